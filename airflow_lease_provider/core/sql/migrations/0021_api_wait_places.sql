-- Version 21 (issue 41): waiting places through the lease API. A place taken over HTTP keeps the digest of
-- its capability, sha256('place' \0 key \0 owner \0 capability), in lease_waiter.api_capability (NULL for a
-- place of the direct path, which no API caller can keep or give back). lease_wait_claim_api takes or
-- keeps a place as lease_wait_claim does (the same advisory lock, at most p_max per key), but keeps one only
-- for the caller whose capability it was taken with: a place of the same owner under another capability
-- (or none) is neither renewed nor replaced ('other'). The direct path's statements never read the column.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
ALTER TABLE {schema}.lease_waiter ADD COLUMN api_capability bytea;

-- The lease API's waiting place (migrations/0021): p_owner's place among the waiters of p_key, taken (at
-- most p_max places per key) or kept (renewed for p_ttl) for the capability whose digest is p_digest.
-- status: 'claimed' (the caller has the place now), 'full' (every place is another's), 'other' (p_owner's
-- place was taken with another capability, or by the direct path: not the caller's). Returns every live
-- waiter of the key, oldest first, each row carrying the status; one row with NULL waiter columns when
-- there is none (never for 'claimed').
CREATE FUNCTION {schema}.lease_wait_claim_api(p_key text, p_owner text, p_ttl interval, p_max integer,
                                              p_digest bytea, p_dag_id text, p_run_id text, p_task_id text,
                                              p_map_index integer)
RETURNS TABLE (status text, owner text, since timestamptz, expires_at timestamptz, dag_id text, run_id text,
               task_id text, map_index integer)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_digest bytea;
    v_status text;
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(125535, pg_catalog.hashtext(p_key));
    DELETE FROM {schema}.lease_waiter w WHERE w.key = p_key AND w.expires_at <= pg_catalog.clock_timestamp();
    SELECT w.api_capability INTO v_digest FROM {schema}.lease_waiter w WHERE w.key = p_key AND w.owner = p_owner;
    IF FOUND THEN
        IF v_digest IS NOT NULL AND v_digest = p_digest THEN
            UPDATE {schema}.lease_waiter AS w SET expires_at = pg_catalog.clock_timestamp() + p_ttl
             WHERE w.key = p_key AND w.owner = p_owner;
            v_status := 'claimed';
        ELSE
            v_status := 'other';
        END IF;
    ELSIF (SELECT pg_catalog.count(*) FROM {schema}.lease_waiter w WHERE w.key = p_key) < p_max THEN
        INSERT INTO {schema}.lease_waiter (key, owner, since, expires_at, dag_id, run_id, task_id, map_index,
                                           api_capability)
        VALUES (p_key, p_owner, pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() + p_ttl,
                p_dag_id, p_run_id, p_task_id, p_map_index, p_digest);
        v_status := 'claimed';
    ELSE
        v_status := 'full';
    END IF;
    RETURN QUERY
    SELECT v_status, w.owner, w.since, w.expires_at, w.dag_id, w.run_id, w.task_id, w.map_index
      FROM {schema}.lease_waiter w WHERE w.key = p_key ORDER BY w.since, w.owner;
    IF NOT FOUND THEN
        RETURN QUERY SELECT v_status, NULL::text, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::text,
                            NULL::text, NULL::integer;
    END IF;
END;
$$;
