-- Version 7: every event names the DAG run (and task instance) it is about in typed columns, so "the
-- events of run X" (and of a DAG) is an index range scan instead of a match on the owner string or the
-- detail. The Airflow layer passes the identity (core/identity.py RunRef) with every store call that
-- writes an event; an event about no run (a core API user's, a script's) has NULL columns.
-- map_index: as Airflow numbers it (-1: not mapped) when task_id is set; NULL for a run-scoped owner.
ALTER TABLE event
    ADD COLUMN dag_id    text,
    ADD COLUMN run_id    text,
    ADD COLUMN task_id   text,
    ADD COLUMN map_index integer;
-- Events written before this version are filled in once, here, from what they already say: the run and
-- task an operator wrote into the detail, else the owner when it has one of the operators' formats
-- (dag_id/run_id, dag_id/run_id/task_id[map_index], or dag_id/run_id/map_index from before owners named
-- the task). Rows with neither keep NULL columns, as a core API user's events do.
UPDATE event AS e
   SET dag_id = p.dag_id, run_id = p.run_id, task_id = p.task_id, map_index = p.map_index
  FROM (
    SELECT o.id,
           coalesce(o.d_dag, o.m[1]) AS dag_id,
           coalesce(o.d_run, o.m[2]) AS run_id,
           CASE WHEN o.d_dag IS NOT NULL THEN o.d_task
                WHEN o.m[3] ~ '^[0-9]+$' THEN NULL
                ELSE o.m[3] END AS task_id,
           CASE WHEN o.d_dag IS NOT NULL THEN CASE WHEN o.d_task IS NOT NULL THEN coalesce(o.d_index, -1) END
                WHEN o.m[3] ~ '^[0-9]+$' THEN o.m[3]::integer
                WHEN o.m[3] IS NOT NULL THEN coalesce(o.m[4]::integer, -1) END AS map_index
      FROM (
        SELECT ev.id,
               CASE WHEN jsonb_typeof(ev.detail->'dag_id') = 'string' AND jsonb_typeof(ev.detail->'run_id') = 'string'
                    THEN ev.detail->>'dag_id' END AS d_dag,
               CASE WHEN jsonb_typeof(ev.detail->'dag_id') = 'string' AND jsonb_typeof(ev.detail->'run_id') = 'string'
                    THEN ev.detail->>'run_id' END AS d_run,
               CASE WHEN jsonb_typeof(ev.detail->'task_id') = 'string' THEN ev.detail->>'task_id' END AS d_task,
               CASE WHEN jsonb_typeof(ev.detail->'map_index') = 'number' AND ev.detail->>'map_index' ~ '^-?[0-9]{1,9}$'
                    THEN (ev.detail->>'map_index')::integer END AS d_index,
               regexp_match(ev.owner, '^([^/]+)/([^/]+)(?:/([^/\[\]]+?)(?:\[([0-9]{1,9})\])?)?$') AS m
          FROM event ev
      ) o
     WHERE o.d_dag IS NOT NULL OR o.m IS NOT NULL
  ) p
 WHERE e.id = p.id;
-- The events of one run by time (run_events), and of one DAG (its leading column).
CREATE INDEX event_run_at_idx ON event (dag_id, run_id, at);
