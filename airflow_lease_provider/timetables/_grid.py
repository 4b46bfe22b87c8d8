"""The slot grids behind :class:`~airflow_lease_provider.timetables.CappedCatchupTimetable`.

A *grid* is the set of instants at which a schedule fires. The timetable only ever asks four
questions of it (the newest slot at or before an instant, the oldest at or after, the next, the
previous), plus one for the skipped-slot record: how many slots lie strictly between two instants.

Cron grids reuse Airflow's own ``CronMixin`` for stepping, so daylight-saving behaviour is exactly
the core timetables' (fold hours, missing hours). Counting does **not** step through the slots: a
year of per-minute slots is counted day by day in local wall-clock time, and only the few hours
around a daylight-saving transition are stepped through, so the answer still matches stepping.
"""

from __future__ import annotations

import calendar
import datetime
from typing import TYPE_CHECKING, Protocol

import pendulum
from croniter import croniter

from airflow_lease_provider.version_compat import CronMixin, convert_to_utc, make_aware, make_naive

if TYPE_CHECKING:
    from pendulum import DateTime
    from pendulum.tz.timezone import FixedTimezone, Timezone

# pendulum's own UTC: pendulum arithmetic on a DateTime carrying the stdlib ``timezone.utc`` drops it.
_UTC = pendulum.UTC
_EPOCH = pendulum.datetime(1970, 1, 1, tz=_UTC)
_ONE_DAY = datetime.timedelta(days=1)
# Wall-clock times within this distance of a UTC-offset change can be missing or doubled; slots there
# are stepped through with Airflow's own logic instead of counted. Three hours covers every real
# offset change (the largest, Antarctica/Troll, is two hours).
_TRANSITION_MARGIN = datetime.timedelta(hours=3)


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


class CronGrid(CronMixin):
    """Slots of a cron expression in a timezone, stepped exactly like Airflow's cron timetables.

    ``CronMixin`` (and the timezone helpers it uses) are this package's private Airflow imports: they
    carry the DST fixes of the core cron timetables, and re-deriving them would make our slots drift
    from Airflow's on the two days a year that matter.

    :param expression: a cron expression or an Airflow preset such as ``@hourly`` (already validated).
    :param timezone: the timezone the expression is read in.
    """

    def __init__(self, expression: str, timezone: Timezone | FixedTimezone) -> None:
        super().__init__(expression, timezone)
        self._fields = croniter(self._expression).expanded
        # Day of month, month and day of week all "*": every day has the same slots (counted by arithmetic).
        self._every_day = len(self._fields) == 5 and all(field == ["*"] for field in self._fields[2:])
        self._fixed_offset = isinstance(timezone, pendulum.FixedTimezone) or getattr(timezone, "name", "") in (
            "UTC",
            "Etc/UTC",
        )
        # The slot before the one the last walk back returned (back_from), so that its data interval
        # (whose start is the slot before it) costs no croniter construction of its own.
        self._previous: dict[DateTime, DateTime] = {}
        # A croniter iterator left at the slot the last at_or_before returned, for the walk back from
        # it (UTC and fixed offsets only): taken by the first walk that starts there, used once.
        self._positioned: tuple[DateTime, croniter] | None = None

    @property
    def expression(self) -> str:
        """The expression with Airflow presets expanded (``@hourly`` becomes ``0 * * * *``)."""
        return self._expression

    def at_or_before(self, moment: DateTime) -> DateTime:
        if not self._fixed_offset or len(self._fields) != 5:
            return self._align_to_prev(moment)
        # At a fixed UTC offset Airflow's _align_to_prev is the wall-clock answer: for a moment that
        # cannot be a slot (seconds past the minute), croniter's previous. One croniter, kept for a walk
        # back from that slot.
        offset = self._offset(moment)
        assert offset is not None
        zone = datetime.timezone(offset)
        local = moment.astimezone(zone).replace(tzinfo=None)
        if local.second == 0 and local.microsecond == 0:
            return self._align_to_prev(moment)  # possibly a slot itself: Airflow's own check
        iterator = croniter(self._expression, start_time=local)
        slot = from_epoch_us(epoch_us(iterator.get_prev(datetime.datetime).replace(tzinfo=zone)))
        self._positioned = (slot, iterator)
        return slot

    def at_or_after(self, moment: DateTime) -> DateTime:
        return self._align_to_next(moment)

    def after(self, moment: DateTime) -> DateTime:
        return self._get_next(moment)

    def before(self, moment: DateTime) -> DateTime:
        known = self._previous.get(moment)
        if known is not None:
            return known
        previous = self._get_prev(moment)
        if previous < moment:
            return previous
        # Airflow only ever steps forward, where a wall-clock slot inside a spring-forward gap is moved
        # forward (02:30 becomes 03:30). Stepping back from that moved slot, croniter names the same
        # 02:30 again; keep asking for earlier wall-clock times until one lies before ``moment``.
        iterator = croniter(self._expression, start_time=make_naive(moment, self._timezone))
        while True:
            candidate = iterator.get_prev(datetime.datetime)
            previous = convert_to_utc(make_aware(candidate, self._timezone))
            if previous < moment:
                return previous

    def back_from(self, slot: DateTime, steps: int, stop: DateTime) -> DateTime:
        """Walk back with one croniter iterator in wall-clock time where the UTC offset cannot change.

        One croniter construction for the whole walk instead of one per step (Airflow's ``_get_prev``
        builds one per call): this keeps a capped catch-up near the cost of latest-only. Near a change
        of UTC offset the walk steps with Airflow's own DST-fixed logic (:meth:`before`) instead.
        """
        if steps <= 0 or slot <= stop:
            return slot
        if len(self._fields) == 5:
            walked = self._walk_back(slot, steps, stop)
            if walked is not None:
                return walked
        for _ in range(steps):
            if slot <= stop:
                break
            slot = self.before(slot)
        return slot

    def _walk_back(self, slot: DateTime, steps: int, stop: DateTime) -> DateTime | None:
        """:meth:`back_from` on one iterator, or None when the UTC offset changes within the walk."""
        offset = self._offset(slot)
        if offset is None:
            return None
        zone = datetime.timezone(offset)
        stop_local = stop.astimezone(zone).replace(tzinfo=None)
        oldest = slot.astimezone(zone).replace(tzinfo=None)  # wall-clock time, at the constant offset
        positioned, self._positioned = self._positioned, None
        if positioned is not None and positioned[0] == slot:
            iterator = positioned[1]  # at_or_before left it at this slot
        else:
            iterator = croniter(self._expression, start_time=oldest)
        for _ in range(steps):
            if oldest <= stop_local:
                break
            oldest = iterator.get_prev(datetime.datetime)
        before_oldest = iterator.get_prev(datetime.datetime)  # the start of the oldest one's interval
        # Only the two slots the caller uses become UTC DateTimes (pendulum arithmetic is the slow part).
        found, previous = (from_epoch_us(epoch_us(m.replace(tzinfo=zone))) for m in (oldest, before_oldest))
        if not self._fixed_offset and (
            self._offset(previous) != offset or self._transition_windows(previous, slot)
        ):
            return None  # an offset change inside the walk: Airflow's stepping decides those slots
        self._previous = {found: previous}
        return found

    def count_between(self, start: DateTime, end: DateTime) -> int:
        if end <= start:
            return 0
        total = self._count_up_to(start, end)
        if self.at_or_before(end) == end:
            total -= 1  # _count_up_to includes ``end`` itself
        return total

    def count_cost(self, start: DateTime, end: DateTime, limit: int) -> int:
        if len(self._fields) != 5:
            return limit  # counted by stepping
        # One croniter call per day spanned (none where every day matches), two to test the end; checked
        # before the (pricier) scan for offset changes, which are stepped through and so priced at the limit.
        cost = 3 if self._every_day else (end.date() - start.date()).days + 3
        if cost >= limit or self._transition_windows(start, end):
            return limit
        return cost

    # -- counting -------------------------------------------------------------------------------------

    def _count_up_to(self, start: DateTime, end: DateTime) -> int:
        """Slots in ``(start, end]``: wall-clock arithmetic away from offset changes, stepping near them."""
        if len(self._fields) != 5:
            # Seconds or years fields: rare in Airflow; count by stepping (O(slots), documented).
            return self._step_count(start, end)
        total = 0
        cursor = start
        for low, high in self._transition_windows(start, end):
            total += self._wall_clock_count(cursor, low)
            total += self._step_count(low, high)
            cursor = high
        return total + self._wall_clock_count(cursor, end)

    def _step_count(self, start: DateTime, end: DateTime) -> int:
        count = 0
        slot = self.after(start)
        while slot <= end:
            count += 1
            slot = self.after(slot)
        return count

    def _offset(self, moment: DateTime) -> datetime.timedelta | None:
        return moment.in_timezone(self._timezone).utcoffset()

    def _transition_windows(self, start: DateTime, end: DateTime) -> list[tuple[DateTime, DateTime]]:
        """UTC ranges around each offset change in ``(start, end]``, widened by the margin and merged."""
        if self._fixed_offset:
            return []  # UTC, Etc/UTC or a fixed offset: no day to look at
        windows: list[tuple[DateTime, DateTime]] = []
        low, low_offset = start, self._offset(start)
        while low < end:
            high = min(low + _ONE_DAY, end)
            high_offset = self._offset(high)
            if high_offset != low_offset:
                # Bisect to the second; offsets change at most once a day anywhere on Earth.
                before, after = low, high
                while after - before > datetime.timedelta(seconds=1):
                    middle = before + (after - before) / 2
                    if self._offset(middle) == low_offset:
                        before = middle
                    else:
                        after = middle
                window = (max(start, after - _TRANSITION_MARGIN), min(end, after + _TRANSITION_MARGIN))
                if windows and window[0] <= windows[-1][1]:
                    windows[-1] = (windows[-1][0], window[1])
                else:
                    windows.append(window)
            low, low_offset = high, high_offset
        return windows

    def _wall_clock_count(self, start: DateTime, end: DateTime) -> int:
        """Slots in ``(start, end]`` where the UTC offset is constant: count matching wall-clock minutes."""
        if end <= start:
            return 0
        first = start.in_timezone(self._timezone).naive()
        last = end.in_timezone(self._timezone).naive()
        minutes, hours = self._fields[0], self._fields[1]
        minute_list = list(range(60)) if minutes == ["*"] else [int(m) for m in minutes]
        hour_list = list(range(24)) if hours == ["*"] else [int(h) for h in hours]
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
