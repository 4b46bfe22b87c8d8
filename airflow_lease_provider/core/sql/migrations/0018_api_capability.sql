-- Version 18 (issue 41): the lease API's per-grant capability. A grant made through the api-server's lease
-- API (plugins/lease_api.py) keeps sha256(key \0 owner \0 token \0 capability) here; renew, release, check and
-- fence over HTTP must present the capability of the row's current grant. NULL for every grant of the direct
-- path (no API caller can act under it). The digest is bound to the grant's key, owner and token, so a digest
-- an older grant left on the row never matches a newer grant. No statement of the direct path reads it.
--
-- (Numbered 0018 on its branch while 0017 was another branch's: the lead renumbers at merge.)
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
ALTER TABLE {schema}.lease ADD COLUMN api_capability bytea;
