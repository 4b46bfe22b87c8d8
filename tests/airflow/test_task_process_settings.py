"""The embedded-store decision in a task process, where Airflow hides the metadata database's URL.

Airflow's supervisor calls ``block_orm_access()`` in every task process: ``[database] sql_alchemy_conn``
becomes ``airflow-db-not-allowed:///``. Read naively, every task then saw "not SQLite", refused the
embedded store and failed with ``LeaseConnectionMissing`` on ``airflow standalone``: the README's demo
failed in its first scene. Each case runs in a fresh process (its exec environment is what
``/proc/self/environ`` shows, as for a scheduler or worker) and calls Airflow's own ``block_orm_access``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json
from airflow.sdk.execution_time.supervisor import block_orm_access
from airflow_lease_provider import settings
from airflow_lease_provider.version_compat import conf
block_orm_access()
print(json.dumps({"seen": conf.get("database", "sql_alchemy_conn"),
                  "sqlite": settings.metadata_on_sqlite(), "embedded": settings.embedded_allowed()}))
"""


def probe(home: Path, cfg: str | None, **env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    base.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__EXECUTOR="LocalExecutor", **env)
    if cfg is not None:
        (home / "airflow.cfg").write_text(cfg)
    out = subprocess.run([sys.executable, "-c", PROBE], env=base, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sqlite_from_the_config_file_still_allows_the_embedded_store(tmp_path: Path) -> None:
    seen = probe(tmp_path, f"[database]\nsql_alchemy_conn = sqlite:///{tmp_path}/airflow.db\n")
    assert str(seen["seen"]).startswith("airflow-db-not-allowed")  # Airflow did hide it
    assert seen == {**seen, "sqlite": True, "embedded": True}


def test_airflows_default_metadata_is_sqlite(tmp_path: Path) -> None:
    assert probe(tmp_path, None)["embedded"] is True


@pytest.mark.parametrize("where", ["env", "file"])
def test_postgres_metadata_refuses_it_wherever_it_was_set(tmp_path: Path, where: str) -> None:
    url = "postgresql+psycopg2://airflow@db.example:5432/airflow"
    if where == "env":  # the file says SQLite, the environment the worker was started with overrides it
        seen = probe(tmp_path, "[database]\nsql_alchemy_conn = sqlite:////tmp/x.db\n",
                     AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=url)
    else:
        seen = probe(tmp_path, f"[database]\nsql_alchemy_conn = {url}\n")
    assert seen["sqlite"] is False and seen["embedded"] is False


def test_a_url_from_a_command_is_unknown_and_refuses_it(tmp_path: Path) -> None:
    seen = probe(tmp_path, "[database]\nsql_alchemy_conn = sqlite:////tmp/x.db\n",
                 AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_CMD="echo sqlite:////tmp/x.db")
    assert seen["sqlite"] is False and seen["embedded"] is False
