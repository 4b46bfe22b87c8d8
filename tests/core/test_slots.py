"""Semaphores: ``try_acquire(..., slots=N)``, at most N holders of a key at once (issue 26 item 3).

Each holder has its own slot and token; tokens strictly increase per (key, slot), and a holder fences,
renews and releases under its slot's row key, so N valid holders never refuse each other at a fence while
a zombie of a slot is refused after a newer holder of that slot published.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from datetime import datetime, timedelta

import pytest

from airflow_lease_provider.core import (
    FenceStore,
    InvalidArgument,
    LeaseStore,
    SlotCountMismatch,
    StaleFencingToken,
)
from airflow_lease_provider.core.types import slot_key

TTL = timedelta(minutes=5)


def test_three_slots_three_holders_and_the_fourth_is_told_all_three(store: LeaseStore) -> None:
    got = [store.try_acquire("sem", f"run-{i}", TTL, slots=3) for i in range(4)]
    held = [a.lease for a in got[:3]]
    assert all(lease is not None for lease in held)
    assert [(lease.slot, lease.slots, lease.key) for lease in held if lease] == [
        (1, 3, "sem"), (2, 3, "sem#2"), (3, 3, "sem#3")
    ]
    assert [lease.lease_key for lease in held if lease] == ["sem"] * 3
    refused = got[3]
    assert refused.lease is None
    assert [(h.slot, h.owner) for h in refused.holders] == [(1, "run-0"), (2, "run-1"), (3, "run-2")]
    assert refused.holder is not None and refused.holder.describe().startswith("slot 1 of 3 of 'sem' held by 'run-0'")
    assert [(h.slot, h.owner) for h in store.slot_holders("sem")] == [(1, "run-0"), (2, "run-1"), (3, "run-2")]
    # The owner of a slot acquiring again keeps its slot with a larger token (a retry re-entering).
    again = store.try_acquire("sem", "run-1", TTL, slots=3).lease
    assert again is not None and again.slot == 2 and held[1] is not None and again.token > held[1].token
    # A released slot is the next one granted; its token is larger than that slot's last.
    assert held[0] is not None and store.release(held[0])
    nxt = store.try_acquire("sem", "run-3", TTL, slots=3).lease
    assert nxt is not None and nxt.slot == 1 and nxt.token > held[0].token


def test_expiry_renewal_and_force_release_are_per_slot(store: LeaseStore) -> None:
    one = store.acquire("per-slot", "a", TTL)  # slots=1 is today's lease...
    assert one is None or one.slots == 1
    assert one is not None and store.release(one)
    first = store.try_acquire("per-slot", "a", TTL, slots=2).lease
    short = store.try_acquire("per-slot", "b", timedelta(seconds=1), slots=2).lease
    assert first is not None and short is not None and short.slot == 2
    renewed = store.renew(short)
    assert renewed is not None and (renewed.slot, renewed.slots, renewed.key) == (2, 2, "per-slot#2")
    assert store.try_acquire("per-slot", "c", TTL, slots=2).lease is None
    time.sleep(1.2)  # slot 2 lapses by itself; slot 1 is still held
    assert store.renew(short) is None
    assert [h.owner for h in store.slot_holders("per-slot")] == ["a"]
    late = store.try_acquire("per-slot", "c", TTL, slots=2).lease
    assert late is not None and late.slot == 2 and late.token > short.token
    # Force-releasing one slot frees that slot only, and bumps its token: its holder cannot renew.
    before, new_token = store.force_release_with_token(slot_key("per-slot", 2), by="admin") or (None, 0)
    assert before is not None and before.owner == "c" and before.slot == 2 and new_token == late.token + 1
    assert store.renew(late) is None
    assert store.renew(first) is not None
    assert [h.owner for h in store.slot_holders("per-slot")] == ["a"]
    after = store.try_acquire("per-slot", "d", TTL, slots=2).lease
    assert after is not None and after.slot == 2 and after.token > new_token


def test_the_keeper_renews_its_slot(store: LeaseStore) -> None:
    store.try_acquire("kept-sem", "a", TTL, slots=2)
    lease = store.try_acquire("kept-sem", "b", timedelta(seconds=2), slots=2).lease
    assert lease is not None and lease.slot == 2
    keeper = store.keep(lease)
    try:
        time.sleep(2.5)  # past the TTL: only the keeper's renewals keep it
        assert keeper.lease.slot == 2
        holders = store.slot_holders("kept-sem")
        assert [(h.slot, h.owner) for h in holders] == [(1, "a"), (2, "b")]
        assert holders[1].renewed_at > lease.renewed_at
    finally:
        keeper.stop()


def test_another_slot_count_is_refused_naming_both_while_held(store: LeaseStore) -> None:
    a = store.try_acquire("count", "a", TTL, slots=2).lease
    b = store.try_acquire("count", "b", TTL, slots=2).lease
    assert a is not None and b is not None
    with pytest.raises(SlotCountMismatch) as refused:
        store.try_acquire("count", "c", TTL, slots=3)
    message = str(refused.value)
    assert "slots=3" in message and "slots=2" in message and "'a'" in message and "'b'" in message
    assert isinstance(refused.value, InvalidArgument) and refused.value.parameter == "slots"
    # A single-holder acquire: slot 1 held, so it is simply held (as any held lease)...
    assert store.try_acquire("count", "c", TTL).lease is None
    # ...and with slot 1 free while slot 2 is held, it is refused, not granted beside slot 2.
    assert store.release(a)
    with pytest.raises(SlotCountMismatch) as single:
        store.try_acquire("count", "c", TTL)
    assert "slots=2" in str(single.value) and "slots=1" in str(single.value)
    assert store.release(b)
    # Nobody holds a slot now: the new count applies.
    c = store.try_acquire("count", "c", TTL, slots=3).lease
    assert c is not None and c.slots == 3
    assert store.release(c)
    plain = store.try_acquire("count", "d", TTL).lease
    assert plain is not None and plain.slots == 1
    # A single lease held is a slot count of 1: a semaphore acquire is refused naming it.
    with pytest.raises(SlotCountMismatch, match="slots=1"):
        store.try_acquire("count", "e", TTL, slots=2)


def test_bad_slot_counts_name_the_parameter(store: LeaseStore) -> None:
    for bad in (0, -1, 1001, True, 2.0, "2"):
        with pytest.raises(InvalidArgument, match="^slots="):
            store.try_acquire("bad", "a", TTL, slots=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="^key="):
        store.try_acquire("k" * 510, "a", TTL, slots=12)


def test_two_holders_both_publish_through_the_fence_and_a_zombie_of_a_slot_is_refused(
    store: LeaseStore, fences: FenceStore
) -> None:
    one = store.try_acquire("pub", "run-1", TTL, slots=2).lease
    two = store.try_acquire("pub", "run-2", TTL, slots=2).lease
    assert one is not None and two is not None and one.token == two.token  # tokens count per slot
    sid = store.store_id
    # Both valid holders publish, in either order, to the same resource (a fence in the issuing store).
    assert fences.accept("table", two.token, key=two.key, owner=two.owner, store_id=sid)
    assert fences.accept("table", one.token, key=one.key, owner=one.owner, store_id=sid)
    with fences.transaction("rows", one.token, key=one.key, owner=one.owner, store_id=sid) as cur:
        cur.execute("SELECT 1")
    with fences.transaction("rows", two.token, key=two.key, owner=two.owner, store_id=sid) as cur:
        cur.execute("SELECT 1")
    # Slot 2's holder stalls past its TTL (force-released here); a newer holder of slot 2 publishes.
    store.force_release(two.key, by="test")
    newer = store.try_acquire("pub", "run-3", TTL, slots=2).lease
    assert newer is not None and newer.slot == 2 and newer.token > two.token
    assert fences.accept("table", newer.token, key=newer.key, owner=newer.owner, store_id=sid)
    # The zombie of slot 2 is refused, with or without the store's id (then by the token alone)...
    with pytest.raises(StaleFencingToken):
        fences.guard("table", two.token, key=two.key, owner=two.owner, store_id=sid)
    assert not fences.accept("table", two.token, key=two.key, owner=two.owner)
    with pytest.raises(StaleFencingToken):
        with fences.transaction("rows", two.token, key=two.key, owner=two.owner, store_id=sid):
            pass
    # ...while slot 1's holder, whose token is lower than the newer slot 2 token, still publishes.
    assert one.token < newer.token
    assert fences.accept("table", one.token, key=one.key, owner=one.owner, store_id=sid)
    assert fences.tokens("table") == {"pub": one.token, "pub#2": newer.token}


def _racer(
    store: LeaseStore, worker: int, rounds: int, barrier: threading.Barrier, grants: list, errors: list
) -> None:
    try:
        for r in range(rounds):
            barrier.wait(timeout=60)
            got = store.try_acquire("race", f"w{worker}", TTL, slots=3).lease
            if got is not None:
                grants.append((r, got.slot, got.token, got.owner))
            barrier.wait(timeout=60)  # every attempt of the round is done: release and go again
            if got is not None:
                assert store.release(got)
    except Exception as exc:  # reported to the test
        errors.append(exc)


def test_many_threads_at_a_barrier_never_get_more_than_n_slots(pg_dsn: str, schema: str) -> None:
    """Against real PostgreSQL: every round, 16 threads acquire at once; exactly 3 get a slot, one per
    slot, and each slot's tokens strictly increase from round to round."""
    threads, rounds = 16, 6
    stores = [LeaseStore(pg_dsn, schema=schema) for _ in range(threads)]
    stores[0].ensure_schema()
    barrier = threading.Barrier(threads)
    grants: list = []
    errors: list = []
    workers = [
        threading.Thread(target=_racer, args=(stores[w], w, rounds, barrier, grants, errors)) for w in range(threads)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    for s in stores:
        s.close()
    assert not errors, errors
    by_round: dict[int, list] = defaultdict(list)
    for g in grants:
        by_round[g[0]].append(g)
    for r in range(rounds):
        assert sorted(g[1] for g in by_round[r]) == [1, 2, 3], f"round {r}: {by_round[r]}"
    for slot in (1, 2, 3):
        tokens = [g[2] for r in range(rounds) for g in by_round[r] if g[1] == slot]
        assert tokens == sorted(set(tokens)) and len(tokens) == rounds, f"slot {slot}: {tokens}"


def _churn(store: LeaseStore, worker: int, seconds: float, start: threading.Barrier, out: list) -> None:
    start.wait(timeout=60)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = store.try_acquire("churn", f"w{worker}", timedelta(seconds=1), slots=2).lease
        if got is None:
            time.sleep(0.005)
            continue
        time.sleep(0.01)
        released = store.release(got)
        out.append((got.slot, got.token, got.acquired_at, got.expires_at, released))


def test_concurrent_churn_holds_at_most_n_at_any_moment(pg_dsn: str, schema: str, store: LeaseStore) -> None:
    threads = 8
    stores = [LeaseStore(pg_dsn, schema=schema) for _ in range(threads)]
    start = threading.Barrier(threads)
    out: list = []
    workers = [threading.Thread(target=_churn, args=(stores[w], w, 3.0, start, out)) for w in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    for s in stores:
        s.close()
    assert len(out) >= 20, f"too few grants to judge: {len(out)}"
    ended = {}
    for key in ("churn", "churn#2"):
        for e in store.events.query(key=key, kind="released", limit=10_000):
            ended[(key, e.token)] = datetime.fromisoformat(e.detail["released_at"])
    assert {s for s, *_ in out} == {1, 2}
    for slot in (1, 2):
        key = slot_key("churn", slot)
        mine = sorted((t, a, min(e, ended.get((key, t), e))) for s, t, a, e, _ in out if s == slot)
        tokens = [t for t, _, _ in mine]
        assert len(tokens) == len(set(tokens)), f"slot {slot}: a token granted twice"
        # Within a slot, by token order, a grant starts only after the previous one ended (released or
        # expired, database time): one holder per slot, so never more than 2 holders at once.
        for (t1, _a1, e1), (t2, a2, _e2) in zip(mine, mine[1:], strict=False):
            assert a2 >= e1, f"slot {slot}: token {t2} started at {a2} before token {t1} ended at {e1}"


def test_the_timeline_of_a_semaphore_shows_each_slot_held_by_whom(store: LeaseStore) -> None:
    from airflow_lease_provider.plugins import timeline

    one = store.try_acquire("tl-sem", "dag/run-1/work", TTL, slots=2).lease
    two = store.try_acquire("tl-sem", "dag/run-2/work", TTL, slots=2).lease
    assert one is not None and two is not None and store.release(two)
    data = timeline.key_timeline(store, "tl-sem", range_name="24h")
    shown = sorted((h["slot"], h["slots"], h["owner"], h["outcome"]) for h in data["holdings"])
    assert shown == [(1, 2, "dag/run-1/work", "held"), (2, 2, "dag/run-2/work", "released")], data["holdings"]
    assert data["lease"]["slot_label"] == "slot 1 of 2"
