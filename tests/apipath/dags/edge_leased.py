"""Leased DAGs for the Edge deployment tier (tests/apipath/test_edge.py). Their tasks run on an Edge worker
with no lease connection and no route to the lease store, so each lease is taken, renewed, fenced and
released through the api-server's lease API ([lease] access = auto). Markers (``_util.mark``) say when a
task reached a point; the fence's target is a file in the markers directory."""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from _util import mark, marker_dir, wait_for
from airflow.sdk import DAG, get_current_context, task

START = pendulum.datetime(2026, 1, 1, tz="UTC")

with DAG("edge_overlap", schedule=None, start_date=START, catchup=False, tags=["lease-edge-test"]):

    @task.leased(lease_key="edge-overlap-key", lease_ttl=timedelta(seconds=30))
    def hold() -> str:
        run_id = get_current_context()["run_id"]
        mark(f"overlap-started-{run_id}", str(os.getpid()))
        wait_for(f"overlap-let-go-{run_id}", timeout=600)  # the test lets go once the overlapping run is done
        return run_id

    hold()


with DAG("edge_zombie", schedule=None, start_date=START, catchup=False, tags=["lease-edge-test"]):

    @task.leased(lease_key="edge-zombie-key", lease_ttl=timedelta(seconds=8))
    def publish(lease=None) -> int:
        run_id = get_current_context()["run_id"]
        mark(f"zombie-token-{run_id}", str(lease.token))
        mark(f"zombie-pid-{run_id}", str(os.getpid()))
        wait_for(f"zombie-go-{run_id}", timeout=600)  # the test freezes this process here, past its TTL
        lease.fence("edge-target")  # refused for a grant that is no longer the key's: nothing below runs
        with (marker_dir() / "edge-target").open("a") as target:
            target.write(f"{lease.owner} {lease.token}\n")
        mark(f"zombie-published-{run_id}", str(lease.token))
        return lease.token

    publish()
