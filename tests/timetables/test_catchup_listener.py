"""The scheduler-side catch-up record (issue 38 item 9): the plugin's ``on_dag_run_running`` listener.

Called in this process as the scheduler calls it, with a run Airflow is starting, on the real PostgreSQL: it records once, the leased task's record after it
writes nothing, and the scheduler's call never waits for the store nor raises, whether the store refuses
connections, never answers, or is not configured. A store that comes back gets the record. The real
scheduler runs it in ``tests/timetables/test_scheduler_moves_e2e.py`` and ``test_scheduler_e2e.py``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk import DAG

from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.plugins import catchup_listener
from airflow_lease_provider.plugins.catchup_listener import CatchUpWriter, LeaseStoreRecorder
from airflow_lease_provider.runtime.catchup import record_skipped_catchup
from airflow_lease_provider.timetables import CappedCatchupTimetable
from airflow_lease_provider.timetables.catchup_record import COALESCED, COALESCED_METRIC, METRIC
from demo.store_proxy import StoreProxy
from tests.pg import scratch_dir
from tests.timetables.test_catchup_record import FakeTI, at

# Hourly, coalesce=True: the kept run covers [03:00, 11:00], standing for the 7 slots ending 04:00 .. 10:00.
COALESCED_RUN = ("scheduled__2025-06-15T03:00:00+00:00", at(2025, 6, 15, 3), at(2025, 6, 15, 11))
FOLDED = 7


def dag(*, coalesce: bool = True) -> DAG:
    return DAG(
        dag_id="articles",
        schedule=CappedCatchupTimetable("0 * * * *", coalesce=coalesce),
        start_date=at(2025, 6, 1),
        catchup=True,
    )


def starting_run(run: tuple[str, Any, Any] = COALESCED_RUN, *, coalesce: bool = True, run_type: str = "scheduled") -> Any:
    """A run as the scheduler hands it to ``on_dag_run_running``: its DAG (deserialized) set on it."""
    run_id, start, end = run
    return SimpleNamespace(
        dag_id="articles", run_id=run_id, run_type=run_type, logical_date=start, data_interval_start=start,
        data_interval_end=end, dag=dag(coalesce=coalesce),
    )


@pytest.fixture
def metrics(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """Every increment of Stats, from any thread (the writer's)."""
    from airflow.sdk.observability.stats import Stats

    calls: list[tuple[str, int | None]] = []
    lock = threading.Lock()

    def incr(stat: str, count: int | None = None, rate: Any = None, *, tags: dict | None = None) -> None:
        with lock:
            calls.append((stat, count))

    monkeypatch.setattr(Stats, "incr", incr)
    return calls


@pytest.fixture
def writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[CatchUpWriter]:
    """A writer of its own in place of the process's (whose store is resolved once), retrying quickly."""
    fresh = CatchUpWriter(first_retry=timedelta(seconds=0.2), last_retry=timedelta(seconds=0.5))
    monkeypatch.setattr(catchup_listener, "WRITER", fresh)
    yield fresh
    fresh.stop()


def lease_default(monkeypatch: pytest.MonkeyPatch, dsn: str, schema: str) -> None:
    """``lease_default`` as a scheduler would have it: the store every hook resolves."""
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", dsn)
    monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", schema)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")


def start(run: Any) -> float:
    """Call the plugin's listener as the scheduler does when it starts ``run`` (through its listener manager,
    which holds it: the first test); how long the call took (s). Called directly: the manager of this
    process also holds Airflow's example listeners, which need a real run."""
    began = time.monotonic()
    catchup_listener.on_dag_run_running(dag_run=run, msg="started")
    return time.monotonic() - began


def records(pg_dsn: str, schema: str, kind: str = COALESCED) -> list[Any]:
    with LeaseStore(pg_dsn, schema=schema, read_only=True) as store:
        return store.events.query(kind=kind)


def test_the_plugin_registers_the_listener_with_airflow() -> None:
    from airflow.listeners.listener import get_listener_manager

    impls = get_listener_manager().hook.on_dag_run_running.get_hookimpls()
    assert catchup_listener in [impl.plugin for impl in impls]


def test_a_starting_run_is_recorded_once_and_a_leased_task_after_it_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, pg_dsn: str, schema: str, writer: CatchUpWriter, metrics: list,
    caplog: pytest.LogCaptureFixture,
) -> None:
    lease_default(monkeypatch, pg_dsn, schema)
    run = starting_run()
    with caplog.at_level(logging.WARNING):
        start(run)
        start(run)  # cleared and started again
        assert writer.idle(30)
    (event,) = records(pg_dsn, schema)
    assert (event.key, event.owner, event.detail["count"]) == ("articles", f"articles/{run.run_id}", FOLDED)
    assert event.run is not None and (event.run.dag_id, event.run.run_id, event.run.task_id) == (
        "articles", run.run_id, None,
    )
    assert event.detail["coalesced_start"] == "2025-06-15T03:00:00+00:00"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("catch-up:")]
    assert lines == [
        "catch-up: 7 missed slots of articles coalesced into this run "
        "(2025-06-15T03:00:00+00:00 to 2025-06-15T11:00:00+00:00)"
    ]
    assert metrics == [(COALESCED_METRIC, FOLDED)]
    # A leased task of the run records it too (its second chance): the ledger has it, so nothing more.
    context = {"dag": run.dag, "dag_run": run, "ti": FakeTI(None)}
    with LeaseStore(pg_dsn, schema=schema) as store:
        folded = record_skipped_catchup(context, ledger=store.events, key="articles-lease")
    assert folded is not None and folded.count == FOLDED
    assert [e.id for e in records(pg_dsn, schema)] == [event.id] and len(metrics) == 1


def test_runs_that_follow_no_gap_and_other_timetables_cost_nothing(
    monkeypatch: pytest.MonkeyPatch, pg_dsn: str, schema: str, writer: CatchUpWriter, metrics: list
) -> None:
    lease_default(monkeypatch, pg_dsn, schema)
    start(starting_run(("scheduled__2025-06-15T11:00:00+00:00", at(2025, 6, 15, 11), at(2025, 6, 15, 12))))
    start(starting_run(run_type="manual"))
    other = starting_run()
    other.dag = DAG(dag_id="articles", schedule="0 * * * *", start_date=at(2025, 6, 1))
    start(other)
    assert writer.idle(5) and writer._thread is None  # nothing was ever queued
    assert metrics == []


def test_a_skip_needs_the_run_before_it_from_the_schedulers_session(
    monkeypatch: pytest.MonkeyPatch, writer: CatchUpWriter, caplog: pytest.LogCaptureFixture
) -> None:
    """A run that is not the scheduler's (no session to read the run before it) records nothing rather
    than a guess (no previous run would count every slot since the start date), and nothing raises."""
    run = starting_run(("scheduled__2025-06-15T11:00:00+00:00", at(2025, 6, 15, 10), at(2025, 6, 15, 11)),
                       coalesce=False)
    with caplog.at_level(logging.WARNING):
        start(run)
    assert writer._thread is None
    assert any("could not work out" in r.getMessage() for r in caplog.records), caplog.records


def test_the_scheduler_never_waits_for_a_store_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, writer: CatchUpWriter, metrics: list, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that accepts connections and never answers (a hung server, a black-holed network): every
    call of the listener returns at once; the writer thread waits out the connect timeout and retries."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes the handshakes; nobody ever reads or answers
    try:
        port = silent.getsockname()[1]
        lease_default(monkeypatch, f"postgresql://postgres@127.0.0.1:{port}/test?connect_timeout=2", "lease_silent")
        with caplog.at_level(logging.WARNING):
            took = [start(starting_run((f"scheduled__{i}", at(2025, 6, 15, 3), at(2025, 6, 15, 11)))) for i in range(20)]
            assert max(took) < 0.5, took
            deadline = time.monotonic() + 30
            while not any("could not record" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, caplog.records
                time.sleep(0.2)
        assert writer._pending or writer._writing  # still trying; nothing reported as recorded
        assert metrics == []
    finally:
        silent.close()


def test_a_store_that_comes_back_gets_the_record(
    monkeypatch: pytest.MonkeyPatch, pg_dsn: str, schema: str, writer: CatchUpWriter, metrics: list,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import psycopg2.extensions

    LeaseStore(pg_dsn, schema=schema).ensure_schema()
    parts = psycopg2.extensions.parse_dsn(pg_dsn)
    proxy = StoreProxy((parts.get("host") or "127.0.0.1", int(parts.get("port") or 5432)))
    try:
        proxy.down()  # refuses the writer's connections
        user, db = parts.get("user") or "postgres", parts.get("dbname") or "test"
        lease_default(monkeypatch, f"postgresql://{user}@127.0.0.1:{proxy.port}/{db}", schema)
        with caplog.at_level(logging.WARNING):
            assert start(starting_run()) < 0.5
            deadline = time.monotonic() + 30
            while sum("could not record" in r.getMessage() for r in caplog.records) < 2:  # tried, and again
                assert time.monotonic() < deadline, caplog.records
                time.sleep(0.1)
            assert records(pg_dsn, schema) == [] and metrics == []
            proxy.up()
            assert writer.idle(30)
    finally:
        proxy.close()
    (event,) = records(pg_dsn, schema)
    assert event.detail["count"] == FOLDED and metrics == [(COALESCED_METRIC, FOLDED)]


def test_a_record_is_given_up_after_the_window_with_its_line_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    writer = CatchUpWriter(lambda catchup: False, first_retry=timedelta(seconds=0.05), give_up=timedelta(seconds=0.3))
    run = starting_run()
    catchup = catchup_listener.catchup_of_run(run.dag, run, lambda: None)
    assert catchup is not None
    with caplog.at_level(logging.WARNING):
        writer.submit(catchup)
        assert writer.idle(10)
    writer.stop()
    (gave_up,) = [r.getMessage() for r in caplog.records if "gave up" in r.getMessage()]
    assert "catch-up: 7 missed slots of articles coalesced into this run" in gave_up, gave_up


def test_a_full_queue_drops_the_record_with_a_warning_and_never_blocks(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    writer = CatchUpWriter(lambda catchup: release.wait(30), max_pending=2)
    run = starting_run()
    catchup = catchup_listener.catchup_of_run(run.dag, run, lambda: None)
    assert catchup is not None
    try:
        with caplog.at_level(logging.WARNING):
            assert [writer.submit(catchup) for _ in range(3)] == [True, True, False]
        assert any("wait for the lease store already" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
    assert writer.idle(10)
    writer.stop()


def test_without_a_lease_connection_the_scheduler_logs_and_counts_and_says_why_once(
    monkeypatch: pytest.MonkeyPatch, metrics: list, caplog: pytest.LogCaptureFixture
) -> None:
    """A distributed executor with no lease connection (a DAG that only uses the timetable): no record, but
    the catch-up line and the metric, and one warning saying why there is no record."""
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_DEFAULT", raising=False)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    writer = CatchUpWriter(LeaseStoreRecorder())
    with caplog.at_level(logging.WARNING):
        for run_id in ("scheduled__a", "scheduled__b"):
            run = starting_run((run_id, at(2025, 6, 15, 3), at(2025, 6, 15, 11)))
            catchup = catchup_listener.catchup_of_run(run.dag, run, lambda: None)
            assert catchup is not None
            writer.submit(catchup)
        assert writer.idle(30)
    writer.stop()
    said = [r.getMessage() for r in caplog.records]
    assert sum("not recorded" in m and "lease_default" in m for m in said) == 1, said
    assert sum(m.startswith("catch-up: 7 missed slots of articles coalesced") for m in said) == 2, said
    assert metrics == [(COALESCED_METRIC, FOLDED)] * 2
    assert METRIC not in [m for m, _ in metrics]


def test_a_child_forked_while_a_thread_starts_the_embedded_store_is_not_stuck() -> None:
    """The scheduler's writer thread may be starting the embedded store (holding its lock) when the
    scheduler forks (a LocalExecutor worker, whose task processes use the store): the child gets a lock of
    its own and attaches to the server itself, instead of waiting forever for a thread it does not have."""
    import os

    from airflow_lease_provider.hooks import lease as hooks

    holding, release = threading.Event(), threading.Event()

    def start_embedded() -> None:
        with hooks._embedded_lock:
            hooks._embedded["/nowhere/lease-postgres"] = "postgresql:///parent"
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=start_embedded)
    thread.start()
    try:
        assert holding.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: exit at once with what it found, never back into pytest
            os._exit(0 if hooks._embedded_lock.acquire(timeout=5) and not hooks._embedded else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join()
        hooks._embedded.pop("/nowhere/lease-postgres", None)
    assert os.waitstatus_to_exitcode(status) == 0


def test_standalone_records_into_the_embedded_store_the_scheduler_starts(
    monkeypatch: pytest.MonkeyPatch, metrics: list
) -> None:
    """``airflow standalone`` as installed (no lease connection, LocalExecutor on SQLite metadata): the
    writer thread starts (or attaches to) the embedded store the hooks resolve there, and records into it."""
    import shutil

    from airflow_lease_provider.core.embedded import EmbeddedPostgres
    from airflow_lease_provider.hooks import lease as hooks

    tmp_path = scratch_dir("lease-catchup-embedded-")  # the server's system user must enter it
    data_dir = tmp_path / "lease-postgres"
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_DEFAULT", raising=False)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{tmp_path / 'airflow.db'}")
    monkeypatch.setenv("AIRFLOW__LEASE__EMBEDDED_DIR", str(data_dir))
    monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", "lease_standalone")
    writer = CatchUpWriter(LeaseStoreRecorder())
    run = starting_run()
    catchup = catchup_listener.catchup_of_run(run.dag, run, lambda: None)
    assert catchup is not None
    try:
        writer.submit(catchup)
        assert writer.idle(180)
        writer.stop()
        dsn = hooks._embedded[str(data_dir)]
        (event,) = records(dsn, "lease_standalone")
        assert (event.key, event.detail["count"]) == ("articles", FOLDED) and metrics == [(COALESCED_METRIC, FOLDED)]
    finally:
        writer.stop()
        if hooks._embedded.pop(str(data_dir), None) is not None:
            # This process is the server's one user: detach (which stops it) instead of at this process's exit.
            server = EmbeddedPostgres(data_dir, on_exit="stop")
            server.start()
            server.cleanup()
        shutil.rmtree(tmp_path, ignore_errors=True)
