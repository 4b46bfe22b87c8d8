-- Indexes for the lease timeline and trends (docs/ui.md, "Timeline and trends").
--
-- An event's DAG: its detail's dag_id when the operator wrote one, else its owner up to the first '/'
-- (owners are dag_id/run_id[/task_id[map_index]]). The expression is the one the DAG-scoped reads use,
-- so the DAG tab and the trends of a DAG read one DAG's events in a time range by index.
CREATE INDEX event_dag_at_idx ON event
    ((coalesce(detail->>'dag_id', CASE WHEN strpos(owner, '/') > 1 THEN split_part(owner, '/', 1) END)), at);
-- A fence rejection is recorded under the fence's resource; its lease key is in the detail. A key's
-- timeline reads them by that key.
CREATE INDEX event_fence_lease_key_at_idx ON event ((detail->>'lease_key'), at) WHERE kind = 'fence_rejected';
