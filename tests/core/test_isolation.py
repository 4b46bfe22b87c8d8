"""The store's statements run under READ COMMITTED whatever the role's or database's default isolation.

Under ``default_transaction_isolation = 'repeatable read'`` a conditional UPDATE that waited on a row lock
fails with a serialization error instead of re-checking its WHERE on the new row version, so a contended
acquire raised instead of reporting the holder (issue 10, item 8). Each case below makes two sessions
meet on one row: the other session's change is in flight (row locked, not committed) when the store's
statement starts, and commits while the store's statement waits.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg2
import psycopg2.extensions
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import FenceStore, LeaseStore
from tests.pg import execute, q

TTL = timedelta(minutes=5)


@pytest.fixture
def rr_dsn(pg_dsn: str, schema: str) -> Iterator[str]:
    """A login role whose default isolation is REPEATABLE READ (as a DBA may set it), dropped afterwards."""
    role = "lease_rr_" + uuid.uuid4().hex[:8]
    name = sql.Identifier(role)
    execute(pg_dsn, sql.SQL("CREATE ROLE {} LOGIN").format(name))
    execute(pg_dsn, sql.SQL("ALTER ROLE {} SET default_transaction_isolation = 'repeatable read'").format(name))
    database = psycopg2.extensions.parse_dsn(pg_dsn)["dbname"]
    execute(pg_dsn, sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(database), name))
    dsn = psycopg2.extensions.make_dsn(pg_dsn, user=role)
    try:
        (level,) = execute(dsn, "SHOW transaction_isolation")[0]
        assert level == "repeatable read"  # the set-up really is the hostile one
        yield dsn
    finally:
        execute(pg_dsn, sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        execute(pg_dsn, sql.SQL("REVOKE CREATE ON DATABASE {} FROM {}").format(sql.Identifier(database), name))
        execute(pg_dsn, sql.SQL("DROP OWNED BY {}").format(name))
        execute(pg_dsn, sql.SQL("DROP ROLE {}").format(name))


def contended(rr_dsn: str, change: str, params: tuple[Any, ...], call: Callable[[], Any]) -> Any:
    """Run ``call`` while another session has ``change`` in flight on the same row; commit it meanwhile."""
    other = psycopg2.connect(rr_dsn)
    try:
        with other.cursor() as cur:
            cur.execute(change, params)
        result: list[Any] = []
        errors: list[BaseException] = []

        def target() -> None:
            try:
                result.append(call())
            except BaseException as exc:  # reported to the test below
                errors.append(exc)

        thread = threading.Thread(target=target)
        thread.start()
        time.sleep(0.5)  # the store's statement has taken its snapshot and waits on the row lock
        other.commit()
        thread.join(timeout=10)
        assert not thread.is_alive()
        if errors:
            raise errors[0]
        return result[0]
    finally:
        other.close()


def test_a_contended_acquire_reports_the_holder_under_a_repeatable_read_default(rr_dsn: str, schema: str) -> None:
    store = LeaseStore(rr_dsn, schema=schema)
    old = store.acquire("job", owner="run-0", ttl=TTL)
    assert old is not None and store.release(old)  # free: both runs' statements may take it
    # Run 1's acquire is in flight (the same UPDATE the store sends, not yet committed)...
    take = q(
        "UPDATE {schema}.lease SET owner = 'run-1', token = token + 1, acquired_at = clock_timestamp(), "
        "renewed_at = clock_timestamp(), expires_at = clock_timestamp() + interval '5 minutes', released_at = NULL "
        "WHERE key = %s", schema,
    )
    # ...when run 2's starts: it must be told run 1 holds the lease, not fail with a serialization error.
    got = contended(rr_dsn, take, ("job",), lambda: store.try_acquire("job", "run-2", TTL))
    assert got.lease is None and got.holder is not None
    assert (got.holder.owner, got.holder.token) == ("run-1", old.token + 1)
    store.close()


def test_a_renewal_waiting_on_a_row_lock_succeeds_under_a_repeatable_read_default(rr_dsn: str, schema: str) -> None:
    store = LeaseStore(rr_dsn, schema=schema)
    lease = store.acquire("job", owner="run-1", ttl=TTL)
    assert lease is not None
    touch = q("UPDATE {schema}.lease SET renewed_at = renewed_at WHERE key = %s", schema)  # e.g. an admin tool
    renewed = contended(rr_dsn, touch, ("job",), lambda: store.renew(lease))
    assert renewed is not None and renewed.token == lease.token
    store.close()


def test_a_contended_fence_advance_decides_under_a_repeatable_read_default(rr_dsn: str, schema: str) -> None:
    fences = FenceStore(rr_dsn, schema=schema)
    assert fences.accept("blog", 1, key="job")
    advance = q("SELECT * FROM {schema}.fence_advance('blog', 'job', 5, 'run-5', NULL)", schema)
    assert contended(rr_dsn, advance, (), lambda: fences.accept("blog", 6, key="job")) is True
    assert contended(rr_dsn, q("SELECT * FROM {schema}.fence_advance('blog', 'job', 8, 'run-8', NULL)", schema), (),
                     lambda: fences.accept("blog", 7, key="job")) is False

    def publish() -> int:
        with fences.transaction("blog", 10, key="job") as cur:
            cur.execute("SELECT 1")
        return 10

    advance9 = q("SELECT * FROM {schema}.fence_advance('blog', 'job', 9, 'run-9', NULL)", schema)
    assert contended(rr_dsn, advance9, (), publish) == 10
    assert fences.current("blog", key="job") == 10
    fences.close()
