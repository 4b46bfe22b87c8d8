from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from airflow_lease_provider.core import FenceStore, LeaseStore
from tests.pg import EmbeddedServer, drop_schema, external_dsn, new_schema_name

if TYPE_CHECKING:
    from demo.deployment import MetadataTemplate

#: Test files that start Airflow deployments or run long fault schedules, longest first (as measured with
#: ``scripts/test --durations=0``). ``scripts/test`` hands whole files to its processes in collection order
#: (``--dist loadfile``), so these go first and the short files fill in behind them: a long file collected
#: last would otherwise run alone at the end while the other processes sit idle.
LONG_FILES_FIRST = (  # seconds per file in one run at 2026-12-02 (2 cores, 3 processes)
    "tests/airflow/test_leased_e2e.py",  # 251
    "tests/timetables/test_scheduler_e2e.py",  # 183
    "tests/reliability/test_airflow_chaos.py",  # 179
    "tests/airflow/test_scheduler_e2e.py",  # 147
    "tests/reliability/test_chaos.py",  # 143
    "tests/celery/test_celery_e2e.py",  # 139
    "tests/ui/test_browser.py",  # 132
    "tests/deployment/test_examples.py",  # 130
    "tests/deployment/test_demo.py",  # 112
    "tests/deployment/test_leased.py",  # 111
    "tests/cli/test_embedded_store.py",  # 111
    "tests/airflow/test_terminate.py",  # 87
    "tests/timetables/test_scheduler_moves_e2e.py",  # 81
)


def _run_order(item: pytest.Item) -> tuple[int, int]:
    path = item.nodeid.split("::", 1)[0]
    if path in LONG_FILES_FIRST:
        return 0, LONG_FILES_FIRST.index(path)
    return (1, 0) if item.get_closest_marker("slow") else (2, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A stable sort: within a file, and among files of one rank, the collection order stays.
    items.sort(key=_run_order)


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
