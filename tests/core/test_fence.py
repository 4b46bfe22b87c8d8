"""The fence: the resource-side gate that rejects stale tokens."""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta

import psycopg2
import psycopg2.errors
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import (
    DuplicatePublish,
    EventKind,
    FenceStore,
    InvalidArgument,
    LeaseStore,
    LeaseStoreUnavailable,
    StaleFencingToken,
)
from airflow_lease_provider.core.schema import latest_version
from tests.pg import execute, q, store_at_version

TTL = timedelta(minutes=5)


def test_accepts_only_larger_tokens(fences: FenceStore) -> None:
    assert fences.current("blog", key="job") is None
    assert fences.accept("blog", 5, key="job") is True
    assert fences.accept("blog", 5, key="job") is False  # equal: rejected
    assert fences.accept("blog", 4, key="job") is False  # smaller: rejected
    assert fences.accept("blog", 6, key="job") is True
    assert fences.current("blog", key="job") == 6
    assert fences.accept("other", 1, key="job") is True  # resources are independent


def test_guard_raises_with_the_current_token_and_records_it(fences: FenceStore) -> None:
    fences.guard("blog", 10, key="job", owner="run-b")
    with pytest.raises(StaleFencingToken) as info:
        fences.guard("blog", 7, key="job", owner="run-a")
    assert info.value.token == 7 and info.value.current == 10
    rejected = fences.events.query(key="blog", kind=EventKind.FENCE_REJECTED)
    assert len(rejected) == 1 and rejected[0].token == 7 and rejected[0].owner == "run-a"
    assert rejected[0].detail["current_token"] == 10


def test_idempotency_key_is_used_once_whatever_the_token(fences: FenceStore) -> None:
    assert fences.accept("billing", 1, key="job", idempotency_key="2026-11-29") is True
    decision = fences.advance("billing", 2, key="job", idempotency_key="2026-11-29")
    assert decision.outcome == "duplicate" and not decision.accepted
    with pytest.raises(DuplicatePublish):
        fences.guard("billing", 3, key="job", idempotency_key="2026-11-29")
    # The refused publishes did not move the fence.
    assert fences.current("billing", key="job") == 1
    assert fences.accept("billing", 2, key="job", idempotency_key="2026-11-30") is True


def test_a_stale_publish_does_not_use_up_its_idempotency_key(fences: FenceStore) -> None:
    assert fences.accept("billing", 10, key="job", idempotency_key="slot-1") is True
    assert fences.advance("billing", 3, key="job", idempotency_key="slot-2").outcome == "stale"
    # slot-2 was never published, so the legitimate holder can still publish it.
    assert fences.accept("billing", 11, key="job", idempotency_key="slot-2") is True


def _accept_many(dsn: str, schema: str, tokens: list[int], out: mp.Queue) -> None:
    store = FenceStore(dsn, schema=schema, record_events=False)
    out.put([t for t in tokens if store.accept("shared", t, key="job")])


def test_concurrent_accepts_end_with_the_largest(fences: FenceStore, pg_dsn: str, schema: str) -> None:
    fences.ensure_schema()
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    workers = [
        ctx.Process(target=_accept_many, args=(pg_dsn, schema, list(range(w + 1, 801, 8)), out)) for w in range(8)
    ]
    for p in workers:
        p.start()
    accepted = [t for _ in workers for t in out.get(timeout=120)]
    for p in workers:
        p.join(timeout=60)
    assert fences.current("shared", key="job") == 800
    assert 800 in accepted
    assert len(accepted) == len(set(accepted))


def test_transaction_writes_exactly_once_with_the_fence(fences: FenceStore, pg_dsn: str, schema: str) -> None:
    execute(pg_dsn, q('CREATE SCHEMA IF NOT EXISTS {schema}', schema))
    execute(pg_dsn, q('CREATE TABLE {schema}.article (slot text PRIMARY KEY, body text, token bigint)', schema))
    with fences.transaction("articles", 2, key="job", owner="run-b", idempotency_key="slot-9") as cur:
        cur.execute(q('INSERT INTO {schema}.article VALUES (%s, %s, %s)', schema), ("slot-9", "new", 2))
    # A zombie with an older token: refused before anything is written.
    with pytest.raises(StaleFencingToken):
        with fences.transaction("articles", 1, key="job", owner="run-a") as cur:
            cur.execute(q('INSERT INTO {schema}.article VALUES (%s, %s, %s)', schema), ("slot-8", "old", 1))
    # The same slot again, even with a larger token: refused as a duplicate.
    with pytest.raises(DuplicatePublish):
        with fences.transaction("articles", 3, key="job", idempotency_key="slot-9") as cur:
            cur.execute(q('INSERT INTO {schema}.article VALUES (%s, %s, %s)', schema), ("slot-9b", "dup", 3))
    # A failure inside the body rolls back the fence advance too.
    with pytest.raises(RuntimeError):
        with fences.transaction("articles", 4, key="job") as cur:
            cur.execute(q('INSERT INTO {schema}.article VALUES (%s, %s, %s)', schema), ("slot-10", "x", 4))
            raise RuntimeError("boom")
    assert fences.current("articles", key="job") == 2
    rows = execute(pg_dsn, q('SELECT slot, body, token FROM {schema}.article', schema))
    assert rows == [("slot-9", "new", 2)]


def test_advance_in_the_callers_own_transaction(fences: FenceStore, pg_dsn: str, schema: str) -> None:
    fences.ensure_schema()
    execute(pg_dsn, q('CREATE TABLE {schema}.target (v int)', schema))
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn:
            with conn.cursor() as cur:
                fences.advance_in(cur, "t", 5, key="job")
                cur.execute(q('INSERT INTO {schema}.target VALUES (1)', schema))
        with pytest.raises(StaleFencingToken):
            with conn:
                with conn.cursor() as cur:
                    fences.advance_in(cur, "t", 5, key="job")
                    cur.execute(q('INSERT INTO {schema}.target VALUES (2)', schema))
    finally:
        conn.close()
    assert execute(pg_dsn, q('SELECT v FROM {schema}.target', schema)) == [(1,)]
    assert fences.current("t", key="job") == 5


# -- a fence per (resource, lease key) (issue 10, item 4) ---------------------------------------------


def test_a_valid_holder_of_another_key_is_accepted(store: LeaseStore, fences: FenceStore) -> None:
    """Two keys publish to one table (a mapped task's per-map-index keys, a renamed DAG, a second job):
    their tokens are counted apart, so neither may be refused because of the other's token."""
    for _ in range(5):  # key etl.load[0] is far ahead in its own count
        lease = store.acquire("etl.load[0]", owner="run-1", ttl=TTL)
        assert lease is not None
    assert lease.token == 5 and fences.accept("warehouse.sales", lease.token, key=lease.key)
    other = store.acquire("etl.load[1]", owner="run-1", ttl=TTL)
    assert other is not None and other.token == 1
    decision = fences.advance("warehouse.sales", other.token, key=other.key, owner=other.owner)
    assert decision.accepted and decision.key == "etl.load[1]" and decision.current_token == 1
    with fences.transaction("warehouse.sales", 2, key="etl.load[1]") as cur:
        cur.execute("SELECT 1")
    assert fences.tokens("warehouse.sales") == {"etl.load[0]": 5, "etl.load[1]": 2}
    assert fences.current("warehouse.sales", key="etl.load[0]") == 5
    assert fences.current("warehouse.sales", key="never-published") is None


def test_a_stale_token_of_the_same_key_is_always_refused(fences: FenceStore) -> None:
    """Whatever other keys do at the resource, a token of one key is compared with that key's only."""
    assert fences.accept("blog", 7, key="a")
    for other_token in (1, 6, 7, 8, 100):  # another key's progress, below, equal and above
        assert fences.accept("blog", other_token, key=f"b{other_token}")
        for stale in (1, 6, 7):
            assert fences.advance("blog", stale, key="a").outcome == "stale"
        with pytest.raises(StaleFencingToken) as info:
            fences.guard("blog", 7, key="a", owner="zombie")
        assert info.value.current == 7
        with pytest.raises(StaleFencingToken):
            with fences.transaction("blog", 6, key="a") as cur:
                cur.execute("SELECT 1")
    assert fences.accept("blog", 8, key="a") and fences.current("blog", key="a") == 8
    rejected = fences.events.query(key="blog", kind=EventKind.FENCE_REJECTED)
    assert rejected and all(e.detail["lease_key"] == "a" for e in rejected)


def test_idempotency_keys_stay_per_resource_across_lease_keys(fences: FenceStore) -> None:
    assert fences.accept("billing", 1, key="close", idempotency_key="2026-11-29")
    assert fences.advance("billing", 1, key="close-v2", idempotency_key="2026-11-29").outcome == "duplicate"
    # A refused publish does not use up its idempotency key.
    assert fences.advance("billing", 1, key="close", idempotency_key="2026-11-30").outcome == "stale"
    assert fences.accept("billing", 1, key="close-v2", idempotency_key="2026-11-30")


def test_the_key_is_required_and_validated(fences: FenceStore) -> None:
    with pytest.raises(TypeError):
        fences.accept("blog", 1)  # type: ignore[call-arg]
    for bad in ("", "x" * 513, None, 5):
        with pytest.raises(InvalidArgument) as info:
            fences.accept("blog", 1, key=bad)  # type: ignore[arg-type]
        assert info.value.parameter == "key"


def _schema_at_version_2(pg_dsn: str, schema: str) -> None:
    store_at_version(pg_dsn, schema, 2)
    conn = psycopg2.connect(pg_dsn)
    with conn, conn.cursor() as cur:
        cur.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
        cur.execute("SELECT outcome FROM fence_advance('blog', 7, 'run-7', NULL)")
    conn.close()


def test_upgrading_keeps_a_fence_from_before_per_key_fences_as_a_floor(pg_dsn: str, schema: str) -> None:
    """A fence row written before version 3 has no key: a token it refused is still refused after the
    upgrade, for any key, until that key has published above it."""
    _schema_at_version_2(pg_dsn, schema)
    fences = FenceStore(pg_dsn, schema=schema)
    try:
        assert fences.ensure_schema() == latest_version()
        assert fences.current("blog", key="job") == 7  # the floor
        assert fences.advance("blog", 6, key="job").outcome == "stale"
        assert fences.advance("blog", 7, key="job").outcome == "stale"
        assert fences.accept("blog", 8, key="job")
        assert fences.advance("blog", 8, key="job").outcome == "stale"  # its own row from now on
        assert fences.accept("other", 1, key="job")  # other resources have no floor
        # The pre-upgrade fence function is gone: a process still running the old code fails closed.
        with pytest.raises(psycopg2.errors.UndefinedFunction):
            execute(pg_dsn, q("SELECT * FROM {schema}.fence_advance('blog', 99, 'old', NULL)", schema))
    finally:
        fences.close()


# -- FenceStore.transaction: the caller's statements are the caller's (issue 10, item 5) ---------------


def test_a_seven_second_statement_inside_the_transaction_commits(fences: FenceStore, pg_dsn: str, schema: str) -> None:
    assert fences.db.statement_timeout == timedelta(seconds=5)  # the store's own limit
    fences.ensure_schema()
    execute(pg_dsn, q("CREATE TABLE {schema}.report (token bigint)", schema))
    started = time.monotonic()
    with fences.transaction("reports", 3, key="job", timeout=timedelta(seconds=30)) as cur:
        cur.execute("SELECT pg_sleep(7)")
        cur.execute(q("INSERT INTO {schema}.report VALUES (%s)", schema), (3,))
    assert time.monotonic() - started >= 7
    assert execute(pg_dsn, q("SELECT token FROM {schema}.report", schema)) == [(3,)]
    assert fences.current("reports", key="job") == 3
    # The store's statements keep their own limit: the next fence call still answers normally.
    with pytest.raises(StaleFencingToken):
        fences.guard("reports", 3, key="job")


def test_without_a_timeout_the_store_sets_no_limit_on_the_callers_statements(fences: FenceStore) -> None:
    small = FenceStore(fences.db.dsn, schema=fences.schema, statement_timeout=timedelta(seconds=1))
    try:
        with small.transaction("slow", 1, key="job") as cur:
            cur.execute("SELECT pg_sleep(2.5)")
        assert small.current("slow", key="job") == 1
    finally:
        small.close()


def test_an_error_in_the_callers_sql_surfaces_as_that_error_and_nothing_advances(fences: FenceStore) -> None:
    assert fences.accept("reports", 1, key="job")
    with pytest.raises(psycopg2.errors.DivisionByZero):
        with fences.transaction("reports", 2, key="job") as cur:
            cur.execute("SELECT 1/0")
    assert fences.current("reports", key="job") == 1
    # The caller's own timeout is the caller's error too (not a store outage).
    with pytest.raises(psycopg2.errors.QueryCanceled):
        with fences.transaction("reports", 3, key="job", timeout=timedelta(milliseconds=300)) as cur:
            cur.execute("SELECT pg_sleep(2)")
    assert fences.current("reports", key="job") == 1
    # The store's connection is usable afterwards.
    with fences.transaction("reports", 4, key="job") as cur:
        cur.execute("SELECT 1")
    assert fences.current("reports", key="job") == 4
    with pytest.raises(InvalidArgument) as info:
        with fences.transaction("reports", 5, key="job", timeout=timedelta(0)):
            pass
    assert info.value.parameter == "timeout"


def test_a_connection_that_dies_under_the_callers_statement_is_the_store_unavailable(fences: FenceStore) -> None:
    """The server ending the connection during one of the caller's statements (a crash, a kill -9, a cut
    network) is a store outage, not the caller's SQL error: LeaseStoreUnavailable, and nothing advanced.
    Before, the driver's OperationalError reached the caller raw (the chaos run's short profile saw it
    as an 'unexpected-error' when a kill -9 landed inside a fenced publish)."""
    assert fences.accept("reports", 1, key="job")
    with pytest.raises(LeaseStoreUnavailable):
        with fences.transaction("reports", 2, key="job") as cur:
            cur.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    assert fences.current("reports", key="job") == 1
    with fences.transaction("reports", 3, key="job") as cur:  # the store reconnects
        cur.execute("SELECT 1")
    assert fences.current("reports", key="job") == 3


def test_after_a_force_release_the_old_holder_is_refused_where_the_docs_say(
    store: LeaseStore, fences: FenceStore
) -> None:
    """docs/ui.md and docs/cli.md, force-release: the old holder can no longer renew or release, the store
    no longer shows the lease as its own (the check a leased task's fence/fenced_transaction makes first),
    and the fence refuses its token once a later token of the key has published there (read back from
    PostgreSQL). The docs used to say it could no longer pass a fence at all: it can, until then."""
    old = store.acquire("forced-job", "dag/run-1/publish", TTL)
    assert old is not None
    assert store.force_release("forced-job", by="admin") is not None
    assert store.renew(old) is None
    assert store.release(old) is False
    assert store.holds("forced-job", old.owner, token=old.token).lease is None
    new = store.acquire("forced-job", "dag/run-2/publish", TTL)
    assert new is not None and new.token > old.token
    assert fences.accept("blog", new.token, key="forced-job")
    assert not fences.accept("blog", old.token, key="forced-job")
    assert fences.current("blog", key="forced-job") == new.token
