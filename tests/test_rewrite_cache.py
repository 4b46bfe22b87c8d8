"""tests/rewrite_cache.py writes the very file pytest's import hook writes (scripts/test reads it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.rewrite_cache import main

MODULE = "def test_sum():\n    total = sum([1, 2])\n    assert total == 3, total\n"


def test_the_cache_is_byte_for_byte_pytests_own(tmp_path: Path) -> None:
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    module = tmp_path / "tests" / "sub" / "test_sample.py"
    module.write_text(MODULE)
    (tmp_path / "tests" / "sub" / "helper.py").write_text("X = 1\n")  # not a test module: not rewritten
    assert main(tmp_path) == 1
    ours = {path.name: path.read_bytes() for path in module.parent.glob("__pycache__/*-pytest-*.pyc")}
    assert list(ours) == [f"test_sample.{sys.implementation.cache_tag}-pytest-{_pytest_version()}.pyc"]
    assert main(tmp_path) == 0  # present and current: nothing written again

    for path in module.parent.glob("__pycache__/*"):
        path.unlink()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          "-c", os.devnull, str(module)], env=env, capture_output=True, text=True, timeout=120)
    assert "1 passed" in run.stdout, run.stdout + run.stderr
    theirs = {path.name: path.read_bytes() for path in module.parent.glob("__pycache__/*-pytest-*.pyc")}
    assert theirs == ours


def _pytest_version() -> str:
    import pytest

    return pytest.__version__
