from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, task

with DAG("bad_lease_on_outlets", schedule=None, start_date=datetime(2026, 1, 1)):

    @task.leased(lease_on="outlets", lease_ttl=timedelta(minutes=5))  # no asset outlets to key on
    def body():
        pass

    body()
