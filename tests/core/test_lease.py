"""Lease semantics against a real PostgreSQL: acquire, holder, renew, release, force-release."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from airflow_lease_provider.core import EventKind, LeaseStore
from tests.pg import execute, q

TTL = timedelta(seconds=30)


def test_acquire_free_key_then_held(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="run-1", ttl=TTL)
    assert lease is not None
    assert (lease.key, lease.owner, lease.token) == ("job", "run-1", 1)
    assert abs(lease.expires_at - lease.acquired_at - TTL) < timedelta(milliseconds=5)
    assert lease.held

    outcome = store.try_acquire("job", owner="run-2", ttl=TTL)
    assert outcome.lease is None
    assert outcome.holder is not None
    assert (outcome.holder.owner, outcome.holder.token) == ("run-1", 1)
    assert timedelta(seconds=25) < outcome.holder.remaining <= TTL
    assert "run-1" in outcome.holder.describe() and "token 1" in outcome.holder.describe()
    assert store.acquire("job", owner="run-2", ttl=TTL) is None
    holder = store.holder("job")
    assert holder is not None and (holder.owner, holder.token, holder.expires_at) == ("run-1", 1, lease.expires_at)


def test_holder_is_none_for_unknown_and_released_keys(store: LeaseStore) -> None:
    assert store.holder("never") is None
    lease = store.acquire("job", owner="a", ttl=TTL)
    assert lease is not None
    assert store.holder("job") is not None
    assert store.release(lease) is True
    assert store.holder("job") is None


def test_same_owner_reacquires_with_a_larger_token(store: LeaseStore) -> None:
    first = store.acquire("job", owner="dag/run-1", ttl=TTL)
    again = store.acquire("job", owner="dag/run-1", ttl=TTL)
    assert first is not None and again is not None
    assert again.token > first.token
    # The earlier attempt's lease is now stale: it can neither renew nor release.
    assert store.renew(first) is None
    assert store.release(first) is False
    assert store.holder("job").token == again.token


def test_release_and_renew_with_stale_owner_or_token_are_no_ops(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=TTL)
    assert lease is not None
    wrong_owner = lease.__class__(**{**lease.__dict__, "owner": "b"})
    wrong_token = lease.__class__(**{**lease.__dict__, "token": lease.token + 5})
    assert store.release(wrong_owner) is False
    assert store.release(wrong_token) is False
    assert store.renew(wrong_owner) is None
    assert store.renew(wrong_token) is None
    still = store.holder("job")
    assert still is not None and (still.owner, still.token, still.expires_at) == ("a", lease.token, lease.expires_at)


def test_renew_extends_from_database_now(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=2))
    assert lease is not None
    time.sleep(0.3)
    renewed = store.renew(lease, ttl=timedelta(seconds=10))
    assert renewed is not None
    assert renewed.token == lease.token
    assert abs(renewed.expires_at - renewed.renewed_at - timedelta(seconds=10)) < timedelta(milliseconds=5)
    assert renewed.renewed_at > lease.renewed_at


def test_expiry_lets_the_next_owner_in_and_renew_after_steal_is_none(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=1))
    assert lease is not None
    assert store.acquire("job", owner="b", ttl=TTL) is None
    time.sleep(1.2)
    # Expired but not yet taken: a renewal still never brings it back.
    assert store.renew(lease) is None
    taker = store.acquire("job", owner="b", ttl=TTL)
    assert taker is not None and taker.token == lease.token + 1
    assert store.renew(lease) is None
    assert store.release(lease) is False
    assert store.holder("job").owner == "b"


def test_release_after_release_is_false(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=TTL)
    assert lease is not None
    assert store.release(lease) is True
    assert store.release(lease) is False
    nxt = store.acquire("job", owner="b", ttl=TTL)
    assert nxt is not None and nxt.token == lease.token + 1


def test_force_release_frees_and_bumps_the_token(store: LeaseStore) -> None:
    assert store.force_release("never-acquired") is None
    lease = store.acquire("job", owner="a", ttl=TTL)
    assert lease is not None
    before = store.force_release("job", by="alice", reason="stuck")
    assert before is not None and before.owner == "a" and before.token == lease.token
    assert store.holder("job") is None
    assert store.renew(lease) is None
    assert store.release(lease) is False
    nxt = store.acquire("job", owner="b", ttl=TTL)
    assert nxt is not None and nxt.token == lease.token + 2  # one for the force-release, one for acquire
    forced = store.events.query(key="job", kind=EventKind.FORCE_RELEASED)
    assert len(forced) == 1 and forced[0].detail["by"] == "alice" and forced[0].detail["new_token"] == lease.token + 1


def test_force_release_logs_who_did_it_on_one_line_whatever_they_typed(store: LeaseStore,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """``by`` comes from the CLI's ``--by`` or the UI user's name: a newline in it must not forge a log line."""
    assert store.acquire("job", owner="dag/run/t", ttl=TTL) is not None
    forged = "mallory\nCRITICAL airflow.security: admin logged in from 10.0.0.1"
    with caplog.at_level("WARNING", logger="airflow_lease_provider.core.lease"):
        assert store.force_release("job", by=forged, reason="x") is not None
    lines = [r.getMessage() for r in caplog.records if "force-released" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "'mallory\\nCRITICAL" in lines[0], lines


def test_events_record_acquire_and_release_but_not_failed_attempts(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=TTL)
    assert lease is not None
    for _ in range(5):
        assert store.acquire("job", owner="b", ttl=TTL) is None
    store.release(lease)
    kinds = [e.kind for e in reversed(store.events.query(key="job"))]
    assert kinds == ["acquired", "released"]
    released = store.events.query(key="job", kind="released")[0]
    assert released.owner == "a" and released.token == lease.token and released.detail["held_seconds"] >= 0


def test_event_write_failure_never_breaks_the_lease_path(store: LeaseStore, pg_dsn: str) -> None:
    store.ensure_schema()
    # Break the ledger on purpose: the lease operations must still work and report truthfully.
    execute(pg_dsn, q('ALTER TABLE {schema}.event RENAME TO event_gone', store.schema))
    lease = store.acquire("job", owner="a", ttl=TTL)
    assert lease is not None and lease.token == 1
    assert store.release(lease) is True
    assert store.events.record("skipped_overlap", "job", owner="b") is False


def test_leases_lists_every_key(store: LeaseStore) -> None:
    a = store.acquire("a", owner="x", ttl=TTL)
    store.acquire("b", owner="y", ttl=TTL)
    assert a is not None
    store.release(a)
    listed = {lease.key: lease.held for lease in store.leases()}
    assert listed == {"a": False, "b": True}


def test_lease_round_trips_through_a_dict(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=TTL)
    assert lease is not None
    assert lease.__class__.from_dict(lease.to_dict()) == lease


def test_unreachable_store_fails_closed_quickly() -> None:
    from airflow_lease_provider.core import LeaseStoreUnavailable

    # A port nothing listens on: refused at once. Fail closed, with the library's own error.
    dead = LeaseStore("postgresql://postgres@127.0.0.1:1/none", connect_timeout=timedelta(seconds=2))
    started = time.monotonic()
    with pytest.raises(LeaseStoreUnavailable) as info:
        dead.acquire("job", owner="a", ttl=TTL)
    assert time.monotonic() - started < 10
    assert "unreachable" in str(info.value)


def test_error_messages_never_show_the_password() -> None:
    from airflow_lease_provider.core import LeaseStoreUnavailable

    dead = LeaseStore("postgresql://postgres:s3cret-pw@127.0.0.1:1/none", connect_timeout=timedelta(seconds=2))
    with pytest.raises(LeaseStoreUnavailable) as info:
        dead.holder("job")
    assert "s3cret-pw" not in str(info.value)


def test_the_ledger_can_be_the_first_thing_used(pg_dsn: str, schema: str) -> None:
    fresh = LeaseStore(pg_dsn, schema=schema)
    assert fresh.events.query() == []
    assert fresh.events.record("skipped_catchup", "job", detail={"count": 3}) is True
    assert fresh.events.query(kind="skipped_catchup")[0].detail == {"count": 3}


def test_the_host_that_acquired_a_lease_is_recorded_and_found_by_its_holder(pg_dsn, schema) -> None:
    worker_a = LeaseStore(pg_dsn, schema=schema, host="worker-a.example")
    worker_b = LeaseStore(pg_dsn, schema=schema, host="worker-b.example")
    try:
        lease = worker_a.acquire("nightly", "etl/run-1", timedelta(seconds=30))
        assert lease is not None
        outcome = worker_b.try_acquire("nightly", "etl/run-2", timedelta(seconds=30))
        assert outcome.holder is not None and outcome.holder.token == lease.token
        assert worker_b.holder_host(outcome.holder) == "worker-a.example"
        # A re-entry by the same owner elsewhere (a retry on another worker) is found with its own token.
        again = worker_b.acquire("nightly", "etl/run-1", timedelta(seconds=30))
        assert again is not None and worker_a.holder_host(again) == "worker-b.example"
    finally:
        worker_a.close()
        worker_b.close()
