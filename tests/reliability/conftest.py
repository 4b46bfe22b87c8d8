from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pg import EmbeddedServer, drop_schema, new_schema_name
from tests.reliability.dbstate import Rows
from tests.reliability.outage import halt, start


@pytest.fixture
def rows(pg_dsn: str, schema: str) -> Iterator[Rows]:
    """Every row of the test schema's store tables, read on demand: ``before = rows()``."""
    reader = Rows(pg_dsn, schema)
    yield reader
    reader.close()


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    """A private server per test module, since these tests stop, freeze and kill it."""
    srv = EmbeddedServer()
    yield srv
    halt(srv)  # bounded, whatever a test left; then the stop below finds nothing running
    srv.stop()


@pytest.fixture
def private(server: EmbeddedServer) -> Iterator[str]:
    """A schema on the private server; the server is up at the start and at the end of every test."""
    start(server)
    name = new_schema_name()
    yield name
    start(server)
    drop_schema(server.dsn, name)
