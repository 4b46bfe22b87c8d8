"""Leased tasks under a live Airflow: api-server, scheduler, dag-processor, LocalExecutor, PostgreSQL metadata.

One deployment for the module (tests/airflow/live.py) with the DAGs of live_dags/lease_live.py; runs
are triggered through the REST API without a logical date and their task states read back from it.
The lease store is the test's PostgreSQL, in a schema of this module's own.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_lease_provider.core import EventKind, LeaseStore
from demo.deployment import MetadataTemplate
from tests.airflow.live import LiveAirflow, wait_until
from tests.pg import drop_schema, execute, new_schema_name, q, scratch_dir

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

DAGS = Path(__file__).parent / "live_dags"


@pytest.fixture(scope="module")
def live_schema(pg_dsn: str) -> Iterator[str]:
    name = new_schema_name()
    yield name
    drop_schema(pg_dsn, name)


@pytest.fixture(scope="module")
def markers() -> Iterator[Path]:
    root = scratch_dir("lease-live-markers-")
    yield root
    import shutil

    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def live(pg_dsn: str, live_schema: str, markers: Path, metadata_template: MetadataTemplate) -> Iterator[LiveAirflow]:
    root = scratch_dir("lease-live-")
    extra = {
        "LEASE_TEST_MARKERS": str(markers),
        "AIRFLOW__CORE__XCOM_BACKEND": "tests.airflow.refusing_xcom.RefusingXCom",
        # live_xcom_refused fails between the acquire and the body on a refused lease XCom: pushed only
        # with [lease] push_lease_xcom = true (off by default since issue 28).
        "AIRFLOW__LEASE__PUSH_LEASE_XCOM": "true",
        # A frozen task is declared dead (and retried) after this many seconds without a heartbeat.
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
    }
    try:
        with LiveAirflow.create(
            root, DAGS, lease_dsn=pg_dsn, lease_schema=live_schema, extra_env=extra, template=metadata_template
        ) as airflow:
            with LeaseStore(pg_dsn, schema=live_schema) as store:
                store.ensure_schema()  # once, before parallel tasks would race to create it
            airflow.start()
            yield airflow
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def store(pg_dsn: str, live_schema: str) -> Iterator[LeaseStore]:
    with LeaseStore(pg_dsn, schema=live_schema) as leases:
        yield leases


def test_two_leased_tasks_of_one_run_with_one_key_one_is_skipped_none_fails(
    live: LiveAirflow, store: LeaseStore, markers: Path
) -> None:
    live.wait_dag("live_same_key")
    run_id = live.trigger("live_same_key")
    states = wait_until(
        lambda: (s := live.task_states("live_same_key", run_id)) and "skipped" in s.values() and s,
        240, "one of the two tasks to be skipped",
    )
    holder = store.holder("live-shared")
    assert holder is not None, states
    running = next(t for (t, _), state in states.items() if state != "skipped")
    assert holder.owner == f"live_same_key/{run_id}/{running}"
    (markers / "same-key-release").write_text("go")
    assert live.wait_run("live_same_key", run_id) == "success"
    states = live.task_states("live_same_key", run_id)
    assert sorted(states.values()) == ["skipped", "success"], states
    skipped = next(t for (t, _), state in states.items() if state == "skipped")
    assert not (markers / f"same-key-body-{skipped}").exists(), "the skipped task's body ran"
    # Neither lost its lease: the one that ran kept it to the end and released it.
    assert store.events.query(key="live-shared", kind=EventKind.LOST) == []
    skips = store.events.query(key="live-shared", kind=EventKind.SKIPPED_OVERLAP)
    assert [e.owner for e in skips] == [f"live_same_key/{run_id}/{skipped}"]
    assert skips[0].detail["holder_owner"] == holder.owner
    assert store.holder("live-shared") is None


def test_a_retry_of_a_frozen_try_re_enters_and_the_frozen_try_is_fenced_out(
    live: LiveAirflow, store: LeaseStore, markers: Path, pg_dsn: str, live_schema: str
) -> None:
    live.wait_dag("live_retry")
    run_id = live.trigger("live_retry")
    pids = wait_until(lambda: _read(markers / "retry-try1-pids"), 240, "try 1 to take the lease")
    task_pid, supervisor_pid = (int(p) for p in pids.split())
    token1 = int(_read(markers / "retry-try1-token"))
    for pid in (task_pid, supervisor_pid):  # a lost VM, a long GC pause: no renewals, no heartbeats
        os.kill(pid, signal.SIGSTOP)
    try:
        # Airflow declares try 1 dead and starts try 2 of the same task instance; its lease re-enters.
        token2 = int(wait_until(lambda: _read(markers / "retry-try2-token"), 240, "try 2 to start"))
        assert token2 > token1
        assert live.wait_run("live_retry", run_id) == "success"
        (ti,) = live.task_instances("live_retry", run_id)
        assert (ti["state"], ti["try_number"]) == ("success", 2)
        # Try 1 wakes up (the task first, its supervisor later): its keeper finds the lease lost.
        os.kill(task_pid, signal.SIGCONT)
        lost = wait_until(
            lambda: [e for e in store.events.query(key="live-retry", kind=EventKind.LOST) if e.token == token1],
            60, "try 1's keeper to record the loss",
        )
    finally:
        for pid in (task_pid, supervisor_pid):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    (markers / "retry-try1-go").write_text("go")
    wait_until(lambda: not _alive(task_pid), 120, "try 1's process to end")
    assert len(lost) == 1, lost
    rows = execute(pg_dsn, q("SELECT try_number, token FROM {schema}.retry_target", live_schema))
    assert [tuple(r) for r in rows] == [(2, token2)], "only try 2's write may land"
    assert not (markers / "retry-try1-published").exists()
    # One loss: one lease.lost (try 1's), and the task instance is still try 2's success.
    wait_until(lambda: live.statsd.count("lease.lost") >= 1, 30, "the lease.lost metric")
    time.sleep(2)
    assert live.statsd.count("lease.lost") == 1
    (ti,) = live.task_instances("live_retry", run_id)
    assert (ti["state"], ti["try_number"]) == ("success", 2)


def test_a_task_failing_between_the_acquire_and_the_keeper_releases_its_lease(
    live: LiveAirflow, store: LeaseStore, markers: Path
) -> None:
    live.wait_dag("live_xcom_refused")
    run_id = live.trigger("live_xcom_refused")
    assert live.wait_run("live_xcom_refused", run_id) == "failed"
    assert live.task_states("live_xcom_refused", run_id) == {("refused", -1): "failed"}
    assert not (markers / "xcom-refused-body").exists()
    acquired = store.events.query(key="live-xcom", kind=EventKind.ACQUIRED)
    released = store.events.query(key="live-xcom", kind=EventKind.RELEASED)
    assert len(acquired) == 1 and [e.token for e in released] == [acquired[0].token]
    assert store.holder("live-xcom") is None, "the 30-minute lease stayed held after the task failed"


def _read(path: Path) -> str | None:
    try:
        return path.read_text() or None
    except FileNotFoundError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as ended
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False
