"""One exclusion rule for every grant of a key (issue 38, defects 1-3), through the core API, on the real store.

- A replace is a single-holder grant: refused while another slot of the key is held (defect 1).
- Every grant of a key is decided under one lock, so a single-holder acquire or replace that arrives while a
  slot grant's transaction is still open waits for it and sees it (defect 2), deterministically (the slot
  grant is held open on a connection of the test's own), and under load (slot and single threads churning).
- After the slot count changes, a zombie of a dropped slot is refused by every fence: at once by the fence
  in the store's own schema, and by a fence elsewhere once a holder of the new count published there
  (defect 3); N valid holders of one count never refuse each other.
- A plain key spelled like a slot (``k#2``) shares that slot's row: never two holders of the row, one token
  sequence, and the semaphore has a slot fewer while the plain key holds it (docs/core.md).

The model that drives all of these together is tests/core/test_exclusion_model.py.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extras
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import (
    FenceStore,
    InvalidArgument,
    Lease,
    LeaseStore,
    SlotCountMismatch,
    StaleFencingToken,
)
from airflow_lease_provider.core.dbapi_fence import DbApiFence
from airflow_lease_provider.core.schema import FENCE_ONLY_VERSION, fence_schema_sql
from airflow_lease_provider.core.types import Acquisition
from tests.core.test_exclusion_model import (
    kind_call,
    open_grant_params,
    open_grant_sql,
    wait_answered_or_waiting,
)
from tests.pg import drop_schema, execute, new_schema_name, q
from tests.reliability.dbstate import Rows

TTL = timedelta(minutes=5)
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def rows(pg_dsn: str, schema: str) -> Iterator[Rows]:
    """Every row of the test schema's store tables, read on demand (tests/reliability/dbstate.py)."""
    reader = Rows(pg_dsn, schema)
    yield reader
    reader.close()


def expire(dsn: str, schema: str, lease: Lease) -> None:
    """``lease``'s holder froze past its TTL: its row's expiry moved to now (tests/core/test_concurrency.py)."""
    execute(dsn, q("UPDATE {schema}.lease SET expires_at = clock_timestamp() WHERE key = %s AND token = %s", schema),
            (lease.key, lease.token))


def publish(fence: Any, resource: str, lease: Lease, store_id: str) -> Any:
    """A publish as the Airflow layer makes it: the slot's key, owner, token, store, and the count epoch."""
    return fence.advance(resource, lease.token, key=lease.key, owner=lease.owner, store_id=store_id,
                         count_epoch=lease.count_epoch, base_key=lease.lease_key)


# -- defect 1: a replace is a single-holder grant ---------------------------------------------------------


def test_a_replace_is_refused_while_another_slot_of_the_key_is_held(store: LeaseStore, rows: Rows) -> None:
    a = store.try_acquire("k", "a", TTL, slots=2).lease
    b = store.try_acquire("k", "b", TTL, slots=2).lease
    assert a is not None and b is not None and (a.slot, b.slot) == (1, 2)
    assert store.release(a)
    before = rows()
    with pytest.raises(SlotCountMismatch) as refused:
        store.try_replace("k", "y", TTL, run_after=T0)
    assert [(h.slot, h.owner) for h in refused.value.holders] == [(2, "b")]
    assert "slots=2" in str(refused.value) and "slots=1" in str(refused.value)
    assert rows() == before  # nothing written: the key's own row still says slot 1 of 2
    assert [(h.slot, h.owner) for h in store.slot_holders("k")] == [(2, "b")]
    # Slot 1 held by a semaphore's holder (whose run order is unknown): held, never taken over.
    c = store.try_acquire("k", "c", TTL, slots=2).lease
    assert c is not None and c.slot == 1
    held = store.try_replace("k", "y", TTL, run_after=T0 + timedelta(days=1))
    assert held.lease is None and held.holder is not None and (held.holder.owner, held.holder.slot) == ("c", 1)
    # Once no slot is held the replace is a single holder's grant, and the semaphore then waits for it.
    assert store.release(b) and store.release(c)
    single = store.try_replace("k", "y", TTL, run_after=T0).lease
    assert single is not None and (single.slot, single.slots) == (1, 1) and single.token > c.token
    with pytest.raises(SlotCountMismatch):
        store.try_acquire("k", "d", TTL, slots=2)


def test_a_replace_takes_over_an_older_single_holder_within_its_holding_period(store: LeaseStore) -> None:
    """A takeover is a grant while the key is held with the same count: same count epoch, a larger token."""
    old = store.try_replace("r", "old", TTL, run_after=T0).lease
    new = store.try_replace("r", "new", TTL, run_after=T0 + timedelta(hours=1)).lease
    assert old is not None and new is not None and new.token > old.token
    assert new.count_epoch == old.count_epoch


# -- defect 2: every grant of a key under one lock --------------------------------------------------------


@pytest.mark.parametrize(
    ("open_kind", "other_kind"),
    [("slots2", "single"), ("slots2", "replace"), ("single", "slots2"), ("replace", "slots2")],
)
def test_a_grant_that_arrives_while_another_grant_of_the_key_is_open_waits_for_it_and_sees_it(
    pg_dsn: str, schema: str, store: LeaseStore, open_kind: str, other_kind: str
) -> None:
    """The first grant runs inside a transaction held open on a connection of the test's own (as a slot grant
    that has picked its slot and not committed yet); the second, from the store, must not be granted beside
    it. Before issue 38 a single-holder acquire (or replace) read the live slots without the semaphore's
    lock, did not see the uncommitted slot 2, and was granted: two holders."""
    store.ensure_schema()
    if open_kind == "slots2":
        # Slot 1, briefly, so the open grant takes slot 2. It lapses rather than being released while the open
        # grant holds the key's rows (a release waits for a grant of its key in flight: migration 17).
        first = store.try_acquire("race", "a", timedelta(seconds=1), slots=2).lease
        assert first is not None
    conn = psycopg2.connect(pg_dsn)
    watcher = psycopg2.connect(pg_dsn)
    watcher.autocommit = True
    answer: list[Any] = []
    try:
        with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
            cur.execute(q(open_grant_sql(open_kind), schema), open_grant_params(open_kind, "race", "b", T0))
            opened = dict(cur.fetchone())
        assert opened["acquired"], opened
        if open_kind == "slots2":
            assert opened["slot"] == 2
            _db_clock_past(watcher, first.expires_at)  # slot 1 is free now: only the open slot 2 is left to see
        other = LeaseStore(pg_dsn, schema=schema)
        pid = other.db._connection().get_backend_pid()

        def ask() -> None:
            try:
                answer.append(kind_call(other, other_kind, "race", "c", T0 + timedelta(hours=1)))
            except Exception as exc:  # SlotCountMismatch is the expected answer; anything else is shown below
                answer.append(exc)

        thread = threading.Thread(target=ask)
        thread.start()
        wait_answered_or_waiting(watcher, pid, thread)
        waited = thread.is_alive()
        conn.commit()
        thread.join(timeout=60)
        other.close()
    finally:
        conn.close()
        watcher.close()
    (got,) = answer
    assert not isinstance(got, Acquisition) or got.lease is None, (
        f"{other_kind} granted {got.lease} beside the open {open_kind} grant {opened}"
    )
    if other_kind == "slots2":
        assert isinstance(got, SlotCountMismatch), got  # the single holder that committed refuses the semaphore
    else:
        assert isinstance(got, SlotCountMismatch) and [h.slot for h in got.holders] == [2], got
        assert waited, "the single-holder grant did not wait for the key's open slot grant"
    live = store.slot_holders("race")
    assert [(h.owner, h.slots) for h in live] == [("b", 1 if open_kind != "slots2" else 2)]


def _churn(store: LeaseStore, worker: int, slots: int, seconds: float, start: threading.Barrier,
           out: list[tuple[int, Lease]], errors: list[BaseException]) -> None:
    try:
        start.wait(timeout=60)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                got = store.try_acquire("mix", f"w{worker}", timedelta(seconds=2), slots=slots).lease
            except SlotCountMismatch:
                continue  # the other count holds the key
            if got is None:
                time.sleep(0.002)
                continue
            time.sleep(0.005)
            store.release(got)
            out.append((slots, got))
            if slots > 1:
                time.sleep(0.02)  # so the key is sometimes free of slots, and a single holder gets in
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_slot_and_single_holders_churning_on_one_key_never_hold_it_together(
    pg_dsn: str, schema: str, store: LeaseStore
) -> None:
    """Issue 38's reproduction, shorter: 4 threads acquiring with slots=2 and 2 with a single holder on one
    key. Each grant's hold, by the database clock, from its grant to its release: no single-holder grant
    overlaps a slot grant (at 72519bc about one single grant in four overlapped a live slot 2)."""
    stores = [LeaseStore(pg_dsn, schema=schema) for _ in range(6)]
    start = threading.Barrier(6)
    out: list[tuple[int, Lease]] = []
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_churn, args=(stores[i], i, 2 if i < 4 else 1, 6.0, start, out, errors))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for s in stores:
        s.close()
    assert not errors, errors
    singles = [lease for slots, lease in out if slots == 1]
    semaphore = [lease for slots, lease in out if slots == 2]
    assert len(singles) >= 10 and len(semaphore) >= 10, (len(singles), len(semaphore))
    ended = {}
    for key in ("mix", "mix#2"):
        for e in store.events.query(key=key, kind="released", limit=10_000):
            ended[(key, e.token)] = datetime.fromisoformat(e.detail["released_at"])
    spans = [(lease, lease.acquired_at, ended.get((lease.key, lease.token), lease.expires_at)) for _, lease in out]
    together = [
        (s, t) for s, s_from, s_to in spans if s.slots == 1
        for t, t_from, t_to in spans if t.slots == 2 and s_from < t_to and t_from < s_to
    ]
    assert not together, f"{len(together)} single-holder grants held beside a slot: {together[:3]}"


# -- a renewal that commits after its row's expiry (the cross-row renewal race) --------------------------

#: A deferred constraint trigger of the test's own: a renewal of the row by ``renewer`` waits, at its
#: commit, for an advisory lock the test holds (the renewal's UPDATE is done, its commit is not: a slow
#: durable commit, made deterministic). Only in the test's schema, and the lock is the schema's own (tests
#: running at once on one server must not hold each other's renewals); the schema is dropped afterwards.
HOLD_COMMIT = """
CREATE FUNCTION {schema}.hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(38, pg_catalog.hashtext(TG_TABLE_SCHEMA));
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER hold_commit AFTER UPDATE ON {schema}.lease DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.owner = 'renewer') EXECUTE FUNCTION {schema}.hold_commit();
"""


def _db_clock_past(conn: Any, moment: datetime) -> None:
    """Until the database clock is past ``moment``."""
    with conn.cursor() as cur:
        for _ in range(3000):
            cur.execute("SELECT clock_timestamp() > %s", (moment,))
            if cur.fetchone()[0]:
                return
            time.sleep(0.005)
    raise AssertionError(f"the database clock never passed {moment}")


@pytest.mark.parametrize(
    ("held_as", "asked"),
    [("slots2", "single"), ("slots2", "replace"), ("slots2", "slots3"), ("single", "slots2"),
     ("replace", "slots2"), ("slot1", "single"), ("slot1", "replace")],
)
def test_a_renewal_that_commits_after_its_rows_expiry_is_seen_by_a_grant_of_the_key(
    pg_dsn: str, schema: str, store: LeaseStore, held_as: str, asked: str
) -> None:
    """A holder renews just before its row's expiry and the renewal's commit lands after it (held at its
    commit by a lock of the test's own); meanwhile another count's grant of the key is asked for just after
    the expiry. Its answer must not be a grant beside the renewed holder: it waits for the renewal and then
    sees it (docs/core.md, "Who may hold a key": a renewal under the key's rule). Before migration 17 a grant
    read the other rows of the key without locking them, found the renewing row expired (its renewal
    not committed yet) and was granted: two holders of different counts, both valid."""
    store.ensure_schema()
    short = timedelta(seconds=1.5)
    if held_as == "slots2":
        first = store.try_acquire("rk", "a", TTL, slots=2).lease
        held = store.try_acquire("rk", "renewer", short, slots=2).lease
        assert first is not None and held is not None and (held.key, held.slot) == ("rk#2", 2)
        assert store.release(first)  # only the renewing slot 2 is left
    elif held_as == "slot1":
        # A semaphore's slot 1 (the key's own row) renewing against a single-holder grant, which locks only
        # the other rows of the key and leaves its own row to the statement that grants it.
        held = store.try_acquire("rk", "renewer", short, slots=2).lease
    elif held_as == "replace":
        held = store.try_replace("rk", "renewer", short, run_after=T0).lease
    else:
        held = store.try_acquire("rk", "renewer", short).lease
    assert held is not None
    execute(pg_dsn, q(HOLD_COMMIT, schema))
    gate = psycopg2.connect(pg_dsn)
    gate.autocommit = True
    watcher = psycopg2.connect(pg_dsn)
    watcher.autocommit = True
    renewing = LeaseStore(pg_dsn, schema=schema)
    asking = LeaseStore(pg_dsn, schema=schema)
    renewed: list[Any] = []
    answer: list[Any] = []

    def renew() -> None:
        try:
            renewed.append(renewing.renew(held, timedelta(minutes=5)))
        except Exception as exc:  # shown by the assertions below
            renewed.append(exc)

    def ask() -> None:
        try:
            answer.append(kind_call(asking, asked, "rk", "c", T0 + timedelta(hours=1)))
        except Exception as exc:  # SlotCountMismatch is the expected answer
            answer.append(exc)

    renewing_pid = renewing.db._connection().get_backend_pid()
    asking_pid = asking.db._connection().get_backend_pid()
    try:
        with gate.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(38, hashtext(%s))", (schema,))
        renewer = threading.Thread(target=renew)
        renewer.start()
        # The renewal's UPDATE is done (before the expiry) and its commit waits for the gate.
        wait_answered_or_waiting(watcher, renewing_pid, renewer)
        assert renewer.is_alive(), f"the renewal did not wait at its commit: {renewed}"
        _db_clock_past(watcher, held.expires_at)
        asker = threading.Thread(target=ask)
        asker.start()
        wait_answered_or_waiting(watcher, asking_pid, asker)
        with gate.cursor() as cur:
            cur.execute("SELECT pg_advisory_unlock(38, hashtext(%s))", (schema,))  # the renewal commits
        renewer.join(timeout=60)
        asker.join(timeout=60)
    finally:
        renewing.close()
        asking.close()
        gate.close()
        watcher.close()
    (renewal,) = renewed
    (got,) = answer
    assert isinstance(renewal, Lease) and renewal.token == held.token, renewal
    assert not isinstance(got, Acquisition) or got.lease is None, (
        f"{asked} granted {got.lease} beside the renewed {held_as} holder {renewal}"
    )
    if held_as == "slot1":
        # Slot 1 held answers a single-holder acquire or replace as a held lease (docs/core.md).
        assert isinstance(got, Acquisition) and got.holder is not None and got.holder.owner == "renewer", got
    else:
        assert isinstance(got, SlotCountMismatch), got
    live = store.slot_holders("rk")
    assert [(h.owner, h.slot, h.token) for h in live] == [("renewer", held.slot, held.token)]


# -- defect 3: a zombie of a dropped slot -----------------------------------------------------------------


@pytest.fixture(params=["store", "elsewhere", "sqlite", "postgres"])
def fence(request: pytest.FixtureRequest, pg_dsn: str, schema: str, tmp_path: Path) -> Iterator[Any]:
    """Each fence a publish can go to: the one in the lease store's own schema, a fence-only PostgreSQL
    schema, the DB-API fence on a SQLite file and on PostgreSQL."""
    if request.param == "store":
        fences = FenceStore(pg_dsn, schema=schema)
        yield fences
        fences.close()
    elif request.param == "elsewhere":
        other = new_schema_name()
        fences = FenceStore(pg_dsn, schema=other, fence_only=True)
        yield fences
        fences.close()
        drop_schema(pg_dsn, other)
    elif request.param == "sqlite":
        yield DbApiFence(lambda: sqlite3.connect(tmp_path / "fence.db", timeout=30), dialect="sqlite",
                         where="sqlite 'fence.db'")
    else:
        other = new_schema_name()
        execute(pg_dsn, sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(other)))
        yield DbApiFence(lambda: psycopg2.connect(pg_dsn), dialect="postgres", where="postgres", schema=other)
        drop_schema(pg_dsn, other)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (3, 2)])
def test_a_zombie_of_a_slot_dropped_by_a_lower_count_is_refused_by_every_fence(
    pg_dsn: str, schema: str, store: LeaseStore, fence: Any, before: int, after: int
) -> None:
    """Z holds the key's last slot and freezes past its TTL; the others end; the count goes ``before`` ->
    ``after``; a holder of the new count publishes; Z wakes and publishes under its slot's key, which is
    never granted again. Refused (at 72519bc: accepted by every fence)."""
    in_store = isinstance(fence, FenceStore) and not fence.fence_only
    sid = store.store_id
    held = [store.try_acquire("sem", f"h{i}", TTL, slots=before).lease for i in range(before)]
    assert all(h is not None for h in held)
    zombie = held[-1]
    assert zombie is not None and zombie.slot == before
    for h in held:
        assert h is not None and publish(fence, "r", h, sid).accepted  # N valid holders never refuse each other
    for h in held[:-1]:
        assert h is not None and store.release(h)
    expire(pg_dsn, schema, zombie)
    new = store.try_acquire("sem", "p", TTL, slots=after).lease
    assert new is not None and new.slots == after
    assert new.count_epoch >= zombie.token and new.token > new.count_epoch
    if in_store:
        # Kept in the issuing store: refused at once, before anyone of the new count published.
        early = publish(fence, "r", zombie, sid)
        assert early.outcome == "count_epoch" and early.newest_grant == new.count_epoch, early
    assert publish(fence, "r", new, sid).accepted
    late = publish(fence, "r", zombie, sid)
    assert late.outcome == "count_epoch" and late.reason == "count_epoch", late
    with pytest.raises(StaleFencingToken, match="later holding period") as raised:
        fence.guard("r", zombie.token, key=zombie.key, owner=zombie.owner, store_id=sid,
                    count_epoch=zombie.count_epoch, base_key=zombie.lease_key)
    assert raised.value.reason == "count_epoch" and raised.value.newest == new.count_epoch
    with pytest.raises(StaleFencingToken):
        with fence.transaction("r", zombie.token, key=zombie.key, owner=zombie.owner, store_id=sid,
                               count_epoch=zombie.count_epoch, base_key=zombie.lease_key):
            pass
    # The new count's holders keep publishing, and so does the zombie's slot... never again: it is not granted.
    assert publish(fence, "r", new, sid).accepted
    second = store.try_acquire("sem", "q", TTL, slots=after).lease if after > 1 else None
    if second is not None:
        assert second.count_epoch == new.count_epoch and publish(fence, "r", second, sid).accepted


def test_a_single_holder_keys_publishes_decide_the_same_with_or_without_the_count_epoch(
    store: LeaseStore, tmp_path: Path
) -> None:
    """A core caller that names no count epoch keeps the rule of before version 15: for a key that only ever
    has single holders, naming it changes no decision (the per-key token order already refuses every holder
    the count epoch would)."""
    plain = DbApiFence(lambda: sqlite3.connect(tmp_path / "plain.db"), dialect="sqlite", where="sqlite")
    named = DbApiFence(lambda: sqlite3.connect(tmp_path / "named.db"), dialect="sqlite", where="sqlite")
    grants = []
    for owner in ("a", "b", "a", "c"):
        lease = store.acquire("single", owner, TTL)
        assert lease is not None
        grants.append(lease)
        assert store.release(lease)
    order = [0, 1, 0, 2, 3, 1, 3, 2, 0]
    without = [plain.advance("r", grants[i].token, key="single", owner=grants[i].owner) for i in order]
    with_epoch = [
        named.advance("r", grants[i].token, key="single", owner=grants[i].owner,
                      count_epoch=grants[i].count_epoch, base_key="single")
        for i in order
    ]
    expected = [True, True, False, True, True, False, True, False, False]
    assert [d.accepted for d in without] == [d.accepted for d in with_epoch] == expected
    # The refusals say why: an older token of the key, or one at or below a later holder's count epoch.
    assert {d.outcome for d in without if not d.accepted} == {"stale"}
    assert {d.outcome for d in with_epoch if not d.accepted} <= {"stale", "count_epoch"}


# -- the count epoch ---------------------------------------------------------------------------------------


def test_the_count_epoch_of_each_grant(store: LeaseStore) -> None:
    first = store.acquire("e", "a", TTL)
    assert first is not None and (first.token, first.count_epoch) == (1, 0)  # a new key: tokens as before
    again = store.acquire("e", "a", TTL)  # the owner re-entering while it holds: the same holding period
    assert again is not None and (again.token, again.count_epoch) == (2, 0)
    assert store.release(again)
    later = store.acquire("e", "b", TTL)  # taken up afresh: a new period above every token of the key
    assert later is not None and (later.token, later.count_epoch) == (3, 2)
    now = store.holder("e")
    assert now is not None and (now.owner, now.token, now.count_epoch) == ("b", 3, 2)
    assert store.renew(later).count_epoch == 2  # type: ignore[union-attr]
    assert store.release(later)
    # The count goes 1 -> 3: every slot's first token is above the key's last.
    slots = [store.try_acquire("e", f"s{i}", TTL, slots=3).lease for i in range(3)]
    assert all(s is not None and s.count_epoch == 3 and s.token > 3 for s in slots)
    assert [s.key for s in slots if s] == ["e", "e#2", "e#3"]
    assert [h.count_epoch for h in store.slot_holders("e")] == [3, 3, 3]
    # One slot freed and granted again while the others hold: the same period.
    assert slots[0] is not None and store.release(slots[0])
    refill = store.try_acquire("e", "s4", TTL, slots=3).lease
    assert refill is not None and refill.slot == 1 and refill.count_epoch == 3
    assert Lease.from_dict(refill.to_dict()).count_epoch == 3


def test_the_count_epoch_a_publish_names_is_checked_and_a_bad_one_writes_nothing(
    store: LeaseStore, fences: FenceStore, rows: Rows
) -> None:
    lease = store.try_acquire("v", "o", TTL, slots=2).lease
    lease2 = store.try_acquire("v", "o2", TTL, slots=2).lease
    assert lease is not None and lease2 is not None
    before = rows()
    bad: list[tuple[str, dict[str, Any]]] = [
        ("count_epoch", {"count_epoch": lease2.token}),  # not below the token
        ("count_epoch", {"count_epoch": -1}),
        ("count_epoch", {"count_epoch": True}),
        ("count_epoch", {"count_epoch": "0"}),
        ("base_key", {"base_key": "v"}),  # without a count epoch
        ("base_key", {"count_epoch": 0, "base_key": "w"}),  # not the key whose slot v#2 is
        ("base_key", {"count_epoch": 0, "base_key": "v#"}),
    ]
    for parameter, extra in bad:
        with pytest.raises(InvalidArgument) as refused:
            fences.advance("res", lease2.token, key=lease2.key, owner=lease2.owner, **extra)
        assert refused.value.parameter == parameter, (extra, refused.value)
    assert rows() == before
    assert fences.advance("res", lease2.token, key="v#2", owner="o2", count_epoch=0, base_key="v").accepted


def test_a_fence_only_target_of_version_10_is_upgraded_to_keep_count_epochs(pg_dsn: str) -> None:
    name = new_schema_name()
    try:
        execute(pg_dsn, sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        execute(pg_dsn, q(fence_schema_sql(), name))
        execute(pg_dsn, q("INSERT INTO {schema}.fence_schema_version (version, name) VALUES (10, 'fence_only')", name))
        execute(pg_dsn, q("INSERT INTO {schema}.fence (resource, key, token, accepted_at) VALUES ('r', 'k', 4, now())",
                          name))
        fences = FenceStore(pg_dsn, schema=name, fence_only=True)
        try:
            assert fences.ensure_schema() == FENCE_ONLY_VERSION == 20
            assert fences.current("r", key="k") == 4  # kept
            assert fences.advance("r", 9, key="k#2", count_epoch=7, base_key="k").accepted
            assert fences.advance("r", 6, key="k", count_epoch=0).outcome == "count_epoch"
        finally:
            fences.close()
        versions = execute(pg_dsn, q("SELECT version FROM {schema}.fence_schema_version ORDER BY 1", name))
        assert versions == [(10,), (15,), (20,)]
    finally:
        drop_schema(pg_dsn, name)


# -- a plain key spelled like a slot ---------------------------------------------------------------------


def test_a_plain_key_spelled_like_a_slot_shares_its_row_and_never_a_holder(store: LeaseStore) -> None:
    """``k#2`` held as a key of its own is the row of slot 2 of ``k``: the two are never held at once, share
    one token sequence (so one fence key orders them), and the semaphore has a slot fewer meanwhile."""
    plain = store.acquire("s#2", "plain", TTL)
    assert plain is not None and (plain.slot, plain.slots) == (1, 1)
    one = store.try_acquire("s", "a", TTL, slots=2).lease
    assert one is not None and one.slot == 1
    full = store.try_acquire("s", "b", TTL, slots=2)  # slot 2's row is held as the plain key
    assert full.lease is None and [h.owner for h in full.holders] == ["a"]
    assert [(h.owner, h.token) for h in store.slot_holders("s")] == [("a", one.token)]
    # The plain key is another key: a single holder of "s" is judged by the semaphore's own slots.
    assert store.release(one)
    single = store.acquire("s", "c", TTL)
    assert single is not None and single.slots == 1
    assert store.release(single) and store.release(plain)
    two = [store.try_acquire("s", f"x{i}", TTL, slots=2).lease for i in range(2)]
    assert two[1] is not None and two[1].key == "s#2" and two[1].token > plain.token  # one sequence per row
    assert store.acquire("s#2", "plain", TTL) is None  # and the slot's holder keeps the row


def test_the_store_fence_keeps_a_plain_keys_holding_period_when_its_row_becomes_another_keys_slot(
    pg_dsn: str, schema: str, store: LeaseStore
) -> None:
    """The plain key ``a#2`` is held with 3 slots (Z: slot 2, row ``a#2#2``, freezes past its TTL), then by
    single holders (a later holding period, whose count epoch is at or above Z's token), then its row ``a#2``
    is granted as slot 2 of ``a``. Z's publish to the fence in the store's own schema is refused at once: the
    key's count epoch is kept per key, not only on its row, which now says ``a``'s (at 00b50b3: accepted,
    the model's finding; docs/reliability.md)."""
    sid = store.store_id
    held = [store.try_acquire("a#2", f"h{i}", TTL, slots=3).lease for i in range(3)]
    assert all(h is not None for h in held)
    zombie = held[1]
    assert zombie is not None and (zombie.key, zombie.slot, zombie.lease_key) == ("a#2#2", 2, "a#2")
    for h in (held[0], held[2]):
        assert h is not None and store.release(h)
    expire(pg_dsn, schema, zombie)
    singles = []
    for owner in ("s1", "s2"):
        single = store.acquire("a#2", owner, TTL)
        assert single is not None and single.slots == 1 and single.count_epoch >= zombie.token
        singles.append(single)
        assert store.release(single)
    first = store.try_acquire("a", "x1", TTL, slots=2).lease
    second = store.try_acquire("a", "x2", TTL, slots=2).lease
    assert first is not None and first.key == "a"
    assert second is not None and (second.key, second.slot, second.lease_key) == ("a#2", 2, "a")
    fences = FenceStore(pg_dsn, schema=schema)
    try:
        early = publish(fences, "r", zombie, sid)
        assert early.outcome == "count_epoch" and early.newest_grant == singles[-1].count_epoch, early
        # The valid holders of ``a`` are not refused by it.
        assert publish(fences, "r", first, sid).accepted and publish(fences, "r", second, sid).accepted
        assert publish(fences, "r", zombie, sid).outcome == "count_epoch"
    finally:
        fences.close()
    # Only the key spelled like a slot keeps its epoch apart; ``a`` (its own row is never another key's) writes
    # nothing more.
    kept = execute(pg_dsn, q("SELECT key, count_epoch FROM {schema}.lease_key_epoch ORDER BY key", schema))
    assert kept == [("a#2", singles[-1].count_epoch)]
