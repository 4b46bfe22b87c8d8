"""A small per-process connection reuse for stores that give their connection up after each operation.

A store opened with ``idle_close=timedelta(0)`` (what the Airflow hooks use) connects for every
operation: a thousand keepers in one process renewing at once are a thousand connects, each a backend
fork on the server, and a burst of them overruns the server's listen queue (clients then wait out
``connect_timeout`` and fail closed although the server had room). With ``Database(pool_size=n)`` the
stores of one process that point at the same server take their connection from a shared set of at most
``n`` instead, and give it back when their operation ends:

* a connection is only ever used by one operation at a time, and goes back only when it is clean:
  open, in autocommit, and outside any transaction (the store's settings travel as ``SET LOCAL``; its
  advisory locks are transaction-scoped; its prepared statements are found missing or present by name
  and handled as on a pooler's session: nothing of one operation's session state reaches the next);
* a connection that nobody takes again within :data:`LINGER` seconds is closed (the watchdog's tick),
  so a process whose leases are idle between renewals holds no server connection;
* waiting for one of the ``n`` is bounded by the store's ``connect_timeout`` and then fails closed
  (:class:`~airflow_lease_provider.core.errors.LeaseStoreUnavailable`), like an unreachable server;
* after ``fork()`` the child starts with no pool of its own and never touches the parent's connections.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import psycopg2.extensions

from airflow_lease_provider.core.errors import LeaseStoreUnavailable

#: Seconds an unused connection stays open in the pool before it is closed.
LINGER = 1.0

_registry_lock = threading.Lock()
_registry: dict[Hashable, ConnectionPool] = {}
_registry_pid = os.getpid()
#: Connections inherited through fork(): kept referenced so that garbage collection in the child never
#: closes them (closing sends the server a Terminate for the parent's session).
_inherited: list[Any] = []


class ConnectionPool:
    """At most ``size`` connections to one server, shared by the stores of this process."""

    def __init__(self, size: int, where: str) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"pool size must be a whole number of at least 1, not {size!r}")
        self.size = size
        self.where = where
        self._cond = threading.Condition(threading.Lock())
        self._idle: list[tuple[Any, float]] = []  # (connection, monotonic time it was given back)
        self._open = 0  # connections in use plus idle ones, and connects under way
        self.connects = 0
        self.reuses = 0

    @property
    def open(self) -> int:
        """Connections counted against ``size`` (in use, idle, being made), read under the pool's lock,
        under which connections are also closed: one whose server backend is gone is not counted."""
        with self._cond:
            return self._open

    def get(self, connect: Callable[[], Any], timeout: float) -> tuple[Any, bool]:
        """A connection and whether it is new: an idle one, else a new one while fewer than ``size`` are
        open, else the first given back within ``timeout`` seconds (then LeaseStoreUnavailable)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                now = time.monotonic()
                self._reap_locked(now)
                if self._idle:
                    conn, _ = self._idle.pop()  # the most recently used: the others age out
                    self.reuses += 1
                    return conn, False
                if self._open < self.size:
                    self._open += 1
                    break
                if now >= deadline or not self._cond.wait(deadline - now):
                    if not self._idle and self._open >= self.size:
                        raise LeaseStoreUnavailable(
                            f"lease store at {self.where}: all {self.size} connections of this process's pool "
                            f"stayed in use for {timeout:g} s"
                        )
        try:
            conn = connect()
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise
        with self._cond:
            self.connects += 1
        return conn, True

    def put(self, conn: Any) -> None:
        """Give a connection back after an operation; one that is not clean is closed instead."""
        clean = (
            not conn.closed
            and conn.autocommit
            and conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
        )
        if not clean:
            self.discard(conn)
            return
        with self._cond:
            self._idle.append((conn, time.monotonic()))
            self._cond.notify()

    def discard(self, conn: Any) -> None:
        """Close a connection taken from the pool (dead, or not clean) and free its place. A dead one
        closes the idle ones too: what killed it (a server restart, a failover) likely killed them."""
        dead = bool(conn.closed)
        with self._cond:
            try:
                conn.close()
            except psycopg2.Error:
                pass
            self._open -= 1
            self._cond.notify()
            if dead:
                self._reap_locked(float("inf"))

    def reap(self, now: float) -> None:
        """Close the connections idle for :data:`LINGER` seconds or more."""
        with self._cond:
            self._reap_locked(now)

    def _reap_locked(self, now: float) -> None:
        keep = []
        for conn, since in self._idle:
            if now - since >= LINGER or conn.closed:
                try:
                    conn.close()
                except psycopg2.Error:
                    pass
                self._open -= 1
                self._cond.notify()
            else:
                keep.append((conn, since))
        self._idle = keep

    def close(self) -> None:
        with self._cond:
            for conn, _ in self._idle:
                try:
                    conn.close()
                except psycopg2.Error:
                    pass
                self._open -= 1
            self._idle = []
            self._cond.notify_all()


def _check_fork() -> None:
    global _registry_pid
    if _registry_pid != os.getpid():  # a forked child: the parent's pools and connections are not ours
        for pool in _registry.values():
            _inherited.extend(conn for conn, _ in pool._idle)
        _registry.clear()
        _registry_pid = os.getpid()


def _after_fork_in_child() -> None:
    # The parent's watchdog thread takes the registry's lock on every tick (reap_all); held at fork(), it
    # would be held for ever in the child, which has no such thread.
    global _registry_lock
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def shared(key: Hashable, size: int, where: str) -> ConnectionPool:
    """This process's pool for ``key`` (the server and connection settings), made on first use; the first
    caller's ``size`` holds for the process."""
    with _registry_lock:
        _check_fork()
        pool = _registry.get(key)
        if pool is None:
            pool = _registry[key] = ConnectionPool(size, where)
        return pool


def reap_all(now: float) -> None:
    """Close every pool's connections idle for :data:`LINGER` seconds (the store watchdog's tick)."""
    with _registry_lock:
        if _registry_pid != os.getpid():
            return
        pools = list(_registry.values())
    for pool in pools:
        pool.reap(now)


def current_pid_pools() -> list[ConnectionPool]:
    """This process's pools (for tests and benchmarks)."""
    with _registry_lock:
        _check_fork()
        return list(_registry.values())
