"""The lease API server of a chaos run: the plugin's lease API app (``plugins/lease_api.py: create_api``),
served by a real uvicorn in a process of its own, over the harness's store; and its handle in the harness.

Started by the harness as ``python -m chaos.api CONFIG_JSON``. The routes are the plugin's own, mounted
at ``/lease/v1`` as in the api-server; only where the store is comes from the run (the private server,
the harness's schema, the profile's timeouts) instead of Airflow's ``lease_default`` connection: each
request thread gets a store of its own on one shared pool, as ``get_api_store`` does. The acquire secret
is the password of the ``lease_api`` connection, from the environment as Airflow reads it.

Faults the nemesis injects here (chaos.nemesis): the process paused (SIGSTOP) or killed and restarted on
the same port, and *lost replies*: while the file ``lossy`` of the run exists, a share of the requests
are answered by nothing, after the route ran (and the store committed): the server holds the reply until
the client has given up (a timeout), or answers 502 as a proxy whose upstream connection broke would.
Each lost reply is recorded (``fault`` ``lost_reply``) in this incarnation's history part.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

#: The acquire secret of a chaos run (the password of its ``lease_api`` connection; a private server).
SECRET = "chaos-lease-api-secret"


@dataclass(frozen=True)
class ApiConfig:
    dsn: str
    schema: str
    port: int
    history: str
    lossy: str
    seed: int
    statement_timeout: float
    connect_timeout: float
    #: How long a lost reply is held back: past the clients' timeout, so that they give up first.
    hold: float
    pool_size: int = 8

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LossyReplies:
    """ASGI middleware: while ``lossy`` exists, a share of the replies (its JSON ``fraction``) are lost
    after the route ran. Nothing of the request is changed; only its answer never arrives."""

    def __init__(self, app: Any, cfg: ApiConfig, recorder: Any) -> None:
        self.app = app
        self.cfg = cfg
        self.rec = recorder
        self.rng = random.Random(cfg.seed)
        self.lossy = Path(cfg.lossy)

    def _fraction(self) -> float:
        try:
            return float(json.loads(self.lossy.read_text()).get("fraction", 0.0))
        except (OSError, ValueError):
            return 0.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        fraction = self._fraction()
        if not fraction or self.rng.random() >= fraction:
            await self.app(scope, receive, send)
            return
        held: list[dict[str, Any]] = []

        async def swallow(message: dict[str, Any]) -> None:
            held.append(message)

        t0 = time.monotonic()
        await self.app(scope, receive, swallow)  # the route runs, and commits, in full
        status = next((m.get("status") for m in held if m["type"] == "http.response.start"), None)
        how = "timeout" if self.rng.random() < 0.5 else "502"
        self.rec.fault("lost_reply", t=t0, t1=time.monotonic(), path=scope.get("path"), status=status, how=how)
        if how == "timeout":
            await asyncio.sleep(self.cfg.hold)  # the client gave up long ago; this reply reaches nobody
            return
        await send({"type": "http.response.start", "status": 502,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"detail": "bad gateway (chaos: reply lost)"}'})


def _app(cfg: ApiConfig, recorder: Any) -> Any:
    from fastapi import FastAPI

    from airflow_lease_provider.core import FenceStore, LeaseStore
    from airflow_lease_provider.plugins import lease_api

    local = threading.local()
    timeouts: dict[str, Any] = {
        "schema": cfg.schema, "connect_timeout": timedelta(seconds=cfg.connect_timeout),
        "statement_timeout": timedelta(seconds=cfg.statement_timeout), "idle_close": timedelta(0),
        "pool_size": cfg.pool_size,
    }

    def store() -> LeaseStore:  # get_api_store's shape: one per request thread, one pool
        found: LeaseStore | None = getattr(local, "store", None)
        if found is None:
            found = local.store = LeaseStore(cfg.dsn, **timeouts)
        return found

    def fences() -> FenceStore:
        found: FenceStore | None = getattr(local, "fences", None)
        if found is None:
            found = local.fences = FenceStore(cfg.dsn, **timeouts)
        return found

    api = lease_api.create_api()
    api.dependency_overrides[lease_api.get_api_store] = store
    api.dependency_overrides[lease_api.get_api_fences] = fences
    app = FastAPI()
    app.mount("/lease/v1", api)
    return LossyReplies(app, cfg, recorder)


def main(argv: list[str]) -> int:
    from chaos.worker import _die_with_parent

    _die_with_parent()
    import uvicorn

    from chaos.history import Recorder

    cfg = ApiConfig(**json.loads(argv[1]))
    app_args = cfg
    if "--spare" in argv:
        # A spare, started ahead (the imports take seconds, tens of them on a loaded machine): ready to
        # serve, it waits for the harness's word to take the port of the one it replaces.
        from fastapi import FastAPI  # noqa: F401  (imported now, not when it is needed)

        from airflow_lease_provider.plugins import lease_api  # noqa: F401

        if not sys.stdin.readline():
            return 0  # the harness went away
    recorder = Recorder(Path(app_args.history), api=True)
    recorder.write({"type": "api_start", "t": time.monotonic(), "pid": os.getpid(), "port": cfg.port})
    server = uvicorn.Server(uvicorn.Config(_app(app_args, recorder), host="127.0.0.1", port=cfg.port,
                                           log_level="warning", access_log=False, timeout_graceful_shutdown=1))
    server.run()
    return 0


class ApiServer:
    """The harness's handle: start, pause, kill and restart the API server process, always on one port.

    A restart takes a *spare*: a process started ahead that has done its imports and waits on its stdin, so
    that a restart is the time to bind the port, not the seconds (tens of them under load) Airflow's imports
    take, during which the nemesis would wait; a new spare is started at once."""

    def __init__(self, cfg: ApiConfig, work: Path, env: dict[str, str]) -> None:
        self.cfg = cfg
        self.work = work
        self.env = {**env, "AIRFLOW_CONN_LEASE_API": json.dumps({"conn_type": "http", "password": SECRET}),
                    "AIRFLOW_HOME": str(work / "airflow-home")}
        self.proc: subprocess.Popen[bytes] | None = None
        self.spare: subprocess.Popen[bytes] | None = None
        self.incarnation = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.port}"

    def _spawn(self, spare: bool) -> subprocess.Popen[bytes]:
        self.incarnation += 1
        cfg = ApiConfig(**{**asdict(self.cfg), "history": str(self.work / f"api-{self.incarnation}.jsonl"),
                           "seed": self.cfg.seed * 100 + self.incarnation})
        (self.work / "logs").mkdir(exist_ok=True)
        log = (self.work / "logs" / f"api-{self.incarnation}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "chaos.api", cfg.to_json(), *(["--spare"] if spare else [])],
            cwd=Path(__file__).parent.parent, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if spare else subprocess.DEVNULL,
        )
        log.close()
        return proc

    def start(self, timeout: float = 90.0, *, wait: bool = True, spares: bool = True) -> None:
        """Serve on the port: the spare when there is a live one, else a new process; then a new spare."""
        spare, self.spare = getattr(self, "spare", None), None
        if spare is not None and spare.poll() is None and spare.stdin is not None:
            spare.stdin.write(b"go\n")
            spare.stdin.flush()
            self.proc = spare
        else:
            self.proc = self._spawn(spare=False)
        if spares:
            self.spare = self._spawn(spare=True)
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Until the port answers HTTP (any answer: 401 without credentials)."""
        import httpx

        deadline = time.monotonic() + timeout
        nap = threading.Event()
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the lease API server exited with {self.proc.returncode}: see {self.work / 'logs'}")
            try:
                httpx.post(self.url + "/lease/v1/renew", timeout=1.0)
                return
            except httpx.HTTPError:
                nap.wait(0.1)
        raise RuntimeError(f"the lease API server did not answer within {timeout:.0f}s")

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def kill(self) -> int | None:
        if self.proc is None:
            return None
        pid = self.proc.pid
        self.signal(signal.SIGKILL)
        self.proc.wait()
        return pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.kill()
        spare = getattr(self, "spare", None)
        if spare is not None and spare.poll() is None:
            spare.kill()
            spare.wait()
        self.spare = None


if __name__ == "__main__":
    sys.exit(main(sys.argv))
