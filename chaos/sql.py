"""The harness's own tables on its private server: the publish target and the ground-truth audit.

The audit triggers write one row per committed change of a lease or fence row, in the same transaction
as the change, so the audit holds exactly what the database committed: including the effects of calls
whose reply a worker never saw (a killed session, a killed server), which a client-side history alone
cannot know. Names are always composed with ``psycopg2.sql.Identifier``.
"""

from __future__ import annotations

from typing import Any

from psycopg2 import sql

#: The store's schema on the private server, and the harness's own.
LEASE_SCHEMA = "chaos_lease"
CHAOS_SCHEMA = "chaos"

_DDL = """
CREATE SCHEMA IF NOT EXISTS {chaos};

CREATE TABLE {chaos}.target (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    resource  text        NOT NULL,
    key       text        NOT NULL,
    token     bigint      NOT NULL,
    owner     text        NOT NULL,
    worker    integer     NOT NULL,
    idem      text,
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE {chaos}.audit_lease (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at               timestamptz NOT NULL DEFAULT clock_timestamp(),
    op               text        NOT NULL,
    key              text        NOT NULL,
    owner            text,
    token            bigint,
    acquired_at      timestamptz,
    renewed_at       timestamptz,
    expires_at       timestamptz,
    released_at      timestamptz,
    old_owner        text,
    old_token        bigint,
    old_expires_at   timestamptz,
    old_released_at  timestamptz,
    -- The grant's shape (migrations 12 and 14), read from the row as jsonb so that the trigger works on a
    -- store with more columns (or, for a column a version lacks, records NULL): a semaphore's slot count
    -- and slot, the slot row's key, a replace's run order and the token it took over.
    slots            integer,
    slot             integer,
    slot_of          text,
    run_after        timestamptz,
    replaced_token   bigint,
    -- Every other column of the row, as the store wrote it (e.g. a slot-count epoch).
    extra            jsonb
);

CREATE TABLE {chaos}.audit_fence (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    resource   text        NOT NULL,
    key        text        NOT NULL,
    token      bigint      NOT NULL,
    owner      text,
    old_token  bigint
);

CREATE FUNCTION {chaos}.audit_lease() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    new_row jsonb := to_jsonb(NEW);
BEGIN
    INSERT INTO {chaos}.audit_lease (op, key, owner, token, acquired_at, renewed_at, expires_at, released_at,
                                     old_owner, old_token, old_expires_at, old_released_at,
                                     slots, slot, slot_of, run_after, replaced_token, extra)
    VALUES (TG_OP, NEW.key, NEW.owner, NEW.token, NEW.acquired_at, NEW.renewed_at, NEW.expires_at,
            NEW.released_at,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.owner END, CASE WHEN TG_OP = 'UPDATE' THEN OLD.token END,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.expires_at END, CASE WHEN TG_OP = 'UPDATE' THEN OLD.released_at END,
            (new_row->>'slots')::integer, (new_row->>'slot')::integer, new_row->>'slot_of',
            (new_row->>'run_after')::timestamptz, (new_row->>'replaced_token')::bigint,
            new_row - ARRAY['key', 'owner', 'token', 'ttl', 'acquired_at', 'renewed_at', 'expires_at',
                            'released_at', 'dag_id', 'run_id', 'task_id', 'map_index', 'slots', 'slot',
                            'slot_of', 'run_after', 'replaced_token']);
    RETURN NULL;
END $$;

CREATE FUNCTION {chaos}.audit_fence() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {chaos}.audit_fence (resource, key, token, owner, old_token)
    VALUES (NEW.resource, NEW.key, NEW.token, NEW.owner, CASE WHEN TG_OP = 'UPDATE' THEN OLD.token END);
    RETURN NULL;
END $$;

CREATE TRIGGER chaos_audit AFTER INSERT OR UPDATE ON {lease}.lease
    FOR EACH ROW EXECUTE FUNCTION {chaos}.audit_lease();
CREATE TRIGGER chaos_audit AFTER INSERT OR UPDATE ON {lease}.fence
    FOR EACH ROW EXECUTE FUNCTION {chaos}.audit_fence();
"""


def names(lease_schema: str = LEASE_SCHEMA, chaos_schema: str = CHAOS_SCHEMA) -> dict[str, Any]:
    return {"lease": sql.Identifier(lease_schema), "chaos": sql.Identifier(chaos_schema)}


def ddl(lease_schema: str = LEASE_SCHEMA, chaos_schema: str = CHAOS_SCHEMA) -> sql.Composed:
    return sql.SQL(_DDL).format(**names(lease_schema, chaos_schema))


def insert_target(chaos_schema: str = CHAOS_SCHEMA) -> sql.Composed:
    return sql.SQL(
        "INSERT INTO {}.target (resource, key, token, owner, worker, idem) "
        "VALUES (%(resource)s, %(key)s, %(token)s, %(owner)s, %(worker)s, %(idem)s) RETURNING at"
    ).format(sql.Identifier(chaos_schema))


def dump_queries(lease_schema: str = LEASE_SCHEMA, chaos_schema: str = CHAOS_SCHEMA) -> dict[str, sql.Composed]:
    """Ground truth, read once the run is over: record type -> query."""
    n = names(lease_schema, chaos_schema)
    return {
        "audit_lease": sql.SQL(
            "SELECT id, at, op, key, owner, token, acquired_at, renewed_at, expires_at, released_at, "
            "old_owner, old_token, old_expires_at, old_released_at, slots, slot, slot_of, run_after, "
            "replaced_token, extra FROM {chaos}.audit_lease ORDER BY id"
        ).format(**n),
        "audit_fence": sql.SQL(
            "SELECT id, at, resource, key, token, owner, old_token, "
            "pg_xact_commit_timestamp(xmin) AS committed_at FROM {chaos}.audit_fence ORDER BY id"
        ).format(**n),
        # committed_at: when the publish's transaction committed (track_commit_timestamp, set by the
        # harness): publishes under different fence keys are not serialized by one row lock, so only the
        # commit order says which one a later reader of the target saw first.
        "target": sql.SQL(
            "SELECT id, resource, key, token, owner, worker, idem, at, "
            "pg_xact_commit_timestamp(xmin) AS committed_at FROM {chaos}.target ORDER BY id"
        ).format(**n),
        "final_lease": sql.SQL(
            "SELECT key, owner, token, expires_at, released_at FROM {lease}.lease ORDER BY key"
        ).format(**n),
    }


def lock_table(schema: str, table: str) -> sql.Composed:
    return sql.SQL("LOCK TABLE {}.{} IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(schema), sql.Identifier(table))


def holders(lease_schema: str = LEASE_SCHEMA) -> sql.Composed:
    return sql.SQL(
        "SELECT owner, key, token FROM {}.lease WHERE expires_at > clock_timestamp() AND released_at IS NULL"
    ).format(sql.Identifier(lease_schema))


def waiters(lease_schema: str = LEASE_SCHEMA) -> sql.Composed:
    """The live waiting places' owners and keys (the nemesis pauses a waiter too)."""
    return sql.SQL(
        "SELECT owner, key FROM {}.lease_waiter WHERE expires_at > clock_timestamp()"
    ).format(sql.Identifier(lease_schema))
