"""Catch-up after a one-year outage: the capped timetable against Airflow's own computations.

Arms, per schedule (``* * * * *`` and ``*/5 * * * *``, UTC, data-interval runs), all asked for the next
run when the last automated run ended one year ago:

* ``capped N=1`` / ``capped N=10``: ``CappedCatchupTimetable(max_backfill=N)``, DAG ``catchup=True``;
* ``Airflow latest-only``: ``CronDataIntervalTimetable`` with ``catchup=False`` (one call);
* ``enumerate``: ``CronDataIntervalTimetable`` with ``catchup=True`` stepping through the missed slots
  one ``next_dagrun_info`` call per slot, as the scheduler would. Stepping through the whole year takes
  many minutes, so each repeat steps on through the *next* segment of the gap for a fixed time budget,
  continuing where the previous repeat stopped. Each segment is one timed repeat; the segments together
  are one measured enumeration of the first part of the gap. Its total time is a *lower bound* on
  enumerating the year, and so is every ratio built from it.

Times are per call. Croniter calls (constructions: one per CronMixin step, as the project's tests
count them) are counted in a separate instrumented call for the fast arms; the enumeration is counted
while it is timed (the counting wrapper costs well under 0.1% of a 0.7 ms step) so it runs once per
repeat.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bench.figures import spread

SCHEDULES: tuple[tuple[str, int], ...] = (("* * * * *", 60), ("*/5 * * * *", 300))  # (cron, period s)
CAPS = (1, 10)
OUTAGE = datetime.timedelta(days=365)


class _Counter:
    def __init__(self) -> None:
        self.calls = 0

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        return counting


@contextmanager
def counting_croniter() -> Iterator[_Counter]:
    """Count croniter constructions where Airflow's CronMixin and the project's timetable look it up."""
    import airflow.timetables._cron as airflow_cron

    from airflow_lease_provider.timetables import _grid, capped_catchup

    counter = _Counter()
    modules = (airflow_cron, _grid, capped_catchup)
    originals = [m.croniter for m in modules]
    for module in modules:
        module.croniter = counter.wrap(module.croniter)  # type: ignore[attr-defined]
    try:
        yield counter
    finally:
        for module, original in zip(modules, originals, strict=True):
            module.croniter = original  # type: ignore[attr-defined]


def _per_call_seconds(fn: Callable[[], Any], min_seconds: float) -> float:
    """Mean seconds per call over at least ``min_seconds`` (and at least 5 calls)."""
    fn()  # warm caches (imports, pendulum timezone objects) outside the measurement
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 5 and elapsed >= min_seconds:
            return elapsed / calls


def _arms(schedule: str) -> tuple[dict[str, Callable[[], Any]], Callable[[float], tuple[int, float]], Any]:
    """The next-run arms of ``schedule``, the enumerator (seconds -> (slots, elapsed)) and the last run."""
    import pendulum
    from airflow.timetables.base import DataInterval, TimeRestriction
    from airflow.timetables.interval import CronDataIntervalTimetable
    from croniter import croniter

    from airflow_lease_provider.timetables import CappedCatchupTimetable

    now = pendulum.now("UTC")
    # The last automated run: the slot at or before one year ago, with its data interval.
    last_end = pendulum.instance(croniter(schedule, now - OUTAGE).get_prev(datetime.datetime))
    last_start = pendulum.instance(croniter(schedule, last_end).get_prev(datetime.datetime))
    last = DataInterval(start=last_start, end=last_end)
    catchup = TimeRestriction(earliest=None, latest=None, catchup=True)
    latest_only = TimeRestriction(earliest=None, latest=None, catchup=False)
    airflow_tt = CronDataIntervalTimetable(schedule, timezone="UTC")
    cursor = [last]  # where the enumeration stopped: the next segment goes on from there

    def enumerate_for(budget: float) -> tuple[int, float]:
        slots, start = 0, time.perf_counter()
        while time.perf_counter() - start < budget:
            info = airflow_tt.next_dagrun_info(last_automated_data_interval=cursor[0], restriction=catchup)
            if info is None or info.run_after > now:
                break  # the whole gap is enumerated
            cursor[0] = info.data_interval
            slots += 1
        return slots, time.perf_counter() - start

    fns: dict[str, Callable[[], Any]] = {}
    for cap in CAPS:
        capped = CappedCatchupTimetable(schedule, max_backfill=cap)  # built once, as at DAG parse time
        fns[f"capped N={cap}"] = _bind_next(capped, last, catchup)
    fns["Airflow latest-only"] = _bind_next(airflow_tt, last, latest_only)
    return fns, enumerate_for, last


def _bind_next(timetable: Any, last: Any, restriction: Any) -> Callable[[], Any]:
    def call() -> Any:
        return timetable.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)

    return call


def run_catchup(repeats: int, enumerate_seconds: float, min_seconds: float) -> dict[str, Any]:
    """Every arm for every schedule, arms interleaved, ``repeats`` times."""
    out: dict[str, Any] = {
        "outage_days": OUTAGE.days,
        "enumerate_seconds_per_segment": enumerate_seconds,
        "schedules": [],
    }
    for schedule, period in SCHEDULES:
        fns, enumerate_for, last = _arms(schedule)
        names = [*fns, "enumerate"]
        seconds: dict[str, list[float]] = {name: [] for name in names}
        segments: list[int] = []
        calls: dict[str, int] = {}
        answers: dict[str, str | None] = {}
        for name, fn in fns.items():
            with counting_croniter() as counter:
                info = fn()
            calls[name] = counter.calls
            answers[name] = info.run_after.isoformat() if info is not None else None
        calls["enumerate"] = 0
        for repeat in range(repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                if name == "enumerate":
                    with counting_croniter() as counter:
                        slots, elapsed = enumerate_for(enumerate_seconds)
                    calls["enumerate"] += counter.calls
                    segments.append(slots)
                    seconds[name].append(elapsed)
                else:
                    seconds[name].append(_per_call_seconds(fns[name], min_seconds))
        out["schedules"].append(_schedule_result(schedule, period, last, seconds, segments, calls, answers))
    return out


def _schedule_result(
    schedule: str,
    period: int,
    last: Any,
    seconds: dict[str, list[float]],
    segments: list[int],
    calls: dict[str, int],
    answers: dict[str, str | None],
) -> dict[str, Any]:
    enumerated = sum(segments)
    total_s = sum(seconds["enumerate"])
    arms_out: dict[str, Any] = {
        name: {
            "ms": spread(s * 1000 for s in seconds[name]),
            "ms_each": [s * 1000 for s in seconds[name]],
            "croniter_calls": calls[name],
            "next_run_after": answers.get(name),
        }
        for name in seconds
    }
    arms_out["enumerate"].update(
        {
            "segment_slots": segments,
            "slots_enumerated": enumerated,
            "total_ms": total_s * 1000,
            "ms_per_slot": spread(
                s * 1000 / n for s, n in zip(seconds["enumerate"], segments, strict=True) if n
            ),
        }
    )
    ratios: dict[str, Any] = {}
    for cap in CAPS:
        capped = seconds[f"capped N={cap}"]
        ratios[f"capped N={cap} / latest-only"] = spread(
            c / a for c, a in zip(capped, seconds["Airflow latest-only"], strict=True)
        )
        # The whole measured enumeration (all segments) against each repeat's capped computation.
        ratios[f"enumerate (lower bound) / capped N={cap}"] = spread(total_s / c for c in capped)
    return {
        "schedule": schedule,
        "missed_slots": int(OUTAGE.total_seconds()) // period,
        "last_run_end": last.end.isoformat(),
        "arms": arms_out,
        "ratios": ratios,
    }
