"""A leased task someone marks failed while it runs (the UI's "Mark as failed", or the REST API)."""

from __future__ import annotations

from datetime import datetime, timedelta

from _util import mark, wait_for  # type: ignore[import-not-found]
from airflow.sdk import DAG, task

with DAG("marked_failed", schedule=None, start_date=datetime(2026, 1, 1)):

    # A 10-minute lease: if marking the task failed left it held, the next run would be skipped for that long.
    @task.leased(lease_key="marked-key", lease_ttl=timedelta(minutes=10))
    def work(lease=None, run_id=None):
        mark(f"marked-started-{run_id}", str(lease.token))
        wait_for(f"marked-let-go-{run_id}", timeout=240)  # the first run never gets it: it is marked failed
        mark(f"marked-finished-{run_id}")

    work()
