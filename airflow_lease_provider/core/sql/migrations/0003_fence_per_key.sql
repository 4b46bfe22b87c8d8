-- Version 3: a fence per (resource, lease key). A token is only ever compared with tokens of its own lease
-- key: tokens are counted per key, so comparing tokens of different keys orders holders that were never
-- mutually exclusive (it refuses a valid holder of another key, or proves nothing). Idempotency keys stay
-- per resource.
--
-- Rows from before this version have key '' (no caller can pass an empty key): a floor for every key of
-- that resource that has no row of its own yet, so a token refused before the upgrade is still refused
-- after it. The old four-argument fence_advance is dropped, so a process still running the old code fails
-- closed instead of advancing a fence it no longer understands.
ALTER TABLE fence ADD COLUMN key text NOT NULL DEFAULT '';
ALTER TABLE fence ALTER COLUMN key DROP DEFAULT;
ALTER TABLE fence DROP CONSTRAINT fence_pkey;
ALTER TABLE fence ADD PRIMARY KEY (resource, key);

DROP FUNCTION fence_advance(text, bigint, text, text);

CREATE FUNCTION fence_advance(p_resource text, p_key text, p_token bigint, p_owner text, p_idempotency_key text)
RETURNS TABLE (outcome text, current_token bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_token bigint;
BEGIN
    IF p_idempotency_key IS NOT NULL THEN
        INSERT INTO fence_publish (resource, idempotency_key, token, owner)
        VALUES (p_resource, p_idempotency_key, p_token, p_owner)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'duplicate'::text, fence_token(p_resource, p_key);
            RETURN;
        END IF;
    END IF;
    -- The key's own row, or (first publish of this key) a new row above the pre-version-3 floor, if any.
    INSERT INTO fence AS f (resource, key, token, owner, accepted_at)
    SELECT p_resource, p_key, p_token, p_owner, clock_timestamp()
     WHERE p_token > coalesce((SELECT l.token FROM fence l WHERE l.resource = p_resource AND l.key = ''), 0)
    ON CONFLICT (resource, key) DO UPDATE
        SET token = EXCLUDED.token, owner = EXCLUDED.owner, accepted_at = EXCLUDED.accepted_at
        WHERE f.token < EXCLUDED.token
    RETURNING f.token INTO v_token;
    IF FOUND THEN
        RETURN QUERY SELECT 'accepted'::text, v_token;
        RETURN;
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        -- A refused publish never uses up its idempotency key.
        DELETE FROM fence_publish WHERE resource = p_resource AND idempotency_key = p_idempotency_key;
    END IF;
    RETURN QUERY SELECT 'stale'::text, fence_token(p_resource, p_key);
END;
$$;

-- The token a new publish of p_key to p_resource must exceed: the key's own, else the pre-version-3 floor.
CREATE FUNCTION fence_token(p_resource text, p_key text)
RETURNS bigint
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT f.token FROM fence f WHERE f.resource = p_resource AND f.key IN (p_key, '')
     ORDER BY f.key = '' LIMIT 1
$$;
