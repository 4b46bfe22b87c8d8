"""Property test: the capped runs are exactly the newest N of the runs Airflow's own timetable would make.

For random schedules, timezones (with and without DST, including a 30-minute DST shift), outages and
caps, the reference is Airflow's ``CronDataIntervalTimetable`` / ``CronTriggerTimetable`` with
``catchup=True``; the capped timetable must produce its newest ``max_backfill`` runs (minus those older
than the window), then wait for the same next run, and report the rest as skipped.

One documented exception (docs/timetable.md, "Daylight saving"): across a spring-forward gap Airflow's
``CronDataIntervalTimetable`` leaves a hole in its own intervals. After a run that ends at a moved gap slot
it starts the next interval at ``_align_to_prev`` of that end, whose ``_get_prev`` reads a non-existent
wall-clock time and lands *after* it (New York, ``*/20 1-4 * * *``, 2025-03-09: the run ending 03:00 EDT is
followed by 03:40-04:00 EDT, so 03:20 and 03:40 never run and 03:00-03:40 is in no interval), although
its own code says "Data interval starts from the end of the previous interval". The capped timetable
keeps contiguous intervals over the trigger timetable's slots instead; where Airflow's chain has such a
hole the reference is those slots, and the test checks that the hole is that case and nothing else.
"""

from __future__ import annotations

import datetime
import itertools
import zoneinfo
from types import SimpleNamespace
from typing import Any

import pendulum
import pytest
from airflow.timetables.base import DagRunInfo, DataInterval, TimeRestriction
from airflow.timetables.interval import CronDataIntervalTimetable
from airflow.timetables.trigger import CronTriggerTimetable
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from airflow_lease_provider.timetables import CappedCatchupTimetable, capped_catchup
from tests.timetables.cron_reference import reference_slots

CATCHUP = TimeRestriction(earliest=None, latest=None, catchup=True)
SCHEDULES = [
    "*/7 * * * *",
    "0 * * * *",
    "30 2 * * *",
    "15 1-3 * * 0",
    "*/20 1-4 * * *",
    "0 0 L * *",
    "45 */5 * * 1-5",
]
TIMEZONES = ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]
START = pendulum.datetime(2025, 1, 1, tz="UTC")
_DAY = datetime.timedelta(days=1)


class Clock:
    now = START


def _runs_until(
    timetable: Any, last: DataInterval, now: pendulum.DateTime
) -> tuple[list[DagRunInfo], DagRunInfo]:
    runs: list[DagRunInfo] = []
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    while info.run_after <= now:
        runs.append(info)
        info = timetable.next_dagrun_info(
            last_automated_data_interval=info.data_interval, restriction=CATCHUP
        )
    return runs, info


def _spring_forward_before(tz: str, moment: pendulum.DateTime) -> bool:
    """Whether ``tz``'s UTC offset went up in the day before ``moment``."""
    zone = pendulum.timezone(tz)
    earlier = moment.subtract(days=1).in_timezone(zone).utcoffset()
    later = moment.in_timezone(zone).utcoffset()
    assert earlier is not None and later is not None
    return later > earlier


def _change_near(tz: str, low: pendulum.DateTime, high: pendulum.DateTime, *, odd_only: bool) -> bool:
    """Whether ``tz``'s UTC offset changes (by other than a whole hour, ``odd_only``) within a day of
    ``[low, high]``."""
    if tz == "UTC":
        return False
    zone = zoneinfo.ZoneInfo(tz)
    moment, stop = low - datetime.timedelta(days=1), high + datetime.timedelta(days=1)
    offset = moment.astimezone(zone).utcoffset()
    while moment < stop:
        moment += datetime.timedelta(minutes=30)
        following = moment.astimezone(zone).utcoffset()
        assert offset is not None and following is not None
        if following != offset and (not odd_only or (following - offset) % datetime.timedelta(hours=1)):
            return True
        offset = following
    return False


def _enumerated_runs(
    schedule: str, tz: str, data_interval: bool, last: DataInterval, now: pendulum.DateTime
) -> tuple[list[DagRunInfo], DagRunInfo]:
    """The runs after ``last`` by ``now`` and the next, from the brute-force enumeration of the slots."""
    slots = [
        pendulum.instance(s)
        for s in reference_slots(schedule, tz, last.end - datetime.timedelta(days=1), now + _DAY)
    ]
    runs = [
        DagRunInfo.interval(start=a, end=b) if data_interval else DagRunInfo.exact(b)
        for a, b in itertools.pairwise(slots)
        if b > last.end
    ]
    due = [r for r in runs if r.run_after <= now]
    return due, runs[len(due)]


def _reference_runs(
    schedule: str, tz: str, data_interval: bool, last: DataInterval, now: pendulum.DateTime
) -> tuple[list[DagRunInfo], DagRunInfo]:
    """Airflow's runs after ``last`` by ``now`` (catchup=True), and the run it then waits for.

    Trigger-style: ``CronTriggerTimetable``'s. Data-interval: ``CronDataIntervalTimetable``'s, unless its
    intervals leave a hole (the spring-forward case in the module's docstring); then the trigger
    timetable's slots with contiguous intervals, after checking that Airflow's runs are among them and
    each hole starts right after a spring-forward change. An every-hour schedule across a change that is
    not a whole hour (Lord Howe's 30 minutes) is the other documented case: Airflow adds the naive hour
    difference across it (its data-interval timetable may even raise "did not advance"), so the slots
    are the brute-force enumeration's, as in ``test_dst_property.py``.
    """
    if schedule.split()[1] == "*" and _change_near(tz, last.end, now, odd_only=True):
        return _enumerated_runs(schedule, tz, data_interval, last, now)
    trigger = CronTriggerTimetable(schedule, timezone=tz)
    if not data_interval:
        return _runs_until(trigger, last, now)
    runs, waiting = _runs_until(CronDataIntervalTimetable(schedule, tz), last, now)
    chain = [last, *(r.data_interval for r in runs), waiting.data_interval]
    holes = [(a, b) for a, b in itertools.pairwise(chain) if a.end != b.start]
    if not holes:
        return runs, waiting
    # The slots, up to the run Airflow waits for (which lies past any slot it dropped).
    slots, _ = _runs_until(trigger, DataInterval.exact(last.end), waiting.run_after)
    ends = [last.end, *(s.run_after for s in slots)]
    for a, b in holes:
        assert a.end < b.start, (a, b)  # a hole, never an overlap
        assert _spring_forward_before(tz, a.end), (schedule, tz, a, b)
    # Airflow drops slots there, it never makes a run at a time that is not one.
    assert {r.data_interval.end for r in [*runs, waiting]} <= set(ends), (schedule, tz)
    contiguous = [DagRunInfo.interval(start=a, end=b) for a, b in itertools.pairwise(ends)]
    due = [r for r in contiguous if r.run_after <= now]
    return due, contiguous[len(due)]


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> type[Clock]:
    monkeypatch.setattr(capped_catchup, "_utcnow", lambda: Clock.now)
    return Clock


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    schedule=st.sampled_from(SCHEDULES),
    tz=st.sampled_from(TIMEZONES),
    data_interval=st.booleans(),
    cap=st.integers(min_value=1, max_value=6),
    window_minutes=st.one_of(st.none(), st.integers(min_value=1, max_value=3000)),
    last_offset_minutes=st.integers(min_value=0, max_value=365 * 24 * 60),
    outage_minutes=st.integers(min_value=0, max_value=6 * 24 * 60),
    second=st.integers(min_value=0, max_value=59),
    from_dag_model=st.booleans(),
)
# Spring forward in New York (2025-03-09, 02:00 -> 03:00): found by Hypothesis.
@example(
    schedule="*/20 1-4 * * *",
    tz="America/New_York",
    data_interval=True,
    cap=1,
    window_minutes=None,
    last_offset_minutes=94160,
    outage_minutes=2800,
    second=0,
    from_dag_model=False,
)
@example(
    schedule="*/20 1-4 * * *",
    tz="America/New_York",
    data_interval=True,
    cap=1,
    window_minutes=None,
    last_offset_minutes=94140,
    outage_minutes=2780,
    second=0,
    from_dag_model=False,
)
@example(
    schedule="*/20 1-4 * * *",
    tz="America/New_York",
    data_interval=True,
    cap=1,
    window_minutes=None,
    last_offset_minutes=94120,
    outage_minutes=2780,
    second=0,
    from_dag_model=False,
)
# The same day: the last run 03:00 EDT, right after the gap, whose data interval Airflow's _get_prev makes
# start at 03:40 (the test's last run is repaired); and the scheduler's path from the stored run.
@example(
    schedule="*/20 1-4 * * *",
    tz="America/New_York",
    data_interval=True,
    cap=3,
    window_minutes=None,
    last_offset_minutes=96910,
    outage_minutes=120,
    second=0,
    from_dag_model=False,
)
@example(
    schedule="*/20 1-4 * * *",
    tz="America/New_York",
    data_interval=True,
    cap=3,
    window_minutes=None,
    last_offset_minutes=94160,
    outage_minutes=2800,
    second=0,
    from_dag_model=True,
)
# Fall back in New York (2025-11-02, 02:00 EDT -> 01:00 EST): the last run 01:20 EDT, down through the
# repeated hour (01:00-01:40 run once, EST) until 02:50 EST.
@example(
    schedule="*/20 1-4 * * *",
    tz="America/New_York",
    data_interval=True,
    cap=3,
    window_minutes=None,
    last_offset_minutes=439520,
    outage_minutes=150,
    second=0,
    from_dag_model=False,
)
@example(
    schedule="*/20 1-4 * * *",
    tz="America/New_York",
    data_interval=False,
    cap=6,
    window_minutes=None,
    last_offset_minutes=439520,
    outage_minutes=150,
    second=0,
    from_dag_model=True,
)
# Lord Howe's 30-minute changes with every-hour schedules (2025-04-06 02:00 LHDT -> 01:30 LHST, 2025-10-05
# 02:00 LHST -> 02:30 LHDT): Airflow's stepping is the documented every-hour case (its data-interval
# timetable raises "did not advance" on the second), so the reference is the enumeration.
@example(
    schedule="0 * * * *",
    tz="Australia/Lord_Howe",
    data_interval=True,
    cap=1,
    window_minutes=None,
    last_offset_minutes=136200,
    outage_minutes=20,
    second=0,
    from_dag_model=False,
)
@example(
    schedule="*/7 * * * *",
    tz="Australia/Lord_Howe",
    data_interval=True,
    cap=2,
    window_minutes=None,
    last_offset_minutes=136260,
    outage_minutes=10,
    second=0,
    from_dag_model=False,
)
@example(
    schedule="0 * * * *",
    tz="Australia/Lord_Howe",
    data_interval=True,
    cap=1,
    window_minutes=None,
    last_offset_minutes=398310,
    outage_minutes=90,
    second=0,
    from_dag_model=True,
)
# Lord Howe's spring-forward (2025-10-05 02:00 -> 02:30 LHDT), the last run asked for at 02:30: Airflow's
# alignment gives 02:50, not a slot of "*/20 1-4 * * *" (the test takes the enumeration's 02:00 -> 02:40).
@example(
    schedule="*/20 1-4 * * *",
    tz="Australia/Lord_Howe",
    data_interval=True,
    cap=1,
    window_minutes=None,
    last_offset_minutes=398370,
    outage_minutes=30,
    second=0,
    from_dag_model=False,
)
def test_capped_runs_are_the_newest_of_airflows_runs(
    frozen: type[Clock],
    schedule: str,
    tz: str,
    data_interval: bool,
    cap: int,
    window_minutes: int | None,
    last_offset_minutes: int,
    outage_minutes: int,
    second: int,
    from_dag_model: bool,
) -> None:
    reference: Any
    if data_interval:
        reference = CronDataIntervalTimetable(schedule, tz)
    else:
        reference = CronTriggerTimetable(schedule, timezone=tz)
    # The last run: a real slot of the schedule, anywhere in 2025.
    moment = START.add(minutes=last_offset_minutes)
    if _change_near(tz, moment, moment, odd_only=False):
        # Near an offset change Airflow's alignment may give an instant that is not a slot (Lord Howe
        # 02:30 LHDT after the gap: 02:50 for "*/20 1-4 * * *"; "0 * * * *" on the fall-back day: 01:30
        # LHST), one after ``moment``, or an interval that starts after it ends (New York 03:00 EDT:
        # 03:40): the enumeration's two slots before ``moment``.
        earlier = reference_slots(schedule, tz, moment - datetime.timedelta(days=63), moment)
        last_start, last_end = (pendulum.instance(s) for s in earlier[-2:])
    else:
        last_end = reference._align_to_prev(moment)
        last_start = reference._get_prev(last_end)
    last = DataInterval(last_start, last_end) if data_interval else DataInterval.exact(last_end)
    now = last_end.add(minutes=outage_minutes, seconds=second)
    frozen.now = now
    window = None if window_minutes is None else datetime.timedelta(minutes=window_minutes)
    timetable = CappedCatchupTimetable(
        schedule, max_backfill=cap, catchup_window=window, timezone=tz, data_interval=data_interval
    )

    everything, reference_next = _reference_runs(schedule, tz, data_interval, last, now)
    expected = [r for r in everything[-cap:] if window is None or r.run_after >= now - window]

    if from_dag_model:
        # The scheduler's path after an outage: the run it stored right after `last` was created.
        stored_info = everything[0] if everything else reference_next
        dag_model = SimpleNamespace(
            next_dagrun=stored_info.logical_date,
            next_dagrun_data_interval=stored_info.data_interval,
            next_dagrun_create_after=stored_info.run_after,
            next_dagrun_partition_date=None,
            next_dagrun_partition_key=None,
        )
        first = timetable.next_run_info_from_dag_model(dag_model=dag_model)
        assert first is not None
        if first.run_after <= now:
            rest, waiting = _runs_until(timetable, first.data_interval, now)
            runs = [first, *rest]
        else:
            runs, waiting = [], first
    else:
        runs, waiting = _runs_until(timetable, last, now)

    assert runs == expected
    assert waiting == reference_next

    if runs:
        skipped = timetable.skipped_slots(runs[0].data_interval, last)
        older = everything[: len(everything) - len(runs)]
        if not older:
            assert skipped is None
        else:
            assert skipped is not None
            assert skipped.count == len(older)
            assert skipped.first == older[0].data_interval
            assert skipped.last == older[-1].data_interval
