"""A private pgbouncer in transaction pooling mode, in front of a test server.

Debian's ``pgbouncer`` package; it refuses to run as root, so it runs as the owner of the server's
socket directory (the embedded server's ``pgserver`` user) or as ``postgres`` for a TCP server.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import psycopg2
import psycopg2.extensions

from demo.deployment import free_port

PGBOUNCER = shutil.which("pgbouncer") or next(
    (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
)


def _unprivileged() -> str:
    for user in ("postgres", "nobody"):
        try:
            pwd.getpwnam(user)
            return user
        except KeyError:
            continue
    raise RuntimeError("no unprivileged user (postgres or nobody) to run pgbouncer as")


class PgBouncer:
    """``pgbouncer`` on 127.0.0.1:<free port>, forwarding every database to the server of ``dsn``.

    :param dsn: the real server (libpq URI or key=value string, trust authentication).
    :param settings: extra ``[pgbouncer]`` settings, e.g. ``{"query_wait_timeout": "5"}``.
    """

    def __init__(self, dsn: str, settings: dict[str, str] | None = None) -> None:
        if PGBOUNCER is None:
            raise RuntimeError("pgbouncer is not installed (apt-get install pgbouncer)")
        info = psycopg2.extensions.parse_dsn(dsn)
        self.user = info.get("user") or "postgres"
        self.dbname = info.get("dbname") or "postgres"
        host = info.get("host") or "/var/run/postgresql"
        port = info.get("port") or "5432"
        # pgbouncer will not run as root: use whoever can reach the server's socket, or for TCP any
        # unprivileged user (postgres where PostgreSQL is installed, else nobody).
        run_as = pwd.getpwuid(Path(host).stat().st_uid).pw_name if host.startswith("/") else _unprivileged()
        self.root = Path(tempfile.mkdtemp(prefix="lease-pgb-", dir="/tmp"))
        self.root.chmod(0o755)
        self.port = free_port()
        (self.root / "userlist.txt").write_text(f'"{self.user}" ""\n')
        lines = [
            "[databases]",
            f"* = host={host} port={port}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.root / 'userlist.txt'}",
            "pool_mode = transaction",
            # A small pool, so that consecutive transactions of one client land on different server
            # sessions: anything that relied on session state would break here.
            "default_pool_size = 3",
            "max_client_conn = 200",
            f"logfile = {self.root / 'pgbouncer.log'}",
            "ignore_startup_parameters = extra_float_digits",
            *(f"{k} = {v}" for k, v in (settings or {}).items()),
        ]
        (self.root / "pgbouncer.ini").write_text("\n".join(lines) + "\n")
        uid = pwd.getpwnam(run_as).pw_uid
        for path in self.root.iterdir():
            os.chown(path, uid, -1)
        os.chown(self.root, uid, -1)
        self.proc = subprocess.Popen(
            [PGBOUNCER, "-u", run_as, str(self.root / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.dsn = f"postgresql://{quote(self.user)}@127.0.0.1:{self.port}/{quote(self.dbname)}"
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"pgbouncer did not start: {self.log()}")

    def log(self) -> str:
        path = self.root / "pgbouncer.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
