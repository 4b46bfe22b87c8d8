"""The lease API's documented contract: the OpenAPI file is what the app says, and the shell example of
docs/api.md runs as written (real ``curl`` and ``jq``) against the lease API served on a real port, over a
real PostgreSQL store."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_lease_provider.core import FenceStore, LeaseStore
from airflow_lease_provider.plugins import lease_api
from tests.api.live_server import serving
from tests.api.test_lease_api import SECRET, make_client

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"


def test_the_openapi_file_is_current() -> None:
    result = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "scripts" / "lease_api_openapi.py"),
                             "--check"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    spec = json.loads((ROOT / "docs" / "lease-api.openapi.json").read_text())
    assert {"/acquire", "/renew", "/release", "/check", "/fence"} <= set(spec["paths"])


def example() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- lease-api-curl-example -->\n```bash\n(.*?)```\n<!-- /lease-api-curl-example -->", text, re.S)
    assert match, "docs/api.md has no marked shell example"
    return match.group(1)


@pytest.fixture
def served(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", json.dumps({"conn_type": "http", "password": SECRET}))
    monkeypatch.setattr(lease_api, "_secret_cache", [])
    with serving(make_client(store).app) as url:
        yield url


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq")), reason="needs curl and jq")
def test_the_documented_curl_example_runs(served: str, store: LeaseStore) -> None:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", example()], capture_output=True, text=True,
                            timeout=120, check=False, env={"PATH": "/usr/bin:/bin", "AIRFLOW": served,
                                                           "LEASE_API_SECRET": SECRET})
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.fullmatch(r"done under token \d+\n", result.stdout)
    assert store.holder("nightly-export") is None  # released
    fences = FenceStore(store.db.dsn, schema=store.schema)
    try:
        assert fences.current("s3://exports/nightly", key="nightly-export") is not None
    finally:
        fences.close()
    # Run again: the idempotency key was claimed once, so the fence step fails the script (at most once).
    again = subprocess.run(["bash", "-euo", "pipefail", "-c", example()], capture_output=True, text=True,
                           timeout=120, check=False, env={"PATH": "/usr/bin:/bin", "AIRFLOW": served,
                                                          "LEASE_API_SECRET": SECRET})
    assert again.returncode != 0
