"""The built wheel on every supported Airflow (3.1, 3.2, 3.3), each in a fresh venv pinned by its lock.

Per version: the provider, the plugin and the timetable load; the example DAGs import cleanly; and a
smoke through ``airflow dags test`` (a leased task, a leased BashOperator, an overlap skip, a fenced
publish, a fence rejection, metrics through statsd), the same smoke run by real processes (``airflow
standalone``, triggered through the REST API with no logical date), plus the capped catch-up as the
scheduler computes it (``airflow dags next-execution`` on the serialized DAG). ``scripts/compat`` runs
this tier.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import sqlite3
import subprocess
import textwrap

import pytest

from airflow_lease_provider.core import EventKind, FenceStore, LeaseStore
from demo.airflow_api import AirflowAPI, wait
from demo.deployment import free_port
from tests.airflow.harness import StatsdListener
from tests.compat.conftest import Home
from tests.pg import execute, q

pytestmark = [pytest.mark.compat, pytest.mark.slow, pytest.mark.timeout(900)]

DISTRIBUTION = "airflow-lease-provider"
STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00")


def test_the_installed_wheel_is_what_loads(home: Home) -> None:
    out = home.python(
        "import airflow, airflow_lease_provider as p; print(airflow.__version__, p.__version__, p.__file__)"
    ).stdout.split()
    assert out[0] == home.venv.airflow_version
    assert out[2].startswith(str(home.venv.path)), out  # the venv's site-packages, not the checkout


def test_every_name_of_the_compat_module_resolves(home: Home) -> None:
    code = textwrap.dedent(
        """
        import airflow_lease_provider.version_compat as c
        for name in c.__all__:
            value = getattr(c, name)
            print("RESOLVED", name, getattr(value, "__module__", type(value).__module__))
        """
    )
    lines = [line for line in home.python(code).stdout.splitlines() if line.startswith("RESOLVED ")]
    resolved = dict(line.split(" ", 2)[1:] for line in lines)
    import airflow_lease_provider.version_compat as compat

    assert set(resolved) == set(compat.__all__)


def test_providers_list_shows_the_provider(home: Home) -> None:
    providers = home.json_out("providers", "list")
    ours = [p for p in providers if p["package_name"] == DISTRIBUTION]
    assert len(ours) == 1, providers
    from airflow_lease_provider import __version__

    assert ours[0]["version"] == __version__


def test_the_plugin_and_the_timetable_load(home: Home) -> None:
    plugins = home.json_out("plugins")
    lease = [p for p in plugins if p["name"] == "lease"]
    assert len(lease) == 1, plugins
    timetables = lease[0]["timetables"]
    assert any("CappedCatchupTimetable" in str(t) for t in timetables), lease[0]


def test_example_and_smoke_dags_import_cleanly(home: Home) -> None:
    args = ["dags", "list-import-errors", "--local"]
    result = home.airflow(*args, "-o", "json", check=False)
    payload = next((line for line in reversed(result.stdout.splitlines()) if line.startswith("[")), None)
    assert payload == "[]", result.stdout[-4000:] + result.stderr[-4000:]
    listed = home.json_out("dags", "list", "--local")
    ids = {d["dag_id"] for d in listed}
    assert {"article_publisher", "billing_close", "compat_smoke", "compat_fence_rejected", "compat_catchup"} <= ids


def _task_states(home: Home, dag_id: str) -> dict[str, str]:
    conn = sqlite3.connect(home.path / "airflow.db")
    try:
        rows = conn.execute("SELECT task_id, state FROM task_instance WHERE dag_id = ?", (dag_id,)).fetchall()
    finally:
        conn.close()
    return dict(rows)


def _statsd_env(listener: StatsdListener) -> dict[str, str]:
    return {
        "AIRFLOW__METRICS__STATSD_ON": "True",
        "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__STATSD_PORT": str(listener.port),
        "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
    }


def test_smoke_leased_task_overlap_skip_and_fenced_publish(home: Home, pg_dsn: str) -> None:
    store = LeaseStore(pg_dsn, schema=home.schema)
    listener = StatsdListener()
    try:
        held = store.acquire("compat-held", owner="someone-else/run", ttl=datetime.timedelta(minutes=5))
        assert held is not None
        result = home.airflow("dags", "test", "compat_smoke", timeout=600, check=False, **_statsd_env(listener))
        states = _task_states(home, "compat_smoke")
        assert states == {"publish": "success", "bash": "success", "overlapped": "skipped"}, (
            result.stdout[-4000:] + result.stderr[-4000:]
        )
        # The fenced publish wrote its row with the lease's token; the skip is in the ledger.
        rows = execute(pg_dsn, q("SELECT writer, token FROM {schema}.compat_articles", home.schema))
        assert [writer for writer, _ in rows] == ["publish"]
        skipped = store.events.query(key="compat-held", kind=EventKind.SKIPPED_OVERLAP)
        assert len(skipped) == 1
        assert store.holder("compat-held").owner == "someone-else/run"  # the skipped task took nothing
        assert store.holder("compat-publish") is None  # released at the end
        # Metrics are emitted on every supported Airflow (3.1's Stats lives elsewhere than 3.2's).
        listener_deadline = datetime.datetime.now() + datetime.timedelta(seconds=5)
        while listener.count("lease.acquired") < 2 and datetime.datetime.now() < listener_deadline:
            pass
        assert listener.count("lease.acquired") >= 2, listener.packets[-20:]
        assert listener.count("scheduled.skipped_overlap") == 1, listener.packets[-20:]
    finally:
        listener.close()
        store.close()


def test_smoke_a_stale_token_cannot_publish(home: Home, pg_dsn: str) -> None:
    fences = FenceStore(pg_dsn, schema=home.schema)
    store = LeaseStore(pg_dsn, schema=home.schema)
    try:
        # A newer writer already published with a token larger than this lease will get.
        assert fences.advance("compat.zombie", 10**12, key="compat-zombie").accepted
        execute(pg_dsn, q("CREATE TABLE IF NOT EXISTS {schema}.compat_articles (writer text, token bigint)", home.schema))
        result = home.airflow("dags", "test", "compat_fence_rejected", timeout=600, check=False)
        assert _task_states(home, "compat_fence_rejected") == {"late_publish": "failed"}, (
            result.stdout[-4000:] + result.stderr[-4000:]
        )
        # The only fence rejections in this home's schema are this test's.
        rejected = store.events.query(kind=EventKind.FENCE_REJECTED)
        assert len(rejected) >= 1
        rows = execute(pg_dsn, q("SELECT writer FROM {schema}.compat_articles WHERE writer = 'zombie'", home.schema))
        assert rows == []
    finally:
        fences.close()
        store.close()


def test_capped_catch_up_as_the_scheduler_computes_it(home: Home) -> None:
    # The DAG starts on 2026-01-01 with catchup=True, hourly: without the cap the first run would be
    # 2026-01-01T00:00; with max_backfill=2 it is one of the newest two slots.
    home.airflow("dags", "reserialize", timeout=600)
    result = home.airflow("dags", "next-execution", "compat_catchup", "-n", "2")
    # The CLI prints one logical date per line, among Airflow's own log lines.
    stamps = [line.strip() for line in result.stdout.splitlines() if STAMP.fullmatch(line.strip())]
    assert len(stamps) == 2, result.stdout
    first = datetime.datetime.fromisoformat(stamps[0])
    now = datetime.datetime.now(datetime.timezone.utc)
    assert now - datetime.timedelta(hours=3) <= first <= now, stamps


def _scheduler_records_the_catch_up_of_a_timetable_only_dag(home: Home, api: AirflowAPI) -> None:
    """``compat_catchup`` has only the timetable and a plain task. Unpaused, this Airflow's scheduler starts
    its newest 2 hourly slots; the first, the DAG's first run with ``catchup=True``, follows the slots since
    its start date, which the plugin's listener records in that scheduler (issue 38 item 9), read back
    through the ``airflow-lease`` CLI of this venv."""
    api.unpause("compat_catchup")
    runs = wait(lambda: api.runs("compat_catchup"), lambda found: len(found) >= 1, 180, "a run of compat_catchup")
    first = runs[0]

    def recorded() -> list[dict]:
        out = home.run(str(home.venv.bin / "airflow-lease"), "events", "--kind", "skipped_catchup", "--json").stdout
        return [e for e in json.loads(out)["events"] if e["dag_id"] == "compat_catchup"]

    (event,) = wait(recorded, bool, 120, f"the catch-up record of compat_catchup on Airflow {home.venv.airflow_version}")
    start = datetime.datetime.fromisoformat(first["data_interval_start"].replace("Z", "+00:00"))
    since = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)  # compat_smoke.START
    assert (event["key"], event["run_id"], event["task_id"]) == ("compat_catchup", first["dag_run_id"], None), event
    assert event["detail"]["count"] == round((start - since) / datetime.timedelta(hours=1)), (event, first)


def kill_what_is_left(airflow_home: str) -> None:
    """SIGKILL every process still running with this ``AIRFLOW_HOME``: ``airflow standalone`` of Airflow 3.1
    leaves its scheduler running (PPID 1, outside the process group) after it exits on SIGTERM, and it
    then used CPU for the rest of CI (the demo, after this tier)."""
    marker = f"AIRFLOW_HOME={airflow_home}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                found = marker in environ.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)


def test_real_airflow_processes_run_the_smoke_dag_triggered_with_no_logical_date(home: Home, pg_dsn: str) -> None:
    """The door a user walks through: ``airflow standalone`` (scheduler, dag-processor, api-server,
    triggerer) of this Airflow, the run triggered through the REST API with no logical date, the
    outcome read back from Airflow's API and from the ledger."""
    store = LeaseStore(pg_dsn, schema=home.schema)
    port = free_port()
    env = {
        **home.env,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://localhost:{port}",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
    }
    log_path = home.path / "standalone.log"
    passwords = home.path / "simple_auth_manager_passwords.json.generated"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(home.venv.bin / "airflow"), "standalone"], env=env, cwd=home.path, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    probe = AirflowAPI(f"http://localhost:{port}", "admin", "")
    api: AirflowAPI | None = None
    held = None
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"airflow standalone exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            return passwords.exists() and probe.healthy()

        wait(up, bool, 300, f"Airflow {home.venv.airflow_version} standalone to be healthy")
        api = AirflowAPI(f"http://localhost:{port}", "admin", json.loads(passwords.read_text())["admin"])
        wait(api.dag_ids, lambda ids: "compat_smoke" in ids, 180, "compat_smoke to be parsed")
        held = store.acquire("compat-held", owner="someone-else/run", ttl=datetime.timedelta(minutes=5))
        assert held is not None
        before = store.events.query(key="compat-held", kind=EventKind.SKIPPED_OVERLAP)
        api.unpause("compat_smoke")
        run_id = api.trigger("compat_smoke")  # no logical date, as the UI's trigger button sends
        state = api.wait_for_run("compat_smoke", run_id, timeout=300)
        states = api.task_states("compat_smoke", run_id)
        assert (state, states) == ("success", {"publish": "success", "bash": "success", "overlapped": "skipped"}), (
            state, states, log_path.read_text()[-4000:],
        )
        token = api.xcom("compat_smoke", run_id, "publish")
        rows = execute(pg_dsn, q("SELECT writer, token FROM {schema}.compat_articles", home.schema))
        assert ("publish", token) in rows  # the fenced write, with this run's token
        skipped = store.events.query(key="compat-held", kind=EventKind.SKIPPED_OVERLAP)
        assert len(skipped) == len(before) + 1
        assert store.holder("compat-held").owner == "someone-else/run"
        assert store.holder("compat-publish") is None
        _scheduler_records_the_catch_up_of_a_timetable_only_dag(home, api)
    finally:
        probe.close()
        if api is not None:
            api.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        # The LocalExecutor's idle workers stay in the group: they outlive the SIGTERM (it waits for the
        # scheduler's stop message) and ``airflow standalone`` exits without them; once reparented they
        # ran on after CI's run, and kill_what_is_left cannot tell them by their environment (their
        # process title overwrites it).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        kill_what_is_left(env["AIRFLOW_HOME"])
        if held is not None:
            store.release(held)
        store.close()
    # Nothing the test started outlives it (an idle worker and an api-server of each Airflow did, before).
    wait(lambda: not group_alive(proc.pid), bool, 15, f"the processes of airflow standalone ({proc.pid}) to end")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
