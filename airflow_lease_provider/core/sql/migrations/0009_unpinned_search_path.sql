-- Version 9: the functions every lease and fence call runs, without `SET search_path FROM CURRENT`
-- (issue 15). A function with a SET clause is called through fmgr_security_definer: the setting is saved,
-- set and restored and the search path recomputed on every call, which cost 30-40 % of a held-key acquire
-- on the server (pgbench, prepared, 16 clients: 42.5k tps with the clause, 60k without). Without the
-- clause the functions run with the caller's search_path, so every object of the store they name is
-- schema-qualified here instead, and every function and type name they look up is qualified too
-- (pg_catalog's own, and the store's; extract, greatest, coalesce and the keyword types are resolved in
-- pg_catalog by the grammar): a caller's search_path (another client's, behind pgbouncer), a table of the
-- same name in another schema or a temporary one cannot change what they read or write. Operators are
-- looked up with pg_catalog first, as in every session that does not list pg_catalog after another schema. Same results, same statements, same database clock.
--
-- The schema's name is chosen by the user, so the definitions are built here with format(): %1$I is the
-- schema (the migrator runs with search_path set to it, so current_schema() names it) quoted as an
-- identifier, and each body is passed to CREATE FUNCTION as a literal (%2$L), so no name can end it.
-- lease_epoch_bump (an operator's command, not a hot path) and lease_timeline (no SET clause) stay.
DO $migration$
DECLARE
    s text := current_schema();
BEGIN
    IF s IS NULL THEN
        RAISE EXCEPTION 'no current schema: the migrator sets search_path to the store''s schema';
    END IF;

    -- The floor of every token issued now (migrations/0006), unchanged but for the qualified names.
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.lease_token_floor()
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS %2$L
$def$, s, format($body$
DECLARE
    -- The system identifier never changes while a server runs: read from the control file once per
    -- session. The timeline does (a promoted standby keeps its sessions): read on every call.
    v_system bigint := nullif(pg_catalog.current_setting('airflow_lease.system_identifier', true), '')::bigint;
    v_timeline integer := %1$I.lease_timeline();
    v_epoch integer;
BEGIN
    IF v_system IS NULL THEN
        v_system := (pg_catalog.pg_control_system()).system_identifier;
        PERFORM pg_catalog.set_config('airflow_lease.system_identifier', v_system::pg_catalog.text, false);
    END IF;
    SELECT e.epoch INTO v_epoch FROM %1$I.lease_epoch e
     WHERE e.system_identifier = v_system AND e.timeline = v_timeline;
    IF NOT FOUND THEN
        UPDATE %1$I.lease_epoch e
           SET epoch = greatest(e.epoch + 1, v_timeline), system_identifier = v_system, timeline = v_timeline,
               changed_at = pg_catalog.clock_timestamp(), reason = 'new server history'
         WHERE e.system_identifier <> v_system OR e.timeline <> v_timeline
        RETURNING e.epoch INTO v_epoch;
        IF NOT FOUND THEN
            SELECT e.epoch INTO v_epoch FROM %1$I.lease_epoch e;
        END IF;
    END IF;
    RETURN v_epoch::bigint << 40;
END;
$body$, s));

    -- acquire (migrations/0008): the read first, then the conditional UPDATE, then the INSERT.
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
AS %2$L
$def$, s, format($body$
#variable_conflict use_column
BEGIN
    FOR attempt IN 1..3 LOOP
        RETURN QUERY
        SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
               pg_catalog.clock_timestamp()
          FROM %1$I.lease l
         WHERE l.key = p_key AND l.expires_at > pg_catalog.clock_timestamp() AND l.owner <> p_owner;
        IF FOUND THEN
            RETURN;
        END IF;
        RETURN QUERY
        UPDATE %1$I.lease AS l
           SET owner = p_owner, token = greatest(l.token + 1, %1$I.lease_token_floor() + 1), ttl = p_ttl,
               acquired_at = pg_catalog.clock_timestamp(), renewed_at = pg_catalog.clock_timestamp(),
               expires_at = pg_catalog.clock_timestamp() + p_ttl, released_at = NULL
         WHERE l.key = p_key AND (l.expires_at <= pg_catalog.clock_timestamp() OR l.owner = p_owner)
        RETURNING true, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
                  pg_catalog.clock_timestamp();
        IF FOUND THEN
            RETURN;
        END IF;
        RETURN QUERY
        INSERT INTO %1$I.lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at)
        VALUES (p_key, p_owner, %1$I.lease_token_floor() + 1, p_ttl, pg_catalog.clock_timestamp(),
                pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() + p_ttl)
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
      FROM %1$I.lease l
     WHERE l.key = p_key;
END;
$body$, s));

    -- renew: extends a lease only while it is still this owner's, with this token, and unexpired (decision 6).
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.lease_renew(p_key text, p_owner text, p_token bigint, p_ttl interval)
RETURNS TABLE (key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
AS %2$L
$def$, s, format($body$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE %1$I.lease AS l
       SET renewed_at = pg_catalog.clock_timestamp(), expires_at = pg_catalog.clock_timestamp() + p_ttl, ttl = p_ttl
     WHERE l.key = p_key AND l.owner = p_owner AND l.token = p_token
       AND l.expires_at > pg_catalog.clock_timestamp() AND l.released_at IS NULL
    RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
              pg_catalog.clock_timestamp();
END;
$body$, s));

    -- release: frees the lease only if owner and token still match (decision 7). The row and its token stay.
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.lease_release(p_key text, p_owner text, p_token bigint)
RETURNS TABLE (key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
AS %2$L
$def$, s, format($body$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE %1$I.lease AS l
       SET expires_at = LEAST(l.expires_at, pg_catalog.clock_timestamp()), released_at = pg_catalog.clock_timestamp()
     WHERE l.key = p_key AND l.owner = p_owner AND l.token = p_token AND l.released_at IS NULL
    RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
              l.released_at;
END;
$body$, s));

    -- The ledger's one INSERT (record_event and the _logged functions below).
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.lease_event_insert(p_kind text, p_key text, p_owner text, p_token bigint,
                                                   p_detail jsonb, p_dag_id text, p_run_id text, p_task_id text,
                                                   p_map_index integer)
RETURNS TABLE (id bigint, at timestamptz)
LANGUAGE plpgsql
AS %2$L
$def$, s, format($body$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    INSERT INTO %1$I.event AS e (kind, key, owner, token, detail, dag_id, run_id, task_id, map_index)
    VALUES (p_kind, p_key, p_owner, p_token, p_detail, p_dag_id, p_run_id, p_task_id, p_map_index)
    RETURNING e.id, e.at;
END;
$body$, s));

    -- acquire with the ledger on (migrations/0008): the grant and its 'acquired' event in one transaction;
    -- the event best effort (`logged` false when its insert failed), a failed attempt writes nothing.
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.lease_acquire_logged(p_key text, p_owner text, p_ttl interval, p_detail jsonb,
                                                     p_dag_id text, p_run_id text, p_task_id text,
                                                     p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               logged boolean)
LANGUAGE plpgsql
AS %2$L
$def$, s, format($body$
#variable_conflict use_column
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM %1$I.lease_acquire(p_key, p_owner, p_ttl) LOOP
        logged := false;
        IF r.acquired THEN
            BEGIN
                PERFORM %1$I.lease_event_insert('acquired', p_key, p_owner, r.token,
                                                p_detail || pg_catalog.jsonb_build_object('expires_at', r.expires_at),
                                                p_dag_id, p_run_id, p_task_id, p_map_index);
                logged := true;
            EXCEPTION WHEN OTHERS THEN
                logged := false;
            END;
        END IF;
        acquired := r.acquired; key := r.key; owner := r.owner; token := r.token; ttl := r.ttl;
        acquired_at := r.acquired_at; renewed_at := r.renewed_at; expires_at := r.expires_at;
        released_at := r.released_at; observed_at := r.observed_at;
        RETURN NEXT;
    END LOOP;
END;
$body$, s));

    -- release with the ledger on: the release and its 'released' event in one transaction.
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.lease_release_logged(p_key text, p_owner text, p_token bigint, p_detail jsonb,
                                                     p_dag_id text, p_run_id text, p_task_id text,
                                                     p_map_index integer)
RETURNS TABLE (key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               logged boolean)
LANGUAGE plpgsql
AS %2$L
$def$, s, format($body$
#variable_conflict use_column
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM %1$I.lease_release(p_key, p_owner, p_token) LOOP
        BEGIN
            PERFORM %1$I.lease_event_insert('released', p_key, p_owner, p_token,
                                            p_detail || pg_catalog.jsonb_build_object(
                                                'held_seconds',
                                                extract(epoch FROM r.observed_at - r.acquired_at)::double precision,
                                                'released_at', r.observed_at),
                                            p_dag_id, p_run_id, p_task_id, p_map_index);
            logged := true;
        EXCEPTION WHEN OTHERS THEN
            logged := false;
        END;
        key := r.key; owner := r.owner; token := r.token; ttl := r.ttl; acquired_at := r.acquired_at;
        renewed_at := r.renewed_at; expires_at := r.expires_at; released_at := r.released_at;
        observed_at := r.observed_at;
        RETURN NEXT;
    END LOOP;
END;
$body$, s));

    -- The token a new publish of p_key to p_resource must exceed (migrations/0003).
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.fence_token(p_resource text, p_key text)
RETURNS bigint
LANGUAGE sql STABLE
AS %2$L
$def$, s, format($body$
    SELECT f.token FROM %1$I.fence f WHERE f.resource = p_resource AND f.key IN (p_key, '')
     ORDER BY f.key = '' LIMIT 1
$body$, s));

    -- fence advance (migrations/0003): the idempotency claim, the conditional upsert, the claim given back
    -- when the token is stale.
    EXECUTE format($def$
CREATE OR REPLACE FUNCTION %1$I.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                              p_idempotency_key text)
RETURNS TABLE (outcome text, current_token bigint)
LANGUAGE plpgsql
AS %2$L
$def$, s, format($body$
DECLARE
    v_token bigint;
BEGIN
    IF p_idempotency_key IS NOT NULL THEN
        INSERT INTO %1$I.fence_publish (resource, idempotency_key, token, owner)
        VALUES (p_resource, p_idempotency_key, p_token, p_owner)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'duplicate'::pg_catalog.text, %1$I.fence_token(p_resource, p_key);
            RETURN;
        END IF;
    END IF;
    -- The key's own row, or (first publish of this key) a new row above the pre-version-3 floor, if any.
    INSERT INTO %1$I.fence AS f (resource, key, token, owner, accepted_at)
    SELECT p_resource, p_key, p_token, p_owner, pg_catalog.clock_timestamp()
     WHERE p_token > coalesce((SELECT l.token FROM %1$I.fence l WHERE l.resource = p_resource AND l.key = ''), 0)
    ON CONFLICT (resource, key) DO UPDATE
        SET token = EXCLUDED.token, owner = EXCLUDED.owner, accepted_at = EXCLUDED.accepted_at
        WHERE f.token < EXCLUDED.token
    RETURNING f.token INTO v_token;
    IF FOUND THEN
        RETURN QUERY SELECT 'accepted'::pg_catalog.text, v_token;
        RETURN;
    END IF;
    IF p_idempotency_key IS NOT NULL THEN
        -- A refused publish never uses up its idempotency key.
        DELETE FROM %1$I.fence_publish WHERE resource = p_resource AND idempotency_key = p_idempotency_key;
    END IF;
    RETURN QUERY SELECT 'stale'::pg_catalog.text, %1$I.fence_token(p_resource, p_key);
END;
$body$, s));
END;
$migration$;
