"""The task side's errors when the lease API is to be used and ``lease_api`` is missing, has no password, or
cannot be read (runtime/store.py: api_secret, api_task_store, task_store): each names ``lease_api`` and what to
do, never the secret, and never sends the operator to ``lease_default`` alone."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_lease_provider.client import HttpLeaseStore
from airflow_lease_provider.hooks import LeaseConnectionMissing
from airflow_lease_provider.hooks import lease as hooks
from airflow_lease_provider.runtime import store as runtime_store
from airflow_lease_provider.runtime.store import LeaseAPIUnconfigured

SECRET = "pw-" + "s3cr3t-value-never-shown"
TASK = SimpleNamespace(on_overlap="skip", lease_ttl=timedelta(seconds=30), lease_renew_every=None)


@pytest.fixture
def api_access(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__ACCESS", "api")
    monkeypatch.setenv("AIRFLOW__LEASE__API_URL", "http://api-server.invalid:8080")
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_API", raising=False)


def says(error: BaseException) -> str:
    return str(error)


def test_access_api_without_lease_api_names_it_and_what_to_do(api_access: None) -> None:
    with pytest.raises(LeaseAPIUnconfigured) as missing:
        runtime_store.task_store(TASK, None)
    message = says(missing.value)
    assert "'lease_api'" in message and "not defined" in message and "AIRFLOW_CONN_LEASE_API" in message
    assert "[lease] access = api" in message and "docs/api.md" in message
    assert "lease_default" not in message


def test_access_api_with_lease_api_without_a_password_names_it(api_access: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", json.dumps({"conn_type": "http", "login": "someone"}))
    with pytest.raises(LeaseAPIUnconfigured, match="'lease_api' is not defined here or has no password") as missing:
        runtime_store.task_store(TASK, None)
    assert "lease_default" not in says(missing.value)


def test_a_lease_api_airflow_cannot_parse_is_not_taken_for_missing(api_access: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", "http://user:" + SECRET + "@host:bad-port/%zz")
    with pytest.raises(LeaseAPIUnconfigured) as unreadable:
        runtime_store.task_store(TASK, None)
    message = says(unreadable.value)
    assert "'lease_api'" in message and "lease_default" not in message
    assert "could not" in message
    assert SECRET not in message and "s3cr3t" not in repr(unreadable.value.__cause__ or "")


def test_a_secrets_backend_that_fails_reading_lease_api_is_named_without_its_message(
    api_access: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(conn_id: str) -> Any:
        assert conn_id == "lease_api"
        raise RuntimeError(f"vault said no for password {SECRET}")

    monkeypatch.setattr(runtime_store, "get_connection", failing)
    with pytest.raises(LeaseAPIUnconfigured) as unreadable:
        runtime_store.task_store(TASK, None)
    message = says(unreadable.value)
    assert "'lease_api'" in message and "could not be read (RuntimeError)" in message
    assert SECRET not in message and unreadable.value.__suppress_context__


def test_auto_without_any_lease_connection_names_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__ACCESS", "auto")
    monkeypatch.setenv("AIRFLOW__LEASE__EMBEDDED", "false")
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_DEFAULT", raising=False)
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_API", raising=False)
    with pytest.raises(LeaseConnectionMissing) as missing:
        runtime_store.task_store(TASK, None)
    message = says(missing.value)
    assert "lease_default" in message and "'lease_api'" in message and "api-server" in message


def test_auto_with_an_unreadable_lease_api_names_lease_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__ACCESS", "auto")
    monkeypatch.setenv("AIRFLOW__LEASE__EMBEDDED", "false")
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_DEFAULT", raising=False)
    real = hooks.get_connection

    def failing(conn_id: str) -> Any:
        if conn_id == "lease_api":
            raise RuntimeError(SECRET)
        return real(conn_id)

    monkeypatch.setattr(runtime_store, "get_connection", failing)
    with pytest.raises(LeaseAPIUnconfigured, match="'lease_api'") as unreadable:
        runtime_store.task_store(TASK, None)
    assert SECRET not in says(unreadable.value)


def test_with_lease_api_the_task_takes_the_api_and_sends_its_host(api_access: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", json.dumps({"conn_type": "http", "password": SECRET}))
    monkeypatch.setattr(runtime_store, "_hostname", lambda: "worker-9.example")
    store = runtime_store.task_store(TASK, None)
    assert isinstance(store, HttpLeaseStore) and store.host == "worker-9.example"
    assert SECRET not in repr(store)
