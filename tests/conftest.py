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


# -- the budget: the longest test files, printed at the end of every run ----------------------------------

#: Seconds per test file: setup, call and teardown of each of its tests (a module-scoped fixture's start
#: counts in its first test's setup). Filled from the test reports, which under xdist arrive on the
#: controller from every worker, so this works with and without ``-n``.
_FILE_SECONDS: dict[str, float] = {}
LONGEST_FILES = 15


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _FILE_SECONDS:
        return  # an xdist worker: the controller prints the whole run's figures
    longest = sorted(_FILE_SECONDS.items(), key=lambda item: item[1], reverse=True)[:LONGEST_FILES]
    terminalreporter.write_sep("=", f"the {len(longest)} longest test files (s, setup + call + teardown)")
    for path, seconds in longest:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}  all {len(_FILE_SECONDS)} files")
