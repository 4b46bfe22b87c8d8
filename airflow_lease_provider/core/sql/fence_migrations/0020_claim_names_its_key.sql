-- Version 20 of the fence-only layout (issue 41, as the store's migrations/0020): an idempotency claim
-- names the lease key of the grant that made it. fence_publish kept the resource, idempotency key, token and owner of a claim, and
-- fence_claim_release (queries.sql; POST /lease/v1/fence/give_back) deleted the claim matching those: a grant
-- of ANOTHER lease key, taken under the same owner name (owners are free text) with the same token (every
-- key's tokens start at the same floor), gave back a claim it never made, and the slot could be published
-- twice. fence_advance now records the key, and fence_claim_release matches it too.
--
-- Claims written before this version have no key (NULL) and are never given back: no key matches NULL
-- (fail closed). Which grant made them cannot be told after the fact (the fence row of a (resource, key)
-- keeps only its latest token), and giving back is the one step that can let a slot publish twice; the
-- cost is that a publish in flight across the upgrade whose side effect then fails keeps its claim (the
-- slot counts as published until the row is deleted by hand), as after a lost answer to a give-back.
--
-- The fence-only target's fence_publish and fence_advance (without the newest-grant check), changed as the
-- store's. {schema} is the target's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
ALTER TABLE {schema}.fence_publish ADD COLUMN key text;

CREATE OR REPLACE FUNCTION {schema}.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                       p_idempotency_key text, p_store uuid, p_base text, p_count_epoch bigint)
RETURNS TABLE (outcome text, current_token bigint, current_store uuid, newest_grant bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    v_token bigint;
    v_store pg_catalog.uuid;
    v_newest bigint;
    v_floor bigint;
    v_outcome pg_catalog.text;
BEGIN
    IF p_idempotency_key IS NOT NULL THEN
        -- The claim names the lease key of the grant that made it: only that grant gives it back
        -- (fence_claim_release, migrations/0020).
        INSERT INTO {schema}.fence_publish (resource, idempotency_key, token, owner, key)
        VALUES (p_resource, p_idempotency_key, p_token, p_owner, p_key)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            v_outcome := 'duplicate';
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
