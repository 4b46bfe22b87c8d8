from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, task

from airflow_lease_provider.operators import run_lease

with DAG("bad_run_scope_renew", schedule=None, start_date=datetime(2026, 1, 1)):
    acquire, release = run_lease(lease_ttl=timedelta(minutes=5))

    # A run-lease task takes its TTL from the run lease, so there is no TTL to compare with here; a
    # negative interval can never work whatever that TTL is.
    @task.leased(lease_scope="run", lease_renew_every=timedelta(seconds=-5))
    def step():
        pass

    acquire >> step() >> release
