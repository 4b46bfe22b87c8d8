from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import pytest

from airflow_lease_provider.core import LeaseStore
from demo.deployment import MetadataTemplate
from tests.celery.deployment import LEASE_SCHEMA, Deployment, ensure_redis, new_root
from tests.tools import require


@pytest.fixture(scope="module")
def celery_deployment(pg_dsn: str, metadata_template: MetadataTemplate) -> Iterator[Deployment]:
    """One CeleryExecutor deployment for the module (see tests/celery/deployment.py), its metadata
    database copied from the session's migrated template."""
    require("redis")
    ensure_redis()
    root = new_root()
    deployment = Deployment(pg_dsn, root, template=metadata_template.name)
    started = time.monotonic()
    try:
        deployment.start()
        print(f"celery deployment up in {time.monotonic() - started:.0f} s")
        yield deployment
    except BaseException:
        print(deployment.tails())
        raise
    finally:
        deployment.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def lease_store(celery_deployment: Deployment) -> Iterator[LeaseStore]:
    """The deployment's lease store, read directly (not through a worker's proxy)."""
    store = LeaseStore(celery_deployment.lease_dsn, schema=LEASE_SCHEMA)
    store.ensure_schema()
    yield store
    store.close()
