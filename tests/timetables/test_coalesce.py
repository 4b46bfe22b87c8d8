"""Coalesced catch-up (issue 26 item 4): ``CappedCatchupTimetable(..., coalesce=True)``, frozen clock.

Through the scheduler's own calls: ``next_dagrun_info`` (what it asks after each run) and
``next_run_info_from_dag_model`` (what it asks right before creating the run it stored before an outage).
The runs with ``coalesce=True`` are compared with the same timetable's runs without it: the same kept
slots, only the oldest kept run's interval reaches back to where the last run's ended.
"""

from __future__ import annotations

import datetime
from typing import Any

import pendulum
import pytest
from airflow.timetables.base import DagRunInfo, DataInterval, TimeRestriction

from airflow_lease_provider.core.errors import InvalidArgument
from airflow_lease_provider.timetables import CappedCatchupTimetable
from tests.timetables.conftest import FrozenClock
from tests.timetables.dag_model import stored
from tests.timetables.test_capped_catchup import CATCHUP, NO_CATCHUP, minute, scheduled_runs

FIVE = "*/5 * * * *"


def _restriction(monkeypatch: pytest.MonkeyPatch, catchup: bool) -> None:
    """What the timetable reads through the scheduler's session: the DAG's catchup flag; no runs taken."""
    from airflow_lease_provider.timetables import _scheduler

    monkeypatch.setattr(
        _scheduler, "dag_time_restriction", lambda _model: TimeRestriction(minute(2025, 1, 1), None, catchup)
    )
    monkeypatch.setattr(_scheduler, "taken_logical_dates", lambda _model, since: set())


# -- the headline: a day offline, one run over the whole gap ---------------------------------------------


def test_a_day_outage_of_a_five_minute_schedule_is_one_run_over_the_whole_gap(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable(FIVE, coalesce=True)
    last = DataInterval(minute(2025, 6, 14, 11, 55), minute(2025, 6, 14, 12, 0))  # a day before NOW
    runs, waiting = scheduled_runs(timetable, last, CATCHUP, clock)
    # One run: its interval starts where the last one ended and ends at the newest due slot.
    assert runs == [DagRunInfo.interval(last.end, minute(2025, 6, 15, 12, 0))]
    assert runs[0].logical_date == last.end
    assert waiting is not None and waiting.data_interval == DataInterval(
        minute(2025, 6, 15, 12, 0), minute(2025, 6, 15, 12, 5)
    )
    # 287 slots folded in (strictly between the two ends), each as the interval its own run would have had.
    folded = timetable.coalesced_slots(runs[0].data_interval)
    assert folded is not None and folded.count == 24 * 12 - 1
    assert folded.first == DataInterval(last.end, minute(2025, 6, 14, 12, 5))
    assert folded.last == DataInterval(minute(2025, 6, 15, 11, 50), minute(2025, 6, 15, 11, 55))
    # Without coalesce the same slot runs over one interval and the rest is dropped.
    plain, _ = scheduled_runs(CappedCatchupTimetable(FIVE), last, CATCHUP, clock)
    assert [r.run_after for r in plain] == [r.run_after for r in runs]
    assert plain[0].data_interval == DataInterval(minute(2025, 6, 15, 11, 55), minute(2025, 6, 15, 12, 0))


def test_the_run_stored_before_the_outage_is_widened_not_moved(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler creates the run it stored before the outage: its start and logical date stay (the
    scheduler checked that logical date is free), its end becomes the kept slot."""
    _restriction(monkeypatch, catchup=True)
    timetable = CappedCatchupTimetable(FIVE, coalesce=True)
    clock.set(minute(2025, 6, 14, 12, 0, 2))
    last = DataInterval(minute(2025, 6, 14, 11, 55), minute(2025, 6, 14, 12, 0))
    before_outage = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert before_outage == DagRunInfo.interval(last.end, minute(2025, 6, 14, 12, 5))  # nothing missed yet

    clock.set(minute(2025, 6, 15, 12, 0, 30))
    created = timetable.next_run_info_from_dag_model(dag_model=stored(before_outage))
    assert created == DagRunInfo.interval(last.end, minute(2025, 6, 15, 12, 0))
    assert created is not None and created.logical_date == before_outage.logical_date
    # Then the schedule goes on from the kept slot: no second run in the gap.
    runs, waiting = scheduled_runs(timetable, created.data_interval, CATCHUP, clock)
    assert runs == []
    assert waiting is not None and waiting.run_after == minute(2025, 6, 15, 12, 5)
    # With no session (``airflow dags next-execution``) the catchup flag is unknown: taken as True.
    from airflow_lease_provider.timetables import _scheduler

    monkeypatch.setattr(_scheduler, "dag_time_restriction", lambda _model: None)
    assert timetable.next_run_info_from_dag_model(dag_model=stored(before_outage)) == created


@pytest.mark.parametrize("cap", [2, 3, 5])
def test_with_max_backfill_n_the_other_kept_runs_are_normal_slots(clock: FrozenClock, cap: int) -> None:
    last = DataInterval(minute(2025, 6, 14, 11, 55), minute(2025, 6, 14, 12, 0))
    runs, _ = scheduled_runs(
        CappedCatchupTimetable(FIVE, max_backfill=cap, coalesce=True), last, CATCHUP, clock
    )
    plain, _ = scheduled_runs(CappedCatchupTimetable(FIVE, max_backfill=cap), last, CATCHUP, clock)
    assert len(runs) == cap
    assert runs[1:] == plain[1:]
    assert runs[0] == DagRunInfo.interval(last.end, plain[0].run_after)
    # Contiguous: every interval starts where the one before ended, from the last run on.
    assert [r.data_interval.start for r in runs] == [last.end] + [r.data_interval.end for r in runs[:-1]]


def test_stored_run_with_max_backfill_n(clock: FrozenClock, monkeypatch: pytest.MonkeyPatch) -> None:
    _restriction(monkeypatch, catchup=True)
    timetable = CappedCatchupTimetable(FIVE, max_backfill=3, coalesce=True)
    stale = DagRunInfo.interval(minute(2025, 6, 14, 12, 0), minute(2025, 6, 14, 12, 5))
    created = timetable.next_run_info_from_dag_model(dag_model=stored(stale))
    assert created == DagRunInfo.interval(minute(2025, 6, 14, 12, 0), minute(2025, 6, 15, 11, 50))
    assert created is not None
    runs, _ = scheduled_runs(timetable, created.data_interval, CATCHUP, clock)
    assert [r.data_interval for r in runs] == [
        DataInterval(minute(2025, 6, 15, 11, 50), minute(2025, 6, 15, 11, 55)),
        DataInterval(minute(2025, 6, 15, 11, 55), minute(2025, 6, 15, 12, 0)),
    ]


def test_no_outage_changes_nothing(clock: FrozenClock, monkeypatch: pytest.MonkeyPatch) -> None:
    _restriction(monkeypatch, catchup=True)
    timetable = CappedCatchupTimetable(FIVE, max_backfill=3, coalesce=True)
    last = DataInterval(minute(2025, 6, 15, 11, 50), minute(2025, 6, 15, 11, 55))
    on_time = DagRunInfo.interval(minute(2025, 6, 15, 11, 55), minute(2025, 6, 15, 12, 0))
    assert timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP) == on_time
    assert timetable.next_run_info_from_dag_model(dag_model=stored(on_time)) == on_time
    assert timetable.coalesced_slots(on_time.data_interval) is None


def test_max_backfill_zero_folds_the_gap_into_the_next_run(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable(FIVE, max_backfill=0, coalesce=True)
    last = DataInterval(minute(2025, 6, 15, 10, 0), minute(2025, 6, 15, 10, 5))
    runs, waiting = scheduled_runs(timetable, last, CATCHUP, clock)
    assert runs == []
    assert waiting == DagRunInfo.interval(last.end, minute(2025, 6, 15, 12, 5))


def test_first_run_from_an_old_start_date_covers_it(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("0 * * * *", max_backfill=2, coalesce=True)
    restriction = TimeRestriction(earliest=minute(2025, 6, 1, 0, 30), latest=None, catchup=True)
    runs, _ = scheduled_runs(timetable, None, restriction, clock)
    assert runs == [
        DagRunInfo.interval(minute(2025, 6, 1, 1), minute(2025, 6, 15, 11)),
        DagRunInfo.interval(minute(2025, 6, 15, 11), minute(2025, 6, 15, 12)),
    ]


def test_fixed_interval_coalesces_on_its_own_phase(clock: FrozenClock) -> None:
    every = datetime.timedelta(minutes=45)
    timetable = CappedCatchupTimetable(every, coalesce=True)
    last = DataInterval(minute(2025, 6, 14, 0, 7), minute(2025, 6, 14, 0, 52))
    runs, _ = scheduled_runs(timetable, last, CATCHUP, clock)
    assert len(runs) == 1 and runs[0].data_interval.start == last.end
    assert (runs[0].run_after - last.end).total_seconds() % every.total_seconds() == 0
    folded = timetable.coalesced_slots(runs[0].data_interval)
    assert folded is not None
    assert folded.count == int((runs[0].run_after - last.end).total_seconds() // every.total_seconds()) - 1


# -- where coalesce does not apply: catchup=False, backfills, manual runs ------------------------------


@pytest.mark.parametrize("cap", [1, 4])
def test_catchup_false_is_latest_only_as_without_coalesce(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch, cap: int
) -> None:
    _restriction(monkeypatch, catchup=False)
    coalescing = CappedCatchupTimetable(FIVE, max_backfill=cap, coalesce=True)
    plain = CappedCatchupTimetable(FIVE, max_backfill=cap)
    last = DataInterval(minute(2025, 6, 14, 11, 55), minute(2025, 6, 14, 12, 0))
    assert scheduled_runs(coalescing, last, NO_CATCHUP, clock) == scheduled_runs(
        plain, last, NO_CATCHUP, clock
    )
    stale = DagRunInfo.interval(last.end, minute(2025, 6, 14, 12, 5))
    created = coalescing.next_run_info_from_dag_model(dag_model=stored(stale))
    assert created == plain.next_run_info_from_dag_model(dag_model=stored(stale))
    assert created == DagRunInfo.interval(minute(2025, 6, 15, 11, 55), minute(2025, 6, 15, 12, 0))


def test_backfill_is_slot_by_slot(clock: FrozenClock) -> None:
    restriction = TimeRestriction(earliest=minute(2025, 6, 1), latest=minute(2025, 6, 2), catchup=True)

    def iterate(timetable: CappedCatchupTimetable) -> list[DagRunInfo]:
        infos: list[DagRunInfo] = []
        info: DagRunInfo | None = None
        while True:
            info = timetable.next_dagrun_info(
                last_automated_data_interval=info.data_interval if info else None, restriction=restriction
            )
            if info is None:
                return infos
            infos.append(info)

    ours = iterate(CappedCatchupTimetable(FIVE, coalesce=True))
    assert len(ours) == 24 * 12 + 1
    assert ours == iterate(CappedCatchupTimetable(FIVE))


def test_manual_runs_get_the_last_complete_interval() -> None:
    run_after = minute(2025, 6, 15, 12, 7, 30)
    timetable = CappedCatchupTimetable(FIVE, max_backfill=3, coalesce=True)
    assert timetable.infer_manual_data_interval(run_after=run_after) == DataInterval(
        minute(2025, 6, 15, 12, 0), minute(2025, 6, 15, 12, 5)
    )
    assert timetable.infer_manual_data_interval(run_after=run_after) == CappedCatchupTimetable(
        FIVE
    ).infer_manual_data_interval(run_after=run_after)


def test_a_manual_run_in_the_gap_does_not_shorten_the_coalesced_range(clock: FrozenClock) -> None:
    """Airflow passes the last *automated* run: a manual run inside the gap is not the schedule's."""
    timetable = CappedCatchupTimetable(FIVE, coalesce=True)
    last = DataInterval(minute(2025, 6, 14, 11, 55), minute(2025, 6, 14, 12, 0))
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert info is not None and info.data_interval.start == last.end


# -- daylight saving ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "last_end", "now"),
    [
        # Spring forward, Berlin 2025-03-30: 02:30 does not exist that day (runs 03:30 CEST).
        ("30 2 * * *", pendulum.datetime(2025, 3, 27, 2, 30, tz="Europe/Berlin"), minute(2025, 4, 2, 12)),
        # Fall back, Berlin 2025-10-26: 02:30 happens twice (runs once, the later).
        ("30 2 * * *", pendulum.datetime(2025, 10, 23, 2, 30, tz="Europe/Berlin"), minute(2025, 10, 29, 12)),
        # An every-hour schedule across the fold runs the repeated hour twice.
        (
            "0 * * * *",
            pendulum.datetime(2025, 10, 25, 20, 0, tz="Europe/Berlin"),
            minute(2025, 10, 26, 4, 30),
        ),
        (
            "*/20 * * * *",
            pendulum.datetime(2025, 3, 29, 20, 0, tz="Europe/Berlin"),
            minute(2025, 3, 30, 3, 30),
        ),
        # New York's changes, on the DST days themselves.
        ("*/15 * * * *", pendulum.datetime(2025, 3, 8, 23, 0, tz="America/New_York"), minute(2025, 3, 9, 12)),
        (
            "*/15 * * * *",
            pendulum.datetime(2025, 11, 1, 23, 0, tz="America/New_York"),
            minute(2025, 11, 2, 12),
        ),
    ],
)
@pytest.mark.parametrize("cap", [1, 3])
def test_dst_days_the_coalesced_range_is_exact(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch, schedule: str, last_end: Any, now: Any, cap: int
) -> None:
    clock.set(now)
    tz = last_end.timezone_name
    coalescing = CappedCatchupTimetable(schedule, max_backfill=cap, timezone=tz, coalesce=True)
    plain = CappedCatchupTimetable(schedule, max_backfill=cap, timezone=tz)
    end = last_end.in_timezone("UTC")
    # The last run's interval as the grid has it (from the plain timetable's own previous slot).
    previous = plain.infer_manual_data_interval(run_after=end)
    assert previous.end == end
    expected, _ = scheduled_runs(plain, previous, CATCHUP, clock)
    runs, _ = scheduled_runs(coalescing, previous, CATCHUP, clock)
    assert len(runs) == cap and runs[1:] == expected[1:]
    assert runs[0] == DagRunInfo.interval(end, expected[0].run_after)
    # The folded slots are exactly the slots the plain timetable dropped: its every run since the last
    # one, stepped one by one with catch-up uncapped (a cap as large as the gap), minus the kept ones.
    everything, _ = scheduled_runs(
        CappedCatchupTimetable(schedule, max_backfill=10_000, timezone=tz), previous, CATCHUP, clock
    )
    dropped = everything[: len(everything) - cap]
    folded = coalescing.coalesced_slots(runs[0].data_interval)
    assert folded is not None
    assert (folded.count, folded.first, folded.last) == (
        len(dropped),
        dropped[0].data_interval,
        dropped[-1].data_interval,
    )
    # And the stored-run path gives the same first run.
    _restriction(monkeypatch, catchup=True)
    clock.set(end.add(seconds=2))  # right after the last run, before the outage: what it stored
    stored_before = coalescing.next_dagrun_info(last_automated_data_interval=previous, restriction=CATCHUP)
    clock.set(now)
    assert stored_before is not None
    assert coalescing.next_run_info_from_dag_model(dag_model=stored(stored_before)) == runs[0]


# -- construction and serialization ---------------------------------------------------------------------


def test_trigger_style_is_refused_clearly() -> None:
    with pytest.raises(InvalidArgument, match=r"coalesce=True.*data_interval=True.*no range"):
        CappedCatchupTimetable(FIVE, data_interval=False, coalesce=True)


def test_a_window_is_refused_clearly() -> None:
    with pytest.raises(InvalidArgument, match=r"coalesce=True.*catchup_window"):
        CappedCatchupTimetable(FIVE, catchup_window=datetime.timedelta(hours=1), coalesce=True)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_coalesce_must_be_a_bool(value: Any) -> None:
    with pytest.raises(InvalidArgument, match="coalesce"):
        CappedCatchupTimetable(FIVE, coalesce=value)


def test_serialization_round_trip_and_old_forms() -> None:
    import json

    timetable = CappedCatchupTimetable(FIVE, max_backfill=3, timezone="Europe/Berlin", coalesce=True)
    data = json.loads(json.dumps(timetable.serialize()))
    assert data["coalesce"] is True
    restored = CappedCatchupTimetable.deserialize(data)
    assert restored == timetable and restored.coalesce
    assert restored.summary == timetable.summary and "coalesced" in restored.summary
    assert "coalesced" in restored.description
    assert "coalesce=True" in repr(restored)
    # Without coalesce the stored form is what it was before the key existed, and reads back as False.
    plain = CappedCatchupTimetable(FIVE, max_backfill=3)
    assert "coalesce" not in plain.serialize()
    old = {"cron": FIVE, "max_backfill": 3, "catchup_window": None, "timezone": "UTC", "data_interval": True}
    assert CappedCatchupTimetable.deserialize(old).coalesce is False
    assert CappedCatchupTimetable.deserialize(old) != CappedCatchupTimetable(
        FIVE, max_backfill=3, coalesce=True
    )


def test_a_real_dag_serializes_and_schedules_coalesced(clock: FrozenClock) -> None:
    """Through Airflow's own DAG serialization (the plugin lists the timetable), as the scheduler reads it."""
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import DagSerialization

    with DAG(
        "coalesced",
        schedule=CappedCatchupTimetable(FIVE, max_backfill=2, coalesce=True),
        start_date=minute(2025, 1, 1),
        catchup=True,
        max_active_runs=1,
    ) as dag:
        pass
    restored = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    assert restored.timetable == dag.timetable and restored.timetable.coalesce
    last = DataInterval(minute(2025, 6, 14, 11, 55), minute(2025, 6, 14, 12, 0))
    info = restored.timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert info == DagRunInfo.interval(last.end, minute(2025, 6, 15, 11, 55))
