from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

from airflow_lease_provider.operators import LeasedOperator, run_lease

with DAG("bad_run_scope_renew_operator", schedule=None, start_date=datetime(2026, 1, 1)):
    acquire, release = run_lease(lease_ttl=timedelta(minutes=5))
    # Longer than any lease can live (7 days): no run lease's TTL could make it work.
    step = LeasedOperator.wrap(BashOperator)(
        task_id="step", bash_command="true", lease_scope="run", lease_renew_every=timedelta(days=8)
    )
    acquire >> step >> release
