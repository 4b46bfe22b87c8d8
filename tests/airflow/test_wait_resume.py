"""``on_overlap="wait"``: the deferred wait never resumes the task within seconds of the deferral.

Airflow 3.1-3.3's scheduler fails a deferred task whose trigger fires before it has read the executor's
report that the deferring process exited, once the task is already queued again ("finished with state
success, but the task instance's state attribute is queued"; apache/airflow issues 67287, 72716). Seen on
a real deployment (LocalExecutor, 2 cores under load): two mapped instances of one leased task with one
key, the lease released 3 s after the second deferred, that instance failed and never ran. The trigger
now holds "free" back until ``RESUME_SETTLE`` after the deferral. The lease store here is the real one.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

import pytest
from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk.exceptions import TaskDeferred

from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.operators import LeasedOperator
from airflow_lease_provider.triggers.lease_free import RESUME_SETTLE, LeaseFreeTrigger
from tests.airflow.test_semantics import RUN, TaskInstance, run_task

pytestmark = pytest.mark.airflow


@pytest.fixture
def lease_env(monkeypatch: pytest.MonkeyPatch, pg_dsn: str, schema: str) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", pg_dsn)
    monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", schema)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")


def first_event(trigger: LeaseFreeTrigger) -> tuple[dict, float]:
    """The trigger's first event and the monotonic time it came."""

    async def run() -> dict:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    payload = asyncio.run(run())
    return payload, time.monotonic()


def test_a_lease_freed_at_once_resumes_the_waiter_only_after_the_settle_time(
    lease_env, store: LeaseStore
) -> None:
    blocker = store.acquire("wait-key", owner="someone-else", ttl=timedelta(minutes=5))
    assert blocker is not None
    waiter = LeasedOperator.wrap(PythonOperator)(
        task_id="waiter",
        python_callable=lambda: None,
        lease_key="wait-key",
        lease_ttl=timedelta(seconds=30),
        on_overlap="wait",
        lease_poll_interval=timedelta(seconds=1),
    )
    with pytest.raises(TaskDeferred) as deferred:
        run_task(waiter, TaskInstance("etl", RUN, "waiter"))
    deferred_at = time.monotonic()
    assert store.release(blocker)  # freed at once, as a short body next door does

    trigger = deferred.value.trigger
    assert isinstance(trigger, LeaseFreeTrigger)
    payload, fired_at = first_event(trigger)
    assert payload == {"status": "free", "key": "wait-key"}
    # Before the fix the trigger said "free" on its first poll, well under a second after the deferral.
    assert fired_at - deferred_at >= RESUME_SETTLE.total_seconds() - 0.5
    # The moment survives the trigger's serialization (the triggerer rebuilds it from the table).
    path, kwargs = trigger.serialize()
    assert path.endswith("LeaseFreeTrigger") and kwargs["not_before"] == trigger.not_before
    assert LeaseFreeTrigger(**kwargs).not_before == trigger.not_before


def test_a_trigger_serialized_before_not_before_existed_still_fires_at_once(
    lease_env, store: LeaseStore
) -> None:
    deadline = (datetime.now(timezone.utc) + timedelta(minutes=1)).isoformat()
    old = LeaseFreeTrigger(
        key="free-key", conn_id=None, schema=store.schema, poll_interval=1.0, deadline=deadline
    )
    started = time.monotonic()
    payload, fired_at = first_event(old)
    assert payload["status"] == "free" and fired_at - started < RESUME_SETTLE.total_seconds() / 2


def test_a_deadline_before_the_settle_time_times_out_at_the_deadline(lease_env, store: LeaseStore) -> None:
    assert store.acquire("held-key", owner="someone-else", ttl=timedelta(minutes=5)) is not None
    now = datetime.now(timezone.utc)
    trigger = LeaseFreeTrigger(
        key="held-key",
        conn_id=None,
        schema=store.schema,
        poll_interval=0.5,
        deadline=(now + timedelta(seconds=2)).isoformat(),
        not_before=(now + timedelta(seconds=30)).isoformat(),
    )
    started = time.monotonic()
    payload, fired_at = first_event(trigger)
    assert payload["status"] == "timeout" and fired_at - started < 10
