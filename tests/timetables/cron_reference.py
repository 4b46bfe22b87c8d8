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
    iterator = croniter(expression, start_time=start)
    slots: list[datetime.datetime] = []
    gap_first: datetime.datetime | None = None  # the first missing wall-clock time of the current gap
    while True:
        wall = iterator.get_next(datetime.datetime)
        if wall > stop:
            break
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
