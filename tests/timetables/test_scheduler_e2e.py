"""End to end: real ``airflow scheduler`` x2 + ``dag-processor`` (LocalExecutor, PostgreSQL metadata).

A per-minute DAG on ``CappedCatchupTimetable(max_backfill=3)`` with three leased tasks (three lease
keys) whose last run is several slots in the past, with the next run Airflow stored *before* the outage
still in ``DagModel`` (the trap). Two schedulers share the metadata database (Airflow HA; issue 12 item
2). After start:

* exactly the newest 3 slots run, then normal per-minute runs; the stored stale slot never runs;
* every task of the 3 kept runs succeeds: none is skipped for overlap (the kept runs run one at a time,
  ``max_active_runs=1`` as the timetable requires; issue 10 item 12);
* the first caught-up run records the skipped slots once in the event ledger although the scheduler that
  starts the run (the plugin's listener, issue 38 item 9) and three leased tasks with different keys all
  write the record, and ``scheduled.skipped_catchup`` reaches statsd once with the same count (issue 10
  item 11).

LocalExecutor cannot run on SQLite in Airflow 3, so the test copies a throwaway database from the
session's migrated metadata template on the suite's PostgreSQL (``metadata_template``) and drops it
afterwards. Tasks reach the scheduler through the
execution API, so an ``airflow api-server --apps execution`` runs too. Every process is started in its
own session and stopped by its process group id, also when the test fails.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from demo.deployment import MetadataTemplate, drop_database, free_port, warm_execution_api
from tests.pg import execute

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(600)]

DAG_ID = "capped_catchup_e2e"
CAP = 3
OUTAGE_SLOTS = 9
TASKS = ("fetch", "render", "publish")
LEDGER_SCHEMA = "lease_e2e"
AIRFLOW = str(Path(sys.executable).parent / "airflow")

DAG_FILE = f'''
from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG, task

from airflow_lease_provider.timetables import CappedCatchupTimetable

with DAG(
    dag_id="{DAG_ID}",
    schedule=CappedCatchupTimetable("* * * * *", max_backfill={CAP}),
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=True,
    max_active_runs=1,  # CappedCatchupTimetable(max_backfill > 1) requires it: kept runs one at a time
):
    # Three leased tasks with three keys, no dependencies: they start together, and each records the
    # catch-up (LeasedOperator does) at the same time. Each holds its lease a few seconds, so kept runs
    # that ran together would find each other's leases held and be skipped.
    for name in {TASKS!r}:

        @task.leased(task_id=name, lease_key=f"{DAG_ID}-{{name}}", lease_ttl=pendulum.duration(seconds=60))
        def work():
            import time

            time.sleep(4)

        work()
'''

# Runs in a subprocess with the test's Airflow environment: the state a scheduler leaves behind when it
# stops right after creating the run for slot T0. It stored the next slot, T0 + 1 minute.
SEED = """
import sys
import pendulum
from airflow.models.dag import DagModel
from airflow.models.serialized_dag import SerializedDagModel
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState
from airflow.utils.types import DagRunTriggeredByType, DagRunType

t0 = pendulum.parse(sys.argv[1])
minute = pendulum.duration(minutes=1)
with create_session() as session:
    dag = SerializedDagModel.get_dag(sys.argv[2], session=session)
    dag.create_dagrun(
        run_id=f"scheduled__{t0.isoformat()}",
        logical_date=t0 - minute,
        data_interval=(t0 - minute, t0),
        run_after=t0,
        run_type=DagRunType.SCHEDULED,
        triggered_by=DagRunTriggeredByType.TIMETABLE,
        state=DagRunState.SUCCESS,
        session=session,
    )
    model = session.get(DagModel, sys.argv[2])
    model.is_paused = False
    model.next_dagrun = t0
    model.next_dagrun_data_interval = (t0, t0 + minute)
    model.next_dagrun_create_after = t0 + minute
"""

def _heartbeating_schedulers(dsn: str) -> int:
    """The scheduler jobs running with a heartbeat in the last 60 s, read from the metadata database's ``job``
    table (what ``Job`` maps: ``job_type``, ``state``, ``latest_heartbeat``). A query, not a Python process
    importing Airflow's models for it (7.6 CPU s by process accounting)."""
    recent = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=60)
    ((count,),) = execute(
        dsn,
        "SELECT count(*) FROM job WHERE job_type = 'SchedulerJob' AND state = 'running' AND latest_heartbeat >= %s",
        (recent,),
    )
    return int(count)


@pytest.fixture
def metadata_dsn(metadata_template: MetadataTemplate) -> Iterator[str]:
    """A PostgreSQL database for Airflow's metadata (and the ledger), copied from the session's migrated
    template (``CREATE DATABASE ... TEMPLATE``), dropped afterwards."""
    probe = subprocess.run([AIRFLOW, "version"], capture_output=True, text=True, timeout=120, check=False)
    if probe.returncode != 0 and "get_provider_info" in probe.stderr:
        pytest.skip("airflow_lease_provider.get_provider_info is missing, so the airflow CLI cannot start")
    name, dsn = metadata_template.copy()
    try:
        yield dsn
    finally:
        drop_database(metadata_template.admin_dsn, name)


class StatsdListener:
    """Collects the statsd lines Airflow sends over UDP."""

    def __init__(self) -> None:
        self.port = free_port(socket.SOCK_DGRAM)
        self.lines: list[str] = []
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", self.port))
        self._socket.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                self.lines.extend(self._socket.recv(65535).decode(errors="replace").splitlines())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()


class Processes:
    """Airflow processes started by this test, each in its own session, stopped by process group id."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []

    def _run(self, argv: list[str], timeout: float) -> str:
        result = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if result.returncode != 0:
            raise AssertionError(f"{argv[:3]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result.stdout

    def run(self, *args: str, timeout: float = 300) -> str:
        """Run an ``airflow`` CLI command to completion."""
        return self._run([AIRFLOW, *args], timeout)

    def python(self, code: str, *args: str) -> str:
        """Run Python code with this Airflow's environment (its config and metadata database)."""
        return self._run([sys.executable, "-c", code, *args], timeout=120)

    def start(self, name: str, *args: str) -> None:
        log = (self.logs / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [AIRFLOW, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.started.append(process)

    def stop(self) -> None:
        """SIGTERM each started process group, then SIGKILL what is left after 30 s."""
        for process in reversed(self.started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for process in reversed(self.started):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)

    def tails(self) -> str:
        return "\n".join(
            f"--- {path.name} ---\n{path.read_text(errors='replace')[-4000:]}"
            for path in sorted(self.logs.glob("*.log"))
        )


@pytest.fixture
def airflow(tmp_path: Path, metadata_dsn: str) -> Iterator[tuple[Processes, StatsdListener]]:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "capped_e2e.py").write_text(textwrap.dedent(DAG_FILE))
    logs = tmp_path / "process-logs"
    logs.mkdir()
    statsd = StatsdListener()
    api_port = free_port()
    sql_alchemy = metadata_dsn.replace("postgresql://", "postgresql+psycopg2://", 1)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "AIRFLOW_HOME": str(tmp_path / "home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{api_port}/execution/",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sql_alchemy,
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",  # a changed file is parsed again anyway (mtime)
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
        "AIRFLOW__METRICS__STATSD_ON": "True",
        "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__STATSD_PORT": str(statsd.port),
        "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
        "LEASE_E2E_DSN": metadata_dsn,
        # The leased tasks' store: the lease_default connection, in the ledger schema.
        "AIRFLOW_CONN_LEASE_DEFAULT": metadata_dsn,
        "AIRFLOW__LEASE__SCHEMA": LEDGER_SCHEMA,
    }
    processes = Processes(env, logs)
    try:
        yield processes, statsd
    finally:
        processes.stop()
        statsd.close()


def _minute_floor(moment: datetime.datetime) -> datetime.datetime:
    return moment.replace(second=0, microsecond=0)


def _iso(moment: datetime.datetime | None) -> str | None:
    return moment.astimezone(datetime.timezone.utc).isoformat() if moment is not None else None


def _runs(processes: Processes) -> list[dict[str, Any]]:
    """The DAG's runs and their task instances' states, oldest first, read from the metadata database.

    A query, not a Python process importing Airflow's models: polled every few seconds, that process cost
    about 2 CPU seconds a time, most of this test's CPU on a machine the rest of the suite shares.
    """
    dsn = processes.env["LEASE_E2E_DSN"]
    tasks: dict[str, dict[str, str]] = {}
    for run_id, task_id, state in execute(
        dsn, "SELECT run_id, task_id, state FROM task_instance WHERE dag_id = %s", (DAG_ID,)
    ):
        tasks.setdefault(str(run_id), {})[str(task_id)] = str(state)
    runs = execute(
        dsn,
        "SELECT run_id, run_type, state, data_interval_end, queued_at, start_date, end_date"
        " FROM dag_run WHERE dag_id = %s ORDER BY logical_date",
        (DAG_ID,),
    )
    return [
        {"run_id": run_id, "type": run_type, "state": str(state), "end": _iso(end),
         "queued_at": _iso(queued_at), "start": _iso(start), "finish": _iso(finish),
         "tasks": tasks.get(str(run_id), {})}
        for run_id, run_type, state, end, queued_at, start, finish in runs
    ]


def test_scheduler_runs_only_the_newest_slots_after_an_outage(
    airflow: tuple[Processes, StatsdListener],
) -> None:
    processes, statsd = airflow
    try:
        _check_capped_catch_up(processes, statsd)
    except BaseException:
        print(processes.tails())  # pytest shows it with the failure
        raise


def _check_capped_catch_up(processes: Processes, statsd: StatsdListener) -> None:
    processes.run("dags", "reserialize")  # the metadata database is migrated (a copy of the template)
    from airflow_lease_provider.core import LeaseStore

    with LeaseStore(processes.env["LEASE_E2E_DSN"], schema=LEDGER_SCHEMA) as store:
        store.ensure_schema()  # once, before three runs' tasks would race to create it

    # The execution API first, and ready: a task that cannot reach it fails before it starts.
    api_url = processes.env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"]
    api_port = api_url.rsplit(":", 1)[1].split("/")[0]
    processes.start("api-server", "api-server", "--apps", "execution", "--port", api_port)
    warm_execution_api(api_url.rsplit("/execution", 1)[0], timeout=180)

    # Start a few seconds into a minute, so that the newest slots cannot change while they are created.
    while not 3 <= datetime.datetime.now(datetime.timezone.utc).second <= 20:
        time.sleep(0.5)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = _minute_floor(started) - datetime.timedelta(minutes=OUTAGE_SLOTS)
    processes.python(SEED, t0.isoformat(), DAG_ID)

    # The scheduler first, alone: it finds the stored pre-outage run and must not create it. Then a
    # second scheduler on the same metadata database (HA): together they create each run once.
    processes.start("scheduler", "scheduler", "--skip-serve-logs")
    time.sleep(15)
    processes.start("scheduler-2", "scheduler", "--skip-serve-logs")
    processes.start("dag-processor", "dag-processor")

    # Wait for the catch-up runs and one normal run after them to finish.
    deadline = time.monotonic() + 300
    while True:
        runs = [r for r in _runs(processes) if r["run_id"] != f"scheduled__{t0.isoformat()}"]
        done = [r for r in runs if r["state"] == "success"]
        if len(done) >= CAP + 1 or time.monotonic() > deadline:
            break
        assert not any(r["state"] == "failed" for r in runs), runs
        time.sleep(3)

    # Both schedulers were up and heartbeating all along (Airflow HA on one metadata database).
    assert _heartbeating_schedulers(processes.env["LEASE_E2E_DSN"]) == 2, processes.tails()
    ends = [datetime.datetime.fromisoformat(r["end"]) for r in runs]
    # The newest due slot when the first kept run was created: the minute the test started, unless the
    # schedulers took past the minute's end to start (a loaded machine); either way the cap counts from it.
    assert runs and runs[0]["queued_at"], runs
    newest_due = _minute_floor(datetime.datetime.fromisoformat(runs[0]["queued_at"]))
    assert newest_due >= _minute_floor(started), runs
    expected_catch_up = [newest_due - datetime.timedelta(minutes=CAP - 1 - i) for i in range(CAP)]
    assert all(r["type"] == "scheduled" for r in runs), runs
    # Exactly the newest CAP slots, then consecutive normal runs: the stored slot T0 + 1 never ran.
    assert ends[:CAP] == expected_catch_up, runs
    assert ends == [expected_catch_up[0] + datetime.timedelta(minutes=i) for i in range(len(ends))], runs
    assert len(done) >= CAP + 1, runs
    # Every task of every kept run ran and succeeded: none was skipped for overlap ...
    for run in runs[:CAP]:
        assert run["tasks"] == dict.fromkeys(TASKS, "success"), runs
    # ... because the kept runs ran one after the other.
    kept = [
        (datetime.datetime.fromisoformat(r["start"]), datetime.datetime.fromisoformat(r["finish"]))
        for r in runs[:CAP]
    ]
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(kept)), runs

    # The first caught-up run recorded the skip once in the ledger: the scheduler that started it writes
    # it as the run starts, keyed by the DAG id; the three leased tasks find it written (one of them writes
    # it, keyed by its lease key, only if it reached the store first) ...
    skipped = round((expected_catch_up[0] - t0) / datetime.timedelta(minutes=1)) - 1
    assert skipped >= OUTAGE_SLOTS - CAP, (skipped, runs)
    store = LeaseStore(processes.env["LEASE_E2E_DSN"], schema=LEDGER_SCHEMA)
    try:
        events = store.events.query(kind="skipped_catchup")
    finally:
        store.close()
    assert len(events) == 1, events
    assert events[0].key in {DAG_ID} | {f"{DAG_ID}-{name}" for name in TASKS}, events
    assert events[0].detail["count"] == skipped
    assert events[0].detail["run_id"] == runs[0]["run_id"]
    # ... in the log of whichever wrote it (a scheduler's, or a task's of that run), once ...
    logs = [*Path(processes.env["AIRFLOW_HOME"], "logs").rglob("*.log"), *processes.logs.glob("scheduler*.log")]
    warnings = [
        line
        for path in logs
        for line in path.read_text(errors="replace").splitlines()
        if f"catch-up: {skipped} older slots of {DAG_ID}" in line
    ]
    assert len(warnings) == 1, warnings
    job = events[0].key
    assert f"older slots of {job} skipped" in warnings[0], (warnings, job)
    # ... and in the metric.
    metric = [line for line in statsd.lines if "scheduled.skipped_catchup" in line]
    assert metric == [f"airflow.scheduled.skipped_catchup:{skipped}|c"], metric
