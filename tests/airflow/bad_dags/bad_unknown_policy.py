from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, task

with DAG("bad_unknown_policy", schedule=None, start_date=datetime(2026, 1, 1)):

    @task.leased(lease_ttl=timedelta(minutes=5), on_overlap='queue')
    def body():
        pass

    body()
