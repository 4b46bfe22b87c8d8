"""DAGs for the tests with a live scheduler (test_scheduler_e2e.py). Markers go to $LEASE_TEST_MARKERS."""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import DAG, get_current_context, task
from psycopg2 import sql

from tests.airflow.dags._util import mark, wait_for

START = datetime(2026, 1, 1)

# (a) Two different tasks of one run, one explicit key: one runs, the other is skipped.
with DAG("live_same_key", schedule=None, start_date=START, catchup=False):

    @task.leased(lease_key="live-shared", lease_ttl=timedelta(seconds=60))
    def first():
        mark("same-key-body-first")
        wait_for("same-key-release", timeout=240)  # the test lets go once the other task is skipped

    @task.leased(lease_key="live-shared", lease_ttl=timedelta(seconds=60))
    def second():
        mark("same-key-body-second")
        wait_for("same-key-release", timeout=240)

    first()
    second()


# (b) A retry of a task instance whose first try is frozen (SIGSTOP) past its TTL.
with DAG("live_retry", schedule=None, start_date=START, catchup=False):

    @task.leased(
        lease_key="live-retry", lease_ttl=timedelta(seconds=6), retries=1, retry_delay=timedelta(seconds=1)
    )
    def publish(lease=None):
        try_number = get_current_context()["ti"].try_number
        mark(f"retry-try{try_number}-token", str(lease.token))
        if try_number == 1:
            mark("retry-try1-pids", f"{os.getpid()} {os.getppid()}")
            wait_for("retry-try1-go", timeout=600)  # frozen here by the test, then resumed
        with lease.fenced_transaction("live.retry_target") as cur:
            table = sql.Identifier(os.environ["AIRFLOW__LEASE__SCHEMA"], "retry_target")
            cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (try_number int, token bigint)").format(table))
            cur.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(table), (try_number, lease.token))
        mark(f"retry-try{try_number}-published")

    publish()


# (c) The task fails between the acquire and the keeper's start: its XCom push is refused.
with DAG("live_xcom_refused", schedule=None, start_date=START, catchup=False):

    @task.leased(lease_key="live-xcom", lease_ttl=timedelta(minutes=30))
    def refused():
        mark("xcom-refused-body")

    refused()
