"""``python -m bench --timetable``: issue 28 item 2, each scheduler call of the capped timetable.

For every row of a matrix (schedule, zone, gap, ``max_backfill``) and each of the scheduler's three calls
after an outage, the best of ``--repeats`` timed calls of :class:`CappedCatchupTimetable` against the
best of as many of Airflow's own :class:`CronTriggerTimetable` with the same last run, in one process:

* ``first``: ``next_dagrun_info`` right after the outage (the gap is the whole outage);
* ``later``: ``next_dagrun_info`` after the first kept run (the gap is ``max_backfill - 1`` slots: each
  call of a catch-up);
* ``dag_model``: ``next_run_info_from_dag_model`` with the run stored before the outage (the slot right
  after the last run), which the timetable moves forward; Airflow's own call returns it as stored.

Target: ratio <= 10x, or under 1 ms. The capped timetable is built inside each timed call (as the
scheduler deserializes it), so no per-instance cache carries over; module caches (a zone's offset changes,
the matching days of a month kind) stay warm, as in a scheduler. Each answer is checked against the
brute-force enumeration of ``tests/timetables/cron_reference.py`` (croniter's matches one by one, the
instants from ``zoneinfo``) over the window it depends on (the kept slots back from now, or the slot after
the last run). Writes ``bench/results-timetable.json`` (with the commit, the command and the load) and
prints the rows with PASS/MISS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pendulum
from airflow.timetables.base import DataInterval, TimeRestriction
from airflow.timetables.trigger import CronTriggerTimetable

from airflow_lease_provider.timetables import CappedCatchupTimetable, capped_catchup
from bench.provenance import REPO
from bench.provenance import provenance as provenance_of_checkout

CATCHUP = TimeRestriction(earliest=None, latest=None, catchup=True)
NOW = pendulum.datetime(2025, 6, 15, 12, 0, 30, tz="UTC")
RATIO_TARGET = 10.0
ABSOLUTE_TARGET_MS = 1.0
CALLS = ("first", "later", "dag_model")
#: (schedule, zone, years offline, max_backfill): the issue's three rows first.
ROWS: list[tuple[str, str, int, int]] = [
    ("0 * * * *", "Europe/Berlin", 10, 1_000),
    ("30 9 * * 1-5", "Europe/Berlin", 10, 1_000),
    ("*/5 * * * *", "UTC", 1, 1_000),
    ("0 * * * *", "Europe/Berlin", 50, 10_000),
    ("*/5 * * * *", "Australia/Lord_Howe", 10, 10_000),
    ("30 9 * * 1-5", "America/New_York", 50, 10_000),
    ("0 6 * * 1", "Europe/Berlin", 50, 10_000),
    ("0 0 1 * *", "Australia/Lord_Howe", 50, 10_000),
    ("0 0 L * *", "America/Santiago", 50, 100),
    ("*/5 * * * *", "Europe/Berlin", 50, 1),
]


def _best_ms(call: Callable[[], Any], repeats: int) -> tuple[float, Any, float]:
    """The best of ``repeats`` timed calls in ms, the last answer, and the first call in ms."""
    times = []
    answer = None
    for _ in range(repeats):
        started = time.perf_counter()
        answer = call()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3, answer, times[0] * 1e3


def _check(schedule: str, zone: str, last: datetime.datetime, cap: int, run: datetime.datetime) -> str:
    """Whether ``run`` is what a cap of ``cap`` gives after ``last`` at NOW, by brute-force enumeration.

    Only the windows the answer depends on are enumerated: the slots from ``run`` to now (at most ``cap``),
    and, when fewer than ``cap`` are kept, the interval from ``last`` to ``run`` (which must hold none).
    """
    from tests.timetables.cron_reference import reference_slots

    if run > NOW:
        # Nothing due: the run is the next slot after the last one, and after now.
        between = reference_slots(schedule, zone, last, run)
        inner = [s for s in between if last < s < run]
        return "ok (next, not due)" if run in between and not inner else "WRONG: not the next slot"
    kept = reference_slots(schedule, zone, run, NOW)
    if not kept or kept[0] != run:
        return f"WRONG: {run} is not a slot"
    if len(kept) > cap:
        return f"WRONG: {len(kept)} slots kept, cap {cap}"
    if len(kept) == cap:
        return f"ok (newest {cap:,})"
    # Fewer than cap kept: every slot after the last run is kept, so none lies between it and the run.
    between = reference_slots(schedule, zone, last, run)
    if [s for s in between if last < s < run]:
        return f"WRONG: {len(kept)} kept of cap {cap}, older slots dropped"
    return f"ok (all {len(kept):,} due)"


def measure_row(schedule: str, zone: str, years: int, cap: int, repeats: int) -> list[dict[str, Any]]:
    airflow = CronTriggerTimetable(schedule, timezone=zone)
    last_slot = airflow._align_to_prev(NOW.subtract(years=years))
    last = DataInterval.exact(last_slot)

    def build() -> CappedCatchupTimetable:
        return CappedCatchupTimetable(schedule, max_backfill=cap, timezone=zone, data_interval=False)

    # The first call after the outage.
    first_airflow, _, _ = _best_ms(
        lambda: airflow.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP), repeats
    )
    first_capped, first, first_cold = _best_ms(
        lambda: build().next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP), repeats
    )
    # A later call of the same catch-up: the last run is the first kept one.
    kept = first.data_interval
    later_airflow, _, _ = _best_ms(
        lambda: airflow.next_dagrun_info(last_automated_data_interval=kept, restriction=CATCHUP), repeats
    )
    later_capped, later, later_cold = _best_ms(
        lambda: build().next_dagrun_info(last_automated_data_interval=kept, restriction=CATCHUP), repeats
    )
    # The run stored before the outage, read back by the scheduler.
    stale = airflow.next_dagrun_info(last_automated_data_interval=last, restriction=CATCHUP)
    assert stale is not None
    from tests.timetables.dag_model import stored  # the DagModel row the scheduler reads back

    model = stored(stale)
    model_airflow, _, _ = _best_ms(lambda: airflow.next_run_info_from_dag_model(dag_model=model), repeats)
    model_capped, moved, model_cold = _best_ms(
        lambda: build().next_run_info_from_dag_model(dag_model=model), repeats
    )

    checked_first = _check(schedule, zone, last_slot, cap, first.run_after)
    # The later call: the gap after the first kept run is at most cap - 1 slots, all kept.
    checked_later = _check(schedule, zone, first.run_after, cap, later.run_after)
    checked_moved = "ok (= first)" if moved.run_after == first.run_after else "WRONG: differs from first"
    out = []
    for call, theirs, ours, cold, answer, checked in (
        ("first", first_airflow, first_capped, first_cold, first.run_after, checked_first),
        ("later", later_airflow, later_capped, later_cold, later.run_after, checked_later),
        ("dag_model", model_airflow, model_capped, model_cold, moved.run_after, checked_moved),
    ):
        out.append(
            {
                "schedule": schedule,
                "zone": zone,
                "years": years,
                "max_backfill": cap,
                "call": call,
                "airflow_ms": theirs,
                "capped_ms": ours,
                "capped_first_of_repeats_ms": cold,
                "ratio": ours / theirs,
                "answer": answer.isoformat(),
                "checked": checked,
            }
        )
    return out


def verdict(row: dict[str, Any]) -> str:
    if row["checked"].startswith("WRONG"):
        return "MISS: wrong answer"
    if row["ratio"] <= RATIO_TARGET:
        return "PASS"
    if row["capped_ms"] < ABSOLUTE_TARGET_MS:
        return "PASS (< 1 ms)"
    return f"MISS: {row['ratio']:.1f}x and {row['capped_ms']:.2f} ms"


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.2f}"


def timetable_report(results: dict[str, Any]) -> str:
    """What ``python -m bench --timetable`` prints: one target row per schedule and call, PASS/MISS."""
    meta = results["meta"]
    where = f"`{(meta.get('git_head') or 'unknown')[:7]}`, `{meta.get('command', '')}`"
    header = [
        "schedule",
        "zone",
        "gap",
        "max_backfill",
        "call",
        "Airflow ms",
        "capped ms",
        "ratio",
        "capped, 1st of the calls",
        "answer (UTC)",
        "brute force",
        "verdict",
    ]
    lines = [
        "### Issue 28 item 2: each scheduler call of the timetable, against Airflow's CronTriggerTimetable",
        "",
        f"{meta['cpus']} CPUs; load average at start {meta['load_start']}, at end {meta['load_end']}; "
        f"{meta['elapsed_s']:.0f} s; best of {meta['repeats']} calls each, at {where}. "
        f"Target: <= {RATIO_TARGET:g}x, or under {ABSOLUTE_TARGET_MS:g} ms. The capped timetable is built "
        "inside each timed call; the 1st of the calls is the first of them (the process's caches cold for "
        "the first row of a zone).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(":--" if i < 5 or i > 8 else "--:" for i in range(len(header))) + "|",
    ]
    for row in results["rows"]:
        cells = [
            f"`{row['schedule']}`",
            row["zone"],
            f"{row['years']} y",
            f"{row['max_backfill']:,}",
            row["call"],
            _ms(row["airflow_ms"]),
            _ms(row["capped_ms"]),
            f"{row['ratio']:.1f}x",
            f"{_ms(row['capped_first_of_repeats_ms'])} ms",
            row["answer"].replace("+00:00", ""),
            row["checked"],
            verdict(row),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    passed = sum(1 for row in results["rows"] if verdict(row).startswith("PASS"))
    ratios = [row["ratio"] for row in results["rows"] if row["call"] != "dag_model"]
    moved = [row["capped_ms"] for row in results["rows"] if row["call"] == "dag_model"]
    lines += [
        "",
        f"{passed} of {len(results['rows'])} rows pass. next_dagrun_info: ratio median "
        f"{statistics.median(ratios):.1f}x, max {max(ratios):.1f}x. next_run_info_from_dag_model: Airflow's "
        f"returns the stored run as it is (microseconds), the capped one moves it: at most {max(moved):.2f} ms.",
    ]
    return "\n".join(lines)


def run(repeats: int, rows: Sequence[tuple[str, str, int, int]] = ROWS) -> list[dict[str, Any]]:
    real_now = capped_catchup._utcnow
    capped_catchup._utcnow = lambda: NOW
    try:
        out = []
        for row in rows:
            print(f"[bench --timetable] {row} ...", file=sys.stderr, flush=True)
            out.extend(measure_row(*row, repeats=repeats))
        return out
    finally:
        capped_catchup._utcnow = real_now


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --timetable", description=__doc__.split("\n")[0])
    parser.add_argument("--timetable", action="store_true")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per figure, the best kept")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results-timetable.json")
    parser.add_argument("--report", type=Path, metavar="RESULTS_JSON", help="run nothing: print a saved run")
    args = parser.parse_args(argv)
    if args.report:
        print(timetable_report(json.loads(args.report.read_text())))
        return 0
    provenance = provenance_of_checkout()
    started_at = datetime.datetime.now(datetime.timezone.utc)
    started, load_start = time.monotonic(), os.getloadavg()
    rows = run(args.repeats)
    meta = {
        "command": "python -m bench " + " ".join(argv),
        "started_at": started_at.isoformat(timespec="seconds"),
        "elapsed_s": time.monotonic() - started,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "load_start": " ".join(f"{v:.2f}" for v in load_start),
        "load_end": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        **provenance,
    }
    results = {"meta": meta, "rows": rows}
    args.output.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(timetable_report(results))
    print(f"[bench --timetable] results written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main(["--timetable", *sys.argv[1:]]))
