"""run leases: one lease held by a whole DAG run across several tasks.

::

    acquire, release = run_lease(lease_key="nightly-close", lease_ttl=timedelta(hours=2))
    acquire >> extract >> transform >> publish >> release

``acquire`` is a setup task: when another run holds the lease it is skipped (with the reason), and
every task after it is skipped too, so an overlapping run is skipped as a whole. ``release`` is a
teardown task: it runs even when tasks in between fail. Tasks in between that run long should take
``lease_scope="run"`` (``LeasedOperator.wrap(X)(..., lease_scope="run")`` or
``@task.leased(lease_scope="run")``): they renew the run's lease while they run. The owner of a
run lease is the DAG run (``dag_id/run_id``); its default key is the DAG id.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from airflow_lease_provider.core import InvalidArgument
from airflow_lease_provider.operators.leased import LeasedOperator
from airflow_lease_provider.runtime.arguments import check_name
from airflow_lease_provider.runtime.task_lease import TaskLease


class AcquireRunLeaseOperator(LeasedOperator):
    """Setup task of a run lease: acquires it for the DAG run and leaves it held."""

    _keeps_for_run = True
    ui_color = "#e8f4ea"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("lease_scope", "task")
        if kwargs.get("on_overlap") == "replace":
            # The run's later tasks would find the lease gone and fail as lost: nothing ends them skipped.
            raise InvalidArgument(
                "on_overlap", "replace", "is not available for a run lease (only for a task's own lease)"
            )
        super().__init__(**kwargs)


class ReleaseRunLeaseOperator(BaseOperator):
    """Teardown task of a run lease: releases it if this run still holds it."""

    template_fields = ("lease_key",)
    ui_color = "#f4ece8"

    def __init__(self, *, lease_key: str | None = None, lease_conn_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_name("lease_key", lease_key, optional=True)
        self.lease_key = lease_key
        self.lease_conn_id = lease_conn_id

    def execute(self, context: Any) -> bool:
        lease = TaskLease.of(self, context, lease_key=self.lease_key, conn_id=self.lease_conn_id, run_scoped=True)
        return lease.release_run_lease()


def run_lease(
    *,
    lease_key: str | None = None,
    lease_ttl: timedelta,
    on_overlap: str = "skip",
    lease_wait_timeout: timedelta | None = None,
    lease_conn_id: str | None = None,
    acquire_task_id: str = "acquire_run_lease",
    release_task_id: str = "release_run_lease",
    **kwargs: Any,
) -> tuple[AcquireRunLeaseOperator, ReleaseRunLeaseOperator]:
    """The setup and teardown tasks of a run lease, already paired (default key: the DAG id)."""
    acquire = AcquireRunLeaseOperator(
        task_id=acquire_task_id, lease_key=lease_key, lease_ttl=lease_ttl, on_overlap=on_overlap,
        lease_wait_timeout=lease_wait_timeout, lease_conn_id=lease_conn_id, **kwargs,
    )
    release = ReleaseRunLeaseOperator(
        task_id=release_task_id, lease_key=lease_key, lease_conn_id=lease_conn_id, **kwargs
    )
    acquire.as_setup()
    release.as_teardown(setups=acquire)
    return acquire, release
