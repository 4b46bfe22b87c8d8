"""The SQL fence on a DbApiHook connection other than PostgreSQL (issue 27, item 4), run the way the task
runner runs the operators: SQLite through the sqlite provider's SqliteHook, a real database file.

A leased task's stale token is refused by the fence in the SQLite file and nothing is written; the
refusal is in the lease store's ledger. FencedSQLOperator publishes there under a run lease (the
token on the row, a slot published once). A dialect the fence does not know is refused naming the
connection, and an unreachable file fails closed; no password appears in any message.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_lease_provider.core import (
    EventKind,
    InvalidArgument,
    LeaseStore,
    LeaseStoreUnavailable,
    StaleFencingToken,
)
from airflow_lease_provider.core.dbapi_fence import DbApiFence, UnsupportedDialect
from airflow_lease_provider.operators import AcquireRunLeaseOperator, FencedSQLOperator
from tests.airflow.test_fenced_publish import TTL, lease_env  # noqa: F401 - the fixture
from tests.airflow.test_semantics import RUN, TaskInstance, leased, run_task

pytestmark = pytest.mark.usefixtures("lease_env")

SECRET = "pw-" + uuid.uuid4().hex[:8]


@pytest.fixture
def target_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Connection ``target_sqlite``: a SQLite file with the caller's table ``sales``."""
    path = tmp_path / "warehouse.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE sales (day TEXT PRIMARY KEY, amount INTEGER, token INTEGER)")
    conn.commit()
    conn.close()
    monkeypatch.setenv("AIRFLOW_CONN_TARGET_SQLITE", json.dumps({"conn_type": "sqlite", "host": str(path)}))
    return path


def _rows(path: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT day, amount, token FROM sales ORDER BY day").fetchall()
    finally:
        conn.close()


def _newer_holder_publishes(path: Path, resource: str, key: str, token: int) -> None:
    """Another holder of the key, granted later, publishes to the same file first (the zombie slept)."""
    fence = DbApiFence(lambda: sqlite3.connect(path), dialect="sqlite", where="the newer holder")
    assert fence.advance(resource, token, key=key, owner="etl/newer-run/load").accepted


def test_a_stale_token_is_refused_by_the_fence_in_the_sqlite_file(
    store: LeaseStore, target_file: Path
) -> None:
    def body(lease=None):
        with lease.fenced_transaction("warehouse.sales", conn_id="target_sqlite") as cur:
            cur.execute("INSERT INTO sales VALUES (:day, :amount, :token)", {"day": "d1", "amount": 1, "token": lease.token})
        # Frozen here; meanwhile the lease went to a newer run, which published with token + 1.
        _newer_holder_publishes(target_file, "warehouse.sales", "etl-load", lease.token + 1)
        with lease.fenced_transaction("warehouse.sales", conn_id="target_sqlite") as cur:
            cur.execute("INSERT INTO sales VALUES (:day, :amount, :token)", {"day": "d2", "amount": 2, "token": lease.token})

    with pytest.raises(StaleFencingToken) as info:
        run_task(leased("load", body, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    token = info.value.token
    assert info.value.current == token + 1
    assert _rows(target_file) == [("d1", 1, token)]  # the stale write is not there
    (event,) = store.events.query(kind=EventKind.FENCE_REJECTED)
    assert (event.key, event.token, event.owner) == ("warehouse.sales", token, f"etl/{RUN}/load")
    assert event.detail["current_token"] == token + 1 and event.detail["fence_at"] == "sqlite connection 'target_sqlite'"
    # The fence's tables are in the target file, beside the caller's.
    conn = sqlite3.connect(target_file)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()
    assert tables == {"sales", "lease_fence", "lease_fence_count_epoch", "lease_fence_publish"}


def test_fenced_sql_operator_publishes_a_slot_once_on_sqlite(store: LeaseStore, target_file: Path) -> None:
    publish = FencedSQLOperator(
        task_id="publish",
        resource="warehouse.sales",
        sql="INSERT INTO {table} (day, amount, token) VALUES (:day, :amount, :fencing_token)",
        identifiers={"table": "sales"},
        parameters={"day": "2026-11-29", "amount": 42},
        fence_conn_id="target_sqlite",
        idempotency_key="2026-11-29",
        on_duplicate="skip",
    )
    run_task(AcquireRunLeaseOperator(task_id="acquire_run_lease", lease_ttl=TTL), TaskInstance("etl", RUN, "acquire_run_lease"))
    token = run_task(publish, TaskInstance("etl", RUN, "publish"))
    assert _rows(target_file) == [("2026-11-29", 42, token)]
    from airflow_lease_provider.version_compat import AirflowSkipException

    with pytest.raises(AirflowSkipException, match="already published"):
        run_task(publish, TaskInstance("etl", RUN, "publish", try_number=2))
    assert _rows(target_file) == [("2026-11-29", 42, token)]


def test_an_unknown_dialect_is_refused_naming_the_connection(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_TARGET_MYSQL", f"mysql://etl:{SECRET}@db.example:3306/warehouse")

    def body(lease=None):
        with lease.fenced_transaction("warehouse.sales", conn_id="target_mysql"):
            pytest.fail("the block ran")

    with pytest.raises(UnsupportedDialect) as info:
        run_task(leased("load", body, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    message = str(info.value)
    assert "fence_conn_id" in message and "'target_mysql'" in message and "'mysql'" in message
    assert "postgres, sqlite" in message and SECRET not in message


def test_a_missing_connection_and_a_non_sql_one_are_named(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_TARGET_HTTP", json.dumps({"conn_type": "http", "host": "x", "password": SECRET}))
    for conn_id, expected in [("target_http", "'http'"), ("no_such_conn", "not defined")]:

        def body(lease=None, conn_id=conn_id):
            lease.fence("warehouse.files", conn_id=conn_id)

        with pytest.raises((InvalidArgument, LeaseStoreUnavailable)) as info:
            run_task(leased("load", body, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
        assert conn_id in str(info.value) and expected in str(info.value) and SECRET not in str(info.value)


def test_an_unreachable_sqlite_target_fails_closed(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gone = tmp_path / "no-such-dir" / "warehouse.db"
    monkeypatch.setenv("AIRFLOW_CONN_TARGET_SQLITE", json.dumps({"conn_type": "sqlite", "host": str(gone)}))
    ran: list[int] = []

    def body(lease=None):
        with lease.fenced_transaction("warehouse.sales", conn_id="target_sqlite"):
            ran.append(lease.token)

    with pytest.raises(LeaseStoreUnavailable, match="target_sqlite.*fails closed"):
        run_task(leased("load", body, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    assert ran == [] and not gone.parent.exists()


def test_a_task_keyed_by_its_outlets_publishes_each_asset_under_its_own_lease(
    store: LeaseStore, target_file: Path
) -> None:
    """``asset=`` on the publish methods: the fence sees that asset's key and token, not the first key's."""
    from airflow.sdk import Asset

    from airflow_lease_provider.assets import asset_lease_key

    daily, summary = Asset("daily", uri="s3://lake/daily"), Asset("summary", uri="s3://lake/summary")

    def body(lease=None):
        with lease.fenced_transaction("warehouse.sales", conn_id="target_sqlite", asset=summary) as cur:
            cur.execute("INSERT INTO sales VALUES (:day, :amount, :token)",
                        {"day": "d1", "amount": 1, "token": lease.for_asset(summary).token})
        lease.fence("warehouse.files", conn_id="target_sqlite", asset=daily)
        return {a.name: lease.for_asset(a).token for a in (daily, summary)}

    tokens = run_task(leased("load", body, lease_on="outlets", outlets=[daily, summary]), TaskInstance("etl", RUN, "load"))
    conn = sqlite3.connect(target_file)
    fenced = set(conn.execute("SELECT resource, lease_key, token FROM lease_fence").fetchall())
    conn.close()
    assert fenced == {
        ("warehouse.sales", asset_lease_key(summary.uri), tokens["summary"]),
        ("warehouse.files", asset_lease_key(daily.uri), tokens["daily"]),
    }


def test_asset_that_is_not_an_outlet_of_the_task_is_named(store: LeaseStore, target_file: Path) -> None:
    """``asset=``: a value that is no asset, or an asset the task holds no lease for, is an error naming
    ``asset`` and the leases the task holds, before anything is written."""
    from airflow.sdk import Asset

    from airflow_lease_provider.core import InvalidArgument

    daily, other = Asset("daily", uri="s3://lake/daily"), Asset("other", uri="s3://lake/other")
    seen: dict[str, str] = {}

    def body(lease=None):
        for name, asset in (("string", "s3://lake/daily"), ("not an outlet", other)):
            with pytest.raises(InvalidArgument) as bad:
                lease.fence("warehouse.files", conn_id="target_sqlite", asset=asset)
            seen[name] = str(bad.value)

    run_task(leased("load", body, lease_on="outlets", outlets=[daily]), TaskInstance("etl", RUN, "load"))
    assert seen["string"].startswith("asset=") and "Asset" in seen["string"], seen
    assert seen["not an outlet"].startswith("asset=") and "s3://lake/daily" in seen["not an outlet"], seen
