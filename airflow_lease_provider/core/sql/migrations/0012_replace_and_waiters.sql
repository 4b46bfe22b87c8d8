-- Version 12 (issue 26): the overlap policies "replace" and "buffer_one" (and "wait" with max_waiting).
--
-- * lease.run_after: the holder's run order (Airflow: its DAG run's run_after), written by lease_replace;
--   NULL for a grant by lease_acquire (which now clears it). A replacing run takes the lease over only
--   from a holder whose run_after is strictly earlier than its own: an older run never replaces a newer one.
-- * lease.replaced_token: the token this grant took over from (lease_replace), NULL for a grant of a free
--   lease; the replaced holder reads it to tell "replaced" from "lost".
-- * lease_waiter: the places of the runs waiting for a key (at most max_waiting each), each with its own
--   expiry, renewed while the waiter is deferred: a dead waiter's place lapses by itself.
-- * lease_replace: the replace policy's acquire, one statement: a free, expired or own lease is taken as
--   lease_acquire takes it; a lease held by an older run is taken over with a strictly larger token, and
--   (ledger on) an 'acquired' event for the new holder and a 'replaced' event for the old one are written
--   in the same transaction.
-- * lease_wait_claim / lease_wait_release: take, keep or give back a waiter's place, serialized per key by
--   a transaction-scoped advisory lock.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
ALTER TABLE {schema}.lease
    ADD COLUMN run_after      timestamptz,
    ADD COLUMN replaced_token bigint;

CREATE TABLE {schema}.lease_waiter (
    key         text        NOT NULL,
    owner       text        NOT NULL,
    since       timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    dag_id      text,
    run_id      text,
    task_id     text,
    map_index   integer,
    PRIMARY KEY (key, owner)
);

-- acquire (migrations/0008, 0011, 0012): the read first (a key someone else holds costs one index lookup, no
-- row lock, no write), then the conditional UPDATE takes a free, expired or own lease, or the INSERT
-- creates a new key; each statement takes its own READ COMMITTED snapshot, and an UPDATE that finds
-- nothing starts over, at most three times. The token floor is computed only for a row written. The
-- holder's run columns are written with every grant; its run order (run_after) is unknown: cleared.
CREATE OR REPLACE FUNCTION {schema}.lease_acquire(p_key text, p_owner text, p_ttl interval, p_dag_id text,
                                                  p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    FOR attempt IN 1..3 LOOP
        RETURN QUERY
        SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
               pg_catalog.clock_timestamp()
          FROM {schema}.lease l
         WHERE l.key = p_key AND l.expires_at > pg_catalog.clock_timestamp() AND l.owner <> p_owner;
        IF FOUND THEN
            RETURN;
        END IF;
        RETURN QUERY
        UPDATE {schema}.lease AS l
           SET owner = p_owner, token = greatest(l.token + 1, {schema}.lease_token_floor() + 1), ttl = p_ttl,
               acquired_at = pg_catalog.clock_timestamp(), renewed_at = pg_catalog.clock_timestamp(),
               expires_at = pg_catalog.clock_timestamp() + p_ttl, released_at = NULL,
               dag_id = p_dag_id, run_id = p_run_id, task_id = p_task_id, map_index = p_map_index,
               run_after = NULL, replaced_token = NULL
         WHERE l.key = p_key AND (l.expires_at <= pg_catalog.clock_timestamp() OR l.owner = p_owner)
        RETURNING true, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
                  pg_catalog.clock_timestamp();
        IF FOUND THEN
            RETURN;
        END IF;
        RETURN QUERY
        INSERT INTO {schema}.lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at,
                                         dag_id, run_id, task_id, map_index)
        VALUES (p_key, p_owner, {schema}.lease_token_floor() + 1, p_ttl, pg_catalog.clock_timestamp(),
                pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() + p_ttl,
                p_dag_id, p_run_id, p_task_id, p_map_index)
        ON CONFLICT (key) DO NOTHING
        RETURNING true, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
                  pg_catalog.clock_timestamp();
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           pg_catalog.clock_timestamp()
      FROM {schema}.lease l
     WHERE l.key = p_key;
END;
$$;

-- replace (migrations/0012): the replace policy's acquire, one statement. A lease held by a run that is not
-- provably older (its run_after not strictly before p_run_after, or unknown), or by any other run when
-- p_takeover is false (a replace_grace not over yet), is answered by one read: no row lock, nothing written;
-- older says whether that holder's run is older (it would have been taken over). Otherwise the row is locked and decided again: a free, expired or own lease is
-- granted as lease_acquire grants it, a lease held by an older run is taken over; either way with a token
-- larger than the row's and than the epoch's floor, the grant's run order and (a takeover) the token it
-- replaced. With p_detail (the ledger on) the grant's 'acquired' event and, for a takeover, a 'replaced'
-- event about the old holder (its owner, token and run columns; the new holder's in its detail) are written
-- in the same transaction; logged says whether they were.
CREATE FUNCTION {schema}.lease_replace(p_key text, p_owner text, p_ttl interval, p_run_after timestamptz,
                                       p_takeover boolean, p_detail jsonb, p_dag_id text, p_run_id text, p_task_id text,
                                       p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               replaced_owner text, replaced_token bigint, logged boolean, older boolean)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_old record;
    v_new record;
    v_inserted boolean := false;
    v_taking boolean := false;
BEGIN
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           pg_catalog.clock_timestamp(), NULL::pg_catalog.text, NULL::bigint, false,
           coalesce(l.run_after < p_run_after, false)
      FROM {schema}.lease l
     WHERE l.key = p_key AND l.expires_at > pg_catalog.clock_timestamp() AND l.owner <> p_owner
       AND (NOT p_takeover OR NOT coalesce(l.run_after < p_run_after, false));
    IF FOUND THEN
        RETURN;
    END IF;
    LOOP
        SELECT l.owner, l.token, l.expires_at, l.run_after, l.dag_id, l.run_id, l.task_id, l.map_index
          INTO v_old FROM {schema}.lease l WHERE l.key = p_key FOR UPDATE;
        EXIT WHEN FOUND;
        INSERT INTO {schema}.lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at,
                                         dag_id, run_id, task_id, map_index, run_after)
        VALUES (p_key, p_owner, {schema}.lease_token_floor() + 1, p_ttl, pg_catalog.clock_timestamp(),
                pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() + p_ttl,
                p_dag_id, p_run_id, p_task_id, p_map_index, p_run_after)
        ON CONFLICT (key) DO NOTHING
        RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at
             INTO v_new;
        IF FOUND THEN
            v_inserted := true;
            EXIT;
        END IF;
    END LOOP;
    IF NOT v_inserted THEN
        v_taking := v_old.expires_at > pg_catalog.clock_timestamp() AND v_old.owner <> p_owner;
        IF v_taking AND (NOT p_takeover OR NOT coalesce(v_old.run_after < p_run_after, false)) THEN
            -- Granted to a run that is not older while this call waited for the row (or no takeover
            -- asked): it holds.
            RETURN QUERY
            SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at,
                   l.released_at, pg_catalog.clock_timestamp(), NULL::pg_catalog.text, NULL::bigint, false,
                   coalesce(v_old.run_after < p_run_after, false)
              FROM {schema}.lease l WHERE l.key = p_key;
            RETURN;
        END IF;
        UPDATE {schema}.lease AS l
           SET owner = p_owner, token = greatest(l.token + 1, {schema}.lease_token_floor() + 1), ttl = p_ttl,
               acquired_at = pg_catalog.clock_timestamp(), renewed_at = pg_catalog.clock_timestamp(),
               expires_at = pg_catalog.clock_timestamp() + p_ttl, released_at = NULL,
               dag_id = p_dag_id, run_id = p_run_id, task_id = p_task_id, map_index = p_map_index,
               run_after = p_run_after, replaced_token = CASE WHEN v_taking THEN v_old.token END
         WHERE l.key = p_key
        RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at
             INTO v_new;
    END IF;
    logged := false;
    IF p_detail IS NOT NULL THEN
        BEGIN
            PERFORM {schema}.lease_event_insert(
                'acquired', p_key, p_owner, v_new.token,
                p_detail || pg_catalog.jsonb_build_object('expires_at', v_new.expires_at)
                    || CASE WHEN v_taking THEN pg_catalog.jsonb_build_object(
                           'replaced_owner', v_old.owner, 'replaced_token', v_old.token) ELSE '{}'::jsonb END,
                p_dag_id, p_run_id, p_task_id, p_map_index);
            IF v_taking THEN
                PERFORM {schema}.lease_event_insert(
                    'replaced', p_key, v_old.owner, v_old.token,
                    pg_catalog.jsonb_build_object(
                        'by_owner', p_owner, 'by_token', v_new.token, 'by_dag_id', p_dag_id, 'by_run_id', p_run_id,
                        'by_task_id', p_task_id, 'by_map_index', p_map_index, 'run_after', v_old.run_after,
                        'by_run_after', p_run_after, 'expires_at', v_old.expires_at),
                    v_old.dag_id, v_old.run_id, v_old.task_id, v_old.map_index);
            END IF;
            logged := true;
        EXCEPTION WHEN OTHERS THEN
            logged := false;
        END;
    END IF;
    acquired := true; key := v_new.key; owner := v_new.owner; token := v_new.token; ttl := v_new.ttl;
    acquired_at := v_new.acquired_at; renewed_at := v_new.renewed_at; expires_at := v_new.expires_at;
    released_at := v_new.released_at; observed_at := pg_catalog.clock_timestamp();
    replaced_owner := CASE WHEN v_taking THEN v_old.owner END;
    replaced_token := CASE WHEN v_taking THEN v_old.token END;
    older := false;
    RETURN NEXT;
END;
$$;

-- A waiter's place (migrations/0012): take or keep p_owner's place among the waiters of p_key, at most
-- p_max of them; a place lapses at its expires_at unless renewed (by this call, again). Serialized per key
-- by a transaction-scoped advisory lock (class 0x1EA5F, the key's hash), so of many runs arriving at once
-- exactly p_max get a place. Returns every live waiter of the key, oldest first, each row saying whether
-- p_owner has a place now (claimed).
CREATE FUNCTION {schema}.lease_wait_claim(p_key text, p_owner text, p_ttl interval, p_max integer, p_dag_id text,
                                          p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (claimed boolean, owner text, since timestamptz, expires_at timestamptz, dag_id text, run_id text,
               task_id text, map_index integer)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_claimed boolean;
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(125535, pg_catalog.hashtext(p_key));
    DELETE FROM {schema}.lease_waiter w WHERE w.key = p_key AND w.expires_at <= pg_catalog.clock_timestamp();
    UPDATE {schema}.lease_waiter AS w SET expires_at = pg_catalog.clock_timestamp() + p_ttl
     WHERE w.key = p_key AND w.owner = p_owner;
    v_claimed := FOUND;
    IF NOT v_claimed AND (SELECT pg_catalog.count(*) FROM {schema}.lease_waiter w WHERE w.key = p_key) < p_max THEN
        INSERT INTO {schema}.lease_waiter (key, owner, since, expires_at, dag_id, run_id, task_id, map_index)
        VALUES (p_key, p_owner, pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() + p_ttl,
                p_dag_id, p_run_id, p_task_id, p_map_index);
        v_claimed := true;
    END IF;
    RETURN QUERY
    SELECT v_claimed, w.owner, w.since, w.expires_at, w.dag_id, w.run_id, w.task_id, w.map_index
      FROM {schema}.lease_waiter w WHERE w.key = p_key ORDER BY w.since, w.owner;
END;
$$;
