-- What a fence needs in a database that holds no lease store (migrations/0010): the write target of
-- FenceStore(fence_only=True), which the Airflow layer uses for a fence kept in another database than
-- the lease's (`conn_id=` / `fence_conn_id=`). The same tables and functions as the full schema's
-- (tests/core/test_fence_grants.py compares them), without the lease, ledger and epoch: a fence kept here
-- cannot see the key's newest grant, and its rejections are recorded in the lease store's ledger.
-- fence_schema_version marks the layout (the full schema has schema_version instead). {schema} is the
-- target's schema, filled in as schema.sql's is (core/db/sqltext.py, with_schema).
CREATE TABLE {schema}.fence_schema_version (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE {schema}.fence (
    resource     text        NOT NULL,
    token        bigint      NOT NULL CHECK (token > 0),
    owner        text,
    accepted_at  timestamptz NOT NULL,
    key          text        NOT NULL,
    store_id     uuid,
    PRIMARY KEY (resource, key)
) WITH (fillfactor = 50);

CREATE TABLE {schema}.fence_publish (
    resource         text        NOT NULL,
    idempotency_key  text        NOT NULL,
    token            bigint      NOT NULL,
    owner            text,
    published_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (resource, idempotency_key)
);

CREATE FUNCTION {schema}.fence_token(p_resource text, p_key text)
RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT f.token FROM {schema}.fence f WHERE f.resource = p_resource AND f.key IN (p_key, '')
     ORDER BY f.key = '' LIMIT 1
$$;

-- As the full schema's fence_advance, without the newest-grant check (no lease table here).
CREATE FUNCTION {schema}.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                       p_idempotency_key text, p_store uuid)
RETURNS TABLE (outcome text, current_token bigint, current_store uuid, newest_grant bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    v_token bigint;
    v_store pg_catalog.uuid;
    v_newest bigint;
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
