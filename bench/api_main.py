"""``python -m bench --api``: issue 41 item 5, the lease API path under a real deployment, in one run.

1. Task overhead over the API path: under one LocalExecutor deployment (``bench/overhead_deployed.py``), the
   direct pairs DAG and the same pairs with ``[lease] access = api`` (each leased task takes, renews and
   releases its lease over HTTP through the api-server; the same store, in the metadata database), their runs
   interleaved round by round: plain, leased direct and leased over the API in the same run. Each figure is
   the median over runs of leased / plain in the same DAG run (target <= 1.25x for the API arm), and per
   round the API arm's leased median over the direct arm's.
2. A thousand leases held at once through that deployment's api-server (``bench/api_scale.py``): TTL 30 s,
   renewed every 10 s by the product's keeper over ``HttpLeaseStore``, none lost, no HTTP error, all held by
   their owners in the store near the end, all released.

Writes ``bench/results-api.json`` (with the commit, the command and the load average) and prints the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench.provenance import REPO, RunStart

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
#: Issue 41 item 5's target for the API arm: leased / plain in the same DAG run.
API_RATIO_TARGET = 1.25


def _log(text: str) -> None:
    print(f"[bench --api] {text}", file=sys.stderr, flush=True)


def _scale_then(args: argparse.Namespace) -> Any:
    """The thousand leases, run against the overhead arms' deployment once they are done."""

    def then(deployment: Any) -> dict[str, Any]:
        from airflow_lease_provider import settings
        from bench.api_scale import run_api_scale

        secret = json.loads(deployment.env["AIRFLOW_CONN_LEASE_API"])["password"]
        api_server = deployment.started[0]  # Deployment.start starts the api-server first
        pool = deployment.env.get("AIRFLOW__LEASE__API_POOL_SIZE") or settings.DEFAULTS["api_pool_size"]
        _log(f"{args.api_leases} leases through the api-server (TTL {args.api_ttl:g} s, renewed every "
             f"{args.api_renew_every:g} s, held {args.api_hold:g} s after a {args.api_ramp:g} s ramp) ...")
        try:
            return run_api_scale(deployment.url, secret, deployment.dsn, deployment.env["AIRFLOW__LEASE__SCHEMA"],
                                 api_server.pid, leases=args.api_leases, ttl_s=args.api_ttl,
                                 renew_every_s=args.api_renew_every, ramp_s=args.api_ramp, hold_s=args.api_hold,
                                 per_process=args.api_per_process, pool_size=int(pool))
        except Exception as exc:  # noqa: BLE001 - reported as not measured, with why
            return {"verdict": f"not measured: {type(exc).__name__}: {str(exc)[:300]}",
                    "tails": deployment.tails()[-3000:]}

    return then


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --api", description=__doc__.split("\n")[0])
    parser.add_argument("--api", action="store_true")
    parser.add_argument("--dsn", default=os.environ.get("LEASE_BENCH_DSN", DEFAULT_DSN))
    parser.add_argument("--repeats", type=int, default=5, help="DAG runs after the warm-up, per arm (at least 3)")
    parser.add_argument("--overhead-pairs", type=int, default=6, help="plain/leased pairs per DAG run")
    parser.add_argument("--api-leases", type=int, default=1000, help="leases held at once through the api-server")
    parser.add_argument("--api-ttl", type=float, default=30.0)
    parser.add_argument("--api-renew-every", type=float, default=10.0)
    parser.add_argument("--api-ramp", type=float, default=20.0, help="acquires spread over this many seconds")
    parser.add_argument("--api-hold", type=float, default=60.0, help="all held at once this long after the ramp")
    parser.add_argument("--api-per-process", type=int, default=250, help="client threads per process")
    parser.add_argument("--no-scale", action="store_true", help="skip the thousand leases")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results-api.json")
    parser.add_argument("--report", type=Path, help="run nothing: print a saved run's tables")
    args = parser.parse_args(argv)
    if args.report:
        from bench.report import api_report

        print(api_report(json.loads(args.report.read_text())))
        return 0
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: every figure is a median with its min-max")
    start = RunStart.now(argv)
    from bench.overhead_deployed import run_overhead_deployed

    _log(f"LocalExecutor deployment: {args.overhead_pairs} pairs direct and over the lease API, "
         f"{args.repeats} repeats ...")
    found = run_overhead_deployed(args.dsn, args.repeats, args.overhead_pairs, 0, xcom=False, api=True,
                                  then=None if args.no_scale else _scale_then(args))
    runs = {"deployed": found.get("pairs"), "deployed_api": found.get("api")}
    if "tails" in found:
        runs["deployed_tails"] = found["tails"]
    meta = start.meta()
    out = {"meta": meta, "task_overhead_runs": runs, "api_scale": found.get("then")}
    args.output.write_text(json.dumps(out, indent=1, default=str) + "\n")
    from bench.report import api_report

    print(api_report(out))
    _log(f"results written to {args.output}")
    return 0
