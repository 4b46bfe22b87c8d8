"""The store's schema: a fresh store is created from ``sql/schema.sql`` in one step; an existing store is
upgraded by the migrations after its version (``sql/migrations/*.sql``). Both run under one advisory
lock, so many processes starting at once create or migrate it exactly once.

Every SQL file is filled in one way: ``{schema}`` becomes the schema's quoted name
(:func:`~airflow_lease_provider.core.db.with_schema`). The migrations before 0011 name no schema and run
with ``search_path`` set to it, as they always did.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from airflow_lease_provider.core.db import Database, LeaseStoreError, names_missing_object, with_schema
from airflow_lease_provider.core.errors import SchemaError

# First key of the two-key advisory lock that serialises migrations; the second is the schema's hash.
_MIGRATION_LOCK_CLASS = 0x1EA5E
_FILE_RE = re.compile(r"^(\d{4})_(\w+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


@cache
def migrations() -> tuple[Migration, ...]:
    """Every migration shipped with the package, in version order."""
    folder = resources.files("airflow_lease_provider.core.sql.migrations")
    found = []
    for entry in folder.iterdir():
        match = _FILE_RE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text()))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    # Unique and increasing from 1. A gap is tolerated: branches get their numbers from the lead, who
    # renumbers them contiguous at merge (a store records each version it applied, so a gap changes nothing).
    if not versions or versions[0] != 1 or len(set(versions)) != len(versions):
        raise SchemaError(f"migrations must be numbered 1..n, each number once, found {versions}")
    return tuple(found)


def latest_version() -> int:
    return migrations()[-1].version


def current_schema_sql() -> str:
    """``schema.sql``: the current schema in one file, kept equal to the migrations by a test; ``{schema}``
    is filled in by :func:`create_current_schema`."""
    return resources.files("airflow_lease_provider.core.sql").joinpath("schema.sql").read_text()


#: The version of the fence-only layout: the store version whose fence it matches. ``fence_schema.sql`` is
#: version 10's; the files of ``sql/fence_migrations`` bring it to this one (a new target runs them all).
FENCE_ONLY_VERSION = 20
#: The version ``fence_schema.sql`` creates.
FENCE_ONLY_BASE = 10


def fence_schema_sql() -> str:
    """``fence_schema.sql``: what a fence needs in a database without a lease store (version 10's layout)."""
    return resources.files("airflow_lease_provider.core.sql").joinpath("fence_schema.sql").read_text()


@cache
def fence_migrations() -> tuple[Migration, ...]:
    """The upgrades of the fence-only layout after :data:`FENCE_ONLY_BASE`, in version order (each numbered
    like the store migration that changed the fence the same way)."""
    folder = resources.files("airflow_lease_provider.core.sql.fence_migrations")
    found = [
        Migration(int(match.group(1)), match.group(2), entry.read_text())
        for entry in folder.iterdir() if (match := _FILE_RE.match(entry.name))
    ]
    found.sort(key=lambda m: m.version)
    if not found or found[-1].version != FENCE_ONLY_VERSION or found[0].version <= FENCE_ONLY_BASE:
        raise SchemaError(f"the fence-only migrations must end at version {FENCE_ONLY_VERSION}, found "
                          f"{[m.version for m in found]}")
    return tuple(found)


def _run(cur: Any, text: str, schema: str, params: Any = None) -> None:
    """Run ``text`` with ``{schema}`` filled in (the one templating scheme of the SQL files)."""
    cur.execute(with_schema(text, schema, cur.connection), params)


def _value(cur: Any, text: str, schema: str, params: Any = None) -> Any:
    """The one value of a one-column, one-row statement (``{schema}`` filled in)."""
    _run(cur, text, schema, params)
    (value,) = cur.fetchone()
    return value


def _has_table(cur: Any, schema: str, table: str) -> bool:
    return bool(_value(cur, "SELECT to_regclass(quote_ident(%s) || '.' || %s) IS NOT NULL", schema, (schema, table)))


def _fence_only_version(cur: Any, schema: str) -> int:
    """The fence-only layout's version in ``schema`` (0: none), read inside the migration lock."""
    if not _has_table(cur, schema, "fence_schema_version"):
        return 0
    return int(_value(cur, "SELECT coalesce(max(version), 0) FROM {schema}.fence_schema_version", schema))


def _create_schema(cur: Any, schema: str) -> None:
    """``CREATE SCHEMA IF NOT EXISTS``, and ``search_path`` set to it for the rest of the transaction."""
    _run(cur, "CREATE SCHEMA IF NOT EXISTS {schema}; SET LOCAL search_path TO {schema}", schema)


def create_current_schema(cur: Any, schema: str) -> None:
    """Create the whole store in ``schema`` (which exists and holds no store) from ``schema.sql``, and
    record every migration's version as applied: a store created at version n is the store the
    migrations make at version n (tests/core/test_schema.py)."""
    _run(cur, current_schema_sql(), schema)
    for migration in migrations():
        _run(cur, "INSERT INTO {schema}.schema_version (version, name) VALUES (%s, %s)", schema,
             (migration.version, migration.name))


def _fence_only_error(db: Database) -> SchemaError:
    return SchemaError(
        f"schema {db.schema!r} at {db.where} holds only fences (made for fenced publishing into this "
        "database), not a lease store: give the lease store a schema of its own (the connection's extra "
        "lease_schema, or [lease] schema), or drop this one if nothing publishes here"
    )


def ensure_fence_schema(db: Database) -> int:
    """In a write target: create only what a fence needs, where no store schema is.

    A schema that holds a whole store already (made by an older version, or the lease store itself) is
    migrated as :func:`ensure_schema` does and used as it is: nothing there is dropped. Returns the
    version of what is there (the store's, or :data:`FENCE_ONLY_VERSION`).
    """
    version = installed_version(db)
    if version:
        return ensure_schema(db)
    with db.transaction() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_MIGRATION_LOCK_CLASS, db.schema))
        whole = _has_table(cur, db.schema, "schema_version")
        if not whole:
            found = _fence_only_version(cur, db.schema)
            if found > FENCE_ONLY_VERSION:
                raise SchemaError(
                    f"the fence in schema {db.schema!r} is at version {found}, newer than this library knows "
                    f"({FENCE_ONLY_VERSION}): upgrade airflow-lease-provider"
                )
            if found == 0:
                _create_schema(cur, db.schema)
                _run(cur, fence_schema_sql(), db.schema)
                _run(cur, "INSERT INTO {schema}.fence_schema_version (version, name) VALUES (%s, 'fence_only')",
                     db.schema, (FENCE_ONLY_BASE,))
                found = FENCE_ONLY_BASE
            for migration in fence_migrations():
                if migration.version > found:
                    _run(cur, migration.sql, db.schema)
                    _run(cur, "INSERT INTO {schema}.fence_schema_version (version, name) VALUES (%s, %s)",
                         db.schema, (migration.version, migration.name))
            return FENCE_ONLY_VERSION
    # A whole store appeared meanwhile (another process made it): migrate it as every user does.
    return ensure_schema(db)


def check_fence_schema(db: Database) -> int:
    """The read-only counterpart of :func:`ensure_fence_schema`."""
    if installed_version(db):
        return check_schema(db)
    with db.transaction() as cur:
        found = _fence_only_version(cur, db.schema)
    if found == 0:
        raise SchemaMissing(f"no fence in schema {db.schema!r} at {db.where}: nothing was created there")
    return found


def installed_version(db: Database) -> int:
    """The schema version in the database; 0 when the schema or its version table does not exist."""
    try:
        rows = db.run("schema_version", {})
    except LeaseStoreError as exc:
        if names_missing_object(exc):  # no schema, or no version table in it
            return 0
        raise
    return int(rows[0]["version"])


class SchemaMissing(SchemaError):
    """A read-only user found no lease store where it points (and created none)."""


def check_schema(db: Database) -> int:
    """The read-only counterpart of :func:`ensure_schema`: never creates a store where there is none.

    A connection or schema that names no lease store (a typo, the wrong database) raises
    :class:`SchemaMissing` and leaves the database as it was. An existing store of an older version is
    migrated like every user migrates it (migrations are additive), so an upgraded api-server can read
    it before the first task runs.
    """
    version = installed_version(db)
    if version == 0:
        with db.transaction() as cur:
            if _fence_only_version(cur, db.schema):
                raise SchemaMissing(str(_fence_only_error(db)))
        raise SchemaMissing(
            f"no lease store in schema {db.schema!r} at {db.where}: nothing was created there. Check the "
            "connection and the schema; a leased task (or LeaseStore.ensure_schema()) creates the store"
        )
    if version == latest_version():
        return version
    return ensure_schema(db)


def ensure_schema(db: Database) -> int:
    """Create or migrate the schema to the latest version. Cheap when it is already current.

    A schema without a store gets the whole of ``schema.sql`` in one step; a store of an older version
    gets the migrations after its version, in order. Concurrent callers serialise on a
    transaction-scoped advisory lock, so ``CREATE SCHEMA``, the creation and each migration run exactly
    once; the others find the work done when they get the lock.
    """
    latest = latest_version()
    version = installed_version(db)
    if version == latest:
        return version
    if version > latest:
        raise SchemaError(
            f"schema {db.schema!r} is at version {version}, newer than this library knows ({latest}): "
            "upgrade airflow-lease-provider"
        )
    with db.transaction() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_MIGRATION_LOCK_CLASS, db.schema))
        if _fence_only_version(cur, db.schema):
            raise _fence_only_error(db)
        _create_schema(cur, db.schema)
        if not _has_table(cur, db.schema, "schema_version"):
            create_current_schema(cur, db.schema)
            return latest
        version = int(_value(cur, "SELECT coalesce(max(version), 0) FROM {schema}.schema_version", db.schema))
        for migration in migrations():
            if migration.version > version:
                _run(cur, migration.sql, db.schema)
                _run(cur, "INSERT INTO {schema}.schema_version (version, name) VALUES (%s, %s)", db.schema,
                     (migration.version, migration.name))
                version = migration.version
    return version


def drop_schema(db: Database) -> None:
    """Remove the schema and everything in it. For tests and uninstalls."""
    with db.transaction() as cur:
        _run(cur, "DROP SCHEMA IF EXISTS {schema} CASCADE", db.schema)
