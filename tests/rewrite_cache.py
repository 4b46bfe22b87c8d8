"""Write pytest's assertion-rewritten bytecode of every test module once, without importing them.

pytest rewrites the asserts of each test module (``test_*.py``, ``conftest.py``) as it imports it and
caches the result next to the module (``__pycache__/*-pytest-*.pyc``), unless ``PYTHONDONTWRITEBYTECODE``
is set, as it is on these machines: then each of the suite's test processes rewrote all of them again,
about 5 CPU s each, every run. ``scripts/test`` runs this first when the cache is missing (a fresh clone).
It writes the same files pytest's import hook would (its own functions, so the same code, file name and
hash-checked header) but imports no test module: about 4 CPU s against 12 for the full collection it
replaces (which imported Airflow). A module changed later is rewritten in memory by pytest, as before.

Usage: python -m tests.rewrite_cache [ROOT]   (exit 0 always: a failure here only costs time)
"""

from __future__ import annotations

import sys
from pathlib import Path


class _Quiet:
    """What ``_write_pyc`` wants of pytest's assertion state: a trace it calls on errors."""

    def trace(self, *args: object) -> None:
        return None


def main(root: Path) -> int:
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc, get_cache_dir

    written = 0
    for path in sorted((root / "tests").rglob("*.py")):
        if not (path.name.startswith("test_") or path.name == "conftest.py") or "__pycache__" in path.parts:
            continue
        cache_dir = get_cache_dir(path)
        pyc = cache_dir / (path.name[:-3] + PYC_TAIL)
        if _read_pyc(path, pyc, lambda *args: None) is not None:
            continue
        cache_dir.mkdir(exist_ok=True)
        source_hash, code = _rewrite_test(path, None)  # type: ignore[arg-type]  # no config: the ini's default hook
        written += _write_pyc(_Quiet(), code, source_hash, pyc)  # type: ignore[arg-type]
    return written


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    except Exception as exc:  # noqa: BLE001 - pytest's internals moved: the run rewrites in memory instead
        print(f"tests/rewrite_cache.py: not written ({exc.__class__.__name__}: {exc})", file=sys.stderr)
