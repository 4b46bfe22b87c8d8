"""Which code a benchmark measured: HEAD and any uncommitted change to the package, read at the start.

Shared by the grid (``bench/run.py``) and the scale profile (``bench/scale.py``), which ``bench/run.py``
dispatches to; kept in a module of its own so that neither imports the other back.
"""

from __future__ import annotations

import subprocess
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
