-- Version 16 (issue 40 item 4): the once-per-run catch-up records (kinds 'skipped_catchup', migration
-- 0004, and 'coalesced', migration 0013) are keyed by the event's run columns (dag_id, run_id; migration
-- 0007) instead of the copies in its detail. Their one writer (EventLedger.record_catchup) fills both from
-- the same run, so every record this package wrote keeps its key; the rule now reads the columns every
-- other run query reads, and a record's detail is only what it says.
--
-- Existing rows, before the new indexes:
-- 1. A record whose run columns are empty but whose detail names its run (written through the plain event
--    API without a run, which the old index still held to one per run) gets its columns from the detail,
--    as migration 0007 filled every event written before it. It stays under the rule.
-- 2. Two records of one kind that now name the same run in their columns (possible only for records written
--    through the plain event API with a run its detail does not name, which the old index did not see as
--    one run): the oldest is kept, as migration 0004 kept the oldest of duplicates.
-- Records with no run in either place stay as they are: NULL columns are never equal, so no rule applies.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
UPDATE {schema}.event
   SET dag_id = detail->>'dag_id', run_id = detail->>'run_id'
 WHERE kind IN ('skipped_catchup', 'coalesced') AND dag_id IS NULL AND run_id IS NULL
   AND jsonb_typeof(detail->'dag_id') = 'string' AND jsonb_typeof(detail->'run_id') = 'string';
DELETE FROM {schema}.event AS e
 USING {schema}.event AS older
 WHERE e.kind IN ('skipped_catchup', 'coalesced') AND older.kind = e.kind
   AND older.dag_id = e.dag_id AND older.run_id = e.run_id AND older.id < e.id;
DROP INDEX {schema}.event_skipped_catchup_uq;
DROP INDEX {schema}.event_coalesced_uq;
CREATE UNIQUE INDEX event_skipped_catchup_uq ON {schema}.event (dag_id, run_id) WHERE kind = 'skipped_catchup';
CREATE UNIQUE INDEX event_coalesced_uq ON {schema}.event (dag_id, run_id) WHERE kind = 'coalesced';
