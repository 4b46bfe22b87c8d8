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
