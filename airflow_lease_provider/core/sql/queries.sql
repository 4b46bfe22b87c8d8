-- Named queries of the lease store. "-- name: x" starts a query; {schema} is filled in with
-- psycopg2.sql.Identifier, values are always %(name)s parameters. Every expiry decision compares
-- against clock_timestamp(): the database clock at the moment of the comparison (now() would be the
-- transaction start time, stale inside a transaction).

-- name: acquire
-- One statement, one round trip: lease_acquire (migrations/0002) runs the single statement below with
-- a plan cached per session. The conditional UPDATE takes a free or expired lease (or one the same owner
-- holds: a retry re-enters and gets a larger token). When the row does not exist yet the INSERT creates
-- it. When neither happens, the last branch reports the holder. A failed attempt writes nothing: an
-- UPDATE whose WHERE is false neither locks nor rewrites the row (DESIGN decision 3).
-- clock_timestamp() is called where it is used, never captured up front: an UPDATE that waited for a
-- row lock re-evaluates its WHERE and SET on the new row version, and must do so with the time *then*.
SELECT * FROM {schema}.lease_acquire(%(key)s, %(owner)s, %(ttl)s);

-- name: renew
-- Extends a lease only while it is still this owner's, with this token, and unexpired (decision 6):
-- a renewal never brings back a lease that lapsed, even if nobody took it. A renewal that waited on a
-- row lock past the expiry is refused, because its WHERE is re-checked with the clock at that moment.
UPDATE {schema}.lease AS l
   SET renewed_at = clock_timestamp(), expires_at = clock_timestamp() + %(ttl)s, ttl = %(ttl)s
 WHERE l.key = %(key)s AND l.owner = %(owner)s AND l.token = %(token)s
   AND l.expires_at > clock_timestamp() AND l.released_at IS NULL
RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
          clock_timestamp();

-- name: release
-- Frees the lease only if owner and token still match (decision 7). The row and its token stay.
UPDATE {schema}.lease AS l
   SET expires_at = LEAST(l.expires_at, clock_timestamp()), released_at = clock_timestamp()
 WHERE l.key = %(key)s AND l.owner = %(owner)s AND l.token = %(token)s AND l.released_at IS NULL
RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
          l.released_at;

-- name: force_release
-- Admin action: frees the lease whoever holds it and bumps the token, so the old holder's renew and
-- release fail and its keeper reports the lease lost. Returns the state before the change.
WITH old AS (
    SELECT key, owner, token, ttl, acquired_at, renewed_at, expires_at, released_at
      FROM {schema}.lease WHERE key = %(key)s FOR UPDATE
)
UPDATE {schema}.lease AS l
   SET token = l.token + 1, expires_at = LEAST(l.expires_at, clock_timestamp()), released_at = clock_timestamp()
  FROM old
 WHERE l.key = old.key
RETURNING old.key, old.owner, old.token, old.ttl, old.acquired_at, old.renewed_at, old.expires_at,
          old.released_at, clock_timestamp(), l.token;

-- name: holder
SELECT l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       clock_timestamp()
  FROM {schema}.lease l
 WHERE l.key = %(key)s AND l.expires_at > clock_timestamp();

-- name: list_leases
-- Every key the store knows, held or not, for status pages.
SELECT l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       clock_timestamp()
  FROM {schema}.lease l
 ORDER BY l.key
 LIMIT %(limit)s;

-- name: fence_advance
-- A fence per (resource, lease key): the token is compared only with tokens of the same lease key.
SELECT outcome, current_token
  FROM {schema}.fence_advance(%(resource)s, %(key)s, %(token)s, %(owner)s, %(idempotency_key)s);

-- name: fence_current
SELECT {schema}.fence_token(%(resource)s, %(key)s);

-- name: fence_tokens
SELECT key, token FROM {schema}.fence WHERE resource = %(resource)s AND key <> '' ORDER BY key;

-- name: record_event
INSERT INTO {schema}.event (kind, key, owner, token, detail)
VALUES (%(kind)s, %(key)s, %(owner)s, %(token)s, %(detail)s)
RETURNING id, at;

-- name: record_skipped_catchup
-- One record per gap per DAG in one statement: the unique index of migrations/0004 lets the first writer
-- of a run (dag_id, run_id) insert and every other one insert nothing. A row back means "this call wrote
-- it", and only that caller logs and counts the skipped slots.
INSERT INTO {schema}.event (kind, key, owner, token, detail)
VALUES ('skipped_catchup', %(key)s, %(owner)s, NULL, %(detail)s)
ON CONFLICT ((detail->>'dag_id'), (detail->>'run_id')) WHERE kind = 'skipped_catchup' DO NOTHING
RETURNING id, at;

-- name: prune_events
-- Deletes in bounded batches so a long-neglected table never holds a long lock.
DELETE FROM {schema}.event
 WHERE id IN (SELECT id FROM {schema}.event WHERE at < clock_timestamp() - %(retention)s LIMIT 10000);

-- name: query_events
SELECT id, at, kind, key, owner, token, detail
  FROM {schema}.event
 WHERE (%(key)s::text IS NULL OR key = %(key)s)
   AND (%(kind)s::text IS NULL OR kind = %(kind)s)
   AND (%(since)s::timestamptz IS NULL OR at >= %(since)s)
   AND (%(until)s::timestamptz IS NULL OR at < %(until)s)
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s;

-- name: count_events
SELECT key, kind, count(*) FILTER (WHERE at >= clock_timestamp() - interval '24 hours'),
       count(*) FILTER (WHERE at >= clock_timestamp() - interval '7 days')
  FROM {schema}.event
 WHERE at >= clock_timestamp() - interval '7 days'
 GROUP BY key, kind
 ORDER BY key, kind;

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.schema_version;

-- name: hold_stats
-- Per key, from the released events within the window: how many holds, the longest and the 95th
-- percentile of held_seconds. Feeds TTL advice (TTL = 1.5-2x the worst normal hold).
SELECT key, count(*), max((detail->>'held_seconds')::float8),
       percentile_cont(0.95) WITHIN GROUP (ORDER BY (detail->>'held_seconds')::float8), max(at)
  FROM {schema}.event
 WHERE kind = 'released' AND at >= clock_timestamp() - %(window)s
   AND jsonb_typeof(detail->'held_seconds') = 'number'
 GROUP BY key
 ORDER BY key;
