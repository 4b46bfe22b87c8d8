-- Named queries of the lease store. "-- name: x" starts a query; {schema} is replaced by the schema's
-- name as a quoted identifier (core/db/sqltext.py, with_schema), values are always %(name)s parameters.
-- Rows are read by column name (core/db/database.py): every column a query returns has a name of its own. Every expiry decision compares
-- against clock_timestamp(): the database clock at the moment of the comparison (now() would be the
-- transaction start time, stale inside a transaction).
-- "-- name: x [prepared]" marks a query a connection prepares from its second use on (core/db.py): only
-- one statement whose plan cannot depend on its values (a function call, a primary-key lookup), since a
-- prepared statement may be run with one generic plan.

-- name: acquire [prepared]
-- One statement, one round trip: lease_acquire (migrations/0002, 0008) runs with its plans cached per
-- session. A key someone else holds is answered by one read: a failed attempt takes no row lock and writes
-- nothing (DESIGN decision 3). Otherwise the conditional UPDATE takes a free or expired lease (or one the
-- same owner holds: a retry re-enters and gets a larger token), or the INSERT creates a new key.
-- clock_timestamp() is called where it is used, never captured up front: an UPDATE that waited for a
-- row lock re-evaluates its WHERE and SET on the new row version, and must do so with the time *then*.
-- The holder's run columns (migrations/0011) are written with every grant.
SELECT * FROM {schema}.lease_acquire(%(key)s, %(owner)s, %(ttl)s,
                                     %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s);

-- name: acquire_logged [prepared]
-- acquire with the ledger on: the grant and its 'acquired' event (%(detail)s plus the expiry) in one
-- transaction, so one durable commit and one round trip (migrations/0008). A failed attempt writes nothing.
SELECT * FROM {schema}.lease_acquire_logged(%(key)s, %(owner)s, %(ttl)s, %(detail)s,
                                            %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s);

-- name: acquire_slots [prepared]
-- A semaphore's acquire (migrations/0014): at most %(slots)s holders of %(key)s, each in its own slot row
-- (slot 1: the key's own row; slot i > 1: the row key#i) with its own token. One statement: the grant (and,
-- %(detail)s not NULL, its 'acquired' event), or every live holder of the key by slot.
SELECT * FROM {schema}.lease_acquire_slots(%(key)s, %(owner)s, %(ttl)s, %(slots)s, %(detail)s,
                                           %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s);

-- name: slot_holders
-- The live holders of a semaphore's slots (its key's own row and its rows key#i held as its slots; a row
-- key#i held as a key of its own is not one), by slot.
SELECT l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       clock_timestamp() AS observed_at, l.dag_id, l.run_id, l.task_id, l.map_index, l.slot, l.slots,
       l.count_epoch
  FROM {schema}.lease l
 WHERE (l.key = %(key)s OR (l.slot_of = %(key)s AND l.slot > 1)) AND l.expires_at > clock_timestamp()
 ORDER BY l.slot, l.key;

-- name: replace [prepared]
-- The replace policy's acquire (migrations/0012): a free, expired or own lease is granted as acquire grants
-- it; a lease held by a run whose run_after is strictly earlier than %(run_after)s is taken over, with a
-- larger token, in the same statement; any other holder is answered by one read (no lock, no write).
-- %(takeover)s false: never take over (a replace_grace not over yet; 'older' says whether it would have).
-- %(detail)s NULL: no events (ledger off); else the 'acquired' and (a takeover) 'replaced' events.
SELECT * FROM {schema}.lease_replace(%(key)s, %(owner)s, %(ttl)s, %(run_after)s, %(takeover)s, %(detail)s,
                                     %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s);

-- name: wait_claim
-- Take or keep a waiter's place (migrations/0012): at most %(max_waiting)s per key, lapsing after %(ttl)s.
SELECT * FROM {schema}.lease_wait_claim(%(key)s, %(owner)s, %(ttl)s, %(max_waiting)s,
                                        %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s);

-- name: wait_release
-- Give a waiter's place back (it got the lease, gave up, or was killed).
DELETE FROM {schema}.lease_waiter WHERE key = %(key)s AND owner = %(owner)s RETURNING owner;

-- name: waiters
-- The live waiters of some keys (NULL: every key), oldest first, of some DAGs (NULL: all).
SELECT w.key, w.owner, w.since, w.expires_at, w.dag_id, w.run_id, w.task_id, w.map_index
  FROM {schema}.lease_waiter w
 WHERE (%(keys)s::text[] IS NULL OR w.key = ANY(%(keys)s::text[]))
   AND w.expires_at > clock_timestamp()
   AND (%(dag_ids)s::text[] IS NULL OR w.dag_id = ANY(%(dag_ids)s::text[]))
 ORDER BY w.key, w.since, w.owner
 LIMIT %(limit)s;

-- name: replacement
-- Whether token %(token)s of %(key)s was taken over by lease_replace, from the lease row: the grant that
-- replaced it, if it is still the row's newest (its owner, token and run columns).
SELECT l.owner, l.token, l.dag_id, l.run_id, l.task_id, l.map_index
  FROM {schema}.lease l
 WHERE l.key = %(key)s AND l.replaced_token = %(token)s;

-- name: renew [prepared]
-- Extends a lease only while it is still this owner's, with this token, and unexpired (decision 6):
-- a renewal never brings back a lease that lapsed, even if nobody took it. A renewal that waited on a
-- row lock past the expiry is refused, because its WHERE is re-checked with the clock at that moment.
-- Sent as the UPDATE itself, not as lease_renew() (migrations/0008, the same UPDATE, kept for older
-- clients): prepared on its connection, the statement needs no plpgsql call around it (see
-- docs/benchmarks.md, "What changed (renew and release as statements)").
UPDATE {schema}.lease AS l
   SET renewed_at = pg_catalog.clock_timestamp(), expires_at = pg_catalog.clock_timestamp() + %(ttl)s,
       ttl = %(ttl)s
 WHERE l.key = %(key)s AND l.owner = %(owner)s AND l.token = %(token)s
   AND l.expires_at > pg_catalog.clock_timestamp() AND l.released_at IS NULL
RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
          pg_catalog.clock_timestamp() AS observed_at, l.slot, l.slots, l.count_epoch;

-- name: release [prepared]
-- Frees the lease only if owner and token still match (decision 7). The row and its token stay.
-- Sent as the UPDATE itself, as renew is; lease_release() (migrations/0008) is the same UPDATE, which
-- lease_release_logged calls.
UPDATE {schema}.lease AS l
   SET expires_at = LEAST(l.expires_at, pg_catalog.clock_timestamp()), released_at = pg_catalog.clock_timestamp()
 WHERE l.key = %(key)s AND l.owner = %(owner)s AND l.token = %(token)s AND l.released_at IS NULL
RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
          l.released_at AS observed_at;

-- name: release_logged [prepared]
-- release with the ledger on: the release and its 'released' event (held_seconds, released_at by the
-- database clock, plus %(detail)s) in one transaction.
SELECT * FROM {schema}.lease_release_logged(%(key)s, %(owner)s, %(token)s, %(detail)s,
                                            %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s);

-- name: holder [prepared]
SELECT l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       clock_timestamp() AS observed_at, l.dag_id, l.run_id, l.task_id, l.map_index, l.slot, l.slots,
       l.count_epoch
  FROM {schema}.lease l
 WHERE l.key = %(key)s AND l.expires_at > clock_timestamp();

-- name: fence_advance [prepared]
-- A fence per (resource, lease key): the token is compared only with tokens of the same lease key. A larger
-- token is accepted, or an equal one from the same owner of the same lease store (%(store_id)s: the
-- issuer's lease_epoch.store_id, or NULL); in the issuing store's own schema a token below the key's
-- newest grant is 'superseded' (migrations/0010). With %(count_epoch)s (the grant's, migrations/0015) a token
-- at or below the largest count epoch the lease key %(base_key)s's holders told this fence is 'count_epoch',
-- and so is one at or below the key's count epoch in the issuing store's own schema.
SELECT outcome, current_token, current_store, newest_grant
  FROM {schema}.fence_advance(%(resource)s, %(key)s, %(token)s, %(owner)s, %(idempotency_key)s,
                              %(store_id)s::uuid, %(base_key)s::text, %(count_epoch)s::bigint);

-- name: fence_claim_release
-- Gives back the idempotency claim of an external publish whose side effect failed: only that publish's
-- own claim (the same lease key, token and owner), never a later one's nor another key's grant's with the
-- same owner and token (migrations/0020). A claim without a key (written before version 20) matches no
-- key: it is never given back (fail closed).
DELETE FROM {schema}.fence_publish
 WHERE resource = %(resource)s AND idempotency_key = %(idempotency_key)s AND token = %(token)s
   AND owner IS NOT DISTINCT FROM %(owner)s AND key = %(key)s
RETURNING token;

-- name: store_id
SELECT e.store_id::text AS store_id FROM {schema}.lease_epoch e;

-- name: token_epoch_raise
SELECT * FROM {schema}.lease_epoch_raise(%(reason)s, %(above)s);

-- name: fence_current [prepared]
SELECT {schema}.fence_token(%(resource)s, %(key)s) AS token;

-- name: fence_tokens
SELECT key, token FROM {schema}.fence WHERE resource = %(resource)s AND key <> '' ORDER BY key;

-- name: fence_published
SELECT 1 AS claimed FROM {schema}.fence_publish
 WHERE resource = %(resource)s AND idempotency_key = %(idempotency_key)s;

-- name: record_event [prepared]
-- lease_event_insert (migrations/0008) is the ledger's one INSERT, shared with acquire_logged/release_logged.
SELECT id, at FROM {schema}.lease_event_insert(%(kind)s, %(key)s, %(owner)s, %(token)s, %(detail)s,
                                               %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s);

-- name: record_skipped_catchup
-- One record per gap per DAG in one statement (EventLedger.record_catchup): the unique index on the run
-- columns (migrations/0016; 0004 made it) lets the first writer of a run (dag_id, run_id) insert and every
-- other one insert nothing. A row back means "this call wrote it", and only that caller logs and counts
-- the skipped slots.
INSERT INTO {schema}.event (kind, key, owner, token, detail, dag_id, run_id, task_id, map_index)
VALUES ('skipped_catchup', %(key)s, %(owner)s, NULL, %(detail)s, %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s)
ON CONFLICT (dag_id, run_id) WHERE kind = 'skipped_catchup' DO NOTHING
RETURNING id, at;

-- name: record_coalesced
-- One record per coalesced run in one statement, as record_skipped_catchup, by the unique index of
-- migrations/0016 (0013 made it; kind 'coalesced'): a row back means "this call wrote it".
INSERT INTO {schema}.event (kind, key, owner, token, detail, dag_id, run_id, task_id, map_index)
VALUES ('coalesced', %(key)s, %(owner)s, NULL, %(detail)s, %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s)
ON CONFLICT (dag_id, run_id) WHERE kind = 'coalesced' DO NOTHING
RETURNING id, at;

-- name: prune_events
-- Deletes in bounded batches so a long-neglected table never holds a long lock.
DELETE FROM {schema}.event
 WHERE id IN (SELECT id FROM {schema}.event WHERE at < clock_timestamp() - %(retention)s LIMIT 10000);

-- name: token_floor
-- The floor of the tokens issued now (migrations/0006); bumps the epoch first on a new server history.
SELECT {schema}.lease_token_floor() AS floor;

-- name: token_epoch
SELECT e.epoch, e.system_identifier, e.timeline, e.changed_at, e.reason FROM {schema}.lease_epoch e;

-- name: token_epoch_locked
-- The epoch as it is, its row locked until the transaction ends: read before a bump in the same
-- transaction, it is the epoch that bump moved from (a concurrent bump waits for it, and then reads ours).
SELECT e.epoch, e.system_identifier, e.timeline, e.changed_at, e.reason FROM {schema}.lease_epoch e FOR UPDATE;

-- name: token_epoch_bump
SELECT * FROM {schema}.lease_epoch_bump(%(reason)s);

-- name: schema_version
SELECT coalesce(max(version), 0) AS version FROM {schema}.schema_version;

-- Reads of the status pages, the CLI and the ledger. A row's DAG is its dag_id column (migrations/0007
-- for events, 0011 for leases): the run its writer passed; a row of no run (a core API user's) belongs to
-- no DAG. A dag_ids parameter NULL means "every row"; an array keeps the rows of those DAGs.

-- name: lease_by_key [prepared]
-- The row of one key, held or not (see Lease.held): one index lookup, however many keys there are.
SELECT l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       clock_timestamp() AS observed_at, l.dag_id, l.run_id, l.task_id, l.map_index, l.slot, l.slots,
       l.count_epoch
  FROM {schema}.lease l
 WHERE l.key = %(key)s;

-- name: force_release_expected
-- Force-release as one statement: the row is locked, compared with the expected token (when one is
-- given) and released with its token bumped, or left alone. Returns the state before, and the new
-- token (NULL when the token did not match: nothing was written). No row: the key was never acquired.
WITH old AS (
    SELECT key, owner, token, ttl, acquired_at, renewed_at, expires_at, released_at, dag_id, run_id, task_id,
           map_index, slot, slots, count_epoch
      FROM {schema}.lease WHERE key = %(key)s FOR UPDATE
), upd AS (
    UPDATE {schema}.lease AS l
       SET token = greatest(l.token + 1, {schema}.lease_token_floor() + 1),
           expires_at = LEAST(l.expires_at, clock_timestamp()),
           released_at = clock_timestamp()
      FROM old
     WHERE l.key = old.key AND (%(expected_token)s::bigint IS NULL OR old.token = %(expected_token)s::bigint)
 RETURNING l.token
)
SELECT old.key, old.owner, old.token, old.ttl, old.acquired_at, old.renewed_at, old.expires_at,
       old.released_at, clock_timestamp() AS observed_at, (SELECT token FROM upd) AS new_token,
       old.dag_id, old.run_id, old.task_id, old.map_index, old.slot, old.slots, old.count_epoch
  FROM old;

-- name: force_release_lock
-- A force-release with the ledger on is one transaction of three statements (LeaseStore.force_release):
-- this one locks the key's row first, waiting for any statement holding it (a first send of this very
-- request still running on a connection the client lost included), so that the next statement, with a
-- snapshot of its own taken after the lock, sees what such a send committed.
SELECT l.key FROM {schema}.lease l WHERE l.key = %(key)s FOR UPDATE;

-- name: force_release_done
-- Whether force-release request %(request)s was applied already (by a send whose answer was lost): its
-- 'force_released' event, written in the same transaction as the release, with the lease as it was just
-- before and the new token. The key's events of the last hour only (event_key_at_idx): a request is only
-- sent again by the call that made it, seconds later.
SELECT p.key, p.owner, p.token, p.ttl, p.acquired_at, p.renewed_at, p.expires_at, p.released_at,
       (e.detail->>'observed_at')::timestamptz AS observed_at, (e.detail->>'new_token')::bigint AS new_token,
       p.dag_id, p.run_id, p.task_id, p.map_index, p.slot, p.slots
  FROM {schema}.event e
 CROSS JOIN LATERAL pg_catalog.jsonb_populate_record(NULL::{schema}.lease, e.detail->'previous') AS p
 WHERE e.key = %(key)s AND e.at > clock_timestamp() - interval '1 hour' AND e.kind = 'force_released'
   AND e.detail->>'request' = %(request)s
 LIMIT 1;

-- name: force_release_logged
-- force_release_expected with its 'force_released' event in the same statement (and transaction): the
-- event carries the request id (%(request)s), the lease as it was just before ('previous', 'observed_at')
-- and the new token, so a request sent again after a lost answer is found applied (force_release_done)
-- instead of being applied twice. No event when nothing was released (a token that did not match).
WITH old AS (
    SELECT key, owner, token, ttl, acquired_at, renewed_at, expires_at, released_at, dag_id, run_id, task_id,
           map_index, slot, slots
      FROM {schema}.lease WHERE key = %(key)s FOR UPDATE
), upd AS (
    UPDATE {schema}.lease AS l
       SET token = greatest(l.token + 1, {schema}.lease_token_floor() + 1),
           expires_at = LEAST(l.expires_at, clock_timestamp()),
           released_at = clock_timestamp()
      FROM old
     WHERE l.key = old.key AND (%(expected_token)s::bigint IS NULL OR old.token = %(expected_token)s::bigint)
 RETURNING l.token, l.released_at AS at
), ev AS (
    INSERT INTO {schema}.event (kind, key, owner, token, detail, dag_id, run_id, task_id, map_index)
    SELECT 'force_released', old.key, old.owner, old.token,
           %(detail)s::jsonb || pg_catalog.jsonb_build_object(
               'request', %(request)s::text, 'new_token', upd.token, 'observed_at', upd.at,
               'was_held', old.released_at IS NULL AND old.expires_at > upd.at, 'previous', pg_catalog.to_jsonb(old)),
           %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s
      FROM old, upd
 RETURNING id
)
SELECT old.key, old.owner, old.token, old.ttl, old.acquired_at, old.renewed_at, old.expires_at,
       old.released_at, coalesce((SELECT at FROM upd), clock_timestamp()) AS observed_at,
       (SELECT token FROM upd) AS new_token, (SELECT count(*) FROM ev) AS logged,
       old.dag_id, old.run_id, old.task_id, old.map_index, old.slot, old.slots
  FROM old;

-- name: lease_page
-- Keyset pagination by key: the keys after %(after)s (NULL: from the first), at most %(limit)s.
SELECT l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       clock_timestamp() AS observed_at, l.dag_id, l.run_id, l.task_id, l.map_index, l.slot, l.slots,
       l.count_epoch
  FROM {schema}.lease l
 WHERE (%(after)s::text IS NULL OR l.key > %(after)s::text)
   AND (NOT %(held_only)s OR (l.released_at IS NULL AND l.expires_at > clock_timestamp()))
   AND (%(dag_ids)s::text[] IS NULL OR l.dag_id = ANY(%(dag_ids)s::text[]))
 ORDER BY l.key
 LIMIT %(limit)s;

-- name: event_page
-- Newest first, keyset-paginated by (at, id): the events older than the cursor (NULL: the newest).
SELECT e.id, e.at, e.kind, e.key, e.owner, e.token, e.detail, e.dag_id, e.run_id, e.task_id, e.map_index
  FROM {schema}.event e
 WHERE (%(key)s::text IS NULL OR e.key = %(key)s::text)
   AND (%(kind)s::text IS NULL OR e.kind = %(kind)s::text)
   AND (%(since)s::timestamptz IS NULL OR e.at >= %(since)s::timestamptz)
   AND (%(until)s::timestamptz IS NULL OR e.at < %(until)s::timestamptz)
   AND (%(before_at)s::timestamptz IS NULL OR (e.at, e.id) < (%(before_at)s::timestamptz, %(before_id)s::bigint))
   AND (%(dag_ids)s::text[] IS NULL
        OR e.dag_id = ANY(%(dag_ids)s::text[]))
 ORDER BY e.at DESC, e.id DESC
 LIMIT %(limit)s;

-- name: fence_refusal
-- The newest refusal, by any fence, of token %(token)s of lease key %(lease_key)s published by %(owner)s (a
-- 'fence_rejected' event: its detail's lease_key, its owner and token). One range scan of
-- event_fence_lease_key_at_idx (migrations/0005): the refusals of that lease key only, newest first, however
-- long the ledger is (assets.staleness).
SELECT e.id, e.at, e.kind, e.key, e.owner, e.token, e.detail, e.dag_id, e.run_id, e.task_id, e.map_index
  FROM {schema}.event e
 WHERE e.kind = 'fence_rejected' AND (e.detail->>'lease_key') = %(lease_key)s
   AND e.token = %(token)s AND e.owner = %(owner)s
 ORDER BY e.at DESC
 LIMIT 1;

-- name: run_events
-- The events of one DAG run, newest first, by its run columns (event_run_at_idx, migrations/0007);
-- within the run's time window when one is given, filtered in SQL, not after a LIMIT.
SELECT e.id, e.at, e.kind, e.key, e.owner, e.token, e.detail, e.dag_id, e.run_id, e.task_id, e.map_index
  FROM {schema}.event e
 WHERE e.dag_id = %(dag_id)s AND e.run_id = %(run_id)s
   AND (%(since)s::timestamptz IS NULL OR e.at >= %(since)s::timestamptz)
   AND (%(until)s::timestamptz IS NULL OR e.at < %(until)s::timestamptz)
 ORDER BY e.at DESC, e.id DESC
 LIMIT %(limit)s;

-- name: count_events
-- Per key and kind, the events of the last 24 hours and 7 days (of some DAGs, or all).
SELECT e.key, e.kind, count(*) FILTER (WHERE e.at >= clock_timestamp() - interval '24 hours') AS last_24h,
       count(*) FILTER (WHERE e.at >= clock_timestamp() - interval '7 days') AS last_7d
  FROM {schema}.event e
 WHERE e.at >= clock_timestamp() - interval '7 days'
   AND (%(dag_ids)s::text[] IS NULL
        OR e.dag_id = ANY(%(dag_ids)s::text[]))
 GROUP BY e.key, e.kind
 ORDER BY e.key, e.kind;

-- name: hold_stats
-- Per key, from the released events within the window (of some DAGs, or all): how many holds, the longest
-- and the 95th percentile of held_seconds. Feeds TTL advice (TTL = 1.5-2x the worst normal hold).
SELECT e.key, count(*) AS holds, max((e.detail->>'held_seconds')::float8) AS worst_seconds,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY (e.detail->>'held_seconds')::float8) AS p95_seconds,
       max(e.at) AS last_at
  FROM {schema}.event e
 WHERE e.kind = 'released' AND e.at >= clock_timestamp() - %(window)s
   AND jsonb_typeof(e.detail->'held_seconds') = 'number'
   AND (%(dag_ids)s::text[] IS NULL
        OR e.dag_id = ANY(%(dag_ids)s::text[]))
 GROUP BY e.key
 ORDER BY e.key;

-- Timeline and trends (core/history.py, docs/ui.md). Always one key or one DAG and a time range, so
-- each reads by index: event_key_at_idx for a key, event_dag_at_idx (migrations/0011) for a DAG,
-- event_fence_lease_key_at_idx for the fence rejections of a key (recorded under the fence's resource).

-- name: timeline_events
-- The events of one lease key in [since, until), newest first (a LIMIT keeps the newest): those recorded
-- under the key, and the fence rejections of tokens of that key.
SELECT t.id, t.at, t.kind, t.key, t.owner, t.token, t.detail, t.dag_id, t.run_id, t.task_id, t.map_index FROM (
    SELECT e.id, e.at, e.kind, e.key, e.owner, e.token, e.detail, e.dag_id, e.run_id, e.task_id, e.map_index
      FROM {schema}.event e
     WHERE e.key = %(key)s AND e.at >= %(since)s AND e.at < %(until)s
    UNION ALL
    SELECT e.id, e.at, e.kind, e.key, e.owner, e.token, e.detail, e.dag_id, e.run_id, e.task_id, e.map_index
      FROM {schema}.event e
     WHERE e.kind = 'fence_rejected' AND e.detail->>'lease_key' = %(key)s AND e.key <> %(key)s
       AND e.at >= %(since)s AND e.at < %(until)s
) t
 WHERE (%(dag_ids)s::text[] IS NULL
        OR t.dag_id = ANY(%(dag_ids)s::text[]))
 ORDER BY t.at DESC, t.id DESC
 LIMIT %(limit)s;

-- name: timeline_open_holding
-- The holding that may still run at %(since)s: the key's last acquisition before it, and the events that
-- ended that token before it (none: it was still held, or it lapsed, at %(since)s).
WITH last AS (
    SELECT e.id, e.at, e.kind, e.key, e.owner, e.token, e.detail, e.dag_id, e.run_id, e.task_id, e.map_index
      FROM {schema}.event e
     WHERE e.key = %(key)s AND e.kind = 'acquired' AND e.at < %(since)s
     ORDER BY e.at DESC, e.id DESC
     LIMIT 1
)
SELECT last.id, last.at, last.kind, last.key, last.owner, last.token, last.detail, last.dag_id, last.run_id, last.task_id, last.map_index FROM last
UNION ALL
SELECT e.id, e.at, e.kind, e.key, e.owner, e.token, e.detail, e.dag_id, e.run_id, e.task_id, e.map_index
  FROM {schema}.event e JOIN last ON e.token = last.token
 WHERE e.key = %(key)s AND e.kind IN ('released', 'lost', 'force_released', 'replaced')
   AND e.at >= last.at AND e.at < %(since)s;

-- name: catchup_events
-- The skipped catch-up records of some DAGs in [since, until) (one per gap), newest first.
SELECT e.id, e.at, e.kind, e.key, e.owner, e.token, e.detail, e.dag_id, e.run_id, e.task_id, e.map_index
  FROM {schema}.event e
 WHERE e.kind = 'skipped_catchup' AND e.dag_id = ANY(%(dag_ids)s::text[])
   AND e.at >= %(since)s AND e.at < %(until)s
 ORDER BY e.at DESC, e.id DESC
 LIMIT %(limit)s;

-- name: catchup_and_coalesced_events
-- catchup_events with the coalesced catch-up records (one per coalesced run) too: the timeline's markers.
-- Each kind is a literal, so each branch can read its partial index (migrations 0004 and 0013).
SELECT e.id, e.at, e.kind, e.key, e.owner, e.token, e.detail, e.dag_id, e.run_id, e.task_id, e.map_index
  FROM {schema}.event e
 WHERE (e.kind = 'skipped_catchup' OR e.kind = 'coalesced') AND e.dag_id = ANY(%(dag_ids)s::text[])
   AND e.at >= %(since)s AND e.at < %(until)s
 ORDER BY e.at DESC, e.id DESC
 LIMIT %(limit)s;

-- name: trend_key
-- Per %(unit)s ('hour' or 'day', UTC) and kind, and for the whole range (bucket NULL): how many events,
-- how many distinct owners (runs, for acquisitions) and how many catch-up slots, of one lease key.
SELECT date_trunc(%(unit)s, e.at AT TIME ZONE 'UTC') AS bucket, e.kind, count(*) AS events,
       count(DISTINCT e.owner) AS owners,
       coalesce(sum(CASE WHEN jsonb_typeof(e.detail->'count') = 'number' THEN (e.detail->>'count')::bigint END), 0)
           AS slots
  FROM {schema}.event e
 WHERE e.key = %(key)s AND e.at >= %(since)s AND e.at < %(until)s
   AND e.kind IN ('acquired', 'skipped_overlap', 'overlap_failed', 'skipped_catchup', 'lost', 'force_released')
   AND (%(dag_ids)s::text[] IS NULL
        OR e.dag_id = ANY(%(dag_ids)s::text[]))
 GROUP BY GROUPING SETS ((1, 2), (2))
 ORDER BY 1 NULLS FIRST, 2;

-- name: trend_dag
-- trend_key for one DAG's events (every key its runs used), by event_dag_at_idx.
SELECT date_trunc(%(unit)s, e.at AT TIME ZONE 'UTC') AS bucket, e.kind, count(*) AS events,
       count(DISTINCT e.owner) AS owners,
       coalesce(sum(CASE WHEN jsonb_typeof(e.detail->'count') = 'number' THEN (e.detail->>'count')::bigint END), 0)
           AS slots
  FROM {schema}.event e
 WHERE e.dag_id = %(dag_id)s
   AND e.at >= %(since)s AND e.at < %(until)s
   AND e.kind IN ('acquired', 'skipped_overlap', 'overlap_failed', 'skipped_catchup', 'lost', 'force_released')
 GROUP BY GROUPING SETS ((1, 2), (2))
 ORDER BY 1 NULLS FIRST, 2;

-- name: dag_keys
-- The lease keys one DAG's runs used in [since, until), most recently used first: the event's key, or for
-- a fence rejection the lease key in its detail. Catch-up records (skipped or coalesced) name the DAG, not
-- a lease: left out.
SELECT CASE WHEN e.kind = 'fence_rejected' THEN coalesce(e.detail->>'lease_key', e.key) ELSE e.key END AS lease_key,
       count(*) AS events, max(e.at) AS last_at
  FROM {schema}.event e
 WHERE e.dag_id = %(dag_id)s
   AND e.at >= %(since)s AND e.at < %(until)s AND e.kind NOT IN ('skipped_catchup', 'coalesced')
 GROUP BY 1
 ORDER BY max(e.at) DESC, 1
 LIMIT %(limit)s;

-- name: dag_leases
-- The lease rows held (or last held) by one DAG's runs (lease_dag_key_idx, migrations/0011).
SELECT l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       clock_timestamp() AS observed_at, l.dag_id, l.run_id, l.task_id, l.map_index, l.slot, l.slots,
       l.count_epoch
  FROM {schema}.lease l
 WHERE l.dag_id = %(dag_id)s
 ORDER BY l.key
 LIMIT %(limit)s;

-- name: db_now
-- The database clock: the time ranges of the timeline and trends end here, as every expiry is measured.
SELECT clock_timestamp() AS now;

-- name: api_capability_bind
-- The lease API (migrations/0018): keep the digest of a grant's capability on its row, only while that grant
-- (key, owner, token) is the row's live grant. No row back: the grant is gone already (lost or taken).
-- In the same statement the grant is kept in lease_api_grant (migrations/0022) with its lease key and the run
-- columns its acquire wrote on the row, and the key's kept grants older than %(keep)s are deleted.
WITH bound AS (
    UPDATE {schema}.lease AS l
       SET api_capability = %(digest)s
     WHERE l.key = %(key)s AND l.owner = %(owner)s AND l.token = %(token)s
       AND l.released_at IS NULL AND l.expires_at > clock_timestamp()
    RETURNING l.key, l.owner, l.token, CASE WHEN l.slot > 1 THEN l.slot_of ELSE l.key END AS lease_key,
              l.dag_id, l.run_id, l.task_id, l.map_index
), kept AS (
    INSERT INTO {schema}.lease_api_grant (key, token, owner, digest, lease_key, dag_id, run_id, task_id, map_index)
    SELECT b.key, b.token, b.owner, %(digest)s, b.lease_key, b.dag_id, b.run_id, b.task_id, b.map_index FROM bound b
    ON CONFLICT (key, token) DO NOTHING
), pruned AS (
    DELETE FROM {schema}.lease_api_grant AS g
     WHERE g.key = %(key)s AND g.token < %(token)s AND g.granted_at < clock_timestamp() - %(keep)s::interval
)
SELECT key FROM bound;

-- name: api_grant_released
-- The lease API's release, before it releases (migrations/0022): the grant's holder ended it, so its
-- capability records no loss of it afterwards. Only the grant the capability's digest names.
UPDATE {schema}.lease_api_grant
   SET released_at = clock_timestamp()
 WHERE key = %(key)s AND owner = %(owner)s AND token = %(token)s AND digest = %(digest)s AND released_at IS NULL
RETURNING key;

-- name: api_past_grant
-- The lease API (migrations/0022): the grant (key, owner, token) when the capability's digest is the one kept
-- for it, its holder did not release it, and the key's row no longer holds it (a newer grant took the row, or
-- a force-release bumped its token): the caller's own lost grant, with its lease key and run columns. No row:
-- a forged capability, another grant's, a released grant's, or a grant that is still the row's.
SELECT g.key, g.owner, g.token, g.lease_key, g.lost_at, g.dag_id, g.run_id, g.task_id, g.map_index,
       l.token AS newest_grant
  FROM {schema}.lease_api_grant g
  JOIN {schema}.lease l ON l.key = g.key
 WHERE g.key = %(key)s AND g.owner = %(owner)s AND g.token = %(token)s AND g.digest = %(digest)s
   AND g.released_at IS NULL AND (l.token <> g.token OR l.owner <> g.owner);

-- name: api_grant_lost
-- The lease API's 'lost' of a grant, at most once (migrations/0022): claimed marks the kept grant now (its
-- holder did not release it, and no 'lost' of it was recorded); kept says whether the grant (key, token) is
-- kept at all, under any digest (a grant bound before version 22 is not, and records its loss as before).
-- Sent only once the capability is checked (api_capability_grant or api_past_grant).
WITH claim AS (
    UPDATE {schema}.lease_api_grant
       SET lost_at = clock_timestamp()
     WHERE key = %(key)s AND owner = %(owner)s AND token = %(token)s AND digest = %(digest)s
       AND released_at IS NULL AND lost_at IS NULL
    RETURNING key
)
SELECT EXISTS (SELECT 1 FROM claim) AS claimed,
       EXISTS (SELECT 1 FROM {schema}.lease_api_grant g WHERE g.key = %(key)s AND g.token = %(token)s) AS kept;

-- name: api_capability_grant
-- The lease API: the row of the grant (key, owner, token) if the capability's digest is the one kept for it,
-- held or not (a release sent again is answered from it); no row: not this grant's capability.
SELECT l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
       clock_timestamp() AS observed_at, l.dag_id, l.run_id, l.task_id, l.map_index, l.slot, l.slots,
       l.count_epoch
  FROM {schema}.lease l
 WHERE l.key = %(key)s AND l.owner = %(owner)s AND l.token = %(token)s AND l.api_capability = %(digest)s;

-- name: api_capability_renew [prepared]
-- The lease API's renewal in one round trip: the renew statement (above), which also requires the
-- capability's digest to be the one kept for this grant. No row: lost, or not this grant's capability
-- (the route then reads api_capability_grant to answer which). ttl NULL: the grant's own. Keep its SET
-- and WHERE as renew's.
UPDATE {schema}.lease AS l
   SET renewed_at = pg_catalog.clock_timestamp(),
       expires_at = pg_catalog.clock_timestamp() + COALESCE(%(ttl)s::interval, l.ttl),
       ttl = COALESCE(%(ttl)s::interval, l.ttl)
 WHERE l.key = %(key)s AND l.owner = %(owner)s AND l.token = %(token)s AND l.api_capability = %(digest)s
   AND l.expires_at > pg_catalog.clock_timestamp() AND l.released_at IS NULL
RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
          pg_catalog.clock_timestamp() AS observed_at, l.slot, l.slots, l.count_epoch;

-- name: api_wait_claim
-- The lease API's waiting place (migrations/0021): take or keep %(owner)s's place for the capability whose
-- digest is %(digest)s, at most %(max_waiting)s per key; every live waiter, each row with the status.
SELECT * FROM {schema}.lease_wait_claim_api(%(key)s, %(owner)s, %(ttl)s, %(max_waiting)s, %(digest)s,
                                            %(dag_id)s, %(run_id)s, %(task_id)s, %(map_index)s);

-- name: api_wait_release
-- The lease API: give a waiting place back, only with the capability it was taken with (its digest).
DELETE FROM {schema}.lease_waiter
 WHERE key = %(key)s AND owner = %(owner)s AND api_capability = %(digest)s
RETURNING owner;
