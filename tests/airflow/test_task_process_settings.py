"""The embedded-store decision in a task process, where Airflow hides the metadata database's URL.

Airflow's supervisor calls ``block_orm_access()`` in every process it forks to run user code:
``[database] sql_alchemy_conn`` becomes ``airflow-db-not-allowed:///``. Read naively, every task then
saw "not SQLite", refused the embedded store and failed with ``LeaseConnectionMissing`` on ``airflow
standalone``: the README's demo failed in its first scene. The task process now learns the fact from
the Airflow component that started it: the plugin's listener records it when the component's job is
created (``Job()``, as the scheduler, triggerer and dag-processor do before they start anything), and
the task process inherits it.

Each case runs in a fresh process that plays a component (``Job()`` or not), then forks the task
process as the supervisor does (fork, ``block_orm_access()``, then the task runner's own
``on_starting``), which reports what it decided.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, os, sys
from airflow_lease_provider import settings
if sys.argv[1] == "component":
    from airflow.jobs.job import Job
    Job()  # what `airflow scheduler` / `airflow triggerer` / `airflow dag-processor` create first
read, write = os.pipe()
if os.fork() == 0:  # the task process, as the supervisor starts it
    from airflow.sdk.execution_time.supervisor import block_orm_access
    from airflow.sdk.execution_time.task_runner import TaskRunnerMarker
    from airflow.sdk.listener import get_listener_manager
    from airflow_lease_provider.version_compat import AirflowNotFoundException, conf
    from airflow_lease_provider.hooks import lease as hook
    block_orm_access()
    get_listener_manager().hook.on_starting(component=TaskRunnerMarker())
    seen = {"seen": conf.get("database", "sql_alchemy_conn"), "metadata": settings.metadata_database(),
            "embedded": settings.embedded_allowed(), "error": None}
    if not seen["embedded"]:
        def missing(conn_id):  # what the supervisor answers for a connection no one defined
            raise AirflowNotFoundException(conn_id)
        hook._get_connection = missing
        try:
            hook.resolve(None)
        except hook.LeaseConnectionMissing as exc:
            seen["error"] = str(exc)
    os.write(write, json.dumps(seen).encode())
    os._exit(0)
os.close(write)
print(os.read(read, 1 << 16).decode())
"""


def probe(home: Path, cfg: str | None, component: bool = True, **env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
    base.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__EXECUTOR="LocalExecutor", **env)
    if cfg is not None:
        (home / "airflow.cfg").write_text(cfg)
    argv = [sys.executable, "-c", PROBE, "component" if component else "none"]
    out = subprocess.run(argv, env=base, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


POSTGRES = "postgresql+psycopg2://airflow:s3cret@db.example:5432/airflow"


def test_sqlite_from_the_config_file_still_allows_the_embedded_store(tmp_path: Path) -> None:
    seen = probe(tmp_path, f"[database]\nsql_alchemy_conn = sqlite:///{tmp_path}/airflow.db\n")
    assert str(seen["seen"]).startswith("airflow-db-not-allowed")  # Airflow did hide it
    assert seen == {**seen, "metadata": "sqlite", "embedded": True}


def test_airflows_default_metadata_is_sqlite(tmp_path: Path) -> None:
    assert probe(tmp_path, None)["embedded"] is True


@pytest.mark.parametrize("where", ["env", "file", "command"])
def test_postgres_metadata_refuses_it_wherever_it_was_set(tmp_path: Path, where: str) -> None:
    sqlite_file = "[database]\nsql_alchemy_conn = sqlite:////tmp/x.db\n"
    if where == "env":  # the file says SQLite, the environment the component was started with overrides it
        seen = probe(tmp_path, sqlite_file, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=POSTGRES)
    elif where == "command":  # a _cmd source: the component's Airflow runs it, as for itself
        seen = probe(tmp_path, sqlite_file, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_CMD=f"echo {POSTGRES}")
    else:
        seen = probe(tmp_path, f"[database]\nsql_alchemy_conn = {POSTGRES}\n")
    assert seen["metadata"] == "other" and seen["embedded"] is False
    error = str(seen["error"])
    assert "metadata database is not SQLite" in error and "AIRFLOW_CONN_LEASE_DEFAULT" in error
    assert "s3cret" not in error and "db.example" not in error  # the fact only, never the URL


def test_a_task_process_no_component_started_refuses_it_and_says_why(tmp_path: Path) -> None:
    # Nothing recorded the fact (no scheduler or triggerer started this process): unknown is not SQLite.
    seen = probe(tmp_path, f"[database]\nsql_alchemy_conn = sqlite:///{tmp_path}/airflow.db\n", component=False)
    assert seen["metadata"] == "unknown" and seen["embedded"] is False
    error = str(seen["error"])
    assert "not known whether Airflow's metadata database is SQLite" in error
    assert "AIRFLOW_CONN_LEASE_DEFAULT" in error and "[lease] embedded = true" in error


def test_a_component_records_its_own_configuration_over_an_inherited_record(tmp_path: Path) -> None:
    # A scheduler restarted on PostgreSQL from a shell that inherited an old record ("sqlite"): its
    # tasks follow its configuration, not the record it was started with.
    seen = probe(tmp_path, f"[database]\nsql_alchemy_conn = {POSTGRES}\n", _AIRFLOW_LEASE_METADATA_DATABASE="sqlite")
    assert seen["metadata"] == "other" and seen["embedded"] is False


def test_the_explicit_setting_still_decides_in_a_task_process(tmp_path: Path) -> None:
    sqlite_file = f"[database]\nsql_alchemy_conn = sqlite:///{tmp_path}/airflow.db\n"
    assert probe(tmp_path, sqlite_file, AIRFLOW__LEASE__EMBEDDED="false")["embedded"] is False
    forced = probe(tmp_path, f"[database]\nsql_alchemy_conn = {POSTGRES}\n", AIRFLOW__LEASE__EMBEDDED="true")
    assert forced["embedded"] is True
