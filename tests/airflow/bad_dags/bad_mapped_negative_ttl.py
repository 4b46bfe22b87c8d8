from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

from airflow_lease_provider.operators import LeasedOperator

with DAG("bad_mapped_negative_ttl", schedule=None, start_date=datetime(2026, 1, 1)):
    LeasedOperator.wrap(BashOperator).partial(task_id="sync", lease_ttl=timedelta(seconds=-7)).expand(
        bash_command=["echo 1", "echo 2"]
    )
