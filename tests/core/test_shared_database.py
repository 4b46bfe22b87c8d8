"""``shared=True``: the stores of one process (the leased tasks ``dag.test()`` runs one after the other) reuse
one connection while it is open, check the schema once, and hold nothing once idle (issue 28 item 1)."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from typing import Any

import pytest

from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.db import Database, shared_database
from airflow_lease_provider.core.errors import InvalidArgument, LeaseError, LeaseStoreUnavailable
from airflow_lease_provider.core.schema import drop_schema
from tests.pg import execute

GRACE = timedelta(seconds=1)
TTL = timedelta(seconds=30)


def _store(dsn: str, schema: str, grace: timedelta = GRACE) -> LeaseStore:
    return LeaseStore(dsn, schema=schema, idle_close=grace, shared=True)


def _alive(dsn: str, pid: int) -> bool:
    return bool(execute(dsn, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)))


def _wait(condition: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _counting(db: Database) -> list[str]:
    """The named queries ``db`` sends from now on (instrumentation of what is sent, nothing else changes)."""
    sent: list[str] = []
    run = db.run

    def counted(name: str, params: Any, **kwargs: Any) -> Any:
        sent.append(name)
        return run(name, params, **kwargs)

    db.run = counted  # type: ignore[method-assign]
    return sent


def test_two_stores_of_one_process_share_one_connection_and_one_schema_check(pg_dsn: str, schema: str) -> None:
    first = _store(pg_dsn, schema)
    lease = first.acquire("job-a", "run-1", TTL)
    assert lease is not None and first.release(lease)
    db = first.db
    pid = db._conn.get_backend_pid()
    connects = db.connects
    sent = _counting(db)

    second = _store(pg_dsn, schema)  # the next task of the same process
    assert second.db is db
    lease = second.acquire("job-b", "run-1", TTL)
    assert lease is not None and second.release(lease)
    assert db.connects == connects, "the second store connected again"
    assert db._conn.get_backend_pid() == pid
    assert "schema_version" not in sent, f"the schema was checked again: {sent}"

    # Another schema, DSN or grace is another database (the key holds every setting).
    assert _store(pg_dsn, schema, timedelta(milliseconds=500)).db is not db
    assert LeaseStore(pg_dsn, schema=schema, idle_close=GRACE).db is not db  # not shared: its own


def test_a_shared_connection_closes_itself_once_idle_for_its_grace(pg_dsn: str, schema: str) -> None:
    store = _store(pg_dsn, schema, timedelta(milliseconds=300))
    lease = store.acquire("job", "run-1", TTL)
    assert lease is not None and store.release(lease)
    pid = store.db._conn.get_backend_pid()
    assert _wait(lambda: store.db._conn is None, timeout=2.0), "the shared connection stayed open once idle"
    assert _wait(lambda: not _alive(pg_dsn, pid), timeout=2.0), "its server backend stayed connected"
    # The next store of the process opens a new one, transparently.
    again = _store(pg_dsn, schema, timedelta(milliseconds=300))
    assert again.holder("job") is None and again.db._conn is not None


def test_a_shared_store_refuses_settings_that_would_hold_a_connection(pg_dsn: str, schema: str) -> None:
    with pytest.raises(InvalidArgument, match="shared"):
        LeaseStore(pg_dsn, schema=schema, idle_close=None, shared=True)
    with pytest.raises(InvalidArgument, match="shared"):
        LeaseStore(pg_dsn, schema=schema, idle_close=GRACE, shared=True, read_only=True)
    with pytest.raises(InvalidArgument, match="idle_close"):
        shared_database(pg_dsn, schema=schema, idle_close=timedelta(0))


def test_a_store_dropped_between_two_stores_is_made_again_and_named_anew(pg_dsn: str, schema: str) -> None:
    first = _store(pg_dsn, schema)
    lease = first.acquire("job", "run-1", TTL)
    assert lease is not None and lease.token == 1
    old_id = first.store_id
    first.release(lease)
    for _ in range(2):  # prepared from the second use: both the plain and the prepared acquire find it gone
        lease = first.acquire("job", "run-1", TTL)
        assert lease is not None
        first.release(lease)
    drop_schema(first.db)  # the store is lost (and nobody made it again yet)

    second = _store(pg_dsn, schema)
    lease = second.acquire("job", "run-2", TTL)  # the full check runs again and makes the store
    assert lease is not None and lease.token == 1, lease
    assert second.store_id != old_id, "the store made again kept the old store's id"
    assert first.store_id == second.store_id, "a store object of the old store kept its id"
    assert second.release(lease)


def test_a_missing_table_in_a_callers_transaction_is_not_retried_and_the_check_runs_again(
    pg_dsn: str, schema: str
) -> None:
    store = _store(pg_dsn, schema)
    assert store.holder("job") is None
    db = store.db
    assert db.schema_current
    drop_schema(db)
    with pytest.raises(LeaseError, match="does not exist"), db.transaction() as cur:
        db.run_in(cur, "holder", {"key": "job"})
    assert not db.schema_current, "the positive check was kept after a statement found the store gone"
    again = _store(pg_dsn, schema)
    assert again.holder("job") is None  # checked (and made) again


def test_a_connection_the_server_ended_while_idle_is_replaced_before_a_statement_is_sent(
    pg_dsn: str, schema: str
) -> None:
    store = _store(pg_dsn, schema, timedelta(seconds=30))
    assert store.holder("job") is None
    pid = store.db._conn.get_backend_pid()
    execute(pg_dsn, "SELECT pg_terminate_backend(%s)", (pid,))
    assert _wait(lambda: not _alive(pg_dsn, pid))
    # retry=False: a statement that is never sent twice; the dead connection is found before it is sent.
    assert store.db.run("holder", {"key": "job"}, retry=False) == []
    assert store.db._conn.get_backend_pid() != pid


def test_a_forked_child_never_uses_or_closes_the_parents_shared_connection(pg_dsn: str, schema: str) -> None:
    store = _store(pg_dsn, schema, timedelta(seconds=30))
    lease = store.acquire("job", "parent", TTL)
    assert lease is not None
    db = store.db
    pid = db._conn.get_backend_pid()
    connects = db.connects
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        code = 1
        try:
            os.close(read)
            mine = shared_database(pg_dsn, schema=schema, idle_close=timedelta(seconds=30))
            ok = mine is not db and mine._conn is None
            kid = _store(pg_dsn, schema, timedelta(seconds=30))
            ok = ok and kid.holder("job") is not None and kid.db._conn.get_backend_pid() != pid
            # The parent's Database object used from the child: a connection of its own, the parent's untouched.
            ok = ok and db.run("holder", {"key": "job"}) != [] and db._conn.get_backend_pid() != pid
            db.close()
            del mine, kid
            gc.collect()
            os.write(write, b"ok" if ok else b"no")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(child, 0)
    answer = os.read(read, 16)
    os.close(read)
    assert status == 0 and answer == b"ok", answer
    assert _alive(pg_dsn, pid), "the child ended the parent's server session"
    assert store.holder("job") is not None
    assert db.connects == connects and db._conn.get_backend_pid() == pid, "the parent had to connect again"
    assert store.release(lease)


def test_a_shared_connection_is_refused_for_an_unreachable_server_as_any(schema: str) -> None:
    store = LeaseStore(
        "postgresql://nobody@127.0.0.1:1/none", schema=schema, idle_close=GRACE, shared=True,
        connect_timeout=timedelta(seconds=1),
    )
    with pytest.raises(LeaseStoreUnavailable):
        store.holder("job")
