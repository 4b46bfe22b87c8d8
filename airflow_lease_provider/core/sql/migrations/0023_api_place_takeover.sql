-- Version 23 (issue 41): a new try of a waiting task keeps its owner's place. A place taken through the lease
-- API is kept only with the capability it was taken with (migrations/0021), and a task's new try (its
-- previous try's trigger died: nobody gave the place back) claims with a new place id, so another
-- capability: it was refused until the place lapsed. Each API claim now records when it was made
-- (lease_waiter.api_renewed_at; NULL for a place of the direct path or one claimed before this version), and
-- lease_wait_claim_api lets a claim of the SAME owner with another capability take the place over when it
-- is stale: not claimed for two thirds of the TTL it was last claimed for (its keeper claims every third),
-- as a lease lapses. A live place stays the taker's ('other', now with the time it may be taken over); a
-- claim of another owner does nothing new. docs/api.md, decision 9.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
ALTER TABLE {schema}.lease_waiter ADD COLUMN api_renewed_at timestamptz;

-- The answer gains a column (takeover_at): the function is dropped and made again, in this migration's
-- transaction.
DROP FUNCTION {schema}.lease_wait_claim_api(text, text, interval, integer, bytea, text, text, text, integer);

-- The lease API's waiting place (migrations/0021, 0023): p_owner's place among the waiters of p_key, taken
-- (at most p_max places per key) or kept (renewed for p_ttl) for the capability whose digest is p_digest.
-- A place of p_owner taken through the API with another capability is taken over (the new digest replaces
-- the old, which is spent; its since, so its order, is kept) only when it is stale: not claimed for two
-- thirds of the TTL it was last claimed for (its keeper claims it every third: it missed a whole period, a
-- dead keeper, as a lease's lapse). status: 'claimed' (kept or taken), 'taken_over' (taken over from a
-- stale keeper), 'full' (every place is another's), 'other' (p_owner's live place was taken with another
-- capability, or by the direct path: not the caller's; takeover_at says from when a claim may take it over,
-- NULL for a direct path's place). Returns every live waiter of the key, oldest first, each row carrying the
-- status; one row with NULL waiter columns when there is none (never for 'claimed' or 'taken_over').
CREATE FUNCTION {schema}.lease_wait_claim_api(p_key text, p_owner text, p_ttl interval, p_max integer,
                                              p_digest bytea, p_dag_id text, p_run_id text, p_task_id text,
                                              p_map_index integer)
RETURNS TABLE (status text, takeover_at timestamptz, owner text, since timestamptz, expires_at timestamptz,
               dag_id text, run_id text, task_id text, map_index integer)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_digest bytea;
    v_renewed timestamptz;
    v_expires timestamptz;
    v_takeover timestamptz;
    v_status text;
    v_now timestamptz;
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(125535, pg_catalog.hashtext(p_key));
    DELETE FROM {schema}.lease_waiter w WHERE w.key = p_key AND w.expires_at <= pg_catalog.clock_timestamp();
    v_now := pg_catalog.clock_timestamp();
    SELECT w.api_capability, w.api_renewed_at, w.expires_at INTO v_digest, v_renewed, v_expires
      FROM {schema}.lease_waiter w WHERE w.key = p_key AND w.owner = p_owner;
    IF FOUND THEN
        IF v_digest IS NOT NULL AND v_digest = p_digest THEN
            UPDATE {schema}.lease_waiter AS w
               SET expires_at = v_now + p_ttl, api_renewed_at = v_now
             WHERE w.key = p_key AND w.owner = p_owner;
            v_status := 'claimed';
        ELSIF v_digest IS NOT NULL AND v_renewed IS NOT NULL THEN
            v_takeover := v_renewed + (v_expires - v_renewed) * 2 / 3;
            IF v_now >= v_takeover THEN
                UPDATE {schema}.lease_waiter AS w
                   SET api_capability = p_digest, expires_at = v_now + p_ttl, api_renewed_at = v_now
                 WHERE w.key = p_key AND w.owner = p_owner;
                v_status := 'taken_over';
                v_takeover := NULL;
            ELSE
                v_status := 'other';
            END IF;
        ELSE
            v_status := 'other';
        END IF;
    ELSIF (SELECT pg_catalog.count(*) FROM {schema}.lease_waiter w WHERE w.key = p_key) < p_max THEN
        INSERT INTO {schema}.lease_waiter (key, owner, since, expires_at, dag_id, run_id, task_id, map_index,
                                           api_capability, api_renewed_at)
        VALUES (p_key, p_owner, v_now, v_now + p_ttl, p_dag_id, p_run_id, p_task_id, p_map_index, p_digest, v_now);
        v_status := 'claimed';
    ELSE
        v_status := 'full';
    END IF;
    RETURN QUERY
    SELECT v_status, v_takeover, w.owner, w.since, w.expires_at, w.dag_id, w.run_id, w.task_id, w.map_index
      FROM {schema}.lease_waiter w WHERE w.key = p_key ORDER BY w.since, w.owner;
    IF NOT FOUND THEN
        RETURN QUERY SELECT v_status, v_takeover, NULL::text, NULL::timestamptz, NULL::timestamptz, NULL::text,
                            NULL::text, NULL::text, NULL::integer;
    END IF;
END;
$$;
