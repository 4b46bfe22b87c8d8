"""DAGs of the Celery tier. A task's ``queue`` steers it: ``a`` runs on worker A, ``b`` on worker B.

The tasks write markers (files in ``LEASE_TEST_MARKERS``) that the tests wait for, and wait for
markers the tests write.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, get_current_context, task
from psycopg2 import sql

from airflow_lease_provider.core import LeaseLost, StaleFencingToken

START = datetime(2026, 1, 1)
SCHEMA = os.environ.get("AIRFLOW__LEASE__SCHEMA", "airflow_lease")


def mark(name: str, text: str = "") -> None:
    path = Path(os.environ["LEASE_TEST_MARKERS"]) / name
    path.write_text(text or str(time.time()))


def wait_for(name: str, timeout: float = 300) -> None:
    path = Path(os.environ["LEASE_TEST_MARKERS"]) / name
    end = time.time() + timeout
    while not path.exists():
        if time.time() > end:
            raise TimeoutError(f"marker {name} never appeared")
        time.sleep(0.1)


def _write(cur, lease, writer: str) -> None:
    table = sql.Identifier(SCHEMA, "zombie_target")
    cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (writer text, token bigint)").format(table))
    cur.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(table), (writer, lease.token))


# -- two runs on two workers, one lease key ------------------------------------------------------------

for worker in ("a", "b"):
    with DAG(f"celery_overlap_{worker}", schedule=None, start_date=START, catchup=False):

        @task.leased(lease_key="celery-overlap", lease_ttl=timedelta(seconds=20), queue=worker)
        def hold(lease=None):
            dag_id = get_current_context()["ti"].dag_id
            mark(f"{dag_id}-acquired", str(lease.token))
            wait_for("overlap-let-go")

        hold()


# -- the zombie: try 1 frozen on worker A after its last check, try 2 on worker B ----------------------

with DAG("celery_zombie", schedule=None, start_date=START, catchup=False):

    @task.leased(
        lease_key="celery-zombie", lease_ttl=timedelta(seconds=6), queue="a", retries=1,
        retry_delay=timedelta(seconds=1),
    )
    def publish(lease=None):
        try_number = get_current_context()["ti"].try_number
        if try_number > 1:
            mark(f"zombie-try{try_number}", f"{os.getpid()} {os.getpgid(0)} {lease.token}")
            with lease.fenced_transaction("celery.zombie_target") as cur:
                _write(cur, lease, f"try{try_number}")
            mark(f"zombie-try{try_number}-published", str(lease.token))
            return
        # Try 1: checked, so past the early safety net, its write target at hand (the store is made
        # now: resolving a connection talks to the supervisor, which stays frozen while this process
        # is resumed), then frozen by the test once its marker is written. The marker comes last: a
        # process frozen while it waits for the (frozen) supervisor's answer would never get here.
        from airflow_lease_provider.hooks import FenceHook

        fences = FenceHook().get_store()
        lease.check()
        mark("zombie-try1", f"{os.getpid()} {os.getpgid(0)} {lease.token}")
        try:
            wait_for("zombie-freeze-done")
        except LeaseLost as lost:  # the keeper's report, raised in this thread when it resumes
            mark("zombie-try1-lost", str(lost))
        wait_for("zombie-go")
        # A zombie that does not listen: straight to the fence, as code already past its check would.
        try:
            with fences.transaction("celery.zombie_target", lease.token, owner=lease.owner, key=lease.key) as cur:
                _write(cur, lease, "try1")
        except StaleFencingToken as refused:
            mark("zombie-try1-refused", str(refused))
            raise
        mark("zombie-try1-published", str(lease.token))

    publish()


# -- kill -9 of worker A mid-task: the retry runs on worker B -------------------------------------------

with DAG("celery_kill", schedule=None, start_date=START, catchup=False):

    @task.leased(
        lease_key="celery-kill", lease_ttl=timedelta(seconds=6), queue="a", retries=1,
        retry_delay=timedelta(seconds=1),
    )
    def work(lease=None):
        try_number = get_current_context()["ti"].try_number
        mark(f"kill-try{try_number}", f"{os.getpid()} {os.getpgid(0)} {lease.token}")
        if try_number == 1:
            wait_for("kill-never")  # killed here with its worker

    work()


# -- the store unreachable from one worker --------------------------------------------------------------

for worker in ("a", "b"):
    with DAG(f"celery_unreachable_{worker}", schedule=None, start_date=START, catchup=False):

        @task.leased(lease_key=f"celery-unreachable-{worker}", lease_ttl=timedelta(seconds=20), queue=worker)
        def body():
            dag_id = get_current_context()["ti"].dag_id
            mark(f"{dag_id}-ran")

        body()
