"""``python -m bench --overhead``: issue 28 item 1 on its own, without the store grid.

In one invocation: the no-op pairs and the ``.expand()`` of ``--overhead-mapped`` instances, each in-process
(``dag.test()``) and under a LocalExecutor deployment (REST durations). Every figure is the median over
repeats of leased / plain in the same DAG run. Writes ``bench/results-overhead.json`` (with the commit and
the command) and prints the rows with PASS/MISS; the full grid (``python -m bench``) prints the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2 import sql

from bench.overhead import run_overhead
from bench.provenance import REPO, RunStart
from bench.report import overhead_report

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
#: The reference arm: leased tasks that push their lease to XCom (the opt-in ``[lease] push_lease_xcom =
#: true``; docs/airflow.md). The default arms push none.
PUSH_XCOM = "AIRFLOW__LEASE__PUSH_LEASE_XCOM"


def _log(text: str) -> None:
    print(f"[bench --overhead] {text}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--overhead", action="store_true")
    parser.add_argument("--dsn", default=os.environ.get("LEASE_BENCH_DSN", DEFAULT_DSN))
    parser.add_argument("--repeats", type=int, default=5, help="DAG runs after the warm-up, per arm (at least 3)")
    parser.add_argument("--overhead-pairs", type=int, default=10)
    parser.add_argument("--overhead-mapped", type=int, default=500, help="instances of each mapped task")
    parser.add_argument("--deployed-mapped", type=int, help="instances of each mapped task under the deployment "
                        "(default: --overhead-mapped; a LocalExecutor starts a process per instance)")
    parser.add_argument("--no-deployed", action="store_true", help="skip the LocalExecutor deployment arms")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results-overhead.json")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: every figure is a median with its min-max")
    start = RunStart.now(argv)
    schema = f"lease_bench_{uuid.uuid4().hex[:10]}"
    results: dict[str, Any] = {}
    deployed_mapped = args.overhead_mapped if args.deployed_mapped is None else args.deployed_mapped
    # The in-process arms first, then the deployment's, one after the other: beside a deployment (its
    # scheduler, task processes and metadata database on the same PostgreSQL server and the same two CPUs),
    # the in-process leased tasks, which commit to that server where a no-op plain task touches nothing,
    # paid for the deployment's load and the plain ones did not (1.28x against 1.20x for the pairs at
    # d952b7a, the 500-instance .expand() ran beside the deployment's 100-instance one).
    try:
        _log(f"in-process: {args.overhead_pairs} pairs, {args.repeats} repeats ...")
        results["in_process"] = run_overhead(args.dsn, schema, args.repeats, args.overhead_pairs)
        _log(f"in-process, reference [lease] push_lease_xcom = true: {args.overhead_pairs} pairs ...")
        results["in_process_xcom"] = run_overhead(
            args.dsn, schema, args.repeats, args.overhead_pairs, extra_env={PUSH_XCOM: "true"}
        )
        if args.overhead_mapped:
            _log(f"in-process: .expand() of {args.overhead_mapped} ...")
            results["in_process_mapped"] = run_overhead(
                args.dsn, schema, args.repeats, args.overhead_pairs, mapped=args.overhead_mapped
            )
    finally:
        with psycopg2.connect(args.dsn) as conn, conn.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.close()
    if not args.no_deployed:
        from bench.overhead_deployed import run_overhead_deployed

        _log(f"LocalExecutor deployment: {args.overhead_pairs} pairs, .expand() of {deployed_mapped} ...")
        found = run_overhead_deployed(args.dsn, args.repeats, args.overhead_pairs, deployed_mapped)
        results["deployed"] = found.get("pairs")
        results["deployed_xcom"] = found.get("xcom")
        results["deployed_mapped"] = found.get("mapped")
        if "tails" in found:
            results["deployed_tails"] = found["tails"]
    meta = start.meta()
    out = {"meta": meta, "task_overhead_runs": results}
    args.output.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(overhead_report(out))
    _log(f"results written to {args.output}")
    return 0
