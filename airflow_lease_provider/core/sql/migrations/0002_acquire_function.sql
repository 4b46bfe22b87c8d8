-- Version 2: acquire runs inside a plpgsql function so its plan is cached per session.
-- acquire as a plpgsql function: the same single statement, but its plan is prepared once per session
-- and reused (measured: planning took twice as long as executing the statement), and unlike a
-- client-side PREPARE it keeps working behind pgbouncer in transaction pooling mode.
CREATE FUNCTION lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS TABLE (acquired boolean, key text, owner text, token bigint, ttl interval, acquired_at timestamptz,
               renewed_at timestamptz, expires_at timestamptz, released_at timestamptz, observed_at timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH upd AS (
        UPDATE lease AS l
           SET owner = p_owner, token = l.token + 1, ttl = p_ttl, acquired_at = clock_timestamp(),
               renewed_at = clock_timestamp(), expires_at = clock_timestamp() + p_ttl, released_at = NULL
         WHERE l.key = p_key AND (l.expires_at <= clock_timestamp() OR l.owner = p_owner)
     RETURNING l.key, l.owner, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at, l.released_at
    ),
    ins AS (
        INSERT INTO lease AS l (key, owner, token, ttl, acquired_at, renewed_at, expires_at)
        SELECT p_key, p_owner, 1, p_ttl, clock_timestamp(), clock_timestamp(), clock_timestamp() + p_ttl
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
