"""``airflow-lease failover``: the operator's step that starts a new token epoch (docs/core.md)."""

from __future__ import annotations

import io
import json
from datetime import timedelta

from airflow_lease_provider import cli
from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.types import EPOCH_SHIFT
from tests.pg import execute


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
