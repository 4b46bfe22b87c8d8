"""The fault harness's broken-on-purpose fences are really broken (on real PostgreSQL).

The checker's own tests (tests/reliability/test_chaos.py) run each broken variant for 20 s of faults and
expect a violation; when a refactor of the real store bypasses the seam a broken variant overrides, that
variant silently behaves correctly and the chaos test fails only as "no violation found", after minutes.
This checks the seams directly, in milliseconds: the cross-key fence compares tokens of different lease keys
at one resource, which the real fence never does; the replace of before issue 38 grants a key beside a live
slot of it, which the real store refuses; the claim that ignores max_waiting gives a second place where the
real store gives one."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from airflow_lease_provider.core import FenceStore, LeaseError, LeaseStore, StaleFencingToken
from chaos.history import Recorder
from chaos.stores import CrossKeyFenceStore, ReplaceIgnoresSlotsLeaseStore, WaitIgnoresMaxLeaseStore

TTL = timedelta(minutes=5)
RUN_AFTER = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def cross_key(pg_dsn: str, schema: str) -> Iterator[CrossKeyFenceStore]:
    fences = CrossKeyFenceStore(pg_dsn, schema=schema)
    yield fences
    fences.close()


def test_the_real_fence_compares_tokens_within_one_lease_key_only(fences: FenceStore) -> None:
    assert fences.accept("target-0", 5, key="job-0")
    assert fences.accept("target-0", 3, key="job-1")  # another key's count: not compared


def test_the_cross_key_fence_refuses_a_valid_holder_of_a_key_whose_count_is_behind(
    cross_key: CrossKeyFenceStore,
) -> None:
    assert cross_key.accept("target-0", 5, key="job-0")
    assert not cross_key.accept("target-0", 3, key="job-1")  # broken on purpose: the chaos checker's prey
    with pytest.raises(StaleFencingToken):
        with cross_key.transaction("target-0", 4, key="job-1") as cur:
            cur.execute("SELECT 1")


@pytest.fixture
def replace_ignores_slots(pg_dsn: str, schema: str, tmp_path: Path) -> Iterator[ReplaceIgnoresSlotsLeaseStore]:
    recorder = Recorder(tmp_path / "history.jsonl")
    leases = ReplaceIgnoresSlotsLeaseStore(
        pg_dsn, schema=schema, recorder=recorder, connect_timeout=timedelta(seconds=5),
        statement_timeout=timedelta(seconds=5),
    )
    yield leases
    leases.close()
    recorder.close()


def semaphore_with_slot_2_held(leases: LeaseStore) -> None:
    first = leases.try_acquire("K", "a", TTL, slots=2).lease
    assert first is not None and leases.try_acquire("K", "b", TTL, slots=2).lease is not None
    assert leases.release(first)  # slot 1 free, slot 2 held by b


def test_the_real_store_never_replaces_beside_a_live_slot(store: LeaseStore) -> None:
    semaphore_with_slot_2_held(store)
    try:
        got = store.try_replace("K", "c", TTL, run_after=RUN_AFTER)
    except LeaseError:
        got = None  # refused loudly (SlotCountMismatch): nothing granted either
    assert got is None or got.lease is None
    assert [(h.key, h.owner) for h in store.slot_holders("K")] == [("K#2", "b")]


def test_the_broken_replace_takes_the_key_beside_a_live_slot(
    replace_ignores_slots: ReplaceIgnoresSlotsLeaseStore,
) -> None:
    semaphore_with_slot_2_held(replace_ignores_slots)
    got = replace_ignores_slots.try_replace("K", "c", TTL, run_after=RUN_AFTER)
    assert got.lease is not None and got.lease.key == "K"  # broken on purpose: the chaos checker's prey
    holders = {(h.key, h.owner) for h in replace_ignores_slots.slot_holders("K")}
    assert {("K", "c"), ("K#2", "b")} <= holders


@pytest.fixture
def wait_ignores_max(pg_dsn: str, schema: str, tmp_path: Path) -> Iterator[WaitIgnoresMaxLeaseStore]:
    recorder = Recorder(tmp_path / "history.jsonl")
    leases = WaitIgnoresMaxLeaseStore(
        pg_dsn, schema=schema, recorder=recorder, connect_timeout=timedelta(seconds=5),
        statement_timeout=timedelta(seconds=5),
    )
    yield leases
    leases.close()
    recorder.close()


def test_the_real_store_gives_no_more_waiting_places_than_max_waiting(store: LeaseStore) -> None:
    assert store.wait_claim("K", "a", TTL, max_waiting=1).claimed
    refused = store.wait_claim("K", "b", TTL, max_waiting=1)
    assert not refused.claimed and [w.owner for w in refused.waiters] == ["a"]


def test_the_broken_claim_ignores_max_waiting(wait_ignores_max: WaitIgnoresMaxLeaseStore) -> None:
    assert wait_ignores_max.wait_claim("K", "a", TTL, max_waiting=1).claimed
    second = wait_ignores_max.wait_claim("K", "b", TTL, max_waiting=1)
    assert second.claimed  # broken on purpose: the chaos checker's prey
    assert [w.owner for w in wait_ignores_max.waiters(["K"])] == ["a", "b"]
