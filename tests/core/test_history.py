"""LeaseHistory on a real PostgreSQL: a key's events with its fence rejections, the holding open before a
range, catch-up records of a DAG, trends, a DAG's keys; scoped reads; and the timeline built from them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from psycopg2 import sql

from airflow_lease_provider.core import EventKind, FenceStore, InvalidArgument, LeaseStore
from airflow_lease_provider.core.history import LeaseHistory
from airflow_lease_provider.core.identity import RunRef
from airflow_lease_provider.plugins import timeline
from tests.pg import execute

KEY = "etl.load"
A = "etl/scheduled__2026-11-30T03:00:00+00:00/load"
B = "etl/scheduled__2026-11-30T04:00:00+00:00/load"


def _shift(dsn: str, schema: str, event_id: int, hours: float) -> None:
    query = sql.SQL("UPDATE {}.event SET at = at - %s WHERE id = %s").format(sql.Identifier(schema))
    execute(dsn, query, (timedelta(hours=hours), event_id))


def _last_id(store: LeaseStore) -> int:
    (event,) = store.events.query(limit=1)
    return event.id


@pytest.fixture
def seeded(store: LeaseStore, fences: FenceStore, pg_dsn: str, schema: str) -> LeaseStore:
    """Through the core API, naming each run as the Airflow layer does (``run=``): a hold 30 h ago (before
    a 24 h range), a released one, a skip, a fence rejection and a catch-up record; events moved back in
    time by SQL."""
    run_a, run_b = RunRef.parse(A), RunRef.parse(B)
    first = store.acquire(KEY, A, timedelta(hours=2), run=run_a)
    assert first is not None
    _shift(pg_dsn, schema, _last_id(store), 30)
    assert store.release(first, run=run_a)
    _shift(pg_dsn, schema, _last_id(store), 29)
    second = store.acquire(KEY, B, timedelta(minutes=10), run=run_b)
    assert second is not None
    store.events.record(EventKind.SKIPPED_OVERLAP, KEY, owner=A, detail={"dag_id": "etl", "run_id": "r3", "task_id": "load"},
                        run=RunRef("etl", "r3", task_id="load"))
    assert fences.accept("warehouse", second.token + 1, key=KEY, run=run_b)
    assert not fences.accept("warehouse", second.token, key=KEY, owner=B, run=run_b)
    store.events.record(EventKind.SKIPPED_CATCHUP, "etl", owner="etl/scheduled__x",
                        detail={"dag_id": "etl", "run_id": "scheduled__x", "count": 6}, run=RunRef("etl", "scheduled__x"))
    store.events.record(EventKind.SKIPPED_OVERLAP, "other.key", owner="other/r/t", detail={"dag_id": "other", "run_id": "r"},
                        run=RunRef("other", "r", task_id="t"))
    return store


def test_key_events_include_the_fence_rejections_of_the_key(seeded: LeaseStore) -> None:
    history = LeaseHistory(seeded)
    now = history.now()
    events = history.key_events(KEY, now - timedelta(hours=24), now + timedelta(seconds=1))
    assert [e.kind for e in events] == ["fence_rejected", "skipped_overlap", "acquired"]
    (rejected,) = [e for e in events if e.kind == "fence_rejected"]
    assert rejected.key == "warehouse" and rejected.detail["lease_key"] == KEY
    # Scoped: a DAG the events are not of sees none of them.
    assert history.key_events(KEY, now - timedelta(hours=24), now, dag_ids={"other"}) == []


def test_the_holding_open_before_the_range(seeded: LeaseStore) -> None:
    history = LeaseHistory(seeded)
    now = history.now()
    before = history.open_holding(KEY, now - timedelta(hours=29.5))
    assert [e.kind for e in before] == ["acquired"]  # its release came after that moment
    before = history.open_holding(KEY, now - timedelta(hours=24))
    assert [e.kind for e in before] == ["acquired", "released"]


def test_timeline_holdings_and_markers(seeded: LeaseStore) -> None:
    data = timeline.key_timeline(seeded, KEY, range_name="24h")
    # The first hold ended 29 h ago, before the range: not drawn. The second is held now.
    assert [(h["token"], h["outcome"]) for h in data["holdings"]] == [(2, "held")]
    assert {m["kind"] for m in data["markers"]} == {"skipped_overlap", "fence_rejected", "skipped_catchup"}
    (catchup,) = [m for m in data["markers"] if m["kind"] == "skipped_catchup"]
    assert catchup["slots"] == 6
    week = timeline.key_timeline(seeded, KEY, range_name="7d")
    assert [(h["token"], h["outcome"]) for h in week["holdings"]] == [(1, "released"), (2, "held")]


def test_trends_and_dag_keys(seeded: LeaseStore) -> None:
    trend = timeline.key_trend(seeded, KEY, range_name="7d")
    assert trend["totals"]["runs"] == 2 and trend["totals"]["skipped_overlap"] == 1
    assert trend["skip_share"] == round(1 / 3, 4)
    assert [g["slots"] for g in trend["catchup_gaps"]] == [6]
    dag = timeline.dag_trend(seeded, "etl", range_name="7d")
    assert dag["totals"]["attempts"] == 3 and dag["totals"]["catchup_slots"] == 6
    history = LeaseHistory(seeded)
    now = history.now()
    assert [u.key for u in history.dag_keys("etl", now - timedelta(days=7), now)] == [KEY]
    assert [lease.key for lease in history.dag_leases("etl")] == [KEY]
    view = timeline.dag_view(seeded, "etl", range_name="7d")
    assert [k["key"] for k in view["keys"]] == [KEY]
    assert view["keys"][0]["timeline"]["lease"]["held"] is True


def test_bad_arguments_name_the_parameter(seeded: LeaseStore) -> None:
    history = LeaseHistory(seeded)
    now = history.now()
    with pytest.raises(InvalidArgument, match="since"):
        history.key_events(KEY, now, now - timedelta(hours=1))
    with pytest.raises(InvalidArgument, match="unit"):
        history.key_trend(KEY, now - timedelta(hours=1), now, unit="week")
    with pytest.raises(InvalidArgument, match="since"):
        history.open_holding(KEY, now.replace(tzinfo=None))
