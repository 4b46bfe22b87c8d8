"""Test PostgreSQL servers: an external one named by ``LEASE_TEST_DSN``, or an embedded one.

Every test gets its own schema (or database) and removes it afterwards, so the suite can share a
server with anything else.
"""

from __future__ import annotations

import os
import shutil
import uuid

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
        self.pg.cleanup()
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
