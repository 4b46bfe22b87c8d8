"""on_overlap="replace" with the holder frozen: a newer run takes the lease over while the old run's
process is stopped (SIGSTOP); once resumed, the old run's late writes are refused and its task ends
skipped, not failed, and is not retried into the lease.

The body holds the keeper's interrupt (SIGUSR1) back while it waits, so that the resumed process does reach
its writes and the test sees each one refused: first a write through the fence alone (as a write already
past its lease check would be), then one through the lease context (its check finds the lease taken).
"""

from __future__ import annotations

import os
import signal
from datetime import datetime, timedelta

from _util import mark, wait_for  # type: ignore[import-not-found]
from airflow.sdk import DAG, task
from psycopg2 import sql

from airflow_lease_provider.core import LeaseLost, StaleFencingToken
from airflow_lease_provider.hooks import FenceHook

with DAG("replace_frozen", schedule=None, start_date=datetime(2026, 1, 1), max_active_runs=4):

    @task.leased(
        lease_key="replace-key",
        lease_ttl=timedelta(seconds=6),
        on_overlap="replace",
        retries=2,
        retry_delay=timedelta(seconds=1),
    )
    def publish(lease=None, run_id=None):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            mark(f"replace-token-{run_id}", str(lease.token))
            mark(f"replace-pid-{run_id}", str(os.getpid()))
            wait_for(f"replace-go-{run_id}", timeout=240)
            fences = FenceHook(lease.conn_id, lease_store=lease.store).get_store()
            try:
                fences.guard("replace.raw", lease.token, key=lease.key, owner=lease.owner,
                             store_id=lease.store.store_id)
                mark(f"replace-raw-accepted-{run_id}")
            except StaleFencingToken as refused:
                mark(f"replace-raw-refused-{run_id}", refused.reason)
            try:
                with lease.fenced_transaction("replace.target") as cur:
                    table = sql.Identifier(os.environ["AIRFLOW__LEASE__SCHEMA"], "replace_target")
                    cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (writer text, token bigint)").format(table))
                    cur.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(table), (lease.owner, lease.token))
                mark(f"replace-published-{run_id}", str(lease.token))
            except LeaseLost:
                mark(f"replace-write-refused-{run_id}")
                raise
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        return lease.token

    publish()
