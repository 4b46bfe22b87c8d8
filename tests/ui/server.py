"""A real ``airflow api-server`` with the lease plugin, for the UI tests.

One AIRFLOW_HOME in a temp dir: SQLite metadata (``airflow db migrate``), SimpleAuthManager with users
of every role and a passwords file written beforehand, the lease connection defined in the metadata
database (``airflow connections add``: that is the path the api-server must resolve by itself), and a
free port. Two ``airflow dags test`` runs of ``dags/lease_ui_demo.py`` leave a real overlap skip: the
first crashes holding the lease, the second finds it held.

Every process runs in its own session and is stopped by process group id; the temp dir is removed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from demo.deployment import free_port
from tests.airflow.warm import WarmServer
from tests.pg import scratch_dir

VENV_BIN = Path(sys.executable).parent
DAGS = Path(__file__).parent / "dags"
DAG_ID = "lease_ui_demo"
LEASE_KEY = "ui-demo"
#: SimpleAuthManager roles: viewer < user < op < admin. The password of each user is its name + "-pw".
USERS = ("admin", "viewer", "user", "op")


def password(user: str) -> str:
    return f"{user}-pw"


@dataclass
class AirflowServer:
    root: Path
    env: dict[str, str]
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    #: Runs the home's ``airflow`` commands but ``airflow db``, as tests/airflow/warm.py's children
    #: (with ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` naming this home's database); else each is a process.
    warm: WarmServer | None = None
    commands: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- processes ----------------------------------------------------------------------------------

    def airflow(
        self, *args: str, timeout: float = 300, extra_env: dict[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        if self.warm is not None and args[0] != "db":
            self.commands += 1
            result = self.warm.cli({**self.env, **(extra_env or {})}, list(args),
                                   self.root / f"warm-{self.commands}", timeout)
        else:
            result = subprocess.run(
                [str(VENV_BIN / "airflow"), *args], env={**self.env, **(extra_env or {})}, capture_output=True,
                text=True, timeout=timeout, check=False, start_new_session=True,
            )
        if check and result.returncode != 0:
            raise AssertionError(
                f"airflow {' '.join(args[:3])} failed ({result.returncode}):\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def start(self) -> None:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(VENV_BIN / "airflow"), "api-server", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"api-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/api/v2/version", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"api-server not healthy after {timeout} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- HTTP ---------------------------------------------------------------------------------------

    def token(self, user: str) -> str:
        if user not in self.tokens:
            response = httpx.post(
                f"{self.url}/auth/token", json={"username": user, "password": password(user)}, timeout=30
            )
            assert response.status_code == 201, response.text
            self.tokens[user] = response.json()["access_token"]
        return self.tokens[user]

    def request(self, method: str, path: str, user: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if user is not None:
            headers["Authorization"] = f"Bearer {self.token(user)}"
        return httpx.request(
            method, f"{self.url}{path}", headers=headers, timeout=60, follow_redirects=False, **kwargs
        )


OTHER_DAG_ID = "lease_ui_other"
FAB_AUTH_MANAGER = "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager"
#: FAB users and their roles. Viewer and Op are FAB's own; the others are made by FAB_SETUP below.
FAB_USERS = {
    "admin": "Admin",  # Admin, granted can_delete on Leases: a lease admin with every DAG
    "viewer": "Viewer",  # reads every DAG, no lease admin
    "op": "Op",  # edits every DAG, no lease admin
    "demo_reader": "DemoReader",  # reads lease_ui_demo only
    "lease_keeper": "LeaseKeeper",  # lease admin; reads both DAGs, edits only lease_ui_other
}
#: Run with the server's Python and environment: the permission the admin check asks about, and roles
#: with DAG-level access, through FAB's security manager (what an operator does once per deployment).
FAB_SETUP = f"""
import json, sys
from airflow.providers.fab.auth_manager.cli_commands.utils import get_application_builder
users = json.loads(sys.argv[1])
with get_application_builder() as appbuilder:
    sm = appbuilder.sm
    grant = lambda role, action, resource: sm.add_permission_to_role(role, sm.create_permission(action, resource))
    grant(sm.find_role("Admin"), "can_delete", "Leases")
    reader = sm.add_role("DemoReader")
    grant(reader, "can_read", "DAG:{DAG_ID}")
    keeper = sm.add_role("LeaseKeeper")
    grant(keeper, "can_delete", "Leases")
    grant(keeper, "can_read", "DAG:{DAG_ID}")
    grant(keeper, "can_read", "DAG:{OTHER_DAG_ID}")
    grant(keeper, "can_edit", "DAG:{OTHER_DAG_ID}")
    for name, role in users.items():
        made = sm.add_user(name, name, "test", name + "@example.com", [sm.find_role(role)], password=name + "-pw")
        assert made, name
"""


def make_fab_server(pg_dsn: str, schema: str, template: Path | None = None,
                    warm: WarmServer | None = None) -> AirflowServer:
    """An api-server under the FAB auth manager, with users of different roles (FAB_USERS)."""
    server = _prepare(pg_dsn, schema, fab=True, template=template, warm=warm)
    try:
        # The DAGs must be in the metadata database: DAG-level access is checked against it.
        server.airflow("dags", "reserialize")
        subprocess.run(
            [str(VENV_BIN / "python"), "-c", FAB_SETUP, json.dumps(FAB_USERS)],
            env=server.env, check=True, capture_output=True, timeout=300, start_new_session=True,
        )
    except BaseException:
        server.cleanup()
        raise
    return server


def make_server(pg_dsn: str, schema: str, template: Path | None = None,
                warm: WarmServer | None = None) -> AirflowServer:
    """Prepare the home (migrate, users, connection); the caller starts the server and runs the DAGs.

    With ``template`` (an AIRFLOW_HOME whose ``airflow.db`` is migrated: the ``airflow_template``
    fixture) the home's metadata database is a copy of it instead of a migration of its own."""
    return _prepare(pg_dsn, schema, template=template, warm=warm)


def _prepare(pg_dsn: str, schema: str, *, fab: bool = False, conn_uri: str | None = None,
             template: Path | None = None, warm: WarmServer | None = None) -> AirflowServer:
    root = scratch_dir("lease-ui-")
    home = root / "home"
    home.mkdir()
    (home / "simple_auth_manager_passwords.json.generated").write_text(
        json.dumps({user: password(user) for user in USERS})
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(DAGS),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        AIRFLOW__CORE__UNIT_TEST_MODE="False",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS=",".join(f"{u}:{u}" for u in USERS),
        AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_urlsafe(32),
        AIRFLOW__API__WORKERS="1",
        AIRFLOW__LEASE__SCHEMA=schema,
        PATH=f"{VENV_BIN}:{env.get('PATH', '')}",
        # Named outright (it is AIRFLOW_HOME's airflow.db either way): a warm child has the server's home.
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}",
    )
    if fab:
        env["AIRFLOW__CORE__AUTH_MANAGER"] = FAB_AUTH_MANAGER
    server = AirflowServer(root=root, env=env, port=free_port(), log=root / "api-server.log", warm=warm)
    try:
        if template is not None:
            shutil.copy(template / "airflow.db", home / "airflow.db")
        if template is None or fab:
            # FAB's own tables (the FAB auth manager migrates them) are not in the template.
            server.airflow("db", "migrate")
        # In the metadata database, not in an env var: the api-server must find it there by itself.
        server.airflow("connections", "add", "lease_default", "--conn-uri", conn_uri or pg_dsn)
    except BaseException:
        server.cleanup()
        raise
    return server
