"""Two DAGs on one lease key with different settings (issue 38, defect 1): ``mixed_slots_x`` holds the key as
a semaphore of two (``lease_slots=2``), ``mixed_replace_y`` asks for it with ``on_overlap="replace"`` (a
single holder). A replace never takes over a slot holder and is never granted beside one."""

from __future__ import annotations

from datetime import datetime, timedelta

from _util import mark, wait_for  # type: ignore[import-not-found]
from airflow.sdk import DAG, task

with DAG("mixed_slots_x", schedule=None, start_date=datetime(2026, 1, 1), max_active_runs=4):

    @task.leased(lease_key="mixed-key", lease_ttl=timedelta(seconds=20), lease_slots=2, on_overlap="skip")
    def hold(lease=None, run_id=None):
        mark(f"mixed-x-{run_id}", f"{lease.slot} {lease.token}")
        wait_for(f"mixed-x-done-{run_id}", timeout=240)
        return lease.token

    hold()

with DAG("mixed_replace_y", schedule=None, start_date=datetime(2026, 1, 1), max_active_runs=4):

    @task.leased(lease_key="mixed-key", lease_ttl=timedelta(seconds=20), on_overlap="replace", retries=0)
    def single(lease=None, run_id=None):
        mark(f"mixed-y-granted-{run_id}", f"{lease.slots} {lease.token}")
        return lease.token

    single()
