"""The fence: the resource-side gate that rejects stale tokens."""

from __future__ import annotations

import multiprocessing as mp

import psycopg2
import pytest

from airflow_lease_provider.core import DuplicatePublish, EventKind, FenceStore, StaleFencingToken
from tests.pg import execute, q


def test_accepts_only_larger_tokens(fences: FenceStore) -> None:
    assert fences.current("blog") is None
    assert fences.accept("blog", 5) is True
    assert fences.accept("blog", 5) is False  # equal: rejected
    assert fences.accept("blog", 4) is False  # smaller: rejected
    assert fences.accept("blog", 6) is True
    assert fences.current("blog") == 6
    assert fences.accept("other", 1) is True  # resources are independent


def test_guard_raises_with_the_current_token_and_records_it(fences: FenceStore) -> None:
    fences.guard("blog", 10, owner="run-b")
    with pytest.raises(StaleFencingToken) as info:
        fences.guard("blog", 7, owner="run-a")
    assert info.value.token == 7 and info.value.current == 10
    rejected = fences.events.query(key="blog", kind=EventKind.FENCE_REJECTED)
    assert len(rejected) == 1 and rejected[0].token == 7 and rejected[0].owner == "run-a"
    assert rejected[0].detail["current_token"] == 10


def test_idempotency_key_is_used_once_whatever_the_token(fences: FenceStore) -> None:
    assert fences.accept("billing", 1, idempotency_key="2026-11-29") is True
    decision = fences.advance("billing", 2, idempotency_key="2026-11-29")
    assert decision.outcome == "duplicate" and not decision.accepted
    with pytest.raises(DuplicatePublish):
        fences.guard("billing", 3, idempotency_key="2026-11-29")
    # The refused publishes did not move the fence.
    assert fences.current("billing") == 1
    assert fences.accept("billing", 2, idempotency_key="2026-11-30") is True


def test_a_stale_publish_does_not_use_up_its_idempotency_key(fences: FenceStore) -> None:
    assert fences.accept("billing", 10, idempotency_key="slot-1") is True
    assert fences.advance("billing", 3, idempotency_key="slot-2").outcome == "stale"
    # slot-2 was never published, so the legitimate holder can still publish it.
    assert fences.accept("billing", 11, idempotency_key="slot-2") is True


def _accept_many(dsn: str, schema: str, tokens: list[int], out: mp.Queue) -> None:
    store = FenceStore(dsn, schema=schema, record_events=False)
    out.put([t for t in tokens if store.accept("shared", t)])


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
    assert fences.current("shared") == 800
    assert 800 in accepted
    assert len(accepted) == len(set(accepted))


def test_transaction_writes_exactly_once_with_the_fence(fences: FenceStore, pg_dsn: str, schema: str) -> None:
    execute(pg_dsn, q('CREATE SCHEMA IF NOT EXISTS {schema}', schema))
    execute(pg_dsn, q('CREATE TABLE {schema}.article (slot text PRIMARY KEY, body text, token bigint)', schema))
    with fences.transaction("articles", 2, owner="run-b", idempotency_key="slot-9") as cur:
        cur.execute(q('INSERT INTO {schema}.article VALUES (%s, %s, %s)', schema), ("slot-9", "new", 2))
    # A zombie with an older token: refused before anything is written.
    with pytest.raises(StaleFencingToken):
        with fences.transaction("articles", 1, owner="run-a") as cur:
            cur.execute(q('INSERT INTO {schema}.article VALUES (%s, %s, %s)', schema), ("slot-8", "old", 1))
    # The same slot again, even with a larger token: refused as a duplicate.
    with pytest.raises(DuplicatePublish):
        with fences.transaction("articles", 3, idempotency_key="slot-9") as cur:
            cur.execute(q('INSERT INTO {schema}.article VALUES (%s, %s, %s)', schema), ("slot-9b", "dup", 3))
    # A failure inside the body rolls back the fence advance too.
    with pytest.raises(RuntimeError):
        with fences.transaction("articles", 4) as cur:
            cur.execute(q('INSERT INTO {schema}.article VALUES (%s, %s, %s)', schema), ("slot-10", "x", 4))
            raise RuntimeError("boom")
    assert fences.current("articles") == 2
    rows = execute(pg_dsn, q('SELECT slot, body, token FROM {schema}.article', schema))
    assert rows == [("slot-9", "new", 2)]


def test_advance_in_the_callers_own_transaction(fences: FenceStore, pg_dsn: str, schema: str) -> None:
    fences.ensure_schema()
    execute(pg_dsn, q('CREATE TABLE {schema}.target (v int)', schema))
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn:
            with conn.cursor() as cur:
                fences.advance_in(cur, "t", 5)
                cur.execute(q('INSERT INTO {schema}.target VALUES (1)', schema))
        with pytest.raises(StaleFencingToken):
            with conn:
                with conn.cursor() as cur:
                    fences.advance_in(cur, "t", 5)
                    cur.execute(q('INSERT INTO {schema}.target VALUES (2)', schema))
    finally:
        conn.close()
    assert execute(pg_dsn, q('SELECT v FROM {schema}.target', schema)) == [(1,)]
    assert fences.current("t") == 5
