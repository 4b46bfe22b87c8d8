"""Helpers for the test DAGs: where a test wants markers written, and the test's schema."""

from __future__ import annotations

import os
import time
from pathlib import Path


def marker_dir() -> Path:
    return Path(os.environ["LEASE_TEST_MARKERS"])


def mark(name: str, text: str = "") -> None:
    (marker_dir() / name).write_text(text or str(time.time()))


def wait_for(name: str, timeout: float = 90) -> None:
    end = time.time() + timeout
    while not (marker_dir() / name).exists():
        if time.time() > end:
            raise TimeoutError(f"marker {name} never appeared")
        time.sleep(0.1)
