"""The current benchmark figure for each question, read from the committed results, with the commit and
command of the run it comes from: ``python -m bench.current`` prints the index table at the top of
docs/benchmarks.md (``--json`` for scripts). One results file answers each question; what a later run
superseded is in ``bench/archive/`` (or in git history), never beside the current file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent


def _store(results: dict[str, Any]) -> str:
    from bench.run import recomputed

    found = recomputed(results)["targets"]
    row = next(t for t in found if t["figure"].startswith("hot key, Python clients"))
    success = next(t for t in found if t["figure"].startswith("success path vs ShedLock upsert"))
    judged = [t for t in found if t["verdict"] != "not measured" and not t["figure"].startswith("catch-up")]
    passed = sum("PASS" in t["verdict"] for t in judged)
    hot = row["measured"].split(": ", 1)[1].split(" / ", 1)[0]
    return (f"held key, 64 clients: {hot} of ShedLock's conditional `UPDATE`, 0 WAL bytes per refusal; "
            f"success path {success['measured'].split(';', 1)[0]} of ShedLock's upsert at 1 / 8 / 64 clients; "
            f"{passed} of the {len(judged)} store targets of issue 15 met (each miss with why, and its cost)")


def _catchup(results: dict[str, Any]) -> str:
    from bench.run import recomputed

    row = next(t for t in recomputed(results)["targets"] if t["figure"].startswith("catch-up after"))
    return f"capped, N = 10, against Airflow's latest-only: {row['measured']} per next-run computation ({row['verdict']})"


def _overhead(results: dict[str, Any]) -> str:
    from bench.report import REFERENCE_OVERHEAD_ARMS, _run_ratios

    runs = results["task_overhead_runs"]
    parts = []
    for name, label in (("in_process", "in process, pairs"), ("in_process_mapped", "in process, `.expand()`"),
                        ("deployed", "LocalExecutor, pairs"), ("deployed_mapped", "LocalExecutor, `.expand()`")):
        if name in REFERENCE_OVERHEAD_ARMS or not (ratios := _run_ratios(runs.get(name) or {})):
            continue
        parts.append(f"{label} {statistics.median(ratios):.2f}x")
    return f"leased / plain task duration in the same DAG run: {'; '.join(parts)} (target <= 1.25x)"


def _timetable(results: dict[str, Any]) -> str:
    from bench.timetable_rows import verdict

    rows = results["rows"]
    passed = sum(verdict(row).startswith("PASS") for row in rows)
    ratios = [row["ratio"] for row in rows if row["call"] != "dag_model"]
    return (f"each scheduler call against Airflow's `CronTriggerTimetable`: median {statistics.median(ratios):.1f}x, "
            f"max {max(ratios):.1f}x; {passed} of {len(rows)} rows meet <= 2x or < 1 ms, every answer checked by brute force")


def _scale(results: dict[str, Any]) -> str:
    arms = {arm["arm"]: arm for arm in results["arms"]}
    bouncer, burst = arms["pgbouncer-10k"], arms["direct-burst"]
    return (f"{bouncer['peak_held_at_once']:,} leases held at once through pgbouncer on `max_connections = 100` "
            f"({bouncer['lost']} lost, {bouncer['fail_closed']} failed closed, {bouncer['verdict']}); a burst of "
            f"{burst['leases']:,} acquires in one second direct ({burst['lost']} lost, {burst['fail_closed']} "
            f"failed closed, {burst['verdict']})")


def _api_overhead(results: dict[str, Any]) -> str:
    from bench.report import _run_ratios

    runs = results["task_overhead_runs"]
    api, direct = _run_ratios(runs.get("deployed_api") or {}), _run_ratios(runs.get("deployed") or {})
    against = ((runs.get("deployed_api") or {}).get("api_over_direct") or {}).get("ratios") or []
    if not api:
        return "not measured"
    return (f"leased over the API / plain task duration in the same DAG run, LocalExecutor: "
            f"{statistics.median(api):.2f}x (target <= 1.25x); the direct path in the same run "
            f"{statistics.median(direct):.2f}x; leased over the API / leased direct {statistics.median(against):.2f}x")


def _api_scale(results: dict[str, Any]) -> str:
    scale = results.get("api_scale") or {}
    if "leases" not in scale:
        return str(scale.get("verdict", "not measured"))
    from bench.api_scale import verdict

    load = scale.get("load_1min_during") or {}
    return (f"{scale['held_at_once_verified']:,} of {scale['leases']:,} leases held at once through one api-server "
            f"(TTL {scale['ttl_s']:g} s, renewed every {scale['renew_every_s']:g} s; {scale['lost']} lost, "
            f"{scale['http_errors']} HTTP errors, renewal p50 {scale['renew_p50_ms']:,.0f} ms, p99 "
            f"{scale['renew_p99_ms']:,.0f} ms; api-server {scale['api_server_cores']:.2f} cores at load "
            f"{load.get('min', 0):.0f}-{load.get('max', 0):.0f}; {verdict(scale)})")


@dataclass(frozen=True)
class Question:
    question: str
    file: str  # under bench/
    section: str  # the anchor of its section in docs/benchmarks.md
    figure: Callable[[dict[str, Any]], str]


QUESTIONS = (
    Question("How fast is a lease against what teams use instead (ShedLock, read-then-CAS)?", "results.json",
             "results", _store),
    Question("What does a leased task cost against a plain one?", "results-overhead.json",
             "issue-28-item-1-each-leased-task", _overhead),
    Question("What does catching up after a year's downtime cost?", "results.json",
             "catch-up-after-a-365-day-outage", _catchup),
    Question("What does the capped timetable cost the scheduler on each call?", "results-timetable.json",
             "issue-28-item-2-each-scheduler-call-of-the-timetable", _timetable),
    Question("How many leases does one store hold?", "results-scale.json", "ten-thousand-leases-issue-28-item-3",
             _scale),
    Question("What does a leased task cost when it takes its lease through the api-server?", "results-api.json",
             "issue-41-item-5-the-lease-api-path", _api_overhead),
    Question("How many leases does one api-server keep?", "results-api.json", "issue-41-item-5-the-lease-api-path",
             _api_scale),
)


def rows() -> list[dict[str, str]]:
    out = []
    for q in QUESTIONS:
        results = json.loads((BENCH / q.file).read_text())
        meta = results["meta"]
        out.append({
            "question": q.question,
            "figure": q.figure(results),
            "file": f"bench/{q.file}",
            "section": q.section,
            "commit": meta["git_head"][:7],
            "command": f"python -m bench{meta['command'].strip().removeprefix('python -m bench')}",
        })
    return out


def table() -> str:
    lines = ["| Question | Current figure | Results, section | Commit | Command |", "|---|---|---|---|---|"]
    for row in rows():
        lines.append(f"| {row['question']} | {row['figure']} | `{row['file']}`, [below](#{row['section']}) | "
                     f"`{row['commit']}` | `{row['command']}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.current", description=__doc__)
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args(argv)
    print(json.dumps(rows(), indent=1) if args.json else table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
