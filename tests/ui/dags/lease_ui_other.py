"""A second DAG for the UI tests, so a user limited to some DAGs has one it may not read."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

with DAG(
    dag_id="lease_ui_other",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["lease-ui-test"],
):

    @task
    def work() -> str:
        return "done"

    work()
