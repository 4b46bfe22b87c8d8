-- The current schema of a lease store in one file: a fresh store is created from it in one step
-- (core/schema.py ensure_schema), and records every migration's version as applied. The migrations
-- (migrations/*.sql) only upgrade an existing store; tests/core/test_schema.py checks that applying them
-- all produces exactly this. Update both when adding a migration.
--
-- {schema} stands for the store's schema: before the file runs it is replaced by the schema's name as a
-- quoted identifier (core/db/sqltext.py, with_schema), as in queries.sql and the migrations. It is the
-- only templating here, and nothing depends on the session's search_path: every name is qualified.
CREATE TABLE {schema}.schema_version (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE {schema}.lease (
    key          text        PRIMARY KEY,
    owner        text        NOT NULL,
    token        bigint      NOT NULL CHECK (token > 0),
    ttl          interval    NOT NULL,
    acquired_at  timestamptz NOT NULL,
    renewed_at   timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    released_at  timestamptz,
    -- The DAG run (and task instance) of the holder (migrations/0011), as the acquire passed it (the
    -- event table's run columns): NULL for a holder that named no run (a core API user's).
    dag_id       text,
    run_id       text,
    task_id      text,
    map_index    integer,
    -- The holder's run order (migrations/0012): its DAG run's run_after, written by lease_replace (NULL for
    -- a grant by lease_acquire). A replacing run takes over only from a holder whose run_after is earlier.
    run_after      timestamptz,
    -- The token this grant took over (lease_replace); NULL for a grant of a free lease.
    replaced_token bigint,
    -- Semaphores (migrations/0014): the slot count of the grant (1: a single-holder lease), its slot, and
    -- for slot i > 1 (the row p_key || '#' || i) the semaphore's key. Slot 1 is the key's own row.
    -- slot_of is kept when the row is later granted as a key of its own (a plain key spelled like a slot,
    -- k#2; migrations/0015): it says whose slot the row ever was, so its tokens count in that key's epochs.
    slots          integer     NOT NULL DEFAULT 1,
    slot           integer     NOT NULL DEFAULT 1,
    slot_of        text,
    -- The count epoch of the grant (migrations/0015): the token floor of the key's holding period it belongs
    -- to; every token of the period is above it, every token the key issued before the period at or below.
    count_epoch    bigint      NOT NULL DEFAULT 0,
    -- The lease API's capability digest of the current grant (migrations/0018; docs/api.md): NULL for a
    -- grant of the direct path.
    api_capability bytea,
    CONSTRAINT lease_slot_check CHECK (slot >= 1 AND slot <= slots)
) WITH (fillfactor = 50);
-- The leases of one DAG (migrations/0011): the DAG-scoped status pages and the DAG tab.
CREATE INDEX lease_dag_key_idx ON {schema}.lease (dag_id, key);
-- The slots i > 1 of a semaphore (migrations/0014).
CREATE INDEX lease_slot_of_idx ON {schema}.lease (slot_of, slot) WHERE slot_of IS NOT NULL;

-- One row per (resource, lease key): tokens are only compared within one lease key (version 3). key ''
-- marks a row from before version 3, a floor for the keys of that resource without a row of their own.
-- The same tables as fence_schema.sql (tests/core/test_fence_grants.py compares them).
CREATE TABLE {schema}.fence (
    resource     text        NOT NULL,
    token        bigint      NOT NULL CHECK (token > 0),
    owner        text,
    accepted_at  timestamptz NOT NULL,
    key          text        NOT NULL,
    -- The lease store the accepted token came from (lease_epoch.store_id; migrations/0010), NULL when
    -- unknown (accepted before version 10, or by a caller that passed none).
    store_id     uuid,
    PRIMARY KEY (resource, key)
) WITH (fillfactor = 50);

-- Per (resource, lease key): the largest count epoch a publish of the key's holders told the fence
-- (migrations/0015); a token of the key, of any slot, at or below it is refused ('count_epoch'). The same
-- table as fence_schema.sql's.
CREATE TABLE {schema}.fence_count_epoch (
    resource     text        NOT NULL,
    key          text        NOT NULL,
    count_epoch  bigint      NOT NULL,
    accepted_at  timestamptz NOT NULL,
    PRIMARY KEY (resource, key)
) WITH (fillfactor = 50);

-- Per lease key spelled like a slot (k#2): the count epoch of the key's latest holding period (migrations/0019),
-- written by lease_key_state under the key's grant lock. Such a key's own row may be granted later as another
-- key's slot (slot 2 of k), which overwrites the row's count_epoch; this keeps the key's. Read by
-- fence_advance with the epochs on the key's rows. A key not spelled like a slot has no row here: its own
-- row is never another key's, and it keeps the epoch of its latest period.
CREATE TABLE {schema}.lease_key_epoch (
    key          text        PRIMARY KEY,
    count_epoch  bigint      NOT NULL
);

-- An idempotency claim per (resource, idempotency key), naming the grant that made it: token, owner and lease
-- key (key NULL: a claim written before version 20, never given back; migrations/0020).
CREATE TABLE {schema}.fence_publish (
    resource         text        NOT NULL,
    idempotency_key  text        NOT NULL,
    token            bigint      NOT NULL,
    owner            text,
    published_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    key              text,
    PRIMARY KEY (resource, idempotency_key)
);

CREATE TABLE {schema}.event (
    id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind    text        NOT NULL,
    key     text        NOT NULL,
    owner   text,
    token   bigint,
    detail  jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- The DAG run (and task instance) the event is about (migrations/0007): NULL for an event about no
    -- run; map_index as Airflow numbers it (-1: not mapped) when task_id is set, NULL for a run.
    dag_id    text,
    run_id    text,
    task_id   text,
    map_index integer
);
CREATE INDEX event_at_idx ON {schema}.event (at);
CREATE INDEX event_key_at_idx ON {schema}.event (key, at);
-- One skipped-catch-up record per gap (the run after it) per DAG (migrations/0004), keyed by the run
-- columns (migrations/0016).
CREATE UNIQUE INDEX event_skipped_catchup_uq ON {schema}.event (dag_id, run_id) WHERE kind = 'skipped_catchup';
-- One coalesced-catch-up record per run (the one the missed range was folded into) per DAG (migrations/0013),
-- keyed by the run columns (migrations/0016).
CREATE UNIQUE INDEX event_coalesced_uq ON {schema}.event (dag_id, run_id) WHERE kind = 'coalesced';
-- One DAG's events by time (migrations/0011): the DAG tab, the DAG's trends and the DAG-scoped reads.
CREATE INDEX event_dag_at_idx ON {schema}.event (dag_id, at);
-- Fence rejections by the lease key in their detail (migrations/0005): a key's timeline.
CREATE INDEX event_fence_lease_key_at_idx ON {schema}.event ((detail->>'lease_key'), at) WHERE kind = 'fence_rejected';
-- The events of one DAG run by time (migrations/0007).
CREATE INDEX event_run_at_idx ON {schema}.event (dag_id, run_id, at);

-- The lease API's grants kept past their row (migrations/0022; docs/api.md): each grant's capability digest,
-- lease key and run columns, so that a capability can record the loss (and a refused late fence) of its own
-- grant after a newer grant took the row. released_at: its holder released it through the API (it then
-- records nothing more); lost_at: its 'lost' event is recorded (once). Pruned per key past the event retention.
CREATE TABLE {schema}.lease_api_grant (
    key          text        NOT NULL,
    token        bigint      NOT NULL,
    owner        text        NOT NULL,
    digest       bytea       NOT NULL,
    lease_key    text        NOT NULL,
    granted_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    released_at  timestamptz,
    lost_at      timestamptz,
    dag_id       text,
    run_id       text,
    task_id      text,
    map_index    integer,
    PRIMARY KEY (key, token)
);

-- The places of the runs waiting for a key (migrations/0012): at most max_waiting per key, each lapsing at
-- its expires_at unless the waiter (its trigger, while deferred) renews it.
CREATE TABLE {schema}.lease_waiter (
    key         text        NOT NULL,
    owner       text        NOT NULL,
    since       timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    dag_id      text,
    run_id      text,
    task_id     text,
    map_index   integer,
    PRIMARY KEY (key, owner),
    -- The lease API's capability digest of the place (migrations/0021; docs/api.md): NULL for a place of the
    -- direct path.
    api_capability bytea,
    -- When the lease API last claimed the place (migrations/0023): a claim of the same owner with another
    -- capability takes it over once two thirds of its TTL passed since (a dead keeper). NULL: the direct
    -- path's place.
    api_renewed_at timestamptz
);

-- The token epoch (migrations/0006): every token is at least (epoch << 40) + 1, and the epoch changes
-- when the store finds itself on another system identifier or timeline (a failover), or by hand.
CREATE TABLE {schema}.lease_epoch (
    id                 boolean     PRIMARY KEY DEFAULT true CHECK (id),
    epoch              integer     NOT NULL CHECK (epoch >= 0 AND epoch < 8388608),
    system_identifier  bigint      NOT NULL,
    timeline           integer     NOT NULL,
    changed_at         timestamptz NOT NULL,
    reason             text        NOT NULL,
    -- This store's identity (migrations/0010): made once, kept by a dump and restore, new for a store
    -- created again; fences record it with the tokens they accept.
    store_id           uuid        NOT NULL DEFAULT (md5(random()::text || clock_timestamp()::text)::uuid)
);

-- The timeline WAL is written on now: the first 8 hex digits of the current WAL file's name.
CREATE FUNCTION {schema}.lease_timeline()
RETURNS integer
LANGUAGE sql VOLATILE
AS $$
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer
$$;

INSERT INTO {schema}.lease_epoch (epoch, system_identifier, timeline, changed_at, reason)
VALUES (0, (pg_control_system()).system_identifier, {schema}.lease_timeline(), clock_timestamp(), 'created');

-- The operator's commands after a failover the store cannot see (they pin their search_path; the hot
-- functions below do not). lease_epoch_bump: the next epoch, recorded with its reason.
CREATE FUNCTION {schema}.lease_epoch_bump(p_reason text)
RETURNS TABLE (epoch integer, system_identifier bigint, timeline integer, changed_at timestamptz, reason text)
LANGUAGE sql VOLATILE
SET search_path = {schema}
AS $$
    UPDATE lease_epoch e
       SET epoch = greatest(e.epoch + 1, lease_timeline()), system_identifier = (pg_control_system()).system_identifier,
           timeline = lease_timeline(), changed_at = clock_timestamp(), reason = p_reason
    RETURNING e.epoch, e.system_identifier, e.timeline, e.changed_at, e.reason
$$;

-- A new epoch whose floor is above p_above (migrations/0010): after the store was recreated while a fence
-- kept elsewhere has its old tokens.
CREATE FUNCTION {schema}.lease_epoch_raise(p_reason text, p_above bigint)
RETURNS TABLE (epoch integer, system_identifier bigint, timeline integer, changed_at timestamptz, reason text)
LANGUAGE sql VOLATILE
SET search_path = {schema}
AS $$
    UPDATE lease_epoch e
       SET epoch = greatest(e.epoch + 1, lease_timeline(), (p_above >> 40)::integer + 1),
           system_identifier = (pg_control_system()).system_identifier,
           timeline = lease_timeline(), changed_at = clock_timestamp(), reason = p_reason
    RETURNING e.epoch, e.system_identifier, e.timeline, e.changed_at, e.reason
$$;

-- The functions every lease and fence call runs (migrations/0009, 0010, 0011): no `SET search_path`
-- clause (it cost 30-40 % of a call on the server), so every name in them is qualified: the store's
-- objects with {schema}, pg_catalog's functions and types with pg_catalog.

-- The floor of every token issued now (migrations/0006): epoch << 40. Bumps the epoch first when the
-- server history changed.
CREATE FUNCTION {schema}.lease_token_floor()
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    -- The system identifier never changes while a server runs: read from the control file once per
    -- session. The timeline does (a promoted standby keeps its sessions): read on every call.
    v_system bigint := nullif(pg_catalog.current_setting('airflow_lease.system_identifier', true), '')::bigint;
    v_timeline integer := {schema}.lease_timeline();
    v_epoch integer;
BEGIN
    IF v_system IS NULL THEN
        v_system := (pg_catalog.pg_control_system()).system_identifier;
        PERFORM pg_catalog.set_config('airflow_lease.system_identifier', v_system::pg_catalog.text, false);
    END IF;
    SELECT e.epoch INTO v_epoch FROM {schema}.lease_epoch e
     WHERE e.system_identifier = v_system AND e.timeline = v_timeline;
    IF NOT FOUND THEN
        UPDATE {schema}.lease_epoch e
           SET epoch = greatest(e.epoch + 1, v_timeline), system_identifier = v_system, timeline = v_timeline,
               changed_at = pg_catalog.clock_timestamp(), reason = 'new server history'
         WHERE e.system_identifier <> v_system OR e.timeline <> v_timeline
        RETURNING e.epoch INTO v_epoch;
        IF NOT FOUND THEN
            SELECT e.epoch INTO v_epoch FROM {schema}.lease_epoch e;
        END IF;
    END IF;
    RETURN v_epoch::bigint << 40;
END;
$$;

-- The exclusion rule's one reading of a key (migrations/0015), under the key's grant lock, for a grant of
-- p_key with p_slots slots (lease_acquire and lease_replace: 1; lease_acquire_slots: N). The key's grants are
-- the row p_key with slot 1 and the rows p_key#i with slot i and slot_of p_key. other_count: one of them is
-- live with another slot count (any owner), which refuses the grant. count_epoch: the epoch of its live
-- grants with this count (a grant while they hold belongs to their holding period), else, the key being
-- taken up afresh (a count changes only then), the largest token any row of the key ever had (its own row,
-- and every row that was ever one of its slots: slot_of is never cleared), so every token of the new period
-- is larger than every token the key issued before it, whichever slot. For a plain key that never had slots
-- this is its row's last token: its tokens count on as before. One scan of the key's rows, after a scan that
-- locks them all (FOR NO KEY UPDATE), whatever their expiry (migrations/0017): a renewal of one of them
-- evaluated before its expiry and not committed yet is waited for, and then seen renewed.
CREATE FUNCTION {schema}.lease_key_state(p_key text, p_slots integer, OUT other_count boolean,
                                         OUT count_epoch bigint)
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    -- plpgsql, not sql: a sql function's body is planned again on every call, a plpgsql one's once per session.
    -- Every row of the key locked first (waits for an uncommitted renewal of any of them), then read in a
    -- statement of its own (a fresh snapshot, which sees that renewal committed). A single-holder grant
    -- (p_slots = 1) leaves the key's own row to the statement that grants it, which locks it and checks its
    -- expiry again after any wait (the UPDATE's WHERE; lease_replace's FOR UPDATE), so a key that never had
    -- slots takes no row lock here.
    PERFORM FROM {schema}.lease l
     WHERE (l.key = p_key AND p_slots > 1) OR l.slot_of = p_key
       FOR NO KEY UPDATE OF l;
    SELECT coalesce(pg_catalog.bool_or(g.live AND l.slots <> p_slots), false),
           coalesce(pg_catalog.max(l.count_epoch) FILTER (WHERE g.live AND l.slots = p_slots),
                    pg_catalog.max(l.token), 0)
      INTO other_count, count_epoch
      FROM {schema}.lease l
     CROSS JOIN LATERAL (SELECT ((l.key = p_key AND l.slot = 1) OR (l.slot_of = p_key AND l.slot > 1))
                                AND l.expires_at > pg_catalog.clock_timestamp() AS live) g
     WHERE l.key = p_key OR l.slot_of = p_key;
    -- A key spelled like a slot (k#2) keeps its count epoch where no grant of another key overwrites it: its
    -- own row may become slot 2 of k (migrations/0019). Only such keys write: a key that never had slots and
    -- is not spelled like one costs what it did.
    IF NOT other_count AND pg_catalog.textregexeq(p_key, '#[0-9]+$') THEN
        INSERT INTO {schema}.lease_key_epoch AS e (key, count_epoch) VALUES (p_key, count_epoch)
        ON CONFLICT (key) DO UPDATE SET count_epoch = EXCLUDED.count_epoch
         WHERE e.count_epoch < EXCLUDED.count_epoch;
    END IF;
END;
$$;

-- acquire (migrations/0008, 0011, 0012, 0015): the read first (a key someone else holds costs one index
-- lookup, no lock, no write). Otherwise the key's grant lock (the transaction-scoped advisory lock of class
-- 0x1EA60 on the key's hash, which every grant of the key takes: lease_acquire_slots, lease_replace): then
-- lease_key_state reads the key; a grant of it live with another slot count (a semaphore's slot, any owner,
-- the caller's own slot 1 too) refuses the single holder, answered by that slot's row; else the conditional
-- UPDATE takes a free, expired or own lease, or the INSERT creates a new key, with a token above the key's
-- count epoch. Each statement after the lock takes its own READ
-- COMMITTED snapshot, so it sees every grant of the key committed before the lock was granted. A row taken
-- meanwhile (only a grant of another key sharing it can: a plain key spelled like a slot) is answered as
-- held. The token floor is computed only for a row written. The holder's run columns are written with
-- every grant; its run order (run_after) is unknown: cleared.
CREATE FUNCTION {schema}.lease_acquire(p_key text, p_owner text, p_ttl interval, p_dag_id text,
                                       p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               count_epoch bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_other boolean;
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
    SELECT k.other_count, k.count_epoch INTO v_other, v_epoch FROM {schema}.lease_key_state(p_key, 1) k;
    IF v_other THEN
        RETURN QUERY
        SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
               pg_catalog.clock_timestamp(), l.count_epoch
          FROM {schema}.lease l
         WHERE ((l.key = p_key AND l.slot = 1) OR (l.slot_of = p_key AND l.slot > 1))
           AND l.expires_at > pg_catalog.clock_timestamp() AND l.slots <> 1
         ORDER BY l.slot DESC
         LIMIT 1;
        RETURN;
    END IF;
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

-- The three-argument call of version 10 (migrations/0011), for processes still running its code: a
-- grant that names no run.
CREATE FUNCTION {schema}.lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE sql
AS $$
    SELECT a.acquired, a.key, a.owner, a.token, a.ttl, a.acquired_at, a.renewed_at, a.expires_at, a.released_at,
           a.observed_at
      FROM {schema}.lease_acquire(p_key, p_owner, p_ttl, NULL::pg_catalog.text, NULL::pg_catalog.text,
                                  NULL::pg_catalog.text, NULL::pg_catalog.int4) a
$$;

-- renew: extends a lease only while it is still this owner's, with this token, and unexpired (decision 6).
-- The store's own calls send this UPDATE as a statement (queries.sql renew); kept for older clients.
CREATE FUNCTION {schema}.lease_renew(p_key text, p_owner text, p_token bigint, p_ttl interval)
RETURNS TABLE (key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE {schema}.lease AS l
       SET renewed_at = pg_catalog.clock_timestamp(), expires_at = pg_catalog.clock_timestamp() + p_ttl, ttl = p_ttl
     WHERE l.key = p_key AND l.owner = p_owner AND l.token = p_token
       AND l.expires_at > pg_catalog.clock_timestamp() AND l.released_at IS NULL
    RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
              pg_catalog.clock_timestamp();
END;
$$;

-- release: frees the lease only if owner and token still match (decision 7). The row and its token stay.
CREATE FUNCTION {schema}.lease_release(p_key text, p_owner text, p_token bigint)
RETURNS TABLE (key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE {schema}.lease AS l
       SET expires_at = LEAST(l.expires_at, pg_catalog.clock_timestamp()), released_at = pg_catalog.clock_timestamp()
     WHERE l.key = p_key AND l.owner = p_owner AND l.token = p_token AND l.released_at IS NULL
    RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
              l.released_at;
END;
$$;

-- The ledger's one INSERT (record_event and the _logged functions below).
CREATE FUNCTION {schema}.lease_event_insert(p_kind text, p_key text, p_owner text, p_token bigint, p_detail jsonb,
                                            p_dag_id text, p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (id bigint, at timestamptz)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    INSERT INTO {schema}.event AS e (kind, key, owner, token, detail, dag_id, run_id, task_id, map_index)
    VALUES (p_kind, p_key, p_owner, p_token, p_detail, p_dag_id, p_run_id, p_task_id, p_map_index)
    RETURNING e.id, e.at;
END;
$$;

-- acquire with the ledger on (migrations/0008, 0011): the grant and its 'acquired' event in one
-- transaction; the event best effort (`logged` false when its insert failed), a failed attempt writes
-- nothing.
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

-- release with the ledger on: the release and its 'released' event in one transaction.
CREATE FUNCTION {schema}.lease_release_logged(p_key text, p_owner text, p_token bigint, p_detail jsonb,
                                              p_dag_id text, p_run_id text, p_task_id text, p_map_index integer)
RETURNS TABLE (key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz,
               logged boolean)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM {schema}.lease_release(p_key, p_owner, p_token) LOOP
        BEGIN
            PERFORM {schema}.lease_event_insert('released', p_key, p_owner, p_token,
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
$$;

-- The token a new publish of p_key to p_resource must exceed (migrations/0003).
CREATE FUNCTION {schema}.fence_token(p_resource text, p_key text)
RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT f.token FROM {schema}.fence f WHERE f.resource = p_resource AND f.key IN (p_key, '')
     ORDER BY f.key = '' LIMIT 1
$$;

-- fence advance (migrations/0003, 0010, 0015, 0020): the idempotency claim (naming the lease key), the newest-grant check where the
-- fence is kept in the lease store that issued the token (the row's newest token, and the key's count
-- epoch), the count epoch the publish names (p_base: the lease key whose slot p_key is; p_count_epoch: the
-- grant's count epoch; NULL: not named, not checked), the conditional upsert (a larger token, or an equal
-- one from the same owner of the same store), the claim given back when refused. fence_schema.sql (with its
-- migrations) has the same function without the newest-grant check.
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
        -- The claim names the lease key of the grant that made it: only that grant gives it back
        -- (fence_claim_release, migrations/0020).
        INSERT INTO {schema}.fence_publish (resource, idempotency_key, token, owner, key)
        VALUES (p_resource, p_idempotency_key, p_token, p_owner, p_key)
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
            -- The key's epoch on its rows, and (a key spelled like a slot, whose own row may now be another
            -- key's slot) the one it keeps apart (migrations/0019).
            SELECT pg_catalog.max(l.count_epoch) INTO v_floor FROM {schema}.lease l
             WHERE (l.key = v_base AND l.slot = 1) OR (l.slot_of = v_base AND l.slot > 1);
            v_floor := greatest(v_floor, (SELECT e.count_epoch FROM {schema}.lease_key_epoch e WHERE e.key = v_base));
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

-- The five-argument call of version 9 (migrations/0010), for processes still running its code.
CREATE FUNCTION {schema}.fence_advance(p_resource text, p_key text, p_token bigint, p_owner text,
                                       p_idempotency_key text)
RETURNS TABLE (outcome text, current_token bigint)
LANGUAGE sql
AS $$
    SELECT a.outcome, a.current_token
      FROM {schema}.fence_advance(p_resource, p_key, p_token, p_owner, p_idempotency_key, NULL::pg_catalog.uuid) a
$$;

-- replace (migrations/0012): the replace policy's acquire, one statement. A lease held by a run that is not
-- provably older (its run_after not strictly before p_run_after, or unknown), or by any other run when
-- p_takeover is false (a replace_grace not over yet), is answered by one read: no row lock, nothing written;
-- older says whether that holder's run is older (it would have been taken over). Otherwise, under the key's
-- grant lock (as lease_acquire: a replace is a single-holder grant, migrations/0015), a live slot i > 1 of
-- the key refuses it (answered by that slot's row), then the row is locked and decided again: a free,
-- expired or own lease is granted as lease_acquire grants it, a single-holder lease held by an older run is
-- taken over (a semaphore's slot never is); either way with a token larger than the row's, than the epoch's
-- floor and than the key's count epoch, the grant's run order and (a takeover) the token it replaced. With p_detail (the ledger on) the grant's 'acquired' event and, for a takeover, a 'replaced'
-- event about the old holder (its owner, token and run columns; the new holder's in its detail) are written
-- in the same transaction; logged says whether they were.
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
    v_other boolean;
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
    SELECT k.other_count, k.count_epoch INTO v_other, v_epoch FROM {schema}.lease_key_state(p_key, 1) k;
    IF v_other THEN
        RETURN QUERY
        SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
               pg_catalog.clock_timestamp(), NULL::pg_catalog.text, NULL::bigint, false, false, l.count_epoch
          FROM {schema}.lease l
         WHERE ((l.key = p_key AND l.slot = 1) OR (l.slot_of = p_key AND l.slot > 1))
           AND l.expires_at > pg_catalog.clock_timestamp() AND l.slots <> 1
         ORDER BY l.slot DESC
         LIMIT 1;
        RETURN;
    END IF;
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

-- A semaphore's acquire (migrations/0014): at most p_slots holders of p_key at once, each in its own slot,
-- one statement. Slot 1 is the row of p_key itself (the row a single-holder lease uses); slot i > 1 is the
-- row p_key || '#' || i (its slot_of is p_key). Each slot row has its own token, strictly increasing per
-- slot, and a holder fences, renews and releases under its slot's key. When every slot is held by others
-- with this slot count, one read answers (no lock, no write). Otherwise the key's grant lock (a
-- transaction-scoped advisory lock, class 0x1EA60, the key's hash: every grant of the key takes it,
-- lease_acquire and lease_replace too, migrations/0015), the live slots are read again, and: a slot held
-- with another slot count (or p_key held as a single lease) refuses the acquire (the caller names both
-- counts); the owner's own slot is granted again with a larger token; else the lowest free slot is granted
-- (its row updated or inserted), with a token above the key's count epoch. The key's slots are the rows
-- p_key with slot 1 and p_key#i with slot i and slot_of p_key: a row held as a key of its own (a plain key
-- spelled like a slot) is skipped. Returns the grant (acquired, with the 'acquired' event when p_detail is
-- given: logged), or every live holder of the key (and whoever holds its own row), by slot.
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
    v_mismatch boolean;
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
        SELECT k.other_count, k.count_epoch INTO v_mismatch, v_epoch FROM {schema}.lease_key_state(p_key, p_slots) k;
        IF NOT v_mismatch THEN
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
