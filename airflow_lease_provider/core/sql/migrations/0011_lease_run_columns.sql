-- Version 11 (issue 24): a lease names its holder's run in typed columns, as events have since version 7,
-- and every DAG-scoped read (the status pages, the CLI, the counts, the DAG tab and its trends) reads the
-- run columns of leases and events: no current query parses an owner string.
--
-- * lease.dag_id, run_id, task_id, map_index: written with every grant by lease_acquire from the run the
--   caller passed (the Airflow layer passes the task instance; a core API user who passes none gets NULL
--   columns, a lease of no DAG). lease_dag_key_idx reads one DAG's leases.
-- * Rows written before this version are filled in once, here, from their owner (the only place that
--   reads a run out of an owner string): the DAG is the owner up to its first '/' (what the DAG-scoped
--   reads took it to be until now), and the run, task and map index come from the operators' owner
--   formats (dag_id/run_id, dag_id/run_id/task_id[map_index], or dag_id/run_id/map_index from before
--   owners named the task; another owner with a '/' gets its second part as the run). Events that
--   version 7 left without a run get their DAG the same way (their detail's dag_id first), so every old
--   row stays in the DAG it was in; a row whose dag_id is set has a run_id too.
-- * event_dag_at_idx is re-keyed from the owner-and-detail expression of version 5 to (dag_id, at).
-- * The three-argument lease_acquire of version 10 stays, as a call of the new one naming no run, so
--   processes still running version 10's code keep working during an upgrade (their grants have NULL run
--   columns until they are granted again by an upgraded process).
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
ALTER TABLE {schema}.lease
    ADD COLUMN dag_id    text,
    ADD COLUMN run_id    text,
    ADD COLUMN task_id   text,
    ADD COLUMN map_index integer;

UPDATE {schema}.lease AS l
   SET dag_id = split_part(l.owner, '/', 1),
       run_id = coalesce(o.m[2], split_part(l.owner, '/', 2)),
       task_id = CASE WHEN o.m[3] ~ '^[0-9]+$' THEN NULL ELSE o.m[3] END,
       map_index = CASE WHEN o.m[3] ~ '^[0-9]+$' THEN o.m[3]::integer
                        WHEN o.m[3] IS NOT NULL THEN coalesce(o.m[4]::integer, -1) END
  FROM (SELECT lo.key, regexp_match(lo.owner, '^([^/]+)/([^/]+)(?:/([^/\[\]]+?)(?:\[([0-9]{1,9})\])?)?$') AS m
          FROM {schema}.lease lo) o
 WHERE l.key = o.key AND strpos(l.owner, '/') > 1;

UPDATE {schema}.event AS e
   SET dag_id = coalesce(e.detail->>'dag_id', split_part(e.owner, '/', 1)),
       run_id = coalesce(e.detail->>'run_id', CASE WHEN strpos(e.owner, '/') > 1 THEN split_part(e.owner, '/', 2) END, '')
 WHERE e.dag_id IS NULL AND (e.detail->>'dag_id' IS NOT NULL OR strpos(e.owner, '/') > 1);

DROP INDEX {schema}.event_dag_at_idx;
CREATE INDEX event_dag_at_idx ON {schema}.event (dag_id, at);
CREATE INDEX lease_dag_key_idx ON {schema}.lease (dag_id, key);

-- acquire, writing the holder's run columns with every grant.
CREATE FUNCTION {schema}.lease_acquire(p_key text, p_owner text, p_ttl interval, p_dag_id text, p_run_id text,
                                       p_task_id text, p_map_index integer)
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
               dag_id = p_dag_id, run_id = p_run_id, task_id = p_task_id, map_index = p_map_index
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

-- The call of version 10: a grant that names no run.
CREATE OR REPLACE FUNCTION {schema}.lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE sql
AS $$
    SELECT * FROM {schema}.lease_acquire(p_key, p_owner, p_ttl, NULL::pg_catalog.text, NULL::pg_catalog.text,
                                         NULL::pg_catalog.text, NULL::pg_catalog.int4)
$$;

-- acquire with the ledger on: the run goes to the grant as well as to its event.
CREATE OR REPLACE FUNCTION {schema}.lease_acquire_logged(p_key text, p_owner text, p_ttl interval, p_detail jsonb,
                                              p_dag_id text, p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               logged boolean)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM {schema}.lease_acquire(p_key, p_owner, p_ttl, p_dag_id, p_run_id, p_task_id, p_map_index) LOOP
        logged := false;
        IF r.acquired THEN
            BEGIN
                PERFORM {schema}.lease_event_insert('acquired', p_key, p_owner, r.token,
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
$$;
