"""Leases keyed by asset and the lease on asset events (issue 27 items 1, 2), through real Airflow.

Two DAGs writing one asset under ``airflow dags test`` (two deployments sharing one lease store): the
second is skipped while the first holds, naming it; the events each writes carry its lease key and token
in their ``extra`` in Airflow's metadata database, and :func:`airflow_lease_provider.assets.is_stale`
tells an event superseded by a newer token from a current one.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_lease_provider.assets import asset_lease_key, is_stale, staleness
from airflow_lease_provider.core import EventKind, LeaseStore

pytestmark = pytest.mark.airflow

DAGS = Path(__file__).parent / "asset_dags"
SHARED = asset_lease_key("postgres://warehouse/public/shared")
OTHER = asset_lease_key("postgres://warehouse/public/other")


def wait_for(path: Path, proc, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path.name} appeared"
        assert time.monotonic() < end, f"timed out waiting for {path.name}"
        time.sleep(0.2)


def asset_events(home) -> list[dict]:
    """Every asset event in the home's metadata database: asset name, uri, extra, source dag."""
    conn = sqlite3.connect(home.path / "airflow.db")
    try:
        rows = conn.execute(
            "SELECT a.name, a.uri, e.extra, e.source_dag_id FROM asset_event e JOIN asset a ON a.id = e.asset_id "
            "ORDER BY e.id"
        ).fetchall()
    finally:
        conn.close()
    return [
        {"name": n, "uri": u, "extra": json.loads(x) if isinstance(x, str) else x, "dag_id": d} for n, u, x, d in rows
    ]


def test_two_dags_writing_one_asset_exclude_each_other_and_events_carry_the_token(
    airflow_home, store: LeaseStore, tmp_path: Path, pg_dsn: str, schema: str, monkeypatch
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"LEASE_TEST_MARKERS": str(marks)}
    home_a = airflow_home("a", dags=DAGS, statsd=False, extra_env=env)
    home_b = airflow_home("b", dags=DAGS, statsd=False, extra_env=env)

    first = home_a.dags_test_background("writer_a")
    wait_for(marks / "holding", first)
    holder = store.holder(SHARED)
    assert holder is not None and holder.owner.startswith("writer_a/")

    # writer_b's two runs in one process (Airflow starts once), the second once writer_a has finished.
    writer_a_done = tmp_path / "writer_a_done"
    runs_b = home_b.dags_test_many_background(["writer_b", writer_a_done, "writer_b"])
    second = runs_b.result(0)  # while writer_a holds the shared asset's lease
    assert second.returncode == 0, second.stderr[-3000:]
    assert not (marks / "b_ran").exists(), "writer_b ran while writer_a held the shared asset"
    assert home_b.task_states() == {("write", -1): "skipped"}
    skipped = store.events.query(key=SHARED, kind=EventKind.SKIPPED_OVERLAP)
    assert skipped and skipped[0].owner.startswith("writer_b/")
    assert holder.owner in skipped[0].detail["reason"]
    # All or nothing: writer_b took other_table first (sorted keys) and gave it back when shared was held.
    assert OTHER < SHARED and store.holder(OTHER) is None
    assert store.lease(OTHER) is not None  # it was taken, then released

    (marks / "release").write_text("")
    assert first.wait(timeout=180) == 0
    assert home_a.task_states() == {("write", -1): "success"}
    [event_a] = asset_events(home_a)
    assert event_a["name"] == "shared_table" and event_a["dag_id"] == "writer_a"
    lease_a = event_a["extra"]["lease"]
    assert lease_a["key"] == SHARED and lease_a["token"] == holder.token and lease_a["owner"] == holder.owner
    assert store.holder(SHARED) is None

    # Now writer_b runs: both its leases, each asset's event with its own key and token.
    writer_a_done.write_text("")
    second = runs_b.result(1)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (marks / "b_ran").read_text() == f"{OTHER} {SHARED}"
    events_b = {e["name"]: e["extra"]["lease"] for e in asset_events(home_b)}
    assert events_b["shared_table"]["key"] == SHARED and events_b["other_table"]["key"] == OTHER
    assert events_b["shared_table"]["token"] > lease_a["token"]
    assert store.holder(SHARED) is None and store.holder(OTHER) is None

    # A consumer asks about the events that triggered it (the extra as Airflow hands it over).
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", pg_dsn)
    monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", schema)
    old = SimpleNamespace(extra=event_a["extra"])
    new = SimpleNamespace(extra={"lease": events_b["shared_table"]})
    assert is_stale(old), "writer_a's event was superseded by writer_b's newer token"
    assert "newer token" in (staleness(old).reason or "")
    assert not is_stale(new)
    assert not is_stale(SimpleNamespace(extra={"lease": events_b["other_table"]}))
