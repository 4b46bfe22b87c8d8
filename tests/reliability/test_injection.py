"""Hostile strings as keys, owners, resources and idempotency keys: stored and read back verbatim, and
the schema (and the server's roles, databases and settings) untouched."""

from __future__ import annotations

from datetime import timedelta

import pytest
from psycopg2 import sql

from airflow_lease_provider.core import EventKind, FenceStore, InvalidArgument, LeaseStore, validation
from airflow_lease_provider.core.validation import MAX_NAME_LENGTH
from tests.pg import execute
from tests.reliability import dbstate
from tests.reliability.injection_corpus import PAYLOADS, payloads

TTL = timedelta(seconds=60)


def tx_key(payload: str) -> str:
    """A second idempotency key per payload, for the publish in a transaction (still <= 512 characters)."""
    return "tx:" + payload[: MAX_NAME_LENGTH - 3]


def test_the_corpus_has_at_least_50_valid_payloads() -> None:
    assert len(PAYLOADS) >= 50
    assert len(set(PAYLOADS)) == len(PAYLOADS)
    for p in payloads("t_0123456789ab"):
        assert p.strip() and "\x00" not in p and len(p) <= MAX_NAME_LENGTH


def is_refused(payload: str) -> bool:
    """A payload the name rule refuses: whitespace at an end, or an invisible or reordering character."""
    try:
        validation.name("name", payload)
    except InvalidArgument:
        return True
    return False


def test_payloads_with_invisible_characters_or_edge_whitespace_are_refused_and_write_nothing(
    store: LeaseStore, fences: FenceStore, pg_dsn: str, schema: str
) -> None:
    store.ensure_schema()
    fences.ensure_schema()
    before = dbstate.catalog(pg_dsn, schema)
    refused = [p for p in payloads(schema) if is_refused(p)]
    assert len(refused) >= 5  # leading/trailing newlines and spaces, U+200B, U+202E, U+2028
    for p in refused:
        with pytest.raises(InvalidArgument) as info:
            store.acquire(p, owner="o", ttl=TTL)
        assert info.value.parameter == "key"
        with pytest.raises(InvalidArgument) as info:
            fences.advance(p, 1, key="job")
        assert info.value.parameter == "resource"
        with pytest.raises(InvalidArgument) as info:
            fences.advance("blog", 1, key="job", idempotency_key=p)
        assert info.value.parameter == "idempotency_key"
    assert store.leases() == [] and fences.tokens("blog") == {}
    assert dbstate.catalog(pg_dsn, schema) == before


def test_payloads_are_stored_verbatim_and_the_schema_is_untouched(
    store: LeaseStore, fences: FenceStore, pg_dsn: str, schema: str
) -> None:
    store.ensure_schema()
    fences.ensure_schema()
    execute(pg_dsn, sql.SQL("CREATE TABLE {}.published (value text NOT NULL)").format(sql.Identifier(schema)))
    before = dbstate.catalog(pg_dsn, schema)
    corpus = [p for p in payloads(schema) if not is_refused(p)]
    assert len(corpus) >= 50
    wrong: list[str] = []

    def expect(condition: bool, payload: str, what: str) -> None:
        if not condition:
            wrong.append(f"{payload!r}: {what}")

    insert = sql.SQL("INSERT INTO {}.published (value) VALUES (%s)").format(sql.Identifier(schema))
    for p in corpus:
        lease = store.acquire(p, owner=p, ttl=TTL)
        expect(lease is not None and (lease.key, lease.owner) == (p, p), p, f"acquire returned {lease}")
        assert lease is not None
        held = store.holder(p)
        expect(held is not None and (held.key, held.owner, held.token) == (p, p, lease.token), p, "holder")
        renewed = store.renew(lease)
        expect(renewed is not None and (renewed.key, renewed.owner) == (p, p), p, "renew")
        decision = fences.advance(p, lease.token, key=p, owner=p, idempotency_key=p)
        expect(decision.accepted and fences.current(p, key=p) == lease.token, p, f"fence advance {decision}")
        expect(fences.advance(p, lease.token + 1, key=p, owner=p, idempotency_key=p).outcome == "duplicate", p, "idempotency")
        again = store.acquire(p, owner=p, ttl=TTL)  # the same owner re-enters with a larger token
        assert again is not None
        with fences.transaction(p, again.token, key=p, owner=p, idempotency_key=tx_key(p)) as cur:
            cur.execute(insert, (p,))
        expect(fences.current(p, key=p) == again.token, p, "fence transaction")
        events = store.events.query(key=p, kind=EventKind.ACQUIRED)
        expect(len(events) == 2 and {(e.key, e.owner) for e in events} == {(p, p)}, p, "events")
        previous = store.force_release(p, by=p, reason=p)
        expect(previous is not None and previous.owner == p, p, "force_release")
        forced = store.events.query(key=p, kind=EventKind.FORCE_RELEASED)
        expect(
            len(forced) == 1 and forced[0].detail.get("by") == p and forced[0].detail.get("reason") == p,
            p, f"force_release event {forced}",
        )
    # Everything read back straight from the tables, bypassing the library.
    keys = [r[0] for r in execute(pg_dsn, sql.SQL("SELECT key FROM {}.lease").format(sql.Identifier(schema)))]
    published = execute(
        pg_dsn, sql.SQL("SELECT resource, idempotency_key, owner FROM {}.fence_publish").format(sql.Identifier(schema))
    )
    values = [r[0] for r in execute(pg_dsn, sql.SQL("SELECT value FROM {}.published").format(sql.Identifier(schema)))]
    assert sorted(keys) == sorted(corpus)
    assert sorted(published) == sorted([(p, p, p) for p in corpus] + [(p, tx_key(p), p) for p in corpus])
    assert sorted(values) == sorted(corpus)
    assert sorted(lease.key for lease in store.leases(limit=1000)) == sorted(corpus)
    assert wrong == [], "\n".join(wrong)
    assert dbstate.catalog(pg_dsn, schema) == before


def test_payloads_as_schema_names_are_refused_and_create_nothing(pg_dsn: str, schema: str) -> None:
    corpus = payloads(schema)
    for p in corpus:
        with pytest.raises(InvalidArgument) as info:
            LeaseStore(pg_dsn, schema=p)
        assert info.value.parameter == "schema"
    found = execute(pg_dsn, "SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s)", (corpus,))
    assert found == []
