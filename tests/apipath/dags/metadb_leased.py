"""Leased DAGs for the LocalExecutor deployment with the lease store in the metadata database and no
``lease_default`` (tests/apipath/test_metadata_deployment.py): every task here takes its lease through the
api-server's lease API (``[lease] access = auto``, no lease connection on the worker)."""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta

from _util import mark, marker_dir, wait_for  # type: ignore[import-not-found]
from airflow.sdk import DAG, get_current_context, task

START = datetime(2026, 1, 1)

with DAG("metadb_overlap", schedule=None, start_date=START):

    @task.leased(lease_key="metadb-overlap", lease_ttl=timedelta(seconds=30))
    def hold(lease=None):
        run_id = get_current_context()["run_id"]
        mark(f"overlap-started-{run_id}", f"{lease.owner} {lease.token}")
        wait_for(f"overlap-let-go-{run_id}", timeout=240)  # the test lets go once the overlapping run is done

    hold()


with DAG("metadb_zombie", schedule=None, start_date=START):

    @task.leased(lease_key="metadb-zombie", lease_ttl=timedelta(seconds=4), retries=0)
    def publish(lease=None):
        run_id = get_current_context()["run_id"]
        mark(f"zombie-started-{run_id}", f"{os.getpid()} {lease.token}")
        wait_for(f"zombie-go-{run_id}", timeout=240)  # the test freezes this process here, past the TTL
        # The fence of the target, on the API path (/lease/v1/fence), then the side effect carrying the token.
        lease.fence("metadb-zombie-target")
        with (marker_dir() / "zombie-target").open("a") as target:
            target.write(f"{lease.owner} {lease.token}\n")
        mark(f"zombie-published-{run_id}", str(lease.token))

    publish()


# The policies that wait, on the API path: the waiting task's trigger polls (and keeps its place) through the
# api-server too, with the acquire secret read in the triggerer (docs/api.md, decision 9).

with DAG("metadb_wait", schedule=None, start_date=START, max_active_runs=4):

    @task.leased(lease_key="metadb-wait", lease_ttl=timedelta(seconds=30), on_overlap="wait",
                 lease_poll_interval=timedelta(seconds=1), lease_wait_timeout=timedelta(minutes=5))
    def work(lease=None):
        run_id = get_current_context()["run_id"]
        mark(f"wait-started-{run_id}", f"{time.time()} {lease.token}")
        wait_for(f"wait-let-go-{run_id}", timeout=240)
        mark(f"wait-finished-{run_id}", str(time.time()))
        return lease.token

    work()


with DAG("metadb_buffer", schedule=None, start_date=START, max_active_runs=4):

    @task.leased(lease_key="metadb-buffer", lease_ttl=timedelta(seconds=30), on_overlap="wait", max_waiting=1,
                 lease_poll_interval=timedelta(seconds=1), lease_wait_timeout=timedelta(minutes=5))
    def work(lease=None):
        run_id = get_current_context()["run_id"]
        mark(f"buffer-started-{run_id}", f"{time.time()} {lease.token}")
        wait_for(f"buffer-let-go-{run_id}", timeout=240)
        mark(f"buffer-finished-{run_id}", str(time.time()))
        return lease.token

    work()


# A new try of a waiting task whose triggerer was killed keeps its place (docs/api.md, decision 9: the takeover
# of a stale place by its owner's new try).

with DAG("metadb_retry_place", schedule=None, start_date=START, max_active_runs=4):

    @task.leased(lease_key="metadb-retry-place", lease_ttl=timedelta(seconds=30), on_overlap="wait", max_waiting=1,
                 lease_poll_interval=timedelta(seconds=1), lease_wait_timeout=timedelta(minutes=8))
    def work(lease=None):
        run_id = get_current_context()["run_id"]
        mark(f"retry-started-{run_id}", f"{time.time()} {lease.token}")
        wait_for(f"retry-let-go-{run_id}", timeout=400)
        return lease.token

    work()


with DAG("metadb_grace", schedule=None, start_date=START, max_active_runs=4):

    @task.leased(lease_key="metadb-grace", lease_ttl=timedelta(seconds=15), on_overlap="replace",
                 replace_grace=timedelta(seconds=20), lease_poll_interval=timedelta(seconds=1), retries=2)
    def work(lease=None):
        run_id = get_current_context()["run_id"]
        mark(f"grace-started-{run_id}", f"{time.time()} {lease.token}")
        wait_for(f"grace-let-go-{run_id}", timeout=240)  # the older run never lets go: it is taken over
        mark(f"grace-finished-{run_id}", str(time.time()))
        return lease.token

    work()
