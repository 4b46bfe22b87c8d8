"""The overlap policies ``replace`` and ``wait`` with ``max_waiting=1`` in the operator, in process, on a real PostgreSQL
(issue 26, items 1, 2 and 5): the operators run the way the task runner runs them (``execute(context)``).

- replace: a newer run takes the lease over; the replaced task's body is interrupted at its keeper's next
  renewal and the task ends skipped (not failed), naming the newer run; its late writes are refused by the
  lease check and by the fence; a replaced run tried again finds the newer holder and is skipped; an older
  run never replaces a newer one. Metrics ``lease.replaced`` and ``scheduled.skipped_replaced``, no
  ``lease.lost``.
- wait with max_waiting=1: the first run that finds the lease held takes the waiting place and defers, its trigger
  keeps the place; the next is skipped naming the waiter; once resumed with the lease, the place is free.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowSkipException, TaskDeferred

from airflow_lease_provider.core import (
    EventKind,
    FenceStore,
    InvalidArgument,
    LeaseLost,
    LeaseStore,
    RunRef,
    StaleFencingToken,
)
from airflow_lease_provider.operators import AcquireRunLeaseOperator
from airflow_lease_provider.triggers import lease_free
from airflow_lease_provider.triggers.lease_free import LeaseFreeTrigger
from tests.airflow.test_semantics import TaskInstance, counted, lease_env, leased  # noqa: F401 (fixtures)

pytestmark = pytest.mark.airflow

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc)
SHORT = timedelta(seconds=3)


def run_id(n: int) -> str:
    return f"manual__2026-12-03T12:0{n}:00+00:00"


def run_task(op: Any, ti: TaskInstance, n: int, *, resume: str | None = None) -> Any:
    """Execute ``op`` as ``ti`` of DAG run n (its run_after T0 + n minutes); ``resume``: after a wait."""
    context = {"ti": ti, "task_instance": ti, "run_id": ti.run_id, "params": {},
               "dag_run": SimpleNamespace(run_after=T0 + timedelta(minutes=n))}
    if resume is not None:
        return op.execute_after_wait(context, event={"status": "free"}, deadline=resume)
    return op.execute(context)


def ti(n: int, task_id: str = "work", try_number: int = 1) -> TaskInstance:
    return TaskInstance("job", run_id(n), task_id, try_number=try_number)


def owner(n: int, task_id: str = "work") -> str:
    return f"job/{run_id(n)}/{task_id}"


@pytest.fixture
def short_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's deferrals settle 1 s instead of ``RESUME_SETTLE`` (10 s, against a scheduler race a
    trigger run in process cannot meet; held to its length in tests/airflow/test_wait_resume.py)."""
    monkeypatch.setattr(lease_free, "RESUME_SETTLE", timedelta(seconds=1))


def first_event(trigger: LeaseFreeTrigger) -> dict:
    async def run() -> dict:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(run())


# -- replace ------------------------------------------------------------------------------------------


def test_a_newer_run_replaces_the_holder_whose_task_stops_skipped_and_whose_writes_are_refused(
    lease_env, store: LeaseStore, fences: FenceStore, counted  # noqa: F811
) -> None:
    seen: dict[str, Any] = {}

    def newer_body(lease=None):
        seen["new token"] = lease.token
        # The replaced run tried again (a retry, a cleared task) while the newer run holds: skipped.
        retry = leased("work", lambda: seen.setdefault("retry ran", True), lease_key="job-key",
                       on_overlap="replace", lease_ttl=SHORT)
        with pytest.raises(AirflowSkipException) as again:
            run_task(retry, ti(1, try_number=2), 1)
        seen["retry reason"] = str(again.value)
        with lease.fenced_transaction("target") as cur:
            cur.execute("SELECT 1")
        return lease.token

    newer = leased("work", newer_body, lease_key="job-key", on_overlap="replace", lease_ttl=SHORT)

    def old_body(lease=None):
        seen["old lease"] = lease.lease
        assert run_task(newer, ti(2), 2) == seen["new token"]  # the newer run took it over, ran, released
        # From the takeover on, the old holder's writes are refused: by the fence in the store's schema ...
        with pytest.raises(StaleFencingToken) as refused:
            fences.guard("target", lease.token, key=lease.key, owner=lease.owner, store_id=store.store_id)
        seen["fence"] = refused.value.reason
        # ... and its keeper stops the body at its next renewal (within TTL/3).
        started = time.monotonic()
        try:
            while time.monotonic() - started < 10:
                time.sleep(0.05)
        finally:
            seen["interrupted after"] = time.monotonic() - started
        seen["body went on"] = True

    old = leased("work", old_body, lease_key="job-key", on_overlap="replace", lease_ttl=SHORT, retries=3)
    with pytest.raises(AirflowSkipException) as skipped:
        run_task(old, first := ti(1), 1)
    old_lease = seen["old lease"]
    assert "body went on" not in seen and seen["interrupted after"] < SHORT.total_seconds() / 3 + 1.5, seen
    assert seen["fence"] == "superseded"
    assert "retry ran" not in seen and owner(2) in seen["retry reason"], seen
    reason = str(skipped.value)
    assert owner(2) in reason and f"token {seen['new token']}" in reason, reason
    assert first.xcoms["lease_skip_reason"]["replaced_by_owner"] == owner(2)
    assert first.xcoms["lease_skip_reason"]["replaced_by_token"] == seen["new token"]

    (event,) = store.events.query(key="job-key", kind=EventKind.REPLACED)
    assert (event.owner, event.token) == (owner(1), old_lease.token)
    assert (event.detail["by_owner"], event.detail["by_token"]) == (owner(2), seen["new token"])
    assert counted["lease.replaced"] == 1 and counted["scheduled.skipped_replaced"] == 1
    assert counted.get("lease.lost", 0) == 0
    assert counted["scheduled.skipped_overlap"] == 1  # the retry, skipped behind the newer holder
    assert store.holder("job-key") is None  # the newer run released it; the old one had nothing to release
    with pytest.raises(LeaseLost):  # a late write through the lease context is refused by the lease check
        from airflow_lease_provider.runtime.context import LeaseContext

        LeaseContext(lease=old_lease, store=store).check()


def test_an_older_run_never_replaces_a_newer_holder(lease_env, store: LeaseStore, counted) -> None:  # noqa: F811
    older = leased("work", lambda: None, lease_key="job-key", on_overlap="replace")

    def newer_body(lease=None):
        with pytest.raises(AirflowSkipException) as skipped:
            run_task(older, ti(1), 1)
        lease.check()  # still ours
        return str(skipped.value)

    reason = run_task(leased("work", newer_body, lease_key="job-key", on_overlap="replace"), ti(2), 2)
    assert owner(2) in reason and "an older run never replaces a newer one" in reason, reason
    assert store.events.query(key="job-key", kind=EventKind.REPLACED) == []
    (skip,) = store.events.query(key="job-key", kind=EventKind.SKIPPED_OVERLAP)
    assert skip.owner == owner(1) and skip.detail["policy"] == "replace" and skip.detail["holder_owner"] == owner(2)
    assert counted.get("lease.replaced", 0) == 0


def test_replace_is_refused_where_it_cannot_end_a_run_skipped(lease_env) -> None:  # noqa: F811
    with pytest.raises(InvalidArgument, match="on_overlap"):
        leased("w", lambda: None, on_overlap="replace", lease_scope="run")
    with pytest.raises(InvalidArgument, match="on_overlap"):
        AcquireRunLeaseOperator(task_id="a", lease_ttl=SHORT, on_overlap="replace")
    for bad in (0, -1, True, "1", 10_001):
        with pytest.raises(InvalidArgument, match="max_waiting"):
            leased("w", lambda: None, on_overlap="wait", max_waiting=bad)
    with pytest.raises(InvalidArgument, match="max_waiting"):
        leased("w", lambda: None, on_overlap="skip", max_waiting=1)
    with pytest.raises(InvalidArgument, match="on_overlap"):
        leased("w", lambda: None, on_overlap="buffer_one")  # wait with max_waiting=1 (docs/airflow.md)
    assert leased("w", lambda: None, on_overlap="wait", max_waiting=2).max_waiting == 2


# -- wait with max_waiting=1 -----------------------------------------------------------------------------------


def test_one_waiting_place_the_first_overlapping_run_waits_and_the_next_is_skipped_naming_it(
    lease_env, store: LeaseStore, counted, short_settle  # noqa: F811
) -> None:
    holder = store.acquire("buf-key", "job/holder/work", timedelta(minutes=5))
    assert holder is not None

    def buffered(n: int) -> Any:
        return leased("work", lambda lease=None: lease.token, lease_key="buf-key", on_overlap="wait", max_waiting=1,
                      lease_poll_interval=timedelta(seconds=1))

    with pytest.raises(TaskDeferred) as deferred:
        run_task(buffered(1), ti(1), 1)
    trigger = deferred.value.trigger
    assert isinstance(trigger, LeaseFreeTrigger) and trigger.waiter["owner"] == owner(1)
    assert [w.owner for w in store.waiters(["buf-key"])] == [owner(1)]

    third = ti(2)
    with pytest.raises(AirflowSkipException) as skipped:
        run_task(buffered(2), third, 2)
    assert owner(1) in str(skipped.value) and "job/holder/work" in str(skipped.value), skipped.value
    assert [w["owner"] for w in third.xcoms["lease_skip_reason"]["waiters"]] == [owner(1)]
    (full,) = store.events.query(key="buf-key", kind=EventKind.SKIPPED_BUFFER_FULL)
    assert full.owner == owner(2) and [w["owner"] for w in full.detail["waiters"]] == [owner(1)]
    (waiting,) = store.events.query(key="buf-key", kind=EventKind.WAITING)
    assert waiting.owner == owner(1) and waiting.detail["max_waiting"] == 1 and waiting.detail["place"] == 1
    assert counted["lease.waiting"] == 1 and counted["scheduled.skipped_buffer_full"] == 1

    # The holder releases: the trigger (keeping the place) says free, and the waiter runs with the lease.
    assert store.release(holder)
    kwargs = trigger.serialize()[1]
    assert first_event(LeaseFreeTrigger(**kwargs)) == {"status": "free", "key": "buf-key"}
    assert [w.owner for w in store.waiters(["buf-key"])] == [owner(1)]  # kept for the resume
    token = run_task(buffered(1), ti(1), 1, resume=kwargs["deadline"])
    assert token > holder.token
    assert store.waiters(["buf-key"]) == []  # given back once it had the lease


def test_a_killed_waiter_gives_its_place_back_and_a_displaced_one_is_told(lease_env, store: LeaseStore) -> None:  # noqa: F811
    assert store.acquire("buf-key", "job/holder/work", timedelta(minutes=5)) is not None
    op = leased("work", lambda: None, lease_key="buf-key", on_overlap="wait", max_waiting=1,
                lease_poll_interval=timedelta(seconds=1))
    with pytest.raises(TaskDeferred) as deferred:
        run_task(op, ti(1), 1)
    trigger = deferred.value.trigger
    asyncio.run(trigger.on_kill())
    assert store.waiters(["buf-key"]) == []

    # A place that lapsed and was taken by another run: the trigger says so instead of waiting on.
    kwargs = trigger.serialize()[1]
    kwargs["not_before"] = None
    assert store.wait_claim("buf-key", "job/other/work", timedelta(minutes=5)).claimed
    assert first_event(LeaseFreeTrigger(**kwargs))["status"] == "displaced"
    with pytest.raises(AirflowSkipException) as skipped:  # resumed: it cannot claim again, skipped
        run_task(op, ti(1), 1, resume=kwargs["deadline"])
    assert "job/other/work" in str(skipped.value)


def test_the_trigger_keeps_the_waiting_place_alive_past_its_ttl_while_deferred(
    lease_env, store: LeaseStore  # noqa: F811
) -> None:
    holder = store.acquire("buf-key", "job/holder/work", timedelta(minutes=5))
    assert holder is not None
    claim = store.wait_claim("buf-key", owner(1), timedelta(seconds=1.5), run=RunRef("job", run_id(1), task_id="work"))
    assert claim.claimed
    now = datetime.now(timezone.utc)
    trigger = LeaseFreeTrigger(
        key="buf-key", conn_id=None, schema=store.schema, poll_interval=0.3,
        deadline=(now + timedelta(minutes=1)).isoformat(), not_before=(now + timedelta(seconds=2)).isoformat(),
        waiter={"owner": owner(1), "ttl_seconds": 1.5, "max_waiting": 1, **RunRef("job", run_id(1), task_id="work").columns()},
    )

    async def scenario() -> tuple[list[str], dict]:
        seen: list[str] = []
        events = trigger.run()
        first = asyncio.ensure_future(events.__anext__())
        for _ in range(4):  # 4 s: well past the place's 1.5 s TTL, settling and then polling
            await asyncio.sleep(1)
            seen += [w.owner for w in await asyncio.to_thread(store.waiters, ["buf-key"])]
        assert not first.done()
        await asyncio.to_thread(store.release, holder)
        payload = (await asyncio.wait_for(first, 10)).payload
        await events.aclose()
        return seen, payload

    seen, payload = asyncio.run(scenario())
    assert seen == [owner(1)] * 4 and payload == {"status": "free", "key": "buf-key"}
    assert [w.owner for w in store.waiters(["buf-key"])] == [owner(1)]  # claimed again for the resume


def test_replace_grace_lets_the_older_holder_finish_first_then_takes_over(
    lease_env, store: LeaseStore, counted  # noqa: F811
) -> None:
    old = store.try_replace("grace-key", owner(1), timedelta(minutes=5), run_after=T0 + timedelta(minutes=1),
                            run=RunRef("job", run_id(1), task_id="work")).lease
    assert old is not None
    newer = leased("work", lambda lease=None: lease.token, lease_key="grace-key", on_overlap="replace",
                   replace_grace=timedelta(seconds=2), lease_poll_interval=timedelta(seconds=1))
    with pytest.raises(TaskDeferred) as deferred:  # the grace: the older holder may still finish
        run_task(newer, ti(2), 2)
    assert store.holder("grace-key").token == old.token and store.renew(old) is not None
    kwargs = deferred.value.trigger.serialize()[1]
    assert first_event(LeaseFreeTrigger(**kwargs))["status"] == "timeout"  # it did not finish in time
    token = run_task(newer, ti(2), 2, resume=kwargs["deadline"])
    assert token > old.token and store.renew(old) is None
    (replaced,) = store.events.query(key="grace-key", kind=EventKind.REPLACED)
    assert replaced.token == old.token and replaced.detail["by_token"] == token
    # An older run with a grace is skipped at once: it never waits to replace a newer holder.
    assert store.try_replace("grace-key", owner(3), timedelta(minutes=5), run_after=T0 + timedelta(minutes=3)).lease
    with pytest.raises(AirflowSkipException):
        run_task(newer, ti(2), 2)
    with pytest.raises(InvalidArgument, match="replace_grace"):
        leased("w", lambda: None, on_overlap="skip", replace_grace=timedelta(seconds=1))


def test_a_run_arriving_while_the_lease_is_free_does_not_jump_ahead_of_the_waiting_run(
    lease_env, store: LeaseStore, counted  # noqa: F811
) -> None:
    """max_waiting=1: the holder releases and, before the waiting run is resumed (its trigger's poll, the
    scheduler and a worker: seconds), a newer run starts. It must not take the free lease ahead of the run
    that waits (which would then wait again and could be skipped at its deadline, starved by every run
    arriving in that window): the place is taken, so the newer run is skipped naming the waiting run, and
    the waiting run then gets the lease."""
    holder = store.acquire("buf-jump", "job/holder/work", timedelta(minutes=5))
    assert holder is not None

    def buffered() -> Any:
        return leased("work", lambda lease=None: lease.token, lease_key="buf-jump", on_overlap="wait", max_waiting=1,
                      lease_poll_interval=timedelta(seconds=1))

    with pytest.raises(TaskDeferred) as deferred:
        run_task(buffered(), ti(1), 1)
    deadline = deferred.value.trigger.serialize()[1]["deadline"]
    assert store.release(holder)

    newer = ti(2)
    with pytest.raises(AirflowSkipException) as skipped:
        run_task(buffered(), newer, 2)
    assert owner(1) in str(skipped.value), skipped.value
    assert store.holder("buf-jump") is None  # the newer run took nothing
    assert [w["owner"] for w in newer.xcoms["lease_skip_reason"]["waiters"]] == [owner(1)]

    token = run_task(buffered(), ti(1), 1, resume=deadline)
    assert token > holder.token
    assert store.waiters(["buf-jump"]) == []


def test_a_fenced_transaction_open_across_the_takeover_commits_nothing(
    lease_env, store: LeaseStore, fences: FenceStore, counted  # noqa: F811
) -> None:
    """The old holder's fenced transaction passed the lease check and the fence before a newer run took
    the lease over (its write was slow); its commit comes after the takeover. From the takeover on, its
    fenced writes are refused: the transaction is rolled back (the fence does not advance) and the task
    ends skipped, naming the newer run."""
    seen: dict[str, Any] = {}

    def old_body(lease=None):
        with lease.fenced_transaction("slow-target") as cur:
            cur.execute("SELECT 1")
            taken = store.try_replace("span-key", owner(2), timedelta(minutes=5), run_after=T0 + timedelta(minutes=2),
                                      run=RunRef("job", run_id(2), task_id="work"))
            seen["new token"] = taken.lease.token if taken.lease else None
        seen["committed"] = True

    old = leased("work", old_body, lease_key="span-key", on_overlap="replace", lease_ttl=timedelta(minutes=5))
    with pytest.raises(AirflowSkipException) as skipped:
        run_task(old, ti(1), 1)
    assert seen["new token"] is not None, seen
    assert "committed" not in seen, seen
    assert fences.current("slow-target", key="span-key") is None  # the fence did not advance: nothing written
    assert owner(2) in str(skipped.value), skipped.value


def test_the_holders_own_retry_re_enters_its_lease_while_another_run_waits(
    lease_env, store: LeaseStore  # noqa: F811
) -> None:
    """max_waiting=1: the holder's try 1 died holding the lease and a newer run waits for it; the holder's
    retry is the same owner and re-enters at once, as with every policy (the waiter keeps waiting)."""

    def buffered(body: Any) -> Any:
        return leased("work", body, lease_key="buf-own", on_overlap="wait", max_waiting=1,
                      lease_poll_interval=timedelta(seconds=1))

    first = store.acquire("buf-own", owner(1), timedelta(minutes=5))
    assert first is not None
    with pytest.raises(TaskDeferred):
        run_task(buffered(lambda: None), ti(2), 2)
    token = run_task(buffered(lambda lease=None: lease.token), ti(1, try_number=2), 1)
    assert token > first.token
    assert [w.owner for w in store.waiters(["buf-own"])] == [owner(2)]
