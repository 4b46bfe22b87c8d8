"""The deployment tier: DAGs run by a real scheduler, dag-processor, api-server and LocalExecutor.

One migrated metadata database per session (a template); one :class:`Deployment` per test module,
copied from it, started once and shared by that module's tests (``deployment_for`` in a module-scoped
fixture). The PostgreSQL server is the suite's (``pg_dsn``): ``LEASE_TEST_DSN``, or the embedded one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_lease_provider.core import LeaseStore
from demo.airflow_api import wait
from demo.deployment import Deployment, MetadataTemplate

#: ``[lease] schema``'s default: where a deployment's tasks keep their leases unless its environment says otherwise
#: (in the metadata database, ``airflow db migrate`` makes it there through the provider's db-manager).
DEFAULT_SCHEMA = "airflow_lease"


@contextmanager
def deployment_for(template: MetadataTemplate, dag_files: list[Path], dag_ids: set[str],
                   extra_env: dict[str, str] | None = None, *, executor: str = "local", triggerer: bool = False,
                   lease_default: bool = True, before_start: Any = None) -> Iterator[Deployment]:
    """A started deployment with ``dag_files``, every DAG in ``dag_ids`` parsed; stopped afterwards.
    ``before_start(deployment)`` runs once its database exists, before any Airflow process starts.
    ``executor`` is :class:`Deployment`'s (``"edge"``: the EdgeExecutor, its workers started by the caller)."""
    deployment = Deployment(template, dag_files, extra_env=extra_env, executor=executor, triggerer=triggerer,
                            lease_default=lease_default)
    try:
        if before_start is not None:
            before_start(deployment)
        deployment.start(dag_ids)
        yield deployment
    except BaseException:
        print(deployment.tails())  # pytest shows it with the failure
        raise
    finally:
        deployment.stop()


@pytest.fixture
def store(airflow: Deployment) -> Iterator[LeaseStore]:
    """The lease store of the module's deployment (its ``airflow`` fixture), read by the test: the schema its
    tasks use (``AIRFLOW__LEASE__SCHEMA`` in its environment, else the default)."""
    with LeaseStore(airflow.dsn, schema=airflow.env.get("AIRFLOW__LEASE__SCHEMA", DEFAULT_SCHEMA)) as leases:
        yield leases


@dataclass(frozen=True)
class Markers:
    """The markers a module's task processes write into ``directory`` (``_util.mark``): ``marker(name)`` waits
    for the file up to ``timeout`` seconds (or the call's ``timeout``) and returns its text."""

    directory: Path
    timeout: float

    def __call__(self, name: str, timeout: float | None = None) -> str:
        path = self.directory / name
        wait(path.exists, bool, self.timeout if timeout is None else timeout, f"marker {name}", interval=0.2)
        return path.read_text()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test of this tier shows its deployment's process logs and newest task logs with the failure
    (the deployment and its files are gone once the module ends; a red run was not diagnosable)."""
    outcome: Any = yield
    report = outcome.get_result()
    deployment = getattr(item, "funcargs", {}).get("airflow")
    if report.when != "call" or not report.failed or not isinstance(deployment, Deployment):
        return
    task_logs = sorted((deployment.home / "logs").rglob("*.log"), key=lambda path: path.stat().st_mtime)[-4:]
    tasks = "\n".join(f"--- {path.relative_to(deployment.home)} ---\n{path.read_text(errors='replace')[-4000:]}"
                      for path in task_logs)
    report.sections.append(("the deployment's logs", f"{deployment.tails()}\n{tasks}"))
