"""``idle_close``: a store that holds no server connection between operations (many idle leases)."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest

from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.errors import InvalidArgument
from tests.pg import execute


def _backend_alive(dsn: str, pid: int) -> bool:
    return bool(execute(dsn, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)))


def _wait_gone(dsn: str, pid: int, timeout: float = 3.0) -> float:
    started = time.monotonic()
    while _backend_alive(dsn, pid):
        assert time.monotonic() - started < timeout, f"backend {pid} still connected after {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - started


def _backends(dsn: str, store: LeaseStore) -> int:
    """Server connections this store has open now (by its own application_name)."""
    rows = execute(dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (store.db.application_name,))
    return int(rows[0][0])  # type: ignore[call-overload]


def _none_left(dsn: str, store: LeaseStore, within: float = 1.0) -> bool:
    """No server connection of the store's is left within ``within`` s (a backend exits just after)."""
    deadline = time.monotonic() + within
    while _backends(dsn, store):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _named(store: LeaseStore) -> LeaseStore:
    store.db.application_name = f"lease-idle-{uuid.uuid4().hex[:8]}"
    return store


def test_an_idle_close_store_gives_its_connection_back_between_renewals(pg_dsn: str, schema: str) -> None:
    store = _named(LeaseStore(pg_dsn, schema=schema, idle_close=timedelta(0)))
    try:
        lease = store.acquire("job", "worker-1", timedelta(seconds=10))
        assert lease is not None
        assert _none_left(pg_dsn, store)  # closed as the operation ended
        with store.db.transaction() as cur:  # while an operation runs, it has its connection
            cur.execute("SELECT 1")
            assert _backends(pg_dsn, store) == 1
        assert _none_left(pg_dsn, store)
        before = store.db.connects
        with store.keep(lease, renew_every=timedelta(seconds=0.5)) as keeper:
            time.sleep(2.2)
            assert keeper.renewals >= 3 and not keeper.lost
            assert _none_left(pg_dsn, store)
        # Each renewal (and the release) opened a connection of its own and gave it back.
        assert store.db.connects - before >= 4
        assert _none_left(pg_dsn, store)
        assert store.holder("job") is None  # released on exit
    finally:
        store.close()


def test_a_store_without_idle_close_keeps_its_one_connection(pg_dsn: str, schema: str) -> None:
    store = LeaseStore(pg_dsn, schema=schema)
    try:
        lease = store.acquire("job", "worker-1", timedelta(seconds=10))
        assert lease is not None
        pid = store.db._conn.get_backend_pid()
        time.sleep(1.0)
        assert _backend_alive(pg_dsn, pid)
        assert store.renew(lease) is not None
        assert store.db._conn.get_backend_pid() == pid and store.db.connects == 1
    finally:
        store.close()


def test_idle_close_must_be_a_non_negative_timedelta(pg_dsn: str, schema: str) -> None:
    for bad in (timedelta(seconds=-1), 5):
        with pytest.raises(InvalidArgument, match="idle_close"):
            LeaseStore(pg_dsn, schema=schema, idle_close=bad)  # type: ignore[arg-type]


def test_a_positive_idle_close_keeps_the_connection_for_that_long_then_closes_it(pg_dsn: str, schema: str) -> None:
    store = LeaseStore(pg_dsn, schema=schema, idle_close=timedelta(seconds=1.5))
    try:
        lease = store.acquire("job", "worker-1", timedelta(seconds=10))
        assert lease is not None
        with store.db._lock:
            pid = store.db._conn.get_backend_pid()
        assert store.renew(lease) is not None
        with store.db._lock:
            assert store.db._conn.get_backend_pid() == pid  # reused within the idle time
        started = time.monotonic()
        gone_after = _wait_gone(pg_dsn, pid, timeout=5.0)
        assert 0.8 <= time.monotonic() - started <= 3.0, gone_after
    finally:
        store.close()


def test_the_watchdog_outlives_a_store_whose_idle_close_fails(pg_dsn: str, schema: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One store's failure on the watchdog's tick must not end the thread that bounds every store's waits."""
    broken = _named(LeaseStore(pg_dsn, schema=schema, idle_close=timedelta(seconds=0.2)))
    healthy = _named(LeaseStore(pg_dsn, schema=schema, idle_close=timedelta(seconds=0.2)))
    failures: list[float] = []

    def fail(now: float) -> None:
        failures.append(now)
        raise RuntimeError("closing failed")

    monkeypatch.setattr(broken.db, "_close_if_idle", fail)
    try:
        assert broken.acquire("a", "w", timedelta(seconds=10)) is not None
        deadline = time.monotonic() + 3
        while len(failures) < 2:  # the tick failed, then ran again: the thread lived on
            assert time.monotonic() < deadline, f"the watchdog ticked {len(failures)} times in 3 s"
            time.sleep(0.05)
        assert healthy.acquire("b", "w", timedelta(seconds=10)) is not None
        assert _none_left(pg_dsn, healthy, within=2.0), "the watchdog stopped closing idle connections"
    finally:
        monkeypatch.undo()
        broken.close()
        healthy.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_watchdog_thread_that_died_is_started_again_by_the_next_store(pg_dsn: str, schema: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_lease_provider.core.db import watchdog as watchdog_module

    watchdog = watchdog_module.watchdog
    first = _named(LeaseStore(pg_dsn, schema=schema, idle_close=timedelta(seconds=0.2)))
    assert first.acquire("a", "w", timedelta(seconds=10)) is not None  # the thread runs
    thread = watchdog._thread
    assert thread is not None and thread.is_alive()

    def die(now: float) -> None:
        raise SystemExit  # not an Exception: the tick's guard lets it end the thread

    monkeypatch.setattr(watchdog, "tick", die)
    thread.join(timeout=2)
    assert not thread.is_alive()
    monkeypatch.undo()
    second = _named(LeaseStore(pg_dsn, schema=schema, idle_close=timedelta(seconds=0.2)))
    try:
        assert second.acquire("b", "w", timedelta(seconds=10)) is not None
        assert watchdog._thread is not thread and watchdog._thread is not None and watchdog._thread.is_alive()
        assert _none_left(pg_dsn, second, within=2.0)
        assert _none_left(pg_dsn, first, within=2.0)  # the new thread watches the stores the old one had
    finally:
        first.close()
        second.close()
