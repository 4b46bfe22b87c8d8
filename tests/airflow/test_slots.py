"""Semaphores in the operator (``lease_slots=N``, issue 26 item 3), in process, on a real PostgreSQL: the
operators run the way the task runner runs them (``execute(context)``).

Two runs hold a key of two slots at once, each in its own slot with its own token, and both publish
through the fence; the third follows its ``on_overlap`` (skip naming both holders, or wait for any slot);
``replace`` with slots and bad slot counts are refused when the DAG is parsed. Across tasks (issue 38): a
``replace`` task on a semaphore's key is not granted beside a slot, and after the slot count is lowered a
zombie of a dropped slot is refused by the fence its publish goes to.
"""

from __future__ import annotations

import json
import sqlite3
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowSkipException, TaskDeferred

from airflow_lease_provider.core import (
    EventKind,
    FenceStore,
    InvalidArgument,
    LeaseStore,
    SlotCountMismatch,
    StaleFencingToken,
)
from airflow_lease_provider.runtime.context import LeaseContext
from airflow_lease_provider.triggers.lease_free import LeaseFreeTrigger
from tests.airflow.test_policies import first_event, owner, run_task, ti
from tests.airflow.test_semantics import counted, lease_env, leased  # noqa: F401 (fixtures)
from tests.pg import execute, q

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
    assert leased("w", lambda: None, lease_slots=3, on_overlap="wait", max_waiting=1).lease_slots == 3
    assert leased("w", lambda: None, lease_slots=1, on_overlap="replace").lease_slots == 1


# -- issue 38: one rule across tasks with different settings on one key --------------------------------------

TTL = timedelta(minutes=5)


def test_a_replace_task_on_a_semaphores_key_is_not_granted_while_a_slot_is_held(
    lease_env, store: LeaseStore  # noqa: F811
) -> None:
    """DAG X holds key K with lease_slots=2 (slot 1 by another run, slot 2 by this one); DAG Y's task has
    on_overlap="replace" on K. With slot 1 held, Y is skipped (a slot holder is never replaced); with only
    slot 2 held, Y fails with SlotCountMismatch, never granted a single lease beside the slot (72519bc
    granted it)."""
    other = store.try_acquire("mixed-key", "x/run-0/work", TTL, slots=2).lease
    assert other is not None and other.slot == 1
    seen: dict[str, Any] = {}

    def y_body(lease=None):
        seen["y granted"] = (lease.key, lease.slots, lease.token)

    def x_body(lease=None):
        seen["x"] = (lease.slot, lease.token)
        y = leased("y-work", y_body, lease_key="mixed-key", on_overlap="replace")
        with pytest.raises(AirflowSkipException) as skipped:
            run_task(y, ti(5, "y-work"), 5)  # slot 1 held (not by a replaceable single holder): skipped
        seen["skipped"] = str(skipped.value)
        assert store.release(other)
        with pytest.raises(SlotCountMismatch) as refused:
            run_task(y, ti(6, "y-work"), 6)
        seen["refused"] = str(refused.value)
        seen["holders"] = [(h.slot, h.owner) for h in store.slot_holders("mixed-key")]
        return lease.token

    x = leased("work", x_body, lease_key="mixed-key", lease_slots=2)
    run_task(x, ti(1), 1)
    assert "y granted" not in seen, seen
    assert seen["x"][0] == 2 and "x/run-0/work" in seen["skipped"]
    assert "slots=2" in seen["refused"] and "slots=1" in seen["refused"] and owner(1) in seen["refused"]
    assert seen["holders"] == [(2, owner(1))]
    assert store.events.query(key="mixed-key", kind=EventKind.REPLACED) == []


@pytest.fixture
def fence_target(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Connection ``drop_target``: a SQLite file, so the fence is kept elsewhere than the lease store (the
    DB-API fence: it sees only publishes)."""
    path = tmp_path / "target.db"
    sqlite3.connect(path).close()
    monkeypatch.setenv("AIRFLOW_CONN_DROP_TARGET", json.dumps({"conn_type": "sqlite", "host": str(path)}))
    return path


@pytest.mark.parametrize("where", ["lease store", "elsewhere"])
def test_a_zombie_of_a_slot_dropped_by_a_lower_count_is_refused_at_its_publish(
    lease_env, monkeypatch: pytest.MonkeyPatch, store: LeaseStore, pg_dsn: str, schema: str,  # noqa: F811
    fence_target: Path, where: str,
) -> None:
    """A run holds slot 2 of K (lease_slots=2); on the way to an external side effect (``lease.fence``) it
    passes its own lease check and freezes there past its TTL; meanwhile the other slot ends, the DAG is
    changed to lease_slots=1, and a new run takes K and advances the fence. When the frozen run's fence
    advance arrives, it is refused (count_epoch): by the fence in the lease store at once, by a fence
    elsewhere because the new run published there first. At 72519bc both accepted it: slot 2 is never
    granted again, so its fence key never sees a larger token."""
    conn_id = None if where == "lease store" else "drop_target"
    slot_one = store.try_acquire("drop-key", "x/run-0/work", TTL, slots=2).lease
    assert slot_one is not None
    seen: dict[str, Any] = {}

    def new_body(lease=None):
        lease.fence("drop.target", conn_id=conn_id)  # before its side effect (a push, an upload)
        seen["new"] = (lease.slots, lease.token)
        return lease.token

    real_check = LeaseContext.check

    def frozen_after_its_check(self: LeaseContext) -> Any:
        checked = real_check(self)
        monkeypatch.setattr(LeaseContext, "check", real_check)  # once
        # Frozen past its TTL, right after its own check said it still holds:
        execute(pg_dsn, q("UPDATE {schema}.lease SET expires_at = clock_timestamp() WHERE key = %s", schema),
                (self.key,))
        assert store.release(slot_one)
        run_task(leased("work", new_body, lease_key="drop-key"), ti(2), 2)  # lease_slots=1 now
        return checked

    def zombie_body(lease=None):
        seen["zombie"] = (lease.slot, lease.token)
        monkeypatch.setattr(LeaseContext, "check", frozen_after_its_check)
        with pytest.raises(StaleFencingToken) as refused:
            lease.fence("drop.target", conn_id=conn_id)
            seen["zombie wrote"] = True  # its side effect would follow here
        seen["reason"] = refused.value.reason

    zombie = leased("work", zombie_body, lease_key="drop-key", lease_slots=2, retries=0)
    run_task(zombie, ti(1), 1)  # its body caught the refusal; its release finds the slot gone and says so
    assert seen["zombie"][0] == 2 and "zombie wrote" not in seen, seen
    assert seen["reason"] == "count_epoch", seen
    new = store.lease("drop-key")
    assert new is not None and (new.slots, new.token) == seen["new"] and new.count_epoch >= seen["zombie"][1]
    rejected = store.events.query(kind=EventKind.FENCE_REJECTED)
    assert [(e.owner, e.token, e.detail["outcome"]) for e in rejected] == [
        (owner(1), seen["zombie"][1], "count_epoch")
    ], rejected
