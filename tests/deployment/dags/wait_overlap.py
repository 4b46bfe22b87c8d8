"""Two runs of one leased task with on_overlap="wait": the second defers (its worker slot free, the
triggerer polling the store) and runs once the first releases the lease."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from _util import mark, wait_for  # type: ignore[import-not-found]
from airflow.sdk import DAG, task

with DAG("wait_overlap", schedule=None, start_date=datetime(2026, 1, 1), max_active_runs=4):

    @task.leased(
        lease_key="wait-overlap-key",
        lease_ttl=timedelta(seconds=30),
        on_overlap="wait",
        lease_poll_interval=timedelta(seconds=1),
        lease_wait_timeout=timedelta(minutes=5),
    )
    def work(lease=None, run_id=None):
        mark(f"wait-started-{run_id}", f"{time.time()} {lease.token}")
        wait_for(f"wait-let-go-{run_id}", timeout=240)
        mark(f"wait-finished-{run_id}", str(time.time()))
        return lease.token

    work()
