-- Version 13 (issue 26 item 4): one coalesced-catch-up record per DAG run, enforced by the database, as
-- version 4 does for skipped catch-up. With CappedCatchupTimetable(coalesce=True) the slots the cap drops
-- are folded into the oldest kept run's data interval; that run records them once (kind 'coalesced', the
-- run's dag_id and run_id in the event's detail). Every leased task of the run, every try and every
-- parallel instance tries to write the record; the unique index lets exactly one
-- INSERT ... ON CONFLICT DO NOTHING through (queries.sql: record_coalesced), and only that writer logs the
-- line and counts scheduled.coalesced. No record of this kind exists before this version.
--
-- {schema} is the store's schema, filled in as a quoted identifier (core/db/sqltext.py, with_schema).
CREATE UNIQUE INDEX event_coalesced_uq ON {schema}.event ((detail->>'dag_id'), (detail->>'run_id'))
 WHERE kind = 'coalesced';
