"""A leased task for the UI tests: one run crashes holding the lease, the next one is skipped.

``LEASE_UI_CRASH=1`` makes the task kill its own process while it holds the lease, like a worker lost
mid-run: nothing releases the lease until its TTL runs out, so the next run finds it held.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, task

with DAG(
    dag_id="lease_ui_demo",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["lease-ui-test"],
):

    @task.leased(lease_key="ui-demo", lease_ttl=timedelta(minutes=10))
    def publish() -> str:
        if os.environ.get("LEASE_UI_CRASH") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return "published"

    publish()
