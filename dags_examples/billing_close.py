"""Billing close: an irreversible job. Every hour, close the hour's invoices, exactly once per slot.

Unlike an article, a missed billing hour still has to be closed, so after downtime the newest
``max_backfill=24`` slots run (older ones are skipped, recorded and counted, for a person to look at).
Each slot's publish carries an idempotency key from ``slot_idempotency_key("billing_close", context)``
(the data interval's start), so a retried or re-run slot is never billed twice, whatever its token: a
cleared re-run of a closed slot ends with ``publish_invoices`` **skipped** (``on_duplicate="skip"``),
nothing written. A manual run without a logical date (the Airflow 3 default) has no slot; it is keyed
by its run id, so it bills once however often it is cleared. To re-close a given hour, trigger a run with
that logical date, or backfill it. The key is computed once, in ``collect_usage``, and reaches the
publish through XCom: no template refers to ``data_interval_start``, which a run without a logical date
does not have.

The whole run holds one **run lease**: ``acquire_run_lease`` (a setup task) takes it,
``release_run_lease`` (a teardown task) always gives it back, and the tasks in between renew it while
they run. An overlapping run is skipped as a whole: its setup task is skipped, and so is everything
after it.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param, task

from airflow_lease_provider.operators import FencedSQLOperator, run_lease
from airflow_lease_provider.timetables import CappedCatchupTimetable, slot_idempotency_key

# Where the invoices table lives (in the lease store's database unless a billing_db connection exists).
BILLING_SCHEMA = os.environ.get("LEASE_EXAMPLES_SCHEMA", "public")

# [START billing_close]
with DAG(
    dag_id="billing_close",
    schedule=CappedCatchupTimetable("0 * * * *", max_backfill=24, catchup_window=timedelta(days=2)),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=True,
    max_active_runs=1,
    params={"work_seconds": Param(1, type="integer", minimum=0)},
    tags=["lease-example"],
):
    acquire, release = run_lease(lease_key="billing-close", lease_ttl=timedelta(minutes=30))

    @task.leased(lease_key="billing-close", lease_scope="run")  # renews the run's lease while it runs
    def collect_usage(params=None, **context):
        time.sleep(params["work_seconds"])
        return {"slot": slot_idempotency_key("billing_close", context), "units": 42}

    @task.leased(lease_key="billing-close", lease_scope="run")
    def price(usage):
        return {**usage, "amount_cents": usage["units"] * 25}

    publish = FencedSQLOperator(
        task_id="publish_invoices",
        resource="billing.invoices",
        lease_key="billing-close",
        idempotency_key="{{ ti.xcom_pull(task_ids='price')['slot'] }}",
        on_duplicate="skip",  # a cleared re-run of a closed slot writes nothing and says so
        sql=[
            "CREATE TABLE IF NOT EXISTS {invoices} "
            "(slot text PRIMARY KEY, amount_cents bigint NOT NULL, token bigint NOT NULL)",
            "INSERT INTO {invoices} (slot, amount_cents, token) "
            "VALUES (%(slot)s, %(amount)s, %(fencing_token)s)",
        ],
        identifiers={"invoices": [BILLING_SCHEMA, "example_invoices"]},
        fence_conn_id="billing_db" if os.environ.get("AIRFLOW_CONN_BILLING_DB") else None,
        parameters={
            "slot": "{{ ti.xcom_pull(task_ids='price')['slot'] }}",
            "amount": "{{ ti.xcom_pull(task_ids='price')['amount_cents'] }}",
        },
    )

    usage = collect_usage()
    acquire >> usage  # every task of the run comes after the setup task that takes the lease
    price(usage) >> publish >> release
# [END billing_close]
