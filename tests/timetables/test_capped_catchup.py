"""Scheduling behaviour of CappedCatchupTimetable, with the clock frozen.

Where Airflow has an equivalent (latest-only, backfill, DST stepping), the expected slots come from
Airflow's own core timetables, so "the newest N" means the newest N of the slots Airflow would run.
"""

from __future__ import annotations

import datetime
import itertools
from typing import Any

import pendulum
import pytest
from airflow.timetables.base import DagRunInfo, DataInterval, TimeRestriction
from airflow.timetables.interval import CronDataIntervalTimetable, DeltaDataIntervalTimetable
from airflow.timetables.trigger import CronTriggerTimetable

from airflow_lease_provider.timetables import CappedCatchupTimetable
from tests.timetables.conftest import CroniterCalls, FrozenClock
from tests.timetables.cron_reference import reference_slots
from tests.timetables.dag_model import stored

UTC = pendulum.UTC
CATCHUP = TimeRestriction(earliest=None, latest=None, catchup=True)
NO_CATCHUP = TimeRestriction(earliest=None, latest=None, catchup=False)
NOW = pendulum.datetime(2025, 6, 15, 12, 0, 30, tz="UTC")


def minute(*args: int) -> pendulum.DateTime:
    return pendulum.datetime(*args, tz="UTC")


def scheduled_runs(
    timetable: Any,
    last: DataInterval | None,
    restriction: TimeRestriction,
    clock: FrozenClock,
    limit: int = 10_000,
) -> tuple[list[DagRunInfo], DagRunInfo | None]:
    """What a scheduler creates at the frozen time: runs while the next one is due, then the one it waits for."""
    runs: list[DagRunInfo] = []
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)
    while info is not None and info.run_after <= clock.now and len(runs) < limit:
        runs.append(info)
        info = timetable.next_dagrun_info(
            last_automated_data_interval=info.data_interval, restriction=restriction
        )
    return runs, info


@pytest.fixture(autouse=True)
def _airflow_clock(clock: FrozenClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Airflow's reference timetables read the same frozen clock."""
    import airflow.timetables.interval as interval_module
    import airflow.timetables.trigger as trigger_module

    monkeypatch.setattr(interval_module, "utcnow", lambda: clock.now)
    monkeypatch.setattr(trigger_module, "utcnow", lambda: clock.now)


def reference_runs(
    timetable: Any, last: DataInterval | None, restriction: TimeRestriction, clock: FrozenClock
) -> list[DagRunInfo]:
    """Every run Airflow's own timetable would create by now (uncapped catch-up)."""
    runs, _ = scheduled_runs(timetable, last, restriction, clock)
    return runs


# -- the headline: a year offline ---------------------------------------------------------------------


@pytest.mark.parametrize("cap", [1, 3, 10])
def test_one_year_outage_every_minute_runs_exactly_the_newest_n(
    clock: FrozenClock, croniter_calls: CroniterCalls, cap: int
) -> None:
    timetable = CappedCatchupTimetable("* * * * *", max_backfill=cap)
    last = DataInterval(minute(2024, 6, 15, 11, 59), minute(2024, 6, 15, 12, 0))  # a year before NOW

    croniter_calls.count = 0
    first = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    # Stepping back from now on one croniter iterator: a constant number of croniter constructions,
    # whatever N (the N - 1 steps back are calls on that one iterator), never 525 600 steps through the gap.
    assert croniter_calls.count <= 5, croniter_calls.count

    runs, waiting = scheduled_runs(timetable, last, CATCHUP, clock)
    assert runs[0] == first
    newest_due = minute(2025, 6, 15, 12, 0)
    expected_ends = [newest_due.subtract(minutes=cap - 1 - i) for i in range(cap)]
    assert [r.run_after for r in runs] == expected_ends
    assert [r.data_interval for r in runs] == [
        DataInterval(end.subtract(minutes=1), end) for end in expected_ends
    ]
    # The slot right after the pre-outage run never slips in.
    assert all(r.run_after > minute(2024, 6, 15, 12, 1) for r in runs)
    # Then normal scheduling resumes with the next slot.
    assert waiting is not None
    assert waiting.run_after == minute(2025, 6, 15, 12, 1)


def test_every_later_call_is_constant_work(clock: FrozenClock, croniter_calls: CroniterCalls) -> None:
    timetable = CappedCatchupTimetable("* * * * *", max_backfill=100)
    last = DataInterval(minute(2025, 6, 15, 10, 0), minute(2025, 6, 15, 10, 1))
    croniter_calls.count = 0
    runs, _ = scheduled_runs(timetable, last, CATCHUP, clock)
    assert len(runs) == 100
    # The first call steps back 99 times; each later one stops at once because nothing older is due.
    assert croniter_calls.count <= 99 + 6 + 100 * 8


def test_a_daily_catch_up_of_years_costs_a_constant_number_of_croniters_per_call(
    clock: FrozenClock, croniter_calls: CroniterCalls
) -> None:
    """A cap larger than the gap (12 years of a daily schedule, max_backfill=10000): every call counts the
    gap, which for a schedule whose every day has the same slots is arithmetic, not a croniter per day."""
    timetable = CappedCatchupTimetable("0 0 * * *", max_backfill=10_000)
    start = minute(2013, 6, 15, 0, 0)
    last = DataInterval(start.subtract(days=1), start)
    croniter_calls.count = 0
    first = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert first is not None and first.run_after == start.add(days=1)  # every missed slot fits the cap
    assert croniter_calls.count <= 12, croniter_calls.count  # one per day spanned would be 4,383
    # Later calls of the same catch-up, each with the gap one day shorter: the same constant work.
    for day in (1, 2, 1000):
        croniter_calls.count = 0
        ran = DataInterval(start.add(days=day - 1), start.add(days=day))
        info = timetable.next_dagrun_info(last_automated_data_interval=ran, restriction=CATCHUP)
        assert info is not None and info.run_after == start.add(days=day + 1)
        assert croniter_calls.count <= 12, (day, croniter_calls.count)


def test_one_year_outage_fixed_interval_keeps_the_phase(
    clock: FrozenClock, croniter_calls: CroniterCalls
) -> None:
    timetable = CappedCatchupTimetable(datetime.timedelta(minutes=45), max_backfill=2)
    # The grid runs through the last run: ..., 00:07 + k * 45 min.
    last = DataInterval(minute(2024, 6, 15, 0, 7), minute(2024, 6, 15, 0, 52))
    runs, waiting = scheduled_runs(timetable, last, CATCHUP, clock)
    assert croniter_calls.count == 0
    step = datetime.timedelta(minutes=45)
    # (pendulum's Interval // timedelta is broken; whole seconds are exact here.)
    slots = int((NOW - last.end).total_seconds()) // int(step.total_seconds())
    newest = last.end + slots * step
    assert [r.run_after for r in runs] == [newest - step, newest]
    assert [r.data_interval for r in runs] == [
        DataInterval(newest - 2 * step, newest - step),
        DataInterval(newest - step, newest),
    ]
    assert waiting is not None and waiting.run_after == newest + step


def test_trigger_runs_have_the_slot_as_logical_date(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("*/15 * * * *", max_backfill=2, data_interval=False)
    last = DataInterval.exact(minute(2025, 6, 14, 9, 0))
    runs, waiting = scheduled_runs(timetable, last, CATCHUP, clock)
    assert [r.logical_date for r in runs] == [minute(2025, 6, 15, 11, 45), minute(2025, 6, 15, 12, 0)]
    assert all(r.data_interval == DataInterval.exact(r.run_after) for r in runs)
    assert waiting is not None and waiting.run_after == minute(2025, 6, 15, 12, 15)


# -- the window and the cap of zero ------------------------------------------------------------------


def test_window_drops_slots_older_than_it(clock: FrozenClock) -> None:
    clock.set(minute(2025, 6, 15, 12, 10))
    timetable = CappedCatchupTimetable(
        "0 * * * *", max_backfill=5, catchup_window=datetime.timedelta(minutes=90)
    )
    last = DataInterval(minute(2025, 6, 14, 0, 0), minute(2025, 6, 14, 1, 0))
    runs, _ = scheduled_runs(timetable, last, CATCHUP, clock)
    # 12:00 (10 min old) and 11:00 (70 min old) are inside the window; 10:00 (130 min) is not.
    assert [r.run_after for r in runs] == [minute(2025, 6, 15, 11, 0), minute(2025, 6, 15, 12, 0)]


def test_window_can_skip_every_due_slot(clock: FrozenClock) -> None:
    clock.set(minute(2025, 6, 15, 12, 40))
    timetable = CappedCatchupTimetable(
        "0 * * * *", max_backfill=3, catchup_window=datetime.timedelta(minutes=30)
    )
    last = DataInterval(minute(2025, 6, 14, 0, 0), minute(2025, 6, 14, 1, 0))
    runs, waiting = scheduled_runs(timetable, last, CATCHUP, clock)
    assert runs == []
    assert waiting is not None and waiting.run_after == minute(2025, 6, 15, 13, 0)


def test_window_also_applies_without_catchup(clock: FrozenClock) -> None:
    clock.set(minute(2025, 6, 15, 12, 40))
    timetable = CappedCatchupTimetable("0 * * * *", catchup_window=datetime.timedelta(minutes=30))
    last = DataInterval(minute(2025, 6, 14, 0, 0), minute(2025, 6, 14, 1, 0))
    runs, waiting = scheduled_runs(timetable, last, NO_CATCHUP, clock)
    assert runs == []
    assert waiting is not None and waiting.run_after == minute(2025, 6, 15, 13, 0)


def test_cap_zero_skips_all_due_slots_after_downtime(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("*/5 * * * *", max_backfill=0)
    last = DataInterval(minute(2025, 6, 15, 10, 0), minute(2025, 6, 15, 10, 5))
    runs, waiting = scheduled_runs(timetable, last, CATCHUP, clock)
    assert runs == []
    assert waiting is not None and waiting.run_after == minute(2025, 6, 15, 12, 5)


def test_cap_zero_still_runs_a_slot_the_scheduler_is_merely_late_for(clock: FrozenClock) -> None:
    # 12:00 came due 30 s ago and no newer slot has: that is latency, not downtime.
    timetable = CappedCatchupTimetable("*/5 * * * *", max_backfill=0)
    last = DataInterval(minute(2025, 6, 15, 11, 50), minute(2025, 6, 15, 11, 55))
    runs, _ = scheduled_runs(timetable, last, CATCHUP, clock)
    assert [r.run_after for r in runs] == [minute(2025, 6, 15, 12, 0)]


# -- normal operation and catchup=False -------------------------------------------------------------


def test_no_downtime_means_no_clipping(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("*/5 * * * *", max_backfill=1)
    last = DataInterval(minute(2025, 6, 15, 11, 50), minute(2025, 6, 15, 11, 55))
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert info == DagRunInfo.interval(minute(2025, 6, 15, 11, 55), minute(2025, 6, 15, 12, 0))
    clock.set(minute(2025, 6, 15, 12, 0, 1))
    info = timetable.next_dagrun_info(last_automated_data_interval=info.data_interval, restriction=CATCHUP)
    assert info is not None and info.run_after == minute(2025, 6, 15, 12, 5)


@pytest.mark.parametrize(
    ("schedule", "reference"),
    [
        ("*/5 * * * *", CronDataIntervalTimetable("*/5 * * * *", "UTC")),
        ("30 2 * * *", CronDataIntervalTimetable("30 2 * * *", "UTC")),
        (datetime.timedelta(minutes=45), DeltaDataIntervalTimetable(datetime.timedelta(minutes=45))),
    ],
)
@pytest.mark.parametrize("cap", [1, 4])
@pytest.mark.parametrize(
    "last",
    [
        None,
        DataInterval(minute(2025, 6, 15, 11, 45), minute(2025, 6, 15, 12, 30)),  # the future: nothing due
        DataInterval(minute(2025, 5, 1, 0, 0), minute(2025, 5, 1, 0, 45)),
    ],
)
def test_catchup_false_is_airflows_latest_only(
    clock: FrozenClock, schedule: Any, reference: Any, cap: int, last: DataInterval | None
) -> None:
    timetable = CappedCatchupTimetable(schedule, max_backfill=cap)
    restriction = TimeRestriction(earliest=minute(2025, 1, 1), latest=None, catchup=False)
    ours = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)
    theirs = reference.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)
    if isinstance(schedule, datetime.timedelta) and last is None:
        # Airflow floors a fixed interval onto an epoch grid only here; we lay it through start_date.
        assert ours is not None and theirs is not None
        assert abs(ours.run_after - theirs.run_after) < schedule
        return
    assert ours == theirs


@pytest.mark.parametrize("data_interval", [True, False])
def test_catchup_false_fixed_interval_keeps_its_phase_where_airflow_realigns(
    clock: FrozenClock, data_interval: bool
) -> None:
    """docs/timetable.md: latest-only, but on the grid through the last run, not Airflow's.

    Every 45 minutes, last run at 00:50 (5 minutes off the epoch grid), back at 12:00:30: we run the
    newest due slot of the 00:50 grid (11:20); Airflow's DeltaDataIntervalTimetable moves to the epoch
    grid (12:00) and DeltaTriggerTimetable runs at the current time (12:00:30).
    """
    from airflow.timetables.trigger import DeltaTriggerTimetable

    every = datetime.timedelta(minutes=45)
    timetable = CappedCatchupTimetable(every, max_backfill=4, data_interval=data_interval)
    last_slot = minute(2025, 5, 1, 0, 50)
    last = DataInterval(last_slot - every, last_slot) if data_interval else DataInterval.exact(last_slot)
    restriction = TimeRestriction(earliest=minute(2025, 1, 1), latest=None, catchup=False)

    runs, waiting = scheduled_runs(timetable, last, restriction, clock)
    # Latest-only: one run, the newest due slot on the grid through 00:50 ...
    assert [r.run_after for r in runs] == [minute(2025, 6, 15, 11, 20)]
    assert (runs[0].run_after - last_slot).total_seconds() % every.total_seconds() == 0
    # ... and the schedule stays on that phase.
    assert waiting is not None and waiting.run_after == minute(2025, 6, 15, 12, 5)

    reference: Any = DeltaDataIntervalTimetable(every) if data_interval else DeltaTriggerTimetable(every)
    theirs = reference.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)
    assert theirs is not None
    assert theirs.run_after == (minute(2025, 6, 15, 12, 0) if data_interval else clock.now)


def test_catchup_false_fixed_interval_on_the_epoch_grid_equals_airflows(clock: FrozenClock) -> None:
    """When the phase is the epoch grid's (hourly, last run on the hour) the two agree exactly."""
    every = datetime.timedelta(hours=1)
    timetable = CappedCatchupTimetable(every)
    last = DataInterval(minute(2025, 5, 1, 0, 0), minute(2025, 5, 1, 1, 0))
    restriction = TimeRestriction(earliest=minute(2025, 1, 1), latest=None, catchup=False)
    assert timetable.next_dagrun_info(
        last_automated_data_interval=last, restriction=restriction
    ) == DeltaDataIntervalTimetable(every).next_dagrun_info(
        last_automated_data_interval=last, restriction=restriction
    )


def test_catchup_false_matches_airflow_trigger_timetable(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("*/10 * * * *", max_backfill=5, data_interval=False)
    reference = CronTriggerTimetable("*/10 * * * *", timezone="UTC")
    last = DataInterval.exact(minute(2025, 6, 1, 3, 0))
    restriction = TimeRestriction(earliest=minute(2025, 1, 1), latest=None, catchup=False)
    assert timetable.next_dagrun_info(
        last_automated_data_interval=last, restriction=restriction
    ) == reference.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)


# -- start_date and end_date -----------------------------------------------------------------------


def test_first_deployment_with_an_old_start_date_runs_the_newest_n(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("0 * * * *", max_backfill=3)
    restriction = TimeRestriction(earliest=minute(2024, 1, 1), latest=None, catchup=True)
    runs, _ = scheduled_runs(timetable, None, restriction, clock)
    assert [r.run_after for r in runs] == [minute(2025, 6, 15, h) for h in (10, 11, 12)]


def test_start_date_in_the_future_waits_for_it(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("0 * * * *", max_backfill=3)
    restriction = TimeRestriction(earliest=minute(2025, 7, 1, 0, 30), latest=None, catchup=True)
    info = timetable.next_dagrun_info(last_automated_data_interval=None, restriction=restriction)
    # The first interval starting at or after start_date is [01:00, 02:00].
    assert info == DagRunInfo.interval(minute(2025, 7, 1, 1), minute(2025, 7, 1, 2))


def test_no_start_date_and_no_runs_starts_with_the_newest_due_slot(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("0 * * * *", max_backfill=3)
    info = timetable.next_dagrun_info(last_automated_data_interval=None, restriction=CATCHUP)
    assert info is not None and info.run_after == minute(2025, 6, 15, 12)


def test_end_date_stops_the_schedule(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("0 * * * *")
    restriction = TimeRestriction(earliest=None, latest=minute(2025, 6, 15, 10, 0), catchup=False)
    last = DataInterval(minute(2025, 6, 15, 9), minute(2025, 6, 15, 10))
    assert timetable.next_dagrun_info(last_automated_data_interval=last, restriction=restriction) is None


# -- backfills are never clipped -------------------------------------------------------------------------


@pytest.mark.parametrize("data_interval", [True, False])
def test_backfill_range_is_not_clipped(clock: FrozenClock, data_interval: bool) -> None:
    timetable = CappedCatchupTimetable("*/5 * * * *", max_backfill=1, data_interval=data_interval)
    reference = (
        CronDataIntervalTimetable("*/5 * * * *", "UTC")
        if data_interval
        else CronTriggerTimetable("*/5 * * * *", timezone="UTC")
    )
    # What SerializedDAG.iter_dagrun_infos_between does for `airflow backfill create`.
    restriction = TimeRestriction(earliest=minute(2025, 6, 1), latest=minute(2025, 6, 2), catchup=True)

    def iterate(tt: Any) -> list[DagRunInfo]:
        infos, info = [], None
        while True:
            info = tt.next_dagrun_info(
                last_automated_data_interval=info.data_interval if info else None, restriction=restriction
            )
            if info is None:
                return infos
            infos.append(info)

    ours = iterate(timetable)
    assert len(ours) == 24 * 12 + 1  # every 5 minutes, both ends inclusive
    assert ours == iterate(reference)


# -- daylight saving time ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "last_end", "now"),
    [
        # Spring forward, Berlin 2025-03-30 02:00 CET -> 03:00 CEST: 02:30 does not exist that day.
        ("30 2 * * *", pendulum.datetime(2025, 3, 20, 2, 30, tz="Europe/Berlin"), minute(2025, 4, 2, 12)),
        # Fall back, Berlin 2025-10-26 03:00 CEST -> 02:00 CET: 02:30 happens twice.
        ("30 2 * * *", pendulum.datetime(2025, 10, 15, 2, 30, tz="Europe/Berlin"), minute(2025, 10, 29, 12)),
        # An every-hour schedule across the fold: Airflow runs the repeated hour twice.
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
    ],
)
@pytest.mark.parametrize("cap", [1, 3, 6])
@pytest.mark.parametrize("data_interval", [True, False])
def test_dst_newest_slots_are_airflows_newest_slots(
    clock: FrozenClock,
    schedule: str,
    last_end: pendulum.DateTime,
    now: pendulum.DateTime,
    cap: int,
    data_interval: bool,
) -> None:
    clock.set(now)
    tz = "Europe/Berlin"
    timetable = CappedCatchupTimetable(schedule, max_backfill=cap, timezone=tz, data_interval=data_interval)
    if data_interval:
        reference: Any = CronDataIntervalTimetable(schedule, tz)
        last = DataInterval(reference._get_prev(last_end.in_timezone("UTC")), last_end.in_timezone("UTC"))
    else:
        reference = CronTriggerTimetable(schedule, timezone=tz)
        last = DataInterval.exact(last_end.in_timezone("UTC"))
    everything = reference_runs(reference, last, CATCHUP, clock)
    assert len(everything) > cap  # the scenario really is a catch-up
    runs, _ = scheduled_runs(timetable, last, CATCHUP, clock)
    assert runs == everything[-cap:]


# -- the trap: the run Airflow stored before the outage ----------------------------------------------------------




@pytest.mark.parametrize("cap", [1, 3])
def test_stored_next_run_from_before_the_outage_does_not_slip_in(clock: FrozenClock, cap: int) -> None:
    timetable = CappedCatchupTimetable("* * * * *", max_backfill=cap)
    # Before the outage, right after creating the 10:00 run, the scheduler stored 10:01.
    clock.set(minute(2025, 6, 15, 10, 0, 2))
    last = DataInterval(minute(2025, 6, 15, 9, 59), minute(2025, 6, 15, 10, 0))
    before_outage = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert before_outage is not None and before_outage.run_after == minute(2025, 6, 15, 10, 1)

    # Two hours later the scheduler comes back and creates the stored run.
    clock.set(NOW)
    created = timetable.next_run_info_from_dag_model(dag_model=stored(before_outage))
    assert created is not None
    assert created.run_after == minute(2025, 6, 15, 12, 0).subtract(minutes=cap - 1)

    # From there on it asks the timetable: exactly the newest N, then normal runs.
    runs = [created]
    info = timetable.next_dagrun_info(last_automated_data_interval=created.data_interval, restriction=CATCHUP)
    while info is not None and info.run_after <= NOW:
        runs.append(info)
        info = timetable.next_dagrun_info(
            last_automated_data_interval=info.data_interval, restriction=CATCHUP
        )
    assert [r.run_after for r in runs] == [
        minute(2025, 6, 15, 12, 0).subtract(minutes=cap - 1 - i) for i in range(cap)
    ]


def test_stored_next_run_is_kept_when_merely_late_or_in_the_future(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("*/5 * * * *", max_backfill=1)
    on_time = DagRunInfo.interval(minute(2025, 6, 15, 11, 55), minute(2025, 6, 15, 12, 0))
    assert timetable.next_run_info_from_dag_model(dag_model=stored(on_time)) == on_time
    future = DagRunInfo.interval(minute(2025, 6, 15, 12, 0), minute(2025, 6, 15, 12, 5))
    assert timetable.next_run_info_from_dag_model(dag_model=stored(future)) == future


def test_stored_next_run_respects_the_window(clock: FrozenClock) -> None:
    clock.set(minute(2025, 6, 15, 12, 40))
    timetable = CappedCatchupTimetable(
        "0 * * * *", max_backfill=3, catchup_window=datetime.timedelta(minutes=30)
    )
    stale = DagRunInfo.interval(minute(2025, 6, 15, 9), minute(2025, 6, 15, 10))
    moved = timetable.next_run_info_from_dag_model(dag_model=stored(stale))
    # Nothing due is young enough: the run is created for the next slot and starts when it is due.
    assert moved == DagRunInfo.interval(minute(2025, 6, 15, 12), minute(2025, 6, 15, 13))


def test_stored_next_run_uses_the_real_dag_model(clock: FrozenClock) -> None:
    from airflow.models.dag import DagModel

    timetable = CappedCatchupTimetable("* * * * *", max_backfill=2)
    stale = DagRunInfo.interval(minute(2025, 6, 15, 10, 0), minute(2025, 6, 15, 10, 1))
    model = DagModel(dag_id="capped")
    model.next_dagrun = stale.logical_date
    model.next_dagrun_data_interval = stale.data_interval
    model.next_dagrun_create_after = stale.run_after
    moved = timetable.next_run_info_from_dag_model(dag_model=model)
    assert moved == DagRunInfo.interval(minute(2025, 6, 15, 11, 58), minute(2025, 6, 15, 11, 59))


# -- manual runs and schedule changes -------------------------------------------------------------------------


def test_infer_manual_data_interval() -> None:
    run_after = minute(2025, 6, 15, 12, 7, 30)
    cron = CappedCatchupTimetable("*/5 * * * *")
    assert cron.infer_manual_data_interval(run_after=run_after) == DataInterval(
        minute(2025, 6, 15, 12, 0), minute(2025, 6, 15, 12, 5)
    )
    delta = CappedCatchupTimetable(datetime.timedelta(minutes=45))
    assert delta.infer_manual_data_interval(run_after=run_after) == DataInterval(
        run_after.subtract(minutes=45), run_after
    )
    trigger = CappedCatchupTimetable("*/5 * * * *", data_interval=False)
    assert trigger.infer_manual_data_interval(run_after=run_after) == DataInterval.exact(run_after)


def test_coarser_schedule_does_not_collide_with_the_last_logical_date(clock: FrozenClock) -> None:
    clock.set(minute(2025, 6, 15, 10, 6))
    timetable = CappedCatchupTimetable("0 * * * *")
    last = DataInterval(minute(2025, 6, 15, 10, 0), minute(2025, 6, 15, 10, 5))  # from the old */5 schedule
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert info is not None and info.logical_date is not None
    assert info.logical_date > last.start


# -- kept runs run one at a time (issue 10 item 12) -------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "limit"),
    [
        ({}, None),  # max_backfill=1: only one kept run, nothing to serialise
        ({"max_backfill": 0}, None),
        ({"max_backfill": 2}, 1),
        ({"max_backfill": 24}, 1),
        ({"max_backfill": 24, "parallel_catchup": True}, None),
    ],
)
def test_active_runs_limit(kwargs: dict[str, Any], limit: int | None) -> None:
    assert CappedCatchupTimetable("0 * * * *", **kwargs).active_runs_limit == limit


def test_airflow_holds_the_dag_to_one_active_run() -> None:
    """Airflow's own DAG checks the hook: the default max_active_runs (16) is refused, 1 is taken."""
    from airflow.sdk import DAG

    start = minute(2025, 1, 1)
    with pytest.raises(ValueError, match="requires max_active_runs <= 1"):
        DAG("billing", schedule=CappedCatchupTimetable("0 * * * *", max_backfill=3), start_date=start)
    dag = DAG(
        "billing",
        schedule=CappedCatchupTimetable("0 * * * *", max_backfill=3),
        start_date=start,
        max_active_runs=1,
    )
    assert dag.max_active_runs == 1
    parallel = DAG(
        "billing",
        schedule=CappedCatchupTimetable("0 * * * *", max_backfill=3, parallel_catchup=True),
        start_date=start,
    )
    assert parallel.max_active_runs == 16


# -- the walk back on one iterator across daylight-saving changes ----------------------------------------


DST_CASES = [
    (tz, schedule)
    for tz in ("Europe/Berlin", "America/New_York", "Australia/Lord_Howe")
    for schedule in ("*/20 * * * *", "30 * * * *", "15 1-3 * * *")
]
# Where Airflow's stepping is wrong (docs/timetable.md, "Daylight saving"): an every-hour schedule across a
# 30-minute shift runs off the wall-clock grid in Airflow; the expected runs are the enumeration's.
_AIRFLOW_WRONG = {("Australia/Lord_Howe", "*/20 * * * *"), ("Australia/Lord_Howe", "30 * * * *")}


@pytest.mark.parametrize(("tz", "schedule"), DST_CASES)
@pytest.mark.parametrize("hours_after", [0.5, 2, 5])
@pytest.mark.parametrize("change", [0, 1], ids=["spring", "autumn"])
def test_kept_slots_across_a_dst_change_are_airflows(
    clock: FrozenClock, tz: str, schedule: str, hours_after: float, change: int
) -> None:
    """Back up a little after a DST change, the kept slots straddle it: exactly Airflow's newest N (the
    enumeration's where Airflow is wrong)."""
    import zoneinfo

    zone = zoneinfo.ZoneInfo(tz)
    # The UTC hours of 2025 after which the zone's offset changes (two: into and out of DST).
    changes, moment = [], minute(2025, 1, 1)
    while moment.year == 2025:
        if moment.astimezone(zone).utcoffset() != moment.add(hours=1).astimezone(zone).utcoffset():
            changes.append(moment)
        moment = moment.add(hours=1)
    assert len(changes) == 2, changes
    now = changes[change].add(hours=1).add(minutes=round(hours_after * 60), seconds=7)
    clock.set(now)
    cap = 6
    reference = CronDataIntervalTimetable(schedule, tz)
    last_end = reference._align_to_prev(now.subtract(days=3))
    last = DataInterval(reference._get_prev(last_end), last_end)
    if (tz, schedule) in _AIRFLOW_WRONG:
        # (Airflow's own CronDataIntervalTimetable raises "did not advance" on some of these.)
        slots = reference_slots(schedule, tz, now.subtract(days=4), now)
        expected = [DagRunInfo.interval(a, b) for a, b in itertools.pairwise(slots)][-cap:]
    else:
        expected = reference_runs(reference, last, CATCHUP, clock)[-cap:]
    timetable = CappedCatchupTimetable(schedule, max_backfill=cap, timezone=tz)
    runs, _ = scheduled_runs(timetable, last, CATCHUP, clock)
    assert runs == expected


def test_walk_back_in_a_dst_zone_away_from_a_change_is_one_iterator(
    clock: FrozenClock, croniter_calls: CroniterCalls
) -> None:
    timetable = CappedCatchupTimetable("*/5 * * * *", max_backfill=10, timezone="Europe/Berlin")
    last = DataInterval(minute(2024, 6, 15, 11, 55), minute(2024, 6, 15, 12, 0))
    croniter_calls.count = 0
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert croniter_calls.count <= 5, croniter_calls.count
    assert info == DagRunInfo.interval(minute(2025, 6, 15, 11, 10), minute(2025, 6, 15, 11, 15))


# -- where the scheduler creates a moved run: its end_date and the runs it already has -------------------------


def _scheduler_knows(monkeypatch: pytest.MonkeyPatch, latest: Any, taken: set[Any]) -> None:
    """What the timetable reads through the scheduler's session (end_date; logical dates taken)."""
    from airflow_lease_provider.timetables import _scheduler

    monkeypatch.setattr(
        _scheduler, "dag_time_restriction", lambda _model: TimeRestriction(minute(2025, 1, 1), latest, True)
    )
    monkeypatch.setattr(
        _scheduler, "taken_logical_dates", lambda _model, since: {t for t in taken if t >= since}
    )


def test_a_moved_run_stays_within_a_passed_end_date(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    _scheduler_knows(monkeypatch, minute(2025, 3, 1), set())
    timetable = CappedCatchupTimetable("0 0 * * *", max_backfill=2)
    first = DagRunInfo.interval(minute(2025, 1, 1), minute(2025, 1, 2))
    moved = timetable.next_run_info_from_dag_model(dag_model=stored(first))
    # The older of the newest 2 slots whose logical date is not after the end_date.
    assert moved == DagRunInfo.interval(minute(2025, 2, 28), minute(2025, 3, 1))
    # A window that leaves none of them: the newest up to the end_date, never one past it.
    windowed = CappedCatchupTimetable("0 0 * * *", catchup_window=datetime.timedelta(days=1))
    assert windowed.next_run_info_from_dag_model(dag_model=stored(first)) == DagRunInfo.interval(
        minute(2025, 3, 1), minute(2025, 3, 2)
    )


def test_a_moved_run_skips_slots_that_runs_already_have(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Manual runs with a logical date took the slots ending 11:00 and 12:00 (logical dates 10:00, 11:00).
    _scheduler_knows(
        monkeypatch, None, {minute(2025, 6, 15, 10), minute(2025, 6, 15, 11), minute(2025, 1, 1)}
    )
    timetable = CappedCatchupTimetable("0 * * * *", max_backfill=2)
    stale = DagRunInfo.interval(minute(2025, 6, 15, 4), minute(2025, 6, 15, 5))
    moved = timetable.next_run_info_from_dag_model(dag_model=stored(stale))
    assert moved == DagRunInfo.interval(minute(2025, 6, 15, 12), minute(2025, 6, 15, 13))


@pytest.mark.parametrize("stale_hours", [1, 3, 30])
@pytest.mark.parametrize("data_interval", [True, False])
def test_catchup_false_creates_only_the_newest_slot_whatever_max_backfill(
    clock: FrozenClock, monkeypatch: pytest.MonkeyPatch, stale_hours: int, data_interval: bool
) -> None:
    """catchup=False is Airflow's latest-only schedule for any max_backfill: one run after an outage.

    The scheduler creates the run it stored before the outage through ``next_run_info_from_dag_model``
    (which reads the DAG's catchup flag through its session), then asks ``next_dagrun_info`` with
    catchup=False. Before the fix the stored run was kept (or moved) under max_backfill, and the schedule
    then jumped to the newest slot: two runs, one of them older than the newest.
    """
    from airflow_lease_provider.timetables import _scheduler

    monkeypatch.setattr(
        _scheduler, "dag_time_restriction", lambda _model: TimeRestriction(minute(2025, 1, 1), None, False)
    )
    monkeypatch.setattr(_scheduler, "taken_logical_dates", lambda _model, since: set())
    timetable = CappedCatchupTimetable("0 * * * *", max_backfill=5, data_interval=data_interval)
    reference: Any = (
        CronDataIntervalTimetable("0 * * * *", "UTC")
        if data_interval
        else CronTriggerTimetable("0 * * * *", timezone="UTC")
    )
    stale_end = minute(2025, 6, 15, 12).subtract(hours=stale_hours)
    stale = (
        DagRunInfo.interval(stale_end.subtract(hours=1), stale_end)
        if data_interval
        else DagRunInfo.exact(stale_end)
    )
    created = timetable.next_run_info_from_dag_model(dag_model=stored(stale))
    assert created is not None and created.data_interval is not None
    runs = [created] if created.run_after <= clock.now else []
    later, waiting = scheduled_runs(timetable, created.data_interval, NO_CATCHUP, clock)
    runs += later
    # Airflow's own timetable, asked after the pre-outage run with catchup=False: the newest slot only.
    newest = reference.next_dagrun_info(
        last_automated_data_interval=DataInterval(stale_end.subtract(hours=1), stale_end.subtract(hours=1))
        if not data_interval
        else DataInterval(stale_end.subtract(hours=2), stale_end.subtract(hours=1)),
        restriction=NO_CATCHUP,
    )
    assert runs == [newest]
    assert waiting is not None and waiting.run_after == minute(2025, 6, 15, 13)
