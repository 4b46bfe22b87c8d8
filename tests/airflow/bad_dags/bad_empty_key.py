from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, task

with DAG("bad_empty_key", schedule=None, start_date=datetime(2026, 1, 1)):

    @task.leased(lease_key='', lease_ttl=timedelta(minutes=5))
    def body():
        pass

    body()
