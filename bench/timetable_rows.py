"""Issue #28 item 2's three rows, standalone: one ``next_dagrun_info`` call of CappedCatchupTimetable
against Airflow's CronTriggerTimetable with the same last run, best of 5, in one process.

Run: ``.venv/bin/python bench/timetable_rows.py`` (with ``PYTHONPATH=<an old checkout>`` to measure that
one). Not part of ``python -m bench``. The timetable is built inside each timed call, as the scheduler
deserializes it, so no per-instance cache carries over between calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pendulum
from airflow.timetables.base import DataInterval, TimeRestriction
from airflow.timetables.trigger import CronTriggerTimetable

import airflow_lease_provider
from airflow_lease_provider.timetables import CappedCatchupTimetable, capped_catchup

CATCHUP = TimeRestriction(earliest=None, latest=None, catchup=True)
NOW = pendulum.datetime(2025, 6, 15, 12, 0, 30, tz="UTC")
ROWS = [
    ("0 * * * *", "Europe/Berlin", 10, 1000),
    ("30 9 * * 1-5", "Europe/Berlin", 10, 1000),
    ("*/5 * * * *", "UTC", 1, 1000),
]


def best(call: Callable[[], Any], n: int = 5) -> tuple[float, float]:
    """(best, first) of ``n`` timed calls, in seconds."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times), times[0]


def row(schedule: str, zone: str, years: int, cap: int) -> str:
    airflow = CronTriggerTimetable(schedule, timezone=zone)
    last = DataInterval.exact(airflow._align_to_prev(NOW.subtract(years=years)))

    def theirs() -> Any:
        return airflow.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)

    def ours() -> Any:
        timetable = CappedCatchupTimetable(schedule, max_backfill=cap, timezone=zone, data_interval=False)
        return timetable.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)

    a, _ = best(theirs)
    c, first = best(ours)
    return (
        f"{schedule:14} {zone:14} {years:2}y cap {cap}: airflow {a * 1e3:7.2f} ms  capped {c * 1e3:8.2f} ms "
        f"(first {first * 1e3:8.2f})  ratio {c / a:7.1f}x  -> {ours().run_after}"
    )


if __name__ == "__main__":
    capped_catchup._utcnow = lambda: NOW  # type: ignore[assignment]
    print("code:", airflow_lease_provider.__file__)
    for args in ROWS:
        print(row(*args))
