"""``python -m chaos``: run a profile, check its history, print the figures; non-zero on any violation."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import tempfile
import time
from pathlib import Path

from chaos import checker, harness
from chaos.profiles import PROFILES, VARIANTS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    p.add_argument("--profile", choices=sorted(PROFILES), default="short")
    p.add_argument("--variant", choices=VARIANTS, default="correct",
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
    if args.check_only is not None:
        return checker.main([str(args.check_only)])
    profile = PROFILES[args.profile].with_overrides(duration=args.duration, workers=args.workers)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    out = args.out or Path(tempfile.gettempdir()) / "chaos-runs" / f"{profile.name}-{args.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
    started = time.monotonic()
    path = harness.run(profile, args.variant, out, seed)
    report = checker.check_file(path)
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
    print(report.format())
    print(f"run: profile={profile.name} variant={args.variant} seed={seed} "
          f"wall={time.monotonic() - started:.0f}s history={path}")
    return report.status
