"""The deployment tier: DAGs run by a real scheduler, dag-processor, api-server and LocalExecutor.

One migrated metadata database per session (a template); one :class:`Deployment` per test module,
copied from it, started once and shared by that module's tests (``deployment_for`` in a module-scoped
fixture). The PostgreSQL server is the suite's (``pg_dsn``): ``LEASE_TEST_DSN``, or the embedded one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from demo.deployment import Deployment, MetadataTemplate


@contextmanager
def deployment_for(template: MetadataTemplate, dag_files: list[Path], dag_ids: set[str],
                   extra_env: dict[str, str] | None = None, *, triggerer: bool = False) -> Iterator[Deployment]:
    """A started deployment with ``dag_files``, every DAG in ``dag_ids`` parsed; stopped afterwards."""
    deployment = Deployment(template, dag_files, extra_env=extra_env, triggerer=triggerer)
    try:
        deployment.start(dag_ids)
        yield deployment
    except BaseException:
        print(deployment.tails())  # pytest shows it with the failure
        raise
    finally:
        deployment.stop()
