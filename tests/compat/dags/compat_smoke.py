"""The compatibility tier's smoke DAGs: what every supported Airflow must run the same way."""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG, task
from psycopg2 import sql

from airflow_lease_provider.operators import LeasedOperator
from airflow_lease_provider.timetables import CappedCatchupTimetable

SCHEMA = os.environ.get("AIRFLOW__LEASE__SCHEMA", "airflow_lease")
START = datetime(2026, 1, 1)


def _insert(cur, writer: str, token: int) -> None:
    table = sql.Identifier(SCHEMA, "compat_articles")
    cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (writer text, token bigint)").format(table))
    cur.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(table), (writer, token))


with DAG("compat_smoke", schedule=None, start_date=START):

    @task.leased(lease_key="compat-publish", lease_ttl=timedelta(seconds=60))
    def publish(lease=None):
        with lease.fenced_transaction("compat.articles") as cur:
            _insert(cur, "publish", lease.token)
        return lease.token

    @task.leased(lease_key="compat-held", lease_ttl=timedelta(seconds=60))
    def overlapped():
        raise RuntimeError("must not run: the test holds this lease elsewhere")

    LeasedBash = LeasedOperator.wrap(BashOperator)
    LeasedBash(
        task_id="bash",
        bash_command="echo leased bash ran",
        lease_key="compat-bash",
        lease_ttl=timedelta(seconds=30),
    )
    publish()
    overlapped()


with DAG("compat_fence_rejected", schedule=None, start_date=START):

    @task.leased(lease_key="compat-zombie", lease_ttl=timedelta(seconds=60))
    def late_publish(lease=None):
        # The test advanced this fence past any token this lease can have: the publish is refused.
        with lease.fenced_transaction("compat.zombie") as cur:
            _insert(cur, "zombie", lease.token)

    late_publish()


with DAG(
    "compat_catchup",
    schedule=CappedCatchupTimetable(timedelta(hours=1), max_backfill=2),
    start_date=START,
    catchup=True,
    max_active_runs=1,  # kept slots run one at a time (the timetable's active_runs_limit, docs/timetable.md)
):

    @task
    def work():
        return "ok"

    work()
