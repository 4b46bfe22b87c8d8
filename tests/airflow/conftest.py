from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.airflow.harness import AirflowHome, make_home

pytestmark = pytest.mark.airflow


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
