"""A throwaway PostgreSQL cluster for the scale profile: ``initdb`` + ``pg_ctl`` into a temp directory.

The machine's own server (5432) is never touched: the cluster gets its own data directory under
``/tmp``, its own port on 127.0.0.1, its own socket directory, and is stopped and deleted afterwards.
``initdb`` refuses to run as root, so as root the cluster runs as the ``postgres`` OS user (``nobody`` where
there is none).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg2

from demo.deployment import free_port

PG_BIN = Path(os.environ.get("LEASE_BENCH_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _unprivileged() -> str:
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("no unprivileged user (postgres or nobody) to run initdb as")


class ThrowawayCluster:
    """A private PostgreSQL server; :meth:`start` returns its DSN, :meth:`cleanup` stops and deletes it."""

    def __init__(self, settings: dict[str, str], pg_bin: Path | None = None) -> None:
        self.settings = settings
        self.pg_bin = pg_bin or PG_BIN
        self.root = Path(tempfile.mkdtemp(prefix="lease-scale-pg-", dir="/tmp"))
        self.root.chmod(0o755)
        self.data = self.root / "data"
        self.port = free_port()
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = _unprivileged()
            uid = pwd.getpwnam(self._user).pw_uid
            os.chown(self.root, uid, -1)
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._started = False

    def _run(self, *args: str) -> None:
        cmd = [str(self.pg_bin / args[0]), *args[1:]]
        if self._user is not None:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({result.returncode}): {result.stderr[-2000:]}")

    def start(self) -> str:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        conf = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            **self.settings,
        }
        with (self.data / "postgresql.conf").open("a") as fh:
            for key, value in conf.items():
                fh.write(f"{key} = {value}\n")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")
        self._started = True
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg2.connect(self.dsn, connect_timeout=2).close()
                return self.dsn
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def describe(self) -> dict[str, Any]:
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT current_setting('server_version'), current_setting('max_connections'), "
                "current_setting('superuser_reserved_connections')"
            )
            version, max_connections, reserved = cur.fetchone()
        conn.close()
        return {
            "server_version": version,
            "max_connections": int(max_connections),
            "superuser_reserved_connections": int(reserved),
            "where": f"throwaway cluster ({self.pg_bin}/initdb + pg_ctl) at 127.0.0.1:{self.port}",
        }

    def cleanup(self) -> None:
        try:
            if self._started:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
