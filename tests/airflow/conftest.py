from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.airflow.harness import AirflowHome, make_home, migrate_template
from tests.pg import scratch_dir

pytestmark = pytest.mark.airflow


@pytest.fixture(scope="session")
def airflow_template() -> Iterator[Path]:
    root = scratch_dir("lease-airflow-template-")
    try:
        yield migrate_template(root)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def airflow_home(airflow_template: Path, pg_dsn: str, schema: str, tmp_path: Path) -> Iterator[Callable[..., AirflowHome]]:
    """A factory of Airflow homes sharing this test's lease store."""
    homes: list[AirflowHome] = []

    def factory(name: str = "home", **kwargs) -> AirflowHome:
        home = make_home(airflow_template, tmp_path, name, dsn=pg_dsn, schema=schema, **kwargs)
        homes.append(home)
        return home

    yield factory
    for home in homes:
        home.close()
