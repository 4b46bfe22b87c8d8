"""The asset-keyed lease examples under a real scheduler and dag-processor.

``dags_examples/asset_lease.py``: the producer's asset events carry its lease token (read back over REST),
the asset triggers the consumer, and the consumer's staleness check tells a superseded token from a
current one.

``dags_examples/asset_partition_s3.py`` (same deployment): a partitioned run publishes its partition of
an asset to S3 (a real moto_server process, tests/s3.py) under the asset's per-partition lease, fenced by
the object store; the partition's consumer run checks the token; a second run of the partition supersedes
the first, whose token the object store then refuses.

``tests/deployment/dags/sqlite_fence.py`` (same deployment): a leased task's write to a SQLite file through
the SQL fence, in a real task process (the SDK's connection and hook lookup): published with its token,
then refused when a newer holder's token is already in the file's fence.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_lease_provider.assets import asset_lease_key, is_stale
from airflow_lease_provider.core import EventKind, LeaseStore, StaleFencingToken
from airflow_lease_provider.core.dbapi_fence import DbApiFence
from airflow_lease_provider.fences.s3 import ObjectFence
from demo.airflow_api import wait
from demo.deployment import EXAMPLES, Deployment, MetadataTemplate
from tests.deployment.conftest import deployment_for
from tests.s3 import ACCESS_KEY, REGION, SECRET_KEY, MotoServer

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

DAGS = {"sales_publisher", "sales_backfill", "sales_report"}
LAKE_DAGS = {"lake_orders_publisher", "lake_orders_report"}
SQLITE_DAG = "sqlite_fence_load"
SQLITE_DAG_FILE = Path(__file__).parent / "dags" / "sqlite_fence.py"
DAILY = asset_lease_key("s3://example-lake/sales/daily")


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SQLite file behind connection ``warehouse_sqlite``, with the caller's table ``sales``."""
    path = tmp_path_factory.mktemp("warehouse") / "warehouse.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE sales (run_id TEXT, token INTEGER)")
    conn.commit()
    conn.close()
    return path


@pytest.fixture(scope="module")
def airflow(metadata_template: MetadataTemplate, moto: MotoServer, warehouse: Path) -> Iterator[Deployment]:
    lake = moto.bucket()
    env = {
        "AIRFLOW_CONN_WAREHOUSE_SQLITE": json.dumps({"conn_type": "sqlite", "host": str(warehouse)}),
        "AIRFLOW_CONN_LAKE_S3": json.dumps({
            "conn_type": "aws", "login": ACCESS_KEY, "password": SECRET_KEY,
            "extra": {"endpoint_url": moto.url, "region_name": REGION},
        }),
        "LAKE_BUCKET": lake,
    }
    files = [EXAMPLES / "asset_lease.py", EXAMPLES / "asset_partition_s3.py", SQLITE_DAG_FILE]
    with deployment_for(metadata_template, files, DAGS | LAKE_DAGS | {SQLITE_DAG}, env) as deployment:
        for dag_id in DAGS | LAKE_DAGS | {SQLITE_DAG}:
            deployment.api.unpause(dag_id)
        yield deployment


def events_of(airflow: Deployment, dag_id: str) -> list[dict]:
    """The asset events ``dag_id``'s runs emitted. Read only once every run they triggered has started:
    while one is queued (no start date yet) Airflow 3.3 answers this request with a 500 (its response
    model, ``DagRunAssetReference``, requires a ``start_date``), a red run of this suite in five."""
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
    # The asset triggers the consumer (its events are read once that run has started: events_of) ...
    wait(lambda: [r for r in report_runs(airflow) if r["state"] in ("success", "failed")], bool, 240,
         "the consumer's first run")
    published = {e["asset_id"]: e for e in events_of(airflow, "sales_publisher")}
    assert len(published) == 2
    by_key = {e["extra"]["lease"]["key"]: e["extra"]["lease"] for e in published.values()}
    assert DAILY in by_key and by_key[DAILY]["owner"].startswith(f"sales_publisher/{run_id}/")
    first_token = by_key[DAILY]["token"]

    # ... which found the event current.
    first_report = report_runs(airflow)[0]
    assert first_report["state"] == "success"
    assert airflow.api.xcom("sales_report", first_report["dag_run_id"], "report") == {
        "fresh": [first_token], "stale": []
    }

    # Another DAG writes the same asset: a newer token of the same key, so the first event is stale now.
    other = airflow.api.trigger("sales_backfill")
    assert airflow.api.wait_for_run("sales_backfill", other, timeout=240) == "success"
    wait(lambda: report_runs(airflow), lambda runs: len(runs) >= 2 and all(r["state"] != "queued" for r in runs),
         240, "the consumer's run the rewrite triggered to start")
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


def _lake_runs(airflow: Deployment, dag_id: str) -> list[dict]:
    reply = airflow.api.get(f"/dags/{dag_id}/dagRuns", params={"limit": 100, "order_by": "run_after"})
    return list(reply["dag_runs"])


def _publish_partition(airflow: Deployment, partition: str) -> str:
    body = {"logical_date": None, "partition_key": partition, "conf": {}}
    run_id = str(airflow.api.request("POST", "/dags/lake_orders_publisher/dagRuns", json=body)["dag_run_id"])
    assert airflow.api.wait_for_run("lake_orders_publisher", run_id, timeout=240) == "success"
    return run_id


def _report_of(airflow: Deployment, partition: str, count: int) -> list[dict]:
    """The consumer's finished runs of ``partition`` once there are ``count``: their reports, oldest first."""

    def finished() -> list[dict]:
        runs = [r for r in _lake_runs(airflow, "lake_orders_report") if r.get("partition_key") == partition]
        return [r for r in runs if r["state"] in ("success", "failed")]

    runs = wait(finished, lambda rs: len(rs) >= count, 240, f"{count} consumer run(s) of partition {partition}")
    assert [r["state"] for r in runs] == ["success"] * len(runs)
    return [airflow.api.xcom("lake_orders_report", r["dag_run_id"], "check_orders") for r in runs]


def test_a_partition_published_to_s3_under_the_assets_lease_and_checked_by_the_consumer(
    airflow: Deployment, moto: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    partition = "2026-11-29"
    key = asset_lease_key("s3://example-lake/orders", partition)
    bucket, object_key = airflow.env["LAKE_BUCKET"], f"orders/{partition}/orders.csv"
    first_run = _publish_partition(airflow, partition)
    # The partition's consumer run, finished (the events are read once the runs they triggered started).
    [report] = _report_of(airflow, partition, 1)

    # The asset event carries the partition's lease; the object carries the same token in its metadata.
    [event] = [e for e in events_of(airflow, "lake_orders_publisher") if e["source_run_id"] == first_run]
    assert event["partition_key"] == partition
    lease = event["extra"]["lease"]
    assert lease["key"] == key and lease["partition_key"] == partition
    first = ObjectFence(moto.client()).read(bucket, object_key)
    assert first is not None and first.token == lease["token"] and first.lease_key == key
    assert first.body is not None and first_run.encode() in first.body

    # The consumer found the event current, and the object holding its token.
    assert report == {"partition": partition, "fresh": [lease["token"]], "stale": [], "object_token": lease["token"]}

    # A second run of the partition publishes with a newer token of the same key ...
    second_run = _publish_partition(airflow, partition)
    reports = _report_of(airflow, partition, 2)
    [newer] = [e for e in events_of(airflow, "lake_orders_publisher") if e["source_run_id"] == second_run]
    assert newer["extra"]["lease"]["key"] == key and newer["extra"]["lease"]["token"] > lease["token"]
    assert reports[-1]["fresh"] == [newer["extra"]["lease"]["token"]]
    assert reports[-1]["object_token"] == newer["extra"]["lease"]["token"]
    # ... so the first event is stale now, and the object store itself refuses the first token.
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", airflow.env["AIRFLOW_CONN_LEASE_DEFAULT"])
    if "AIRFLOW__LEASE__SCHEMA" in airflow.env:
        monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", airflow.env["AIRFLOW__LEASE__SCHEMA"])
    assert is_stale(SimpleNamespace(extra=event["extra"]))
    assert not is_stale(SimpleNamespace(extra=newer["extra"]))
    with pytest.raises(StaleFencingToken):
        ObjectFence(moto.client()).put(
            bucket, object_key, b"zombie", token=lease["token"], lease_key=key, owner=lease["owner"],
        )
    kept = ObjectFence(moto.client()).read(bucket, object_key)
    assert kept is not None and kept.token == newer["extra"]["lease"]["token"] and second_run.encode() in kept.body


def test_a_leased_tasks_sqlite_write_is_fenced_in_a_real_task_process(airflow: Deployment, warehouse: Path) -> None:
    run_id = airflow.api.trigger(SQLITE_DAG)
    assert airflow.api.wait_for_run(SQLITE_DAG, run_id, timeout=240) == "success"
    token = airflow.api.xcom(SQLITE_DAG, run_id, "load")
    conn = sqlite3.connect(warehouse)
    assert conn.execute("SELECT run_id, token FROM sales").fetchall() == [(run_id, token)]
    conn.close()

    # A newer holder of the key (another deployment's run, say) has published to the file since.
    newer = DbApiFence(lambda: sqlite3.connect(warehouse), dialect="sqlite", where="the newer holder")
    assert newer.advance("warehouse.sales", token + 100, key="warehouse-load", owner="elsewhere/run/load").accepted
    stale = airflow.api.trigger(SQLITE_DAG)
    assert airflow.api.wait_for_run(SQLITE_DAG, stale, timeout=240) == "failed"
    conn = sqlite3.connect(warehouse)
    assert conn.execute("SELECT run_id, token FROM sales").fetchall() == [(run_id, token)]  # nothing written
    conn.close()
    with LeaseStore(airflow.dsn) as store:
        refused = [e for e in store.events.query(kind=EventKind.FENCE_REJECTED) if e.key == "warehouse.sales"]
    assert len(refused) == 1 and refused[0].owner == f"{SQLITE_DAG}/{stale}/load"
    assert refused[0].token > token and refused[0].detail["current_token"] == token + 100
    assert refused[0].detail["fence_at"] == "sqlite connection 'warehouse_sqlite'"
