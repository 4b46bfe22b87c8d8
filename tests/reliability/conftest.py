from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reliability.dbstate import Rows


@pytest.fixture
def rows(pg_dsn: str, schema: str) -> Iterator[Rows]:
    """Every row of the test schema's store tables, read on demand: ``before = rows()``."""
    reader = Rows(pg_dsn, schema)
    yield reader
    reader.close()
