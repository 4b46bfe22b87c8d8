"""Leases keyed by asset, in-process: the parse-time check, the key's canonical form, and several outlets
taken in one order, all or nothing (issue 27 item 1).

The operators run as the task runner runs them (``execute(context)``) against the real lease store; two
tasks with overlapping outlet sets run concurrently many times: never a deadlock, never both holding.
"""

from __future__ import annotations

import threading
import unicodedata
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, Asset, task
from airflow.sdk.exceptions import AirflowSkipException

from airflow_lease_provider.assets import EXTRA_KEY, asset_lease_key, outlet_keys
from airflow_lease_provider.core import InvalidArgument, LeaseStore, validation
from airflow_lease_provider.operators import LeasedOperator

LeasedPython = LeasedOperator.wrap(PythonOperator)
TTL = timedelta(seconds=30)
X, Y, Z = (Asset(n, uri=f"s3://lake/{n}") for n in ("x", "y", "z"))
KX, KY, KZ = (asset_lease_key(a.uri) for a in (X, Y, Z))


@dataclass
class TaskInstance:
    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    try_number: int = 1
    xcoms: dict[str, Any] = field(default_factory=dict)

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = value


class Events(dict):
    """The context's ``outlet_events``: an accessor with an ``extra`` per asset, as Airflow's."""

    def __missing__(self, asset: Any) -> Any:
        self[asset] = value = type("Accessor", (), {})()
        value.extra = {}
        return value


def run_task(op: Any, dag_id: str, run_id: str = "manual__1", **context: Any) -> Any:
    ti = TaskInstance(dag_id, run_id, op.task_id)
    return op.execute({"ti": ti, "task_instance": ti, "run_id": run_id, "params": {}, **context})


@pytest.fixture
def lease_env(monkeypatch: pytest.MonkeyPatch, pg_dsn: str, schema: str) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", pg_dsn)
    monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", schema)


# -- at parse time -----------------------------------------------------------------------------------------


def test_lease_on_outlets_without_asset_outlets_is_a_parse_error() -> None:
    with DAG("p", schedule=None, start_date=datetime(2026, 1, 1)):
        with pytest.raises(InvalidArgument, match="lease_on.*has none"):
            LeasedPython(task_id="t", python_callable=lambda: None, lease_on="outlets", lease_ttl=TTL)

        @task.leased(lease_on="outlets", lease_ttl=TTL)
        def no_outlets() -> None: ...

        with pytest.raises(InvalidArgument, match="lease_on.*has none"):
            no_outlets()
        with pytest.raises(InvalidArgument, match="lease_key"):
            LeasedPython(task_id="k", python_callable=lambda: None, lease_on="outlets", lease_key="k",
                         outlets=[X], lease_ttl=TTL)
        with pytest.raises(InvalidArgument, match="lease_on"):
            LeasedPython(task_id="o", python_callable=lambda: None, lease_on="asset", lease_ttl=TTL)
        LeasedPython(task_id="ok", python_callable=lambda: None, lease_on="outlets", outlets=[X], lease_ttl=TTL)
        with pytest.raises(InvalidArgument, match="has none"):
            LeasedPython.partial(task_id="m", lease_on="outlets", lease_ttl=TTL)


def test_the_key_is_the_assets_uri_canonical_and_within_the_limits() -> None:
    # The same asset whatever its name, the URI as Airflow normalises it (trailing slash).
    assert asset_lease_key(Asset("a", uri="s3://lake/t/").uri) == asset_lease_key(Asset("b", uri="s3://lake/t").uri)
    assert asset_lease_key("s3://lake/t") == "asset:s3://lake/t"
    # Airflow does not normalise Unicode: the NFD and NFC URIs are two assets (and two S3 objects), so two
    # keys; the NFC one readable, the other hashed (tests/airflow/test_asset_keys.py).
    nfd, nfc = unicodedata.normalize("NFD", "s3://lake/é"), unicodedata.normalize("NFC", "s3://lake/é")
    assert asset_lease_key(nfc) == f"asset:{nfc}"
    assert asset_lease_key(nfd) != asset_lease_key(nfc) and "~" in asset_lease_key(nfd)
    # Per partition; different partitions, different keys.
    assert asset_lease_key("s3://lake/t", "2026-01-01") == "asset:s3://lake/t#2026-01-01"
    assert asset_lease_key("s3://lake/t", "a") != asset_lease_key("s3://lake/t", "b")
    # Too long, or ambiguous (a '#' in a non-URI name): the hashed form, a valid key, different per identity.
    long_a, long_b = "s3://lake/" + "a" * 600, "s3://lake/" + "a" * 599 + "b"
    for key in (asset_lease_key(long_a), asset_lease_key("x#y"), asset_lease_key("x", "y")):
        assert validation.name("key", key) == key and len(key) <= validation.MAX_NAME_LENGTH
    assert asset_lease_key(long_a) != asset_lease_key(long_b)
    assert asset_lease_key("x#y") != asset_lease_key("x", "y")
    # Several outlets: taken in sorted key order, whatever order the task lists them.
    assert list(outlet_keys([Z, X, Y])) == list(outlet_keys([Y, Z, X])) == sorted([KX, KY, KZ])


# -- all or nothing --------------------------------------------------------------------------------------


def test_a_task_whose_second_asset_is_held_takes_none_and_skips(lease_env, store: LeaseStore) -> None:
    seen: dict[str, Any] = {}
    # "zz" is written by the first; the second writes x and zz: x is free and is taken first (sorted),
    # then zz is held: x must be given back before the skip (no half-hold).
    ZZ = Asset("zz", uri="s3://lake/zz")
    second = LeasedPython(task_id="second", python_callable=lambda: seen.setdefault("second ran", True),
                          lease_on="outlets", outlets=[ZZ, X], lease_ttl=TTL)

    def first_body(lease=None):
        with pytest.raises(AirflowSkipException) as skipped:
            run_task(second, "dag_two")
        seen["reason"] = str(skipped.value)
        seen["x holder"] = store.holder(KX)
        seen["x row"] = store.lease(KX)
        return lease.token

    first = LeasedPython(task_id="first", python_callable=first_body, lease_on="outlets", outlets=[ZZ],
                         lease_ttl=TTL)
    events = Events()
    token = run_task(first, "dag_one", outlet_events=events)
    assert "second ran" not in seen
    assert "dag_one/manual__1/first" in seen["reason"] and asset_lease_key(ZZ.uri) in seen["reason"]
    assert seen["x row"] is not None and seen["x holder"] is None, "x was taken and not given back"
    assert events[ZZ].extra[EXTRA_KEY]["token"] == token
    assert events[ZZ].extra[EXTRA_KEY]["key"] == asset_lease_key(ZZ.uri)


def test_overlapping_outlet_sets_concurrently_never_deadlock_nor_both_hold(lease_env, store: LeaseStore) -> None:
    """Three tasks, outlets {x, y}, {y, x} and {y, z}, released together 25 times: each round ends (no
    deadlock), no asset is ever written by two at once, and after each round every lease is free."""
    lock = threading.Lock()
    inside: dict[str, str] = {}
    overlaps: list[str] = []
    ran: dict[str, int] = {"ab": 0, "ba": 0, "yz": 0}

    def body(name: str, assets: list[Asset]) -> Any:
        def run() -> None:
            with lock:
                for a in assets:
                    if a.name in inside:
                        overlaps.append(f"{name} and {inside[a.name]} both in {a.name}")
                    inside[a.name] = name
                ran[name] += 1
            threading.Event().wait(0.02)
            with lock:
                for a in assets:
                    inside.pop(a.name, None)

        return run

    sets = {"ab": [X, Y], "ba": [Y, X], "yz": [Y, Z]}
    ops = {
        name: LeasedPython(task_id=f"t_{name}", python_callable=body(name, assets), lease_on="outlets",
                           outlets=assets, lease_ttl=TTL)
        for name, assets in sets.items()
    }
    outcomes: list[str] = []
    for round_ in range(25):
        barrier = threading.Barrier(len(ops))

        def go(name: str, op: Any, round_: int = round_, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                run_task(op, f"dag_{name}", run_id=f"r{round_}")
                outcomes.append("ran")
            except AirflowSkipException:
                outcomes.append("skipped")

        threads = [threading.Thread(target=go, args=(n, op)) for n, op in ops.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), f"round {round_}: a task never finished (deadlock)"
        assert all(store.holder(k) is None for k in (KX, KY, KZ)), f"round {round_}: a lease left held"
    assert overlaps == []
    assert len(outcomes) == 75 and outcomes.count("ran") >= 1
    assert sum(ran.values()) == outcomes.count("ran")


def test_is_stale_when_a_fence_refused_the_producers_token(lease_env, store: LeaseStore, fences) -> None:
    """The producer's token is still the newest of its key, but the fence of what it wrote refused it."""
    from airflow_lease_provider.assets import is_stale, staleness
    from airflow_lease_provider.core import StaleFencingToken

    # A writer from elsewhere (another lease store, a restored backup) advanced the fence of this key past us.
    fences.guard("warehouse.sales", 10**6, key=KX, owner="someone")
    seen: dict[str, Any] = {}

    def body(lease=None):
        seen["extra"] = {EXTRA_KEY: {"key": lease.key, "token": lease.token, "owner": lease.owner}}
        seen["before"] = is_stale(seen["extra"])
        lease.fence("warehouse.sales")

    op = LeasedPython(task_id="w", python_callable=body, lease_on="outlets", outlets=[X], lease_ttl=TTL)
    with pytest.raises(StaleFencingToken):
        run_task(op, "producer")
    assert seen["before"] is False
    answer = staleness(seen["extra"])
    assert answer.stale and "fence refused" in (answer.reason or "")
    assert store.lease(KX) is not None and store.lease(KX).token == seen["extra"][EXTRA_KEY]["token"]


def test_with_a_partition_key_the_lease_is_per_partition(lease_env, store: LeaseStore) -> None:
    """A partitioned run (``partition_key`` in the context, Airflow 3.2+): writers of one partition exclude
    each other, writers of two partitions of the same asset do not."""
    seen: dict[str, Any] = {}
    same = LeasedPython(task_id="same", python_callable=lambda: seen.setdefault("same ran", True),
                        lease_on="outlets", outlets=[X], lease_ttl=TTL)
    other = LeasedPython(task_id="other", python_callable=lambda lease=None: seen.setdefault("other", lease.key),
                         lease_on="outlets", outlets=[X], lease_ttl=TTL)

    def body(lease=None):
        with pytest.raises(AirflowSkipException):
            run_task(same, "dag_b", partition_key="2026-01-01")
        run_task(other, "dag_c", partition_key="2026-01-02")
        return lease.key

    first = LeasedPython(task_id="first", python_callable=body, lease_on="outlets", outlets=[X], lease_ttl=TTL)
    events = Events()
    key = run_task(first, "dag_a", partition_key="2026-01-01", outlet_events=events)
    assert key == asset_lease_key(X.uri, "2026-01-01") == "asset:s3://lake/x#2026-01-01"
    assert "same ran" not in seen and seen["other"] == "asset:s3://lake/x#2026-01-02"
    assert events[X].extra[EXTRA_KEY]["partition_key"] == "2026-01-01"
    assert events[X].extra[EXTRA_KEY]["key"] == key


def test_wait_defers_on_the_held_asset_holding_none(lease_env, store: LeaseStore) -> None:
    """``on_overlap="wait"`` with several outlets: the task defers on the key that is held, and holds none
    of the others while it waits."""
    from airflow.sdk.exceptions import TaskDeferred

    held = store.acquire(KY, "someone-else", TTL)
    assert held is not None
    op = LeasedPython(task_id="w", python_callable=lambda: None, lease_on="outlets", outlets=[Y, X],
                      lease_ttl=TTL, on_overlap="wait")
    with pytest.raises(TaskDeferred) as deferred:
        run_task(op, "waiter")
    assert deferred.value.trigger.key == KY  # x (first in order) was taken, then y was found held
    assert store.lease(KX) is not None and store.holder(KX) is None
