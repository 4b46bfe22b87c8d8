"""The overlap policies and the fence of a leased task on the API path (docs/api.md): the task lease and its
policies as on the direct path, with the store an :class:`HttpLeaseStore` talking to the real route code
(FastAPI's TestClient) on a real PostgreSQL store, the waiting policies included (their trigger waits through
the api-server too, tests/api/test_wait_places.py)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_lease_provider.core import (
    DuplicatePublish,
    EventKind,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseStore,
    RunRef,
    StaleFencingToken,
)
from airflow_lease_provider.runtime import store as runtime_store
from airflow_lease_provider.runtime.context import LeaseContext
from airflow_lease_provider.runtime.policies import Replace
from airflow_lease_provider.runtime.signals import Terminate
from airflow_lease_provider.runtime.task_lease import TaskLease
from airflow_lease_provider.version_compat import AirflowSkipException
from tests.api.test_client import PausableClient, http_store, server  # noqa: F401
from tests.api.test_lease_api import SECRET

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


class TI(SimpleNamespace):
    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed = (key, value)


def task_lease(http: Any, run_id: str, *, on_overlap: str = "skip", run_after: datetime = T0, **task: Any) -> TaskLease:
    run = RunRef("dag", run_id, task_id="t")
    op = SimpleNamespace(on_overlap=on_overlap, lease_ttl=timedelta(seconds=30), lease_renew_every=None,
                         log=logging.getLogger("test"), on_kill=lambda: None, **task)
    ti = TI(dag_id="dag", run_id=run_id, task_id="t", map_index=-1, try_number=1)
    return TaskLease(op, ti, run, run.owner(), "job", True, http, None, {}, run_after=run_after)


def events(store: LeaseStore, kind: str) -> list[Any]:
    return [e for e in store.events.query(key="job") if e.kind == kind]


def test_fail_over_the_api_fails_naming_the_holder_and_records_overlap_failed_once(
    server: PausableClient, store: LeaseStore  # noqa: F811
) -> None:
    http = http_store(server)
    first = task_lease(http, "r1").acquire(Terminate())
    with pytest.raises(LeaseHeld, match="r1"):
        task_lease(http, "r2", on_overlap="fail").acquire(Terminate())
    failed = events(store, EventKind.OVERLAP_FAILED)
    assert len(failed) == 1 and failed[0].run == RunRef("dag", "r2", task_id="t")
    assert failed[0].detail["holder_token"] == first.token and failed[0].detail["policy"] == "fail"
    acquired = [e for e in events(store, EventKind.ACQUIRED) if e.token == first.token]
    assert len(acquired) == 1 and acquired[0].run == RunRef("dag", "r1", task_id="t")  # the run columns too


def test_replace_over_the_api_takes_over_and_the_replaced_task_ends_skipped_naming_the_newer_run(
    server: PausableClient, store: LeaseStore  # noqa: F811
) -> None:
    http = http_store(server)
    older = task_lease(http, "r1", on_overlap="replace", run_after=T0)
    held = older.acquire(Terminate())
    newer = task_lease(http_store(server), "r2", on_overlap="replace", run_after=T0 + timedelta(hours=1))
    taken = newer.acquire(Terminate())
    assert taken.token > held.token
    replaced = events(store, EventKind.REPLACED)
    assert len(replaced) == 1 and replaced[0].token == held.token
    # The older run finds out at its next renewal (lost), and the policy asks who took it over: the newer run.
    assert http.renew(held) is None
    lost = LeaseLost("job", held.token, "renewal refused")
    with pytest.raises(AirflowSkipException, match="r2"):
        Replace().lost(older, lost, [SimpleNamespace(lease=held)])
    # An older run never replaces a newer one: it is skipped, naming it.
    with pytest.raises(AirflowSkipException, match="not older"):
        task_lease(http, "r0", on_overlap="replace", run_after=T0 - timedelta(hours=1)).acquire(Terminate())


class Deferred(Exception):
    """What ``task.defer`` raises in these tests (Airflow's TaskDeferred), with what it was given."""

    def __init__(self, trigger: Any, method_name: str, kwargs: dict[str, Any]) -> None:
        super().__init__(method_name)
        self.trigger, self.method_name, self.kwargs = trigger, method_name, kwargs


def defer(*, trigger: Any, method_name: str, kwargs: dict[str, Any], **_: Any) -> None:
    raise Deferred(trigger, method_name, kwargs)


def waiting_lease(http: Any, run_id: str, **task: Any) -> TaskLease:
    return task_lease(http, run_id, on_overlap="wait", defer=defer, lease_wait_timeout=None,
                      lease_poll_interval=None, **task)


def test_wait_with_one_place_over_the_api_one_waits_through_the_api_the_next_is_skipped_naming_it(
    server: PausableClient, store: LeaseStore  # noqa: F811
) -> None:
    import json

    http = http_store(server)
    first = task_lease(http, "r1").acquire(Terminate())
    second_store = http_store(server)
    with pytest.raises(Deferred) as deferred:
        waiting_lease(second_store, "r2", max_waiting=1).acquire(Terminate())
    trigger = deferred.value.trigger
    owner = RunRef("dag", "r2", task_id="t").owner()
    # The trigger waits through the api-server: the secret is read in the triggerer, never in its kwargs (the
    # metadata database); the place's id (no right alone) goes to the trigger and to the resumed task.
    _, kwargs = trigger.serialize()
    assert kwargs["access"] == "api" and kwargs["waiter"]["owner"] == owner
    assert kwargs["waiter"]["place"] == deferred.value.kwargs["place"] == second_store.place_id(owner)
    assert SECRET not in json.dumps(kwargs) + json.dumps(deferred.value.kwargs)
    assert [w.owner for w in store.waiters(["job"])] == [owner]
    waiting = events(store, EventKind.WAITING)
    assert len(waiting) == 1 and waiting[0].run == RunRef("dag", "r2", task_id="t")
    # A third run finds the one place taken: skipped, naming the run that waits (and the ledger says it).
    third = waiting_lease(http_store(server), "r3", max_waiting=1)
    with pytest.raises(AirflowSkipException, match=r"'dag/r2/t' already waits"):
        third.acquire(Terminate())
    full = events(store, EventKind.SKIPPED_BUFFER_FULL)
    assert len(full) == 1 and full[0].run == RunRef("dag", "r3", task_id="t")
    assert [w.owner for w in store.waiters(["job"])] == [owner]
    # The holder releases; the resumed task (a new process: a new store, given the place's id) takes the
    # lease and gives its place back.
    assert http.release(first)
    resumed_store = http_store(server)
    resumed_store.adopt_place(owner, deferred.value.kwargs["place"])
    taken = waiting_lease(resumed_store, "r2", max_waiting=1).acquire(Terminate(), waited=deferred.value.kwargs["deadline"])
    assert taken.owner == owner and taken.token > first.token
    assert store.waiters(["job"]) == []


def test_wait_without_places_over_the_api_defers_and_is_resumed_into_the_lease(
    server: PausableClient, store: LeaseStore  # noqa: F811
) -> None:
    http = http_store(server)
    first = task_lease(http, "r1").acquire(Terminate())
    with pytest.raises(Deferred) as deferred:
        waiting_lease(http_store(server), "r2").acquire(Terminate())
    _, kwargs = deferred.value.trigger.serialize()
    assert kwargs["access"] == "api" and kwargs["waiter"] is None and "place" not in deferred.value.kwargs
    # Resumed while still held (the trigger timed out, say): it waits again, until its first deadline.
    with pytest.raises(Deferred):
        waiting_lease(http_store(server), "r2").acquire(Terminate(), waited=deferred.value.kwargs["deadline"])
    assert http.release(first)
    taken = waiting_lease(http_store(server), "r2").acquire(Terminate(), waited=deferred.value.kwargs["deadline"])
    assert taken.token > first.token


def test_replace_with_a_grace_over_the_api_waits_through_the_api_then_takes_over(
    server: PausableClient, store: LeaseStore  # noqa: F811
) -> None:
    http = http_store(server)
    older = task_lease(http, "r1", on_overlap="replace", run_after=T0).acquire(Terminate())
    newer_args: dict[str, Any] = {"on_overlap": "replace", "run_after": T0 + timedelta(hours=1),
                                  "replace_grace": timedelta(seconds=5), "defer": defer, "lease_poll_interval": None}
    with pytest.raises(Deferred) as deferred:
        task_lease(http_store(server), "r2", **newer_args).acquire(Terminate())
    _, kwargs = deferred.value.trigger.serialize()
    assert kwargs["access"] == "api" and SECRET not in str(kwargs)
    assert store.holder("job").token == older.token  # the older run keeps it through the grace
    taken = task_lease(http_store(server), "r2", **newer_args).acquire(Terminate(), waited=deferred.value.kwargs["deadline"])
    assert taken.token > older.token and http.renew(older) is None
    assert len(events(store, EventKind.REPLACED)) == 1


@pytest.mark.parametrize(("policy", "task"), [("wait", {}), ("wait", {"max_waiting": 1}),
                                              ("replace", {"replace_grace": timedelta(seconds=5)})])
def test_a_policy_that_waits_takes_the_api_path(
    policy: str, task: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_lease_provider.client import HttpLeaseStore

    monkeypatch.setattr(runtime_store, "api_secret", lambda: SECRET)
    op = SimpleNamespace(on_overlap=policy, lease_ttl=timedelta(seconds=30), **task)
    assert isinstance(runtime_store.api_task_store(op), HttpLeaseStore)


def test_lease_fence_over_the_api(server: PausableClient, store: LeaseStore) -> None:  # noqa: F811
    http = http_store(server)
    tl = task_lease(http, "r1")
    lease = tl.acquire(Terminate())
    ctx = LeaseContext(lease=lease, store=http, run=tl.run)  # type: ignore[arg-type]
    assert ctx.fence("s3://bucket/out").accepted
    # A side effect that failed gives its idempotency claim back (a retry may publish the slot) ...
    with pytest.raises(RuntimeError), ctx.fence("s3://bucket/out", idempotency_key="slot-1"):
        raise RuntimeError("the push failed")
    with ctx.fence("s3://bucket/out", idempotency_key="slot-1"):
        pass
    # ... and one that completed keeps it: at most once.
    with pytest.raises(DuplicatePublish):
        ctx.fence("s3://bucket/out", idempotency_key="slot-1")
    with pytest.raises(LeaseError, match="fenced transaction"), ctx.fenced_transaction("table"):
        pass
    assert http.release(lease)
    # A newer grant's publish moves the fence on; the older grant is refused from then on, by the API itself
    # (its capability is no longer the key's grant's: LeaseLost) before the fence is asked.
    newer_http = http_store(server)
    newer = task_lease(newer_http, "r2").acquire(Terminate())
    assert LeaseContext(lease=newer, store=newer_http).fence("s3://bucket/out").accepted  # type: ignore[arg-type]
    with pytest.raises(LeaseLost):
        http.fences().guard("s3://bucket/out", lease.token, key="job", owner=lease.owner)
    # A holder whose token the fence has passed (a publish under a newer grant of another store's key id,
    # here the fence moved on by hand) is refused by the fence: StaleFencingToken, as on the direct path.
    from airflow_lease_provider.core import FenceStore

    FenceStore(store.db.dsn, schema=store.schema).advance("s3://bucket/other", newer.token + 5, key="job")
    with pytest.raises(StaleFencingToken):
        LeaseContext(lease=newer, store=newer_http).fence("s3://bucket/other")  # type: ignore[arg-type]
