"""A live Airflow for end-to-end tests: api-server, scheduler and dag-processor with the LocalExecutor.

The metadata database is a throwaway PostgreSQL database (LocalExecutor does not run on SQLite in
Airflow 3), created on the test server and dropped afterwards. Runs are triggered through the REST API
without a logical date and their states are read back from it, as a user or an outside system would.
SimpleAuthManager with one admin user whose password is generated; free ports; every process started in
its own session and stopped by process group id (SIGCONT first, so a test that paused one cannot leave
it behind)::

    with LiveAirflow.create(root, dags, lease_dsn=pg_dsn, lease_schema=schema) as airflow:
        airflow.start()
        run_id = airflow.trigger("my_dag")
        assert airflow.wait_run("my_dag", run_id) == "success"
        airflow.task_states("my_dag", run_id)   # {(task_id, map_index): state}
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psycopg2
from psycopg2 import sql
from psycopg2.extensions import make_dsn, parse_dsn
from sqlalchemy.engine import URL

from demo.deployment import free_port, warm_execution_api
from tests.airflow.harness import StatsdListener

if TYPE_CHECKING:
    from demo.deployment import MetadataTemplate

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).parents[2]
ADMIN = "admin"
FINISHED = {"success", "failed"}


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned), or fail naming ``what``."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def metadata_database(server_dsn: str, template: MetadataTemplate | None = None) -> Iterator[str]:
    """A fresh database on the server of ``server_dsn`` (a libpq DSN or URI), yielded as a SQLAlchemy URL:
    empty, or with ``template`` a copy of that migrated metadata database (on the same server)."""
    name = f"airflow_meta_{secrets.token_hex(6)}"
    admin = psycopg2.connect(server_dsn, connect_timeout=5)
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            if template is None:
                cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            else:
                cur.execute(
                    sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template.name))
                )
        params = parse_dsn(make_dsn(server_dsn))
        host = params.get("host")
        query = {"host": host} if host and host.startswith("/") else {}
        url = URL.create(
            "postgresql+psycopg2", username=params.get("user"), password=params.get("password"),
            host=None if query else host, port=int(params["port"]) if params.get("port") and not query else None,
            database=name, query=query,
        )
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        admin.close()


@dataclass
class LiveAirflow:
    """One Airflow deployment: its environment, its processes and a REST client."""

    root: Path
    env: dict[str, str]
    port: int
    password: str
    statsd: StatsdListener
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _token: str | None = None

    # -- building and tearing down -------------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def create(
        cls, root: Path, dags: Path, *, lease_dsn: str, lease_schema: str, extra_env: dict[str, str] | None = None,
        template: MetadataTemplate | None = None,
    ) -> Iterator[LiveAirflow]:
        """A migrated deployment reading ``dags``, its lease store at ``lease_dsn``/``lease_schema``; its
        metadata database a copy of ``template`` (the ``metadata_template`` fixture), else migrated here."""
        with metadata_database(lease_dsn, template) as metadata_url:
            home = root / "home"
            home.mkdir(parents=True)
            password = secrets.token_urlsafe(12)
            (home / "passwords.json").write_text(json.dumps({ADMIN: password}))
            port = free_port()
            statsd = StatsdListener()
            env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
            env.update(
                {
                    "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
                    "PYTHONPATH": str(REPO),
                    "AIRFLOW_HOME": str(home),
                    "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
                    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                    "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
                    "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                    "AIRFLOW__CORE__PARALLELISM": "8",
                    "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
                    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN}:admin",
                    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
                    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": metadata_url,
                    "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
                    "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
                    "AIRFLOW__API__WORKERS": "1",
                    "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                    "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",  # a changed file is parsed again anyway (mtime)
                    "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
                    "AIRFLOW__METRICS__STATSD_ON": "True",
                    "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
                    "AIRFLOW__METRICS__STATSD_PORT": str(statsd.port),
                    "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
                    "AIRFLOW_CONN_LEASE_DEFAULT": lease_dsn,
                    "AIRFLOW__LEASE__SCHEMA": lease_schema,
                }
            )
            env.update(extra_env or {})
            airflow = cls(root=root, env=env, port=port, password=password, statsd=statsd)
            try:
                if template is None:
                    airflow.cli("db", "migrate", timeout=600)
                yield airflow
            except BaseException:
                print(airflow.tails())  # pytest shows it with the failure
                raise
            finally:
                airflow.stop()
                statsd.close()
                shutil.rmtree(home / "logs", ignore_errors=True)

    def cli(self, *args: str, timeout: float = 300) -> str:
        """Run an ``airflow`` command to completion; its stdout."""
        result = subprocess.run(
            [str(VENV_BIN / "airflow"), *args], env=self.env, capture_output=True, text=True, timeout=timeout,
            check=False, start_new_session=True,
        )
        if result.returncode != 0:
            raise AssertionError(f"airflow {' '.join(args[:3])} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result.stdout

    def start(self, timeout: float = 300) -> None:
        """api-server (REST and execution API), scheduler and dag-processor; returns once the API answers."""
        for name, args in (
            ("api-server", ["api-server", "--host", "127.0.0.1", "--port", str(self.port)]),
            ("scheduler", ["scheduler", "--skip-serve-logs"]),
            ("dag-processor", ["dag-processor"]),
        ):
            with (self.root / f"{name}.log").open("wb") as log:
                self.procs[name] = subprocess.Popen(
                    [str(VENV_BIN / "airflow"), *args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        wait_until(self._healthy, timeout, "the api-server to answer")
        warm_execution_api(self.url)  # before a task's first call can time out on its cold start

    def _healthy(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.tails()}")
        try:
            return httpx.get(f"{self.url}/api/v2/version", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGCONT, then SIGTERM each process group; SIGKILL what is left after 30 s."""
        for proc in self.procs.values():
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()

    def tails(self) -> str:
        logs = [*sorted(self.root.glob("*.log")), *sorted((self.root / "home" / "logs").rglob("*.log"))]
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}" for p in logs)

    # -- the REST API ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._token is None:
            response = httpx.post(
                f"{self.url}/auth/token", json={"username": ADMIN, "password": self.password}, timeout=30
            )
            assert response.status_code == 201, response.text
            self._token = response.json()["access_token"]
        response = httpx.request(
            method, f"{self.url}/api/v2{path}", headers={"Authorization": f"Bearer {self._token}"}, timeout=60,
            **kwargs,
        )
        assert response.is_success, f"{method} {path}: {response.status_code} {response.text[:2000]}"
        return response.json()

    def wait_dag(self, dag_id: str, timeout: float = 240) -> None:
        """Until the dag-processor has parsed ``dag_id`` (with no import error)."""

        def parsed() -> bool:
            errors = self.api("GET", "/importErrors")["import_errors"]
            assert not errors, errors
            dags = self.api("GET", "/dags", params={"dag_id_pattern": dag_id})["dags"]
            return any(d["dag_id"] == dag_id for d in dags)

        wait_until(parsed, timeout, f"DAG {dag_id} to be parsed", interval=2)

    def trigger(self, dag_id: str) -> str:
        """A manual run with no logical date; its run id."""
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None})
        return str(run["dag_run_id"])

    def run_state(self, dag_id: str, run_id: str) -> str:
        return str(self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"])

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 300) -> str:
        """Until the run finishes; its state."""
        return str(
            wait_until(
                lambda: (state := self.run_state(dag_id, run_id)) in FINISHED and state, timeout,
                f"run {run_id} of {dag_id} to finish", interval=2,
            )
        )

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return list(self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"])

    def task_states(self, dag_id: str, run_id: str) -> dict[tuple[str, int], str | None]:
        return {(t["task_id"], t["map_index"]): t["state"] for t in self.task_instances(dag_id, run_id)}
