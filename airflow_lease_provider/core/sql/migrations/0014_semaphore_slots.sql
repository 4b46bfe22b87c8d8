-- Version 14 (issue 26 item 3): semaphores, at most N holders of a key at once (lease_slots=N).
--
-- * lease.slots / slot / slot_of: a grant's slot count (1: a single-holder lease, every row before this
--   version), its slot, and for slot i > 1 the semaphore's key. Slot 1 of key K is K's own row; slot i > 1
--   is the row 'K#i'. Each slot row keeps its own token, so tokens strictly increase per (key, slot), and
--   a holder renews, releases and fences under its slot's row key: two valid holders are two fence keys.
-- * lease_acquire_slots: the semaphore's acquire, one statement (see schema.sql).
-- * lease_acquire: a single-holder grant resets the row's slot columns, and is refused while another slot
--   of the key is held (the check runs only on a row whose slots > 1: unchanged cost for a plain key);
--   when refused that way, its answer is the live slot's row. lease_replace resets the slot columns too.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
ALTER TABLE {schema}.lease
    ADD COLUMN slots   integer NOT NULL DEFAULT 1,
    ADD COLUMN slot    integer NOT NULL DEFAULT 1,
    ADD COLUMN slot_of text,
    ADD CONSTRAINT lease_slot_check CHECK (slot >= 1 AND slot <= slots);

CREATE INDEX lease_slot_of_idx ON {schema}.lease (slot_of, slot) WHERE slot_of IS NOT NULL;

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
               run_after = NULL, replaced_token = NULL, slots = 1, slot = 1, slot_of = NULL
         WHERE l.key = p_key AND (l.expires_at <= pg_catalog.clock_timestamp() OR l.owner = p_owner)
           AND (l.slots = 1 OR NOT EXISTS (SELECT 1 FROM {schema}.lease s
                                            WHERE s.slot_of = p_key AND s.expires_at > pg_catalog.clock_timestamp()))
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
     WHERE l.key = p_key OR (l.slot_of = p_key AND l.expires_at > pg_catalog.clock_timestamp())
     ORDER BY l.expires_at > pg_catalog.clock_timestamp() DESC, l.slot
     LIMIT 1;
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.lease_replace(p_key text, p_owner text, p_ttl interval, p_run_after timestamptz,
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
        SELECT l.owner, l.token, l.expires_at, l.released_at, l.run_after, l.dag_id, l.run_id, l.task_id,
               l.map_index
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
        -- A lease of an older run that lapsed unreleased (its holder frozen, partitioned or dead past its
        -- TTL) is superseded as a live one is: the old holder, if it comes back, finds itself replaced (and
        -- skips) rather than lost (and fails into a retry that would only skip behind this run).
        v_taking := v_taking OR (v_old.owner <> p_owner AND v_old.released_at IS NULL
                                 AND coalesce(v_old.run_after < p_run_after, false));
        UPDATE {schema}.lease AS l
           SET owner = p_owner, token = greatest(l.token + 1, {schema}.lease_token_floor() + 1), ttl = p_ttl,
               acquired_at = pg_catalog.clock_timestamp(), renewed_at = pg_catalog.clock_timestamp(),
               expires_at = pg_catalog.clock_timestamp() + p_ttl, released_at = NULL,
               dag_id = p_dag_id, run_id = p_run_id, task_id = p_task_id, map_index = p_map_index,
               run_after = p_run_after, replaced_token = CASE WHEN v_taking THEN v_old.token END,
               slots = 1, slot = 1, slot_of = NULL
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
    older := false;
    RETURN NEXT;
END;
$$;

-- A semaphore's acquire (migrations/0014): at most p_slots holders of p_key at once, each in its own slot,
-- one statement. Slot 1 is the row of p_key itself (the row a single-holder lease uses); slot i > 1 is the
-- row p_key || '#' || i (its slot_of is p_key). Each slot row has its own token, strictly increasing per
-- slot, and a holder fences, renews and releases under its slot's key. When every slot is held by others
-- with this slot count, one read answers (no lock, no write). Otherwise the acquirers of the key are
-- serialized by a transaction-scoped advisory lock (class 0x1EA60, the key's hash), the live slots are
-- read again, and: a slot held with another slot count (or p_key held as a single lease) refuses the
-- acquire (the caller names both counts); the owner's own slot is granted again with a larger token;
-- else the lowest free slot is granted (its row updated or inserted). Returns the grant (acquired, with
-- the 'acquired' event when p_detail is given: logged), or every live holder of the key, by slot.
CREATE FUNCTION {schema}.lease_acquire_slots(p_key text, p_owner text, p_ttl interval, p_slots integer,
                                             p_detail jsonb, p_dag_id text, p_run_id text, p_task_id text,
                                             p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               slot integer, slots integer, logged boolean)
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
BEGIN
    SELECT pg_catalog.count(*) FILTER (WHERE l.owner <> p_owner AND l.slots = p_slots),
           pg_catalog.count(*) FILTER (WHERE l.owner = p_owner OR l.slots <> p_slots)
      INTO v_full, v_other
      FROM {schema}.lease l
     WHERE (l.key = p_key OR l.slot_of = p_key) AND l.expires_at > pg_catalog.clock_timestamp();
    IF v_full < p_slots OR v_other > 0 THEN
        PERFORM pg_catalog.pg_advisory_xact_lock(125536, pg_catalog.hashtext(p_key));
        FOR attempt IN 1..p_slots + 2 LOOP
            -- The live slots now (a new snapshot: this statement starts after the lock was granted).
            SELECT s.slot INTO v_slot FROM {schema}.lease s
             WHERE (s.key = p_key OR s.slot_of = p_key) AND s.expires_at > pg_catalog.clock_timestamp()
               AND s.slots <> p_slots
             LIMIT 1;
            EXIT WHEN FOUND;
            SELECT s.slot INTO v_slot FROM {schema}.lease s
             WHERE (s.key = p_key OR s.slot_of = p_key) AND s.expires_at > pg_catalog.clock_timestamp()
               AND s.owner = p_owner
             ORDER BY s.slot LIMIT 1;
            IF NOT FOUND THEN
                SELECT i INTO v_slot FROM pg_catalog.generate_series(1, p_slots) i
                 WHERE i <> ALL (v_tried)
                   AND NOT EXISTS (SELECT 1 FROM {schema}.lease s
                                    WHERE (s.key = p_key OR s.slot_of = p_key) AND s.slot = i
                                      AND s.expires_at > pg_catalog.clock_timestamp())
                 ORDER BY i LIMIT 1;
                EXIT WHEN NOT FOUND;
            END IF;
            v_tried := v_tried || v_slot;
            v_key := CASE WHEN v_slot = 1 THEN p_key ELSE p_key || '#' || v_slot END;
            UPDATE {schema}.lease AS l
               SET owner = p_owner, token = greatest(l.token + 1, {schema}.lease_token_floor() + 1), ttl = p_ttl,
                   acquired_at = pg_catalog.clock_timestamp(), renewed_at = pg_catalog.clock_timestamp(),
                   expires_at = pg_catalog.clock_timestamp() + p_ttl, released_at = NULL,
                   dag_id = p_dag_id, run_id = p_run_id, task_id = p_task_id, map_index = p_map_index,
                   run_after = NULL, replaced_token = NULL, slots = p_slots, slot = v_slot,
                   slot_of = CASE WHEN v_slot = 1 THEN NULL ELSE p_key END
             WHERE l.key = v_key AND (l.expires_at <= pg_catalog.clock_timestamp() OR l.owner = p_owner)
            RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at
                 INTO v_new;
            IF NOT FOUND THEN
                INSERT INTO {schema}.lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at,
                                                 dag_id, run_id, task_id, map_index, slots, slot, slot_of)
                VALUES (v_key, p_owner, {schema}.lease_token_floor() + 1, p_ttl, pg_catalog.clock_timestamp(),
                        pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp() + p_ttl,
                        p_dag_id, p_run_id, p_task_id, p_map_index, p_slots, v_slot,
                        CASE WHEN v_slot = 1 THEN NULL ELSE p_key END)
                ON CONFLICT (key) DO NOTHING
                RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at
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
                RETURN NEXT;
                RETURN;
            END IF;
            -- The slot's row was taken under another lock (p_key as a single lease, or a key spelled like
            -- this slot's held as a lease of its own): the next slot.
        END LOOP;
    END IF;
    RETURN QUERY
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           pg_catalog.clock_timestamp(), l.slot, l.slots, false
      FROM {schema}.lease l
     WHERE (l.key = p_key OR l.slot_of = p_key) AND l.expires_at > pg_catalog.clock_timestamp()
     ORDER BY l.slot, l.key;
END;
$$;
