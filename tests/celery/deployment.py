"""A CeleryExecutor Airflow for the tests: Redis broker, PostgreSQL metadata, two workers.

One deployment per test module (starting it costs about a minute on two cores):

* a throwaway metadata database (``CREATE DATABASE`` on the test server: ``LEASE_TEST_DSN``'s, or the
  embedded PostgreSQL), dropped afterwards; the lease store is a schema in it;
* the machine's Redis at 127.0.0.1:6379 as the Celery broker, in a database number of its own (one of
  1-15 that no other deployment has claimed: ``demo.deployment.claim_redis_db``, flushed after); started
  if it is down;
* ``airflow api-server`` (REST API with SimpleAuthManager, everyone admin, and the execution API),
  ``scheduler``, ``dag-processor``, and two ``airflow celery worker`` processes with the Celery host
  names ``worker-a@...`` and ``worker-b@...``. Worker A serves queues ``a`` and ``default``, worker B
  ``b`` and ``default``; a DAG task's ``queue=`` steers it to one worker.
* each worker reaches the lease store through a proxy of its own (:class:`StoreProxy`), so a test can
  cut one worker off the store; each reports its own host name (``tests.celery.hostname``).

Heartbeat thresholds are short (``[scheduler] task_instance_heartbeat_timeout = 10``), so that a frozen
or killed worker's task is declared dead and retried within seconds.

Every process runs in its own session. The supervisor puts each task in a process group of its own,
so teardown also kills every process whose environment carries this deployment's id.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from demo.deployment import (
    REDIS_HOST,
    REDIS_PORT,
    claim_redis_db,
    free_port,
    release_redis_db,
    warm_execution_api,
)
from demo.deployment import ensure_redis as ensure_redis
from demo.store_proxy import StoreProxy, upstream_of
from tests.pg import scratch_dir

AIRFLOW = str(Path(sys.executable).parent / "airflow")
REPO = Path(__file__).resolve().parents[2]
DAGS = Path(__file__).parent / "dags"
LEASE_SCHEMA = "lease_celery"
WORKERS = ("a", "b")
#: Seconds without a heartbeat before the scheduler fails a running task instance (Airflow: 300).
HEARTBEAT_TIMEOUT = 10


def _with_dbname(dsn: str, dbname: str) -> dict[str, str]:
    info = psycopg2.extensions.parse_dsn(dsn)
    info["dbname"] = dbname
    return info


def _sqlalchemy_url(info: dict[str, str]) -> str:
    """A SQLAlchemy URL for Airflow; the host may be a Unix socket directory (the embedded server)."""
    user = info.get("user") or "postgres"
    password = info.get("password") or ""
    host = info.get("host") or "127.0.0.1"
    port = info.get("port") or "5432"
    auth = f"{user}:{password}@" if password else f"{user}@"
    if host.startswith("/"):
        return f"postgresql+psycopg2://{auth}/{info['dbname']}?host={host}&port={port}"
    return f"postgresql+psycopg2://{auth}{host}:{port}/{info['dbname']}"


class Deployment:
    def __init__(self, server_dsn: str, root: Path, template: str | None = None) -> None:
        """``template``: a migrated metadata database on the same server (the ``metadata_template``
        fixture's name) to copy, instead of migrating this deployment's own."""
        self.root = root
        self.template = template
        self.id = secrets.token_hex(8)
        self.server_dsn = server_dsn
        self.dbname = f"lease_celery_{self.id}"
        self.metadata = _with_dbname(server_dsn, self.dbname)
        self.lease_dsn = psycopg2.extensions.make_dsn(**self.metadata)
        self.redis_db = claim_redis_db(self.dbname)
        self.api_port = free_port()
        self.markers = root / "markers"
        self.logs = root / "process-logs"
        self.home = root / "home"
        for path in (self.markers, self.logs, self.home):
            path.mkdir(parents=True)
            path.chmod(0o777)
        self.proxies = {name: StoreProxy(upstream_of(self.metadata)) for name in WORKERS}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.hostnames = {name: f"worker-{name}.lease-test" for name in WORKERS}
        self.celery_names = {name: f"worker-{name}@{self.hostnames[name]}" for name in WORKERS}
        self._token: str | None = None
        self.env = self._base_env()

    # -- setup ----------------------------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        broker = f"redis://{REDIS_HOST}:{REDIS_PORT}/{self.redis_db}"
        env.update(
            {
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
                "PYTHONPATH": str(REPO),
                "LEASE_CELERY_DEPLOYMENT": self.id,
                "LEASE_TEST_MARKERS": str(self.markers),
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tests.celery.hostname.get",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{self.api_port}/execution/",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": _sqlalchemy_url(self.metadata),
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__API__PORT": str(self.api_port),
                "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
                "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
                "AIRFLOW__CELERY__BROKER_URL": broker,
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
                "AIRFLOW__CELERY__WORKER_PREFETCH_MULTIPLIER": "1",
                "AIRFLOW__OPERATORS__DEFAULT_QUEUE": "default",
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
                "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
                "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",  # a changed file is parsed again anyway (mtime)
                "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
                # Schedulers, API server, DAG processor: the store directly (workers get their own below).
                "AIRFLOW_CONN_LEASE_DEFAULT": self._lease_uri(None),
                "AIRFLOW__LEASE__SCHEMA": LEASE_SCHEMA,
            }
        )
        return env

    def _lease_uri(self, worker: str | None) -> str:
        if worker is None:
            return self.lease_dsn
        user = self.metadata.get("user") or "postgres"
        return f"postgresql://{user}@127.0.0.1:{self.proxies[worker].port}/{self.dbname}?connect_timeout=5"

    def worker_env(self, name: str) -> dict[str, str]:
        return {
            **self.env,
            "LEASE_TEST_HOSTNAME": self.hostnames[name],
            "AIRFLOW_CONN_LEASE_DEFAULT": self._lease_uri(name),
        }

    def create_database(self) -> None:
        admin = psycopg2.connect(self.server_dsn)
        admin.autocommit = True
        try:
            with admin.cursor() as cur:
                if self.template is None:
                    cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.dbname)))
                else:
                    cur.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                        sql.Identifier(self.dbname), sql.Identifier(self.template)))
        finally:
            admin.close()

    def drop_database(self) -> None:
        admin = psycopg2.connect(self.server_dsn)
        admin.autocommit = True
        try:
            with admin.cursor() as cur:
                cur.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (self.dbname,)
                )
                cur.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(self.dbname)))
        finally:
            admin.close()

    def flush_redis(self) -> None:
        release_redis_db(self.redis_db, self.dbname)

    def airflow(self, *args: str, timeout: float = 600) -> str:
        result = subprocess.run(
            [AIRFLOW, *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if result.returncode != 0:
            raise AssertionError(f"airflow {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result.stdout

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [AIRFLOW, *args], env=env or self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def start_worker(self, name: str) -> None:
        queues = f"{name},default"
        self.spawn(
            f"worker-{name}",
            ["celery", "worker", "--celery-hostname", self.celery_names[name], "--queues", queues,
             "--concurrency", "2", "--skip-serve-logs", "--without-mingle", "--without-gossip"],
            env=self.worker_env(name),
        )

    def start(self) -> None:
        self.create_database()
        if self.template is None:
            self.airflow("db", "migrate")
        self.spawn("api-server", ["api-server", "--host", "127.0.0.1", "--port", str(self.api_port)])
        self.spawn("scheduler", ["scheduler", "--skip-serve-logs"])
        self.spawn("dag-processor", ["dag-processor"])
        for name in WORKERS:
            self.start_worker(name)
        self.wait(self._api_ready, "the api-server to answer", timeout=240)
        # Before a worker's task calls it: a cold execution API builds its routes on the first request,
        # and a task whose calls time out meanwhile fails before it starts (a red run, as the deployment
        # tier's was: demo.deployment.warm_execution_api).
        warm_execution_api(f"http://127.0.0.1:{self.api_port}")
        self.wait_workers(WORKERS)
        self.wait(self._dags_parsed, "the DAG processor to parse the test DAGs", timeout=240)

    # -- Celery ---------------------------------------------------------------------------------------

    def celery(self) -> Any:
        from celery import Celery

        return Celery(broker=self.env["AIRFLOW__CELERY__BROKER_URL"])

    def wait_workers(self, names: tuple[str, ...] | list[str], timeout: float = 240) -> None:
        app = self.celery()
        wanted = {self.celery_names[n] for n in names}
        try:
            def ready() -> bool:
                replies = app.control.ping(destination=list(wanted), timeout=1.0) or []
                return wanted <= {name for reply in replies for name in reply}

            self.wait(ready, f"Celery workers {sorted(wanted)} to answer a ping", timeout=timeout)
        finally:
            app.close()

    def add_queue(self, worker: str, queue: str) -> None:
        """Make ``worker`` consume ``queue`` too (Celery remote control), e.g. the queue of a dead worker."""
        app = self.celery()
        try:
            replies = app.control.add_consumer(queue, destination=[self.celery_names[worker]], reply=True, timeout=5)
            assert replies, f"{self.celery_names[worker]} did not confirm consuming {queue!r}"
        finally:
            app.close()

    def remove_queue(self, worker: str, queue: str) -> None:
        app = self.celery()
        try:
            app.control.cancel_consumer(queue, destination=[self.celery_names[worker]], reply=True, timeout=5)
        finally:
            app.close()

    # -- REST API -------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def _api_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/api/v2/version", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def token(self) -> str:
        if self._token is None:
            response = httpx.get(f"{self.url}/auth/token", timeout=30)
            assert response.status_code in (200, 201), response.text
            self._token = str(response.json()["access_token"])
        return self._token

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = httpx.request(
            method, f"{self.url}/api/v2{path}", headers={"Authorization": f"Bearer {self.token()}"},
            timeout=30, **kwargs,
        )
        assert response.status_code < 300, f"{method} {path}: {response.status_code} {response.text[:2000]}"
        return response.json()

    def _dags_parsed(self) -> bool:
        try:
            dags = self.api("GET", "/dags", params={"limit": 100})
        except (AssertionError, httpx.HTTPError):
            return False
        return len(dags["dags"]) >= EXPECTED_DAGS

    def trigger(self, dag_id: str) -> str:
        """Trigger a run through the REST API with no logical date; returns its run id."""
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None})
        return str(run["dag_run_id"])

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        ti: dict[str, Any] = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")
        return ti

    def task_state(self, dag_id: str, run_id: str, task_id: str) -> str | None:
        """The task instance's state, or None while the scheduler has not created it yet."""
        response = httpx.get(
            f"{self.url}/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}",
            headers={"Authorization": f"Bearer {self.token()}"}, timeout=30,
        )
        if response.status_code == 404:
            return None
        assert response.status_code == 200, f"{response.status_code} {response.text[:2000]}"
        state = response.json()["state"]
        return None if state is None else str(state)

    def tries(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        data = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/tries")
        return list(data["task_instances"])

    def run_state(self, dag_id: str, run_id: str) -> str:
        return str(self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"])

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 240) -> str:
        finished: list[str] = []

        def done() -> bool:
            state = self.run_state(dag_id, run_id)
            finished[:] = [state]
            return state in ("success", "failed")

        self.wait(done, f"run {dag_id}/{run_id} to finish", timeout=timeout)
        return finished[0]

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str) -> Any:
        entry = self.api(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
            params={"deserialize": "true"},
        )
        return entry["value"]

    # -- markers written by the test DAGs -------------------------------------------------------------

    def marker(self, name: str) -> Path:
        return self.markers / name

    def write_marker(self, name: str, text: str = "go") -> None:
        path = self.marker(name)
        path.write_text(text)
        path.chmod(0o666)

    # -- processes --------------------------------------------------------------------------------------

    def signal_worker(self, name: str, sig: signal.Signals) -> None:
        """Send ``sig`` to worker ``name``'s process group: the Celery main process and its pool."""
        os.killpg(self.procs[f"worker-{name}"].pid, sig)

    def wait(self, condition: Callable[[], Any], what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if condition():
                return
            for name, proc in self.procs.items():
                if proc.poll() is not None and not name.endswith("-killed"):
                    raise AssertionError(f"{name} exited with {proc.returncode} while waiting for {what}:\n{self.tails()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{self.tails()}")
            time.sleep(0.5)

    def tails(self, size: int = 3000) -> str:
        return "\n".join(
            f"--- {path.name} ---\n{path.read_text(errors='replace')[-size:]}" for path in sorted(self.logs.glob("*.log"))
        )

    def task_logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted((self.home / "logs").rglob("*.log")))

    def _ours(self) -> list[int]:
        """Every live process whose environment carries this deployment's id (task groups included)."""
        needle = f"LEASE_CELERY_DEPLOYMENT={self.id}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found

    def stop(self) -> None:
        for pid in self._ours():  # resume anything a test froze, so that SIGTERM can be handled
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for _ in range(3):
            left = self._ours()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for proxy in self.proxies.values():
            proxy.close()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            with contextlib.suppress(Exception):
                self.flush_redis()
            with contextlib.suppress(psycopg2.Error):
                self.drop_database()


#: The DAGs in tests/celery/dags (the deployment waits until all are parsed).
EXPECTED_DAGS = 6


def new_root() -> Path:
    return scratch_dir("lease-celery-")
