-- Version 22 (issue 41): the lease API's grants, kept past their row. lease.api_capability (migrations/0018)
-- holds the capability digest of the row's current grant only: once a newer grant took the row, a lapsed
-- grant's capability could not be told from a forged one, and its keeper's 'lost' and its late fence's
-- 'fence_rejected' went unrecorded. Each grant the lease API binds is kept here too, by (key, token), with
-- the same digest (sha256 of key \0 owner \0 token \0 capability, bound to that grant), its lease key and the
-- run columns its acquire wrote (the server's record: a caller cannot choose them). The lease API then lets a
-- capability record, for ITS OWN grant only, that the grant was lost and that a late fence of it was
-- refused; it never acts under it (plugins/lease_api.py; docs/api.md).
--
-- released_at: the grant's holder asked the lease API to release it (set before the release, so a grant
-- ended by its holder never records a loss afterwards, whatever failed between). lost_at: its 'lost' event
-- was recorded (at most once per grant). Rows of a key older than the store's event retention are deleted
-- when the key's next API grant is bound.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
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
