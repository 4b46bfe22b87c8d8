from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from airflow_lease_provider.core import FenceStore, LeaseStore
from tests.pg import EmbeddedServer, drop_schema, external_dsn, new_schema_name

if TYPE_CHECKING:
    from demo.deployment import MetadataTemplate


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """The server under test: ``LEASE_TEST_DSN`` if set, else a throwaway embedded PostgreSQL."""
    dsn = external_dsn()
    if dsn:
        yield dsn
        return
    server = EmbeddedServer()
    try:
        yield server.dsn
    finally:
        server.stop()


@pytest.fixture(scope="session")
def metadata_template(pg_dsn: str) -> Iterator[MetadataTemplate]:
    """A migrated Airflow metadata database, once per test process: every tier that starts Airflow
    copies its databases from it (``CREATE DATABASE ... TEMPLATE``) instead of migrating one of its own
    (``airflow db migrate`` is most of a minute of CPU)."""
    from demo.deployment import MetadataTemplate

    template = MetadataTemplate(pg_dsn)
    try:
        yield template
    finally:
        template.drop()


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    """A schema name of this test's own, dropped afterwards."""
    name = new_schema_name()
    yield name
    drop_schema(pg_dsn, name)


@pytest.fixture
def store(pg_dsn: str, schema: str) -> Iterator[LeaseStore]:
    leases = LeaseStore(pg_dsn, schema=schema)
    yield leases
    leases.close()


@pytest.fixture
def fences(pg_dsn: str, schema: str) -> Iterator[FenceStore]:
    fence_store = FenceStore(pg_dsn, schema=schema)
    yield fence_store
    fence_store.close()
