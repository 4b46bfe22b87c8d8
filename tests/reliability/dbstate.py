"""Snapshots of what a store has written, and of the catalog, to prove "nothing changed"."""

from __future__ import annotations

from typing import Any

import psycopg2
from psycopg2 import sql

#: The store's tables always listed (empty when the schema is absent). Every other table of the schema
#: (the waiting places, the lease API's kept grants, the epochs, the schema version, and any table a later
#: migration adds) is compared too, listed once it has a row, so a new table cannot be left out.
STORE_TABLES = ("lease", "fence", "fence_count_epoch", "fence_publish", "event")


class Rows:
    """Reads every row of a store's tables over one connection of its own (an absent schema reads empty)."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.schema = schema
        self.conn = psycopg2.connect(dsn)
        self.conn.autocommit = True

    def __call__(self) -> dict[str, list[tuple[Any, ...]]]:
        out: dict[str, list[tuple[Any, ...]]] = {}
        with self.conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.schema,))
            exists = cur.fetchone() is not None
            tables = list(STORE_TABLES)
            if exists:
                cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY tablename", (self.schema,))
                tables += [name for (name,) in cur.fetchall() if name not in STORE_TABLES]
            for table in tables:
                if not exists:
                    out[table] = []
                    continue
                cur.execute(sql.SQL("SELECT * FROM {}.{}").format(sql.Identifier(self.schema), sql.Identifier(table)))
                rows = sorted(cur.fetchall(), key=repr)
                if rows or table in STORE_TABLES:
                    out[table] = rows
        return out

    def close(self) -> None:
        self.conn.close()


#: Server-wide names whose existence is compared: the test server's own and the payloads' targets.
WATCHED = ("postgres", "test", "template0", "template1", "lease_evil")

_CATALOG = {
    "relations": "SELECT c.relname, c.relkind, c.relpersistence, c.reloptions::text FROM pg_class c "
                 "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s",
    "columns": "SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull FROM pg_attribute a "
               "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
               "WHERE n.nspname = %(schema)s AND a.attnum > 0 AND NOT a.attisdropped",
    "constraints": "SELECT conname, contype, pg_get_constraintdef(k.oid) FROM pg_constraint k "
                   "JOIN pg_namespace n ON n.oid = k.connamespace WHERE n.nspname = %(schema)s",
    "functions": "SELECT p.proname, md5(p.prosrc), p.proconfig::text FROM pg_proc p "
                 "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %(schema)s",
    "triggers": "SELECT t.tgname, c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s",
    "privileges": "SELECT c.relname, c.relacl::text FROM pg_class c "
                  "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s",
    "schema": "SELECT nspname, nspacl::text FROM pg_namespace WHERE nspname = %(schema)s",
    # Server-wide objects: other test files running at the same time create and drop their own
    # databases and (non-superuser) roles, so what is compared is what an injection would touch: the
    # superusers, the databases that were there before any test, and the names the payloads use.
    "roles": "SELECT rolname, rolsuper, rolcanlogin FROM pg_roles "
             "WHERE rolsuper OR rolname LIKE 'pg\\_%%' OR rolname = ANY(%(watched)s)",
    "databases": "SELECT datname FROM pg_database WHERE datname = ANY(%(watched)s)",
    "settings": "SELECT name, setting FROM pg_settings WHERE source NOT IN ('default', 'session', 'client') "
                "AND name NOT LIKE 'application_name'",
}


def catalog(dsn: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """The catalog of one schema, plus the server-wide objects an injection would go for.

    Other schemas are left out: a shared test server has other suites creating and dropping theirs.
    """
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            out = {}
            for name, query in _CATALOG.items():
                cur.execute(query, {"schema": schema, "watched": list(WATCHED)})
                out[name] = sorted(cur.fetchall(), key=repr)
            return out
    finally:
        conn.close()
