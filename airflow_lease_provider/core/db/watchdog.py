"""The watchdog: one daemon thread per process that cuts off statements the server never answers, and
closes idle connections (``idle_close``)."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Protocol

from airflow_lease_provider.core.db import pool

log = logging.getLogger("airflow_lease_provider.core.db")


class Watched(Protocol):
    """What the watchdog reads and does of a store's connection (:class:`~.database.Database`)."""

    idle_close: timedelta | None
    where: str
    _conn: Any
    _inflight: tuple[float, int] | None
    _cut_off: bool

    def _close_if_idle(self, now: float) -> None: ...


class _Watchdog:
    """One daemon thread per process that cuts off statements the server never answers.

    ``statement_timeout`` is enforced by the server; a server that is frozen, or a pooler that holds the
    query while its own server is down, leaves the client waiting in ``recv()`` for as long as that
    lasts. Each :class:`Database` publishes its one in-flight statement as ``(deadline, fd)`` (a plain
    attribute write, nothing on the hot path takes a lock); four times a second this thread looks, and
    past a deadline shuts that socket down, so the blocked call fails at once and the caller fails closed.

    On the same tick it closes the connection of a store opened with a positive ``idle_close`` that
    nobody has used for that long (``idle_close == 0`` closes it as each operation ends), so an idle
    lease (between two renewals) holds no server connection.
    """

    TICK = 0.25

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: weakref.WeakSet[Watched] = weakref.WeakSet()
        self._pid = 0
        self._thread: threading.Thread | None = None

    def watch(self, db: Watched) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: it needs a thread of its own
                self._pid = os.getpid()
                self._watched = weakref.WeakSet()
                self._thread = None
            if self._thread is None or not self._thread.is_alive():
                # Also after a death the tick's guard did not prevent (it cannot be left without a watchdog).
                self._thread = threading.Thread(target=self._run, name="lease-store-watchdog", daemon=True)
                self._thread.start()
            self._watched.add(db)

    def _run(self) -> None:
        while True:
            _pause(self.TICK)
            try:
                self.tick(time.monotonic())
            except Exception:  # one store's failure must not take the bound away from every other store
                log.exception("lease store watchdog: a tick failed; the next one runs as usual")

    def tick(self, now: float) -> None:
        with self._lock:
            watched = list(self._watched)
        for db in watched:
            inflight = db._inflight
            if inflight is not None and inflight[0] <= now:
                db._inflight = None
                db._cut_off = True
                _shutdown(inflight[1])
            elif db.idle_close and db._conn is not None:
                try:
                    db._close_if_idle(now)
                except Exception:
                    log.exception("lease store watchdog: closing an idle connection to %s failed", db.where)
        pool.reap_all(now)  # pooled connections unused for pool.LINGER s


def _pause(seconds: float) -> None:
    """``time.sleep`` that cannot end the watchdog: under a faked clock (libfaketime) ``clock_nanosleep``
    can fail with ``EINVAL``; ``select`` takes a relative timeout instead."""
    try:
        time.sleep(seconds)
    except OSError:
        select.select([], [], [], seconds)


def _shutdown(fd: int) -> None:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return  # already closed: nothing is blocked on it
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


#: The process's one watchdog (every Database publishes its statements to it).
watchdog = _Watchdog()


def _after_fork_in_child() -> None:
    # The watchdog thread of the parent may have held the lock at fork() (a tick copies the watched set
    # under it); it does not exist in the child, so the child's first watch() would wait for ever.
    watchdog._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
