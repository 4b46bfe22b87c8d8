"""A leased task that writes to a SQLite file through the SQL fence (connection ``warehouse_sqlite``, a
sqlite DbApiHook connection): run by tests/deployment/test_asset_example.py in a real task process."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, task

with DAG("sqlite_fence_load", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):

    @task.leased(lease_key="warehouse-load", lease_ttl=timedelta(minutes=5))
    def load(lease=None, run_id=None):
        with lease.fenced_transaction("warehouse.sales", conn_id="warehouse_sqlite") as cur:
            cur.execute("INSERT INTO sales (run_id, token) VALUES (:run_id, :token)",
                        {"run_id": run_id, "token": lease.token})
        return lease.token

    load()
