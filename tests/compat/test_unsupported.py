"""Airflow 3.0 is not supported: the installer refuses the wheel, and a forced install refuses to import."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.compat.matrix import UV, Dists, clean_env, unsupported_venv
from tests.pg import scratch_dir

pytestmark = [pytest.mark.compat, pytest.mark.slow, pytest.mark.timeout(900)]


def test_airflow_3_0_is_refused_by_the_installer_and_at_import(dists: Dists) -> None:
    venv = unsupported_venv("3.0")
    # With its dependencies, the wheel cannot be installed next to Airflow 3.0 at all.
    resolve = subprocess.run(
        [UV, "pip", "install", "--dry-run", "--python", venv.python, f"apache-airflow=={venv.airflow_version}",
         str(dists.wheel)],
        capture_output=True, text=True, timeout=600,
    )
    assert resolve.returncode != 0
    assert "apache-airflow>=3.1.0" in resolve.stderr, resolve.stderr[-2000:]
    # Forced in without its dependencies, importing it says what it needs instead of failing later.
    subprocess.run(
        [UV, "pip", "install", "-q", "--python", venv.python, "--no-deps", "--reinstall", str(dists.wheel)],
        check=True, capture_output=True, timeout=600,
    )
    home = scratch_dir("lease-compat-3.0-")
    try:
        result = subprocess.run(
            [venv.python, "-c", "import airflow_lease_provider.operators"],
            env=clean_env(venv, home), cwd=home, capture_output=True, text=True, timeout=300,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: The package `airflow-lease-provider:"), result.stderr[-2000:]
    assert f"needs Apache Airflow 3.1.0+ (found Apache Airflow {venv.airflow_version})" in last
