"""Leased DAGs for the Edge deployment tier (tests/apipath/test_edge.py). Their tasks run on an Edge worker
with no lease connection and no route to the lease store, so each lease is taken, renewed, fenced and
released through the api-server's lease API ([lease] access = auto). Markers (``_util.mark``) say when a
task reached a point; the fence's target is a file in the markers directory."""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta

import pendulum
from _util import mark, marker_dir, wait_for
from airflow.sdk import DAG, get_current_context, task

from airflow_lease_provider.core import LeaseLost

START = pendulum.datetime(2026, 1, 1, tz="UTC")

with DAG("edge_overlap", schedule=None, start_date=START, catchup=False, tags=["lease-edge-test"]):

    @task.leased(lease_key="edge-overlap-key", lease_ttl=timedelta(seconds=30))
    def hold() -> str:
        run_id = get_current_context()["run_id"]
        # What this process has of Airflow's settings: names only, and the metadata URL's scheme (no value that
        # could carry a secret is written down).
        url = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "")
        names = sorted(k for k in os.environ if k.startswith("AIRFLOW"))
        mark(f"overlap-env-{run_id}", json.dumps({"names": names, "metadata_scheme": url.partition(":")[0]}))
        mark(f"overlap-started-{run_id}", str(os.getpid()))
        wait_for(f"overlap-let-go-{run_id}", timeout=600)  # the test lets go once the overlapping run is done
        return run_id

    hold()


def frozen_publish(lease, prefix: str) -> int:
    """Mark the token and pid, wait for the test's go (frozen here, past the TTL), then publish to the target
    file through ``lease.fence()``. The keeper's interrupt (SIGUSR1) is held back meanwhile, so a resumed
    process does reach the fence and the test sees the fence's own answer: a refusal is marked, then raised."""
    run_id = get_current_context()["run_id"]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        mark(f"{prefix}-token-{run_id}", str(lease.token))
        mark(f"{prefix}-pid-{run_id}", str(os.getpid()))
        wait_for(f"{prefix}-go-{run_id}", timeout=600)
        try:
            lease.fence(f"{prefix}-target")  # through the api-server's /lease/v1/fence
        except LeaseLost:
            mark(f"{prefix}-fence-refused-{run_id}")
            raise
        with (marker_dir() / f"{prefix}-target").open("a") as target:
            target.write(f"{lease.owner} {lease.token}\n")
        mark(f"{prefix}-published-{run_id}", str(lease.token))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    return int(lease.token)


with DAG("edge_zombie", schedule=None, start_date=START, catchup=False, tags=["lease-edge-test"]):

    @task.leased(lease_key="edge-zombie-key", lease_ttl=timedelta(seconds=8))
    def publish(lease=None) -> int:
        return frozen_publish(lease, "zombie")

    publish()


with DAG("edge_replace", schedule=None, start_date=START, catchup=False, tags=["lease-edge-test"]):

    @task.leased(lease_key="edge-replace-key", lease_ttl=timedelta(seconds=8), on_overlap="replace")
    def publish(lease=None) -> int:
        return frozen_publish(lease, "replace")

    publish()
