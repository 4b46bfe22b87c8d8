"""``python -m chaos``: run a profile, check its history, print the figures; non-zero on any violation."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos import checker, harness
from chaos.airflow.profiles import PROFILES as AIRFLOW_PROFILES
from chaos.airflow.run import VARIANTS as AIRFLOW_VARIANTS
from chaos.profiles import PROFILES, VARIANTS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    p.add_argument("--airflow", action="store_true",
                   help="the Airflow-level fault run (real scheduler, dag-processor, api-server; chaos.airflow)")
    p.add_argument("--profile", choices=sorted(set(PROFILES) | set(AIRFLOW_PROFILES)), default=None,
                   help=f"core: {', '.join(sorted(PROFILES))} (default short); --airflow: "
                        f"{', '.join(sorted(AIRFLOW_PROFILES))} (default ci)")
    p.add_argument("--seconds", type=float, default=None, help="--airflow: override the fault phase, in seconds")
    p.add_argument("--dsn", default=None,
                   help="--airflow: the PostgreSQL server to use (default $LEASE_TEST_DSN, else 127.0.0.1:5432)")
    p.add_argument("--executor", choices=("local", "celery"), default="local",
                   help="--airflow: LocalExecutor, or CeleryExecutor with two Celery workers on the Redis at "
                        "127.0.0.1:6379 (the nemesis freezes and kills whole workers too)")
    p.add_argument("--template", default=None,
                   help="--airflow: an already migrated Airflow metadata database to copy (default: migrate one)")
    p.add_argument("--variant", choices=sorted(set(VARIANTS) | set(AIRFLOW_VARIANTS)), default="correct",
                   help="correct (the real store), or a deliberately broken one the checker must catch")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: $TMPDIR/chaos-runs/<profile>-<variant>-<time>)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="override the fault phase, in seconds")
    p.add_argument("--workers", type=int, default=None, help="override the number of workers")
    p.add_argument("--check-only", type=Path, default=None, metavar="HISTORY",
                   help="only check an existing history file")
    return p


def _terminate(signum: int, frame: object) -> None:
    # A test that gives up on us sends SIGTERM: unwind, so the harness kills its workers and removes
    # its private server on the way out.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.airflow:
        return airflow_main(args)
    if args.check_only is not None:
        return checker.main([str(args.check_only)])
    if args.profile not in PROFILES and args.profile is not None:
        parser().error(f"--profile {args.profile} is an --airflow profile")
    if args.variant not in VARIANTS:
        parser().error(f"--variant {args.variant} is an --airflow variant")
    profile = PROFILES[args.profile or "short"].with_overrides(duration=args.duration, workers=args.workers)
    seed, out = _seed_and_out(args, f"{profile.name}-{args.variant}")
    started = time.monotonic()
    path = harness.run(profile, args.variant, out, seed)
    return _report(checker.check_file(path), out,
                   f"profile={profile.name} variant={args.variant} seed={seed} "
                   f"wall={time.monotonic() - started:.0f}s history={path}")


def _seed_and_out(args: argparse.Namespace, name: str) -> tuple[int, Path]:
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    out = args.out or Path(tempfile.gettempdir()) / "chaos-runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return seed, out


def _report(report: Any, out: Path, run_line: str) -> int:
    """Write ``report.json``, print the report and the run's line; the exit status."""
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
    print(report.format())
    print(f"run: {run_line}")
    return int(report.status)


def airflow_main(args: argparse.Namespace) -> int:
    """``python -m chaos --airflow``: the Airflow-level fault run (:mod:`chaos.airflow`)."""
    from chaos.airflow import check, run

    if args.check_only is not None:
        report = check.check_file(args.check_only)
        print(report.format())
        return report.status
    name = args.profile or "ci"
    if name not in AIRFLOW_PROFILES:
        parser().error(f"--profile {name} is not an --airflow profile ({', '.join(sorted(AIRFLOW_PROFILES))})")
    if args.variant not in AIRFLOW_VARIANTS:
        parser().error(f"--variant {args.variant} is not an --airflow variant ({', '.join(AIRFLOW_VARIANTS)})")
    profile = AIRFLOW_PROFILES[name].with_seconds(args.seconds)
    seed, out = _seed_and_out(args, f"airflow-{args.executor}-{name}-{args.variant}")
    dsn = args.dsn or os.environ.get("LEASE_TEST_DSN") or "postgresql://postgres@127.0.0.1:5432/postgres"
    started = time.monotonic()
    path = run.run(profile, args.variant, out, seed, dsn, args.template, args.executor)
    return _report(check.check_file(path), out,
                   f"--airflow executor={args.executor} profile={name} seconds={profile.seconds:.0f} "
                   f"variant={args.variant} seed={seed} "
                   f"wall={time.monotonic() - started:.0f}s history={path}")
