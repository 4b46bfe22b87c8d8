"""The record of a coalesced catch-up (issue 26 items 4 and 5): kind ``coalesced``, once per run, on the
real PostgreSQL; its line, its metric (``scheduled.coalesced``) and what the ledger's readers make of it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pendulum
import pytest
from airflow.sdk import DAG

from airflow_lease_provider.core import EventKind
from airflow_lease_provider.runtime.catchup import record_skipped_catchup
from airflow_lease_provider.timetables import CappedCatchupTimetable
from airflow_lease_provider.timetables.catchup_record import COALESCED, COALESCED_METRIC, SKIPPED_CATCHUP
from tests.timetables.test_catchup_record import BEFORE_GAP, FakeTI, at, dag_run

# Before the outage the last run covered [02:00, 03:00]; after it the oldest kept run covers [03:00, 11:00]
# (hourly, coalesce=True): the 7 slots ending 04:00 .. 10:00 are folded into it.
COALESCED_RUN = dag_run("scheduled__2025-06-15T03:00:00+00:00", at(2025, 6, 15, 3), at(2025, 6, 15, 11))
NEXT = dag_run("scheduled__2025-06-15T11:00:00+00:00", at(2025, 6, 15, 11), at(2025, 6, 15, 12))


@pytest.fixture
def metrics(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None, dict | None]]:
    """Every increment of the task-side Stats, from any thread."""
    import threading

    from airflow.sdk.observability.stats import Stats

    calls: list[tuple[str, int | None, dict | None]] = []
    lock = threading.Lock()

    def incr(stat: str, count: int | None = None, rate: Any = None, *, tags: dict | None = None) -> None:
        with lock:
            calls.append((stat, count, tags))

    monkeypatch.setattr(Stats, "incr", incr)
    return calls


@pytest.fixture
def real_ledger(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The real EventLedger on the test PostgreSQL (root conftest's ``store``)."""
    store = request.getfixturevalue("store")
    store.ensure_schema()
    yield store.events


def coalescing_context(run: Any, previous: Any, *, try_number: int = 1, task_id: str = "publish") -> dict:
    dag = DAG(
        dag_id="articles",
        schedule=CappedCatchupTimetable("0 * * * *", max_backfill=2, coalesce=True),
        start_date=at(2025, 6, 1),
        catchup=True,
        max_active_runs=1,
    )
    ti = FakeTI(previous, try_number)
    ti.task_id = task_id  # type: ignore[attr-defined]
    ti.map_index = -1  # type: ignore[attr-defined]
    return {"dag": dag, "dag_run": run, "ti": ti}


def test_the_coalesced_run_records_its_range_once(
    real_ledger: Any, metrics: list, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        folded = record_skipped_catchup(coalescing_context(COALESCED_RUN, BEFORE_GAP), ledger=real_ledger)
    assert folded is not None and folded.count == 7
    assert [r.getMessage() for r in caplog.records] == [
        "catch-up: 7 missed slots of articles coalesced into this run "
        "(2025-06-15T03:00:00+00:00 to 2025-06-15T11:00:00+00:00)"
    ]
    assert metrics == [(COALESCED_METRIC, 7, {"dag_id": "articles"})]
    (event,) = real_ledger.query(kind=COALESCED)
    assert event.kind == EventKind.COALESCED == "coalesced" and event.key == "articles"
    assert event.detail == {
        "count": 7,
        "first_start": "2025-06-15T03:00:00+00:00",
        "first_end": "2025-06-15T04:00:00+00:00",
        "last_start": "2025-06-15T09:00:00+00:00",
        "last_end": "2025-06-15T10:00:00+00:00",
        "coalesced_start": "2025-06-15T03:00:00+00:00",
        "coalesced_end": "2025-06-15T11:00:00+00:00",
        "dag_id": "articles",
        "run_id": COALESCED_RUN.run_id,
        "max_backfill": 2,
    }
    assert event.run is not None and (event.run.dag_id, event.run.run_id) == (
        "articles",
        COALESCED_RUN.run_id,
    )
    # Not a skip: nothing was dropped.
    assert real_ledger.query(kind=SKIPPED_CATCHUP) == []

    # Another task of the run and a retry find the record and stay quiet; the next run folded nothing.
    caplog.clear()
    again = record_skipped_catchup(
        coalescing_context(COALESCED_RUN, BEFORE_GAP, task_id="other"), ledger=real_ledger
    )
    assert again == folded
    retry = record_skipped_catchup(
        coalescing_context(COALESCED_RUN, BEFORE_GAP, try_number=2), ledger=real_ledger
    )
    assert retry == folded
    assert record_skipped_catchup(coalescing_context(NEXT, COALESCED_RUN), ledger=real_ledger) is None
    assert len(real_ledger.query(kind=COALESCED)) == 1 and len(metrics) == 1 and caplog.records == []


def test_many_callers_at_once_write_one_record(
    real_ledger: Any, metrics: list, pg_dsn: str, schema: str
) -> None:
    """Six tasks of the run at the same moment, each with its own store: the database lets one through."""
    from airflow_lease_provider.core import LeaseStore
    from tests.timetables.test_catchup_record_once import _call_together

    def call(i: int) -> Any:
        with LeaseStore(pg_dsn, schema=schema) as store:
            return record_skipped_catchup(
                coalescing_context(COALESCED_RUN, BEFORE_GAP, task_id=f"t{i}"),
                ledger=store.events,
                key=f"k{i % 3}",
            )

    results = _call_together(6, call)
    assert all(r is not None and r.count == 7 for r in results)
    assert len(real_ledger.query(kind=COALESCED)) == 1
    assert metrics == [(COALESCED_METRIC, 7, {"dag_id": "articles"})]


@pytest.mark.parametrize("run_type", ["manual", "backfill"])
def test_manual_and_backfill_runs_record_nothing(real_ledger: Any, metrics: list, run_type: str) -> None:
    run = dag_run("x", at(2025, 6, 15, 3), at(2025, 6, 15, 11), run_type=run_type)
    assert record_skipped_catchup(coalescing_context(run, BEFORE_GAP), ledger=real_ledger) is None
    assert metrics == [] and real_ledger.query(kind=COALESCED) == []


def test_the_ledger_readers_say_what_was_coalesced(real_ledger: Any, metrics: list) -> None:
    from airflow_lease_provider.reading import summarize

    record_skipped_catchup(coalescing_context(COALESCED_RUN, BEFORE_GAP), ledger=real_ledger)
    (event,) = real_ledger.query(kind=COALESCED)
    assert summarize(event) == (
        "catch-up coalesced 7 missed slot(s) into this run: its data interval covers 2025-06-15 03:00:00 UTC "
        "to 2025-06-15 11:00:00 UTC"
    )


def test_the_dst_day_range_is_recorded_in_utc(real_ledger: Any, metrics: list) -> None:
    """Berlin's spring-forward day: 02:30 does not exist, the daily run for it runs 03:30 CEST."""
    dag = DAG(
        dag_id="articles",
        schedule=CappedCatchupTimetable("30 2 * * *", timezone="Europe/Berlin", coalesce=True),
        start_date=at(2025, 3, 1),
        catchup=True,
    )
    start = pendulum.datetime(2025, 3, 27, 2, 30, tz="Europe/Berlin").in_timezone("UTC")
    end = pendulum.datetime(2025, 3, 31, 2, 30, tz="Europe/Berlin").in_timezone("UTC")
    run = dag_run("scheduled__dst", start, end)
    folded = record_skipped_catchup({"dag": dag, "dag_run": run, "ti": FakeTI(None)}, ledger=real_ledger)
    # 28th, 29th and the 30th's 03:30 CEST (01:30 UTC).
    assert folded is not None and folded.count == 3
    (event,) = real_ledger.query(kind=COALESCED)
    assert event.detail["last_end"] == "2025-03-30T01:30:00+00:00"
    assert event.detail["coalesced_start"] == "2025-03-27T01:30:00+00:00"


def test_the_timeline_shows_the_coalesced_range_and_the_trends_do_not_count_it_as_skipped(store: Any) -> None:
    """The Leases page's timeline (a key's markers, the DAG's catch-up records) and the DAG tab's reads."""
    from datetime import timedelta

    from airflow_lease_provider.core.history import LeaseHistory
    from airflow_lease_provider.core.identity import RunRef
    from airflow_lease_provider.plugins import timeline

    store.ensure_schema()
    run = RunRef("etl", "scheduled__c", task_id="load")
    lease = store.acquire("etl.load", "etl/scheduled__c/load", timedelta(minutes=10), run=run)
    assert lease is not None
    # Recorded under the DAG id (a leased task without lease_key), as catchup_record writes it.
    detail = {
        "dag_id": "etl",
        "run_id": "scheduled__c",
        "count": 287,
        "coalesced_start": "2025-06-14T12:00:00+00:00",
        "coalesced_end": "2025-06-15T12:00:00+00:00",
    }
    store.events.record(EventKind.COALESCED, "etl", owner="etl/scheduled__c", detail=detail, run=run)

    data = timeline.key_timeline(store, "etl.load", range_name="24h")
    (marker,) = [m for m in data["markers"] if m["kind"] == "coalesced"]
    assert marker["slots"] == 287
    assert (marker["coalesced_start"], marker["coalesced_end"]) == (
        detail["coalesced_start"],
        detail["coalesced_end"],
    )
    assert marker["summary"].startswith("catch-up coalesced 287 missed slot(s) into this run")
    # Nothing was skipped: the trends' catch-up counts stay at zero, and the DAG id is not a lease key.
    assert timeline.dag_trend(store, "etl", range_name="7d")["totals"]["catchup_slots"] == 0
    history = LeaseHistory(store)
    now = history.now()
    assert [u.key for u in history.dag_keys("etl", now - timedelta(days=1), now)] == ["etl.load"]
    # The task's Lease tab (the writer's task instance) and the Leases page's event list.
    from airflow_lease_provider.reading import task_instance_events

    tab = task_instance_events(store, "etl", "scheduled__c", "load")
    assert [e["kind"] for e in tab["events"] if e["kind"] == "coalesced"] == ["coalesced"]
