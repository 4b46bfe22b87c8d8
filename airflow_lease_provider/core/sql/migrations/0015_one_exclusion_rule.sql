-- Version 15 (issue 38): one exclusion rule for every grant of a key, under one lock, and the count epoch.
--
-- * Every grant of a key (lease_acquire's grant path, lease_acquire_slots, lease_replace, and the _logged
--   forms that call them) is decided under the same transaction-scoped advisory lock, class 0x1EA60 on the
--   key's hash, taken after lease_acquire's and lease_replace's lock-free read of a key someone else holds;
--   each statement after it reads with a fresh READ COMMITTED snapshot, so it sees every grant of the key
--   committed before (an uncommitted slot grant was invisible to lease_acquire's check of the live slots).
-- * lease_replace is a single-holder grant: refused while another slot of the key is held, and never takes
--   over a semaphore's slot.
-- * lease.count_epoch: the token floor of the key's current holding period. A grant of a key none of whose
--   grants with its slot count is live starts a period: its count epoch is the largest token any row of the
--   key ever had (lease_count_epoch), and every token of the period is larger. So once the slot count
--   changes (which needs every slot free), every token of the old count is at or below the new epoch.
-- * slot_of is kept by a grant of the row as a key of its own (a plain key spelled like a slot, k#2): it says
--   which key's slot the row ever was, so its tokens count in that key's epochs.
-- * fence_count_epoch (resource, key): the largest count epoch a fence accepted from a key's holders; a token
--   at or below it is refused ('count_epoch'). fence_advance takes the holder's base key and count epoch; in
--   the store's own schema it also refuses a token at or below the key's count epoch at once.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
ALTER TABLE {schema}.lease ADD COLUMN count_epoch bigint NOT NULL DEFAULT 0;

CREATE TABLE {schema}.fence_count_epoch (
    resource     text        NOT NULL,
    key          text        NOT NULL,
    count_epoch  bigint      NOT NULL,
    accepted_at  timestamptz NOT NULL,
    PRIMARY KEY (resource, key)
) WITH (fillfactor = 50);

-- The count epoch a grant of p_key with p_slots slots takes (see schema.sql).
CREATE FUNCTION {schema}.lease_count_epoch(p_key text, p_slots integer)
RETURNS bigint
LANGUAGE sql VOLATILE
AS $$
    SELECT coalesce(
        (SELECT l.count_epoch FROM {schema}.lease l
          WHERE ((l.key = p_key AND l.slot = 1) OR (l.slot_of = p_key AND l.slot > 1))
            AND l.slots = p_slots AND l.expires_at > pg_catalog.clock_timestamp()
          LIMIT 1),
        (SELECT pg_catalog.max(l.token) FROM {schema}.lease l WHERE l.key = p_key OR l.slot_of = p_key),
        0)
$$;

DROP FUNCTION {schema}.lease_acquire_logged(text, text, interval, jsonb, text, text, text, integer);
DROP FUNCTION {schema}.lease_acquire(text, text, interval, text, text, text, integer);

CREATE FUNCTION {schema}.lease_acquire(p_key text, p_owner text, p_ttl interval, p_dag_id text,
                                       p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               count_epoch bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_epoch bigint;
BEGIN
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           pg_catalog.clock_timestamp(), l.count_epoch
      FROM {schema}.lease l
     WHERE l.key = p_key AND l.expires_at > pg_catalog.clock_timestamp() AND l.owner <> p_owner;
    IF FOUND THEN
        RETURN;
    END IF;
    PERFORM pg_catalog.pg_advisory_xact_lock(125536, pg_catalog.hashtext(p_key));
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           pg_catalog.clock_timestamp(), l.count_epoch
      FROM {schema}.lease l
     WHERE l.slot_of = p_key AND l.slot > 1 AND l.expires_at > pg_catalog.clock_timestamp()
     ORDER BY l.slot
     LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    v_epoch := {schema}.lease_count_epoch(p_key, 1);
    RETURN QUERY
    UPDATE {schema}.lease AS l
       SET owner = p_owner, token = greatest(l.token + 1, {schema}.lease_token_floor() + 1, v_epoch + 1),
           ttl = p_ttl, acquired_at = pg_catalog.clock_timestamp(), renewed_at = pg_catalog.clock_timestamp(),
           expires_at = pg_catalog.clock_timestamp() + p_ttl, released_at = NULL,
           dag_id = p_dag_id, run_id = p_run_id, task_id = p_task_id, map_index = p_map_index,
           run_after = NULL, replaced_token = NULL, slots = 1, slot = 1, count_epoch = v_epoch
     WHERE l.key = p_key AND (l.expires_at <= pg_catalog.clock_timestamp() OR l.owner = p_owner)
    RETURNING true, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
              pg_catalog.clock_timestamp(), l.count_epoch;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
    INSERT INTO {schema}.lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at,
                                     dag_id, run_id, task_id, map_index, count_epoch)
    VALUES (p_key, p_owner, greatest({schema}.lease_token_floor(), v_epoch) + 1, p_ttl, pg_catalog.clock_timestamp(),
            pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() + p_ttl,
            p_dag_id, p_run_id, p_task_id, p_map_index, v_epoch)
    ON CONFLICT (key) DO NOTHING
    RETURNING true, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
              pg_catalog.clock_timestamp(), l.count_epoch;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           pg_catalog.clock_timestamp(), l.count_epoch
      FROM {schema}.lease l
     WHERE l.key = p_key;
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE sql
AS $$
    SELECT a.acquired, a.key, a.owner, a.token, a.ttl, a.acquired_at, a.renewed_at, a.expires_at, a.released_at,
           a.observed_at
      FROM {schema}.lease_acquire(p_key, p_owner, p_ttl, NULL::pg_catalog.text, NULL::pg_catalog.text,
                                  NULL::pg_catalog.text, NULL::pg_catalog.int4) a
$$;

CREATE FUNCTION {schema}.lease_acquire_logged(p_key text, p_owner text, p_ttl interval, p_detail jsonb,
                                              p_dag_id text, p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               count_epoch bigint, logged boolean)
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
        released_at := r.released_at; observed_at := r.observed_at; count_epoch := r.count_epoch;
        RETURN NEXT;
    END LOOP;
END;
$$;

DROP FUNCTION {schema}.lease_replace(text, text, interval, timestamptz, boolean, jsonb, text, text, text, integer);

CREATE FUNCTION {schema}.lease_replace(p_key text, p_owner text, p_ttl interval, p_run_after timestamptz,
                                       p_takeover boolean, p_detail jsonb, p_dag_id text, p_run_id text, p_task_id text,
                                       p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               replaced_owner text, replaced_token bigint, logged boolean, older boolean, count_epoch bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_old record;
    v_new record;
    v_inserted boolean := false;
    v_taking boolean := false;
    v_epoch bigint;
BEGIN
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           pg_catalog.clock_timestamp(), NULL::pg_catalog.text, NULL::bigint, false,
           coalesce(l.run_after < p_run_after, false), l.count_epoch
      FROM {schema}.lease l
     WHERE l.key = p_key AND l.expires_at > pg_catalog.clock_timestamp() AND l.owner <> p_owner
       AND (NOT p_takeover OR NOT coalesce(l.run_after < p_run_after, false));
    IF FOUND THEN
        RETURN;
    END IF;
    PERFORM pg_catalog.pg_advisory_xact_lock(125536, pg_catalog.hashtext(p_key));
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           pg_catalog.clock_timestamp(), NULL::pg_catalog.text, NULL::bigint, false, false, l.count_epoch
      FROM {schema}.lease l
     WHERE l.slot_of = p_key AND l.slot > 1 AND l.expires_at > pg_catalog.clock_timestamp()
     ORDER BY l.slot
     LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    v_epoch := {schema}.lease_count_epoch(p_key, 1);
    LOOP
        SELECT l.owner, l.token, l.expires_at, l.released_at, l.run_after, l.dag_id, l.run_id, l.task_id,
               l.map_index, l.slots, l.slot
          INTO v_old FROM {schema}.lease l WHERE l.key = p_key FOR UPDATE;
        EXIT WHEN FOUND;
        INSERT INTO {schema}.lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at,
                                         dag_id, run_id, task_id, map_index, run_after, count_epoch)
        VALUES (p_key, p_owner, greatest({schema}.lease_token_floor(), v_epoch) + 1, p_ttl,
                pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() + p_ttl,
                p_dag_id, p_run_id, p_task_id, p_map_index, p_run_after, v_epoch)
        ON CONFLICT (key) DO NOTHING
        RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
                  l.count_epoch
             INTO v_new;
        IF FOUND THEN
            v_inserted := true;
            EXIT;
        END IF;
    END LOOP;
    IF NOT v_inserted THEN
        v_taking := v_old.expires_at > pg_catalog.clock_timestamp() AND v_old.owner <> p_owner;
        IF v_taking AND (NOT p_takeover OR NOT coalesce(v_old.run_after < p_run_after, false)
                         OR v_old.slots > 1 OR v_old.slot > 1) THEN
            -- Granted to a run that is not older while this call waited for the row (or no takeover
            -- asked), or held as a slot (a semaphore's, or another key's sharing this row): it holds.
            RETURN QUERY
            SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at,
                   l.released_at, pg_catalog.clock_timestamp(), NULL::pg_catalog.text, NULL::bigint, false,
                   coalesce(v_old.run_after < p_run_after, false), l.count_epoch
              FROM {schema}.lease l WHERE l.key = p_key;
            RETURN;
        END IF;
        -- A lease of an older run that lapsed unreleased (its holder frozen, partitioned or dead past its
        -- TTL) is superseded as a live one is: the old holder, if it comes back, finds itself replaced (and
        -- skips) rather than lost (and fails into a retry that would only skip behind this run).
        v_taking := v_taking OR (v_old.owner <> p_owner AND v_old.released_at IS NULL
                                 AND coalesce(v_old.run_after < p_run_after, false));
        UPDATE {schema}.lease AS l
           SET owner = p_owner, token = greatest(l.token + 1, {schema}.lease_token_floor() + 1, v_epoch + 1),
               ttl = p_ttl, acquired_at = pg_catalog.clock_timestamp(), renewed_at = pg_catalog.clock_timestamp(),
               expires_at = pg_catalog.clock_timestamp() + p_ttl, released_at = NULL,
               dag_id = p_dag_id, run_id = p_run_id, task_id = p_task_id, map_index = p_map_index,
               run_after = p_run_after, replaced_token = CASE WHEN v_taking THEN v_old.token END,
               slots = 1, slot = 1, count_epoch = v_epoch
         WHERE l.key = p_key
        RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
                  l.count_epoch
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
                        'by_run_after', p_run_after, 'expires_at', v_old.expires_at,
                        'lapsed', v_old.expires_at <= pg_catalog.clock_timestamp()),
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
    older := false; count_epoch := v_new.count_epoch;
    RETURN NEXT;
END;
$$;

DROP FUNCTION {schema}.lease_acquire_slots(text, text, interval, integer, jsonb, text, text, text, integer);

CREATE FUNCTION {schema}.lease_acquire_slots(p_key text, p_owner text, p_ttl interval, p_slots integer,
                                             p_detail jsonb, p_dag_id text, p_run_id text, p_task_id text,
                                             p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               slot integer, slots integer, logged boolean, count_epoch bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_full integer;
    v_other integer;
    v_slot integer;
    v_key pg_catalog.text;
    v_tried integer[] := '{}';
    v_new record;
    v_epoch bigint;
BEGIN
    SELECT pg_catalog.count(*) FILTER (WHERE l.owner <> p_owner AND l.slots = p_slots),
           pg_catalog.count(*) FILTER (WHERE l.owner = p_owner OR l.slots <> p_slots)
      INTO v_full, v_other
      FROM {schema}.lease l
     WHERE ((l.key = p_key AND l.slot = 1) OR (l.slot_of = p_key AND l.slot > 1))
       AND l.expires_at > pg_catalog.clock_timestamp();
    IF v_full < p_slots OR v_other > 0 THEN
        PERFORM pg_catalog.pg_advisory_xact_lock(125536, pg_catalog.hashtext(p_key));
        -- The live slots now (a new snapshot: this statement starts after the lock was granted). One held
        -- with another slot count (or the key held by a single holder) refuses the acquire.
        PERFORM 1 FROM {schema}.lease s
         WHERE ((s.key = p_key AND s.slot = 1) OR (s.slot_of = p_key AND s.slot > 1))
           AND s.expires_at > pg_catalog.clock_timestamp() AND s.slots <> p_slots;
        IF NOT FOUND THEN
            v_epoch := {schema}.lease_count_epoch(p_key, p_slots);
            FOR attempt IN 1..p_slots + 1 LOOP
                SELECT s.slot INTO v_slot FROM {schema}.lease s
                 WHERE ((s.key = p_key AND s.slot = 1) OR (s.slot_of = p_key AND s.slot > 1))
                   AND s.expires_at > pg_catalog.clock_timestamp() AND s.owner = p_owner AND s.slot <> ALL (v_tried)
                 ORDER BY s.slot LIMIT 1;
                IF NOT FOUND THEN
                    SELECT i INTO v_slot FROM pg_catalog.generate_series(1, p_slots) i
                     WHERE i <> ALL (v_tried)
                       AND NOT EXISTS (SELECT 1 FROM {schema}.lease s
                                        WHERE ((s.key = p_key AND s.slot = 1) OR (s.slot_of = p_key AND s.slot > 1))
                                          AND s.slot = i AND s.expires_at > pg_catalog.clock_timestamp())
                     ORDER BY i LIMIT 1;
                    EXIT WHEN NOT FOUND;
                END IF;
                v_tried := v_tried || v_slot;
                v_key := CASE WHEN v_slot = 1 THEN p_key ELSE p_key || '#' || v_slot END;
                UPDATE {schema}.lease AS l
                   SET owner = p_owner, token = greatest(l.token + 1, {schema}.lease_token_floor() + 1, v_epoch + 1),
                       ttl = p_ttl, acquired_at = pg_catalog.clock_timestamp(),
                       renewed_at = pg_catalog.clock_timestamp(), expires_at = pg_catalog.clock_timestamp() + p_ttl,
                       released_at = NULL, dag_id = p_dag_id, run_id = p_run_id, task_id = p_task_id,
                       map_index = p_map_index, run_after = NULL, replaced_token = NULL, slots = p_slots,
                       slot = v_slot, slot_of = CASE WHEN v_slot = 1 THEN l.slot_of ELSE p_key END,
                       count_epoch = v_epoch
                 WHERE l.key = v_key AND (l.expires_at <= pg_catalog.clock_timestamp() OR l.owner = p_owner)
                RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at
                     INTO v_new;
                IF NOT FOUND THEN
                    INSERT INTO {schema}.lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at,
                                                     dag_id, run_id, task_id, map_index, slots, slot, slot_of,
                                                     count_epoch)
                    VALUES (v_key, p_owner, greatest({schema}.lease_token_floor(), v_epoch) + 1, p_ttl,
                            pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp(),
                            pg_catalog.clock_timestamp() + p_ttl, p_dag_id, p_run_id, p_task_id, p_map_index,
                            p_slots, v_slot, CASE WHEN v_slot = 1 THEN NULL ELSE p_key END, v_epoch)
                    ON CONFLICT (key) DO NOTHING
                    RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at,
                              l.released_at
                         INTO v_new;
                END IF;
                IF FOUND THEN
                    logged := false;
                    IF p_detail IS NOT NULL THEN
                        BEGIN
                            PERFORM {schema}.lease_event_insert(
                                'acquired', v_key, p_owner, v_new.token,
                                p_detail || pg_catalog.jsonb_build_object(
                                    'expires_at', v_new.expires_at, 'slot', v_slot, 'slots', p_slots,
                                    'lease_key', p_key),
                                p_dag_id, p_run_id, p_task_id, p_map_index);
                            logged := true;
                        EXCEPTION WHEN OTHERS THEN
                            logged := false;
                        END;
                    END IF;
                    acquired := true; key := v_new.key; owner := v_new.owner; token := v_new.token;
                    ttl := v_new.ttl; acquired_at := v_new.acquired_at; renewed_at := v_new.renewed_at;
                    expires_at := v_new.expires_at; released_at := v_new.released_at;
                    observed_at := pg_catalog.clock_timestamp(); slot := v_slot; slots := p_slots;
                    count_epoch := v_epoch;
                    RETURN NEXT;
                    RETURN;
                END IF;
                -- The slot's row is held as a key of its own (a plain key spelled like this slot, or a slot
                -- of another key this one is spelled after): the next slot.
            END LOOP;
        END IF;
    END IF;
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           pg_catalog.clock_timestamp(), l.slot, l.slots, false, l.count_epoch
      FROM {schema}.lease l
     WHERE (l.key = p_key OR (l.slot_of = p_key AND l.slot > 1)) AND l.expires_at > pg_catalog.clock_timestamp()
     ORDER BY l.slot, l.key;
END;
$$;

DROP FUNCTION {schema}.fence_advance(text, text, bigint, text, text, uuid);

CREATE FUNCTION {schema}.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                       p_idempotency_key text, p_store uuid, p_base text, p_count_epoch bigint)
RETURNS TABLE (outcome text, current_token bigint, current_store uuid, newest_grant bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    v_token bigint;
    v_store pg_catalog.uuid;
    v_newest bigint;
    v_base pg_catalog.text;
    v_floor bigint;
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
    IF v_outcome IS NULL AND p_store IS NOT NULL THEN
        -- Kept in the lease store that issued the token: a token below the row's newest grant belongs to a
        -- holder the lease has moved past (granted again, or force-released); one at or below the key's
        -- count epoch to a holder of an earlier holding period (a dropped slot of a lowered slot count is
        -- never granted again). Both refused before any later token has published here.
        SELECT l.token, CASE WHEN l.slot > 1 THEN l.slot_of ELSE l.key END INTO v_newest, v_base
          FROM {schema}.lease l
         WHERE l.key = p_key AND EXISTS (SELECT 1 FROM {schema}.lease_epoch e WHERE e.store_id = p_store);
        IF p_token < v_newest THEN
            v_outcome := 'superseded';
        ELSIF v_base IS NOT NULL THEN
            SELECT pg_catalog.max(l.count_epoch) INTO v_floor FROM {schema}.lease l
             WHERE (l.key = v_base AND l.slot = 1) OR (l.slot_of = v_base AND l.slot > 1);
            IF p_token <= v_floor THEN
                v_outcome := 'count_epoch';
                v_newest := v_floor;
            END IF;
        END IF;
    END IF;
    IF v_outcome IS NULL AND p_count_epoch IS NOT NULL THEN
        -- The key's count epoch, as its holders told it: raised by the first publish of a later period (the
        -- row locked, so a publish of an earlier period waits for it and then reads it), read under a share
        -- lock by every other (so a raise waits for the publishes already deciding). A token at or below it
        -- is refused.
        INSERT INTO {schema}.fence_count_epoch (resource, key, count_epoch, accepted_at)
        VALUES (p_resource, coalesce(p_base, p_key), p_count_epoch, pg_catalog.clock_timestamp())
        ON CONFLICT DO NOTHING;
        UPDATE {schema}.fence_count_epoch AS e
           SET count_epoch = p_count_epoch, accepted_at = pg_catalog.clock_timestamp()
         WHERE e.resource = p_resource AND e.key = coalesce(p_base, p_key) AND e.count_epoch < p_count_epoch;
        SELECT e.count_epoch INTO v_floor FROM {schema}.fence_count_epoch e
         WHERE e.resource = p_resource AND e.key = coalesce(p_base, p_key) FOR SHARE;
        IF p_token <= v_floor THEN
            v_outcome := 'count_epoch';
            v_newest := v_floor;
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

-- The call of version 10 (version 9's calls it), for processes still running its code: a publish that names
-- no count epoch (the fence of its time).
CREATE FUNCTION {schema}.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                       p_idempotency_key text, p_store uuid)
RETURNS TABLE (outcome text, current_token bigint, current_store uuid, newest_grant bigint)
LANGUAGE sql
AS $$
    SELECT a.outcome, a.current_token, a.current_store, a.newest_grant
      FROM {schema}.fence_advance(p_resource, p_key, p_token, p_owner, p_idempotency_key, p_store,
                                  NULL::pg_catalog.text, NULL::bigint) a
$$;
