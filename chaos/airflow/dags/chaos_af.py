"""The DAGs of the Airflow-level fault run (``python -m chaos --airflow``): leased, fenced, short TTLs.

Read by a real dag-processor and run by a real scheduler (LocalExecutor, or CeleryExecutor with two
workers). The run's harness passes its settings through the environment (``CHAOS_AF_*``). Every body
records itself in the history schema by the database clock (``clock_timestamp()``, through a direct
connection that the nemesis never cuts) and publishes through the fence to ``<schema>.target``, which
lives in the store's database, so the target row commits in the fence's transaction.

- ``chaos_pair``: two tasks of one run sharing one lease key (one of them skips), every ``EVERY``;
- ``chaos_mapped``: three mapped instances, each with its own key (the default key per map index),
  every 2/3 ``EVERY``;
- ``chaos_catchup``: the capped catch-up timetable (``max_backfill=2``), every 4/3 ``EVERY``: a
  scheduler that was down catches up two slots.

``CHAOS_AF_VARIANT``: ``correct``; ``lease-off`` (broken: plain ``@task``, no lease, no fence);
``unfenced`` (broken: the lease is taken but the publish skips the fence).
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg2
from airflow.sdk import DAG, task
from psycopg2 import sql

from airflow_lease_provider.core import DuplicatePublish, LeaseLost, LeaseStoreUnavailable, StaleFencingToken
from airflow_lease_provider.timetables import CappedCatchupTimetable, slot_idempotency_key

HISTORY_DSN = os.environ.get("CHAOS_AF_HISTORY_DSN", "")
SCHEMA = os.environ.get("CHAOS_AF_SCHEMA", "chaos_af")
VARIANT = os.environ.get("CHAOS_AF_VARIANT", "correct")
TTL = timedelta(seconds=float(os.environ.get("CHAOS_AF_TTL", "8")))
EVERY = timedelta(seconds=float(os.environ.get("CHAOS_AF_EVERY", "15")))
#: The DAGs' schedule intervals (staggered so that some body is running most of the time).
INTERVALS = {"chaos_pair": EVERY, "chaos_mapped": EVERY * 2 / 3, "chaos_catchup": EVERY * 4 / 3}
WORK = float(os.environ.get("CHAOS_AF_WORK", "3"))
START = datetime.fromtimestamp(float(os.environ.get("CHAOS_AF_START", "1764547200")), tz=timezone.utc)
RETRIES = {"retries": 2, "retry_delay": timedelta(seconds=2)}

BODIES = sql.Identifier(SCHEMA, "bodies")
TARGET = sql.Identifier(SCHEMA, "target")


def _history() -> Any:
    conn = psycopg2.connect(HISTORY_DSN, application_name="chaos-history", connect_timeout=10)
    conn.autocommit = True
    return conn


def _begin(resource: str, key: str, slot: str, token: int | None, context: dict[str, Any]) -> int:
    ti = context["ti"]
    conn = _history()
    try:
        with conn.cursor() as cur:
            cur.execute(
                sql.SQL(
                    "INSERT INTO {} (dag_id, run_id, task_id, map_index, try_number, key, resource, slot, token, pid)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id"
                ).format(BODIES),
                (ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number, key, resource, slot, token, os.getpid()),
            )
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def _end(body: int, outcome: str) -> None:
    conn = _history()
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("UPDATE {} SET ended_at = clock_timestamp(), outcome = %s WHERE id = %s").format(BODIES),
                        (outcome, body))
    finally:
        conn.close()


def _insert(cur: Any, body: int, resource: str, key: str, slot: str, token: int | None) -> None:
    cur.execute(sql.SQL("INSERT INTO {} (body, resource, key, slot, token) VALUES (%s, %s, %s, %s, %s)").format(TARGET),
                (body, resource, key, slot, token))


def body(resource: str, key: str, lease: Any, context: dict[str, Any]) -> dict[str, Any]:
    """Work for ``WORK`` seconds under the lease, then publish the run's slot through the fence."""
    slot = slot_idempotency_key(resource, context)
    token = lease.token if lease is not None else None
    me = _begin(resource, key, slot, token, context)
    outcome = "interrupted"
    try:
        deadline = time.monotonic() + WORK
        while time.monotonic() < deadline:  # short sleeps: the keeper's LeaseLost lands promptly
            time.sleep(0.1)
        if lease is None or VARIANT == "unfenced":
            conn = _history()
            try:
                with conn.cursor() as cur:
                    _insert(cur, me, resource, key, slot, token)
            finally:
                conn.close()
        else:
            with lease.fenced_transaction(resource, idempotency_key=slot) as cur:
                _insert(cur, me, resource, key, slot, token)
        outcome = "accepted"
        return {"token": token, "slot": slot}
    except DuplicatePublish:
        outcome = "refused:duplicate"
        raise
    except StaleFencingToken:
        outcome = "refused:stale"
        raise
    except LeaseLost:
        outcome = "lost"
        raise
    except LeaseStoreUnavailable:
        outcome = "store-unavailable"
        raise
    except BaseException as error:
        outcome = f"error:{type(error).__name__}"
        raise
    finally:
        _end(me, outcome)


def leased(**kwargs: Any) -> Any:
    """``@task.leased(...)``, or for the ``lease-off`` variant a plain ``@task`` (no lease, no fence)."""
    if VARIANT == "lease-off":
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith("lease_") and k != "on_overlap"}
        return task(**kwargs)
    return task.leased(lease_ttl=TTL, on_overlap="skip", **kwargs)


with DAG("chaos_pair", schedule=INTERVALS["chaos_pair"], start_date=START, catchup=False, max_active_runs=3, tags=["chaos"]):

    @leased(task_id="writer_a", lease_key="chaos-pair", **RETRIES)
    def writer_a(lease: Any = None, **context: Any) -> dict[str, Any]:
        return body("chaos.pair", "chaos-pair", lease, context)

    @leased(task_id="writer_b", lease_key="chaos-pair", **RETRIES)
    def writer_b(lease: Any = None, **context: Any) -> dict[str, Any]:
        return body("chaos.pair", "chaos-pair", lease, context)

    writer_a()
    writer_b()


with DAG("chaos_mapped", schedule=INTERVALS["chaos_mapped"], start_date=START, catchup=False, max_active_runs=3, tags=["chaos"]):

    @leased(**RETRIES)
    def part(index: int, lease: Any = None, **context: Any) -> dict[str, Any]:
        key = lease.key if lease is not None else f"chaos_mapped.part[{index}]"
        return body(f"chaos.mapped[{index}]", key, lease, context)

    part.expand(index=[0, 1, 2])


with DAG("chaos_catchup", schedule=CappedCatchupTimetable(INTERVALS["chaos_catchup"], max_backfill=2), start_date=START,
         catchup=True, max_active_runs=1, tags=["chaos"]):

    @leased(lease_key="chaos-catchup", **RETRIES)
    def publish(lease: Any = None, **context: Any) -> dict[str, Any]:
        return body("chaos.catchup", "chaos-catchup", lease, context)

    publish()
