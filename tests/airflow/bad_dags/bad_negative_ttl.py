from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, task

with DAG("bad_negative_ttl", schedule=None, start_date=datetime(2026, 1, 1)):

    @task.leased(lease_ttl=timedelta(seconds=-5))
    def body():
        pass

    body()
