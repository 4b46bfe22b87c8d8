"""A leased task for the lease API path (tests/ui/test_lease_api_server.py): run with ``[lease] access = api``
it takes, renews and releases its lease through the api-server only."""

from __future__ import annotations

import time
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task

with DAG(
    dag_id="lease_api_path",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["lease-ui-test"],
):

    @task.leased(lease_key="api-path", lease_ttl=timedelta(seconds=9), lease_renew_every=timedelta(seconds=1))
    def work() -> str:
        time.sleep(4)  # several renewals, over HTTP
        return "done"

    work()
