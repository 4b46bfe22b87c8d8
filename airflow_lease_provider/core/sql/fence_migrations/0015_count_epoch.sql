-- Version 15 of the fence-only layout (issue 38): the count epoch, as the store's migrations/0015 adds it to
-- the whole store's fence. fence_count_epoch keeps per (resource, lease key) the largest count epoch the key's
-- holders told the fence; fence_advance takes the holder's base key and count epoch and refuses a token at
-- or below that epoch ('count_epoch'); version 10's call stays, naming none. Without the newest-grant check
-- (no lease table here). A target is created from fence_schema.sql (version 10) and then these files.
CREATE TABLE {schema}.fence_count_epoch (
    resource     text        NOT NULL,
    key          text        NOT NULL,
    count_epoch  bigint      NOT NULL,
    accepted_at  timestamptz NOT NULL,
    PRIMARY KEY (resource, key)
) WITH (fillfactor = 50);

DROP FUNCTION {schema}.fence_advance(text, text, bigint, text, text, uuid);

CREATE FUNCTION {schema}.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
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
        INSERT INTO {schema}.fence_publish (resource, idempotency_key, token, owner)
        VALUES (p_resource, p_idempotency_key, p_token, p_owner)
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

-- The call of version 10 (version 9's calls it), for processes still running its code: a publish that names
-- no count epoch (the fence of its time).
CREATE FUNCTION {schema}.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                       p_idempotency_key text, p_store uuid)
RETURNS TABLE (outcome text, current_token bigint, current_store uuid, newest_grant bigint)
LANGUAGE sql
AS $$
    SELECT a.outcome, a.current_token, a.current_store, a.newest_grant
      FROM {schema}.fence_advance(p_resource, p_key, p_token, p_owner, p_idempotency_key, p_store,
                                  NULL::pg_catalog.text, NULL::bigint) a
$$;
