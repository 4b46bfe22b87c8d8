"""A small client of Airflow 3's public REST API (``/api/v2``), as a user or a script meets it.

Authentication is SimpleAuthManager's: ``POST /auth/token`` with a user name and password returns a
JWT that every request carries as ``Authorization: Bearer``. Runs are triggered the way the UI, the CLI
and other clients do by default: with **no logical date** (``"logical_date": null``) unless one is given.

Used by the demo (``demo/airflow_demo.py``) to check its claims, and by the deployment test tier
(``tests/deployment``) to drive and read back real Airflow processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import quote

import httpx

FINISHED = frozenset({"success", "failed"})


class AirflowAPIError(AssertionError):
    """A request that Airflow answered with an error status (the body is in the message)."""


def _q(part: str) -> str:
    return quote(part, safe="")


class AirflowAPI:
    """The public API of one Airflow deployment, as one SimpleAuthManager user."""

    def __init__(self, base_url: str, username: str, password: str, *, timeout: float = 60) -> None:
        self.base_url = base_url.rstrip("/")
        self._credentials = {"username": username, "password": password}
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout)
        self._token: str | None = None

    def close(self) -> None:
        self._client.close()

    # -- HTTP ---------------------------------------------------------------------------------------

    def _login(self) -> str:
        reply = self._client.post("/auth/token", json=self._credentials)
        if reply.status_code != 201:
            # The reply never contains the password; the status and body say what went wrong.
            raise AirflowAPIError(f"POST /auth/token as {self._credentials['username']!r}: "
                                  f"{reply.status_code} {reply.text[:500]}")
        token = reply.json()["access_token"]
        self._token = token
        return token

    def request(self, method: str, path: str, *, ok: Iterable[int] = (200,), **kwargs: Any) -> Any:
        """Send a request to ``/api/v2{path}``; the decoded JSON body (or the text for non-JSON)."""
        headers = dict(kwargs.pop("headers", {}))
        for attempt in (1, 2):
            token = self._token or self._login()
            reply = self._client.request(
                method, f"/api/v2{path}", headers={**headers, "Authorization": f"Bearer {token}"}, **kwargs
            )
            if reply.status_code == 401 and attempt == 1:
                self._token = None  # expired: log in again once
                continue
            break
        if reply.status_code not in set(ok):
            raise AirflowAPIError(f"{method} /api/v2{path}: {reply.status_code} {reply.text[:2000]}")
        if "json" in reply.headers.get("content-type", ""):
            return reply.json()
        return reply.text

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    # -- DAGs ---------------------------------------------------------------------------------------

    def healthy(self) -> bool:
        try:
            health = self._client.get("/api/v2/monitor/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return False
        return all(health.get(part, {}).get("status") == "healthy" for part in ("metadatabase", "scheduler"))

    def dag_ids(self) -> set[str]:
        return {dag["dag_id"] for dag in self.get("/dags", params={"limit": 1000})["dags"]}

    def import_errors(self) -> dict[str, str]:
        """File name -> error of every DAG file that failed to import."""
        reply = self.get("/importErrors", params={"limit": 1000})
        return {e["filename"]: e["stack_trace"] for e in reply["import_errors"]}

    def unpause(self, dag_id: str) -> None:
        self.request("PATCH", f"/dags/{_q(dag_id)}", json={"is_paused": False})

    def pause(self, dag_id: str) -> None:
        self.request("PATCH", f"/dags/{_q(dag_id)}", json={"is_paused": True})

    # -- runs ---------------------------------------------------------------------------------------

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None, *, logical_date: str | None = None) -> str:
        """Trigger a run (no logical date unless given, like the UI's default); its run id."""
        body = {"logical_date": logical_date, "conf": conf or {}}
        return str(self.request("POST", f"/dags/{_q(dag_id)}/dagRuns", json=body)["dag_run_id"])

    def backfill(self, dag_id: str, from_date: str, to_date: str, **options: Any) -> dict[str, Any]:
        body = {"dag_id": dag_id, "from_date": from_date, "to_date": to_date, **options}
        result: dict[str, Any] = self.request("POST", "/backfills", json=body)
        return result

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        """Every run of ``dag_id``, oldest first (by ``run_after``)."""
        reply = self.get(f"/dags/{_q(dag_id)}/dagRuns", params={"limit": 1000, "order_by": "run_after"})
        return list(reply["dag_runs"])

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.get(f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}")
        return result

    def wait_for_run(self, dag_id: str, run_id: str, *, states: Iterable[str] = FINISHED,
                     timeout: float = 180) -> str:
        """Wait until the run is in one of ``states``; its state."""
        wanted = set(states)
        state = wait(lambda: self.run(dag_id, run_id)["state"], lambda s: s in wanted, timeout,
                     f"run {dag_id}/{run_id} to be {'/'.join(sorted(wanted))}")
        return str(state)

    def clear(self, dag_id: str, run_id: str, task_ids: list[str]) -> list[dict[str, Any]]:
        """Clear tasks of a finished run (as the UI's Clear does); the cleared task instances."""
        body = {"dry_run": False, "dag_run_id": run_id, "task_ids": task_ids, "only_failed": False,
                "reset_dag_runs": True}
        reply = self.request("POST", f"/dags/{_q(dag_id)}/clearTaskInstances", json=body)
        return list(reply["task_instances"])

    # -- task instances -----------------------------------------------------------------------------

    def set_task_state(self, dag_id: str, run_id: str, task_id: str, state: str) -> None:
        """Set a task instance's state (the UI's "Mark as failed" / "Mark as success")."""
        self.request("PATCH", f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/{_q(task_id)}",
                     json={"new_state": state})

    def task_instances(self, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
        """``task_id`` (``task_id[i]`` for a mapped instance) -> the task instance, of one run."""
        reply = self.get(f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances", params={"limit": 1000})
        return {
            ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else ""): ti
            for ti in reply["task_instances"]
        }

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        return {task: ti["state"] for task, ti in self.task_instances(dag_id, run_id).items()}

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value",
             map_index: int = -1) -> Any:
        """The deserialized XCom value, or ``None`` when there is none."""
        path = f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/{_q(task_id)}/xcomEntries/{_q(key)}"
        reply = self.request("GET", path, ok=(200, 404), params={"map_index": map_index, "deserialize": True})
        if isinstance(reply, dict) and "value" in reply:
            return reply["value"]
        return None

    def tries(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> list[dict[str, Any]]:
        """Every try of one task instance (its state, pid, hostname, start and end), oldest first."""
        path = f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/{_q(task_id)}"
        if map_index >= 0:
            path += f"/{map_index}"
        reply = self.get(f"{path}/tries", params={"limit": 1000})
        return sorted(reply["task_instances"], key=lambda t: t["try_number"])

    def events(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        """Airflow's audit log entries of one task (``heartbeat timeout``, a state set through the UI, ...)."""
        reply = self.get("/eventLogs", params={"dag_id": dag_id, "run_id": run_id, "task_id": task_id,
                                               "order_by": "id", "limit": 1000})
        return list(reply["event_logs"])

    def log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1, map_index: int = -1) -> str:
        """The task log of one try, as text (one line per structured log event)."""
        path = f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/{_q(task_id)}/logs/{try_number}"
        reply = self.request("GET", path, params={"full_content": True, "map_index": map_index},
                             headers={"Accept": "application/json"})
        content = reply.get("content", "") if isinstance(reply, dict) else reply
        if isinstance(content, list):
            return "\n".join(_log_line(item) for item in content)
        return str(content)


def _log_line(item: Any) -> str:
    if not isinstance(item, dict):
        return str(item)
    extra = {k: v for k, v in item.items() if k not in ("event", "timestamp", "level", "logger")}
    text = f"{item.get('level', '')} {item.get('event', '')}".strip()
    return f"{text} {extra}" if extra else text


def wait(read: Callable[[], Any], done: Callable[[Any], bool], timeout: float, what: str,
         interval: float = 1.0) -> Any:
    """Poll ``read()`` until ``done(value)``; the value. Raises ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what} (last: {value!r:.300})")
        time.sleep(interval)
