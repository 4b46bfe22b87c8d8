"""Helpers for the test DAGs: where a test wants markers written, and the test's schema."""

from __future__ import annotations

import os
import time
from pathlib import Path


def marker_dir() -> Path:
    return Path(os.environ["LEASE_TEST_MARKERS"])


def mark(name: str, text: str = "") -> None:
    """Write a marker whole: a test that sees it exist reads its text (written to a temporary name first
    and renamed, so never an empty file a test read between the create and the write)."""
    path = marker_dir() / name
    part = path.with_name(f".{name}.{os.getpid()}.part")
    part.write_text(text or str(time.time()))
    os.replace(part, path)


def wait_for(name: str, timeout: float = 90) -> None:
    end = time.time() + timeout
    while not (marker_dir() / name).exists():
        if time.time() > end:
            raise TimeoutError(f"marker {name} never appeared")
        time.sleep(0.1)
