"""``airflow-lease failover``: the operator's step that starts a new token epoch (docs/core.md)."""

from __future__ import annotations

import io
import json
from datetime import timedelta

from airflow_lease_provider import cli
from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.types import EPOCH_SHIFT
from tests.pg import execute, q


def _run(pg_dsn: str, schema: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(["--dsn", pg_dsn, "--schema", schema, *args], out=out)
    return code, out.getvalue()


def test_failover_starts_a_new_epoch_and_show_does_not(pg_dsn: str, schema: str, store: LeaseStore) -> None:
    before = store.acquire("daily-article", "run-1", timedelta(seconds=30))
    assert before is not None and before.token == 1

    code, text = _run(pg_dsn, schema, "failover", "--show", "--json")
    assert code == 0, text
    assert json.loads(text)["epoch"]["epoch"] == 0 and "previous" not in json.loads(text)

    code, text = _run(pg_dsn, schema, "failover", "--reason", "restored from a dump")
    assert code == 0, text
    assert text.startswith("token epoch 0 -> 1: every token issued from now on is above 1099511627776"), text
    assert "restored from a dump" in text
    epoch = store.token_epoch()
    assert (epoch.epoch, epoch.reason) == (1, "restored from a dump")

    after = store.acquire("daily-article", "run-2", timedelta(seconds=30))
    assert after is None  # still held by run-1: a new epoch takes nobody's lease
    renewed = store.renew(before)
    assert renewed is not None
    store.release(renewed)
    after = store.acquire("daily-article", "run-2", timedelta(seconds=30))
    assert after is not None and after.token == (1 << EPOCH_SHIFT) + 1

    code, text = _run(pg_dsn, schema, "failover", "--json")
    data = json.loads(text)
    assert code == 0 and data["previous"]["epoch"] == 1 and data["epoch"]["epoch"] == 2
    assert data["epoch"]["reason"].startswith("airflow-lease failover by ")


def test_failover_on_no_store_creates_nothing(pg_dsn: str, schema: str) -> None:
    code, _ = _run(pg_dsn, schema, "failover")
    assert code == cli.EXIT_ERROR
    assert not execute(pg_dsn, "SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))


def test_force_release_after_a_failover_reports_the_token_the_lease_really_has(
    pg_dsn: str, schema: str, store: LeaseStore
) -> None:
    held = store.acquire("daily-article", "run-1", timedelta(seconds=30))
    assert held is not None and held.token == 1
    store.bump_epoch("promoted the standby")
    code, text = _run(pg_dsn, schema, "release", "--force", "daily-article", "--yes", "--json")
    assert code == 0, text
    reported = json.loads(text)["new_token"]
    row = store.lease("daily-article")
    assert row is not None and reported == row.token == (1 << EPOCH_SHIFT) + 1  # not the old token + 1


def test_concurrent_failovers_each_report_the_epoch_they_moved_from(
    pg_dsn: str, schema: str, store: LeaseStore
) -> None:
    """Two ``airflow-lease failover`` console scripts at once. "previous" was read before the bump took
    the row lock, so both printed ``0 -> ...`` (``0 -> 1`` and ``0 -> 2``): one of them lied."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psycopg2

    store.ensure_schema()
    blocker = psycopg2.connect(pg_dsn)  # holds the epoch's row until both runs wait for it
    try:
        with blocker.cursor() as cur:
            cur.execute(q("SELECT epoch FROM {schema}.lease_epoch FOR UPDATE", schema))
        script = str(Path(sys.executable).parent / "airflow-lease")
        runs = [
            subprocess.Popen(
                [script, "--dsn", pg_dsn, "--schema", schema, "failover", "--reason", f"run {i}", "--json"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for i in (1, 2)
        ]
        deadline = time.monotonic() + 60
        while True:  # both are waiting for the row lock (the old code had read "previous" by then)
            waiting = execute(
                pg_dsn,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                ("%lease_epoch%",),
            )[0][0]
            if waiting == 2:
                break
            assert time.monotonic() < deadline, "the two failovers never both waited for the epoch's row"
            assert all(run.poll() is None for run in runs), [run.communicate() for run in runs]
            time.sleep(0.1)
        blocker.rollback()
        results = [run.communicate(timeout=120) for run in runs]
    finally:
        blocker.close()
    assert [run.returncode for run in runs] == [0, 0], results
    moves = sorted((json.loads(out)["previous"]["epoch"], json.loads(out)["epoch"]["epoch"]) for out, _ in results)
    assert moves == [(0, 1), (1, 2)], moves
    assert store.token_epoch().epoch == 2
