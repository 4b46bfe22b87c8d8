"""Test processes of their own, without each importing the world again."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing import forkserver


@contextlib.contextmanager
def processes(*preload: str) -> Iterator[mp.context.ForkServerContext]:
    """A multiprocessing context whose processes are forked from a server process that imported ``preload``
    (the test module whose functions they run) once.

    Each is a process of its own (its own interpreter state, its own connections, its own pid), as a spawned
    one is, without importing its modules again: ~0.35 CPU s a process for the store alone, ~2 with Airflow.
    The fork server is a fresh, single-threaded interpreter, not the test process (whose threads and
    connections a plain fork would copy). It is stopped and reaped at the end, so its CPU and its
    children's count as the test's (tests/conftest.py's per-file figures read RUSAGE_CHILDREN)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    try:
        yield ctx
    finally:
        forkserver._forkserver._stop()  # private, but in every Python we support (3.10-3.13): its own tests use it
