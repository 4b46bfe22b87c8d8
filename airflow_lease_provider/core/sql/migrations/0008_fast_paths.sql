-- Version 8: the cheapest statement first (issue 15). acquire reads before it writes, so a held key costs
-- one index lookup and no token floor; renew and release run as plpgsql functions, so their plans are
-- cached per session like acquire's (they were parsed and planned on every call). Same results, same
-- single round trip, same database clock.

-- acquire: a key someone else holds is answered by one read (a failed attempt takes no row lock and
-- writes nothing); otherwise the conditional UPDATE takes a free, expired or own lease, or the INSERT
-- creates a new key. The token floor (lease_token_floor) is computed only for a row actually written.
-- Each statement takes its own READ COMMITTED snapshot, so a change made between two of them is seen by
-- the next: an UPDATE that finds nothing (someone took the lease since the read) starts over, at most
-- three times; after that the row is returned as it is (the caller reads the holder again).
CREATE OR REPLACE FUNCTION lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    FOR attempt IN 1..3 LOOP
        RETURN QUERY
        SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
               clock_timestamp()
          FROM lease l
         WHERE l.key = p_key AND l.expires_at > clock_timestamp() AND l.owner <> p_owner;
        IF FOUND THEN
            RETURN;
        END IF;
        RETURN QUERY
        UPDATE lease AS l
           SET owner = p_owner, token = greatest(l.token + 1, lease_token_floor() + 1), ttl = p_ttl,
               acquired_at = clock_timestamp(), renewed_at = clock_timestamp(),
               expires_at = clock_timestamp() + p_ttl, released_at = NULL
         WHERE l.key = p_key AND (l.expires_at <= clock_timestamp() OR l.owner = p_owner)
        RETURNING true, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
                  clock_timestamp();
        IF FOUND THEN
            RETURN;
        END IF;
        RETURN QUERY
        INSERT INTO lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at)
        VALUES (p_key, p_owner, lease_token_floor() + 1, p_ttl, clock_timestamp(), clock_timestamp(),
                clock_timestamp() + p_ttl)
        ON CONFLICT (key) DO NOTHING
        RETURNING true, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
                  clock_timestamp();
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           clock_timestamp()
      FROM lease l
     WHERE l.key = p_key;
END;
$$;

-- renew: extends a lease only while it is still this owner's, with this token, and unexpired (decision 6).
CREATE FUNCTION lease_renew(p_key text, p_owner text, p_token bigint, p_ttl interval)
RETURNS TABLE (key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE lease AS l
       SET renewed_at = clock_timestamp(), expires_at = clock_timestamp() + p_ttl, ttl = p_ttl
     WHERE l.key = p_key AND l.owner = p_owner AND l.token = p_token
       AND l.expires_at > clock_timestamp() AND l.released_at IS NULL
    RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
              clock_timestamp();
END;
$$;

-- release: frees the lease only if owner and token still match (decision 7). The row and its token stay.
CREATE FUNCTION lease_release(p_key text, p_owner text, p_token bigint)
RETURNS TABLE (key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE lease AS l
       SET expires_at = LEAST(l.expires_at, clock_timestamp()), released_at = clock_timestamp()
     WHERE l.key = p_key AND l.owner = p_owner AND l.token = p_token AND l.released_at IS NULL
    RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
              l.released_at;
END;
$$;

-- The ledger's insert, in one place: record_event (queries.sql) and the lease functions that write their
-- event in the same transaction as the lease (below) all call it. A plpgsql function, so its plan is
-- cached per session too.
CREATE FUNCTION lease_event_insert(p_kind text, p_key text, p_owner text, p_token bigint, p_detail jsonb,
                                   p_dag_id text, p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (id bigint, at timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    INSERT INTO event AS e (kind, key, owner, token, detail, dag_id, run_id, task_id, map_index)
    VALUES (p_kind, p_key, p_owner, p_token, p_detail, p_dag_id, p_run_id, p_task_id, p_map_index)
    RETURNING e.id, e.at;
END;
$$;

-- acquire with the ledger on: a grant and its 'acquired' event are one transaction, so one commit (the
-- grant's durable one) and one round trip. p_detail is the event's detail from the caller; the grant's
-- expiry is added here. A failed attempt writes nothing. The event is best effort, as when it was written
-- on its own: if its insert fails (a broken ledger), the grant stands and `logged` says false.
CREATE FUNCTION lease_acquire_logged(p_key text, p_owner text, p_ttl interval, p_detail jsonb,
                                     p_dag_id text, p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               logged boolean)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM lease_acquire(p_key, p_owner, p_ttl) LOOP
        logged := false;
        IF r.acquired THEN
            BEGIN
                PERFORM lease_event_insert('acquired', p_key, p_owner, r.token,
                                           p_detail || jsonb_build_object('expires_at', r.expires_at),
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

-- release with the ledger on: the release and its 'released' event (how long it was held, by the
-- database clock) in one transaction; the event best effort as above.
CREATE FUNCTION lease_release_logged(p_key text, p_owner text, p_token bigint, p_detail jsonb,
                                     p_dag_id text, p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               logged boolean)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM lease_release(p_key, p_owner, p_token) LOOP
        BEGIN
            PERFORM lease_event_insert('released', p_key, p_owner, p_token,
                                       p_detail || jsonb_build_object(
                                           'held_seconds', extract(epoch FROM r.observed_at - r.acquired_at)::float8,
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
$$;
