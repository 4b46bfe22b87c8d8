"""Catch-up after a one-year outage: the capped timetable against Airflow's own computations.

Arms, per schedule (``* * * * *`` and ``*/5 * * * *``, UTC, data-interval runs), all asked for the next
run when the last automated run ended one year ago:

* ``capped N=1`` / ``capped N=10``: ``CappedCatchupTimetable(max_backfill=N)``, DAG ``catchup=True``;
* ``Airflow latest-only``: ``CronDataIntervalTimetable`` with ``catchup=False`` (one call);
* ``enumerate``: ``CronDataIntervalTimetable`` with ``catchup=True`` stepping through the missed slots
  one ``next_dagrun_info`` call per slot, as the scheduler would. Only the first ``enumerate_days`` of
  the gap are stepped through (the whole year takes minutes): its time is a *lower bound* on
  enumerating the year, and so is any ratio built from it.

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


def _arms(schedule: str, enumerate_days: int) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    import pendulum
    from airflow.timetables.base import DataInterval, TimeRestriction
    from airflow.timetables.interval import CronDataIntervalTimetable
    from croniter import croniter

    from airflow_lease_provider.timetables import CappedCatchupTimetable

    now = pendulum.now("UTC")
    # The last automated run: the slot at or before one year ago, with its data interval.
    steps = croniter(schedule, now - OUTAGE)
    last_end = pendulum.instance(steps.get_prev(datetime.datetime))
    last_start = pendulum.instance(croniter(schedule, last_end).get_prev(datetime.datetime))
    last = DataInterval(start=last_start, end=last_end)
    catchup = TimeRestriction(earliest=None, latest=None, catchup=True)
    latest_only = TimeRestriction(earliest=None, latest=None, catchup=False)
    airflow_tt = CronDataIntervalTimetable(schedule, timezone="UTC")
    horizon = last_end + datetime.timedelta(days=enumerate_days)
    enumerated = {"slots": 0}

    def enumerate_slots() -> Any:
        info = airflow_tt.next_dagrun_info(last_automated_data_interval=last, restriction=catchup)
        slots = 0
        while info is not None and info.run_after <= horizon:
            slots += 1
            info = airflow_tt.next_dagrun_info(
                last_automated_data_interval=info.data_interval, restriction=catchup
            )
        enumerated["slots"] = slots
        return info

    fns: dict[str, Callable[[], Any]] = {}
    for cap in CAPS:
        capped = CappedCatchupTimetable(schedule, max_backfill=cap)  # built once, as at DAG parse time
        fns[f"capped N={cap}"] = _bind_next(capped, last, catchup)
    fns["Airflow latest-only"] = _bind_next(airflow_tt, last, latest_only)
    fns["enumerate"] = enumerate_slots
    context = {"last_end": last_end.isoformat(), "now": now.isoformat(), "enumerated": enumerated}
    return fns, context


def _bind_next(timetable: Any, last: Any, restriction: Any) -> Callable[[], Any]:
    def call() -> Any:
        return timetable.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)

    return call


def run_catchup(repeats: int, enumerate_days: int, min_seconds: float) -> dict[str, Any]:
    """Every arm for every schedule, arms interleaved, ``repeats`` times."""
    out: dict[str, Any] = {"outage_days": OUTAGE.days, "enumerate_days": enumerate_days, "schedules": []}
    for schedule, period in SCHEDULES:
        fns, context = _arms(schedule, enumerate_days)
        names = list(fns)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        calls: dict[str, int] = {}
        answers: dict[str, str | None] = {}
        for name in names:
            if name != "enumerate":
                with counting_croniter() as counter:
                    info = fns[name]()
                calls[name] = counter.calls
                answers[name] = info.run_after.isoformat() if info is not None else None
        for repeat in range(repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                if name == "enumerate":
                    with counting_croniter() as counter:
                        start = time.perf_counter()
                        info = fns[name]()
                        seconds[name].append(time.perf_counter() - start)
                    calls[name] = counter.calls
                    answers[name] = info.run_after.isoformat() if info is not None else None
                else:
                    seconds[name].append(_per_call_seconds(fns[name], min_seconds))
        missed = int(OUTAGE.total_seconds()) // period
        arms_out = {
            name: {
                "ms": spread(s * 1000 for s in seconds[name]),
                "ms_each": [s * 1000 for s in seconds[name]],
                "croniter_calls": calls[name],
                "next_run_after": answers[name],
            }
            for name in names
        }
        arms_out["enumerate"]["slots_enumerated"] = context["enumerated"]["slots"]
        ratios = {}
        for cap in CAPS:
            capped = seconds[f"capped N={cap}"]
            ratios[f"capped N={cap} / latest-only"] = spread(
                c / a for c, a in zip(capped, seconds["Airflow latest-only"], strict=True)
            )
            ratios[f"enumerate (lower bound) / capped N={cap}"] = spread(
                e / c for e, c in zip(seconds["enumerate"], capped, strict=True)
            )
        out["schedules"].append(
            {
                "schedule": schedule,
                "missed_slots": missed,
                "last_run_end": context["last_end"],
                "now": context["now"],
                "arms": arms_out,
                "ratios": ratios,
            }
        )
    return out
