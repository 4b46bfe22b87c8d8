"""Daylight-saving days through the scheduler's calls (issue #23, defect 1).

Each case is a reproduction from the issue: the timetable is asked what the scheduler asks
(``next_dagrun_info`` when it creates a run and stores the next one, ``next_run_info_from_dag_model``
when it creates that stored run), with the clock frozen. The slots expected are Airflow's own
(``CronTriggerTimetable`` / ``CronDataIntervalTimetable`` stepping forward), which agree with the
brute-force reference (:mod:`tests.timetables.cron_reference`) in these cases.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pendulum
import pytest
from airflow.timetables.base import DagRunInfo, DataInterval, TimeRestriction
from airflow.timetables.interval import CronDataIntervalTimetable
from airflow.timetables.trigger import CronTriggerTimetable

from airflow_lease_provider.timetables import CappedCatchupTimetable, skipped_slots
from tests.timetables.conftest import FrozenClock
from tests.timetables.cron_reference import reference_slots
from tests.timetables.dag_model import stored

CATCHUP = TimeRestriction(earliest=None, latest=None, catchup=True)
BERLIN, NEW_YORK, LORD_HOWE = "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"


def local(tz: str, *args: int) -> pendulum.DateTime:
    return pendulum.datetime(*args, tz=tz).in_timezone("UTC")




def scheduler(timetable: Any, last: DataInterval, clock: FrozenClock) -> tuple[list[DagRunInfo], DagRunInfo]:
    """What a scheduler creates at the frozen time after ``last``: the stored run (through
    ``next_run_info_from_dag_model``), then each next one while it is due; and the one it waits for."""
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    info = timetable.next_run_info_from_dag_model(dag_model=stored(info))
    runs: list[DagRunInfo] = []
    while info.run_after <= clock.now:
        runs.append(info)
        info = timetable.next_dagrun_info(
            last_automated_data_interval=info.data_interval, restriction=CATCHUP
        )
    return runs, info


def live_scheduler(timetable: Any, last: DataInterval, clock: FrozenClock, count: int) -> list[DagRunInfo]:
    """A scheduler that never stops: each stored run is created 5 s after it is due, and the next stored."""
    clock.set(last.end.add(seconds=5))
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    runs: list[DagRunInfo] = []
    for _ in range(count):
        clock.set(info.run_after.add(seconds=5))
        created = timetable.next_run_info_from_dag_model(dag_model=stored(info))
        assert created.run_after <= clock.now, (created, clock.now)
        runs.append(created)
        info = timetable.next_dagrun_info(
            last_automated_data_interval=created.data_interval, restriction=CATCHUP
        )
    return runs


def airflow_runs(reference: Any, last: DataInterval, clock: FrozenClock) -> list[DagRunInfo]:
    """Every run Airflow's own timetable creates after ``last`` by the frozen time (catchup=True)."""
    runs: list[DagRunInfo] = []
    info = reference.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    while info.run_after <= clock.now:
        runs.append(info)
        info = reference.next_dagrun_info(
            last_automated_data_interval=info.data_interval, restriction=CATCHUP
        )
    return runs


def test_berlin_the_due_gap_run_is_created_on_time_not_moved_into_the_future(clock: FrozenClock) -> None:
    # "0,30 2 * * *": on 2026-03-29 02:00 and 02:30 do not exist; Airflow runs that day's slot at 03:00 CEST.
    timetable = CappedCatchupTimetable("0,30 2 * * *", max_backfill=1, timezone=BERLIN)
    previous = DataInterval(local(BERLIN, 2026, 3, 28, 2, 0), local(BERLIN, 2026, 3, 28, 2, 30))
    clock.set(previous.end.add(seconds=5))  # the scheduler creates the 02:30 run and stores the next one
    nxt = timetable.next_dagrun_info(last_automated_data_interval=previous, restriction=CATCHUP)
    assert nxt == DagRunInfo.interval(previous.end, local(BERLIN, 2026, 3, 29, 3, 0))
    clock.set(local(BERLIN, 2026, 3, 29, 3, 0, 5))  # no outage: it creates the stored run on time
    created = timetable.next_run_info_from_dag_model(dag_model=stored(nxt))
    assert created == nxt
    assert created.run_after <= clock.now
    # And it is Airflow's run.
    reference = CronDataIntervalTimetable("0,30 2 * * *", BERLIN)
    assert reference.next_dagrun_info(last_automated_data_interval=previous, restriction=CATCHUP) == nxt


@pytest.mark.parametrize("cap", [1, 2, 3])
@pytest.mark.parametrize("data_interval", [True, False])
def test_new_york_after_a_gap_the_kept_runs_are_airflows_and_all_due(
    clock: FrozenClock, cap: int, data_interval: bool
) -> None:
    # "*/15 2 * * *": on 2026-03-08 02:00-02:59 do not exist; Airflow runs that day once, at 03:00 EDT.
    timetable = CappedCatchupTimetable(
        "*/15 2 * * *", max_backfill=cap, timezone=NEW_YORK, data_interval=data_interval
    )
    reference: Any
    if data_interval:
        reference = CronDataIntervalTimetable("*/15 2 * * *", NEW_YORK)
        last = DataInterval(local(NEW_YORK, 2026, 3, 5, 2, 30), local(NEW_YORK, 2026, 3, 5, 2, 45))
    else:
        reference = CronTriggerTimetable("*/15 2 * * *", timezone=NEW_YORK)
        last = DataInterval.exact(local(NEW_YORK, 2026, 3, 5, 2, 45))
    clock.set(local(NEW_YORK, 2026, 3, 8, 3, 0, 5))
    runs, waiting = scheduler(timetable, last, clock)
    expected = airflow_runs(reference, last, clock)[-cap:]
    assert [r.run_after for r in runs] == [r.run_after for r in expected]
    assert runs[-1].run_after == local(NEW_YORK, 2026, 3, 8, 3, 0)
    assert all(r.run_after <= clock.now for r in runs)
    assert waiting.run_after == local(NEW_YORK, 2026, 3, 9, 2, 0)
    if not data_interval:
        assert runs == expected


def test_new_york_skipped_slots_across_the_gap(clock: FrozenClock) -> None:
    timetable = CappedCatchupTimetable("*/15 2 * * *", timezone=NEW_YORK)
    previous = DataInterval(local(NEW_YORK, 2026, 3, 7, 2, 15), local(NEW_YORK, 2026, 3, 7, 2, 30))
    run = DataInterval(local(NEW_YORK, 2026, 3, 7, 2, 45), local(NEW_YORK, 2026, 3, 8, 3, 0))
    skipped = skipped_slots(timetable, run, previous)
    # One slot between them, 02:45 EST on the 7th (the gap's slots run once, as the 03:00 EDT run).
    assert skipped is not None
    assert skipped.count == 1
    assert skipped.first == skipped.last == DataInterval(previous.end, run.start)


@pytest.mark.parametrize("cap", [1, 2, 100])
@pytest.mark.parametrize("data_interval", [True, False])
def test_lord_howe_half_hour_shift_runs_airflows_slots(
    clock: FrozenClock, data_interval: bool, cap: int
) -> None:
    # "0,20,40 2 * * 0": on Sunday 2025-10-05 02:00-02:29 do not exist (a 30-minute shift): Airflow's
    # CronTriggerTimetable runs 02:30 (for 02:00 and 02:20) and 02:40, then 2025-10-12 02:00 as usual.
    # (Its CronDataIntervalTimetable skips 10-05 02:40: the interval after 02:30 starts at 02:50, its
    # _get_prev of 02:30; docs/timetable.md. The slots here are the enumeration's, and the trigger one's.)
    expression = "0,20,40 2 * * 0"
    timetable = CappedCatchupTimetable(
        expression, max_backfill=cap, timezone=LORD_HOWE, data_interval=data_interval
    )
    reference = CronTriggerTimetable(expression, timezone=LORD_HOWE)
    end = local(LORD_HOWE, 2025, 9, 28, 2, 40)
    last = (
        DataInterval(local(LORD_HOWE, 2025, 9, 28, 2, 20), end) if data_interval else DataInterval.exact(end)
    )
    # The scheduler ran throughout (before the fix, 10-05 02:50 ran and 10-12 02:00 never did, cap 1) ...
    runs = live_scheduler(timetable, last, clock, 8)
    assert [r.run_after.in_timezone(LORD_HOWE).strftime("%m-%d %H:%M") for r in runs] == [
        "10-05 02:30", "10-05 02:40", "10-12 02:00", "10-12 02:20", "10-12 02:40",
        "10-19 02:00", "10-19 02:20", "10-19 02:40",
    ]  # fmt: skip
    assert [r.run_after for r in runs] == [
        r.run_after for r in airflow_runs(reference, DataInterval.exact(end), clock)
    ]
    assert [r.run_after for r in runs] == reference_slots(
        expression, LORD_HOWE, end.add(seconds=1), clock.now
    )
    # ... or was down from before the change until after the last of them: the newest ``cap`` of the same.
    clock.set(local(LORD_HOWE, 2025, 10, 19, 12, 0))
    after_outage, waiting = scheduler(timetable, last, clock)
    assert after_outage == runs[-cap:]
    assert waiting.run_after == local(LORD_HOWE, 2025, 10, 26, 2, 0)
    if data_interval:
        # Each data interval starts where the previous run's ended: no slot in between, none twice.
        assert runs[0].data_interval.start == end
        assert all(a.data_interval.end == b.data_interval.start for a, b in itertools.pairwise(runs))


def test_lord_howe_hourly_ten_thousand_kept_is_the_enumerations_oldest(clock: FrozenClock) -> None:
    # 10,000 hourly slots back from now span two Lord Howe DST changes (30-minute shifts).
    timetable = CappedCatchupTimetable("0 * * * *", max_backfill=10_000, timezone=LORD_HOWE)
    clock.set(pendulum.datetime(2025, 6, 15, 12, 0, 30, tz="UTC"))
    last = DataInterval(
        pendulum.datetime(2023, 1, 1, 0, 30, tz="UTC"), pendulum.datetime(2023, 1, 1, 1, 30, tz="UTC")
    )
    slots = reference_slots("0 * * * *", LORD_HOWE, pendulum.datetime(2024, 1, 1, tz="UTC"), clock.now)
    started = time.perf_counter()
    first = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    moved = timetable.next_run_info_from_dag_model(
        dag_model=stored(DagRunInfo.interval(last.end, last.end.add(hours=1)))
    )
    elapsed = time.perf_counter() - started
    assert first == moved == DagRunInfo.interval(slots[-10_001], slots[-10_000])
    assert elapsed < 5, elapsed  # a back-stepping of one croniter per step near a change timed out here
