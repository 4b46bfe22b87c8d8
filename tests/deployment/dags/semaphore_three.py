"""lease_slots=2 with three runs triggered together: two hold the key at once (slots 1 and 2, each with its
own token), both publish through the fence while both hold, and the third is skipped naming both."""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from _util import mark, wait_for  # type: ignore[import-not-found]
from airflow.sdk import DAG, task
from psycopg2 import sql

with DAG("semaphore_three", schedule=None, start_date=datetime(2026, 1, 1), max_active_runs=4):

    @task.leased(lease_key="semaphore-key", lease_ttl=timedelta(seconds=20), lease_slots=2, on_overlap="skip")
    def work(lease=None, run_id=None):
        mark(f"semaphore-started-{run_id}", f"{lease.slot} {lease.token}")
        wait_for("semaphore-publish", timeout=240)  # the test made the table once both hold and the third skipped
        with lease.fenced_transaction("semaphore.target") as cur:
            table = sql.Identifier(os.environ["AIRFLOW__LEASE__SCHEMA"], "semaphore_target")
            cur.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, %s)").format(table),
                        (lease.owner, lease.slot, lease.token))
        mark(f"semaphore-published-{run_id}", str(lease.token))
        return lease.token

    work()
