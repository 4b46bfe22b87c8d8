"""Issue 41's acceptance door: leased DAGs on a real EdgeExecutor deployment whose Edge worker cannot reach
the lease store.

``airflow api-server`` (edge3's worker API on, ``[edge] api_enabled``; the lease plugin; the connection
``lease_api``, the acquire secret, in the metadata database), ``airflow scheduler`` with
``[core] executor = EdgeExecutor``, ``airflow dag-processor``, and a real ``airflow edge worker``
(:meth:`demo.deployment.Deployment.start_edge_worker`) in a network namespace whose only route out is a socat
forward to the api-server's port, in a mount namespace where the metadata database's Unix socket (the
embedded server's) is ``/dev/null``, with no database URL and no connection in its environment. The lease
store is the metadata database's ``airflow_lease`` schema (created by ``airflow db migrate`` through the
provider's db-manager); no ``lease_default`` is defined anywhere. Each task therefore takes its lease through
the api-server's lease API (``[lease] access = auto``, the default).

Everything is read back through the doors a platform team has: Airflow's REST API (run and task states,
XComs, task logs), edge3's own UI API (which worker ran a job), the lease plugin's routes, and the Leases
page in a headless Chromium.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from demo.airflow_api import wait
from demo.deployment import ROOT, Deployment, MetadataTemplate
from tests.deployment.conftest import Markers, deployment_for
from tests.pg import scratch_dir

pytestmark = [
    pytest.mark.airflow, pytest.mark.apipath, pytest.mark.slow, pytest.mark.timeout(1200),
    pytest.mark.needs("socat", "netns", "chromium"),
]

DAGS = Path(__file__).parent / "dags"
MARKERS = scratch_dir("lease-edge-markers-")
SECRET = secrets.token_urlsafe(24)
DAG_IDS = {"edge_overlap", "edge_zombie", "edge_replace"}
WORKER = "a"


@pytest.fixture(scope="module")
def airflow(metadata_template: MetadataTemplate) -> Iterator[Deployment]:
    files = [ROOT / "tests" / "airflow" / "dags" / "_util.py", DAGS / "edge_leased.py"]
    try:
        with deployment_for(metadata_template, files, DAG_IDS, {"LEASE_TEST_MARKERS": str(MARKERS)},
                            executor="edge") as deployment:
            # The acquire secret, defined on the api-server's side only (in the metadata database).
            deployment.airflow("connections", "add", "lease_api", "--conn-type", "http", f"--conn-password={SECRET}")
            deployment.start_edge_worker(WORKER)
            deployment.wait_edge_workers((WORKER,))
            for dag_id in DAG_IDS:
                deployment.api.unpause(dag_id)
            yield deployment
    finally:
        shutil.rmtree(MARKERS, ignore_errors=True)


marker = Markers(MARKERS, timeout=180)


def plugin(airflow: Deployment, path: str, **params: Any) -> Any:
    """GET a route of the lease plugin (``/lease/api/...``, the Leases page's data) as the admin user."""
    api = airflow.api
    token = api._token or api._login()
    reply = api._client.get(path, params=params, headers={"Authorization": f"Bearer {token}"})
    assert reply.status_code == 200, (path, reply.status_code, reply.text[:2000])
    return reply.json()


def edge_jobs(airflow: Deployment, dag_id: str) -> dict[str, dict[str, Any]]:
    """edge3's jobs of ``dag_id`` by run id (its UI API, as the Edge Executor admin page reads them)."""
    jobs = plugin(airflow, "/edge_worker/ui/jobs", dag_id_pattern=dag_id)["jobs"]
    return {job["run_id"]: job for job in jobs}


def events(airflow: Deployment, key: str, kind: str | None = None) -> list[dict[str, Any]]:
    found = plugin(airflow, "/lease/api/events", key=key, **({"kind": kind} if kind else {}))
    return list(found["events"])


def test_the_edge_worker_has_no_route_to_the_store_and_no_lease_connection(airflow: Deployment) -> None:
    """What makes the rest mean something: the worker's environment names no database and no connection,
    and from its namespaces the store's server does not answer while the api-server does."""
    import subprocess

    import psycopg2

    worker = airflow.edge_workers[WORKER]
    assert worker.poll() is None
    # (edge3 sets its title: "airflow edge worker: edge-a"; it also overwrites /proc/<pid>/environ, so the
    # environment is read where a task runs: the overlap test's task process writes it down.)
    assert f"edge worker: edge-{WORKER}" in Path(f"/proc/{worker.pid}/cmdline").read_bytes().decode(errors="replace")
    env = airflow.edge_worker_env(WORKER)  # what start_edge_worker gave it
    assert not [k for k in env if k.startswith(("AIRFLOW__DATABASE__", "AIRFLOW_CONN_", "AIRFLOW__CORE__FERNET"))], env
    assert env["AIRFLOW__CORE__EXECUTOR"].endswith("EdgeExecutor")
    assert "AIRFLOW_CONN_LEASE_DEFAULT" not in airflow.env  # no lease_default on any process
    # Inside the worker's namespaces (entered through its pid): the database refuses, the api-server answers.
    probe = (
        "import psycopg2, sys, urllib.request\n"
        "try:\n"
        "    psycopg2.connect(sys.argv[1], connect_timeout=3).close(); print('db: reached')\n"
        "except psycopg2.OperationalError:\n"
        "    print('db: unreachable')\n"
        "print('api:', urllib.request.urlopen(sys.argv[2] + '/api/v2/monitor/health', timeout=30).status)\n"
    )
    result = subprocess.run(
        ["nsenter", "-t", str(worker.pid), "-n", "-m", sys.executable, "-c", probe, airflow.dsn, airflow.url],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.stdout.splitlines() == ["db: unreachable", "api: 200"], (result.stdout, result.stderr[-2000:])
    # From here (the host's namespaces) the same DSN answers: the cut is the namespace's, not a broken DSN.
    psycopg2.connect(airflow.dsn, connect_timeout=10).close()


def test_two_runs_at_once_on_the_edge_worker_one_runs_the_other_is_skipped_naming_the_holder(
    airflow: Deployment,
) -> None:
    api = airflow.api
    first = api.trigger("edge_overlap")
    marker(f"overlap-started-{first}")
    # The task process's own environment on the Edge worker: no connection, no Fernet key, and as metadata
    # database only the placeholder the Task SDK puts in every task process ("airflow-db-not-allowed:///").
    env = json.loads(marker(f"overlap-env-{first}"))
    assert {"AIRFLOW_HOME", "AIRFLOW__CORE__EXECUTOR", "AIRFLOW__EDGE__API_URL"} <= set(env["names"]), env
    assert not [k for k in env["names"] if k.startswith(("AIRFLOW_CONN_", "AIRFLOW__CORE__FERNET"))], env
    assert env["metadata_scheme"] in ("", "airflow-db-not-allowed"), env
    holder = f"edge_overlap/{first}/hold"
    row = plugin(airflow, "/lease/api/lease", key="edge-overlap-key")["lease"]
    assert row["held"] and row["owner"] == holder, row

    second = api.trigger("edge_overlap")
    assert api.wait_for_run("edge_overlap", second, timeout=300) == "success"  # a skipped task: the run did not fail
    assert api.task_states("edge_overlap", second) == {"hold": "skipped"}
    assert not (MARKERS / f"overlap-started-{second}").exists()  # its body never ran
    reason = api.xcom("edge_overlap", second, "hold", "lease_skip_reason")
    assert reason is not None and holder in reason["reason"] and reason["holder_token"] == row["token"], reason
    log = api.log("edge_overlap", second, "hold")
    assert holder in log, log[-3000:]
    assert SECRET not in log
    # Recorded once, with the skipped run's columns, in the ledger the Leases page reads.
    skips = events(airflow, "edge-overlap-key", "skipped_overlap")
    assert len(skips) == 1 and skips[0]["run_id"] == second and skips[0]["detail"]["holder_owner"] == holder, skips
    assert api.run("edge_overlap", first)["state"] == "running"  # the holder was never disturbed

    (MARKERS / f"overlap-let-go-{first}").write_text("go")
    assert api.wait_for_run("edge_overlap", first, timeout=300) == "success"
    assert api.task_states("edge_overlap", first) == {"hold": "success"}
    assert api.xcom("edge_overlap", first, "hold") == first
    # Both task instances were Edge jobs of this worker, and the lease went through the API (not the store).
    jobs = edge_jobs(airflow, "edge_overlap")
    assert {jobs[r]["edge_worker"] for r in (first, second)} == {f"edge-{WORKER}"}, jobs
    assert "through the api-server's lease API" in api.log("edge_overlap", first, "hold")
    assert plugin(airflow, "/lease/api/lease", key="edge-overlap-key")["lease"]["held"] is False  # released


def freeze_and_overtake(airflow: Deployment, dag_id: str, prefix: str, key: str, *, lapse: bool) -> tuple[str, str, int, int]:
    """Run ``dag_id`` (a :func:`frozen_publish` task), stop its task process (SIGSTOP) once it holds
    ``key`` (with ``lapse``, until its TTL has passed and the plugin shows the key free), run it again and
    let the newer run publish, then let the frozen one go and resume it. (old run, new run, their tokens)."""
    api = airflow.api
    old = api.trigger(dag_id)
    pid, old_token = int(marker(f"{prefix}-pid-{old}")), int(marker(f"{prefix}-token-{old}"))
    os.kill(pid, signal.SIGSTOP)  # frozen: a lost VM, a GC pause
    try:
        if lapse:
            wait(lambda: plugin(airflow, "/lease/api/lease", key=key)["lease"], lambda row: not row["held"], 60,
                 "the frozen holder's lease to lapse")
        new = api.trigger(dag_id)
        new_token = int(marker(f"{prefix}-token-{new}"))
        assert new_token > old_token
        (MARKERS / f"{prefix}-go-{new}").write_text("go")
        assert api.wait_for_run(dag_id, new, timeout=300) == "success", api.task_states(dag_id, new)
        (MARKERS / f"{prefix}-go-{old}").write_text("go")  # the frozen one publishes as soon as it runs again
    finally:
        os.kill(pid, signal.SIGCONT)
    return old, new, old_token, new_token


def published(airflow: Deployment, dag_id: str, prefix: str, old: str, new: str, new_token: int) -> None:
    """The target holds the newer run's write only: the frozen run reached the fence, was refused there
    (the api-server no longer takes its grant's capability) and wrote nothing."""
    target = (MARKERS / f"{prefix}-target").read_text().splitlines()
    assert target == [f"{dag_id}/{new}/publish {new_token}"], target
    assert (MARKERS / f"{prefix}-fence-refused-{old}").exists()
    assert not (MARKERS / f"{prefix}-published-{old}").exists()
    assert not (MARKERS / f"{prefix}-fence-refused-{new}").exists()
    assert marker(f"{prefix}-published-{new}") == str(new_token)
    assert airflow.api.xcom(dag_id, new, "publish") == new_token
    jobs = edge_jobs(airflow, dag_id)
    assert {jobs[r]["edge_worker"] for r in (old, new)} == {f"edge-{WORKER}"}, jobs


def test_a_frozen_holder_on_the_edge_worker_cannot_publish_after_a_newer_run_took_the_lapsed_lease(
    airflow: Deployment,
) -> None:
    """The default policy: the holder frozen past its 8 s TTL, a newer run takes the lapsed lease and
    publishes; resumed, the frozen run's ``lease.fence()`` is refused and its task fails (LeaseLost)."""
    api = airflow.api
    old, new, old_token, new_token = freeze_and_overtake(airflow, "edge_zombie", "zombie", "edge-zombie-key", lapse=True)
    assert api.wait_for_run("edge_zombie", old, timeout=300) == "failed"
    assert api.task_states("edge_zombie", old) == {"publish": "failed"}
    published(airflow, "edge_zombie", "zombie", old, new, new_token)
    log = api.log("edge_zombie", old, "publish")
    assert "LeaseLost" in log, log[-3000:]
    assert SECRET not in log
    # The ledger: both grants, the frozen grant's loss (recorded once by its own capability after the newer run
    # took the key: docs/api.md, "A grant's own past"), only the newer one released (no release, no write).
    seen = [(e["kind"], e["token"]) for e in events(airflow, "edge-zombie-key")]
    assert sorted(seen) == [("acquired", old_token), ("acquired", new_token), ("lost", old_token),
                            ("released", new_token)], seen


def test_a_frozen_holder_replaced_by_a_newer_run_is_refused_by_the_fence_and_skipped_naming_it(
    airflow: Deployment,
) -> None:
    """on_overlap="replace" on the Edge worker: a newer run takes the frozen holder's lease over (a
    ``replaced`` event in the ledger); resumed, the old run's ``lease.fence()`` is refused, it writes nothing,
    and its task ends skipped naming the newer run (asked through /lease/v1/replaced_by)."""
    api = airflow.api
    old, new, old_token, new_token = freeze_and_overtake(airflow, "edge_replace", "replace", "edge-replace-key",
                                                         lapse=False)
    assert api.wait_for_run("edge_replace", old, timeout=300) == "success"  # a skipped task: the run did not fail
    ti = api.task_instances("edge_replace", old)["publish"]
    assert ti["state"] == "skipped" and ti["try_number"] == 1, ti
    published(airflow, "edge_replace", "replace", old, new, new_token)
    reason = api.xcom("edge_replace", old, "publish", "lease_skip_reason")
    assert reason["replaced_by_owner"] == f"edge_replace/{new}/publish" and reason["replaced_by_token"] == new_token
    assert f"edge_replace/{new}/publish" in api.log("edge_replace", old, "publish")
    (replaced,) = events(airflow, "edge-replace-key", "replaced")
    assert (replaced["owner"], replaced["token"]) == (f"edge_replace/{old}/publish", old_token), replaced
    assert (replaced["detail"]["by_owner"], replaced["detail"]["by_token"]) == (f"edge_replace/{new}/publish", new_token)


def test_the_leases_page_shows_the_edge_runs(airflow: Deployment) -> None:
    """The Leases page (the plugin's page in the Airflow UI, headless Chromium): the Edge run's overlap skip,
    naming the run that held the key, and the frozen holder's takeover (``replaced``); the replaced task
    instance's Lease tab."""
    from playwright import sync_api  # the test group's; it drives Debian's Chromium, it downloads none

    from tests.tools import chromium
    from tests.ui.test_browser import CHROMIUM_ARGS, open_leases_from_nav

    api = airflow.api
    states = {run["dag_run_id"]: api.task_states("edge_overlap", run["dag_run_id"]).get("hold")
              for run in api.runs("edge_overlap")}
    (skipped,) = [run for run, state in states.items() if state == "skipped"]
    (held,) = [run for run, state in states.items() if state == "success"]
    replace_runs = {run["dag_run_id"]: api.task_states("edge_replace", run["dag_run_id"]).get("publish")
                    for run in api.runs("edge_replace")}
    (old,) = [run for run, state in replace_runs.items() if state == "skipped"]
    (new,) = [run for run, state in replace_runs.items() if state == "success"]
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(60_000)
            page.goto(f"{airflow.url}/auth/login")
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", "admin-pw")
            page.click("button[type=submit]")
            page.wait_for_url(lambda url: "/auth/login" not in url)
            frame = open_leases_from_nav(page)
            skip = frame.locator("#events tbody tr[data-kind=skipped_overlap]", has_text="edge-overlap-key")
            skip.wait_for()
            assert skip.count() == 1
            text = skip.inner_text()
            assert skipped in text and held in text, text
            # The takeover of the frozen holder, naming both runs.
            replaced = frame.locator("#events tbody tr[data-kind=replaced]", has_text="edge-replace-key")
            replaced.wait_for()
            text = replaced.inner_text()
            assert replaced.count() == 1 and old in text and new in text, text
            # The replaced task instance's Lease tab says so, naming the newer run.
            page.goto(f"{airflow.url}/lease/ui/task?dag_id=edge_replace&run_id={quote(old, safe='')}"
                      "&task_id=publish&map_index=-1")
            page.locator("#explain h2", has_text="Replaced by a newer run, skipped").wait_for()
            assert new in page.locator("#replaced-by").inner_text()
        finally:
            browser.close()
