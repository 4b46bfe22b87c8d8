"""Demo only: a job that stalls past its TTL without renewing, then tries to publish anyway.

It takes the lease with the core API and no keeper (like code written before it used the operator),
waits for the demo's go-ahead (by then a newer run has taken the lease and published), and then
publishes through the fence, which refuses its old token: the task fails with StaleFencingToken.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG, Param, task

from airflow_lease_provider.hooks import FenceHook, LeaseHook

MARKERS = Path(os.environ.get("AIRFLOW_HOME", "/tmp")) / "demo-markers"

with DAG(
    dag_id="zombie_demo",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    params={"stall": Param(False, type="boolean")},
    max_active_runs=2,
    tags=["lease-demo"],
):

    @task
    def publish_once(params=None, dag_run=None):
        leases = LeaseHook().get_store()
        lease = leases.acquire("zombie-demo", owner=f"zombie_demo/{dag_run.run_id}", ttl=timedelta(seconds=8))
        if lease is None:
            raise RuntimeError("demo: the lease is held; run the demo from a clean state")
        if params["stall"]:
            MARKERS.mkdir(exist_ok=True)
            (MARKERS / "stalled").write_text(str(lease.token))
            while not (MARKERS / "go").exists():  # stalls past the 8 s TTL, renewing nothing
                time.sleep(0.5)
        FenceHook().get_store().guard("demo.blog", lease.token, key=lease.key, owner=lease.owner)  # the final gate
        leases.release(lease)
        return lease.token

    publish_once()
