from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.sensors.python import PythonSensor
from airflow.sdk import DAG

from airflow_lease_provider.operators import LeasedOperator

with DAG("bad_reschedule_sensor", schedule=None, start_date=datetime(2026, 1, 1)):
    LeasedOperator.wrap(PythonSensor)(task_id="wait_file", python_callable=lambda: True, mode="reschedule",
                                      poke_interval=30, lease_ttl=timedelta(minutes=5))
