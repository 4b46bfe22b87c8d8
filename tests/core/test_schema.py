"""Migrations: applying them all equals schema.sql, and a store migrates itself on first use."""

from __future__ import annotations

from datetime import timedelta

import psycopg2
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import FenceStore, LeaseStore, SchemaError
from airflow_lease_provider.core.db import Database
from airflow_lease_provider.core.schema import (
    create_current_schema,
    ensure_schema,
    latest_version,
    migrations,
)
from tests.pg import drop_schema, execute, new_schema_name, q, store_at_version

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
        SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid), p.prosrc,
               p.proconfig, p.provolatile
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s ORDER BY 1, 2""",
}

#: The functions every lease and fence call runs: no SET clause (migrations/0009), every name qualified.
HOT_FUNCTIONS = {
    "lease_acquire", "lease_acquire_logged", "lease_renew", "lease_release", "lease_release_logged",
    "lease_event_insert", "lease_token_floor", "fence_advance", "fence_token", "lease_acquire_slots",
    "lease_key_state",
}


def _without_comments(body: object) -> str:
    lines = (line.split("--", 1)[0].strip() for line in str(body).splitlines())
    return " ".join(line for line in lines if line)


def _catalog(dsn: str, schema: str) -> dict[str, list]:
    found = {name: execute(dsn, query, (schema,)) for name, query in CATALOG_QUERIES.items()}
    # Function bodies are compared as code: comments and layout may differ between the two files. The
    # bodies and settings name their own schema (migrations/0009), which differs between the two copies.
    # The migrations of version 9 and 10 quote it as quote_ident does (only when needed), schema.sql and
    # the later migrations always (a quoted identifier): both spellings name the same schema.
    spellings = {str(execute(dsn, "SELECT quote_ident(%s)", (schema,))[0][0]), '"' + schema.replace('"', '""') + '"'}

    def own(text: object) -> str:
        text = str(text)
        for quoted in sorted(spellings, key=len, reverse=True):
            text = text.replace(f"{quoted}.", "{schema}.").replace(f"={quoted}", "={schema}")
        return text

    found["functions"] = [
        (*row[:3], own(_without_comments(row[3])), None if row[4] is None else [own(c) for c in row[4]], row[5])
        for row in found["functions"]
    ]
    return found


def test_migrations_equal_schema_sql(pg_dsn: str) -> None:
    """A store upgraded from version 1 by every migration is the store schema.sql creates in one step."""
    migrated, direct = new_schema_name(), new_schema_name()
    try:
        store_at_version(pg_dsn, migrated, 1)
        assert ensure_schema(Database(pg_dsn, schema=migrated)) == latest_version()
        conn = psycopg2.connect(pg_dsn)
        with conn, conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(direct)))
            create_current_schema(cur, direct)
        conn.close()
        a, b = _catalog(pg_dsn, migrated), _catalog(pg_dsn, direct)
        assert a == b
        assert a["columns"], "the comparison saw no tables"
        versions = "SELECT version, name FROM {schema}.schema_version ORDER BY 1"
        assert execute(pg_dsn, q(versions, migrated)) == execute(pg_dsn, q(versions, direct))
    finally:
        drop_schema(pg_dsn, migrated)
        drop_schema(pg_dsn, direct)


def test_hot_functions_pin_no_search_path_and_name_everything(pg_dsn: str, schema: str) -> None:
    """No SET clause on the hot path (migrations/0009): what the functions read and write cannot depend on
    the caller's search_path, so a table named like the store's, first on that path, is never touched."""
    LeaseStore(pg_dsn, schema=schema).ensure_schema()
    rows = execute(
        pg_dsn,
        "SELECT p.proname, p.proconfig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s",
        (schema,),
    )
    config = dict(rows)
    assert HOT_FUNCTIONS <= set(config)
    assert {name: config[name] for name in HOT_FUNCTIONS} == dict.fromkeys(HOT_FUNCTIONS)
    # The rest (an operator's command) still pins its path.
    assert config["lease_epoch_bump"] == [f"search_path={schema}"]


def test_a_callers_search_path_and_temp_tables_change_nothing(pg_dsn: str, schema: str) -> None:
    """The caller's session (behind pgbouncer: any client's) puts a schema with tables named like the
    store's first on its search_path, and has temporary ones too (searched first for tables): every lease
    and fence call still reads and writes the store's own tables, and the decoys stay empty."""
    decoy = new_schema_name()
    tables = ("lease", "event", "fence", "fence_publish", "lease_epoch")
    LeaseStore(pg_dsn, schema=schema).ensure_schema()
    try:
        execute(pg_dsn, sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(decoy)))
        for table in tables:
            execute(pg_dsn, sql.SQL("CREATE TABLE {}.{} (LIKE {}.{})").format(
                sql.Identifier(decoy), sql.Identifier(table), sql.Identifier(schema), sql.Identifier(table)))
        joiner = "&" if "?" in pg_dsn else "?"
        store = LeaseStore(f"{pg_dsn}{joiner}options=-csearch_path%3D{decoy}", schema=schema)
        fences = FenceStore(f"{pg_dsn}{joiner}options=-csearch_path%3D{decoy}", schema=schema)
        conn = store.db._connection()
        with conn.cursor() as cur:
            cur.execute("SHOW search_path")
            assert cur.fetchone()[0] == decoy
            for table in tables:
                cur.execute(sql.SQL("CREATE TEMP TABLE {} (LIKE {}.{})").format(
                    sql.Identifier(table), sql.Identifier(schema), sql.Identifier(table)))
        lease = store.acquire("k", "o", timedelta(seconds=30))
        assert lease is not None and lease.token == 1
        holder = store.try_acquire("k", "other", timedelta(seconds=30)).holder
        assert holder is not None and (holder.owner, holder.token) == ("o", 1)
        renewed = store.renew(lease)
        assert renewed is not None
        assert store.release(renewed)
        assert fences.advance("r", lease.token, key="k", idempotency_key="i").accepted
        assert not fences.advance("r", lease.token, key="k").accepted
        assert fences.current("r", key="k") == lease.token
        with conn.cursor() as cur:
            for table in tables:
                cur.execute(sql.SQL("SELECT count(*) FROM pg_temp.{}").format(sql.Identifier(table)))
                assert cur.fetchone()[0] == 0, table
        for table in tables:
            assert execute(pg_dsn, sql.SQL("SELECT count(*) FROM {}.{}").format(
                sql.Identifier(decoy), sql.Identifier(table))) == [(0,)], table
        own = {t: execute(pg_dsn, sql.SQL("SELECT count(*) FROM {}.{}").format(
            sql.Identifier(schema), sql.Identifier(t)))[0][0] for t in tables}
        assert own == {"lease": 1, "event": 3, "fence": 1, "fence_publish": 1, "lease_epoch": 1}
        store.close()
        fences.close()
    finally:
        drop_schema(pg_dsn, decoy)


def test_migrations_are_numbered_once_each_from_one() -> None:
    # Gaps are tolerated (a branch's number is the lead's to give; the lead renumbers at merge).
    versions = [m.version for m in migrations()]
    assert versions[0] == 1 and versions == sorted(set(versions))


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
