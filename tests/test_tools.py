"""A test that needs a system tool (tests/tools.py) skips naming the Debian package when it is absent,
and fails instead under ``CI=true``, where ``.ci/run`` installed it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tools

ROOT = Path(__file__).parents[1]
PGBOUNCER_TEST = "tests/core/test_pool.py::test_many_keepers_through_pgbouncer_transaction_pooling"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv(tools.WITHOUT_ENV, raising=False)
    tools._present.cache_clear()
    yield
    tools._present.cache_clear()


@pytest.mark.parametrize("name", sorted(tools.TOOLS))
def test_an_absent_tool_skips_naming_its_package_and_fails_under_ci(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tools.WITHOUT_ENV, f"something-else,{name}")
    with pytest.raises(pytest.skip.Exception) as skipped:
        tools.require(name)
    assert f"apt-get install {tools.TOOLS[name].packages}" in str(skipped.value)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception) as failed:
        tools.require(name)
    assert f"apt-get install {tools.TOOLS[name].packages}" in str(failed.value)
    assert "CI=true" in str(failed.value)


def test_a_tool_is_looked_for_where_it_is_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not by name: a PATH without ``faketime`` and a Chromium path that does not exist are absences."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("LEASE_TEST_CHROMIUM", str(tmp_path / "no-chromium"))
    assert "apt-get install faketime" in (tools.missing("faketime") or "")
    assert "apt-get install chromium" in (tools.missing("chromium") or "")
    browser = tmp_path / "chromium"
    browser.write_text("#!/bin/sh\n")
    monkeypatch.setenv("LEASE_TEST_CHROMIUM", str(browser))
    tools._present.cache_clear()
    assert tools.missing("chromium") is None


def test_an_unknown_tool_is_a_mistake() -> None:
    with pytest.raises(ValueError, match="unknown tool 'pgbouncr'"):
        tools.require("pgbouncr")


@pytest.mark.parametrize("ci", ["", "true"])
def test_a_marked_test_skips_or_fails_before_its_fixtures(ci: str) -> None:
    """Through the mark and the suite's conftest, as ``scripts/test`` runs it (the pgbouncer test failed
    with "pgbouncer is not installed" where the other tool tests skipped)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    env.update({tools.WITHOUT_ENV: "pgbouncer", "CI": ci})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rsf", PGBOUNCER_TEST],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    output = result.stdout + result.stderr
    assert "apt-get install pgbouncer" in output, output[-3000:]
    if ci:
        assert result.returncode == 1 and "1 error" in output, output[-3000:]  # failed in its setup
    else:
        assert result.returncode == 0 and "1 skipped" in output, output[-3000:]
