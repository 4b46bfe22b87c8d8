-- Version 1 of the lease store. Runs with search_path set to the store's schema, inside one transaction
-- that holds an advisory lock, so many processes starting at once create it exactly once.

-- One row per lease key, kept forever: release and expiry only move expires_at, so the token column
-- never goes back or repeats (DESIGN decision 2). fillfactor leaves room for HOT updates: no indexed
-- column changes on acquire, renew or release, so the table stays small under constant updates.
CREATE TABLE lease (
    key          text        PRIMARY KEY,
    owner        text        NOT NULL,
    token        bigint      NOT NULL CHECK (token > 0),
    ttl          interval    NOT NULL,
    acquired_at  timestamptz NOT NULL,
    renewed_at   timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    released_at  timestamptz
) WITH (fillfactor = 50);

-- The resource-side gate: the largest token each write target has accepted.
CREATE TABLE fence (
    resource     text        PRIMARY KEY,
    token        bigint      NOT NULL CHECK (token > 0),
    owner        text,
    accepted_at  timestamptz NOT NULL
) WITH (fillfactor = 50);

-- Idempotency keys of publishes: one row per (resource, key) ever published.
CREATE TABLE fence_publish (
    resource         text        NOT NULL,
    idempotency_key  text        NOT NULL,
    token            bigint      NOT NULL,
    owner            text,
    published_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (resource, idempotency_key)
);

-- The event ledger: what happened, with database timestamps. Bounded by a retention setting.
CREATE TABLE event (
    id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind    text        NOT NULL,
    key     text        NOT NULL,
    owner   text,
    token   bigint,
    detail  jsonb       NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX event_at_idx ON event (at);
CREATE INDEX event_key_at_idx ON event (key, at);

-- Advance a fence, with an optional idempotency key, as one atomic statement for the caller.
-- Outcomes: 'accepted'; 'stale' (a token >= p_token was accepted before: nothing written);
-- 'duplicate' (p_idempotency_key was already published: nothing written).
-- In plpgsql each statement takes a fresh snapshot, so current_token is the value that decided.
CREATE FUNCTION fence_advance(p_resource text, p_token bigint, p_owner text, p_idempotency_key text)
RETURNS TABLE (outcome text, current_token bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_token bigint;
BEGIN
    IF p_idempotency_key IS NULL THEN
        INSERT INTO fence AS f (resource, token, owner, accepted_at)
        VALUES (p_resource, p_token, p_owner, clock_timestamp())
        ON CONFLICT (resource) DO UPDATE
            SET token = EXCLUDED.token, owner = EXCLUDED.owner, accepted_at = EXCLUDED.accepted_at
            WHERE f.token < EXCLUDED.token
        RETURNING f.token INTO v_token;
        IF FOUND THEN
            RETURN QUERY SELECT 'accepted'::text, v_token;
        ELSE
            RETURN QUERY SELECT 'stale'::text, (SELECT f.token FROM fence f WHERE f.resource = p_resource);
        END IF;
        RETURN;
    END IF;

    -- Claim the idempotency key first: a concurrent publish of the same key waits here for ours to
    -- commit or roll back. If the fence then refuses the token, the block's subtransaction undoes the
    -- claim, so a rejected publish never uses up its key.
    BEGIN
        INSERT INTO fence_publish (resource, idempotency_key, token, owner)
        VALUES (p_resource, p_idempotency_key, p_token, p_owner)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'duplicate'::text, (SELECT f.token FROM fence f WHERE f.resource = p_resource);
            RETURN;
        END IF;
        INSERT INTO fence AS f (resource, token, owner, accepted_at)
        VALUES (p_resource, p_token, p_owner, clock_timestamp())
        ON CONFLICT (resource) DO UPDATE
            SET token = EXCLUDED.token, owner = EXCLUDED.owner, accepted_at = EXCLUDED.accepted_at
            WHERE f.token < EXCLUDED.token
        RETURNING f.token INTO v_token;
        IF FOUND THEN
            RETURN QUERY SELECT 'accepted'::text, v_token;
            RETURN;
        END IF;
        RAISE EXCEPTION 'stale fencing token' USING ERRCODE = 'LP409';
    EXCEPTION WHEN SQLSTATE 'LP409' THEN
        RETURN QUERY SELECT 'stale'::text, (SELECT f.token FROM fence f WHERE f.resource = p_resource);
    END;
END;
$$;
