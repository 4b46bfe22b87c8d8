"""Migrations: applying them all equals schema.sql, and a store migrates itself on first use."""

from __future__ import annotations

import psycopg2
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import LeaseStore, SchemaError
from airflow_lease_provider.core.db import Database
from airflow_lease_provider.core.schema import current_schema_sql, ensure_schema, latest_version, migrations
from tests.pg import drop_schema, execute, new_schema_name, q

CATALOG_QUERIES = {
    "columns": """
        SELECT table_name, column_name, data_type, is_nullable, column_default, ordinal_position
          FROM information_schema.columns WHERE table_schema = %s ORDER BY 1, 6""",
    "constraints": """
        SELECT rel.relname, con.contype, pg_get_constraintdef(con.oid)
          FROM pg_constraint con JOIN pg_class rel ON rel.oid = con.conrelid
          JOIN pg_namespace n ON n.oid = rel.relnamespace WHERE n.nspname = %s ORDER BY 1, 2, 3""",
    "indexes": """
        SELECT tablename, indexname, regexp_replace(indexdef, ' ON \\S+\\.', ' ON ')
          FROM pg_indexes WHERE schemaname = %s ORDER BY 1, 2""",
    "reloptions": """
        SELECT c.relname, c.relkind, c.reloptions FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid), p.prosrc
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s ORDER BY 1""",
}


def _without_comments(body: object) -> str:
    lines = (line.split("--", 1)[0].strip() for line in str(body).splitlines())
    return " ".join(line for line in lines if line)


def _catalog(dsn: str, schema: str) -> dict[str, list]:
    found = {name: execute(dsn, query, (schema,)) for name, query in CATALOG_QUERIES.items()}
    # Function bodies are compared as code: comments and layout may differ between the two files.
    found["functions"] = [(*row[:3], _without_comments(row[3])) for row in found["functions"]]
    return found


def test_migrations_equal_schema_sql(pg_dsn: str) -> None:
    migrated, direct = new_schema_name(), new_schema_name()
    try:
        ensure_schema(Database(pg_dsn, schema=migrated))
        conn = psycopg2.connect(pg_dsn)
        with conn, conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(direct)))
            cur.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(direct)))
            cur.execute(current_schema_sql())
        conn.close()
        a, b = _catalog(pg_dsn, migrated), _catalog(pg_dsn, direct)
        # The migrated schema also has the version table; schema.sql describes the store's own objects.
        for part in a:
            a[part] = [row for row in a[part] if "schema_version" not in str(row[0])]
        assert a == b
        assert a["columns"], "the comparison saw no tables"
    finally:
        drop_schema(pg_dsn, migrated)
        drop_schema(pg_dsn, direct)


def test_migrations_are_numbered_without_gaps() -> None:
    assert [m.version for m in migrations()] == list(range(1, latest_version() + 1))


def test_store_creates_its_schema_on_first_use_and_is_idempotent(pg_dsn: str, schema: str) -> None:
    store = LeaseStore(pg_dsn, schema=schema)
    assert execute(pg_dsn, "SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)) == []
    store.holder("anything")
    assert execute(pg_dsn, "SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)) == [(1,)]
    assert LeaseStore(pg_dsn, schema=schema).ensure_schema() == latest_version()


def test_a_newer_schema_is_refused(pg_dsn: str, schema: str) -> None:
    LeaseStore(pg_dsn, schema=schema).ensure_schema()
    execute(pg_dsn, q('INSERT INTO {schema}.schema_version (version, name) VALUES (999, %s)', schema), ("future",))
    with pytest.raises(SchemaError, match="newer"):
        LeaseStore(pg_dsn, schema=schema).holder("x")
