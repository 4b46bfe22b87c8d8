"""The compatibility tier's machinery: the built distributions and one cached venv per supported Airflow.

The wheel and the sdist are built from the checkout with ``uv build`` (the pinned build backend, in
isolation) once per session. Each supported Airflow minor has a lock, ``requirements/airflow-X.Y.txt``
(``uv pip compile pyproject.toml --extra embedded --extra statsd -c <(echo apache-airflow==X.Y.Z)``), and
a venv under ``.compat/venvs/X.Y-<hash of the lock>`` (git-ignored) made from it the first time; a
re-run only reinstalls the freshly built wheel. The wheel is installed with its declared dependencies
and the lock as constraints, the way a user installs into an Airflow pinned by its constraints file,
so a dependency the wheel declares wrongly fails the install.

Nothing of the checkout is importable in those venvs: commands run from a scratch directory with no
``PYTHONPATH``, so what loads is the installed wheel.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[2]
CACHE = ROOT / ".compat"
UV = str(Path(sys.executable).parent / "uv")
PYTHON = os.environ.get("LEASE_COMPAT_PYTHON", "python3.11")


def locks() -> dict[str, Path]:
    """Supported minor -> its lock file."""
    found = {}
    for path in sorted((ROOT / "requirements").glob("airflow-*.txt")):
        found[path.stem.removeprefix("airflow-")] = path
    return found


def pinned_airflow(lock: Path) -> str:
    match = re.search(r"^apache-airflow==(\S+)$", lock.read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f"{lock}: no apache-airflow== pin")
    return match.group(1)


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=kw.pop("timeout", 900), **kw)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@dataclass(frozen=True)
class Dists:
    wheel: Path
    sdist: Path


def build(out: Path, source: Path = ROOT) -> Dists:
    """``uv build`` of ``source`` (a checkout or an unpacked sdist) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    _run([UV, "build", "-q", "--out-dir", str(out), str(source)], timeout=600)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return Dists(wheel, sdist)


@dataclass(frozen=True)
class Venv:
    minor: str
    airflow_version: str
    path: Path

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def python(self) -> str:
        return str(self.bin / "python")


def venv_for(minor: str, wheel: Path) -> Venv:
    """The cached venv of ``minor`` (made from its lock if missing) with ``wheel`` (re)installed."""
    lock = locks()[minor]
    key = hashlib.sha256(lock.read_bytes() + PYTHON.encode() + b" bytecode").hexdigest()[:12]
    path = CACHE / "venvs" / f"{minor}-{key}"
    if not (path / ".complete").exists():
        shutil.rmtree(path, ignore_errors=True)
        for stale in (CACHE / "venvs").glob(f"{minor}-*"):
            shutil.rmtree(stale, ignore_errors=True)  # an older lock's venv
        _run([UV, "venv", "-q", "--python", PYTHON, str(path)])
        _run([UV, "pip", "install", "-q", "--compile-bytecode", "--python", str(path / "bin" / "python"), "-r", str(lock)])
        (path / ".complete").write_text(lock.name)
    version = pinned_airflow(lock)
    _run(
        [
            UV, "pip", "install", "-q", "--compile-bytecode", "--python", str(path / "bin" / "python"),
            "--reinstall-package", "airflow-lease-provider",
            f"apache-airflow=={version}", f"{wheel}[embedded,statsd]", "-c", str(lock),
        ]
    )
    return Venv(minor, version, path)


def unsupported_venv(minor: str) -> Venv:
    """A cached venv of an Airflow the package refuses (``requirements/unsupported/airflow-X.Y.txt``)."""
    lock = ROOT / "requirements" / "unsupported" / f"airflow-{minor}.txt"
    key = hashlib.sha256(lock.read_bytes() + PYTHON.encode() + b" bytecode").hexdigest()[:12]
    path = CACHE / "venvs" / f"unsupported-{minor}-{key}"
    if not (path / ".complete").exists():
        shutil.rmtree(path, ignore_errors=True)
        _run([UV, "venv", "-q", "--python", PYTHON, str(path)])
        _run([UV, "pip", "install", "-q", "--compile-bytecode", "--python", str(path / "bin" / "python"), "-r", str(lock)])
        (path / ".complete").write_text(lock.name)
    return Venv(minor, pinned_airflow(lock), path)


def clean_env(venv: Venv, home: Path) -> dict[str, str]:
    """An environment with nothing of the caller's Airflow or Python path, for ``venv``'s Airflow."""
    keep = ("HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        {
            "PATH": f"{venv.bin}:/usr/local/bin:/usr/bin:/bin",
            "VIRTUAL_ENV": str(venv.path),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    return env
