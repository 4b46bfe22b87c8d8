"""Provider registration, connection resolution and the clock check, without a running Airflow."""

from __future__ import annotations

import json
import logging
import subprocess
from datetime import datetime, timedelta, timezone

import pytest

from airflow_lease_provider.core import Lease
from airflow_lease_provider.hooks import FenceHook, LeaseConnectionMissing, LeaseHook
from airflow_lease_provider.hooks.lease import dsn_from_connection, resolve
from airflow_lease_provider.runtime.task_lease import warn_on_clock_skew


def test_airflow_lists_the_provider_and_its_decorators(airflow_home) -> None:
    home = airflow_home("providers", statsd=False)
    result = home.cli(["providers", "list", "-o", "json"], timeout=180)
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


def test_a_missing_fence_connection_is_named_as_the_fence_s_not_as_a_lease_connection(monkeypatch) -> None:
    # lease.fenced_transaction("x", conn_id="no_such_db") reaches the target database through FenceHook.
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    with pytest.raises(LeaseConnectionMissing) as info:
        FenceHook("no_such_db").get_store()
    assert str(info.value).startswith("fence connection (the database the fence is kept in) 'no_such_db' is not defined")
    monkeypatch.setenv("AIRFLOW_CONN_BROKEN_DB", "postgresql://u:a/b@h/db")  # an unencoded / in the password
    with pytest.raises(Exception, match=r"^fence connection .* 'broken_db' ") as unreadable:
        FenceHook("broken_db").get_store()
    assert "a/b" not in str(unreadable.value)


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


@pytest.fixture
def no_connection(monkeypatch):
    """No lease connection, and an embedded store that is only recorded, not started."""
    from airflow_lease_provider.hooks import lease as hook_module

    monkeypatch.delenv("AIRFLOW_CONN_LEASE_DEFAULT", raising=False)
    monkeypatch.delenv("AIRFLOW__LEASE__EMBEDDED", raising=False)
    started: list[str] = []

    def fake_embedded() -> str:
        started.append("embedded")
        return "postgresql://embedded@/postgres?host=/tmp/none"

    monkeypatch.setattr(hook_module, "embedded_dsn", fake_embedded)
    return started


def test_a_local_executor_on_a_shared_metadata_database_without_a_connection_is_an_error(
    monkeypatch, no_connection
) -> None:
    # HA schedulers or a triggerer of its own may run on other hosts: each would start its own store.
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql+psycopg2://airflow@db:5432/airflow")
    with pytest.raises(LeaseConnectionMissing) as info:
        resolve(None)
    message = str(info.value)
    assert "AIRFLOW_CONN_LEASE_DEFAULT" in message and "'lease_default'" in message
    assert "metadata database is not SQLite" in message and "[lease] embedded = true" in message
    assert no_connection == []


def test_a_local_executor_on_sqlite_falls_back_to_the_embedded_store(monkeypatch, no_connection) -> None:
    # airflow standalone as installed: one host, one SQLite file, no second host can exist.
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "sqlite:////tmp/airflow.db")
    location = resolve(None)
    assert location.embedded and no_connection == ["embedded"]


def test_embedded_true_turns_the_fallback_on_by_name_even_on_a_distributed_executor(
    monkeypatch, no_connection
) -> None:
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql+psycopg2://airflow@db:5432/airflow")
    monkeypatch.setenv("AIRFLOW__LEASE__EMBEDDED", "true")
    assert resolve(None).embedded and no_connection == ["embedded"]


def test_embedded_false_refuses_the_fallback_even_on_sqlite(monkeypatch, no_connection) -> None:
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "sqlite:////tmp/airflow.db")
    monkeypatch.setenv("AIRFLOW__LEASE__EMBEDDED", "false")
    with pytest.raises(LeaseConnectionMissing, match=r"\[lease\] embedded = false"):
        resolve(None)
    assert no_connection == []


def test_a_bad_embedded_setting_is_an_error_naming_it(monkeypatch, no_connection) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__EMBEDDED", "sometimes")
    with pytest.raises(ValueError, match=r"\[lease\] embedded='sometimes'"):
        resolve(None)
    assert no_connection == []


def test_hook_stores_close_their_connection_when_idle_unless_told_to_hold_it(monkeypatch, pg_dsn) -> None:
    from datetime import timedelta as td

    monkeypatch.setenv("AIRFLOW_CONN_LEASE_IDLE", pg_dsn)
    assert LeaseHook("lease_idle").get_store().db.idle_close == td(0)
    monkeypatch.setenv("AIRFLOW__LEASE__HOLD_CONNECTION", "True")
    assert LeaseHook("lease_idle").get_store().db.idle_close is None
    monkeypatch.setenv("AIRFLOW__LEASE__HOLD_CONNECTION", "maybe")
    with pytest.raises(ValueError, match=r"\[lease\] hold_connection='maybe'"):
        LeaseHook("lease_idle").get_store()


def test_hook_stores_prepare_their_statements_unless_told_not_to(monkeypatch, pg_dsn) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_PREP", pg_dsn)
    monkeypatch.delenv("AIRFLOW__LEASE__PREPARE_STATEMENTS", raising=False)
    assert LeaseHook("lease_prep").get_store().db.prepare is True
    assert FenceHook("lease_prep").get_store().db.prepare is True
    monkeypatch.setenv("AIRFLOW__LEASE__PREPARE_STATEMENTS", "false")
    assert LeaseHook("lease_prep").get_store().db.prepare is False
    assert FenceHook("lease_prep").get_store().db.prepare is False
    monkeypatch.setenv("AIRFLOW__LEASE__PREPARE_STATEMENTS", "sometimes")
    with pytest.raises(ValueError, match=r"\[lease\] prepare_statements='sometimes'"):
        LeaseHook("lease_prep").get_store()


def test_a_leased_task_s_store_lookup_does_not_import_the_fence_hooks_or_the_embedded_server() -> None:
    """Under an executor each task is a new process: what it imports to reach LeaseHook is paid per leased task
    (issue 28 item 1). The DB-API fence and the embedded server are imported only where they are used."""
    import sys

    code = (
        "import sys\n"
        "from airflow_lease_provider.runtime.task_lease import TaskLease\n"
        "from airflow_lease_provider.hooks import LeaseHook\n"
        "print(sorted(m for m in ('airflow_lease_provider.core.dbapi_fence', 'airflow_lease_provider.hooks.dbapi_fence',"
        " 'airflow_lease_provider.core.embedded') if m in sys.modules))\n"
        "from airflow_lease_provider.hooks import DbApiFenceHook\n"
        "from airflow_lease_provider.hooks.dbapi_fence import DbApiFenceHook as Direct\n"
        "print(DbApiFenceHook is Direct)\n"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert probe.stdout.split("\n")[:2] == ["[]", "True"], probe.stdout + probe.stderr[-2000:]
