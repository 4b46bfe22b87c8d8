"""``@task.leased()`` with its TTL from ``default_args``, as users write it: the DAG's ``lease_ttl`` for a plain
and a mapped task, a task group's own ``lease_ttl`` for another; and
``.override(...).expand()`` of the mapped function. Each returns the TTL it ran
with."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, TaskGroup, task

with DAG("default_args_ttl", schedule=None, start_date=datetime(2026, 1, 1),
         default_args={"lease_ttl": timedelta(seconds=45)}):

    @task.leased()
    def plain(lease=None):
        return lease.lease.ttl.total_seconds()

    @task.leased()
    def mapped(x, lease=None):
        return [x, lease.lease.ttl.total_seconds(), lease.key]

    with TaskGroup("group", default_args={"lease_ttl": timedelta(seconds=50)}):

        @task.leased()
        def in_group(lease=None):
            return lease.lease.ttl.total_seconds()

        in_group()

    plain()
    mapped.expand(x=[1, 2])
    mapped.override(task_id="overridden", lease_key="over-{{ ti.map_index }}").expand(x=[3])
