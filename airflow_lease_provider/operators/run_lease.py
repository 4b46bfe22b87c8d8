"""Run-scoped leases: one lease held by a whole DAG run across several tasks.

::

    acquire, release = run_lease(lease_key="nightly-close", lease_ttl=timedelta(hours=2))
    acquire >> extract >> transform >> publish >> release

``acquire`` is a setup task: when another run holds the lease it is skipped (with the reason), and
every task after it is skipped too, so an overlapping run is skipped as a whole. ``release`` is a
teardown task: it runs even when tasks in between fail. Tasks in between that run long should take
``lease_scope="run"`` (``LeasedOperator.wrap(X)(..., lease_scope="run")`` or
``@task.leased(lease_scope="run")``): they renew the run's lease while they run. The owner of a
run-scoped lease is the DAG run (``dag_id/run_id``); its default key is the DAG id.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from airflow_lease_provider.arguments import check_name
from airflow_lease_provider.clock import warn_on_clock_skew
from airflow_lease_provider.context import XCOM_LEASE
from airflow_lease_provider.core import Lease, LeaseStore, validation
from airflow_lease_provider.identity import run_ref, task_ref, task_tags
from airflow_lease_provider.interrupt import Terminate
from airflow_lease_provider.operators.leased import LeasedOperator
from airflow_lease_provider.outcomes import Outcome, report


class AcquireRunLeaseOperator(LeasedOperator):
    """Setup task of a run-scoped lease: acquires it for the DAG run and leaves it held."""

    _run_owned = True
    ui_color = "#e8f4ea"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("lease_scope", "task")
        super().__init__(**kwargs)

    def _run_holding(
        self, context: Any, store: LeaseStore, lease: Lease, *, release: bool, terminate: Terminate
    ) -> Any:
        """Leave the lease held for the run; but if this task fails (or is told to stop) before it is done,
        free it."""
        from datetime import datetime, timezone

        try:
            warn_on_clock_skew(lease, datetime.now(timezone.utc), self.log)
            report(
                Outcome.ACQUIRED, store=store, key=lease.key, owner=lease.owner,
                tags=task_tags(context, lease.key), logger=self.log,
                message=(
                    f"run {lease.owner} acquired {lease.key!r} with token {lease.token} "
                    f"until {lease.expires_at.isoformat()}"
                ),
            )
            context["ti"].xcom_push(key=XCOM_LEASE, value=lease.to_dict())
            terminate.check()
        except BaseException:
            self._give_back(store, lease, None, release=True, run=task_ref(context))
            raise
        return lease.to_dict()


class ReleaseRunLeaseOperator(BaseOperator):
    """Teardown task of a run-scoped lease: releases it if this run still holds it."""

    template_fields = ("lease_key",)
    ui_color = "#f4ece8"

    def __init__(self, *, lease_key: str | None = None, lease_conn_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_name("lease_key", lease_key, optional=True)
        self.lease_key = lease_key
        self.lease_conn_id = lease_conn_id

    def execute(self, context: Any) -> bool:
        from airflow_lease_provider.hooks import LeaseHook

        run = run_ref(context)
        key = run.default_key() if self.lease_key is None else validation.name("lease_key", self.lease_key)
        store = LeaseHook(self.lease_conn_id).get_store()
        owner = run.owner()
        holding = store.holds(key, owner)
        if holding.lease is None:
            self.log.warning(
                "lease: run %s does not hold %r any more (%s); nothing to release",
                owner, key, holding.holder.describe() if holding.holder else "it is free",
            )
            return False
        released = store.release(holding.lease, run=task_ref(context))
        self.log.info("lease: run %s released %r token %s", owner, key, holding.lease.token)
        return released


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
    """The setup and teardown tasks of a run-scoped lease, already paired (default key: the DAG id)."""
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
