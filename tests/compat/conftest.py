"""Fixtures of the compatibility tier: the built wheel, and an Airflow home per supported minor."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.compat.matrix import ROOT, Dists, Venv, build, clean_env, locks, venv_for
from tests.pg import drop_schema, new_schema_name, scratch_dir

pytestmark = pytest.mark.compat

SMOKE_DAGS = Path(__file__).parent / "dags"
EXAMPLES = ROOT / "dags_examples"


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    return build(tmp_path_factory.mktemp("dist"))


@dataclass
class Home:
    """An AIRFLOW_HOME of one supported Airflow, with the wheel installed and the DAGs in its folder."""

    venv: Venv
    path: Path
    env: dict[str, str]
    schema: str

    def run(self, *args: str, timeout: float = 300, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            list(args), env={**self.env, **env}, cwd=self.path, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {result.returncode} on Airflow {self.venv.airflow_version}:\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
        return result

    def airflow(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run(str(self.venv.bin / "airflow"), *args, **kw)

    def python(self, code: str, **kw) -> subprocess.CompletedProcess:
        return self.run(self.venv.python, "-c", code, **kw)

    def json_out(self, *args: str, **kw) -> object:
        """The JSON an ``airflow ... -o json`` command prints after its log lines."""
        result = self.airflow(*args, "-o", "json", **kw)
        lines = result.stdout.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(("[", "{")):
                return json.loads("\n".join(lines[i:]))
        raise AssertionError(f"no JSON in the output of {args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


@pytest.fixture(scope="session", params=sorted(locks()), ids=lambda minor: f"airflow-{minor}")
def home(request: pytest.FixtureRequest, dists: Dists, pg_dsn: str) -> Iterator[Home]:
    venv = venv_for(request.param, dists.wheel)
    path = scratch_dir(f"lease-compat-{venv.minor}-")
    dags = path / "dags"
    shutil.copytree(EXAMPLES, dags, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(SMOKE_DAGS / "compat_smoke.py", dags)
    schema = new_schema_name()
    env = clean_env(venv, path)
    env.update(
        {
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW_CONN_LEASE_DEFAULT": pg_dsn,
            "AIRFLOW__LEASE__SCHEMA": schema,
            "LEASE_EXAMPLES_SCHEMA": schema,
        }
    )
    home = Home(venv, path, env, schema)
    home.airflow("db", "migrate", timeout=600)
    try:
        yield home
    finally:
        drop_schema(pg_dsn, schema)
        shutil.rmtree(path, ignore_errors=True)
