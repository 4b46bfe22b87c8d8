"""Semaphores in the operator (``lease_slots=N``, issue 26 item 3), in process, on a real PostgreSQL: the
operators run the way the task runner runs them (``execute(context)``).

Two runs hold a key of two slots at once, each in its own slot with its own token, and both publish
through the fence; the third follows its ``on_overlap`` (skip naming both holders, or wait for any slot);
``replace`` with slots and bad slot counts are refused when the DAG is parsed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowSkipException, TaskDeferred

from airflow_lease_provider.core import EventKind, FenceStore, InvalidArgument, LeaseStore
from airflow_lease_provider.triggers.lease_free import LeaseFreeTrigger
from tests.airflow.test_policies import first_event, owner, run_task, ti
from tests.airflow.test_semantics import counted, lease_env, leased  # noqa: F401 (fixtures)

pytestmark = pytest.mark.airflow


def test_two_runs_hold_two_slots_at_once_both_publish_and_the_third_is_skipped_naming_both(
    lease_env, monkeypatch, store: LeaseStore, fences: FenceStore, counted  # noqa: F811
) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__PUSH_LEASE_XCOM", "true")  # read below: the first holder's lease XCom
    seen: dict[str, Any] = {}

    def sem(body: Any, **kwargs: Any) -> Any:
        return leased("work", body, lease_key="sem-key", lease_slots=2, **kwargs)

    def third_body(lease=None):
        seen["third ran"] = True

    def second_body(lease=None):
        seen["second"] = (lease.slot, lease.slots, lease.key, lease.token)
        with lease.fenced_transaction("target") as cur:
            cur.execute("SELECT 1")
        with pytest.raises(AirflowSkipException) as skipped:
            run_task(sem(third_body), third := ti(3), 3)
        seen["third reason"] = str(skipped.value)
        seen["third detail"] = third.xcoms["lease_skip_reason"]
        return lease.token

    def first_body(lease=None):
        seen["first"] = (lease.slot, lease.slots, lease.key, lease.token)
        with lease.fenced_transaction("target") as cur:  # before the second holder's publish...
            cur.execute("SELECT 1")
        run_task(sem(second_body), ti(2), 2)  # ...which holds at the same time, in slot 2
        with lease.fenced_transaction("target") as cur:  # ...and after it: a valid holder is never stale
            cur.execute("SELECT 1")
        return lease.token

    run_task(sem(first_body), first := ti(1), 1)
    assert seen["first"][:3] == (1, 2, "sem-key") and seen["second"][:3] == (2, 2, "sem-key#2"), seen
    assert "third ran" not in seen
    reason = seen["third reason"]
    assert owner(1) in reason and owner(2) in reason and "all 2 slots" in reason, reason
    assert [h["owner"] for h in seen["third detail"]["holders"]] == [owner(1), owner(2)]
    assert first.xcoms["lease"]["slot"] == 1 and first.xcoms["lease"]["lease_key"] == "sem-key"
    assert fences.tokens("target") == {"sem-key": seen["first"][3], "sem-key#2": seen["second"][3]}
    (skip,) = store.events.query(key="sem-key", kind=EventKind.SKIPPED_OVERLAP)
    assert skip.owner == owner(3) and skip.detail["slots"] == 2
    acquired = store.events.query(key="sem-key#2", kind=EventKind.ACQUIRED)
    assert [(e.owner, e.detail["slot"], e.detail["slots"], e.detail["lease_key"]) for e in acquired] == [
        (owner(2), 2, 2, "sem-key")
    ]
    assert counted["lease.acquired"] == 2 and counted["scheduled.skipped_overlap"] == 1
    assert counted["lease.slot_acquired"] == 2
    assert store.slot_holders("sem-key") == []  # both released


def test_wait_on_a_full_semaphore_resumes_when_any_slot_frees(lease_env, store: LeaseStore) -> None:  # noqa: F811
    one = store.try_acquire("wsem", "job/a/work", timedelta(minutes=5), slots=2).lease
    two = store.try_acquire("wsem", "job/b/work", timedelta(minutes=5), slots=2).lease
    assert one is not None and two is not None
    op = leased("work", lambda lease=None: (lease.slot, lease.token), lease_key="wsem", lease_slots=2,
                on_overlap="wait", lease_poll_interval=timedelta(seconds=1))
    with pytest.raises(TaskDeferred) as deferred:
        run_task(op, ti(1), 1)
    kwargs = deferred.value.trigger.serialize()[1]
    assert kwargs["slots"] == 2
    assert store.release(two)  # slot 2 frees while slot 1 is still held
    assert first_event(LeaseFreeTrigger(**kwargs)) == {"status": "free", "key": "wsem"}
    slot, token = run_task(op, ti(1), 1, resume=kwargs["deadline"])
    assert slot == 2 and token > two.token


def test_slot_arguments_are_checked_when_the_dag_is_parsed() -> None:
    with pytest.raises(InvalidArgument, match="on_overlap='replace'.*lease_slots=2"):
        leased("w", lambda: None, on_overlap="replace", lease_slots=2)
    for bad in (0, -1, True, "2", 1001, 2.0):
        with pytest.raises(InvalidArgument, match="^lease_slots="):
            leased("w", lambda: None, lease_slots=bad)
    with pytest.raises(InvalidArgument, match="lease_slots.*lease_scope='run'"):
        leased("w", lambda: None, lease_slots=2, lease_scope="run")
    assert leased("w", lambda: None, lease_slots=3, on_overlap="buffer_one").lease_slots == 3
    assert leased("w", lambda: None, lease_slots=1, on_overlap="replace").lease_slots == 1
