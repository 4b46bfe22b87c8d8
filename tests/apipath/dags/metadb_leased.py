"""Leased DAGs for the LocalExecutor deployment with the lease store in the metadata database and no
``lease_default`` (tests/apipath/test_metadata_deployment.py): every task here takes its lease through the
api-server's lease API (``[lease] access = auto``, no lease connection on the worker)."""

from __future__ import annotations

import os
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
