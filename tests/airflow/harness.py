"""Real Airflow for end-to-end tests: an AIRFLOW_HOME per test, ``airflow dags test`` in a process of its
own: a child of the run's warm Airflow server (tests/airflow/warm.py), or with ``warm=None`` a new one.

The metadata database is SQLite, migrated once per session and copied for each home; the lease store
is the test PostgreSQL (``pg_dsn``) in the test's own schema. Two homes sharing one lease store are
two Airflow deployments sharing leases, which is what makes overlapping runs possible here.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from demo.deployment import StatsdListener
from tests.airflow.cli_batch import parts
from tests.airflow.warm import WarmRun, WarmServer

VENV_BIN = Path(sys.executable).parent
DAGS = Path(__file__).parent / "dags"
REPO = Path(__file__).parents[2]
EXAMPLES = REPO / "dags_examples"


_batch_parts = parts  # tests/cli/test_embedded_store.py reads a batch's output with it


def base_env(home: Path, dags: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "PATH": f"{VENV_BIN}:{env.get('PATH', '')}",
            "PYTHONPATH": str(Path(__file__).parents[2]),
        }
    )
    return env


def migrate_template(root: Path) -> Path:
    """An AIRFLOW_HOME with a migrated SQLite metadata database, to copy from."""
    home = root / "template"
    home.mkdir(parents=True)
    result = subprocess.run(
        ["airflow", "db", "migrate"], env=base_env(home, DAGS), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return home


def _batch_items(runs: list) -> tuple[list, list[list[str]]]:
    """The JSON items of tests/airflow/cli_batch.py for ``runs`` (gates as ``{"wait_for": path}``), and
    the ``dags test`` commands alone."""
    items: list = []
    commands: list[list[str]] = []
    for run in runs:
        if isinstance(run, Path):
            items.append({"wait_for": str(run)})
            continue
        dag_id, logical_date = (run, None) if isinstance(run, str) else run
        commands.append(["dags", "test", dag_id] + ([logical_date] if logical_date else []))
        items.append(commands[-1])
    return items, commands


def _batch_result(command: list[str], out: tuple[int, str], err: tuple[int, str]) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(["airflow", *command], out[0], out[1], err[1])


@dataclass
class BatchRun:
    """A background :meth:`AirflowHome.dags_test_many_background`: its runs' results as they finish."""

    proc: subprocess.Popen | WarmRun
    commands: list[list[str]]
    out: Path
    err: Path

    def result(self, index: int, timeout: float = 240) -> subprocess.CompletedProcess:
        """Run ``index``'s result, once it has finished (its output and exit status, as ``dags_test``)."""
        end = time.monotonic() + timeout
        while True:
            ended = self.proc.poll() is not None
            outs, errs = _batch_parts(self.out.read_text()), _batch_parts(self.err.read_text())
            if index in outs and index in errs:
                return _batch_result(self.commands[index], outs[index], errs[index])
            if ended or time.monotonic() > end:
                state = f"ended (status {self.proc.returncode})" if ended else f"ran {timeout} s"
                raise AssertionError(
                    f"the batch {state} before {self.commands[index]} finished:\n"
                    + self.out.read_text()[-3000:] + self.err.read_text()[-3000:]
                )
            time.sleep(0.2)


@dataclass
class AirflowHome:
    """One Airflow deployment for a test."""

    path: Path
    env: dict[str, str]
    statsd: StatsdListener | None = None
    procs: list[subprocess.Popen | WarmRun] = field(default_factory=list)
    #: The warm Airflow that runs this home's foreground commands (:meth:`cli`, :meth:`dags_test`,
    #: :meth:`dags_test_many`); without one, each is a process of its own. Background runs always are.
    warm: WarmServer | None = None
    batches: int = 0

    def cli(self, args: list[str], timeout: int = 240, **kw: str) -> subprocess.CompletedProcess:
        """``airflow ARGS`` with this home's environment (``kw`` added to it): a process of its own, or a
        child of the warm server (:mod:`tests.airflow.warm`) when the home has one."""
        if self.warm is None:
            return subprocess.run(["airflow", *args], env={**self.env, **kw}, capture_output=True, text=True,
                                  timeout=timeout)
        self.batches += 1
        return self.warm.cli({**self.env, **kw}, args, self.path / f"warm-{self.batches}", timeout)

    def dags_test(self, dag_id: str, logical_date: str | None = None, timeout: int = 240, **kw) -> subprocess.CompletedProcess:
        return self.cli(["dags", "test", dag_id] + ([logical_date] if logical_date else []), timeout, **kw)

    def _batch(self, items: list, timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        """tests/airflow/cli_batch.py with ``items``, in a process of its own or in a child of the warm
        server: its exit status, stdout and stderr."""
        env = {**self.env, **(env or {})}
        if self.warm is None:
            done = subprocess.run([sys.executable, "-m", "tests.airflow.cli_batch", json.dumps(items)],
                                  env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            return done.returncode, done.stdout, done.stderr
        self.batches += 1
        out, err = self.path / f"warm-{self.batches}.out", self.path / f"warm-{self.batches}.err"
        status = self.warm.run(env, items, out, err, timeout)
        return status, out.read_text(errors="replace"), err.read_text(errors="replace")

    def dags_test_many(
        self, runs: list[str | tuple[str, str | None]], timeout: int = 240
    ) -> list[subprocess.CompletedProcess]:
        """``airflow dags test`` of each run in turn (a DAG id, or a DAG id and logical date), as
        :meth:`dags_test` runs them but all in one process (tests/airflow/cli_batch.py): Airflow starts
        once, which is most of a run's CPU. Each result has its own run's output and exit status;
        ``timeout`` is per run."""
        items, commands = _batch_items(runs)
        status, stdout, stderr = self._batch(items, timeout * len(commands))
        outs, errs = _batch_parts(stdout), _batch_parts(stderr)
        results = []
        for index, command in enumerate(commands):
            if index not in outs or index not in errs:
                raise AssertionError(
                    f"the batch ended (status {status}) before {command} finished:\n" + stdout[-3000:] + stderr[-3000:]
                )
            results.append(_batch_result(command, outs[index], errs[index]))
        return results

    def dags_test_many_background(self, runs: list[str | tuple[str, str | None] | Path]) -> BatchRun:
        """:meth:`dags_test_many` started in the background; a :class:`~pathlib.Path` among the runs is a
        gate: the next run starts once that file exists (the test acts in between). Each run's result from
        :meth:`BatchRun.result` (its index counts runs only)."""
        items, commands = _batch_items(runs)
        name = f"batch-{len(self.procs)}"
        out, err = self.path / f"{name}.out", self.path / f"{name}.err"
        proc: subprocess.Popen | WarmRun
        if self.warm is not None:
            out.touch()
            err.touch()
            proc = WarmRun(self.warm, self.env, items, out, err)
        else:
            with open(out, "w") as stdout, open(err, "w") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.airflow.cli_batch", json.dumps(items)],
                    env=self.env, cwd=REPO, stdout=stdout, stderr=stderr, text=True,
                )
        self.procs.append(proc)
        return BatchRun(proc, commands, out, err)

    def dags_test_background(self, dag_id: str, logical_date: str | None = None) -> subprocess.Popen | WarmRun:
        """``airflow dags test`` in the background, its stdout and stderr in ``<home>/<dag_id>.log``."""
        args = ["dags", "test", dag_id] + ([logical_date] if logical_date else [])
        path = self.path / f"{dag_id}.log"
        proc: subprocess.Popen | WarmRun
        if self.warm is not None:
            proc = WarmRun(self.warm, self.env, [args], path, path)
        else:
            log = open(path, "w")  # noqa: SIM115 - closed with the process
            proc = subprocess.Popen(["airflow", *args], env=self.env, stdout=log, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def task_states(self, dag_id: str | None = None) -> dict[tuple[str, int], str]:
        """(task_id, map_index) -> state, over every run in this home's metadata database (of one DAG's
        runs with ``dag_id``)."""
        conn = sqlite3.connect(self.path / "airflow.db")
        try:
            if dag_id is None:
                rows = conn.execute("SELECT task_id, map_index, state FROM task_instance").fetchall()
            else:
                rows = conn.execute(
                    "SELECT task_id, map_index, state FROM task_instance WHERE dag_id = ?", (dag_id,)
                ).fetchall()
        finally:
            conn.close()
        return {(t, m): s for t, m, s in rows}

    def task_seconds(self, task_id: str, map_index: int = -1) -> float:
        """How long the task instance ran, start to end, by Airflow's own record (its ``duration``)."""
        conn = sqlite3.connect(self.path / "airflow.db")
        try:
            (value,) = conn.execute(
                "SELECT duration FROM task_instance WHERE task_id = ? AND map_index = ?", (task_id, map_index)
            ).fetchone()
        finally:
            conn.close()
        assert value is not None, f"{task_id} has no duration: it did not end"
        return float(value)

    def xcom(self, task_id: str, key: str) -> object:
        conn = sqlite3.connect(self.path / "airflow.db")
        try:
            row = conn.execute(
                "SELECT value FROM xcom WHERE task_id = ? AND key = ? ORDER BY timestamp DESC", (task_id, key)
            ).fetchone()
        finally:
            conn.close()
        if row is None:
            return None
        value = row[0]
        return json.loads(value) if isinstance(value, str | bytes) else value

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        if self.statsd:
            self.statsd.close()


def make_home(template: Path, root: Path, name: str, *, dsn: str, schema: str, dags: Path = DAGS,
              statsd: bool = True, extra_env: dict[str, str] | None = None,
              warm: WarmServer | None = None) -> AirflowHome:
    path = root / name
    path.mkdir(parents=True)
    shutil.copy(template / "airflow.db", path / "airflow.db")
    env = base_env(path, dags)
    # Named outright (it is AIRFLOW_HOME's airflow.db either way): a warm child has the server's home.
    env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{path / 'airflow.db'}"
    env["AIRFLOW_CONN_LEASE_DEFAULT"] = dsn
    env["AIRFLOW__LEASE__SCHEMA"] = schema
    listener = None
    if statsd:
        listener = StatsdListener()
        env.update(
            {
                "AIRFLOW__METRICS__STATSD_ON": "True",
                "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
                "AIRFLOW__METRICS__STATSD_PORT": str(listener.port),
                "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
            }
        )
    env.update(extra_env or {})
    return AirflowHome(path, env, listener, warm=warm)
