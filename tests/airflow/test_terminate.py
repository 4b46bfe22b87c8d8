"""A leased task told to stop (SIGTERM) stops its body and releases its lease before the SIGKILL.

Airflow 3's task runner answers SIGTERM (a task marked failed or success, or cleared, while it runs; a
worker shutting down) by calling the operator's ``on_kill`` and nothing more; the supervisor sends SIGKILL
5 s later. Seen on a LocalExecutor deployment (Airflow 3.3.2): a running leased task marked failed through
the REST API was killed holding its lease, and the next run of the job was skipped for the rest of the TTL.
Here a real process runs the operator with the task runner's SIGTERM handler in place (it calls
``on_kill`` and returns, as ``airflow.sdk.execution_time.task_runner.run`` installs it), against the real
store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import psycopg2
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import EventKind, LeaseStore
from tests.pg import execute

pytestmark = pytest.mark.airflow

CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from datetime import timedelta
    from pathlib import Path
    from airflow.providers.standard.operators.python import PythonOperator
    from airflow_lease_provider.operators import LeasedOperator
    from tests.airflow.test_semantics import RUN, TaskInstance, run_task

    markers = Path(sys.argv[1])

    def body():
        (markers / "started").write_text("")
        for _ in range(600):
            time.sleep(0.1)
        (markers / "body-finished").write_text("")

    op = LeasedOperator.wrap(PythonOperator)(
        task_id="load", python_callable=body, lease_key="term-key", lease_ttl=timedelta(minutes=10)
    )
    op.on_kill = lambda: (markers / "on_kill").write_text("")
    ti = TaskInstance("etl", RUN, "load")
    if len(sys.argv) > 2 and sys.argv[2] == "slow-xcom":
        # The window between the acquire and the body: the XCom push (an API call in Airflow 3; pushed with
        # [lease] push_lease_xcom = true, set by _child for this case) takes 3 s.
        push = ti.xcom_push

        def slow_push(key, value):
            (markers / "pushing").write_text("")
            time.sleep(3)
            push(key, value)

        ti.xcom_push = slow_push
    if "slow-store" in sys.argv[2:]:
        # Before the acquire: the store's connection lookup (an API call in Airflow 3) takes 3 s.
        from airflow_lease_provider.hooks import LeaseHook

        get_task_store = LeaseHook.get_task_store

        def slow_store(self, idle_close):
            (markers / "storing").write_text("")
            time.sleep(3)
            return get_task_store(self, idle_close)

        LeaseHook.get_task_store = slow_store
    if "raising-on-kill" in sys.argv[2:]:
        def on_kill():  # one that assumes the body started
            (markers / "on_kill").write_text("")
            raise AttributeError("on_kill: nothing started yet")

        op.on_kill = on_kill

    def _on_term(signum, frame):  # the task runner's handler: on_kill, and the body goes on
        op.on_kill()

    signal.signal(signal.SIGTERM, _on_term)
    (markers / "ready").write_text("")  # imported and set up (tens of seconds on a loaded machine)
    try:
        run_task(op, ti)
    except BaseException as exc:
        (markers / "raised").write_text(type(exc).__name__)
        raise
    """
)


def _child(markers: Path, pg_dsn: str, schema: str, *args: str) -> subprocess.Popen[str]:
    env = dict(
        os.environ,
        AIRFLOW_CONN_LEASE_DEFAULT=pg_dsn,
        AIRFLOW__LEASE__SCHEMA=schema,
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        PYTHONPATH=str(Path(__file__).parents[2]),
    )
    if "slow-xcom" in args:  # the lease XCom is what is slow there: pushed only when enabled
        env["AIRFLOW__LEASE__PUSH_LEASE_XCOM"] = "true"
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(markers), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(child: subprocess.Popen[str], marker: Path) -> None:
    # Bounded by the child's life (it fails if the child exits) and the test's timeout; the child's
    # Airflow imports alone take tens of seconds when the machine is loaded.
    end = time.monotonic() + 240
    while not marker.exists():
        assert child.poll() is None, child.stdout.read() if child.stdout else ""
        assert time.monotonic() < end, f"{marker.name} never came"
        time.sleep(0.05)


def _terminate_wait(store: LeaseStore, message: str) -> None:
    """The lease must be free before the supervisor's SIGKILL, 5 s after its SIGTERM."""
    deadline = time.monotonic() + 5
    while store.holder("term-key") is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.holder("term-key") is None, message


def _terminate_and_wait_released(child: subprocess.Popen[str], store: LeaseStore, message: str) -> None:
    """SIGTERM the task process; the lease must be free before the supervisor's SIGKILL."""
    child.send_signal(signal.SIGTERM)
    _terminate_wait(store, message)
    child.wait(timeout=30)


def _reap(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        child.kill()
        child.wait()


def test_sigterm_between_the_acquire_and_the_body_gives_the_lease_back_and_never_starts_the_body(
    pg_dsn: str, schema: str, store: LeaseStore, tmp_path: Path
) -> None:
    """SIGTERM while the task got ready to run (here its XCom push): before, the task runner's handler ran
    ``on_kill`` and the body then started anyway, holding the lease until the SIGKILL, and the lease stayed
    held for its whole TTL (10 minutes here)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    child = _child(markers, pg_dsn, schema, "slow-xcom")
    try:
        _wait_for(child, markers / "pushing")
        held = store.holder("term-key")
        assert held is not None and held.owner.endswith("/load")
        _terminate_and_wait_released(child, store, "SIGTERM before the body left the lease held for its TTL")
    finally:
        _reap(child)
    output = child.stdout.read() if child.stdout else ""
    assert (markers / "on_kill").exists(), output  # the task runner's handler still ran
    assert not (markers / "started").exists(), "the body started after SIGTERM"
    assert (markers / "raised").read_text() == "TaskTerminated", output
    assert child.returncode != 0


def test_sigterm_before_the_acquire_never_takes_the_lease(
    pg_dsn: str, schema: str, store: LeaseStore, tmp_path: Path
) -> None:
    """SIGTERM while the task looks up its store (before the acquire): it stops without taking the lease.
    Before, the task runner's handler ran ``on_kill``, then the task acquired and ran its body anyway."""
    markers = tmp_path / "markers"
    markers.mkdir()
    child = _child(markers, pg_dsn, schema, "slow-store")
    try:
        _wait_for(child, markers / "storing")
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
    finally:
        _reap(child)
    output = child.stdout.read() if child.stdout else ""
    assert (markers / "raised").read_text() == "TaskTerminated", output
    assert not (markers / "started").exists(), "the body started after SIGTERM"
    assert store.lease("term-key") is None, "the lease was taken after SIGTERM"  # never acquired at all


def test_sigterm_during_the_acquire_with_an_on_kill_that_raises_still_gives_the_lease_back(
    pg_dsn: str, schema: str, store: LeaseStore, tmp_path: Path
) -> None:
    """The acquire waits on a row lock; SIGTERM comes; the wrapped operator's ``on_kill`` raises (it assumed
    the body had started). Python runs the handler as soon as the acquire returns, after the grant
    committed: before, its exception escaped there and nothing released the 10-minute lease."""
    store.ensure_schema()
    stale = store.acquire("term-key", "an-old-run", timedelta(seconds=1))
    assert stale is not None
    time.sleep(1.2)  # expired: the task's acquire will UPDATE the row, and wait for its lock
    blocker = psycopg2.connect(pg_dsn)
    markers = tmp_path / "markers"
    markers.mkdir()
    child = None
    try:
        with blocker.cursor() as cur:
            cur.execute(sql.SQL("SELECT 1 FROM {}.lease WHERE key = 'term-key' FOR UPDATE").format(
                sql.Identifier(schema)))
        child = _child(markers, pg_dsn, schema, "raising-on-kill")
        # The 60 s are for the acquire to reach the lock, not for the child's Airflow imports before it.
        _wait_for(child, markers / "ready")
        wait_until_waiting = time.monotonic() + 60
        # This task's acquire (its statement names this test's schema), not another test's session.
        while not execute(pg_dsn, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                  "AND pid <> pg_backend_pid() AND strpos(query, %s) > 0", (schema,)):
            assert child.poll() is None, child.stdout.read() if child.stdout else ""
            assert time.monotonic() < wait_until_waiting, "the task's acquire never waited on the row lock"
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        blocker.commit()  # the acquire goes through: the grant commits, then the handler runs
        child.wait(timeout=60)
    finally:
        blocker.close()
        if child is not None:
            _reap(child)
    output = child.stdout.read() if child.stdout else ""
    assert store.holder("term-key") is None, f"the lease taken during SIGTERM stayed held for its TTL:\n{output}"
    assert (markers / "on_kill").exists(), output
    assert (markers / "raised").read_text() == "TaskTerminated", output
    assert not (markers / "started").exists(), "the body started after SIGTERM"
    lease = store.lease("term-key")
    assert lease is not None and lease.owner.endswith("/load") and lease.released_at is not None, lease


def test_sigterm_stops_the_body_and_releases_the_lease(
    pg_dsn: str, schema: str, store: LeaseStore, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    child = _child(markers, pg_dsn, schema)
    try:
        _wait_for(child, markers / "started")
        held = store.holder("term-key")
        assert held is not None and held.owner.endswith("/load")

        _terminate_and_wait_released(child, store, "SIGTERM left the lease held (the next run would skip for the TTL)")
    finally:
        _reap(child)
    output = child.stdout.read() if child.stdout else ""
    assert (markers / "on_kill").exists(), output  # the wrapped operator's on_kill still runs first
    assert (markers / "raised").read_text() == "TaskTerminated", output
    assert not (markers / "body-finished").exists(), "the body went on after SIGTERM"
    assert child.returncode != 0
    released = store.events.query(key="term-key", kind=EventKind.RELEASED)
    assert len(released) == 1 and released[0].owner.endswith("/load")
