"""DAGs for the end-to-end tests of leased tasks."""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta

from _util import mark, wait_for  # type: ignore[import-not-found]
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG, task
from psycopg2 import sql

from airflow_lease_provider.operators import LeasedOperator, run_lease

START = datetime(2026, 1, 1)
HOLD = float(os.environ.get("LEASE_TEST_HOLD_SECONDS", "0"))

with DAG("overlap", schedule=None, start_date=START):

    @task.leased(lease_key="overlap-key", lease_ttl=timedelta(seconds=30))
    def hold():
        mark("hold-started")
        if HOLD:
            wait_for("let-go", timeout=HOLD)  # the test lets go once the overlapping run is done
        mark("hold-finished")

    @task
    def after():
        mark("after-ran")

    hold() >> after()


with DAG("zombie", schedule=None, start_date=START):

    @task.leased(lease_key="zombie-key", lease_ttl=timedelta(seconds=4))
    def publish(lease=None):
        mark("zombie-pid", str(os.getpid()))
        mark(f"token-{lease.token}")
        wait_for("go")  # the test freezes this process here, past the TTL, then writes "go"
        with lease.fenced_transaction("zombie.target") as cur:
            table = sql.Identifier(os.environ["AIRFLOW__LEASE__SCHEMA"], "zombie_target")
            cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (writer text, token bigint)").format(table))
            cur.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(table), (lease.owner, lease.token))
        mark(f"published-{lease.token}")

    publish()


with DAG("unreachable", schedule=None, start_date=START):

    @task.leased(lease_key="unreachable-key", lease_ttl=timedelta(seconds=30))
    def body():
        mark("body-ran")

    body()


with DAG("waiter", schedule=None, start_date=START):

    @task.leased(
        lease_key="wait-key",
        lease_ttl=timedelta(seconds=30),
        on_overlap="wait",
        lease_wait_timeout=timedelta(seconds=90),
        lease_poll_interval=timedelta(seconds=1),
    )
    def waited():
        mark("waited-ran")

    waited()


with DAG("mapped_and_bash", schedule=None, start_date=START):

    @task.leased(lease_key="shard-{{ ti.map_index }}", lease_ttl=timedelta(seconds=30))
    def shard(x, lease=None):
        return {"x": x, "key": lease.key, "token": lease.token, "owner": lease.owner}

    LeasedBash = LeasedOperator.wrap(BashOperator)
    bash = LeasedBash(
        task_id="bash",
        bash_command='echo "bash ran under $LEASE_NOTE"',
        env={"LEASE_NOTE": "a lease"},
        lease_key="bash-{{ dag.dag_id }}",
        lease_ttl=timedelta(seconds=30),
    )
    shard.expand(x=[1, 2, 3]) >> bash


with DAG("run_scoped", schedule=None, start_date=START):
    acquire, release = run_lease(lease_key="run-key", lease_ttl=timedelta(seconds=6))

    @task.leased(lease_key="run-key", lease_scope="run", lease_renew_every=timedelta(seconds=1))
    def step(n, lease=None):
        time.sleep(3)  # three of these outlast the 6 s TTL: only their renewals keep the lease
        return {"n": n, "token": lease.token}

    acquire >> step.override(task_id="one")(1) >> step.override(task_id="two")(2) >> step.override(
        task_id="three"
    )(3) >> release


def _report_exception(context):
    """What the task runner reports as the task's error: its type, as a marker for the test."""
    mark("reported-exception", type(context["exception"]).__name__)


for _outcome in ("done", "raise"):
    with DAG(f"release_blocked_{_outcome}", schedule=None, start_date=START):

        @task.leased(
            lease_key=f"release-blocked-{_outcome}", lease_ttl=timedelta(seconds=60),
            on_failure_callback=_report_exception,
        )
        def body(outcome=_outcome):
            mark("body-running")
            wait_for("row-locked")  # the test holds the lease row FOR UPDATE now: the release cannot finish
            if outcome == "raise":
                raise ValueError("the body's own error")
            mark("body-returned")
            return "done"

        body()


# Default keys of ids that read alike (issue 23): each of these is a lease of its own.
with DAG("etl.daily", schedule=None, start_date=START):

    @task.leased(lease_ttl=timedelta(seconds=30))
    def load(lease=None):
        return lease.key

    load()

with DAG("etl", schedule=None, start_date=START):
    from airflow.sdk import TaskGroup

    @task.leased(lease_ttl=timedelta(seconds=30))
    def load(lease=None):  # noqa: F811 - one per DAG, as DAG files do
        return lease.key

    with TaskGroup("daily"):
        load()  # task id daily.load
    load()  # task id load

with DAG("etl.load", schedule=None, start_date=START):
    _acquire, _release = run_lease(lease_ttl=timedelta(seconds=30))
    _acquire >> _release

# The longest ids Airflow takes: a 240-character DAG id and task id make a 518-character owner.
LONG_DAG_ID, LONG_TASK_ID = "d" * 240, "t" * 240
with DAG(LONG_DAG_ID, schedule=None, start_date=START):

    @task.leased(task_id=LONG_TASK_ID, lease_ttl=timedelta(seconds=30))
    def long_ids(lease=None):
        return {"key": lease.key, "owner": lease.owner}

    long_ids()
