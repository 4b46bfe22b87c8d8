"""Asset-keyed leases: two producers of one asset exclude each other, and a consumer checks the token.

What each piece is for:

- ``@task.leased(lease_on="outlets", outlets=[DAILY_SALES, SALES_SUMMARY])``: the lease is taken on the
  task's asset outlets, not on a hand-written key. Its key is the asset's (``asset:<uri>``, per partition
  in a partitioned run), so any task of any DAG that writes ``daily_sales`` excludes this one: here
  ``sales_backfill`` writes the same asset and is **skipped** while ``sales_publisher`` holds it (naming
  the holder). Two outlets: both leases are taken in sorted key order, all or nothing.
- The asset events: each carries its lease in ``extra["lease"]`` (key, token, owner, store), visible in
  Airflow's asset views and handed to the consumer in ``triggering_asset_events``.
- ``sales_report`` (scheduled on ``daily_sales``): ``is_stale(event)`` asks the lease store whether a
  newer token of that key was issued since, or a fence refused the producer's token; a stale event is
  skipped, a current one is reported.

``lease.for_asset(asset)`` is the lease of one asset (fence and publish what you write to that asset with
its token); ``lease`` itself is the first key's in sorted order.

Connections: ``lease_default`` (the lease store).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Asset, task

from airflow_lease_provider.assets import carries_lease, staleness

log = logging.getLogger(__name__)

DAILY_SALES = Asset("daily_sales", uri="s3://example-lake/sales/daily")
SALES_SUMMARY = Asset("sales_summary", uri="s3://example-lake/sales/summary")
START = pendulum.datetime(2026, 1, 1, tz="UTC")

with DAG("sales_publisher", schedule=None, start_date=START, catchup=False, tags=["lease", "example"]):

    @task.leased(lease_on="outlets", outlets=[DAILY_SALES, SALES_SUMMARY], lease_ttl=timedelta(minutes=20))
    def publish(lease=None):
        # Write the data here, e.g. lease.for_asset(DAILY_SALES).fenced_put(bucket, key, body) (the "s3" extra).
        daily = lease.for_asset(DAILY_SALES)
        log.info("publishing daily_sales under %s token %s", daily.key, daily.token)
        return {"daily_sales": daily.token, "sales_summary": lease.for_asset(SALES_SUMMARY).token}

    publish()

with DAG("sales_backfill", schedule=None, start_date=START, catchup=False, tags=["lease", "example"]):

    @task.leased(lease_on="outlets", outlets=[DAILY_SALES], lease_ttl=timedelta(minutes=20))
    def rewrite(lease=None):
        log.info("rewriting daily_sales under token %s", lease.token)

    rewrite()

with DAG("sales_report", schedule=[DAILY_SALES], start_date=START, catchup=False, tags=["lease", "example"]):

    @task
    def report(triggering_asset_events=None):
        fresh, stale = [], []
        for events in (triggering_asset_events or {}).values():
            for event in events:
                if not carries_lease(event):
                    continue  # not published by a leased task
                answer = staleness(event)
                (stale if answer.stale else fresh).append(answer)
                log.info("event %s: %s", answer.lease, answer.reason or "current")
        return {"fresh": [a.lease.token for a in fresh if a.lease], "stale": [a.lease.token for a in stale if a.lease]}

    report()
