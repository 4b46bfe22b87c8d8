"""Owners built from ids Airflow accepts: ``task_id='²'`` (a digit ``int`` refuses) and ``'٣'`` (a digit of
another script). Through the ``airflow-lease`` console script; the HTTP API's side is in tests/ui.

``RunRef.parse`` took any Unicode digit as an old owner's map index: ``int('²')`` raised for every reader of
the lease (``airflow-lease status`` exited 1 with a ValueError), and ``'٣'`` read as map index 3.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from airflow_lease_provider.core import LeaseStore

VENV_BIN = Path(sys.executable).parent


def airflow_lease(pg_dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "airflow-lease"), "--dsn", pg_dsn, "--schema", schema, *args],
        capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.parametrize(("task", "map_index"), [("²", -1), ("٣", -1), ("٣[2]", 2)])
def test_status_and_events_read_an_owner_whose_task_id_is_a_unicode_digit(
    pg_dsn: str, schema: str, store: LeaseStore, task: str, map_index: int
) -> None:
    owner = f"etl/manual__2026-12-01/{task}"
    assert store.acquire("k", owner, timedelta(minutes=5)) is not None
    for args in (("status",), ("status", "--json"), ("events", "--json"), ("status", "--key", "k", "--json")):
        result = airflow_lease(pg_dsn, schema, *args)
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr and "ValueError" not in result.stderr
    (row,) = json.loads(airflow_lease(pg_dsn, schema, "status", "--json").stdout)["leases"]
    assert row["owner"] == owner
    # The task part is the task id (a map index is only ever written in ASCII digits): '٣' is not map index 3.
    assert row["holder_run"] == {
        "dag_id": "etl", "run_id": "manual__2026-12-01", "map_index": map_index,
        "path": "dags/etl/runs/manual__2026-12-01",
    }
