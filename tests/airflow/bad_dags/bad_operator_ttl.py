from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

from airflow_lease_provider.operators import LeasedOperator

with DAG("bad_operator_ttl", schedule=None, start_date=datetime(2026, 1, 1)):
    LeasedOperator.wrap(BashOperator)(task_id="b", bash_command="true", lease_ttl=timedelta(days=30))
