"""The slot grids behind :class:`~airflow_lease_provider.timetables.CappedCatchupTimetable`.

A *grid* is the set of instants at which a schedule fires. The timetable only ever asks four
questions of it (the newest slot at or before an instant, the oldest at or after, the next, the
previous), plus one for the skipped-slot record: how many slots lie strictly between two instants.

A cron grid is one set of instants, defined from croniter's naive wall-clock matches and three rules
for the times a zone's clock skips or repeats (:class:`CronGrid`); every question is answered from that
set, so the answers agree with each other across daylight-saving changes. Nothing steps through the
slots of a five-field expression: inside each stretch of constant UTC offset, counting slots and finding
the n-th slot back are calendar arithmetic on wall-clock time (whole years, a bisect into the month, the
day and its times), and whole UTC years are skipped by their cached counts; no answer costs more with a
longer gap or a larger ``max_backfill`` (issue 28).
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
from airflow.timetables.trigger import CronTriggerTimetable
from croniter import croniter

from airflow_lease_provider.version_compat import cron_presets

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
        """About how many croniter calls :meth:`count_between` needs, or ``limit`` if at least that many
        (or if counting is no cheaper than :meth:`back_from` ``limit`` steps, which then answers)."""
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
    #: The segment cut into ascending pieces: ``(low, high)`` ranges whose real slots all count (the
    #: segment less its dropped ranges, split at the gap run), and ``(gap_run, None)`` for the gap run.
    pieces: tuple[tuple[datetime.datetime, datetime.datetime | None], ...]


def _offset(key: str, moment: datetime.datetime) -> datetime.timedelta:
    """The UTC offset of zone ``key`` at ``moment`` (naive UTC)."""
    return _offset_at_second(zoneinfo.ZoneInfo(key), calendar.timegm(moment.timetuple()))


def _offset_at_second(zone: zoneinfo.ZoneInfo, second: int) -> datetime.timedelta:
    offset = datetime.datetime.fromtimestamp(second, zone).utcoffset()
    assert offset is not None
    return offset


@functools.lru_cache(maxsize=4096)
def _transitions(key: str, year: int) -> tuple[_Transition, ...]:
    """The offset changes of zone ``key`` in ``(1 January year, 1 January year + 1]`` UTC.

    Found by looking at the offset once a day and bisecting to the second where it differs (no zone
    changes its offset twice within a day); about 400 offset look-ups per zone and year (about 1 ms),
    cached.
    """
    zone = zoneinfo.ZoneInfo(key)
    low = calendar.timegm((year, 1, 1, 0, 0, 0))
    end = calendar.timegm((year + 1, 1, 1, 0, 0, 0))
    found: list[_Transition] = []
    before = _offset_at_second(zone, low)
    while low < end:
        high = min(low + 86_400, end)
        after = _offset_at_second(zone, high)
        if after != before:
            a, b = low, high
            while b - a > 1:
                middle = (a + b) // 2
                if _offset_at_second(zone, middle) == before:
                    a = middle
                else:
                    b = middle
            at = datetime.datetime(1970, 1, 1) + datetime.timedelta(seconds=b)
            found.append(_Transition(at, before, after))
        low, before = high, after
    return tuple(found)


# -- calendar arithmetic for five-field expressions ----------------------------------------------------
#
# In a five-field expression the times of day (hour x minute) are the same on every matching day, and
# whether a day matches depends only on its month, the month's length and the weekday of its first day
# (day of month, month, day of week, ``L``, ``W``, ``#``). So the matching days of one such "month kind"
# are computed once (84 kinds at most, cached per set of day fields), and counting the wall-clock matches
# of any range, or finding the n-th match back from an instant, is arithmetic on whole years, months and
# days plus a bisect inside the first and last day: no croniter stepping, however long the range.

_MINUTE_US = 60_000_000


class _Year(NamedTuple):
    """The matching days of one kind of year (leap or not, weekday of 1 January)."""

    #: ``months[m]``: the matching days of month ``m`` (1 to 12), ascending; ``months[0]`` is empty.
    months: tuple[tuple[int, ...], ...]
    #: ``before[m]``: matching days in the months before month ``m`` (1 to 13); ``before[13]`` is the year's.
    before: tuple[int, ...]


_YEAR_KINDS: dict[int, tuple[bool, int]] = {}
_YEARS: dict[tuple[str, bool, int], _Year] = {}
_MONTHS: dict[tuple[str, int, int, int], tuple[int, ...]] = {}


class _Days:
    """The matching days of a five-field expression's day fields (day of month, month, day of week).

    Whether a day matches depends only on its month, the month's length and the weekday of its first day;
    so a year's matching days depend only on whether it is a leap year and the weekday of its 1 January:
    14 kinds of year, each computed once per set of day fields (module caches, shared by every grid).
    """

    def __init__(self, expression: str, fields: list[list[int | str]], exotic: bool) -> None:
        self._day_fields = " ".join(expression.split()[2:5])
        dom, months, dow = fields[2], fields[3], fields[4]
        self._exotic = exotic  # "#" or "W": matching days asked of croniter itself, per month kind
        self._months = None if months == ["*"] else frozenset(int(m) for m in months)
        self._dom = None if dom == ["*"] else frozenset(d for d in dom if d != "l")
        self._dom_last = "l" in dom
        self._dow = None if dow == ["*"] else frozenset(int(d) % 7 for d in dow)

    def year(self, year: int) -> _Year:
        kind = _YEAR_KINDS.get(year)
        if kind is None:
            kind = _YEAR_KINDS[year] = (calendar.isleap(year), datetime.date(year, 1, 1).weekday())
        key = (self._day_fields, *kind)
        found = _YEARS.get(key)
        if found is None:
            if len(_YEARS) > 20_000:
                _YEARS.clear()
                _MONTHS.clear()
            months: list[tuple[int, ...]] = [()]
            before = [0, 0]
            for month in range(1, 13):
                first_weekday, length = calendar.monthrange(year, month)
                month_key = (self._day_fields, month, length, first_weekday)
                days = _MONTHS.get(month_key)
                if days is None:
                    days = _MONTHS[month_key] = self._compute(year, month, length, first_weekday)
                months.append(days)
                before.append(before[-1] + len(days))
            found = _YEARS[key] = _Year(tuple(months), tuple(before))
        return found

    def _compute(self, year: int, month: int, length: int, first_weekday: int) -> tuple[int, ...]:
        if self._months is not None and month not in self._months:
            return ()
        if self._exotic:
            return self._from_croniter(year, month)
        dom, dow = self._dom, self._dow
        days = []
        for day in range(1, length + 1):
            by_dom = dom is None or day in dom or (self._dom_last and day == length)
            # calendar's weekdays count from Monday = 0; cron's from Sunday = 0.
            by_dow = dow is None or (first_weekday + day) % 7 in dow
            # croniter: both fields restricted is a union (day_or); otherwise the restricted one alone.
            if (by_dom or by_dow) if dom is not None and dow is not None else (by_dom and by_dow):
                days.append(day)
        return tuple(days)

    def _from_croniter(self, year: int, month: int) -> tuple[int, ...]:
        iterator = croniter(f"0 0 {self._day_fields}", start_time=datetime.datetime(year, month, 1) - _SECOND)
        days: list[int] = []
        while True:
            found = iterator.get_next(datetime.datetime)
            if found.year != year or found.month != month:
                return tuple(days)
            days.append(found.day)

    def matches(self, day: datetime.date) -> bool:
        return day.day in self.year(day.year).months[day.month]

    def year_count(self, year: int) -> int:
        """How many days of ``year`` match."""
        return self.year(year).before[13]

    def before_in_year(self, day: datetime.date) -> int:
        """Matching days of ``day``'s year strictly before ``day``."""
        table = self.year(day.year)
        return table.before[day.month] + bisect.bisect_left(table.months[day.month], day.day)

    def count(self, low: datetime.date, high: datetime.date) -> int:
        """Matching days in ``[low, high)``."""
        if high <= low:
            return 0
        total = self.before_in_year(high) - self.before_in_year(low)
        for year in range(low.year, high.year):
            total += self.year_count(year)
        return total

    def _locate(self, year: int, index: int) -> datetime.date:
        """The ``index``-th (from 0) matching day of ``year``."""
        table = self.year(year)
        month = bisect.bisect_right(table.before, index, 1, 14) - 1
        return datetime.date(year, month, table.months[month][index - table.before[month]])

    def nth_before(self, day: datetime.date, n: int, floor: int) -> datetime.date | None:
        """The ``n``-th (n >= 1) matching day strictly before ``day``, or None before year ``floor``."""
        year = day.year
        earlier = self.before_in_year(day)
        while n > earlier:
            n -= earlier
            year -= 1
            if year < floor:
                return None
            earlier = self.year_count(year)
        return self._locate(year, earlier - n)

    def first_from(self, day: datetime.date, ceiling: int) -> datetime.date | None:
        """The first matching day at or after ``day``, or None after year ``ceiling``."""
        year = day.year
        index = self.before_in_year(day)
        while index >= self.year_count(year):
            year, index = year + 1, 0
            if year > ceiling:
                return None
        return self._locate(year, index)


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


@functools.lru_cache(maxsize=256)
def _parsed(expression: str) -> croniter:
    """The expression parsed by croniter once (a template: walks copy it)."""
    return croniter(expression)


@functools.lru_cache(maxsize=256)
def _description(expression: str) -> str:
    """Airflow's description of the expression, as its cron timetables give it in the UI (cron_descriptor,
    with Airflow's day-of-month-or-week wording), once per expression."""
    return CronTriggerTimetable(expression, timezone="UTC").description


class _GridState(NamedTuple):
    segments: dict[datetime.datetime, _Segment]
    layouts: dict[int, tuple[list[datetime.datetime], tuple[_Transition, ...]]]
    gap_runs: dict[_Transition, datetime.datetime | None]
    year_slots: dict[int, int]


_GRID_STATE: dict[tuple[str, str], _GridState] = {}


class CronGrid:
    """Slots of a cron expression in a timezone: one well-defined set of instants, across every offset change.

    The slots are croniter's wall-clock matches (naive, exact) read in the zone, with three rules where the
    zone's clock is not one-to-one (``docs/timetable.md``, "Daylight saving"):

    * a wall-clock time that exists once is that instant;
    * a wall-clock time that exists twice (a fall-back fold) is its later instant, or both for a schedule
      that fires every hour (hour field ``*``): Airflow's own rule (its cron timetables, ``make_aware(fold=1)``);
    * the wall-clock times a spring-forward gap skips run once, together, at the first of them moved forward
      by the gap (``02:30`` becomes ``03:30``, as Airflow moves it), unless a real slot after the gap comes
      first or at the same time, which then stands for them (never a slot after a real slot it would skip).

    The timeline is cut into *segments* of constant UTC offset (at each offset change and at every 1 January
    UTC), and each segment into *pieces*: ranges whose real slots all count (less the earlier half of a
    fold) and the gap run. For a five-field expression every question is calendar arithmetic on a piece's
    wall-clock range (:class:`_Days`: whole years, months and days, a bisect inside the first and last
    day), so a count, or the n-th slot back from an instant, costs a few operations per segment crossed and
    none per slot. Expressions with a seconds or year field are stepped with croniter. Every question is
    answered from that one set, so :meth:`at_or_before` never returns a slot after its argument and
    ``after``/``before`` are each other's inverse.

    :param expression: a cron expression or an Airflow preset such as ``@hourly`` (already validated).
    :param timezone: the timezone the expression is read in.
    """

    def __init__(self, expression: str, timezone: Timezone | FixedTimezone) -> None:
        # Airflow's cron timetables parse the expression and describe it (cron_descriptor) when made: both cached
        # per expression here, as a scheduler builds the timetable again for each DAG it deserializes.
        self._expression = cron_presets.get(expression, expression)
        self._timezone = timezone
        self.description = _description(self._expression)
        # Parsed once per expression; each walk copies the template.
        self._template = copy.copy(_parsed(self._expression))
        self._fields = self._template.expanded
        # Five fields: the times of day are the same on every matching day (calendar arithmetic).
        self._arithmetic = len(self._fields) == 5
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
        minute_list = range(60) if minutes == ["*"] else [int(m) for m in minutes]
        hour_list = range(24) if hours == ["*"] else [int(h) for h in hours]
        #: The matching minutes of a matching day, ascending (five-field expressions).
        self._times = sorted({hour * 60 + minute for hour in hour_list for minute in minute_list})
        exotic = bool(self._template.nth_weekday_of_month or self._template.nearest_weekday)
        self._days = _Days(self._expression, self._fields, exotic) if self._arithmetic else None
        # The segments, the year layouts, the gap runs and the slots per UTC year depend only on the
        # expression and the zone: shared by every grid of the same pair (module state, bounded).
        key = (self._expression, self._zone_key or str(self._fixed))
        state = _GRID_STATE.get(key)
        if state is None:
            if len(_GRID_STATE) > 256:
                _GRID_STATE.clear()
            state = _GRID_STATE[key] = _GridState({}, {}, {}, {})
        self._segments = state.segments
        self._layouts = state.layouts
        self._gap_runs = state.gap_runs
        self._year_slots = state.year_slots

    @property
    def expression(self) -> str:
        """The expression with Airflow presets expanded (``@hourly`` becomes ``0 * * * *``)."""
        return self._expression

    # -- the four questions, on naive UTC datetimes inside --------------------------------------------------

    def at_or_before(self, moment: DateTime) -> DateTime:
        return _aware(self._newest_before(_naive_utc(moment) + _TICK))

    def at_or_after(self, moment: DateTime) -> DateTime:
        return _aware(self._oldest_from(_naive_utc(moment)))

    def after(self, moment: DateTime) -> DateTime:
        return _aware(self._oldest_from(_naive_utc(moment) + _TICK))

    def before(self, moment: DateTime) -> DateTime:
        return _aware(self._newest_before(_naive_utc(moment)))

    def back_from(self, slot: DateTime, steps: int, stop: DateTime) -> DateTime:
        """``steps`` slots back: arithmetic per segment crossed (five fields), else one iterator per segment."""
        if steps <= 0 or slot <= stop:
            return slot
        stop_utc = _naive_utc(stop)
        found = _naive_utc(slot)
        if self._arithmetic:
            # The walk back stops at ``stop``'s segment: never more segments than the range spans.
            nth = self._nth_before(found, steps, floor=stop_utc)
            if nth is not None and nth > stop_utc:
                return _aware(nth)
            newest_by_stop = self._newest_before(stop_utc + _TICK)
            return _aware(newest_by_stop if nth is None else max(nth, newest_by_stop))
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
        if not self._arithmetic:
            # Seconds or years fields: rare in Airflow; counted by stepping (O(slots), documented).
            count = 0
            for slot in self._forward(low):
                if slot >= high:
                    return count
                count += 1
        return self._count(low + _TICK, high)

    def count_cost(self, start: DateTime, end: DateTime, limit: int) -> int:
        # Five fields: back_from is arithmetic too and stops at whichever comes first, the n-th slot or
        # ``stop``, so it never costs more than counting the whole range: say "step back".
        return limit

    # -- arithmetic on wall-clock time (five fields) -------------------------------------------------------

    @staticmethod
    def _split(wall: datetime.datetime) -> tuple[datetime.date, int]:
        """``wall``'s date, and the first whole minute of that day at or after ``wall`` (0 to 1440)."""
        micros = (wall.hour * 3600 + wall.minute * 60 + wall.second) * 1_000_000 + wall.microsecond
        return wall.date(), -(-micros // _MINUTE_US)

    def _matches(self, day: datetime.date) -> bool:
        assert self._days is not None
        return self._days.matches(day)

    def _wall_range(self, low: datetime.datetime, high: datetime.datetime) -> int:
        """Wall-clock matches in ``[low, high)`` (naive)."""
        if high <= low:
            return 0
        assert self._days is not None
        times = self._times
        first, start = self._split(low)
        last, stop = self._split(high)
        if first == last:
            if not self._matches(first):
                return 0
            return max(0, bisect.bisect_left(times, stop) - bisect.bisect_left(times, start))
        total = self._days.count(first + _ONE_DAY, last) * len(times)
        if self._matches(first):
            total += len(times) - bisect.bisect_left(times, start)
        if self._matches(last):
            total += bisect.bisect_left(times, stop)
        return total

    def _wall_nth_before(self, high: datetime.datetime, n: int, floor: int) -> datetime.datetime | None:
        """The ``n``-th (n >= 1) wall-clock match strictly before ``high``, or None before year ``floor``."""
        assert self._days is not None
        times = self._times
        day, stop = self._split(high)
        if self._matches(day):
            earlier = bisect.bisect_left(times, stop)
            if n <= earlier:
                return datetime.datetime.combine(day, datetime.time()) + datetime.timedelta(
                    minutes=times[earlier - n]
                )
            n -= earlier
        per_day = len(times)
        days_back = -(-n // per_day)
        found = self._days.nth_before(day, days_back, floor)
        if found is None:
            return None
        index = per_day - (n - (days_back - 1) * per_day)
        return datetime.datetime.combine(found, datetime.time()) + datetime.timedelta(minutes=times[index])

    def _wall_first_from(self, low: datetime.datetime, ceiling: int) -> datetime.datetime | None:
        """The first wall-clock match at or after ``low``, or None after year ``ceiling``."""
        assert self._days is not None
        times = self._times
        day, start = self._split(low)
        if self._matches(day):
            index = bisect.bisect_left(times, start)
            if index < len(times):
                return datetime.datetime.combine(day, datetime.time()) + datetime.timedelta(
                    minutes=times[index]
                )
        found = self._days.first_from(day + _ONE_DAY, ceiling)
        if found is None:
            return None
        return datetime.datetime.combine(found, datetime.time()) + datetime.timedelta(minutes=times[0])

    # -- arithmetic on slots (naive UTC; five fields) ------------------------------------------------------

    def _count(self, low: datetime.datetime, high: datetime.datetime, whole_years: bool = True) -> int:
        """Slots in ``[low, high)``; a whole UTC year inside the range from the per-year cache."""
        total = 0
        segment = self._segment_at(low)
        while segment.start < high:
            year = segment.start.year
            if (
                whole_years
                and segment.start >= low
                and segment.start == datetime.datetime(year, 1, 1)
                and high >= datetime.datetime(year + 1, 1, 1)
            ):
                total += self._slots_in_year(year)
                segment = self._segment_at(datetime.datetime(year + 1, 1, 1))
                continue
            offset = segment.offset
            for a, b in segment.pieces:
                if b is None:
                    total += low <= a < high
                elif a < high and b > low:
                    total += self._wall_range(max(a, low) + offset, min(b, high) + offset)
            segment = self._segment_at(segment.end)
        return total

    def _nth_before(
        self, high: datetime.datetime, n: int, floor: datetime.datetime | None = None
    ) -> datetime.datetime | None:
        """The ``n``-th (n >= 1) slot strictly before ``high``; None once the walk passes ``floor``.

        Without ``floor`` the walk gives up a century back (croniter's own limit is 50 years between
        matches; every accepted expression fires within that).
        """
        if floor is None:
            floor = datetime.datetime(max(high.year - 100, 1), 1, 1)
        segment = self._segment_at(high - _TICK)
        while segment.end > floor:
            year = segment.end.year - 1
            if (
                segment.end <= high
                and segment.end == datetime.datetime(year + 1, 1, 1)
                and datetime.datetime(year, 1, 1) >= floor
                and n > (in_year := self._slots_in_year(year))
            ):
                # All of UTC year ``year`` lies between: skipped at once (its count is cached).
                n -= in_year
                if year <= 1:
                    return None
                segment = self._segment_at(datetime.datetime(year, 1, 1) - _TICK)
                continue
            offset = segment.offset
            for a, b in reversed(segment.pieces):
                if a >= high:
                    continue
                if b is None:
                    if n == 1:
                        return a
                    n -= 1
                    continue
                top = min(b, high)
                count = self._wall_range(a + offset, top + offset)
                if n <= count:
                    found = self._wall_nth_before(top + offset, n, a.year - 1)
                    assert found is not None
                    return found - offset
                n -= count
            if segment.start.year <= 1:
                return None
            segment = self._segment_at(segment.start - _TICK)
        return None

    def _slots_in_year(self, year: int) -> int:
        """Slots in UTC year ``year``, counted once per expression and zone."""
        found = self._year_slots.get(year)
        if found is None:
            if len(self._year_slots) > 4_096:
                self._year_slots.clear()
            start, end = datetime.datetime(year, 1, 1), datetime.datetime(year + 1, 1, 1)
            found = self._year_slots[year] = self._count(start, end, whole_years=False)
        return found

    def _oldest_from(self, low: datetime.datetime) -> datetime.datetime:
        """The oldest slot at or after ``low`` (naive UTC)."""
        if not self._arithmetic:
            return next(self._forward(low - _TICK))
        ceiling = low.year + 100
        segment = self._segment_at(low)
        while segment.start.year <= ceiling:
            offset = segment.offset
            for a, b in segment.pieces:
                if b is None:
                    if a >= low:
                        return a
                elif b > low:
                    found = self._wall_first_from(max(a, low) + offset, b.year + 1)
                    if found is not None and found - offset < b:
                        return found - offset
            segment = self._segment_at(segment.end)
        raise AssertionError(f"{self._expression!r} has no slot within a century after {low}")

    def _newest_before(self, high: datetime.datetime) -> datetime.datetime:
        """The newest slot strictly before ``high`` (naive UTC)."""
        if not self._arithmetic:
            return next(self._backward(high))
        found = self._nth_before(high, 1)
        if found is None:
            raise AssertionError(f"{self._expression!r} has no slot within a century before {high}")
        return found

    # -- segments ----------------------------------------------------------------------------------------

    def _segment_at(self, moment: datetime.datetime) -> _Segment:
        """The segment of constant offset holding ``moment`` (naive UTC): ``start <= moment < end``."""
        layout = self._layouts.get(moment.year)
        if layout is None:
            layout = self._layout(moment.year)
        boundaries, transitions = layout
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
        pieces: list[tuple[datetime.datetime, datetime.datetime | None]] = []
        low = start
        for drop_low, drop_high in sorted(dropped):
            if drop_low > low:
                pieces.append((low, drop_low))
            low = max(low, drop_high)
        if low < end:
            pieces.append((low, end))
        if gap_run is not None:
            # Not a real slot (none lies between the change and it): the piece holding it is cut there.
            for index, (a, b) in enumerate(pieces):
                if b is not None and a <= gap_run < b:
                    pieces[index : index + 1] = [
                        *([(a, gap_run)] if a < gap_run else []),
                        (gap_run, None),
                        (gap_run + _TICK, b),
                    ]
                    break
            else:
                pieces.append((gap_run, None))
                pieces.sort(key=lambda piece: piece[0])
        segment = _Segment(start, end, offset, tuple(dropped), gap_run, tuple(pieces))
        if len(self._segments) > 512:
            self._segments.clear()
        self._segments[start] = segment
        return segment

    def _layout(self, year: int) -> tuple[list[datetime.datetime], tuple[_Transition, ...]]:
        """The segment boundaries of ``year`` (UTC) and the offset changes that may shape its segments."""
        year_start = datetime.datetime(year, 1, 1)
        boundaries = [year_start, datetime.datetime(year + 1, 1, 1)]
        transitions: tuple[_Transition, ...] = ()
        if self._zone_key is not None:
            # The year's changes, and its neighbours' (a gap run or a fold may reach across 1 January).
            transitions = tuple(t for y in (year - 1, year, year + 1) for t in _transitions(self._zone_key, y))
            boundaries += [t.at for t in transitions if year_start < t.at < boundaries[1]]
            boundaries.sort()
        if len(self._layouts) > 256:
            self._layouts.clear()
        self._layouts[year] = (boundaries, transitions)
        return boundaries, transitions

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
        """The first wall-clock match strictly after ``wall`` (naive)."""
        if self._arithmetic:
            found = self._wall_first_from(wall + _TICK, wall.year + 100)
            assert found is not None, (self._expression, wall)
            return found
        iterator = self._cron_at(wall.replace(microsecond=0))
        while True:
            found = iterator.get_next(datetime.datetime)
            if found > wall:
                return found

    def _cron_at(self, wall: datetime.datetime) -> croniter:
        """A croniter iterator of the expression positioned at ``wall`` (naive wall-clock time)."""
        iterator = copy.copy(self._template)
        iterator.set_current(wall, force=True)
        return iterator

    # -- walking with croniter (expressions with a seconds or year field) ----------------------------------

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
