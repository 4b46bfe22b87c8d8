"""SQL of the baseline arms and of the per-cell table setup.

Every statement names its schema through ``psycopg2.sql.Identifier``; values are always parameters.
The baselines live in the run's own schema next to the store's tables, so dropping the schema at the
end removes everything.
"""

from __future__ import annotations

from psycopg2 import sql

from airflow_lease_provider.core.schema import migrations

# -- baseline tables -----------------------------------------------------------------------------------

# ShedLock's documented table (name/lock_until/locked_at/locked_by, TIMESTAMP columns, default fillfactor).
CREATE_SHEDLOCK = """
CREATE TABLE {schema}.shedlock (
    name        varchar(64)  NOT NULL,
    lock_until  timestamp    NOT NULL,
    locked_at   timestamp    NOT NULL,
    locked_by   varchar(255) NOT NULL,
    PRIMARY KEY (name)
)"""

# The naive read-then-CAS arm uses a copy of the store's lease table (same columns, same fillfactor),
# so the only difference from the project's arm is the protocol: two round trips instead of one.
CREATE_NAIVE = """
CREATE TABLE {schema}.naive_lease (
    key          text        PRIMARY KEY,
    owner        text        NOT NULL,
    token        bigint      NOT NULL CHECK (token > 0),
    ttl          interval    NOT NULL,
    acquired_at  timestamptz NOT NULL,
    renewed_at   timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    released_at  timestamptz
) WITH (fillfactor = 50)"""

# The fence statement of DESIGN decision 8 without the plpgsql wrapper, on a copy of the fence table.
CREATE_RAW_FENCE = """
CREATE TABLE {schema}.raw_fence (
    resource     text        PRIMARY KEY,
    token        bigint      NOT NULL CHECK (token > 0),
    owner        text,
    accepted_at  timestamptz NOT NULL
) WITH (fillfactor = 50)"""

BASELINE_TABLES = (CREATE_SHEDLOCK, CREATE_NAIVE, CREATE_RAW_FENCE)

# -- ShedLock-style statements (the shape of ShedLock's PostgreSQL provider with usingDbTime()) ---------

# One statement: insert the row, or take it over when it has expired. When the WHERE is false,
# PostgreSQL still locks the conflicting row (a LOCK record and a transaction id): the cost measured here.
SHEDLOCK_UPSERT = (
    "INSERT INTO {schema}.shedlock AS s (name, lock_until, locked_at, locked_by) "
    "VALUES (%(name)s, timezone('utc', CURRENT_TIMESTAMP) + make_interval(secs => %(secs)s), timezone('utc', CURRENT_TIMESTAMP), %(by)s) "
    "ON CONFLICT (name) DO UPDATE SET lock_until = timezone('utc', CURRENT_TIMESTAMP) + make_interval(secs => %(secs)s), "
    "locked_at = timezone('utc', CURRENT_TIMESTAMP), locked_by = %(by)s "
    "WHERE s.name = %(name)s AND s.lock_until <= timezone('utc', CURRENT_TIMESTAMP)"
)
# ShedLock's own steady state: once a process has seen the row, it only sends this conditional UPDATE.
SHEDLOCK_UPDATE = (
    "UPDATE {schema}.shedlock SET lock_until = timezone('utc', CURRENT_TIMESTAMP) + make_interval(secs => %(secs)s), "
    "locked_at = timezone('utc', CURRENT_TIMESTAMP), locked_by = %(by)s "
    "WHERE name = %(name)s AND lock_until <= timezone('utc', CURRENT_TIMESTAMP)"
)
SHEDLOCK_EXTEND = (
    "UPDATE {schema}.shedlock SET lock_until = timezone('utc', CURRENT_TIMESTAMP) + make_interval(secs => %(secs)s) "
    "WHERE name = %(name)s AND locked_by = %(by)s AND lock_until > timezone('utc', CURRENT_TIMESTAMP)"
)
# lockAtLeastFor = 0: the CASE of ShedLock's unlock always picks "now".
SHEDLOCK_UNLOCK = (
    "UPDATE {schema}.shedlock SET lock_until = timezone('utc', CURRENT_TIMESTAMP) "
    "WHERE name = %(name)s AND locked_by = %(by)s"
)

# -- naive read-then-compare-and-set (the shape most articles show) --------------------------------------

NAIVE_READ = (
    "SELECT token, owner, expires_at <= clock_timestamp() FROM {schema}.naive_lease WHERE key = %(key)s"
)
NAIVE_CAS = (
    "UPDATE {schema}.naive_lease SET owner = %(owner)s, token = token + 1, ttl = %(ttl)s, "
    "acquired_at = clock_timestamp(), renewed_at = clock_timestamp(), "
    "expires_at = clock_timestamp() + %(ttl)s, released_at = NULL "
    "WHERE key = %(key)s AND token = %(token)s RETURNING token"
)
NAIVE_INSERT = (
    "INSERT INTO {schema}.naive_lease (key, owner, token, ttl, acquired_at, renewed_at, expires_at) "
    "VALUES (%(key)s, %(owner)s, 1, %(ttl)s, clock_timestamp(), clock_timestamp(), "
    "clock_timestamp() + %(ttl)s) ON CONFLICT (key) DO NOTHING RETURNING token"
)
NAIVE_RENEW_READ = (
    "SELECT owner = %(owner)s AND token = %(token)s AND expires_at > clock_timestamp() "
    "FROM {schema}.naive_lease WHERE key = %(key)s"
)
NAIVE_RENEW = (
    "UPDATE {schema}.naive_lease SET renewed_at = clock_timestamp(), "
    "expires_at = clock_timestamp() + %(ttl)s WHERE key = %(key)s AND owner = %(owner)s "
    "AND token = %(token)s"
)
NAIVE_RELEASE = (
    "UPDATE {schema}.naive_lease SET expires_at = LEAST(expires_at, clock_timestamp()), "
    "released_at = clock_timestamp() WHERE key = %(key)s AND owner = %(owner)s AND token = %(token)s"
)

# -- fence baseline: decision 8's single statement --------------------------------------------------------

RAW_FENCE = (
    "INSERT INTO {schema}.raw_fence AS f (resource, token, owner, accepted_at) "
    "VALUES (%(resource)s, %(token)s, %(owner)s, clock_timestamp()) "
    "ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token, owner = EXCLUDED.owner, "
    "accepted_at = EXCLUDED.accepted_at WHERE f.token < EXCLUDED.token RETURNING f.token"
)

# -- floors ------------------------------------------------------------------------------------------------

SELECT_ONE = "SELECT 1"
COMMIT_FLOOR = "SELECT txid_current()"
FLUSH_FLOOR = "SELECT pg_logical_emit_message(true, 'lease-bench', '')"
ADVISORY_TRY_XACT = "SELECT pg_try_advisory_xact_lock(%(lock)s)"

# -- the SQL of version 6 (before issue 15), for before/after arms in the same run -------------------------

# The acquire function of migration 0006 (one CTE: UPDATE, INSERT and holder branches, the token floor
# computed on every call) under another name, and the renew statement the core sent before migration
# 0008 (parsed and planned on every call). The arms send them through the library's own code path.
BEFORE_ACQUIRE_NAME = "bench_lease_acquire_v6"
BEFORE_ACQUIRE_CALL = "SELECT * FROM {schema}.bench_lease_acquire_v6(%(key)s, %(owner)s, %(ttl)s)"
BEFORE_RENEW = (
    "UPDATE {schema}.lease AS l "
    "SET renewed_at = clock_timestamp(), expires_at = clock_timestamp() + %(ttl)s, ttl = %(ttl)s "
    "WHERE l.key = %(key)s AND l.owner = %(owner)s AND l.token = %(token)s "
    "AND l.expires_at > clock_timestamp() AND l.released_at IS NULL "
    "RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at, "
    "clock_timestamp() AS observed_at"
)


# How the store sent renew from migration 0008 until the renew UPDATE itself was prepared: a call of the
# lease_renew() function (the same UPDATE inside plpgsql), prepared as the store prepares its statements.
FUNCTION_RENEW = "SELECT * FROM {schema}.lease_renew(%(key)s, %(owner)s, %(token)s, %(ttl)s)"


# Migration 0008's acquire (read first, then UPDATE, then INSERT) with its `SET search_path FROM CURRENT`,
# which migration 0009 removed: the before half of the pgbench pair that measures that clause alone.
V8_ACQUIRE_NAME = "bench_lease_acquire_v8"
V8_ACQUIRE_CALL = "SELECT * FROM {schema}.bench_lease_acquire_v8(%(key)s, %(owner)s, %(ttl)s)"
# The least a statement that answers a held key with its holder can cost: one index lookup that returns the
# row acquire returns (the same columns and conditions as lease_acquire's first read), nothing else.
HOLDER_ROW_FLOOR = """SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at,
       l.released_at, clock_timestamp()
  FROM {schema}.lease l
 WHERE l.key = %(key)s AND l.expires_at > clock_timestamp() AND l.owner <> %(owner)s"""


def _renamed_acquire(version: int, name: str) -> str:
    text = migration_text(version)
    start = text.index("CREATE OR REPLACE FUNCTION lease_acquire")
    end = text.index("$$;", text.index("BEGIN", start)) + 3
    return text[start:end].replace("FUNCTION lease_acquire(", f"FUNCTION {name}(", 1)


def before_acquire_function() -> str:
    """Migration 0006's ``lease_acquire``, renamed; run with ``search_path`` set to the run's schema."""
    return _renamed_acquire(6, BEFORE_ACQUIRE_NAME)


def v8_acquire_function() -> str:
    """Migration 0008's ``lease_acquire`` (with its SET clause), renamed; run like :func:`before_acquire_function`."""
    return _renamed_acquire(8, V8_ACQUIRE_NAME)


def migration_text(version: int) -> str:
    return next(m.sql for m in migrations() if m.version == version)


# -- per-cell setup (coordinator) ----------------------------------------------------------------------------

# The keys to seed, generated in the server: a success-path pool of tens of thousands of keys is then
# one short statement. The names match arms.pool_key() and arms.many_key().
POOL_KEYS = (
    "SELECT 's' || w || '-' || n FROM generate_series(0, %(clients)s - 1) AS w, "
    "generate_series(0, %(pool)s - 1) AS n"
)
MANY_KEYS = "SELECT 'k' || n FROM generate_series(0, %(count)s - 1) AS n"
ONE_KEY = "SELECT %(key)s::text"

# Free (expired and released) leases: what the success path, hand-off and 10k-key scenarios take.
SEED_LEASE_ROWS = """
INSERT INTO {schema}.{table} (key, owner, token, ttl, acquired_at, renewed_at, expires_at, released_at)
SELECT k, 'seed', 1, interval '60 seconds', clock_timestamp() - interval '2 hours',
       clock_timestamp() - interval '2 hours', clock_timestamp() - interval '1 hour',
       clock_timestamp() - interval '1 hour'
  FROM ({keys}) AS keys (k)"""
SEED_HELD_LEASE = """
INSERT INTO {schema}.{table} (key, owner, token, ttl, acquired_at, renewed_at, expires_at)
VALUES (%(key)s, 'holder', 1, interval '1 hour', clock_timestamp(), clock_timestamp(),
        clock_timestamp() + interval '1 hour')"""
SEED_SHEDLOCK_ROWS = """
INSERT INTO {schema}.shedlock (name, lock_until, locked_at, locked_by)
SELECT k, timezone('utc', CURRENT_TIMESTAMP) - interval '1 hour',
       timezone('utc', CURRENT_TIMESTAMP) - interval '2 hours', 'seed'
  FROM ({keys}) AS keys (k)"""
SEED_HELD_SHEDLOCK = """
INSERT INTO {schema}.shedlock (name, lock_until, locked_at, locked_by)
VALUES (%(key)s, timezone('utc', CURRENT_TIMESTAMP) + interval '1 hour',
        timezone('utc', CURRENT_TIMESTAMP), 'holder')"""


def compose(text: str, schema: str, *, keys: str | None = None, **names: str) -> sql.Composed:
    """``text`` with ``{schema}`` (and any other ``{name}``) filled in as quoted identifiers.

    :param keys: one of the constant key queries above, for ``{keys}`` (never built from input).
    """
    parts: dict[str, sql.Composable] = {key: sql.Identifier(value) for key, value in names.items()}
    if keys is not None:
        parts["keys"] = sql.SQL(keys)
    return sql.SQL(text).format(schema=sql.Identifier(schema), **parts)
