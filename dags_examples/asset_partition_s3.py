"""A partitioned asset published to S3 under a lease keyed by the asset, fenced by the object store.

What each piece is for:

- ``lake_orders_publisher`` (``schedule=PartitionedAtRuntime()``: each run is given its partition key,
  e.g. ``POST /dags/lake_orders_publisher/dagRuns {"partition_key": "2026-11-29"}``). Its task is
  ``@task.leased(lease_on="outlets")``: the lease key is the asset's **per partition**
  (``asset:s3://example-lake/orders#2026-11-29``), so two runs writing the same partition exclude each
  other, and runs of two partitions do not.
- ``lease.for_asset(LAKE_ORDERS).fenced_put(...)``: the object ``orders/<partition>/orders.csv`` is written
  with a compare-and-swap on its ETag, carrying the token in its metadata. The object store itself refuses
  a write whose token is older than the one already there (a writer frozen past its lease, resumed after
  a newer run published): ``StaleFencingToken``, and the object keeps the newer content.
- The asset event carries the lease (``extra["lease"]``: key, token, owner, partition_key).
- ``lake_orders_report`` (``schedule=PartitionedAssetTimetable(assets=LAKE_ORDERS)``: one run per
  partition published) checks each triggering event with ``is_stale(event)`` and reads the object's
  current token: it reports the partition's fresh and stale tokens.

Connections: ``lease_default`` (the lease store) and ``lake_s3`` (an AWS connection; for an
S3-compatible store put ``endpoint_url`` in its extra). The bucket is ``$LAKE_BUCKET`` (default
``example-lake``). Needs the ``s3`` extra and ``PartitionedAtRuntime`` / ``PartitionedAssetTimetable`` in
``airflow.sdk`` (partitioned assets came in Airflow 3.2; this example is run on 3.3): where they are
missing, this file defines no DAG.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Asset, task

from airflow_lease_provider.assets import carries_lease, staleness

try:  # partitioned assets (tested on Airflow 3.3)
    from airflow.sdk import PartitionedAssetTimetable, PartitionedAtRuntime
except ImportError:  # pragma: no cover - older Airflow: no DAG here
    PartitionedAssetTimetable = PartitionedAtRuntime = None

log = logging.getLogger(__name__)

LAKE_ORDERS = Asset("lake_orders", uri="s3://example-lake/orders")
AWS_CONN_ID = "lake_s3"
START = pendulum.datetime(2026, 1, 1, tz="UTC")


def bucket() -> str:
    return os.environ.get("LAKE_BUCKET", "example-lake")


def object_key(partition_key: str) -> str:
    return f"orders/{partition_key}/orders.csv"


if PartitionedAtRuntime is not None:
    with DAG(
        "lake_orders_publisher", schedule=PartitionedAtRuntime(), start_date=START, catchup=False,
        tags=["lease", "example"],
    ):

        @task.leased(lease_on="outlets", outlets=[LAKE_ORDERS], lease_ttl=timedelta(minutes=20))
        def publish_orders(lease=None, partition_key=None, run_id=None):
            orders = lease.for_asset(LAKE_ORDERS)  # this partition's lease of the asset
            body = f"partition,run,token\n{partition_key},{run_id},{orders.token}\n"
            published = orders.fenced_put(bucket(), object_key(partition_key), body, aws_conn_id=AWS_CONN_ID)
            log.info("published %s under %s token %s", published.resource, orders.key, orders.token)
            return {"key": orders.key, "token": orders.token, "etag": published.etag}

        publish_orders()

    with DAG(
        "lake_orders_report", schedule=PartitionedAssetTimetable(assets=LAKE_ORDERS), start_date=START,
        catchup=False, tags=["lease", "example"],
    ):

        @task
        def check_orders(triggering_asset_events=None, partition_key=None):
            from airflow_lease_provider.hooks.s3_fence import S3FenceHook

            fresh, stale = [], []
            for events in (triggering_asset_events or {}).values():
                for event in events:
                    if not carries_lease(event):
                        continue  # not published by a leased task
                    answer = staleness(event)
                    (stale if answer.stale else fresh).append(answer.lease.token if answer.lease else None)
                    log.info("event %s: %s", answer.lease, answer.reason or "current")
            current = S3FenceHook(AWS_CONN_ID).read(bucket(), object_key(partition_key), body=False)
            return {
                "partition": partition_key, "fresh": fresh, "stale": stale,
                "object_token": current.token if current else None,
            }

        check_orders()
