"""Provider registration, connection resolution and the clock check, without a running Airflow."""

from __future__ import annotations

import json
import logging
import subprocess
from datetime import datetime, timedelta, timezone

import pytest

from airflow_lease_provider.core import Lease
from airflow_lease_provider.hooks import LeaseConnectionMissing, LeaseHook
from airflow_lease_provider.hooks.lease import dsn_from_connection, resolve
from airflow_lease_provider.operators.leased import warn_on_clock_skew


def test_airflow_lists_the_provider_and_its_decorators(airflow_home) -> None:
    home = airflow_home("providers", statsd=False)
    result = subprocess.run(
        ["airflow", "providers", "list", "-o", "json"], env=home.env, capture_output=True, text=True, timeout=180
    )
    payload = next(line for line in reversed(result.stdout.splitlines()) if line.startswith("["))
    assert "airflow-lease-provider" in {p["package_name"] for p in json.loads(payload)}
    probe = subprocess.run(
        [
            "python", "-c",
            "from airflow.sdk import task; print(task.leased.__name__, task.fenced_publish.__name__)",
        ],
        env=home.env, capture_output=True, text=True, timeout=180,
    )
    assert probe.stdout.split()[-2:] == ["leased_task", "fenced_publish_task"], probe.stderr[-2000:]


def test_a_distributed_executor_without_a_connection_is_an_error_naming_what_to_set(monkeypatch) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_DEFAULT", raising=False)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    with pytest.raises(LeaseConnectionMissing) as info:
        resolve(None)
    assert "AIRFLOW_CONN_LEASE_DEFAULT" in str(info.value) and "CeleryExecutor" in str(info.value)


def test_an_explicit_connection_id_that_is_missing_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    with pytest.raises(LeaseConnectionMissing, match="'no_such_conn' is not defined"):
        LeaseHook("no_such_conn").get_store()


def test_a_postgres_uri_connection_becomes_a_dsn_with_its_extras(monkeypatch) -> None:
    monkeypatch.setenv(
        "AIRFLOW_CONN_MY_PG", "postgresql://u:p%40ss@db.internal:6543/airflow?sslmode=require&lease_schema=leases"
    )
    location = resolve("my_pg")
    assert location.schema == "leases" and not location.embedded
    assert "sslmode=require" in location.dsn and "port=6543" in location.dsn and "dbname=airflow" in location.dsn
    assert "p@ss" not in location.where  # the password never reaches a log line

    class Conn:  # a UI-made connection with a Unix socket in the extras
        host, port, login, password, schema = None, None, "postgres", None, None
        extra_dejson = {"host": "/run/postgresql", "unrelated": "x"}

    dsn, schema = dsn_from_connection(Conn())
    assert "host=/run/postgresql" in dsn and "unrelated" not in dsn and schema is None


def test_clock_skew_is_warned_about_and_changes_nothing(caplog) -> None:
    now = datetime.now(timezone.utc)
    lease = Lease("k", "o", 1, timedelta(minutes=1), now, now, now + timedelta(minutes=1), None, now)
    logger = logging.getLogger("skew-test")
    with caplog.at_level(logging.WARNING, logger="skew-test"):
        warn_on_clock_skew(lease, now + timedelta(seconds=0.5), logger)
        assert not caplog.records
        warn_on_clock_skew(lease, now + timedelta(minutes=10), logger)
    assert "differs from the database's by 600.0 s" in caplog.text
