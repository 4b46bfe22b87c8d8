from __future__ import annotations

from collections.abc import Iterator

import pytest

from airflow_lease_provider.core import FenceStore, LeaseStore
from tests.pg import EmbeddedServer, drop_schema, external_dsn, new_schema_name


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
