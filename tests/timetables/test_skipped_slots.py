"""The pure skipped-slot computation: exact, and fast enough for a year of per-minute slots."""

from __future__ import annotations

import datetime
import json
import time

import pendulum
import pytest
from airflow.timetables.base import DataInterval
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_lease_provider.timetables import (
    CappedCatchupTimetable,
    SkippedSlots,
    skipped_slots,
    slot_idempotency_key,
)
from airflow_lease_provider.timetables._grid import CronGrid, DeltaGrid
from tests.timetables.conftest import CroniterCalls


def at(*args: int, tz: str = "UTC") -> pendulum.DateTime:
    return pendulum.datetime(*args, tz=tz).in_timezone("UTC")


def minute_interval(end: pendulum.DateTime) -> DataInterval:
    return DataInterval(end.subtract(minutes=1), end)


@pytest.mark.parametrize("tz", ["UTC", "Europe/Berlin"])
def test_one_year_of_per_minute_slots_is_counted_not_enumerated(
    tz: str, croniter_calls: CroniterCalls
) -> None:
    timetable = CappedCatchupTimetable("* * * * *", timezone=tz)
    previous = minute_interval(at(2024, 6, 15, 12, 0))
    run = minute_interval(at(2025, 6, 15, 11, 58))
    croniter_calls.count = 0
    started = time.perf_counter()
    skipped = timetable.skipped_slots(run, previous)
    elapsed = time.perf_counter() - started
    assert skipped == SkippedSlots(
        count=525_597,  # every minute of the year in between: 365 days * 1440 - 3
        first=minute_interval(at(2024, 6, 15, 12, 1)),
        last=minute_interval(at(2025, 6, 15, 11, 57)),
    )
    # About one call per day, plus stepping through the hours around the two DST changes in Berlin.
    assert croniter_calls.count < 400 + (2 * 6 * 60 if tz != "UTC" else 0), croniter_calls.count
    assert elapsed < 5


def test_adjacent_runs_skip_nothing() -> None:
    timetable = CappedCatchupTimetable("*/5 * * * *")
    previous = DataInterval(at(2025, 6, 15, 11, 50), at(2025, 6, 15, 11, 55))
    run = DataInterval(at(2025, 6, 15, 11, 55), at(2025, 6, 15, 12, 0))
    assert timetable.skipped_slots(run, previous) is None


def test_logical_dates_work_like_data_intervals() -> None:
    data_interval = CappedCatchupTimetable("0 * * * *")
    by_interval = data_interval.skipped_slots(
        DataInterval(at(2025, 6, 15, 11), at(2025, 6, 15, 12)),
        DataInterval(at(2025, 6, 15, 7), at(2025, 6, 15, 8)),
    )
    by_logical_date = skipped_slots(data_interval, at(2025, 6, 15, 11), at(2025, 6, 15, 7))
    assert by_interval == by_logical_date
    assert by_interval is not None and by_interval.count == 3  # intervals ending 09:00, 10:00, 11:00
    assert by_interval.first == DataInterval(at(2025, 6, 15, 8), at(2025, 6, 15, 9))
    assert by_interval.last == DataInterval(at(2025, 6, 15, 10), at(2025, 6, 15, 11))

    trigger = CappedCatchupTimetable("0 * * * *", data_interval=False)
    skipped = trigger.skipped_slots(at(2025, 6, 15, 12), at(2025, 6, 15, 8))
    assert skipped == SkippedSlots(
        count=3,
        first=DataInterval.exact(at(2025, 6, 15, 9)),
        last=DataInterval.exact(at(2025, 6, 15, 11)),
    )


def test_fixed_interval_counts_on_the_previous_runs_phase() -> None:
    step = datetime.timedelta(minutes=45)
    timetable = CappedCatchupTimetable(step)
    previous = DataInterval(at(2025, 6, 1, 0, 7), at(2025, 6, 1, 0, 52))
    end = previous.end + 463 * step
    skipped = timetable.skipped_slots(DataInterval(end - step, end), previous)
    assert skipped == SkippedSlots(
        count=462,
        first=DataInterval(at(2025, 6, 1, 0, 52), at(2025, 6, 1, 1, 37)),
        last=DataInterval(end - 2 * step, end - step),
    )


def test_first_run_counts_from_the_start_date() -> None:
    timetable = CappedCatchupTimetable("0 * * * *")
    run = DataInterval(at(2025, 6, 15, 11), at(2025, 6, 15, 12))
    skipped = timetable.skipped_slots(run, None, earliest=at(2025, 6, 15, 0, 30))
    # Intervals starting at or after 00:30: [01:00, 02:00] ... [10:00, 11:00].
    assert skipped == SkippedSlots(
        count=10,
        first=DataInterval(at(2025, 6, 15, 1), at(2025, 6, 15, 2)),
        last=DataInterval(at(2025, 6, 15, 10), at(2025, 6, 15, 11)),
    )
    assert timetable.skipped_slots(run, None) is None


def test_detail_is_json_for_the_ledger() -> None:
    skipped = SkippedSlots(
        count=2,
        first=DataInterval(at(2025, 6, 15, 9), at(2025, 6, 15, 10)),
        last=DataInterval(at(2025, 6, 15, 10), at(2025, 6, 15, 11)),
    )
    assert json.loads(json.dumps(skipped.detail())) == {
        "count": 2,
        "first_start": "2025-06-15T09:00:00+00:00",
        "first_end": "2025-06-15T10:00:00+00:00",
        "last_start": "2025-06-15T10:00:00+00:00",
        "last_end": "2025-06-15T11:00:00+00:00",
    }


def test_slot_idempotency_key_is_per_slot_and_timezone_free() -> None:
    interval = DataInterval(at(2025, 6, 15, 9), at(2025, 6, 15, 10))
    key = slot_idempotency_key("billing-close", interval)
    assert key == "billing-close@2025-06-15T09:00:00Z"
    assert (
        slot_idempotency_key("billing-close", pendulum.datetime(2025, 6, 15, 11, tz="Europe/Berlin")) == key
    )
    assert slot_idempotency_key("billing-close", at(2025, 6, 15, 10)) != key
    assert slot_idempotency_key("billing-close", at(2025, 6, 15, 9, 0).add(microseconds=5)).endswith(
        ".000005Z"
    )


# -- the counter agrees with stepping slot by slot ------------------------------------------------------------

COUNT_SCHEDULES = [
    "* * * * *",
    "*/7 * * * *",
    "0 * * * *",
    "30 2 * * *",
    "15 1-3 * * 0",
    "0 0 L * *",
    "0 12 * * 1#2",
]
COUNT_TIMEZONES = ["UTC", "Europe/Berlin", "America/Santiago", "Australia/Lord_Howe", "Asia/Kolkata"]


def stepped_count(grid: CronGrid, start: pendulum.DateTime, end: pendulum.DateTime) -> int:
    count, slot = 0, grid.after(start)
    while slot < end:
        count += 1
        slot = grid.after(slot)
    return count


@settings(max_examples=120, deadline=None)
@given(
    schedule=st.sampled_from(COUNT_SCHEDULES),
    tz=st.sampled_from(COUNT_TIMEZONES),
    start_minutes=st.integers(min_value=0, max_value=2 * 365 * 24 * 60),
    start_second=st.integers(min_value=0, max_value=59),
    length_minutes=st.integers(min_value=0, max_value=9 * 24 * 60),
    aligned=st.booleans(),
)
def test_count_between_matches_stepping(
    schedule: str, tz: str, start_minutes: int, start_second: int, length_minutes: int, aligned: bool
) -> None:
    grid = CronGrid(schedule, pendulum.timezone(tz))
    start = pendulum.datetime(2024, 1, 1, tz="UTC").add(minutes=start_minutes, seconds=start_second)
    if aligned:
        start = grid.at_or_before(start)
    end = start.add(minutes=length_minutes)
    assert grid.count_between(start, end) == stepped_count(grid, start, end)


@pytest.mark.parametrize(
    ("tz", "start", "end"),
    [
        # Across Berlin's spring-forward and fall-back days, for an every-hour and a daily schedule.
        ("Europe/Berlin", at(2025, 3, 29), at(2025, 4, 1)),
        ("Europe/Berlin", at(2025, 10, 25), at(2025, 10, 28)),
        # Lord Howe shifts by 30 minutes.
        ("Australia/Lord_Howe", at(2025, 4, 5), at(2025, 4, 7)),
    ],
)
@pytest.mark.parametrize("schedule", ["0 * * * *", "30 2 * * *", "*/10 1-3 * * *"])
def test_count_between_across_dst(
    tz: str, start: pendulum.DateTime, end: pendulum.DateTime, schedule: str
) -> None:
    grid = CronGrid(schedule, pendulum.timezone(tz))
    assert grid.count_between(start, end) == stepped_count(grid, start, end)


def test_before_steps_past_a_spring_forward_gap() -> None:
    # 2025-03-30 02:30 does not exist in Berlin; Airflow runs that day's slot at 03:30 CEST (01:30 UTC).
    grid = CronGrid("30 2 * * *", pendulum.timezone("Europe/Berlin"))
    moved = grid.after(at(2025, 3, 29, 1, 30))
    assert moved == at(2025, 3, 30, 1, 30)
    assert grid.before(moved) == at(2025, 3, 29, 1, 30)


@settings(max_examples=200, deadline=None)
@given(
    step_seconds=st.integers(min_value=1, max_value=3 * 86400),
    anchor_seconds=st.integers(min_value=-(10**9), max_value=10**9),
    start_us=st.integers(min_value=0, max_value=10**15),
    length_us=st.integers(min_value=0, max_value=10**10),
)
def test_delta_grid_arithmetic(step_seconds: int, anchor_seconds: int, start_us: int, length_us: int) -> None:
    step = datetime.timedelta(seconds=step_seconds)
    anchor = pendulum.datetime(2025, 1, 1, tz="UTC").add(seconds=anchor_seconds)
    grid = DeltaGrid(step, anchor)
    start = pendulum.datetime(2000, 1, 1, tz="UTC").add(microseconds=start_us)
    end = start.add(microseconds=length_us)
    floor = grid.at_or_before(start)
    assert floor <= start < floor + step
    assert (floor - anchor).total_seconds() % step_seconds == 0
    assert grid.after(start) == floor + step
    assert grid.at_or_after(start) == (floor if floor == start else floor + step)
    assert grid.before(start) == (floor - step if floor == start else floor)
    expected = 0
    slot = grid.after(start)
    while slot < end:
        expected += 1
        slot += step
    assert grid.count_between(start, end) == expected
