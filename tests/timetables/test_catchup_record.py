"""The task-side record of skipped catch-up slots: once per run, in the ledger, the log and the metric."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pendulum
import pytest
from airflow.sdk import DAG
from airflow.sdk.api.datamodels._generated import DagRunType

from airflow_lease_provider.runtime.catchup import record_skipped_catchup
from airflow_lease_provider.timetables import CappedCatchupTimetable
from airflow_lease_provider.timetables.catchup_record import METRIC, SKIPPED_CATCHUP, skipped_catchup_slots


def at(*args: int) -> pendulum.DateTime:
    return pendulum.datetime(*args, tz="UTC")


class FakeTI:
    def __init__(self, previous: Any, try_number: int = 1) -> None:
        self.previous = previous
        self.try_number = try_number

    def get_previous_dagrun(self, state: str | None = None) -> Any:
        return self.previous


def dag_run(
    run_id: str, start: pendulum.DateTime, end: pendulum.DateTime, run_type: Any = "scheduled"
) -> Any:
    return SimpleNamespace(
        dag_id="articles",
        run_id=run_id,
        run_type=run_type,
        logical_date=start,
        data_interval_start=start,
        data_interval_end=end,
    )


def context(
    run: Any, previous: Any, *, try_number: int = 1, max_backfill: int = 2, catchup: bool = True
) -> dict:
    dag = DAG(
        dag_id="articles",
        schedule=CappedCatchupTimetable("0 * * * *", max_backfill=max_backfill),
        start_date=at(2025, 6, 1),
        catchup=catchup,
        max_active_runs=1,
    )
    return {"dag": dag, "dag_run": run, "ti": FakeTI(previous, try_number)}


@pytest.fixture
def metrics(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None, dict | None]]:
    from airflow.sdk.observability.stats import Stats

    calls: list[tuple[str, int | None, dict | None]] = []

    def incr(stat: str, count: int | None = None, rate: Any = None, *, tags: dict | None = None) -> None:
        calls.append((stat, count, tags))

    monkeypatch.setattr(Stats, "incr", incr)
    return calls


BEFORE_GAP = dag_run("scheduled__2025-06-15T03:00:00+00:00", at(2025, 6, 15, 2), at(2025, 6, 15, 3))
AFTER_GAP = dag_run("scheduled__2025-06-15T11:00:00+00:00", at(2025, 6, 15, 10), at(2025, 6, 15, 11))
NEXT = dag_run("scheduled__2025-06-15T12:00:00+00:00", at(2025, 6, 15, 11), at(2025, 6, 15, 12))


def events_of(ledger: Any) -> list[Any]:
    return ledger.query(kind=SKIPPED_CATCHUP)


def test_first_run_after_a_gap_records_once(
    real_ledger: Any, metrics: list, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = real_ledger
    with caplog.at_level(logging.WARNING):
        skipped = record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP), ledger=ledger)
    # Slots ending 04:00 .. 10:00 never ran: 7 of them.
    assert skipped is not None and skipped.count == 7
    assert [r.getMessage() for r in caplog.records] == ["catch-up: 7 older slots of articles skipped"]
    assert metrics == [(METRIC, 7, {"dag_id": "articles"})]
    (event,) = events_of(ledger)
    assert event.kind == SKIPPED_CATCHUP and event.key == "articles"
    assert event.owner == f"articles/{AFTER_GAP.run_id}"
    assert event.detail == {
        "count": 7,
        "first_start": "2025-06-15T03:00:00+00:00",
        "first_end": "2025-06-15T04:00:00+00:00",
        "last_start": "2025-06-15T09:00:00+00:00",
        "last_end": "2025-06-15T10:00:00+00:00",
        "dag_id": "articles",
        "run_id": AFTER_GAP.run_id,
        "max_backfill": 2,
    }

    # Another task of the same run, and a retry, find the record and stay quiet.
    caplog.clear()
    assert record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP), ledger=ledger) == skipped
    assert record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP, try_number=2), ledger=ledger) == skipped
    assert len(events_of(ledger)) == 1 and len(metrics) == 1 and caplog.records == []

    # The run after it skipped nothing.
    assert record_skipped_catchup(context(NEXT, AFTER_GAP), ledger=ledger) is None
    assert len(events_of(ledger)) == 1


def test_custom_key_and_logger(real_ledger: Any, metrics: list, caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.leased")
    with caplog.at_level(logging.WARNING, logger="test.leased"):
        record_skipped_catchup(
            context(AFTER_GAP, BEFORE_GAP), ledger=real_ledger, key="lease:articles", logger=logger
        )
    assert events_of(real_ledger)[0].key == "lease:articles"
    assert [r.name for r in caplog.records] == ["test.leased"]


def test_a_ledger_that_is_not_a_stores_is_refused_by_name() -> None:
    from airflow_lease_provider.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="ledger"):
        record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP), ledger=object())  # type: ignore[arg-type]


def test_without_a_ledger_only_the_first_try_logs_and_counts(
    metrics: list, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP)) is not None
        assert record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP, try_number=2)) is not None
    assert len(caplog.records) == 1 and metrics == [(METRIC, 7, {"dag_id": "articles"})]


@pytest.mark.parametrize("run_type", ["manual", "backfill", DagRunType.MANUAL, DagRunType.ASSET_TRIGGERED])
def test_only_scheduled_runs_record(run_type: Any, real_ledger: Any, metrics: list) -> None:
    run = dag_run("x", at(2025, 6, 15, 10), at(2025, 6, 15, 11), run_type=run_type)
    assert record_skipped_catchup(context(run, BEFORE_GAP), ledger=real_ledger) is None
    assert metrics == [] and events_of(real_ledger) == []


def test_enum_run_type_and_sdk_dag_run_model() -> None:
    from airflow.sdk.api.datamodels._generated import DagRun

    def model(run: Any) -> DagRun:
        return DagRun(
            dag_id=run.dag_id,
            run_id=run.run_id,
            logical_date=run.logical_date,
            data_interval_start=run.data_interval_start,
            data_interval_end=run.data_interval_end,
            run_after=run.data_interval_end,
            start_date=None,
            end_date=None,
            run_type=DagRunType.SCHEDULED,
            state="success",
            consumed_asset_events=[],
            partition_key=None,
        )

    skipped = skipped_catchup_slots(context(model(AFTER_GAP), model(BEFORE_GAP)))
    assert skipped is not None and skipped.count == 7


def test_other_timetables_record_nothing() -> None:
    ctx = context(AFTER_GAP, BEFORE_GAP)
    ctx["dag"] = DAG(dag_id="articles", schedule="0 * * * *", start_date=at(2025, 6, 1))
    assert skipped_catchup_slots(ctx) is None


def test_first_run_counts_from_start_date_only_with_catchup() -> None:
    first = dag_run("first", at(2025, 6, 15, 10), at(2025, 6, 15, 11))
    skipped = skipped_catchup_slots(context(first, None, catchup=True))
    # start_date 2025-06-01 00:00: intervals [00:00, 01:00] ... [09:00, 10:00] on 06-15.
    assert skipped is not None and skipped.count == 14 * 24 + 10
    assert skipped_catchup_slots(context(first, None, catchup=False)) is None


@pytest.fixture
def real_ledger(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The real EventLedger on the test PostgreSQL (root conftest's ``store``)."""
    store = request.getfixturevalue("store")
    store.ensure_schema()
    yield store.events


def test_real_ledger_keeps_one_event_per_run(real_ledger: Any, metrics: list) -> None:
    for _ in range(3):
        record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP), ledger=real_ledger)
    (event,) = real_ledger.query(key="articles", kind=SKIPPED_CATCHUP)
    assert event.detail["count"] == 7 and event.detail["run_id"] == AFTER_GAP.run_id
    assert len(metrics) == 1
