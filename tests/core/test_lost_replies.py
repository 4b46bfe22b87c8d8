"""Writes whose answer is lost after the server applied them (issue 38, defect 6), against the real PostgreSQL.

A proxy (tests/lost_reply.py) lets the statement, or its transaction's ``COMMIT``, reach the server and be
applied, then cuts the connection before the client reads the answer. A write that may have been applied
is never sent again blindly: its outcome is read back (force-release by its request id, release by its
row), or the caller gets :class:`OutcomeUnknown`; writes whose repetition is harmless (renew) are sent
again. docs/core.md, "Statements sent again after a lost connection", lists each.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from airflow_lease_provider.core import EventKind, FenceStore, LeaseStore, OutcomeUnknown
from tests.lost_reply import LostReplyProxy

TTL = timedelta(seconds=30)
#: In the text of the force-release statement (with or without the ledger), before and after the fix.
FORCE_RELEASE = b"AS new_token"


@pytest.fixture
def proxy(pg_dsn: str) -> Iterator[LostReplyProxy]:
    cut = LostReplyProxy.for_dsn(pg_dsn)
    yield cut
    cut.close()


def _through(proxy: LostReplyProxy, pg_dsn: str, schema: str, **kwargs: object) -> LeaseStore:
    return LeaseStore(proxy.dsn(pg_dsn), schema=schema, **kwargs)  # type: ignore[arg-type]


def test_a_force_release_whose_commit_answer_is_lost_says_what_it_did(
    store: LeaseStore, proxy: LostReplyProxy, pg_dsn: str, schema: str
) -> None:
    lease = store.acquire("job", "worker-a", TTL)
    assert lease is not None
    admin = _through(proxy, pg_dsn, schema)
    try:
        assert admin.lease("job") is not None  # as the CLI and the UI do: read it, then release it
        proxy.lose_reply(after=FORCE_RELEASE)
        previous, new_token = admin.force_release_with_token("job", by="alice", expected_token=lease.token)
        assert proxy.lost.is_set(), "the proxy lost no answer: the test tested nothing"
    finally:
        admin.close()
    assert (previous.owner, previous.token, previous.held) == ("worker-a", lease.token, True)
    assert new_token == lease.token + 1
    row = store.lease("job")
    assert row is not None and row.token == lease.token + 1 and not row.held  # bumped once, released
    events = store.events.query(key="job", kind=EventKind.FORCE_RELEASED)
    assert len(events) == 1 and events[0].detail["by"] == "alice" and events[0].detail["new_token"] == new_token


def test_without_the_ledger_a_lost_force_release_is_unknown_and_never_applied_twice(
    store: LeaseStore, proxy: LostReplyProxy, pg_dsn: str, schema: str
) -> None:
    lease = store.acquire("job", "worker-a", TTL)
    assert lease is not None
    admin = _through(proxy, pg_dsn, schema, record_events=False)
    try:
        assert admin.lease("job") is not None
        proxy.lose_reply(after=FORCE_RELEASE)
        with pytest.raises(OutcomeUnknown, match="may or may not"):
            admin.force_release("job", by="alice")  # no expected token: a resend would bump it again
        assert proxy.lost.is_set()
    finally:
        admin.close()
    row = store.lease("job")
    assert row is not None and row.token == lease.token + 1  # applied once


def test_a_release_whose_answer_is_lost_is_read_back_as_released(
    store: LeaseStore, proxy: LostReplyProxy, pg_dsn: str, schema: str
) -> None:
    holder = _through(proxy, pg_dsn, schema)
    try:
        lease = holder.acquire("job", "worker-a", TTL)
        assert lease is not None
        proxy.lose_reply(after=b"lease_release_logged(")
        assert holder.release(lease) is True
        assert proxy.lost.is_set()
    finally:
        holder.close()
    row = store.lease("job")
    assert row is not None and row.released_at is not None and row.token == lease.token
    assert len(store.events.query(key="job", kind=EventKind.RELEASED)) == 1


def test_an_event_whose_answer_is_lost_is_not_written_twice(
    store: LeaseStore, proxy: LostReplyProxy, pg_dsn: str, schema: str
) -> None:
    writer = _through(proxy, pg_dsn, schema)
    try:
        assert writer.lease("job") is None  # the connection is open (a reused one is what was resent)
        proxy.lose_reply(after=b"lease_event_insert(")
        writer.events.record(EventKind.SKIPPED_OVERLAP, "job", owner="worker-b", detail={"holder_owner": "a"})
        assert proxy.lost.is_set()
    finally:
        writer.close()
    assert len(store.events.query(key="job", kind=EventKind.SKIPPED_OVERLAP)) == 1


def test_a_fence_advance_whose_answer_is_lost_is_unknown(
    fences: FenceStore, proxy: LostReplyProxy, pg_dsn: str, schema: str
) -> None:
    fences.ensure_schema()
    publisher = FenceStore(proxy.dsn(pg_dsn), schema=schema)
    try:
        assert publisher.current("res", key="job") is None
        proxy.lose_reply(after=b"fence_advance(")
        with pytest.raises(OutcomeUnknown, match="may or may not"):
            publisher.advance("res", 5, key="job", owner="a", idempotency_key="slot")
    finally:
        publisher.close()
    assert fences.current("res", key="job") == 5  # it was applied; the caller was told it may have been


def test_a_fenced_transaction_whose_commit_answer_is_lost_is_unknown(
    fences: FenceStore, proxy: LostReplyProxy, pg_dsn: str, schema: str
) -> None:
    fences.ensure_schema()
    publisher = FenceStore(proxy.dsn(pg_dsn), schema=schema)
    try:
        proxy.lose_reply(after=b"fence_advance(")
        with pytest.raises(OutcomeUnknown, match="may or may not have committed"):
            with publisher.transaction("res", 5, key="job", owner="a") as cur:
                cur.execute("SELECT 1")
        assert proxy.lost.is_set()
    finally:
        publisher.close()
    assert fences.current("res", key="job") == 5


def test_a_renewal_whose_answer_is_lost_is_sent_again(
    store: LeaseStore, proxy: LostReplyProxy, pg_dsn: str, schema: str
) -> None:
    """Renewing with the same owner and token is harmless twice: sent again, and the lease is kept."""
    holder = _through(proxy, pg_dsn, schema)
    try:
        lease = holder.acquire("job", "worker-a", TTL)
        assert lease is not None
        proxy.lose_reply(after=b"expires_at = pg_catalog.clock_timestamp() + ")
        renewed = holder.renew(lease)
        assert proxy.lost.is_set()
    finally:
        holder.close()
    assert renewed is not None and renewed.token == lease.token and renewed.owner == "worker-a"
