"""Which code a benchmark measured: HEAD and any uncommitted change to the package, read at the start;
and a run's start (:class:`RunStart`), from which its results' ``meta`` is made.

Shared by the grid (``bench/run.py``) and the scale profile (``bench/scale.py``), which ``bench/run.py``
dispatches to, and by the overhead and API runs (``bench/overhead_main.py``, ``bench/api_main.py``); kept in a
module of its own so that none imports another back.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def git(*args: str) -> str | None:
    """``git -C REPO *args``'s output, or None when git is missing or the command fails."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance() -> dict[str, Any]:
    """The code that was measured: HEAD and any uncommitted change to the package, read at the start
    (the checkout is shared, so both can move while the benchmark runs)."""
    dirty = git("status", "--porcelain", "--", "airflow_lease_provider")
    return {"git_head": git("rev-parse", "HEAD"), "uncommitted_package_changes": (dirty or "").splitlines()}


def _loads(values: tuple[float, float, float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


@dataclass(frozen=True)
class RunStart:
    """What a run reads before it measures anything (:meth:`now`): the command, the code measured, the clock
    and the machine's load average."""

    command: str
    provenance: dict[str, Any]
    started_at: datetime.datetime
    started: float  # time.monotonic()
    load_start: tuple[float, float, float]

    @classmethod
    def now(cls, argv: list[str]) -> RunStart:
        """The start of ``python -m bench *argv``, now."""
        return cls(
            "python -m bench " + " ".join(argv),
            provenance(),
            datetime.datetime.now(datetime.timezone.utc),
            time.monotonic(),
            os.getloadavg(),
        )

    def meta(self) -> dict[str, Any]:
        """The results' ``meta`` at the run's end: when and how long, on what machine under what load (at the
        start and now), and the code measured."""
        return {
            "command": self.command,
            "started_at": self.started_at.isoformat(timespec="seconds"),
            "elapsed_s": time.monotonic() - self.started,
            "cpus": os.cpu_count(),
            "machine": platform.platform(),
            "python": platform.python_version(),
            "load_start": _loads(self.load_start),
            "load_end": _loads(os.getloadavg()),
            **self.provenance,
        }
