-- Version 4: one skipped-catch-up record per gap per DAG, enforced by the database.
-- The gap is the one right before a run, so a run (dag_id, run_id in the event's detail) names it. Every
-- leased task of that run, every try and every parallel instance tries to write the record; the unique
-- index lets exactly one INSERT ... ON CONFLICT DO NOTHING through (queries.sql: record_skipped_catchup),
-- and only that writer logs the warning and counts the metric.
-- Records written more than once before this version are reduced to the oldest one first.
DELETE FROM event AS e
 USING event AS older
 WHERE e.kind = 'skipped_catchup' AND older.kind = 'skipped_catchup'
   AND older.detail->>'dag_id' = e.detail->>'dag_id' AND older.detail->>'run_id' = e.detail->>'run_id'
   AND older.id < e.id;
CREATE UNIQUE INDEX event_skipped_catchup_uq ON event ((detail->>'dag_id'), (detail->>'run_id'))
 WHERE kind = 'skipped_catchup';
