-- Version 19 (issue 38, the model's finding after 96fe53b): a plain key spelled like a slot keeps its count
-- epoch apart from its rows.
--
-- The fence in the store's own schema refuses at once a token at or below the key's count epoch, read from
-- the key's rows (its own row with slot 1, its slot rows). A key spelled like a slot (k#2) shares its own
-- row with slot 2 of k: once that row is granted as k's slot, it says k's epoch, and the key k#2's latest
-- holding period (single holders after a 3-slot grant, say) was forgotten: a zombie of k#2's slot 2 (row
-- k#2#2), of an earlier period, was accepted. lease_key_state, the one reading every grant makes under the
-- key's grant lock, now also records the epoch of a key spelled like a slot (ending in #digits) in
-- lease_key_epoch, which only grants of that key write; fence_advance takes the larger of it and the rows'.
-- A key not spelled like a slot writes nothing more: its own row is never another key's, and the first
-- grant of each of its holding periods writes that row (single holder, or slot 1: the lowest free slot).
-- Recorded before the grant's own write: a grant refused after it (its row held as another key's slot) had
-- no live holder of the key to refuse, and the next grant's epoch is at least as large.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
CREATE TABLE {schema}.lease_key_epoch (
    key          text        PRIMARY KEY,
    count_epoch  bigint      NOT NULL
);

-- What the rows still say of every key spelled like a slot (its own row while it is its own, its slot rows).
INSERT INTO {schema}.lease_key_epoch (key, count_epoch)
SELECT b.base, pg_catalog.max(b.count_epoch)
  FROM (SELECT CASE WHEN l.slot > 1 THEN l.slot_of ELSE l.key END AS base, l.count_epoch
          FROM {schema}.lease l) b
 WHERE pg_catalog.textregexeq(b.base, '#[0-9]+$')
 GROUP BY b.base;

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
    -- A key spelled like a slot (k#2) keeps its count epoch where no grant of another key overwrites it: its
    -- own row may become slot 2 of k (migrations/0019). Only such keys write: a key that never had slots and
    -- is not spelled like one costs what it did.
    IF NOT other_count AND pg_catalog.textregexeq(p_key, '#[0-9]+$') THEN
        INSERT INTO {schema}.lease_key_epoch AS e (key, count_epoch) VALUES (p_key, count_epoch)
        ON CONFLICT (key) DO UPDATE SET count_epoch = EXCLUDED.count_epoch
         WHERE e.count_epoch < EXCLUDED.count_epoch;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                       p_idempotency_key text, p_store uuid, p_base text, p_count_epoch bigint)
RETURNS TABLE (outcome text, current_token bigint, current_store uuid, newest_grant bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    v_token bigint;
    v_store pg_catalog.uuid;
    v_newest bigint;
    v_base pg_catalog.text;
    v_floor bigint;
    v_outcome pg_catalog.text;
BEGIN
    IF p_idempotency_key IS NOT NULL THEN
        INSERT INTO {schema}.fence_publish (resource, idempotency_key, token, owner)
        VALUES (p_resource, p_idempotency_key, p_token, p_owner)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            v_outcome := 'duplicate';
        END IF;
    END IF;
    IF v_outcome IS NULL AND p_store IS NOT NULL THEN
        -- Kept in the lease store that issued the token: a token below the row's newest grant belongs to a
        -- holder the lease has moved past (granted again, or force-released); one at or below the key's
        -- count epoch to a holder of an earlier holding period (a dropped slot of a lowered slot count is
        -- never granted again). Both refused before any later token has published here.
        SELECT l.token, CASE WHEN l.slot > 1 THEN l.slot_of ELSE l.key END INTO v_newest, v_base
          FROM {schema}.lease l
         WHERE l.key = p_key AND EXISTS (SELECT 1 FROM {schema}.lease_epoch e WHERE e.store_id = p_store);
        IF p_token < v_newest THEN
            v_outcome := 'superseded';
        ELSIF v_base IS NOT NULL THEN
            -- The key's epoch on its rows, and (a key spelled like a slot, whose own row may now be another
            -- key's slot) the one it keeps apart (migrations/0019).
            SELECT pg_catalog.max(l.count_epoch) INTO v_floor FROM {schema}.lease l
             WHERE (l.key = v_base AND l.slot = 1) OR (l.slot_of = v_base AND l.slot > 1);
            v_floor := greatest(v_floor, (SELECT e.count_epoch FROM {schema}.lease_key_epoch e WHERE e.key = v_base));
            IF p_token <= v_floor THEN
                v_outcome := 'count_epoch';
                v_newest := v_floor;
            END IF;
        END IF;
    END IF;
    IF v_outcome IS NULL AND p_count_epoch IS NOT NULL THEN
        -- The key's count epoch, as its holders told it: raised by the first publish of a later period (the
        -- row locked, so a publish of an earlier period waits for it and then reads it), read under a share
        -- lock by every other (so a raise waits for the publishes already deciding). A token at or below it
        -- is refused.
        INSERT INTO {schema}.fence_count_epoch (resource, key, count_epoch, accepted_at)
        VALUES (p_resource, coalesce(p_base, p_key), p_count_epoch, pg_catalog.clock_timestamp())
        ON CONFLICT DO NOTHING;
        UPDATE {schema}.fence_count_epoch AS e
           SET count_epoch = p_count_epoch, accepted_at = pg_catalog.clock_timestamp()
         WHERE e.resource = p_resource AND e.key = coalesce(p_base, p_key) AND e.count_epoch < p_count_epoch;
        SELECT e.count_epoch INTO v_floor FROM {schema}.fence_count_epoch e
         WHERE e.resource = p_resource AND e.key = coalesce(p_base, p_key) FOR SHARE;
        IF p_token <= v_floor THEN
            v_outcome := 'count_epoch';
            v_newest := v_floor;
        END IF;
    END IF;
    IF v_outcome IS NULL THEN
        -- The key's own row, or (first publish of this key) a new row above the pre-version-3 floor, if any.
        -- A larger token is accepted; an equal one only from the same owner of the same lease store: the
        -- grant that token was issued for, publishing again.
        INSERT INTO {schema}.fence AS f (resource, key, token, owner, accepted_at, store_id)
        SELECT p_resource, p_key, p_token, p_owner, pg_catalog.clock_timestamp(), p_store
         WHERE p_token > coalesce((SELECT l.token FROM {schema}.fence l WHERE l.resource = p_resource AND l.key = ''), 0)
        ON CONFLICT (resource, key) DO UPDATE
            SET token = EXCLUDED.token, owner = EXCLUDED.owner, accepted_at = EXCLUDED.accepted_at,
                store_id = CASE WHEN f.token < EXCLUDED.token THEN EXCLUDED.store_id
                                ELSE coalesce(f.store_id, EXCLUDED.store_id) END
            WHERE f.token < EXCLUDED.token
               OR (f.token = EXCLUDED.token AND f.owner = EXCLUDED.owner
                   AND (f.store_id IS NULL OR EXCLUDED.store_id IS NULL OR f.store_id = EXCLUDED.store_id))
        RETURNING f.token, f.store_id INTO v_token, v_store;
        IF FOUND THEN
            RETURN QUERY SELECT 'accepted'::pg_catalog.text, v_token, v_store, v_newest;
            RETURN;
        END IF;
        v_outcome := 'stale';
    END IF;
    IF p_idempotency_key IS NOT NULL AND v_outcome <> 'duplicate' THEN
        -- A refused publish never uses up its idempotency key.
        DELETE FROM {schema}.fence_publish WHERE resource = p_resource AND idempotency_key = p_idempotency_key;
    END IF;
    SELECT c.token, c.store_id INTO v_token, v_store FROM {schema}.fence c
     WHERE c.resource = p_resource AND c.key IN (p_key, '')
     ORDER BY c.key = '' LIMIT 1;
    RETURN QUERY SELECT v_outcome, v_token, v_store, v_newest;
END;
$$;
