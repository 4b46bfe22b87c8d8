"""The cron grid's calendar arithmetic against brute-force enumeration, and its cost against the gap's length.

:class:`~airflow_lease_provider.timetables._grid.CronGrid` counts slots and finds the n-th slot back by
arithmetic on whole years, months and days (issue 28 item 2). Here random five-field expressions (day of
month with lists, ranges, steps, ``L`` and ``W``; months; days of week with ranges, lists and ``#``; both
day fields restricted), in random zones (odd DST changes, any IANA zone, fixed offsets) at random places
from 1971 to 2036, are held to :mod:`tests.timetables.cron_reference` (croniter's matches one by one, the
instants from ``zoneinfo``), over windows from a day (every minute) to about four years (a monthly
schedule): every question the timetable asks, and the capped first run after a gap through
``next_dagrun_info``. The cost tests count croniter work and segments visited; nothing is timed.
"""

from __future__ import annotations

import datetime
import zoneinfo
from typing import Any

import pendulum
import pytest
from airflow.timetables.base import DataInterval, TimeRestriction
from croniter import CroniterBadDateError, croniter
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from airflow_lease_provider.timetables import CappedCatchupTimetable, _grid, capped_catchup
from airflow_lease_provider.timetables._grid import CronGrid
from tests.timetables.cron_reference import reference_slots

UTC = datetime.timezone.utc
CATCHUP = TimeRestriction(earliest=None, latest=None, catchup=True)
ALL_ZONES = sorted(zoneinfo.available_timezones() - {"Factory", "localtime"})
ODD_ZONES = [
    "Australia/Lord_Howe",
    "Antarctica/Troll",
    "America/Santiago",
    "Pacific/Chatham",
    "America/St_Johns",
    "Africa/Casablanca",
    "Asia/Tehran",
    "Europe/Berlin",
    "America/New_York",
]

MINUTES = ["0", "30", "*/15", "5,35", "59", "*/7", "0-2", "*/20"]
HOURS = ["*", "0", "2", "1-3", "*/6", "9,17", "23", "0,12"]
DAYS_OF_MONTH = [
    "*",
    "*",
    "*",
    "1",
    "15",
    "31",
    "L",
    "1,15",
    "29",
    "28-31",
    "10W",
    "1W",
    "1-7",
    "*/10",
    "2-5,20",
]
MONTHS = ["*", "*", "*", "2", "1,7", "*/3", "11-12", "3-10"]
DAYS_OF_WEEK = ["*", "*", "*", "1-5", "0", "6,0", "5#2", "1#1", "3#5", "2", "0-6", "1,3,5"]


@st.composite
def expressions(draw: st.DrawFn) -> str:
    """Five-field expressions with every kind of day field, that fire at least once."""
    fields = [
        draw(st.sampled_from(choices)) for choices in (MINUTES, HOURS, DAYS_OF_MONTH, MONTHS, DAYS_OF_WEEK)
    ]
    # croniter refuses W and # together with a restricted other day field in ways of its own: keep one.
    if ("W" in fields[2] or "#" in fields[4]) and fields[2] != "*" and fields[4] != "*":
        fields[4] = "*"
    expression = " ".join(fields)
    try:
        croniter(expression).get_next(datetime.datetime)
    except (CroniterBadDateError, ValueError, KeyError):
        assume(False)
    return expression


@st.composite
def places(draw: st.DrawFn) -> tuple[str | int, datetime.datetime]:
    kind = draw(st.sampled_from(["odd", "odd", "any", "fixed"]))
    zone: str | int
    if kind == "fixed":
        zone = draw(st.sampled_from(["UTC", 19_800, -12_600, 3_600 * 14, -3_600 * 11]))
    else:
        zone = draw(st.sampled_from(ODD_ZONES if kind == "odd" else ALL_ZONES))
    seconds = draw(st.integers(0, 65 * 365 * 86_400))
    return zone, datetime.datetime(1971, 1, 1, tzinfo=UTC) + datetime.timedelta(seconds=seconds)


def _window(expression: str) -> datetime.timedelta:
    """About 300 slots (a day of a schedule every few minutes, years of a monthly one; at most 12 years),
    or 80 where the reference asks croniter for each match (L, W, #, both day fields), so the brute force
    stays cheap whatever the density."""
    grid = CronGrid(expression, pendulum.timezone("UTC"))
    assert grid._days is not None
    per_year = len(grid._times) * sum(grid._days.year_count(year) for year in range(2000, 2008)) / 8
    fields = expression.split()
    stepped = any(c in expression for c in "LW#") or (fields[2] != "*" and fields[4] != "*")
    slots = 80 if stepped else 300
    return datetime.timedelta(days=min(4_400, max(1.0, slots * 365 / max(per_year, 1))))


def _walk_back(
    slots: list[datetime.datetime], slot: datetime.datetime, steps: int, stop: datetime.datetime
) -> Any:
    """``back_from`` by its definition: step back one slot at a time, stopping at the first at or before stop."""
    index = slots.index(slot)
    for _ in range(steps):
        if slots[index] <= stop:
            break
        index -= 1
        if index < 0:
            return None  # before the enumerated window
    return slots[index]


@settings(max_examples=800, deadline=None)
@given(
    expression=expressions(),
    place=places(),
    cuts=st.lists(st.floats(0.05, 0.95), min_size=6, max_size=6),
    steps=st.integers(1, 3_000),
)
def test_the_arithmetic_grid_answers_as_the_enumeration(
    expression: str, place: tuple[str | int, datetime.datetime], cuts: list[float], steps: int
) -> None:
    zone, low = place
    window = _window(expression)
    high = low + window
    slots = reference_slots(expression, zone, low, high)
    assume(len(slots) >= 2)
    grid = CronGrid(expression, pendulum.timezone(zone))
    moments = sorted(low + window * cut for cut in cuts)
    # A probe a second off a slot and one on it, as the scheduler asks (now, a run's end).
    moments += [slots[len(slots) // 2], slots[-1] + datetime.timedelta(seconds=1)]
    for moment in moments:
        older = [s for s in slots if s <= moment]
        newer = [s for s in slots if s >= moment]
        if older:
            assert grid.at_or_before(pendulum.instance(moment)) == older[-1], (expression, zone, moment)
            if [s for s in older if s < moment]:
                assert grid.before(pendulum.instance(moment)) == [s for s in older if s < moment][-1]
        if newer:
            assert grid.at_or_after(pendulum.instance(moment)) == newer[0], (expression, zone, moment)
            if [s for s in newer if s > moment]:
                assert grid.after(pendulum.instance(moment)) == [s for s in newer if s > moment][0]
    # Counts between any two of the moments.
    for a, b in zip(moments[:3], moments[3:6], strict=True):
        expected = sum(1 for s in slots if a < s < b)
        assert grid.count_between(pendulum.instance(a), pendulum.instance(b)) == expected, (
            expression,
            zone,
            a,
            b,
        )
    # The walk back from the newest slot, stopping at the oldest moment.
    stop = moments[0]
    expected_slot = _walk_back(slots, slots[-1], steps, stop)
    if expected_slot is not None:
        found = grid.back_from(pendulum.instance(slots[-1]), steps, stop=pendulum.instance(stop))
        assert found == expected_slot, (expression, zone, steps, stop)


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    now: dict[str, Any] = {"now": pendulum.datetime(2025, 1, 1, tz="UTC")}
    monkeypatch.setattr(capped_catchup, "_utcnow", lambda: now["now"])
    return now


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    expression=expressions(),
    place=places(),
    cap=st.integers(1, 10_000),
    data_interval=st.booleans(),
    late=st.floats(0.1, 1.0),
)
def test_the_first_run_after_a_gap_is_the_enumerations_capped_slot(
    frozen: dict[str, Any],
    expression: str,
    place: tuple[str | int, datetime.datetime],
    cap: int,
    data_interval: bool,
    late: float,
) -> None:
    zone, low = place
    window = _window(expression)
    slots = reference_slots(expression, zone, low, low + window)
    assume(len(slots) >= 3)
    previous_slot, last_slot = slots[0], slots[1]
    now = last_slot + (slots[-1] - last_slot) * late + datetime.timedelta(seconds=7)
    frozen["now"] = pendulum.instance(now)
    due = [s for s in slots if last_slot < s <= now]
    assume(due)
    timetable = CappedCatchupTimetable(
        expression, max_backfill=cap, timezone=pendulum.timezone(zone), data_interval=data_interval
    )
    last = DataInterval(previous_slot, last_slot) if data_interval else DataInterval.exact(last_slot)
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert info is not None
    assert info.run_after == due[-cap:][0], (expression, zone, cap, now)
    if data_interval:
        assert info.data_interval.start == slots[slots.index(info.run_after) - 1]


# -- cost: it does not grow with the gap ----------------------------------------------------------------


class _Work:
    """Counts croniter constructions and steps, and the segments of constant offset the grid visits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.croniters = self.steps = self.segments = 0
        real_croniter = _grid.croniter

        def construct(*args: Any, **kwargs: Any) -> Any:
            self.croniters += 1
            return real_croniter(*args, **kwargs)

        monkeypatch.setattr(_grid, "croniter", construct)
        monkeypatch.setattr(capped_catchup, "croniter", construct)
        for name in ("get_next", "get_prev"):
            real_step = getattr(croniter, name)

            def step(iterator: Any, *args: Any, _real: Any = real_step, **kwargs: Any) -> Any:
                self.steps += 1
                return _real(iterator, *args, **kwargs)

            monkeypatch.setattr(croniter, name, step)
        real_segment = CronGrid._segment_at

        def segment(grid: CronGrid, moment: datetime.datetime) -> Any:
            self.segments += 1
            return real_segment(grid, moment)

        monkeypatch.setattr(CronGrid, "_segment_at", segment)

    def reset(self) -> None:
        self.croniters = self.steps = self.segments = 0

    @property
    def croniter_work(self) -> int:
        return self.croniters + self.steps


NOW = pendulum.datetime(2025, 6, 15, 12, 0, 30, tz="UTC")


def _first_call(expression: str, zone: str, years: int, cap: int, work: _Work) -> tuple[Any, int, int]:
    """The first call after ``years`` offline: (its run, croniter work, segments visited)."""
    timetable = CappedCatchupTimetable(expression, max_backfill=cap, timezone=zone, data_interval=False)
    last = DataInterval.exact(timetable._cron.at_or_before(NOW.subtract(years=years)))  # type: ignore[union-attr]
    work.reset()
    info = timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    return info, work.croniter_work, work.segments


@pytest.mark.parametrize(
    ("expression", "zone", "cap"),
    [
        ("0 * * * *", "Europe/Berlin", 1_000),
        ("30 9 * * 1-5", "Europe/Berlin", 1_000),
        ("*/5 * * * *", "UTC", 1_000),
        ("*/5 * * * *", "Australia/Lord_Howe", 10_000),
        ("0 0 L * *", "America/New_York", 10),
    ],
)
def test_a_capped_call_costs_the_same_after_five_or_fifty_years(
    monkeypatch: pytest.MonkeyPatch, expression: str, zone: str, cap: int
) -> None:
    """The cap, not the gap, bounds the work: no croniter step at all (the old grid stepped back cap - 1
    times per call), and the same segments visited whether the DAG was offline 5 or 50 years."""
    monkeypatch.setattr(capped_catchup, "_utcnow", lambda: NOW)
    work = _Work(monkeypatch)
    _first_call(expression, zone, 5, cap, work)  # the zone's transitions and the month kinds, cached
    _, croniter_5, segments_5 = _first_call(expression, zone, 5, cap, work)
    _first_call(expression, zone, 50, cap, work)
    _, croniter_50, segments_50 = _first_call(expression, zone, 50, cap, work)
    assert croniter_5 <= 3 and croniter_50 <= 3, (croniter_5, croniter_50)
    assert segments_50 == segments_5, (segments_5, segments_50)


def test_when_the_cap_covers_the_gap_the_work_is_per_year_not_per_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Weekly, max_backfill=10000, 50 years offline in a DST zone: every slot of the gap (2,600) fits the
    cap, so the walk back crosses the whole gap, a few segments per year (two offset changes and 1 January)."""
    monkeypatch.setattr(capped_catchup, "_utcnow", lambda: NOW)
    work = _Work(monkeypatch)
    _first_call("0 6 * * 1", "Europe/Berlin", 50, 10_000, work)
    info, croniter_work, segments = _first_call("0 6 * * 1", "Europe/Berlin", 50, 10_000, work)
    assert croniter_work <= 3, croniter_work
    assert segments <= 4 * 52, segments
    # Every slot of the gap is kept: the first run is the one right after the last.
    assert info.run_after == pendulum.datetime(1975, 6, 16, 5, tz="UTC")  # a Monday, 06:00 CET


def test_counting_fifty_years_of_a_weekday_schedule_steps_no_croniter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The skipped-slot record counts the whole gap: 50 years of ``30 9 * * 1-5`` in Berlin took a croniter
    per day (18,262) before the days were counted by month kind."""
    work = _Work(monkeypatch)
    grid = CronGrid("30 9 * * 1-5", pendulum.timezone("Europe/Berlin"))
    start, end = pendulum.datetime(1975, 1, 1, tz="UTC"), pendulum.datetime(2025, 1, 1, tz="UTC")
    grid.count_between(start, end)
    work.reset()
    # 09:30 is never skipped nor doubled in Berlin: one slot per weekday.
    days = (end.date() - start.date()).days
    weekdays = sum(1 for n in range(days) if (start.date() + datetime.timedelta(days=n)).weekday() < 5)
    assert grid.count_between(start, end) == weekdays
    assert work.croniter_work == 0
