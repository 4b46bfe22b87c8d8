"""A brute-force reference for the slots of a cron expression in a timezone, for the property tests.

It shares no code with :mod:`airflow_lease_provider.timetables._grid`: croniter enumerates the naive
wall-clock matches one by one, and the standard library's ``zoneinfo`` (``fold``) says which instants
show each wall-clock time. The rules (``docs/timetable.md``, "Daylight saving") then make instants of them:

* a wall-clock time shown once is that instant;
* a wall-clock time shown twice (a fall-back fold) is its later instant, or both for a schedule whose hour
  field is ``*`` (Airflow's rule);
* the wall-clock times a spring-forward gap skips run once, at the first of them moved forward by the gap
  (``fold=0``: read with the offset before the change), unless the first real slot after the gap comes
  first or at the same instant.
"""

from __future__ import annotations

import datetime
import zoneinfo
from collections.abc import Iterator

from croniter import croniter

UTC = datetime.timezone.utc


def _instants(wall: datetime.datetime, zone: datetime.tzinfo) -> list[datetime.datetime]:
    """The UTC instants whose wall-clock time in ``zone`` is ``wall`` (none in a gap, two in a fold)."""
    found = []
    for fold in (0, 1):
        instant = wall.replace(tzinfo=zone, fold=fold).astimezone(UTC)
        if instant.astimezone(zone).replace(tzinfo=None) == wall and instant not in found:
            found.append(instant)
    return sorted(found)


def _walls(expression: str, start: datetime.datetime, stop: datetime.datetime) -> Iterator[datetime.datetime]:
    """croniter's naive matches in ``(start, stop]``, ascending.

    Plain five-field expressions (numbers, ranges, steps, lists) are matched minute by minute against
    croniter's own parsed fields, far faster than one ``get_next`` per match; with both day fields
    restricted a day matches either (croniter's default ``day_or``, classic cron); anything else (``L``,
    ``W``, ``#``, ``?``) is croniter's ``get_next``.
    """
    fields = croniter(expression).expanded
    plain = len(fields) == 5 and not any(c in expression for c in "LW#?")
    if not plain:
        iterator = croniter(expression, start_time=start)
        while (wall := iterator.get_next(datetime.datetime)) <= stop:
            yield wall
        return
    minutes, hours, days, months, weekdays = (
        None if field == ["*"] else {int(v) % 7 if i == 4 else int(v) for v in field}
        for i, field in enumerate(fields)
    )
    day = start.date()
    while day <= stop.date():
        of_month = days is None or day.day in days
        of_week = weekdays is None or (day.weekday() + 1) % 7 in weekdays
        either = days is not None and weekdays is not None
        if (months is None or day.month in months) and ((of_month or of_week) if either else (of_month and of_week)):
            for hour in range(24) if hours is None else sorted(hours):
                for minute in range(60) if minutes is None else sorted(minutes):
                    wall = datetime.datetime.combine(day, datetime.time(hour, minute))
                    if start < wall <= stop:
                        yield wall
        day += datetime.timedelta(days=1)


def reference_slots(
    expression: str, zone_name: str | int, low: datetime.datetime, high: datetime.datetime
) -> list[datetime.datetime]:
    """Every slot in ``[low, high]`` (aware), ascending, as aware UTC datetimes."""
    zone: datetime.tzinfo
    if isinstance(zone_name, int):
        zone = datetime.timezone(datetime.timedelta(seconds=zone_name))
    else:
        zone = UTC if zone_name in ("UTC", "Etc/UTC") else zoneinfo.ZoneInfo(zone_name)
    every_hour = croniter(expression).expanded[1] == ["*"]
    # Wall-clock times a little wider than the range (offsets are within a day of UTC; a gap up to a day).
    start = low.astimezone(UTC).replace(tzinfo=None) - datetime.timedelta(days=2)
    stop = high.astimezone(UTC).replace(tzinfo=None) + datetime.timedelta(days=2)
    slots: list[datetime.datetime] = []
    gap_first: datetime.datetime | None = None  # the first missing wall-clock time of the current gap
    for wall in _walls(expression, start, stop):
        instants = _instants(wall, zone)
        if not instants:
            if gap_first is None:
                gap_first = wall
            continue
        if gap_first is not None:
            moved = gap_first.replace(tzinfo=zone, fold=0).astimezone(UTC)
            if moved < instants[0]:
                slots.append(moved)
            gap_first = None
        slots.extend(instants if every_hour else instants[-1:])
    return sorted(s for s in set(slots) if low <= s <= high)
