# Sourced by scripts/demo and scripts/test: creates .venv at the repo root from the pinned lock file
# (requirements/lock.txt) the first time, and again whenever the lock file or pyproject.toml changes.
# The lock holds the package's dependencies, its extras and the `test` dependency group (pyproject's
# [dependency-groups]; not a published extra), made with:
#   uv pip compile pyproject.toml --group test --extra embedded --extra statsd --extra s3 --extra sql --python-version 3.11 -o requirements/lock.txt
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.installed-from"
# The stamp also names how the venv is made ("bytecode": see below), so a venv made the old way is redone.
want="$( (cat "$ROOT/requirements/lock.txt" "$ROOT/pyproject.toml"; echo bytecode) | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "==> setting up $VENV from requirements/lock.txt (first run takes a minute)" >&2
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "Python >= 3.10 is required" >&2; exit 1; }
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # uv installs the ~480 pinned packages in seconds where pip takes minutes; it is pinned too.
  # --compile-bytecode: uv does not write .pyc files (pip does), and where PYTHONDONTWRITEBYTECODE is
  # set (these machines) no process writes them either, so every Airflow process compiled the ~2,300
  # modules it imports again: 3 of the 10 CPU seconds of an `airflow dags test`, 1.4 of `airflow version`.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv==0.13.9"
  "$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python" -r "$ROOT/requirements/lock.txt"
  "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --no-deps -e "$ROOT"
  echo "$want" > "$STAMP"
fi
# The checkout's own modules too (the package, its DAGs, the tests' and the demo's), into their
# __pycache__ (git ignores it): each task process imports them; a second run only checks mtimes.
"$VENV/bin/python" -m compileall -q -j 0 "$ROOT/airflow_lease_provider" "$ROOT/demo" "$ROOT/chaos" "$ROOT/tests" \
  "$ROOT/dags_examples" "$ROOT/bench" >/dev/null || true
export PATH="$VENV/bin:$PATH"
