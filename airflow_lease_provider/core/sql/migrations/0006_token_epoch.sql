-- Version 6: a token epoch, so a store that failed over never issues a token again (docs/core.md,
-- "Failover of the store").
--
-- With asynchronous replication a promoted standby can lack the last acknowledged grants: counting on
-- from its rows would issue those tokens a second time. Every token is therefore at least
-- (epoch << 40) + 1, and the epoch changes whenever the store finds itself on another server history
-- than the one it recorded: another system identifier (a different cluster) or another timeline (a
-- promoted standby, a point-in-time recovery). The new epoch is greatest(epoch + 1, timeline), so a
-- standby promoted after a second failover, whose copy of this row lags, still lands above the epoch of
-- the timeline it followed. lease_epoch_bump() changes it by hand (airflow-lease failover), for what no
-- server history shows: a schema restored from a dump into the same cluster.
CREATE TABLE lease_epoch (
    id                 boolean     PRIMARY KEY DEFAULT true CHECK (id),
    epoch              integer     NOT NULL CHECK (epoch >= 0 AND epoch < 8388608),
    system_identifier  bigint      NOT NULL,
    timeline           integer     NOT NULL,
    changed_at         timestamptz NOT NULL,
    reason             text        NOT NULL
);

-- The timeline WAL is written on now: the first 8 hex digits of the current WAL file's name.
CREATE FUNCTION lease_timeline()
RETURNS integer
LANGUAGE sql VOLATILE
AS $$
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer
$$;

INSERT INTO lease_epoch (epoch, system_identifier, timeline, changed_at, reason)
VALUES (0, (pg_control_system()).system_identifier, lease_timeline(), clock_timestamp(), 'created');

-- The floor of every token issued now: epoch << 40. Bumps the epoch first when the server history
-- changed. Concurrent callers on a new timeline serialise on the row: the first bumps, the others find
-- the row already current when its lock is released (READ COMMITTED re-checks the WHERE).
CREATE FUNCTION lease_token_floor()
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    -- The system identifier never changes while a server runs: read from the control file once per
    -- session. The timeline does (a promoted standby keeps its sessions): read on every call.
    v_system bigint := nullif(current_setting('airflow_lease.system_identifier', true), '')::bigint;
    v_timeline integer := lease_timeline();
    v_epoch integer;
BEGIN
    IF v_system IS NULL THEN
        v_system := (pg_control_system()).system_identifier;
        PERFORM set_config('airflow_lease.system_identifier', v_system::text, false);
    END IF;
    SELECT e.epoch INTO v_epoch FROM lease_epoch e
     WHERE e.system_identifier = v_system AND e.timeline = v_timeline;
    IF NOT FOUND THEN
        UPDATE lease_epoch e
           SET epoch = greatest(e.epoch + 1, v_timeline), system_identifier = v_system, timeline = v_timeline,
               changed_at = clock_timestamp(), reason = 'new server history'
         WHERE e.system_identifier <> v_system OR e.timeline <> v_timeline
        RETURNING e.epoch INTO v_epoch;
        IF NOT FOUND THEN
            SELECT e.epoch INTO v_epoch FROM lease_epoch e;
        END IF;
    END IF;
    RETURN v_epoch::bigint << 40;
END;
$$;

-- The operator's step after a failover the store cannot see: the next epoch, recorded with its reason.
CREATE FUNCTION lease_epoch_bump(p_reason text)
RETURNS TABLE (epoch integer, system_identifier bigint, timeline integer, changed_at timestamptz, reason text)
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
AS $$
    UPDATE lease_epoch e
       SET epoch = greatest(e.epoch + 1, lease_timeline()), system_identifier = (pg_control_system()).system_identifier,
           timeline = lease_timeline(), changed_at = clock_timestamp(), reason = p_reason
    RETURNING e.epoch, e.system_identifier, e.timeline, e.changed_at, e.reason
$$;

-- lease_acquire of version 2, with every new token at least the epoch's floor + 1.
CREATE OR REPLACE FUNCTION lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_first bigint := lease_token_floor() + 1;
BEGIN
    RETURN QUERY
    WITH upd AS (
        UPDATE lease AS l
           SET owner = p_owner, token = greatest(l.token + 1, v_first), ttl = p_ttl, acquired_at = clock_timestamp(),
               renewed_at = clock_timestamp(), expires_at = clock_timestamp() + p_ttl, released_at = NULL
         WHERE l.key = p_key AND (l.expires_at <= clock_timestamp() OR l.owner = p_owner)
     RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at
    ),
    ins AS (
        INSERT INTO lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at)
        SELECT p_key, p_owner, v_first, p_ttl, clock_timestamp(), clock_timestamp(), clock_timestamp() + p_ttl
         WHERE NOT EXISTS (SELECT 1 FROM lease WHERE key = p_key)
        ON CONFLICT (key) DO NOTHING
     RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at
    )
    SELECT true, u.*, clock_timestamp() FROM upd u
    UNION ALL
    SELECT true, i.*, clock_timestamp() FROM ins i
    UNION ALL
    SELECT false, l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at,
           clock_timestamp()
      FROM lease l
     WHERE l.key = p_key AND NOT EXISTS (SELECT 1 FROM upd) AND NOT EXISTS (SELECT 1 FROM ins);
END;
$$;
