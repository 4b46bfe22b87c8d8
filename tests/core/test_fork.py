"""A task body that forks while a keeper renews: the child's first store call must not hang.

A lock held by another thread at ``fork()`` stays held for ever in the child (only the forking thread is
copied). The keeper's renewal holds the store's lock for the whole statement, so a child forked while a
renewal is in flight waited for ever on its first ``holder()``, ``check()`` or fence (issue 38, defect 8).
The renewal is held in flight deterministically: another session locks the lease row, so the keeper's
``UPDATE`` waits on it (as it would behind a slow disk or an admin's ``SELECT ... FOR UPDATE``).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg2
import pytest

from airflow_lease_provider.core import FenceStore, LeaseStore
from tests.pg import execute, q

#: How long a forked child may take for its store calls (a connect and two statements) on a loaded machine.
CHILD_WITHIN = 20.0


@contextmanager
def row_locked(dsn: str, schema: str, key: str) -> Iterator[None]:
    """Hold the lease row of ``key`` locked from another session while the block runs."""
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(q("SELECT key FROM {schema}.lease WHERE key = %s FOR UPDATE", schema), (key,))
        yield
    finally:
        conn.rollback()
        conn.close()


def wait_for_renewal_blocked(dsn: str, schema: str, within: float = 20.0) -> None:
    """Until the keeper's renewal waits on the row lock (it holds the store's lock all that time)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        rows = execute(
            dsn,
            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
            (f'%UPDATE "{schema}".lease AS l%',),
        )
        if rows:
            return
        time.sleep(0.05)
    raise AssertionError("the keeper's renewal never waited on the locked row")


def in_forked_child(target: Callable[[Any], None]) -> Any:
    """Run ``target(queue)`` in a child made by ``fork()``; what it put on the queue, or fail if it hung."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=target, args=(results,), daemon=True)
    child.start()
    child.join(CHILD_WITHIN)
    if child.is_alive():
        child.kill()
        child.join(5)
        raise AssertionError(f"the forked child's store calls did not return within {CHILD_WITHIN:g} s: it hangs")
    assert child.exitcode == 0, f"the forked child failed (exit code {child.exitcode})"
    return results.get(timeout=5)


def test_a_child_forked_during_a_renewal_reads_the_store_and_fences(pg_dsn: str, schema: str) -> None:
    # As the Airflow hooks make them: one shared database (one connection, one lock) for the task's leases
    # and fences.
    store = LeaseStore(pg_dsn, schema=schema, shared=True, idle_close=timedelta(seconds=30))
    fences = FenceStore(pg_dsn, schema=schema, shared=True, idle_close=timedelta(seconds=30))
    assert fences.db is store.db
    try:
        lease = store.acquire("job", owner="a", ttl=timedelta(seconds=20))
        assert lease is not None
        with store.keep(lease, renew_every=timedelta(seconds=0.2)) as keeper, row_locked(pg_dsn, schema, "job"):
            wait_for_renewal_blocked(pg_dsn, schema)

            def child(results: Any) -> None:
                holder = store.holder("job")
                keeper.check()
                decision = fences.advance("out", lease.token, key="job", owner="a", store_id=store.store_id)
                results.put((holder.owner if holder else None, holder.token if holder else None, decision.outcome))

            owner, token, outcome = in_forked_child(child)
        assert (owner, token, outcome) == ("a", lease.token, "accepted")
        assert not keeper.lost  # the parent's keeper renewed once the row was free again
    finally:
        store.close()


def _module_lock(name: str) -> Any:
    from airflow_lease_provider.core.db import database, pool, watchdog

    return {
        "shared databases": lambda: database._shared_lock,
        "watchdog": lambda: watchdog.watchdog._lock,
        "connection pools": lambda: pool._registry_lock,
    }[name]()


@pytest.mark.parametrize("name", ["shared databases", "watchdog", "connection pools"])
def test_a_child_forked_while_another_thread_holds_a_module_lock_uses_a_new_store(
    pg_dsn: str, schema: str, name: str
) -> None:
    """The locks of the database layer's own registries, taken by the parent's other threads (its watchdog
    on every tick, another task's store being made), are made anew in the child as well."""
    LeaseStore(pg_dsn, schema=schema).ensure_schema()
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with _module_lock(name):
            taken.set()
            done.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(10)
    try:

        def child(results: Any) -> None:
            kinds = (
                LeaseStore(pg_dsn, schema=schema, shared=True, idle_close=timedelta(seconds=30)),
                LeaseStore(pg_dsn, schema=schema, idle_close=timedelta(0), pool_size=2),
            )
            results.put([store.holder("job") for store in kinds])

        assert in_forked_child(child) == [None, None]
    finally:
        done.set()
        holder.join(10)
