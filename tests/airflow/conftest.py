from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.airflow.harness import AirflowHome, make_home
from tests.airflow.warm import WarmServer

pytestmark = pytest.mark.airflow


@pytest.fixture
def airflow_home(
    airflow_template: Path, warm_airflow: WarmServer | None, pg_dsn: str, schema: str, tmp_path: Path
) -> Iterator[Callable[..., AirflowHome]]:
    """A factory of Airflow homes sharing this test's lease store; their foreground ``airflow`` commands run
    in the warm server (tests/airflow/warm.py) unless ``warm=None`` is passed."""
    homes: list[AirflowHome] = []

    def factory(name: str = "home", **kwargs) -> AirflowHome:
        kwargs.setdefault("warm", warm_airflow)
        home = make_home(airflow_template, tmp_path, name, dsn=pg_dsn, schema=schema, **kwargs)
        homes.append(home)
        return home

    yield factory
    for home in homes:
        home.close()
