"""The slot grids behind :class:`~airflow_lease_provider.timetables.CappedCatchupTimetable`.

A *grid* is the set of instants at which a schedule fires. The timetable only ever asks four
questions of it (the newest slot at or before an instant, the oldest at or after, the next, the
previous), plus one for the skipped-slot record: how many slots lie strictly between two instants.

A cron grid is one set of instants, defined from croniter's naive wall-clock matches and three rules
for the times a zone's clock skips or repeats (:class:`CronGrid`); every question is answered from that
set, so the answers agree with each other across daylight-saving changes. Counting does **not** step
through the slots: inside each stretch of constant UTC offset, slots are counted by wall-clock
arithmetic (day by day, or in O(1) where every day matches).
"""

from __future__ import annotations

import bisect
import calendar
import copy
import datetime
import functools
import zoneinfo
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol

import pendulum
from croniter import croniter

from airflow_lease_provider.version_compat import CronMixin

if TYPE_CHECKING:
    from pendulum import DateTime
    from pendulum.tz.timezone import FixedTimezone, Timezone

# pendulum's own UTC: pendulum arithmetic on a DateTime carrying the stdlib ``timezone.utc`` drops it.
_UTC = pendulum.UTC
_EPOCH = pendulum.datetime(1970, 1, 1, tz=_UTC)
_ONE_DAY = datetime.timedelta(days=1)
_TICK = datetime.timedelta(microseconds=1)
_SECOND = datetime.timedelta(seconds=1)
_STD_UTC = datetime.timezone.utc


def epoch_us(moment: datetime.datetime) -> int:
    """Microseconds since the Unix epoch, exact (``timestamp()`` is a float and rounds)."""
    utc = moment.astimezone(_UTC)
    return calendar.timegm(utc.utctimetuple()) * 1_000_000 + utc.microsecond


def from_epoch_us(micros: int) -> DateTime:
    """The UTC instant ``micros`` microseconds after the Unix epoch, as a pendulum ``DateTime``."""
    return _EPOCH + datetime.timedelta(microseconds=micros)


def to_utc(moment: datetime.datetime) -> DateTime:
    """An aware instant as a pendulum ``DateTime`` in UTC (naive input is taken as UTC, like Airflow)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_UTC)
    return pendulum.instance(moment).in_timezone(_UTC)


class Grid(Protocol):
    """The instants at which a schedule fires. Every method returns an aware UTC ``DateTime``."""

    def at_or_before(self, moment: DateTime) -> DateTime:
        """The newest slot at or before ``moment``."""
        ...

    def at_or_after(self, moment: DateTime) -> DateTime:
        """The oldest slot at or after ``moment``."""
        ...

    def after(self, moment: DateTime) -> DateTime:
        """The oldest slot strictly after ``moment``."""
        ...

    def before(self, moment: DateTime) -> DateTime:
        """The newest slot strictly before ``moment``."""
        ...

    def back_from(self, slot: DateTime, steps: int, stop: DateTime) -> DateTime:
        """``slot`` moved back ``steps`` slots, but not past the first slot at or before ``stop``."""
        ...

    def count_between(self, start: DateTime, end: DateTime) -> int:
        """How many slots lie strictly between ``start`` and ``end``."""
        ...

    def count_cost(self, start: DateTime, end: DateTime, limit: int) -> int:
        """About how many croniter calls :meth:`count_between` needs, or ``limit`` if at least that many."""
        ...


class DeltaGrid:
    """Slots every ``delta``, on the lattice through ``anchor``: pure arithmetic, no stepping.

    :param delta: the fixed interval between slots (positive).
    :param anchor: any slot of the grid; the timetable passes the last run's slot, so a fixed-interval
        schedule keeps its phase across an outage.
    """

    def __init__(self, delta: datetime.timedelta, anchor: datetime.datetime | None = None) -> None:
        self._step = delta // datetime.timedelta(microseconds=1)
        self._anchor = epoch_us(anchor) if anchor is not None else 0

    def _index_floor(self, moment: datetime.datetime) -> int:
        return (epoch_us(moment) - self._anchor) // self._step

    def _slot(self, index: int) -> DateTime:
        return from_epoch_us(self._anchor + index * self._step)

    def at_or_before(self, moment: DateTime) -> DateTime:
        return self._slot(self._index_floor(moment))

    def at_or_after(self, moment: DateTime) -> DateTime:
        # Ceiling division on integers: exact for any length of outage.
        return self._slot(-((self._anchor - epoch_us(moment)) // self._step))

    def after(self, moment: DateTime) -> DateTime:
        return self._slot(self._index_floor(moment) + 1)

    def before(self, moment: DateTime) -> DateTime:
        return self._slot(-((self._anchor - epoch_us(moment)) // self._step) - 1)

    def back_from(self, slot: DateTime, steps: int, stop: DateTime) -> DateTime:
        index = self._index_floor(slot) - steps
        return self._slot(max(index, self._index_floor(stop)))

    def count_between(self, start: DateTime, end: DateTime) -> int:
        first = self._index_floor(start) + 1
        last = -((self._anchor - epoch_us(end)) // self._step) - 1
        return max(0, last - first + 1)

    def count_cost(self, start: DateTime, end: DateTime, limit: int) -> int:
        return 0


class _Transition(NamedTuple):
    """A change of UTC offset: at ``at`` (naive UTC) the offset goes from ``before`` to ``after``."""

    at: datetime.datetime
    before: datetime.timedelta
    after: datetime.timedelta


class _Segment(NamedTuple):
    """A stretch ``[start, end)`` (naive UTC) of constant UTC offset, and what DST changes make of it."""

    start: datetime.datetime
    end: datetime.datetime
    offset: datetime.timedelta
    #: ``[low, high)`` ranges whose wall-clock matches are not slots (the earlier half of a fold).
    dropped: tuple[tuple[datetime.datetime, datetime.datetime], ...]
    #: The one run standing for a spring-forward gap's missing slots, if it falls in this segment.
    gap_run: datetime.datetime | None


def _offset(key: str, moment: datetime.datetime) -> datetime.timedelta:
    """The UTC offset of zone ``key`` at ``moment`` (naive UTC)."""
    offset = moment.replace(tzinfo=_STD_UTC).astimezone(zoneinfo.ZoneInfo(key)).utcoffset()
    assert offset is not None
    return offset


@functools.lru_cache(maxsize=1024)
def _transitions(key: str, year: int) -> tuple[_Transition, ...]:
    """The offset changes of zone ``key`` in ``(1 January year, 1 January year + 1]`` UTC.

    Found by looking at the offset once a day and bisecting to the second where it differs (no zone
    changes its offset twice within a day); about 400 offset look-ups per zone and year, cached.
    """
    low = datetime.datetime(year, 1, 1)
    end = datetime.datetime(year + 1, 1, 1)
    found: list[_Transition] = []
    before = _offset(key, low)
    while low < end:
        high = min(low + _ONE_DAY, end)
        after = _offset(key, high)
        if after != before:
            a, b = low, high
            while b - a > datetime.timedelta(seconds=1):
                middle = a + (b - a) // 2
                middle = middle.replace(microsecond=0)
                if _offset(key, middle) == before:
                    a = middle
                else:
                    b = middle
            found.append(_Transition(b, before, after))
        low, before = high, after
    return tuple(found)


def _naive_utc(moment: datetime.datetime) -> datetime.datetime:
    """``moment`` as a naive UTC datetime (naive input is UTC already); no pendulum arithmetic."""
    naive = datetime.datetime(
        moment.year, moment.month, moment.day, moment.hour, moment.minute, moment.second, moment.microsecond
    )
    offset = moment.utcoffset()
    return naive if offset is None else naive - offset


def _aware(moment: datetime.datetime) -> DateTime:
    return pendulum.DateTime(
        moment.year,
        moment.month,
        moment.day,
        moment.hour,
        moment.minute,
        moment.second,
        moment.microsecond,
        tzinfo=_UTC,
    )


class CronGrid(CronMixin):
    """Slots of a cron expression in a timezone: one well-defined set of instants, across every offset change.

    The slots are croniter's wall-clock matches (naive, exact) read in the zone, with three rules where the
    zone's clock is not one-to-one (``docs/timetable.md``, "Daylight saving"):

    * a wall-clock time that exists once is that instant;
    * a wall-clock time that exists twice (a fall-back fold) is its later instant, or both for a schedule
      that fires every hour (hour field ``*``): Airflow's own rule (``CronMixin``, ``make_aware(fold=1)``);
    * the wall-clock times a spring-forward gap skips run once, together, at the first of them moved forward
      by the gap (``02:30`` becomes ``03:30``, as Airflow moves it), unless a real slot after the gap comes
      first or at the same time, which then stands for them (never a slot after a real slot it would skip).

    The timeline is cut into *segments* of constant UTC offset (at each offset change and at every 1 January
    UTC); inside one, slots are croniter's, stepped on one iterator and counted by wall-clock arithmetic.
    Every question is answered from that one set, so :meth:`at_or_before` never returns a slot after its
    argument and ``after``/``before`` are each other's inverse.

    :param expression: a cron expression or an Airflow preset such as ``@hourly`` (already validated).
    :param timezone: the timezone the expression is read in.
    """

    def __init__(self, expression: str, timezone: Timezone | FixedTimezone) -> None:
        super().__init__(expression, timezone)
        # Parsed once: each walk copies it (a copy is a quarter of the cost of parsing the expression again).
        self._template = croniter(self._expression)
        self._fields = self._template.expanded
        # Day of month, month and day of week all "*": every day has the same slots (counted by arithmetic).
        self._every_day = len(self._fields) == 5 and all(field == ["*"] for field in self._fields[2:])
        # Airflow's test (_covers_every_hour): such a schedule runs both instants of a fold hour.
        self._every_hour = self._fields[1] == ["*"]
        name = getattr(timezone, "name", "")
        self._zone_key: str | None = (
            None if isinstance(timezone, pendulum.FixedTimezone) or name in ("UTC", "Etc/UTC") else name
        )
        self._fixed = (
            timezone.utcoffset(None)
            if isinstance(timezone, pendulum.FixedTimezone)
            else datetime.timedelta(0)
        )
        minutes, hours = self._fields[0], self._fields[1]
        self._minute_list = list(range(60)) if minutes == ["*"] else [int(m) for m in minutes]
        self._hour_list = list(range(24)) if hours == ["*"] else [int(h) for h in hours]
        self._segments: dict[datetime.datetime, _Segment] = {}
        self._gap_runs: dict[_Transition, datetime.datetime | None] = {}

    @property
    def expression(self) -> str:
        """The expression with Airflow presets expanded (``@hourly`` becomes ``0 * * * *``)."""
        return self._expression

    # -- the four questions, on naive UTC datetimes inside --------------------------------------------------

    def at_or_before(self, moment: DateTime) -> DateTime:
        return _aware(next(self._backward(_naive_utc(moment) + _TICK)))

    def at_or_after(self, moment: DateTime) -> DateTime:
        return _aware(next(self._forward(_naive_utc(moment) - _TICK)))

    def after(self, moment: DateTime) -> DateTime:
        return _aware(next(self._forward(_naive_utc(moment))))

    def before(self, moment: DateTime) -> DateTime:
        return _aware(next(self._backward(_naive_utc(moment))))

    def back_from(self, slot: DateTime, steps: int, stop: DateTime) -> DateTime:
        """``steps`` slots back on one croniter iterator per segment of constant offset."""
        if steps <= 0 or slot <= stop:
            return slot
        stop_utc = _naive_utc(stop)
        found = _naive_utc(slot)
        walk = self._backward(found)
        for _ in range(steps):
            if found <= stop_utc:
                break
            found = next(walk)
        return _aware(found)

    def count_between(self, start: DateTime, end: DateTime) -> int:
        if end <= start:
            return 0
        low, high = _naive_utc(start), _naive_utc(end)
        if len(self._fields) != 5:
            # Seconds or years fields: rare in Airflow; counted by stepping (O(slots), documented).
            count = 0
            for slot in self._forward(low):
                if slot >= high:
                    return count
                count += 1
        total = 0
        segment = self._segment_at(low)
        while segment.start < high:
            # Real slots of the segment in (low, high), minus a dropped fold, plus its gap run.
            a, b = max(low, segment.start - _TICK), min(high, segment.end)
            total += self._wall_count(a, b, segment.offset)
            for drop_low, drop_high in segment.dropped:
                total -= self._wall_count(max(a, drop_low - _TICK), min(b, drop_high), segment.offset)
            if segment.gap_run is not None and low < segment.gap_run < high:
                total += 1
            segment = self._segment_at(segment.end)
        return total

    def count_cost(self, start: DateTime, end: DateTime, limit: int) -> int:
        if len(self._fields) != 5:
            return limit  # counted by stepping
        # One croniter call per day spanned (none where every day matches), a few per segment.
        years = end.year - start.year + 1
        cost = (3 if self._every_day else (end.date() - start.date()).days + 3) + 2 * years
        return min(cost, limit)

    # -- segments ----------------------------------------------------------------------------------------

    def _segment_at(self, moment: datetime.datetime) -> _Segment:
        """The segment of constant offset holding ``moment`` (naive UTC): ``start <= moment < end``."""
        year_start = datetime.datetime(moment.year, 1, 1)
        boundaries = [year_start, datetime.datetime(moment.year + 1, 1, 1)]
        transitions: tuple[_Transition, ...] = ()
        if self._zone_key is not None:
            # The year's changes, and its neighbours' (a gap run or a fold may reach across 1 January).
            transitions = tuple(
                t
                for year in (moment.year - 1, moment.year, moment.year + 1)
                for t in _transitions(self._zone_key, year)
            )
            boundaries += [t.at for t in transitions if year_start < t.at < boundaries[1]]
        boundaries.sort()
        index = bisect.bisect_right(boundaries, moment) - 1
        start, end = boundaries[index], boundaries[index + 1]
        cached = self._segments.get(start)
        if cached is not None and cached.end == end:
            return cached
        offset = self._offset_at(start)
        dropped: list[tuple[datetime.datetime, datetime.datetime]] = []
        gap_run = None
        for transition in transitions:
            if transition.before > transition.after and not self._every_hour:
                # A fold: the earlier instants of the doubled wall-clock times are not slots.
                fold = (transition.at - (transition.before - transition.after), transition.at)
                if fold[0] < end and fold[1] > start:
                    dropped.append((max(fold[0], start), min(fold[1], end)))
            elif (
                transition.before < transition.after
                and start <= transition.at + (transition.after - transition.before)
                and transition.at < end
            ):
                run = self._gap_run(transition)
                if run is not None and start <= run < end:
                    gap_run = run
        segment = _Segment(start, end, offset, tuple(dropped), gap_run)
        if len(self._segments) > 64:
            self._segments.clear()
        self._segments[start] = segment
        return segment

    def _offset_at(self, moment: datetime.datetime) -> datetime.timedelta:
        if self._zone_key is None:
            return self._fixed
        return _offset(self._zone_key, moment)

    def _gap_run(self, transition: _Transition) -> datetime.datetime | None:
        """The one run for the wall-clock times a spring-forward gap skips, or None (none, or merged)."""
        gap_low = transition.at + transition.before  # wall-clock, the first missing time
        gap_high = transition.at + transition.after  # wall-clock, the first time after the gap
        if transition in self._gap_runs:
            return self._gap_runs[transition]
        run: datetime.datetime | None = None
        first = self._wall_after(gap_low - _TICK)
        if first < gap_high:
            moved = (
                first - transition.before
            )  # the first missing slot moved forward by the gap, as an instant
            # A real slot after the gap that comes first (or at once) stands for them.
            if self._wall_after(gap_high - _TICK) - transition.after > moved:
                run = moved
        self._gap_runs[transition] = run
        return run

    def _wall_after(self, wall: datetime.datetime) -> datetime.datetime:
        """The first wall-clock match strictly after ``wall`` (naive): arithmetic where every day matches."""
        if not self._every_day:
            iterator = self._cron_at(wall.replace(microsecond=0))
            while True:
                found = iterator.get_next(datetime.datetime)
                if found > wall:
                    return found
        day = wall.date()
        for _ in range(2):
            for hour in self._hour_list:
                for minute in self._minute_list:
                    candidate = datetime.datetime.combine(day, datetime.time(hour, minute))
                    if candidate > wall:
                        return candidate
            day += _ONE_DAY
        raise AssertionError("an every-day schedule matches every day")

    def _cron_at(self, wall: datetime.datetime) -> croniter:
        """A croniter iterator of the expression positioned at ``wall`` (naive wall-clock time)."""
        iterator = copy.copy(self._template)
        iterator.set_current(wall, force=True)
        return iterator

    # -- walking -------------------------------------------------------------------------------------------

    def _forward(self, moment: datetime.datetime) -> Iterator[datetime.datetime]:
        """Slots strictly after ``moment`` (naive UTC), oldest first."""
        segment = self._segment_at(moment)
        low = moment
        while True:
            if segment.gap_run is not None and segment.gap_run > low:
                yield segment.gap_run
            offset = segment.offset
            low = max(low, segment.start - _TICK)
            # Slots are whole seconds: croniter (whose clock is a float) starts at a whole second.
            iterator = self._cron_at(low.replace(microsecond=0) + offset)
            while True:
                slot = iterator.get_next(datetime.datetime) - offset
                if slot >= segment.end:
                    break
                if slot > low and not any(a <= slot < b for a, b in segment.dropped):
                    yield slot
            segment = self._segment_at(segment.end)
            low = segment.start - _TICK

    def _backward(self, moment: datetime.datetime) -> Iterator[datetime.datetime]:
        """Slots strictly before ``moment`` (naive UTC), newest first."""
        segment = self._segment_at(moment - _TICK)
        high = moment
        while True:
            offset = segment.offset
            high = min(high, segment.end)
            ceiling = high if high.microsecond == 0 else high.replace(microsecond=0) + _SECOND
            iterator = self._cron_at(ceiling + offset)
            while True:
                slot = iterator.get_prev(datetime.datetime) - offset
                if slot < segment.start:
                    break
                if slot < high and not any(a <= slot < b for a, b in segment.dropped):
                    yield slot
            if segment.gap_run is not None and segment.gap_run < high:
                yield segment.gap_run
            high = segment.start
            segment = self._segment_at(segment.start - _TICK)

    # -- counting ------------------------------------------------------------------------------------------

    def _wall_count(self, low: datetime.datetime, high: datetime.datetime, offset: datetime.timedelta) -> int:
        """Wall-clock matches whose instant (at ``offset``) lies strictly between ``low`` and ``high``."""
        if high <= low:
            return 0
        return self._wall_clock_count(low + offset, high + offset - _TICK)

    def _wall_clock_count(self, first: datetime.datetime, last: datetime.datetime) -> int:
        """Matching naive wall-clock minutes in ``(first, last]``."""
        if last <= first:
            return 0
        minute_list, hour_list = self._minute_list, self._hour_list
        if self._every_day:
            # Every day matches (day of month, month and day of week are all "*"): the days strictly between
            # the first and the last day hold the same slots each, so only those two days are looked at.
            # O(1) however long the range, where the loop below makes one croniter call per day.
            if first.date() == last.date():
                return self._minutes_in_day(first.date(), hour_list, minute_list, first, last)
            whole_days = (last.date() - first.date()).days - 1
            return (
                self._minutes_in_day(first.date(), hour_list, minute_list, first, last)
                + whole_days * len(hour_list) * len(minute_list)
                + self._minutes_in_day(last.date(), hour_list, minute_list, first, last)
            )
        total = 0
        day = first.date()
        while day <= last.date():
            # croniter decides which days match (day-of-month OR day-of-week, L, #): one call jumps
            # straight to the next matching day, so sparse schedules cost one call per matching day.
            day_start = datetime.datetime.combine(day, datetime.time()) - datetime.timedelta(seconds=1)
            matching = croniter(self._expression, start_time=day_start).get_next(datetime.datetime)
            if matching.date() > last.date():
                break
            day = matching.date()
            total += self._minutes_in_day(day, hour_list, minute_list, first, last)
            day += _ONE_DAY
        return total

    @staticmethod
    def _minutes_in_day(
        day: datetime.date,
        hour_list: list[int],
        minute_list: list[int],
        first: datetime.datetime,
        last: datetime.datetime,
    ) -> int:
        """Matching (hour, minute) pairs of ``day`` in ``(first, last]``; naive wall-clock times."""
        if first.date() < day < last.date():
            return len(hour_list) * len(minute_list)
        count = 0
        for hour in hour_list:
            for minute in minute_list:
                moment = datetime.datetime.combine(day, datetime.time(hour, minute))
                if first < moment <= last:
                    count += 1
        return count
