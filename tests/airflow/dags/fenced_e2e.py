"""A run lease whose tasks publish to one resource several times (tests/airflow/test_fenced_publish.py)."""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG

from airflow_lease_provider.operators import FencedSQLOperator, run_lease

SCHEMA = os.environ.get("AIRFLOW__LEASE__SCHEMA", "airflow_lease")
TABLE = {"table": [SCHEMA, "fenced_rows"]}
SQL = [
    "CREATE TABLE IF NOT EXISTS {table} (who text, token bigint)",
    "INSERT INTO {table} VALUES (%(who)s, %(fencing_token)s)",
]

with DAG("fenced_twice", schedule=None, start_date=datetime(2026, 1, 1)):
    acquire, release = run_lease(lease_key="fenced-run", lease_ttl=timedelta(minutes=2))
    first = FencedSQLOperator(
        task_id="first",
        resource="warehouse.rows",
        sql=SQL,
        identifiers=TABLE,
        parameters={"who": "first"},
        lease_key="fenced-run",
    )
    second = FencedSQLOperator(
        task_id="second",
        resource="warehouse.rows",
        sql=SQL,
        identifiers=TABLE,
        parameters={"who": "second"},
        lease_key="fenced-run",
    )
    mapped = FencedSQLOperator.partial(
        task_id="mapped", resource="warehouse.rows", sql=SQL, identifiers=TABLE, lease_key="fenced-run"
    ).expand(parameters=[{"who": "mapped-0"}, {"who": "mapped-1"}])
    acquire >> first >> second >> mapped >> release
