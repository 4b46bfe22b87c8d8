"""The asset-keyed lease example (``dags_examples/asset_lease.py``) under a real scheduler and
dag-processor: the producer's asset events carry its lease token (read back over REST), the asset
triggers the consumer, and the consumer's staleness check tells a superseded token from a current one.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from airflow_lease_provider.assets import asset_lease_key, is_stale
from airflow_lease_provider.core import LeaseStore
from demo.airflow_api import wait
from demo.deployment import EXAMPLES, Deployment, MetadataTemplate
from tests.deployment.conftest import deployment_for

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

DAGS = {"sales_publisher", "sales_backfill", "sales_report"}
DAILY = asset_lease_key("s3://example-lake/sales/daily")


@pytest.fixture(scope="module")
def airflow(metadata_template: MetadataTemplate) -> Iterator[Deployment]:
    with deployment_for(metadata_template, [EXAMPLES / "asset_lease.py"], DAGS) as deployment:
        for dag_id in DAGS:
            deployment.api.unpause(dag_id)
        yield deployment


def events_of(airflow: Deployment, dag_id: str) -> list[dict]:
    reply = airflow.api.get("/assets/events", params={"source_dag_id": dag_id, "limit": 100})
    return list(reply["asset_events"])


def report_runs(airflow: Deployment) -> list[dict]:
    reply = airflow.api.get("/dags/sales_report/dagRuns", params={"limit": 100, "order_by": "run_after"})
    return list(reply["dag_runs"])


def test_the_token_on_the_asset_event_and_the_consumers_staleness_check(
    airflow: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = airflow.api.trigger("sales_publisher")
    assert airflow.api.wait_for_run("sales_publisher", run_id, timeout=240) == "success"
    published = {e["asset_id"]: e for e in events_of(airflow, "sales_publisher")}
    assert len(published) == 2
    by_key = {e["extra"]["lease"]["key"]: e["extra"]["lease"] for e in published.values()}
    assert DAILY in by_key and by_key[DAILY]["owner"].startswith(f"sales_publisher/{run_id}/")
    first_token = by_key[DAILY]["token"]

    # The asset triggers the consumer, which finds the event current.
    wait(lambda: [r for r in report_runs(airflow) if r["state"] in ("success", "failed")], bool, 240,
         "the consumer's first run")
    first_report = report_runs(airflow)[0]
    assert first_report["state"] == "success"
    assert airflow.api.xcom("sales_report", first_report["dag_run_id"], "report") == {
        "fresh": [first_token], "stale": []
    }

    # Another DAG writes the same asset: a newer token of the same key, so the first event is stale now.
    other = airflow.api.trigger("sales_backfill")
    assert airflow.api.wait_for_run("sales_backfill", other, timeout=240) == "success"
    [rewritten] = events_of(airflow, "sales_backfill")
    assert rewritten["extra"]["lease"]["key"] == DAILY and rewritten["extra"]["lease"]["token"] > first_token
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", airflow.env["AIRFLOW_CONN_LEASE_DEFAULT"])
    if "AIRFLOW__LEASE__SCHEMA" in airflow.env:
        monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", airflow.env["AIRFLOW__LEASE__SCHEMA"])
    event = next(e for e in published.values() if e["extra"]["lease"]["key"] == DAILY)
    assert is_stale(SimpleNamespace(extra=event["extra"]))
    assert not is_stale(SimpleNamespace(extra=rewritten["extra"]))
    with LeaseStore(airflow.dsn) as store:
        assert store.holder(DAILY) is None
