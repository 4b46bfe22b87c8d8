"""The store side of the overlap policies ``replace`` and ``wait`` with ``max_waiting`` (issue 26, items 1 and 2).

- ``try_replace`` takes a lease held by an older run over in one statement, with a strictly larger token;
  the old holder's renewal is refused and its fenced writes are refused by a fence in the store's schema;
  the takeover is one ``replaced`` event naming both runs and both tokens.
- An older run never takes over from a newer one (nor from a holder of unknown order), so a replaced run's
  retry finds the newer holder and does not take it back. Of many replacers at once, the lease ends with
  the newest run, and every takeover moved the token up.
- ``wait_claim``: of many runs claiming a waiting place at once, exactly ``max_waiting`` get one; a dead
  waiter's place lapses with its TTL, and a given-back place is free at once.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

from airflow_lease_provider.core import (
    EventKind,
    FenceStore,
    InvalidArgument,
    LeaseStore,
    RunRef,
    StaleFencingToken,
)

TTL = timedelta(minutes=5)
T0 = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc)


def _run(n: int) -> RunRef:
    return RunRef("job", f"manual__{n}", task_id="work")


def _take(store: LeaseStore, n: int, *, key: str = "job-key", ttl: timedelta = TTL) -> object:
    """Run n (run_after T0 + n minutes) asks for ``key`` with the replace policy."""
    return store.try_replace(key, _run(n).owner(), ttl, run_after=T0 + timedelta(minutes=n), run=_run(n))


def test_a_newer_run_takes_the_lease_over_with_a_larger_token_in_one_step(
    store: LeaseStore, fences: FenceStore
) -> None:
    first = _take(store, 1)
    assert first.lease is not None and first.replaced is None
    old = first.lease
    assert fences.accept("target", old.token, key=old.key, owner=old.owner, store_id=store.store_id)

    second = _take(store, 2)
    assert second.lease is not None, second
    new = second.lease
    assert new.token > old.token and new.owner == _run(2).owner()
    assert second.replaced is not None and (second.replaced.owner, second.replaced.token) == (old.owner, old.token)
    holder = store.holder("job-key")
    assert holder is not None and (holder.owner, holder.token) == (new.owner, new.token)

    # The old holder: its renewal is refused, its release frees nothing, its fenced write is refused from now on.
    assert store.renew(old) is None
    assert store.release(old) is False
    with pytest.raises(StaleFencingToken) as refused:
        fences.guard("target", old.token, key=old.key, owner=old.owner, store_id=store.store_id)
    assert refused.value.reason == "superseded"
    with pytest.raises(StaleFencingToken):
        with fences.transaction("other", old.token, key=old.key, owner=old.owner, store_id=store.store_id):
            pass
    assert fences.accept("target", new.token, key=new.key, owner=new.owner, store_id=store.store_id)

    # Who replaced it: from the lease row, and after a later grant from the ledger.
    by = store.replaced_by(old)
    assert by is not None and (by.owner, by.token) == (new.owner, new.token) and by.run == _run(2)
    assert store.replaced_by(new) is None
    assert store.release(new)
    assert store.acquire("job-key", "someone/else", TTL) is not None
    by = store.replaced_by(old)
    assert by is not None and (by.owner, by.token, by.run) == (new.owner, new.token, _run(2))


def test_the_takeover_is_one_replaced_event_naming_both_runs_and_tokens(store: LeaseStore) -> None:
    old = _take(store, 1).lease
    new = _take(store, 2).lease
    assert old is not None and new is not None
    (replaced,) = store.events.query(key="job-key", kind=EventKind.REPLACED)
    assert (replaced.owner, replaced.token, replaced.run) == (old.owner, old.token, _run(1))
    assert replaced.detail["by_owner"] == new.owner and replaced.detail["by_token"] == new.token
    assert (replaced.detail["by_dag_id"], replaced.detail["by_run_id"], replaced.detail["by_task_id"]) == (
        "job", "manual__2", "work"
    )
    acquired = [e for e in store.events.query(key="job-key", kind=EventKind.ACQUIRED) if e.token == new.token]
    assert len(acquired) == 1 and acquired[0].detail["replaced_token"] == old.token
    assert acquired[0].run == _run(2)


def test_an_older_run_never_replaces_a_newer_one_so_a_replaced_runs_retry_does_not_take_it_back(
    store: LeaseStore,
) -> None:
    old = _take(store, 1).lease
    new = _take(store, 2).lease
    assert old is not None and new is not None
    # The replaced run tries again (a retry, a cleared task): same run, same run order: the newer run holds.
    retry = _take(store, 1)
    assert retry.lease is None and retry.holder is not None and retry.holder.token == new.token
    # An equal run order does not replace either (only a strictly later one).
    tie = store.try_replace("job-key", "job/other/work", TTL, run_after=T0 + timedelta(minutes=2))
    assert tie.lease is None and tie.holder is not None and tie.holder.owner == new.owner
    # Nothing was written by the refused attempts.
    assert len(store.events.query(key="job-key", kind=EventKind.REPLACED)) == 1
    holder = store.holder("job-key")
    assert holder is not None and holder.token == new.token
    # Once the newer run released it, the lease is free: anyone takes it as usual, with a larger token.
    assert store.release(new)
    again = _take(store, 1)
    assert again.lease is not None and again.replaced is None and again.lease.token > new.token


def test_a_holder_of_unknown_run_order_is_never_replaced(store: LeaseStore) -> None:
    plain = store.acquire("job-key", "job/manual__0/work", TTL)
    assert plain is not None
    attempt = _take(store, 5)
    assert attempt.lease is None and attempt.holder is not None and attempt.holder.token == plain.token
    # A plain acquire clears the run order an earlier replace grant left on the row.
    assert store.release(plain)
    assert _take(store, 5).lease is not None
    lease = store.holder("job-key")
    assert lease is not None and store.release(lease)
    again = store.acquire("job-key", "job/plain/work", TTL)
    assert again is not None
    assert _take(store, 9).lease is None


def test_the_same_run_re_enters_and_a_free_or_expired_lease_is_granted_plainly(store: LeaseStore) -> None:
    first = _take(store, 1, ttl=timedelta(seconds=1))
    assert first.lease is not None
    again = _take(store, 1, ttl=timedelta(seconds=1))
    assert again.lease is not None and again.replaced is None and again.lease.token > first.lease.token
    time.sleep(1.3)
    later = _take(store, 0)  # an older run, but the lease expired: a plain grant, nobody replaced
    assert later.lease is not None and later.replaced is None
    assert store.events.query(key="job-key", kind=EventKind.REPLACED) == []


def test_a_newer_run_supersedes_an_older_holder_whose_lease_lapsed_unreleased(store: LeaseStore) -> None:
    """A holder frozen (or partitioned) past its TTL, then a newer run: the old holder comes back replaced,
    not lost, so its task skips instead of failing into a retry (that retry would only skip behind the newer
    run). A lapsed lease that was released, or a newer holder's lapsed lease, is granted plainly."""
    old = _take(store, 1, ttl=timedelta(seconds=1))
    assert old.lease is not None
    time.sleep(1.3)
    new = _take(store, 2)
    assert new.lease is not None and new.lease.token > old.lease.token
    assert new.replaced is not None and new.replaced.owner == _run(1).owner()
    assert new.replaced.token == old.lease.token
    by = store.replaced_by(old.lease)
    assert by is not None and by.owner == _run(2).owner() and by.token == new.lease.token
    [event] = store.events.query(key="job-key", kind=EventKind.REPLACED)
    assert event.owner == _run(1).owner() and event.token == old.lease.token
    assert event.detail["lapsed"] is True and event.detail["by_token"] == new.lease.token

    released = _take(store, 1, key="other", ttl=timedelta(seconds=1))
    assert released.lease is not None and store.release(released.lease)
    after = _take(store, 2, key="other")
    assert after.lease is not None and after.replaced is None  # released: nobody was replaced

    newer = _take(store, 5, key="third", ttl=timedelta(seconds=1))
    assert newer.lease is not None
    time.sleep(1.3)
    older = _take(store, 3, key="third")  # an older run after a newer one lapsed: a plain grant
    assert older.lease is not None and older.replaced is None
    assert store.replaced_by(newer.lease) is None


def test_many_replacers_at_once_leave_the_newest_run_holding_and_every_token_larger(
    store: LeaseStore, pg_dsn: str, schema: str
) -> None:
    n = 8
    barrier = threading.Barrier(n, timeout=30)
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def replacer(i: int) -> None:
        own = LeaseStore(pg_dsn, schema=schema)
        try:
            barrier.wait()
            results[i] = _take(own, i)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=replacer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    holder = store.holder("job-key")
    assert holder is not None and holder.owner == _run(n - 1).owner(), holder
    granted = sorted((r.lease.token, i) for i, r in results.items() if r.lease is not None)
    # Every grant got a token larger than the one before it, and each takeover names the grant before it.
    tokens = [t for t, _ in granted]
    assert tokens == sorted(set(tokens))
    replaced = store.events.query(key="job-key", kind=EventKind.REPLACED, limit=100)
    for event in replaced:
        assert event.detail["by_token"] > event.token
        older = int(event.run.run_id.split("__")[1])
        assert older < int(event.detail["by_run_id"].split("__")[1])
    # A grant is refused only to a run no newer than the holder it found.
    for i, r in results.items():
        if r.lease is None:
            assert r.holder is not None and int(r.holder.owner.split("__")[1].split("/")[0]) >= i


def test_replace_checks_its_arguments(store: LeaseStore) -> None:
    with pytest.raises(InvalidArgument, match="run_after"):
        store.try_replace("k", "o", TTL, run_after=datetime(2026, 1, 1))  # naive
    with pytest.raises(InvalidArgument, match="run_after"):
        store.try_replace("k", "o", TTL, run_after=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="max_waiting"):
        store.wait_claim("k", "o", TTL, max_waiting=0)


# -- waiting places --------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_waiting", [1, 3])
def test_of_many_runs_claiming_at_once_exactly_max_waiting_get_a_place(
    store: LeaseStore, pg_dsn: str, schema: str, max_waiting: int
) -> None:
    key, n = f"buffered-{max_waiting}", 10
    barrier = threading.Barrier(n, timeout=30)
    claims: dict[int, object] = {}
    errors: list[BaseException] = []

    def claim(i: int) -> None:
        own = LeaseStore(pg_dsn, schema=schema)
        try:
            barrier.wait()
            claims[i] = own.wait_claim(key, _run(i).owner(), TTL, max_waiting=max_waiting, run=_run(i))
        except BaseException as exc:
            errors.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    winners = {i for i, c in claims.items() if c.claimed}
    assert len(winners) == max_waiting, claims
    places = {w.owner for w in store.waiters([key])}
    assert places == {_run(i).owner() for i in winners}
    for c in claims.values():
        if not c.claimed:  # refused: told who fills the places
            assert {w.owner for w in c.others} == places, c


def test_a_waiter_keeps_its_place_by_claiming_again_and_gives_it_back(store: LeaseStore) -> None:
    first = store.wait_claim("k", "a", TTL, run=_run(1))
    assert first.claimed and [w.owner for w in first.waiters] == ["a"] and first.waiters[0].run == _run(1)
    assert store.wait_claim("k", "a", TTL).claimed  # again: kept (renewed), not a second place
    refused = store.wait_claim("k", "b", TTL)
    assert not refused.claimed and [w.owner for w in refused.others] == ["a"]
    assert store.wait_release("k", "a") is True
    assert store.wait_release("k", "a") is False
    assert store.wait_claim("k", "b", TTL).claimed
    assert [w.owner for w in store.waiters(["k"])] == ["b"]


def test_a_dead_waiters_place_lapses_with_its_ttl(store: LeaseStore) -> None:
    assert store.wait_claim("k", "dead", timedelta(seconds=1)).claimed
    assert not store.wait_claim("k", "next", TTL).claimed
    time.sleep(1.3)
    assert [w.owner for w in store.waiters(["k"])] == []  # lapsed: not shown as waiting
    taken = store.wait_claim("k", "next", TTL)
    assert taken.claimed and [w.owner for w in taken.waiters] == ["next"]


def test_without_takeover_an_older_holder_keeps_the_lease_and_is_said_to_be_older(store: LeaseStore) -> None:
    """``takeover=False`` (a replace_grace not over yet): nothing is taken over, and the answer says whether
    the holder's run is older; a free lease is granted with its run order as usual."""
    old = _take(store, 1).lease
    assert old is not None
    waiting = store.try_replace("job-key", _run(2).owner(), TTL, run_after=T0 + timedelta(minutes=2), run=_run(2),
                                takeover=False)
    assert waiting.lease is None and waiting.holder is not None and waiting.holder.token == old.token
    assert waiting.holder_older is True
    newer = store.try_replace("job-key", _run(0).owner(), TTL, run_after=T0, run=_run(0), takeover=False)
    assert newer.lease is None and newer.holder_older is False
    assert store.events.query(key="job-key", kind=EventKind.REPLACED) == []
    assert store.renew(old) is not None  # still the holder's
    free = store.try_replace("free-key", _run(2).owner(), TTL, run_after=T0 + timedelta(minutes=2), takeover=False)
    assert free.lease is not None
    assert _take(store, 3, key="free-key").replaced is not None  # its run order was recorded: replaceable
