-- Version 17 (issue 38, the cross-row renewal race): a grant of a key locks every row of the key before it
-- reads them, so a renewal of another of the key's rows that is not committed yet is waited for, not missed.
--
-- A renewal updates its own row only, without the key's grant lock. Its UPDATE is evaluated while the row
-- is live and may commit after the row's expiry (a slow durable commit). A grant of the key made in between
-- read that row's last committed version, found it expired, and was granted beside the renewed holder (a
-- single holder beside a slot 2, or a semaphore's slot beside a single holder). lease_key_state, the one
-- reading every grant makes under the key's grant lock, now first locks every row of the key (key = p_key
-- OR slot_of = p_key, whatever its expiry) FOR NO KEY UPDATE: a row a renewal (or a release, or a
-- force-release) has updated and not committed yet makes the grant wait for that transaction; then the
-- reading, a statement of its own with a fresh READ COMMITTED snapshot, sees the renewed expiry. A renewal
-- that arrives after the grant's lock waits for the grant's commit and is then re-checked by its own WHERE
-- (expires_at > now).
-- A single-holder grant (p_slots = 1) locks only the rows slot_of = p_key: the key's own row is locked by
-- the statement that grants it (lease_acquire's UPDATE re-checks its WHERE after a wait; lease_replace reads
-- it FOR UPDATE), which then answers "held"; so a key that never had slots takes no new row lock.
-- No expiry predicate on the lock: a row live when the lock is taken and expired by the reading is exactly
-- the row whose renewal may be in flight. FOR NO KEY UPDATE, not FOR SHARE: two grants of different keys
-- that share a row (k's slot 2 and the plain key k#2) would both hold it shared and then both wait to
-- update it (a deadlock); an exclusive lock makes the second wait before it holds anything of the row.
-- Two keys share at most one row (k#i), so grants of different keys cannot wait for each other in a ring.
-- The cost: a renewal, release or force-release of one of the key's rows that arrives while a grant of the
-- key is in its transaction (one statement and its commit) waits for that commit.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
CREATE OR REPLACE FUNCTION {schema}.lease_key_state(p_key text, p_slots integer, OUT other_count boolean,
                                                    OUT count_epoch bigint)
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    -- plpgsql, not sql: a sql function's body is planned again on every call, a plpgsql one's once per session.
    -- Every row of the key locked first (waits for an uncommitted renewal of any of them), then read in a
    -- statement of its own (a fresh snapshot, which sees that renewal committed). A single-holder grant
    -- (p_slots = 1) leaves the key's own row to the statement that grants it, which locks it and checks its
    -- expiry again after any wait (the UPDATE's WHERE; lease_replace's FOR UPDATE), so a key that never had
    -- slots takes no row lock here.
    PERFORM FROM {schema}.lease l
     WHERE (l.key = p_key AND p_slots > 1) OR l.slot_of = p_key
       FOR NO KEY UPDATE OF l;
    SELECT coalesce(pg_catalog.bool_or(g.live AND l.slots <> p_slots), false),
           coalesce(pg_catalog.max(l.count_epoch) FILTER (WHERE g.live AND l.slots = p_slots),
                    pg_catalog.max(l.token), 0)
      INTO other_count, count_epoch
      FROM {schema}.lease l
     CROSS JOIN LATERAL (SELECT ((l.key = p_key AND l.slot = 1) OR (l.slot_of = p_key AND l.slot > 1))
                                AND l.expires_at > pg_catalog.clock_timestamp() AS live) g
     WHERE l.key = p_key OR l.slot_of = p_key;
END;
$$;
