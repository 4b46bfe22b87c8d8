"""When the keeper says a lease is gone: counted from when the lease was read, never from the keeper.

The local deadline is the monotonic clock just before the request that produced the lease state, plus the
database's figure of the time left in that state. A pause between acquire and ``keep()``, a join with
little time left, or a slow reply can only make the deadline early, never late (issue 10, item 2).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import psycopg2
import pytest

from airflow_lease_provider.core import EventKind, InvalidArgument, Lease, LeaseKeeper, LeaseLost, LeaseStore
from tests.pg import execute, q


def test_a_lease_kept_after_a_pause_longer_than_its_time_left_is_lost_before_the_body_runs(
    store: LeaseStore,
) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=2))
    assert lease is not None
    time.sleep(1.9)  # a slow XCom push, a GC pause: past TTL minus the 0.2 s margin, still before expiry
    lost: list[LeaseLost] = []
    keeper = store.keep(lease, on_lost=lost.append)
    try:
        # Before the body's first line: check() raises, and on_lost has already been called.
        with pytest.raises(LeaseLost, match="before the lease would expire"):
            keeper.check()
        assert len(lost) == 1 and lost[0].token == lease.token
        assert keeper.time_left() == timedelta(0)
        time.sleep(0.3)
        thief = store.acquire("job", owner="b", ttl=timedelta(seconds=30))
        assert thief is not None  # the lease really ran out: the keeper was right to stop
        assert keeper.renewals == 0 and keeper.lost
    finally:
        keeper.stop()
    events = store.events.query(key="job", kind=EventKind.LOST)
    assert len(events) == 1 and events[0].token == lease.token


def test_a_pause_shorter_than_the_time_left_still_counts_against_the_lease(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=4))
    assert lease is not None
    time.sleep(1.5)
    keeper = LeaseKeeper(store, lease)  # not started: nothing renews, the deadline is the acquire's
    keeper.check()
    # 4 s TTL - 1.5 s pause - 0.4 s margin: about 2.1 s left, not the 3.6 s a count from construction gives.
    time.sleep(2.3)
    with pytest.raises(LeaseLost):
        keeper.check()
    keeper.stop()
    fresh = LeaseKeeper(store, lease)
    assert fresh.time_left() == timedelta(0) and fresh.lost


def _thief(store: LeaseStore, key: str, until: float, got: list[tuple[float, Lease]]) -> None:
    while time.monotonic() < until and not got:
        lease = store.acquire(key, owner="thief", ttl=timedelta(seconds=30))
        if lease is not None:
            got.append((time.monotonic(), lease))
        time.sleep(0.02)


def test_joining_a_lease_with_0_4_s_left_renews_in_time(store: LeaseStore, pg_dsn: str) -> None:
    """A task that joins a run lease (reads its holder) with 0.4 s left keeps it: the first renewal comes
    before the point of loss instead of one renewal interval (TTL/3 = 0.67 s) later."""
    lease = store.acquire("run", owner="run-1", ttl=timedelta(seconds=2))
    assert lease is not None
    time.sleep(1.4)
    joined = store.holder("run")
    while joined is not None and joined.remaining > timedelta(seconds=0.42):
        time.sleep(0.005)
        joined = store.holder("run")
    assert joined is not None and joined.owner == "run-1"
    assert 0.3 < joined.remaining.total_seconds() <= 0.42, joined.remaining  # the margin is 0.2 s
    lost: list[LeaseLost] = []
    thief_store = LeaseStore(pg_dsn, schema=store.schema)
    stolen: list[tuple[float, Lease]] = []
    with store.keep(joined, on_lost=lost.append) as keeper:
        thief = threading.Thread(target=_thief, args=(thief_store, "run", time.monotonic() + 2.0, stolen))
        thief.start()
        thief.join()
        assert keeper.renewals >= 1
        assert lost == [] and not keeper.lost
        keeper.check()
    thief_store.close()
    assert stolen == [], "another owner took the lease while the joined task kept running"


@pytest.fixture
def row_lock(pg_dsn: str, store: LeaseStore) -> Iterator[psycopg2.extensions.connection]:
    """A second session that can hold the lease row locked (an admin's SELECT ... FOR UPDATE)."""
    store.ensure_schema()
    conn = psycopg2.connect(pg_dsn)
    try:
        yield conn
    finally:
        conn.rollback()
        conn.close()


def test_a_joined_lease_whose_renewal_hangs_is_lost_at_its_deadline_not_after_the_renewal(
    store: LeaseStore, row_lock: psycopg2.extensions.connection
) -> None:
    """The keeper's thread wakes up for the deadline itself: on_lost fires at the point of loss even while
    the renewal is stuck behind a row lock, and the late renewal never brings the lease back."""
    lease = store.acquire("run", owner="run-1", ttl=timedelta(seconds=3))
    assert lease is not None
    with row_lock.cursor() as cur:
        cur.execute(q("SELECT 1 FROM {schema}.lease WHERE key = %s FOR UPDATE", store.schema), ("run",))
    time.sleep(2.3)
    joined = store.holder("run")  # a plain read is not blocked by the lock
    assert joined is not None
    lost_at: list[float] = []
    started = time.monotonic()
    keeper = store.keep(joined, on_lost=lambda exc: lost_at.append(time.monotonic()))
    try:
        # 0.7 s left minus the 0.3 s margin: lost about 0.4 s after the join; never as late as the
        # first renewal interval (1 s) or the renewal's statement timeout (5 s).
        deadline = started + 1.0
        while not lost_at and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost_at, "on_lost was not called at the deadline"
        assert lost_at[0] - started < 0.8
        row_lock.commit()  # the hung renewal goes through now (the lease had not expired for the database)
        time.sleep(0.5)
        assert keeper.lost  # and is not taken as a reason to resurrect the lease
    finally:
        keeper.stop()


@pytest.mark.parametrize("delay", ["slow-reply", "row-lock"])
def test_a_slow_renewal_does_not_extend_the_deadline_by_its_own_delay(
    store: LeaseStore, pg_dsn: str, row_lock: psycopg2.extensions.connection, delay: str
) -> None:
    """A renewal that takes 2.5 s (its reply held back after the database computed the time left, or the
    statement waiting on a row lock first) leaves a deadline counted from before it was sent."""
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=4))
    assert lease is not None
    if delay == "slow-reply":
        # An AFTER trigger runs once the row (and the RETURNING figure) is computed, before the reply.
        execute(pg_dsn, q(
            "CREATE FUNCTION {schema}.slow_reply() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(2.5); RETURN NULL; END $$", store.schema,
        ))
        execute(pg_dsn, q(
            "CREATE TRIGGER slow_reply AFTER UPDATE ON {schema}.lease FOR EACH ROW "
            "EXECUTE FUNCTION {schema}.slow_reply()", store.schema,
        ))
    else:
        with row_lock.cursor() as cur:
            cur.execute(q("SELECT 1 FROM {schema}.lease WHERE key = %s FOR UPDATE", store.schema), ("job",))
        threading.Timer(2.5, row_lock.commit).start()
    before = time.monotonic()
    renewed = store.renew(lease)
    took = time.monotonic() - before
    assert renewed is not None and took >= 2.4
    # The truth, by the database clock: how long the renewed lease has left now.
    (left_now,) = execute(
        pg_dsn, q("SELECT extract(epoch FROM expires_at - clock_timestamp()) FROM {schema}.lease WHERE key = %s",
                  store.schema), ("job",),
    )[0]
    keeper = LeaseKeeper(store, renewed)
    margin = keeper.safety_margin.total_seconds()
    # By the database's own figure the keeper must give up margin seconds before the lease expires.
    time.sleep(max(0.0, float(left_now) - margin + 0.05))
    with pytest.raises(LeaseLost):
        keeper.check()
    keeper.stop()


def test_a_lease_rebuilt_from_a_dict_is_renewed_before_the_keeper_trusts_it(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=3))
    assert lease is not None
    rebuilt = Lease.from_dict(lease.to_dict())  # what a downstream task gets from XCom
    assert rebuilt == lease
    time.sleep(1.5)
    keeper = LeaseKeeper(store, rebuilt)
    assert keeper.renewals == 1 and not keeper.lost
    assert keeper.time_left() > timedelta(seconds=2.4)  # counted from the renewal, not from the dict
    assert rebuilt.sent_at is None and "sent_at" not in lease.to_dict()
    keeper.stop()

    # The same from a lease that has meanwhile been taken: lost at once, nothing renewed.
    store.force_release("job", by="test")
    assert store.acquire("job", owner="b", ttl=timedelta(seconds=30)) is not None
    stale = LeaseKeeper(store, rebuilt)
    with pytest.raises(LeaseLost, match="renewal refused"):
        stale.check()
    stale.stop()
    assert store.holder("job").owner == "b"


def test_renew_every_near_the_ttl_is_refused_naming_the_ttl_and_the_margin(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=30))
    assert lease is not None
    # The keeper gives up at TTL - margin (30 s - 3 s) without a renewal: a renewal due then never helps.
    for bad in (timedelta(seconds=27), timedelta(seconds=29), timedelta(seconds=30)):
        with pytest.raises(InvalidArgument) as info:
            store.keep(lease, renew_every=bad)
        assert info.value.parameter == "renew_every"
        assert "0:00:30" in str(info.value) and "0:00:03" in str(info.value), str(info.value)
    with pytest.raises(InvalidArgument, match="renew_every"):
        LeaseKeeper(store, lease, renew_every=timedelta(seconds=20), safety_margin=timedelta(seconds=10))
    keeper = LeaseKeeper(store, lease, renew_every=timedelta(seconds=26.9))
    assert keeper.renew_every == timedelta(seconds=26.9)
    keeper.stop()


def test_a_lease_without_local_timing_and_an_unreachable_store_is_lost_at_once(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=30))
    assert lease is not None
    with socket.socket() as probe:  # a port nobody listens on: connections are refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nowhere = LeaseStore(f"postgresql://postgres@127.0.0.1:{port}/test", schema=store.schema, record_events=False)
    keeper = LeaseKeeper(nowhere, Lease.from_dict(lease.to_dict()))
    with pytest.raises(LeaseLost, match="could not be confirmed"):
        keeper.check()  # it cannot prove any time is left, so it does not pretend there is
    keeper.stop()
    assert LeaseKeeper(store, lease).time_left() > timedelta(seconds=25)  # the lease itself is fine
