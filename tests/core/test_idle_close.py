"""``idle_close``: a store that holds no server connection between operations (many idle leases)."""

from __future__ import annotations

import time
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


def _closed_within(store: LeaseStore, dsn: str) -> float:
    """Seconds until the store's current connection is gone on the server (0 if already dropped)."""
    with store.db._lock:  # the watchdog needs the lock to close it, so the connection is stable here
        conn = store.db._conn
        pid = None if conn is None else conn.get_backend_pid()
    return 0.0 if pid is None else _wait_gone(dsn, pid)


def test_an_idle_close_store_gives_its_connection_back_between_renewals(pg_dsn: str, schema: str) -> None:
    store = LeaseStore(pg_dsn, schema=schema, idle_close=timedelta(0))
    try:
        lease = store.acquire("job", "worker-1", timedelta(seconds=10))
        assert lease is not None
        assert _closed_within(store, pg_dsn) < 1.0  # closed within a watchdog tick or so
        with store.keep(lease, renew_every=timedelta(seconds=0.5)) as keeper:
            time.sleep(2.2)
            assert keeper.renewals >= 3 and not keeper.lost
        # Each renewal opened a connection and gave it back; nothing is left open on the server.
        assert store.db.connects >= 4
        assert _closed_within(store, pg_dsn) < 1.0  # the release's connection too
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
