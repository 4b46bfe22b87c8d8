"""The lease store in Airflow's metadata database (issue 41, docs/api.md decisions 1 and 2): created by
``airflow db migrate`` through the provider's ``db-managers`` entry, and the api-server's choice of store, one
test per branch, on real PostgreSQL databases made for the test and dropped after it."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from datetime import timedelta

import psycopg2
import pytest
from psycopg2 import sql
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.schema import latest_version
from airflow_lease_provider.db_manager import MANAGER, LeaseDBManager, libpq_dsn
from airflow_lease_provider.hooks import lease as lease_hooks
from demo.deployment import MetadataTemplate, drop_database, with_database
from tests.pg import execute


@pytest.fixture
def temp_database(pg_dsn: str) -> Iterator[str]:
    """A database of its own (its DSN), dropped after the test."""
    name = f"lease_api_{secrets.token_hex(5)}"
    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    conn.close()
    try:
        yield with_database(pg_dsn, name)
    finally:
        drop_database(pg_dsn, name)


def _version(dsn: str, schema: str = "airflow_lease") -> int:
    rows = execute(dsn, sql.SQL("SELECT max(version) FROM {}.schema_version").format(sql.Identifier(schema)))
    return int(rows[0][0])


def test_the_provider_registers_its_db_manager() -> None:
    from airflow.providers_manager import ProvidersManager

    assert MANAGER in ProvidersManager().db_managers


@pytest.mark.airflow
@pytest.mark.timeout(900)
def test_airflow_db_migrate_creates_the_store_in_the_metadata_database(
    metadata_template: MetadataTemplate, pg_dsn: str
) -> None:
    """The run's metadata template was made by a real ``airflow db migrate``: the store is in it, current."""
    name, dsn = metadata_template.copy()
    try:
        assert _version(dsn) == latest_version()
        store = LeaseStore(dsn, schema="airflow_lease", read_only=True)
        try:
            assert store.acquire("migrated", "me", timedelta(seconds=30)) is not None
        finally:
            store.close()
    finally:
        drop_database(pg_dsn, name)


def test_the_manager_migrates_postgresql_and_is_idempotent(temp_database: str) -> None:
    engine = create_engine(temp_database.replace("postgresql://", "postgresql+psycopg2://", 1))
    try:
        with Session(engine) as session:
            manager = LeaseDBManager(session)
            assert not manager.check_migration()
            manager.initdb()
            assert _version(temp_database) == latest_version()
            manager.upgradedb()  # again: nothing to do
            assert _version(temp_database) == latest_version()
            assert manager.check_migration()
    finally:
        engine.dispose()


def test_the_manager_does_nothing_on_sqlite(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'airflow.db'}")
    with Session(engine) as session, caplog.at_level(logging.INFO, logger="airflow_lease_provider.db_manager"):
        manager = LeaseDBManager(session)
        manager.upgradedb()
        assert manager.check_migration()
    assert "not PostgreSQL: no lease store created there" in caplog.text


def test_libpq_dsn_keeps_the_password_and_drops_the_driver() -> None:
    assert libpq_dsn("postgresql+psycopg2://u:p%40ss@h:5433/db?sslmode=require") == (
        "postgresql://u:p%40ss@h:5433/db?sslmode=require"
    )
    assert libpq_dsn("sqlite:////tmp/airflow.db") is None
    assert libpq_dsn("mysql+mysqldb://u:p@h/db") is None


# -- the api-server's store: one test per branch ---------------------------------------------------


def _database_of(dsn: str) -> str:
    return str(execute(dsn, "SELECT current_database()")[0][0])


def test_api_server_store_is_the_lease_connection_when_defined(
    monkeypatch: pytest.MonkeyPatch, pg_dsn: str, temp_database: str
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", temp_database)
    # The metadata database is PostgreSQL too, elsewhere: the connection wins.
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", pg_dsn.replace("postgresql://", "postgresql+psycopg2://"))
    location = lease_hooks.api_server_location()
    assert not location.embedded
    assert _database_of(location.dsn) == _database_of(temp_database)


def test_api_server_store_is_the_metadata_database_without_a_connection(
    monkeypatch: pytest.MonkeyPatch, temp_database: str
) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_DEFAULT", raising=False)
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
                       temp_database.replace("postgresql://", "postgresql+psycopg2://"))
    # No Airflow tables in the temporary database: the connection lookup answers "not defined" as Airflow's
    # does on a migrated one without it.
    monkeypatch.setattr(lease_hooks, "_get_connection", _no_connection)
    location = lease_hooks.api_server_location()
    assert (location.embedded, location.schema) == (False, "airflow_lease")
    assert _database_of(location.dsn) == _database_of(temp_database)
    hook = lease_hooks.LeaseHook.for_api_server(read_only=False)
    store = hook.get_store()
    try:
        assert store.acquire("in-metadata", "me", timedelta(seconds=30)) is not None
    finally:
        store.close()
    assert _version(temp_database) == latest_version()


def test_api_server_store_is_the_embedded_one_on_sqlite(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_DEFAULT", raising=False)
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{tmp_path / 'airflow.db'}")
    monkeypatch.setattr(lease_hooks, "_get_connection", _no_connection)
    monkeypatch.setattr(lease_hooks.settings, "embedded_allowed", lambda: True)
    # Starting the embedded server is its own tests' business (tests/core/test_embedded.py); here, which branch.
    monkeypatch.setattr(lease_hooks, "embedded_dsn", lambda: "postgresql://embedded.invalid/x")
    location = lease_hooks.api_server_location()
    assert location.embedded and location.dsn == "postgresql://embedded.invalid/x"


def test_api_server_store_refuses_an_unreadable_connection_rather_than_falling_back(
    monkeypatch: pytest.MonkeyPatch, temp_database: str
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", "postgresql://u:p/w@host:5432/db")  # an unencoded /
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
                       temp_database.replace("postgresql://", "postgresql+psycopg2://"))
    with pytest.raises(lease_hooks.LeaseStoreUnavailable):
        lease_hooks.api_server_location()


def _no_connection(conn_id: str) -> object:
    raise lease_hooks.AirflowNotFoundException(conn_id)
