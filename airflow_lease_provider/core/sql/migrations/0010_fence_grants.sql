-- Version 10 (issue 23): the fence lets the holder of a grant publish again, knows which lease store a
-- token came from, and a store can be told a token floor.
--
-- * A fence accepts a token larger than the largest it accepted (as before) or EQUAL to it from the same
--   owner of the same lease store: tokens are issued per grant, so an equal token from the same owner is
--   the same grant publishing again (a second task of a run-scoped lease, a mapped instance, a second
--   fence call in one task). A zombie's older token is still refused, and so is an equal token from
--   another owner or another store (only a reissued token can be that). One INSERT ... ON CONFLICT DO
--   UPDATE ... WHERE, under the row lock: no read-then-write window.
-- * lease_epoch.store_id: a random id made once per lease store (kept by a dump and restore, new for a
--   store created again). Every fence row records the store id of the token it accepted, so a refusal of
--   a token from another store can say so: the store appears recreated and must be told a floor.
-- * Where the fence is kept in the lease store that issued the token (the caller passes its store id,
--   and it is this schema's), a token below the key's newest grant is refused ('superseded'): the old
--   holder after a force-release, or after a new grant, before any later token has published there.
-- * lease_epoch_raise(reason, above): a new epoch whose every token is larger than `above` (a token a
--   fence kept elsewhere accepted from the store before it was recreated).
-- The five-argument fence_advance stays, as a call of the new one without a store id, so processes still
-- running version 9's code keep working during an upgrade.
ALTER TABLE lease_epoch ADD COLUMN store_id uuid NOT NULL DEFAULT (md5(random()::text || clock_timestamp()::text)::uuid);
ALTER TABLE fence ADD COLUMN store_id uuid;

DO $migration$
DECLARE
    s text := current_schema();
BEGIN
    IF s IS NULL THEN
        RAISE EXCEPTION 'no current schema: the migrator sets search_path to the store''s schema';
    END IF;

    -- fence advance: the idempotency claim, the newest-grant check, the conditional upsert, the claim given
    -- back when refused.
    EXECUTE format($def$
CREATE FUNCTION %1$I.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                   p_idempotency_key text, p_store uuid)
RETURNS TABLE (outcome text, current_token bigint, current_store uuid, newest_grant bigint)
LANGUAGE plpgsql
AS %2$L
$def$, s, format($body$
DECLARE
    v_token bigint;
    v_store pg_catalog.uuid;
    v_newest bigint;
    v_outcome pg_catalog.text;
BEGIN
    IF p_idempotency_key IS NOT NULL THEN
        INSERT INTO %1$I.fence_publish (resource, idempotency_key, token, owner)
        VALUES (p_resource, p_idempotency_key, p_token, p_owner)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            v_outcome := 'duplicate';
        END IF;
    END IF;
    IF v_outcome IS NULL AND p_store IS NOT NULL THEN
        -- Kept in the lease store that issued the token: a token below the key's newest grant belongs to
        -- a holder the lease has moved past (granted again, or force-released), refused before any later
        -- token has published here.
        SELECT l.token INTO v_newest FROM %1$I.lease l
         WHERE l.key = p_key AND EXISTS (SELECT 1 FROM %1$I.lease_epoch e WHERE e.store_id = p_store);
        IF p_token < v_newest THEN
            v_outcome := 'superseded';
        END IF;
    END IF;
    IF v_outcome IS NULL THEN
        -- The key's own row, or (first publish of this key) a new row above the pre-version-3 floor, if any.
        -- A larger token is accepted; an equal one only from the same owner of the same lease store: the
        -- grant that token was issued for, publishing again.
        INSERT INTO %1$I.fence AS f (resource, key, token, owner, accepted_at, store_id)
        SELECT p_resource, p_key, p_token, p_owner, pg_catalog.clock_timestamp(), p_store
         WHERE p_token > coalesce((SELECT l.token FROM %1$I.fence l WHERE l.resource = p_resource AND l.key = ''), 0)
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
        DELETE FROM %1$I.fence_publish WHERE resource = p_resource AND idempotency_key = p_idempotency_key;
    END IF;
    SELECT c.token, c.store_id INTO v_token, v_store FROM %1$I.fence c
     WHERE c.resource = p_resource AND c.key IN (p_key, '')
     ORDER BY c.key = '' LIMIT 1;
    RETURN QUERY SELECT v_outcome, v_token, v_store, v_newest;
END;
$body$, s));

    -- Version 9's call, for processes still running its code.
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                              p_idempotency_key text)
RETURNS TABLE (outcome text, current_token bigint)
LANGUAGE sql
AS %2$L
$def$, s, format($body$
    SELECT a.outcome, a.current_token
      FROM %1$I.fence_advance(p_resource, p_key, p_token, p_owner, p_idempotency_key, NULL::pg_catalog.uuid) a
$body$, s));
END;
$migration$;

-- The operator's step after the store was recreated while a fence kept elsewhere has its old tokens: a new
-- epoch whose floor is above p_above (and above the next epoch and the timeline, as lease_epoch_bump).
CREATE FUNCTION lease_epoch_raise(p_reason text, p_above bigint)
RETURNS TABLE (epoch integer, system_identifier bigint, timeline integer, changed_at timestamptz, reason text)
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
AS $$
    UPDATE lease_epoch e
       SET epoch = greatest(e.epoch + 1, lease_timeline(), (p_above >> 40)::integer + 1),
           system_identifier = (pg_control_system()).system_identifier,
           timeline = lease_timeline(), changed_at = clock_timestamp(), reason = p_reason
    RETURNING e.epoch, e.system_identifier, e.timeline, e.changed_at, e.reason
$$;
