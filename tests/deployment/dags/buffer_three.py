"""on_overlap="wait", max_waiting=1 with three runs triggered together: one holds the lease, one takes the waiting
place and defers (its trigger keeping the place), one is skipped naming the waiter."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from _util import mark, wait_for  # type: ignore[import-not-found]
from airflow.sdk import DAG, task

with DAG("buffer_three", schedule=None, start_date=datetime(2026, 1, 1), max_active_runs=4):

    @task.leased(
        lease_key="buffer-key",
        lease_ttl=timedelta(seconds=20),
        on_overlap="wait",
        max_waiting=1,
        lease_poll_interval=timedelta(seconds=1),
        lease_wait_timeout=timedelta(minutes=5),
    )
    def work(lease=None, run_id=None):
        mark(f"buffer-started-{run_id}", f"{time.time()} {lease.token}")
        wait_for(f"buffer-let-go-{run_id}", timeout=240)
        mark(f"buffer-finished-{run_id}", str(time.time()))
        return lease.token

    work()
