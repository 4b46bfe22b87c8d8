"""One real Airflow deployment (for a test module, or a fault run of ``python -m chaos --airflow``): the processes Airflow runs in production, on PostgreSQL.

``airflow api-server`` (public API ``/api/v2``, the execution API the workers talk to, the UI and the
lease plugin), ``airflow scheduler`` (LocalExecutor, or CeleryExecutor with ``airflow celery worker``
processes on the machine's Redis as the broker) and ``airflow dag-processor``, each on a free port
and in its own session, with a throwaway PostgreSQL database for Airflow's metadata (LocalExecutor cannot
run on SQLite in Airflow 3). The lease store is the same database (its ``airflow_lease`` schema), so
dropping the database removes everything a module left behind.

The metadata database is migrated once per session into a template database and each deployment is a
``CREATE DATABASE ... TEMPLATE`` copy of it (a second instead of a minute of ``airflow db migrate``).

Tests drive it only through the doors a user has: runs are triggered through the REST API (with no
logical date unless a test gives one), tasks are cleared through it, and run states, task states,
XComs and task logs are read back through it (:class:`demo.airflow_api.AirflowAPI`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg2
from psycopg2 import sql

from demo.airflow_api import AirflowAPI, wait

VENV_BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "dags_examples"
DEMO_DAGS = ROOT / "demo" / "dags"
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
# The machine page's command (env/machines/python-svc.md), used when Redis is down.
REDIS_START = [
    "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1", "--port", "6379", "--save", "",
    "--appendonly", "no", "--dir", "/var/lib/redis", "--logfile", "/var/log/redis/ci.log",
]
#: The key a deployment sets in the Redis database it takes as its broker (one database per deployment).
REDIS_CLAIM = "airflow-lease-test:claimed-by"
#: SimpleAuthManager users of the deployment: name -> role. The password of each is its name + "-pw".
USERS = {"admin": "admin", "viewer": "viewer"}


def warm_execution_api(url: str, timeout: float = 240) -> None:
    """Make the api-server at ``url`` build its execution API before a task needs it.

    The execution API (Cadwyn) generates its versioned routes on its first request, in the api-server's
    event loop: 34 s on a loaded 2-core machine, while a task's first call (``ti run``) gives up after five
    5 s attempts and the task fails before it starts (a red run of the deployment tier). One request to
    its health endpoint, waited for, does it first.
    """
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/execution/health", timeout=max(1.0, deadline - time.monotonic())).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the execution API at {url}/execution did not answer within {timeout:g} s")
        time.sleep(0.5)


def scratch_dir(prefix: str) -> Path:
    """A directory the embedded server's unprivileged system user can enter (pytest's are 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


class StatsdListener:
    """A UDP socket collecting statsd packets, to check the metrics a task emitted."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.packets: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65535)
            except OSError:
                continue
            self.packets.extend(data.decode(errors="replace").splitlines())

    def count(self, metric: str) -> int:
        """Sum of a counter's increments (``prefix.metric:1|c``)."""
        total = 0
        for line in self.packets:
            name, _, rest = line.partition(":")
            if name.endswith(metric) and rest.endswith("|c"):
                total += int(rest.split("|")[0])
        return total

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port on 127.0.0.1 that nothing listens on now (TCP, or UDP with ``socket.SOCK_DGRAM``)."""
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def ensure_redis() -> None:
    """Redis at 127.0.0.1:6379 answers PING, or is started with the machine's command, or we fail clearly."""
    import redis

    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_connect_timeout=2)
    try:
        client.ping()
        return
    except redis.RedisError:
        pass
    if shutil.which("redis-server") is None:
        raise RuntimeError(
            "the Celery deployments need Redis at 127.0.0.1:6379 and it is down, and redis-server is not "
            "installed (apt-get install redis-server)"
        )
    for directory in ("/var/lib/redis", "/var/log/redis"):
        Path(directory).mkdir(parents=True, exist_ok=True)
    subprocess.run(REDIS_START, check=False, capture_output=True, timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            client.ping()
            return
        except redis.RedisError:
            time.sleep(0.3)
    raise RuntimeError(f"Redis at 127.0.0.1:6379 is down and did not start with: {' '.join(REDIS_START)}")


def claim_redis_db(owner: str) -> int:
    """A Redis database (1-15) no other deployment uses, flushed and marked as ``owner``'s.

    Two deployments on one broker database would take each other's tasks (and a flush would drop them):
    the claim is an atomic ``SET NX`` of :data:`REDIS_CLAIM` in the database, kept until
    :func:`release_redis_db` (an hour at most, should the owner die).
    """
    import redis

    ensure_redis()
    numbers = list(range(1, 16))
    secrets.SystemRandom().shuffle(numbers)
    for number in numbers:
        client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=number)
        try:
            if client.set(REDIS_CLAIM, owner, nx=True, ex=3600):
                for key in client.scan_iter(count=1000):  # what a dead owner left
                    if key != REDIS_CLAIM.encode():
                        client.delete(key)
                return number
        finally:
            client.close()
    raise RuntimeError("every Redis database 1-15 is claimed by a running deployment")


def release_redis_db(number: int, owner: str) -> None:
    """Flush ``number`` (the broker's queues and results) if ``owner`` still holds it."""
    import redis

    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=number)
    try:
        if client.get(REDIS_CLAIM) == owner.encode():
            client.flushdb()
    finally:
        client.close()


def with_database(dsn: str, database: str) -> str:
    """``dsn`` (a ``postgresql://`` URI, TCP or Unix socket) pointing at another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


def connection_json(dsn: str) -> str:
    """An Airflow connection (JSON form) for ``dsn``: TCP or a Unix socket directory as the host."""
    parts = psycopg2.extensions.parse_dsn(dsn)
    conn = {"conn_type": "postgres", "host": parts.get("host"), "port": int(parts.get("port") or 5432),
            "login": parts.get("user"), "password": parts.get("password") or None, "schema": parts.get("dbname")}
    return json.dumps({k: v for k, v in conn.items() if v is not None})


def _admin(dsn: str) -> Any:
    conn = psycopg2.connect(dsn, connect_timeout=10)
    conn.autocommit = True
    return conn


def drop_database(admin_dsn: str, name: str) -> None:
    conn = _admin(admin_dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
    finally:
        conn.close()


def base_env(home: Path, dags: Path, metadata_dsn: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": metadata_dsn.replace("postgresql://", "postgresql+psycopg2://", 1),
            "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),
        }
    )
    return env


class MetadataTemplate:
    """A migrated Airflow metadata database to copy deployments from (one per test session)."""

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self.name = f"lease_tier_tmpl_{secrets.token_hex(4)}"
        self.root = scratch_dir("lease-tier-tmpl-")
        conn = _admin(admin_dsn)
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        finally:
            conn.close()
        try:
            env = base_env(self.root, self.root, with_database(admin_dsn, self.name))
            result = subprocess.run([str(VENV_BIN / "airflow"), "db", "migrate"], env=env, capture_output=True,
                                    text=True, timeout=600, check=False, start_new_session=True)
            if result.returncode != 0:
                raise AssertionError(f"airflow db migrate failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        except BaseException:
            self.drop()
            raise

    @classmethod
    def existing(cls, admin_dsn: str, name: str) -> MetadataTemplate:
        """A template another process migrated (its owner drops it, not this object)."""
        template = cls.__new__(cls)
        template.admin_dsn, template.name, template.root = admin_dsn, name, scratch_dir("lease-tier-tmpl-")
        return template

    def copy(self) -> tuple[str, str]:
        """A new database copied from the template: its name and DSN."""
        name = f"lease_tier_{secrets.token_hex(5)}"
        conn = _admin(self.admin_dsn)
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(self.name)))
        finally:
            conn.close()
        return name, with_database(self.admin_dsn, name)

    def drop(self) -> None:
        drop_database(self.admin_dsn, self.name)
        shutil.rmtree(self.root, ignore_errors=True)


EXECUTORS = ("local", "celery", "edge")
#: The Celery workers of a ``celery`` deployment (each ``--concurrency`` 2, all on the ``default`` queue).
CELERY_WORKERS = ("a", "b")
#: The executor of an ``edge`` deployment (apache-airflow-providers-edge3, the test group's).
EDGE_EXECUTOR = "airflow.providers.edge3.executors.EdgeExecutor"
#: What an Edge worker's environment never gets from the deployment's: the metadata database, its Fernet
#: key, the UI's session secret and any connection (a lease connection above all). It reaches the api-server,
#: nothing else (issue 41); it keeps ``[api_auth] jwt_secret``, which edge3 signs its requests with.
EDGE_WORKER_HIDDEN = ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API__SECRET_KEY",
                      "AIRFLOW_CONN_")


def socket_file(dsn: str) -> Path | None:
    """The Unix socket file of a PostgreSQL DSN whose host is a socket directory; None for TCP."""
    parts = psycopg2.extensions.parse_dsn(dsn)
    host = parts.get("host") or ""
    return Path(host) / f".s.PGSQL.{parts.get('port') or 5432}" if host.startswith("/") else None


class Deployment:
    """A running Airflow (api-server, scheduler, dag-processor, with ``triggerer=True`` a triggerer;
    LocalExecutor, or CeleryExecutor and two Celery workers, or EdgeExecutor and the Edge workers a test
    starts with :meth:`start_edge_worker`) with the given DAG files. ``lease_default=False`` defines no
    ``lease_default`` connection (the lease store is then the metadata database's, through the api-server:
    docs/api.md).

    ``executor="edge"``: edge3's API on the api-server (``[edge] api_enabled``), and no ``lease_default``
    anywhere: the api-server's lease store is the metadata database's schema (docs/api.md, decision 2)."""

    def __init__(self, template: MetadataTemplate, dag_files: list[Path], *,
                 extra_env: dict[str, str] | None = None, executor: str = "local", triggerer: bool = False,
                 lease_default: bool = True) -> None:
        if executor not in EXECUTORS:
            raise ValueError(f"executor={executor!r}: expected one of {', '.join(EXECUTORS)}")
        self.executor = executor
        #: Whether ``start`` also starts ``airflow triggerer`` (deferred tasks, ``on_overlap="wait"``).
        self.triggerer = triggerer
        #: The statsd packets the deployment's processes and tasks sent (``statsd.count(metric)``).
        self.statsd = StatsdListener()
        self.template = template
        self.root = scratch_dir("lease-tier-")
        self.home = self.root / "home"
        self.dags = self.root / "dags"
        self.logs = self.root / "process-logs"
        for path in (self.home, self.dags, self.logs):
            path.mkdir()
        for source in dag_files:
            shutil.copy(source, self.dags / source.name)
        self.database, self.dsn = template.copy()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (self.home / "passwords.json").write_text(json.dumps({u: f"{u}-pw" for u in USERS}))
        self.env = base_env(self.home, self.dags, self.dsn)
        self.env.update(
            {
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{u}:{r}" for u, r in USERS.items()),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
                "AIRFLOW__CORE__PARALLELISM": "8",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__BASE_URL": self.url,
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
                "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
                # One Fernet key for every process: without it each process that starts first may write a
                # key of its own into airflow.cfg (or run with none), and a connection added by the CLI
                # cannot be read by the api-server (a 500 on /api/v2/connections, a 404 to a task).
                "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                # A file is parsed again when its mtime changes (the default modified_time order), so re-parsing
                # unchanged files every 30 s only burned CPU: about 3.4 CPU s a minute with 12 DAG files.
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
                "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
                "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "True",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW_CONN_LEASE_DEFAULT": connection_json(self.dsn),
                "AIRFLOW__METRICS__STATSD_ON": "True",
                "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
                "AIRFLOW__METRICS__STATSD_PORT": str(self.statsd.port),
                "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
                "LEASE_EXAMPLES_SCHEMA": "public",
            }
        )
        self.redis_db: int | None = None
        if executor == "celery":
            self.redis_db = claim_redis_db(self.database)
            self.env.update({
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                "AIRFLOW__CELERY__BROKER_URL": f"redis://{REDIS_HOST}:{REDIS_PORT}/{self.redis_db}",
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
                "AIRFLOW__CELERY__WORKER_PREFETCH_MULTIPLIER": "1",
                "AIRFLOW__OPERATORS__DEFAULT_QUEUE": "default",
            })
        if not lease_default or executor == "edge":
            # No lease connection anywhere (issue 41): the api-server's store is the metadata database's
            # schema (docs/api.md, decision 2), and a task with access=auto takes the lease API.
            self.env.pop("AIRFLOW_CONN_LEASE_DEFAULT", None)
        if executor == "edge":
            self.env.update({
                "AIRFLOW__CORE__EXECUTOR": EDGE_EXECUTOR,
                "AIRFLOW__EDGE__API_ENABLED": "True",
                "AIRFLOW__EDGE__API_URL": f"{self.url}/edge_worker/v1/rpcapi",
                "AIRFLOW__EDGE__JOB_POLL_INTERVAL": "1",
                "AIRFLOW__EDGE__HEARTBEAT_INTERVAL": "5",
            })
        self.env.update(extra_env or {})
        self.started: list[subprocess.Popen[bytes]] = []
        #: The running Celery worker of each name (a worker started again replaces its entry).
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        #: The running Edge worker of each name (``start_edge_worker``), and the network namespaces the
        #: isolated ones run in (deleted by ``stop``).
        self.edge_workers: dict[str, subprocess.Popen[bytes]] = {}
        self.namespaces: list[str] = []
        self.api = AirflowAPI(self.url, "admin", "admin-pw")

    # -- processes ----------------------------------------------------------------------------------

    def _start(self, name: str, *args: str, env: dict[str, str] | None = None,
               command: list[str] | None = None) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as out:
            process = subprocess.Popen(
                command or [str(VENV_BIN / "airflow"), *args], env=self.env if env is None else env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.started.append(process)
        return process

    def edge_worker_env(self, name: str) -> dict[str, str]:
        """An Edge worker's environment: a home of its own (its task logs, pushed to the api-server from
        there), the api-server's URLs and JWT secret (edge3 signs its requests with it), and none of
        :data:`EDGE_WORKER_HIDDEN`: no metadata database, no connection."""
        home = self.root / f"edge-{name}"
        home.mkdir(exist_ok=True)
        env = {k: v for k, v in self.env.items() if not k.startswith(EDGE_WORKER_HIDDEN)}
        env["AIRFLOW_HOME"] = str(home)
        return env

    def start_edge_worker(self, name: str, *, isolated: bool = True) -> subprocess.Popen[bytes]:
        """Start ``airflow edge worker`` as ``edge-<name>`` (an ``edge`` deployment).

        ``isolated`` (root, ``ip``, ``unshare`` and ``socat``): in a network namespace of its own whose only
        interface is its loopback, where ``127.0.0.1:<api-server port>`` is a socat forward over a Unix
        socket to the api-server, so the metadata database's TCP port (and any other) does not answer; in
        a mount namespace where the database's Unix socket file, when it has one, is ``/dev/null``. The
        worker then reaches the api-server and nothing else, as an Edge worker on a remote site."""
        if self.executor != "edge":
            raise ValueError("start_edge_worker needs an executor='edge' deployment")
        env = self.edge_worker_env(name)
        worker = [str(VENV_BIN / "airflow"), "edge", "worker", "--edge-hostname", f"edge-{name}",
                  "--concurrency", "4"]
        if not isolated:
            self.edge_workers[name] = self._start(f"edge-{name}", env=env, command=worker)
            return self.edge_workers[name]
        namespace = f"lease-edge-{secrets.token_hex(4)}"
        subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True, timeout=30)
        self.namespaces.append(namespace)
        subprocess.run(["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"], check=True,
                       capture_output=True, timeout=30)
        bridge = self.root / f"edge-{name}-api.sock"
        self._start(f"edge-{name}-bridge", command=[
            "socat", f"UNIX-LISTEN:{bridge},fork,unlink-early", f"TCP:127.0.0.1:{self.port}"])
        wait(bridge.exists, bool, 30, "the Edge worker's socat bridge", interval=0.1)
        hidden = socket_file(self.dsn)
        script = (
            'set -e; if [ -n "$1" ]; then mount --bind /dev/null "$1"; fi; '
            'socat "TCP-LISTEN:$2,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$3" & shift 3; exec "$@"'
        )
        # ip, unshare and sh each exec the next: the process started is the worker itself.
        self.edge_workers[name] = self._start(f"edge-{name}", env=env, command=[
            "ip", "netns", "exec", namespace, "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", script, "edge-worker", str(hidden or ""), str(self.port), str(bridge), *worker,
        ])
        return self.edge_workers[name]

    def wait_edge_workers(self, names: tuple[str, ...], timeout: float = 120) -> None:
        """Wait until each Edge worker in ``names`` has registered and is idle (edge3's ``edge_worker`` table)."""
        def states() -> dict[str, str]:
            for process in self.started:
                if process.poll() is not None:
                    raise AssertionError(f"an Airflow process exited with {process.returncode}:\n{self.tails()}")
            conn = psycopg2.connect(self.dsn, connect_timeout=10)
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT worker_name, state FROM edge_worker")
                    return dict(cur.fetchall())
            finally:
                conn.close()

        wait(states, lambda found: all(found.get(f"edge-{n}") in ("idle", "running") for n in names), timeout,
             f"Edge workers {sorted(names)} to register")

    def start_worker(self, name: str) -> None:
        """Start (or start again) the Celery worker ``name`` (``worker-<name>@<host>``)."""
        self.workers[name] = self._start(
            f"worker-{name}", "celery", "worker", "--celery-hostname", f"worker-{name}@%h", "--concurrency", "2",
            "--skip-serve-logs", "--without-mingle", "--without-gossip",
        )

    def wait_workers(self, names: tuple[str, ...] = CELERY_WORKERS, timeout: float = 120) -> None:
        """Wait until each Celery worker in ``names`` answers a ping."""
        from celery import Celery

        app = Celery(broker=self.env["AIRFLOW__CELERY__BROKER_URL"])
        try:
            def answered() -> set[str]:
                replies = app.control.ping(timeout=1.0) or []
                return {name.partition("@")[0] for reply in replies for name in reply}

            wait(answered, lambda found: {f"worker-{n}" for n in names} <= found, timeout,
                 f"Celery workers {sorted(names)} to answer a ping")
        finally:
            app.close()

    def start(self, dag_ids: set[str], timeout: float = 240) -> None:
        """Start the processes and wait until the API answers and every DAG in ``dag_ids`` is parsed."""
        self._start("api-server", "api-server")
        self._start("scheduler", "scheduler")
        self._start("dag-processor", "dag-processor")
        if self.triggerer:
            self._start("triggerer", "triggerer")
        if self.executor == "celery":
            for name in CELERY_WORKERS:
                self.start_worker(name)
        started = time.monotonic()

        def ready() -> bool:
            for process in self.started:
                if process.poll() is not None:
                    raise AssertionError(f"an Airflow process exited with {process.returncode}:\n{self.tails()}")
            return self.api.healthy()

        wait(ready, bool, timeout, "the api-server and the scheduler to be healthy")
        warm_execution_api(self.url, max(30.0, timeout - (time.monotonic() - started)))

        def parsed() -> set[str]:
            errors = self.api.import_errors()
            if errors:
                raise AssertionError(f"DAG import errors: {errors}")
            return self.api.dag_ids()

        wait(parsed, lambda found: dag_ids <= found, max(30.0, timeout - (time.monotonic() - started)),
             f"the DAGs {sorted(dag_ids)} to be parsed")
        if self.executor == "celery":
            self.wait_workers(timeout=max(30.0, timeout - (time.monotonic() - started)))

    def airflow(self, *args: str, timeout: float = 180) -> str:
        """An ``airflow`` CLI command against this deployment (as its operator would run it)."""
        result = subprocess.run([str(VENV_BIN / "airflow"), *args], env=self.env, capture_output=True,
                                text=True, timeout=timeout, check=False, start_new_session=True)
        if result.returncode != 0:
            raise AssertionError(f"airflow {' '.join(args[:3])} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result.stdout

    def tails(self) -> str:
        return "\n".join(
            f"--- {path.name} ---\n{path.read_text(errors='replace')[-5000:]}" for path in sorted(self.logs.glob("*.log"))
        )

    def stop(self) -> None:
        """SIGTERM each process group, SIGKILL what is left after 10 s, then drop the database."""
        self.api.close()
        for process in reversed(self.started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in reversed(self.started):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Task processes the executor forked live in the same group: none may outlive the test.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self.statsd.close()
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True, timeout=30)
        if self.redis_db is not None:
            release_redis_db(self.redis_db, self.database)
        drop_database(self.template.admin_dsn, self.database)
        shutil.rmtree(self.root, ignore_errors=True)
