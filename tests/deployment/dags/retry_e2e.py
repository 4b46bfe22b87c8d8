"""A leased task whose first try dies holding its lease (the worker is gone: nothing releases it)."""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from _util import mark  # type: ignore[import-not-found]
from airflow.sdk import DAG, task

with DAG("retry_after_crash", schedule=None, start_date=datetime(2026, 1, 1)):

    @task.leased(lease_key="retry-key", lease_ttl=timedelta(minutes=10), retries=1,
                 retry_delay=timedelta(seconds=1))
    def crash_then_succeed(lease=None, ti=None):
        mark(f"try-{ti.try_number}", str(lease.token))
        if ti.try_number == 1:
            os._exit(1)  # a worker lost mid-task: the 10-minute lease stays held by this task instance
        return {"token": lease.token, "owner": lease.owner, "key": lease.key}

    crash_then_succeed()
