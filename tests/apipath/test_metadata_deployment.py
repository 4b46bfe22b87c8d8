"""Issue 41's second deployment: LocalExecutor, the lease store in Airflow's metadata database, no ``lease_default``.

A real api-server, scheduler and dag-processor (:class:`demo.deployment.Deployment`) on a metadata database on
the suite's PostgreSQL (embedded, or ``LEASE_TEST_DSN``'s), whose ``airflow_lease`` schema only ``airflow db
migrate`` made (through the provider's db-manager: docs/api.md, decision 1). Only the connection ``lease_api``
is defined (the acquire secret, in the metadata database as a platform team defines it); the task processes
have no lease connection, so ``[lease] access = auto`` takes the lease API through the api-server.

Door A: leased DAGs under the real scheduler (runs triggered over REST): an overlap skipped naming the holder,
a frozen holder's late publish refused by the fence, both on the Leases page's data; and the policies that
wait, through the real triggerer, whose trigger polls and keeps its waiting place over the lease API too
(``wait``; ``wait`` with ``max_waiting=1`` and three runs; the same with its triggerer killed and the waiting
run cleared: its new try takes its place over; ``replace`` with a ``replace_grace``).

Door B: an attacker over HTTP against the same api-server: no credentials, wrong ones, another grant's
capability, a released one replayed, the right one for another grant, the acquire secret or an Airflow JWT
as a capability, hostile bodies; the store read before and after to prove nothing changed, and the secret
and capabilities looked for in every answer and log file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from airflow_lease_provider.core import EventKind, LeaseStore
from airflow_lease_provider.core.db import Database
from airflow_lease_provider.core.schema import installed_version, latest_version
from demo.airflow_api import wait
from demo.deployment import ROOT, Deployment, MetadataTemplate
from tests.deployment.conftest import Markers, deployment_for
from tests.pg import execute, q, scratch_dir

pytestmark = [pytest.mark.airflow, pytest.mark.apipath, pytest.mark.slow, pytest.mark.timeout(900)]

DAGS = Path(__file__).parent / "dags"
MARKERS = scratch_dir("lease-metadb-markers-")
#: The schema ``airflow db migrate`` gives the store in the metadata database (``[lease] schema``'s default).
SCHEMA = "airflow_lease"
#: The acquire secret: the password of the connection ``lease_api``.
SECRET = "metadb-" + secrets.token_urlsafe(24)
#: Every capability this module was answered (never to be found in another answer or in a log).
CAPABILITIES: list[str] = []
#: Every answer this module got from the lease API, but the grants' own (which carry their capability).
ANSWERS: list[str] = []
#: The API path's log line (runtime/store.py: task_store) in a task that has no lease connection.
API_PATH_LINE = "no lease connection here; taking the lease through the api-server's lease API"


def _migrated_by_airflow(deployment: Deployment) -> None:
    """Before any Airflow process starts: the store is in the metadata database at the latest version, made by
    ``airflow db migrate`` alone (the template is that command's result; nothing else touched it), and empty."""
    db = Database(deployment.dsn, schema=SCHEMA)
    try:
        assert installed_version(db) == latest_version()
    finally:
        db.close()
    assert execute(deployment.dsn, q("SELECT count(*) FROM {schema}.lease", SCHEMA)) == [(0,)]
    # As a platform team enables the API: the connection in the metadata database, read by the api-server and,
    # through the execution API, by the tasks. No other connection is defined.
    deployment.airflow("connections", "add", "lease_api", "--conn-type", "http", f"--conn-password={SECRET}")


@pytest.fixture(scope="module")
def airflow(metadata_template: MetadataTemplate) -> Iterator[Deployment]:
    files = [DAGS / "metadb_leased.py", ROOT / "tests" / "airflow" / "dags" / "_util.py"]
    env = {"LEASE_TEST_MARKERS": str(MARKERS)}
    dag_ids = {"metadb_overlap", "metadb_zombie", "metadb_wait", "metadb_buffer", "metadb_grace", "metadb_retry_place"}
    # With a triggerer: the waiting policies defer, and the triggerer (through the lease API) resumes them.
    with deployment_for(metadata_template, files, dag_ids, env, lease_default=False, triggerer=True,
                        before_start=_migrated_by_airflow) as deployment:
        assert "AIRFLOW_CONN_LEASE_DEFAULT" not in deployment.env
        assert not any(k.startswith("AIRFLOW__LEASE__") for k in deployment.env)  # access = auto, the default
        for dag_id in dag_ids:
            deployment.api.unpause(dag_id)
        yield deployment
    shutil.rmtree(MARKERS, ignore_errors=True)


# ``store`` (conftest's): the store the api-server uses, the metadata database's schema SCHEMA (the default).
marker = Markers(MARKERS, timeout=180)


def grant_row(airflow: Deployment, key: str) -> tuple[Any, ...]:
    """(owner, token, made through the API, released) of ``key``'s row."""
    rows = execute(airflow.dsn, q(
        "SELECT owner, token, api_capability IS NOT NULL, released_at IS NOT NULL FROM {schema}.lease WHERE key = %s",
        SCHEMA), (key,))
    assert len(rows) == 1, rows
    return rows[0]


def ui_get(airflow: Deployment, path: str, **params: Any) -> Any:
    """A Leases plugin route as the deployment's authenticated admin (the page's own data)."""
    token = airflow.api._token or airflow.api._login()
    reply = airflow.api._client.get(path, params=params, headers={"Authorization": f"Bearer {token}"})
    assert reply.status_code == 200, (path, reply.status_code, reply.text[:2000])
    return reply.json() if "json" in reply.headers.get("content-type", "") else reply.text


def cli_events(airflow: Deployment, *args: str) -> list[dict[str, Any]]:
    """``airflow-lease events`` against the metadata database's schema, as an operator runs it."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "airflow-lease"), "--dsn", airflow.dsn, "--schema", SCHEMA, "--json",
         "events", *args], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout)["events"])


# -- door A: leased DAGs through the real scheduler ----------------------------------------------------------


def test_two_overlapping_runs_over_the_api_one_runs_the_other_is_skipped_naming_the_holder_once(
    airflow: Deployment, store: LeaseStore
) -> None:
    api = airflow.api
    first = api.trigger("metadb_overlap")
    owner, token = marker(f"overlap-started-{first}").split()
    assert owner == f"metadb_overlap/{first}/hold"
    # Granted by the api-server (the row keeps its capability's digest), in the metadata database's schema.
    assert grant_row(airflow, "metadb-overlap") == (owner, int(token), True, False)
    assert API_PATH_LINE in api.log("metadb_overlap", first, "hold")

    second = api.trigger("metadb_overlap")
    assert api.wait_for_run("metadb_overlap", second) == "success"  # a skipped task: the run did not fail
    assert api.task_states("metadb_overlap", second) == {"hold": "skipped"}
    reason = api.xcom("metadb_overlap", second, "hold", "lease_skip_reason")
    assert reason is not None and owner in reason["reason"] and f"token {token}" in reason["reason"], reason
    assert reason["holder_token"] == int(token)
    log = api.log("metadb_overlap", second, "hold")
    assert owner in log and API_PATH_LINE in log
    assert not (MARKERS / f"overlap-started-{second}").exists()  # its body never ran
    assert api.run("metadb_overlap", first)["state"] == "running"  # the holder was not disturbed

    # The skip, recorded once by the api-server's store (the /event route), read through the CLI and the page.
    skips = cli_events(airflow, "--key", "metadb-overlap", "--kind", "skipped_overlap")
    assert len(skips) == 1, skips
    assert (skips[0]["dag_id"], skips[0]["run_id"], skips[0]["task_id"]) == ("metadb_overlap", second, "hold")
    assert skips[0]["detail"]["holder_owner"] == owner and skips[0]["detail"]["holder_token"] == int(token)
    shown = ui_get(airflow, "/lease/api/events", key="metadb-overlap", kind="skipped_overlap")["events"]
    assert [(e["run_id"], e["detail"]["holder_token"]) for e in shown] == [(second, int(token))], shown

    (MARKERS / f"overlap-let-go-{first}").write_text("go")
    assert api.wait_for_run("metadb_overlap", first) == "success"
    assert grant_row(airflow, "metadb-overlap") == (owner, int(token), True, True)  # released over the API
    assert store.holder("metadb-overlap") is None


def test_a_frozen_holder_s_late_publish_through_the_fence_is_refused_and_the_newer_one_s_accepted(
    airflow: Deployment, store: LeaseStore
) -> None:
    api = airflow.api
    old = api.trigger("metadb_zombie")
    pid, old_token = (int(part) for part in marker(f"zombie-started-{old}").split())
    assert grant_row(airflow, "metadb-zombie")[1:3] == (old_token, True)
    os.kill(pid, signal.SIGSTOP)  # frozen past its 4 s TTL: a lost VM, a GC pause
    try:
        # Until the store says the frozen grant lapsed (its keeper cannot renew it from a stopped process).
        wait(lambda: store.holder("metadb-zombie"), lambda holder: holder is None, 60, "the frozen grant to lapse")
        new = api.trigger("metadb_zombie")
        new_token = int(marker(f"zombie-started-{new}").split()[1])
        assert new_token == old_token + 1
        (MARKERS / f"zombie-go-{new}").write_text("go")
        assert api.wait_for_run("metadb_zombie", new) == "success", api.log("metadb_zombie", new, "publish")[-3000:]
        (MARKERS / f"zombie-go-{old}").write_text("go")  # resumed, it goes straight to its publish
    finally:
        os.kill(pid, signal.SIGCONT)
    assert api.wait_for_run("metadb_zombie", old) == "failed"
    assert api.task_states("metadb_zombie", old) == {"publish": "failed"}

    # The target holds the newer write only; the frozen one wrote nothing.
    target = (MARKERS / "zombie-target").read_text().splitlines()
    assert target == [f"metadb_zombie/{new}/publish {new_token}"], target
    assert not (MARKERS / f"zombie-published-{old}").exists()
    assert marker(f"zombie-published-{new}") == str(new_token)
    # The fence accepted the newer token at the target (the api-server's store keeps it), never the old one.
    fence = execute(airflow.dsn, q("SELECT key, token, owner FROM {schema}.fence WHERE resource = %s", SCHEMA),
                    ("metadb-zombie-target",))
    assert fence == [("metadb-zombie", new_token, f"metadb_zombie/{new}/publish")], fence
    log = api.log("metadb_zombie", old, "publish")
    assert "LeaseLost" in log or "StaleFencingToken" in log, log[-3000:]
    # The ledger has the frozen grant's loss once, filed under its own run (recorded by its capability, kept past
    # its row: docs/api.md, "A grant's own past"), and the newer grant's release under the newer run.
    events = store.events.query(key="metadb-zombie", limit=100)
    lost = [(e.owner, e.token, e.run.run_id if e.run else None) for e in events if e.kind == "lost"]
    assert lost == [(f"metadb_zombie/{old}/publish", old_token, old)], lost
    released = [(e.token, e.run.run_id if e.run else None) for e in events if e.kind == "released"]
    assert released == [(new_token, new)], released
    assert API_PATH_LINE in log
    # The ledger: both grants, the frozen one's loss (above), the newer one's release; the frozen one never
    # released.
    seen = {(e.kind, e.token) for e in store.events.query(key="metadb-zombie")}
    assert {(EventKind.ACQUIRED, old_token), (EventKind.ACQUIRED, new_token), (EventKind.LOST, old_token),
            (EventKind.RELEASED, new_token)} <= seen
    assert (EventKind.RELEASED, old_token) not in seen, seen


def trigger_kwargs(airflow: Deployment) -> list[str]:
    """The kwargs of every trigger in the metadata database, as JSON text: decrypted with the deployment's
    Fernet key, as Airflow reads them (models/trigger.py)."""
    from cryptography.fernet import Fernet

    fernet = Fernet(airflow.env["AIRFLOW__CORE__FERNET_KEY"].encode())
    texts = []
    for (text,) in execute(airflow.dsn, "SELECT kwargs FROM trigger"):
        texts.append(str(text) if str(text).startswith("{") else fernet.decrypt(str(text).encode()).decode())
    return texts


def test_a_waiting_run_over_the_api_defers_and_runs_after_the_holder_releases_never_alongside_it(
    airflow: Deployment, store: LeaseStore
) -> None:
    """on_overlap="wait" on the API path: the second run's task defers; its trigger, in the triggerer, polls
    the api-server (the secret read there) and the task runs once the first released, with the next token."""
    api = airflow.api
    first = api.trigger("metadb_wait")
    _, token_first = marker(f"wait-started-{first}").split()
    second = api.trigger("metadb_wait")
    wait(lambda: api.task_states("metadb_wait", second).get("work"), lambda state: state == "deferred", 180,
         "the second run's task to defer")
    assert not (MARKERS / f"wait-started-{second}").exists()  # it never ran alongside the holder
    waiting = store.events.query(key="metadb-wait", kind=EventKind.WAITING)
    assert [(e.run.run_id if e.run else None, e.detail.get("holder_token")) for e in waiting] == [
        (second, int(token_first))], waiting  # recorded once over /event, naming the holder
    # The trigger's kwargs (decrypted as the triggerer reads them) and the resumed task's carry no secret.
    kwargs = trigger_kwargs(airflow)
    assert kwargs and all('"access": "api"' in k and SECRET not in k for k in kwargs), kwargs
    next_kwargs = execute(airflow.dsn, "SELECT next_kwargs::text FROM task_instance WHERE dag_id = %s AND run_id = %s",
                          ("metadb_wait", second))
    assert next_kwargs and all(SECRET not in str(row) for row in next_kwargs), next_kwargs

    (MARKERS / f"wait-let-go-{first}").write_text("go")
    assert api.wait_for_run("metadb_wait", first) == "success"
    finished_first = float(marker(f"wait-finished-{first}"))
    started_second, token_second = marker(f"wait-started-{second}", timeout=180).split()
    assert float(started_second) > finished_first, "the waiter ran while the holder still held the lease"
    assert int(token_second) > int(token_first)
    (MARKERS / f"wait-let-go-{second}").write_text("go")
    assert api.wait_for_run("metadb_wait", second) == "success", api.task_states("metadb_wait", second)
    assert api.xcom("metadb_wait", second, "work", "return_value") == int(token_second)
    assert API_PATH_LINE in api.log("metadb_wait", second, "work")
    # The trigger polled the api-server (the triggerer has no lease connection of its own to use instead).
    assert "/lease/v1/holders" in (airflow.logs / "api-server.log").read_text(errors="replace")
    assert store.holder("metadb-wait") is None
    assert store.events.query(key="metadb-wait", kind=EventKind.SKIPPED_OVERLAP) == []


def test_one_waiting_place_over_the_api_three_runs_one_runs_one_waits_then_runs_the_third_is_skipped_naming_it(
    airflow: Deployment, store: LeaseStore
) -> None:
    """on_overlap="wait", max_waiting=1 on the API path: the place taken over /wait/claim (the store gives at
    most one), kept by the trigger through the api-server, given back by the resumed task."""
    api = airflow.api
    runs = [api.trigger("metadb_buffer") for _ in range(3)]

    def states() -> dict[str, str | None]:
        return {run: api.task_states("metadb_buffer", run).get("work") for run in runs}

    settled = wait(states, lambda s: sorted(map(str, s.values())) == ["deferred", "running", "skipped"], 240,
                   "one run holding, one deferred, one skipped")
    holder = next(r for r, state in settled.items() if state == "running")
    waiter = next(r for r, state in settled.items() if state == "deferred")
    skipped = next(r for r, state in settled.items() if state == "skipped")
    _, holder_token = marker(f"buffer-started-{holder}").split()
    reason = api.xcom("metadb_buffer", skipped, "work", "lease_skip_reason")
    assert [w["owner"] for w in reason["waiters"]] == [f"metadb_buffer/{waiter}/work"], reason
    assert f"metadb_buffer/{waiter}/work" in reason["reason"] and "waiting place" in reason["reason"], reason
    assert f"metadb_buffer/{waiter}/work" in api.log("metadb_buffer", skipped, "work")
    # The place is the waiter's, taken through the API (its capability's digest on the row).
    places = execute(airflow.dsn, q("SELECT owner, api_capability IS NOT NULL FROM {schema}.lease_waiter "
                                    "WHERE key = %s", SCHEMA), ("metadb-buffer",))
    assert places == [(f"metadb_buffer/{waiter}/work", True)], places
    assert "/lease/v1/wait/claim" in (airflow.logs / "api-server.log").read_text(errors="replace")
    (full,) = store.events.query(key="metadb-buffer", kind=EventKind.SKIPPED_BUFFER_FULL)
    assert full.run is not None and full.run.run_id == skipped

    (MARKERS / f"buffer-let-go-{holder}").write_text("go")
    assert api.wait_for_run("metadb_buffer", holder) == "success"
    finished = float(marker(f"buffer-finished-{holder}"))
    started, token = marker(f"buffer-started-{waiter}", timeout=180).split()
    assert float(started) > finished and int(token) > int(holder_token)
    (MARKERS / f"buffer-let-go-{waiter}").write_text("go")
    assert api.wait_for_run("metadb_buffer", waiter) == "success", api.task_states("metadb_buffer", waiter)
    assert api.wait_for_run("metadb_buffer", skipped) == "success"  # skipped, not failed
    assert not (MARKERS / f"buffer-started-{skipped}").exists()
    assert store.waiters(["metadb-buffer"]) == [] and store.holder("metadb-buffer") is None


def test_a_new_try_of_a_waiting_run_whose_triggerer_was_killed_keeps_its_place_and_runs_after_the_holder(
    airflow: Deployment, store: LeaseStore
) -> None:
    """docs/api.md, decision 9: a run waits with max_waiting=1 (its place taken over /wait/claim, kept by its
    trigger); the triggerer is killed (SIGKILL: nothing gives the place back) and the run is cleared. Its new
    try claims with a place id of its own and takes the place over once its dead keeper's claims stopped (not
    skipped as if every place were taken); its order and owner are kept, only the capability changes. Then a
    triggerer again: the new try's trigger waits, and the run takes the lease once the holder is done."""
    api, dag, key = airflow.api, "metadb_retry_place", "metadb-retry-place"
    holder = api.trigger(dag)
    _, holder_token = marker(f"retry-started-{holder}").split()
    waiter = api.trigger(dag)
    owner = f"{dag}/{waiter}/work"

    def place() -> list[tuple[Any, ...]]:
        return execute(airflow.dsn, q("SELECT owner, since, api_capability FROM {schema}.lease_waiter WHERE key = %s",
                                      SCHEMA), (key,))

    wait(lambda: api.task_states(dag, waiter).get("work"), lambda s: s == "deferred", 180, "the waiter deferred")
    (before,) = wait(place, lambda rows: [r[0] for r in rows] == [owner], 60, "the waiter's place")
    assert before[2] is not None  # taken through the lease API
    # The trigger claims the place as it starts (its expiry moves on): its keeper is the triggerer now.
    wait(lambda: execute(airflow.dsn, q("SELECT expires_at FROM {schema}.lease_waiter WHERE key = %s", SCHEMA),
                         (key,)), lambda rows: bool(rows) and rows[0][0] > before[1] + timedelta(seconds=91), 120,
         "the trigger to keep the place")
    (triggerer,) = [p for p in airflow.started if p.args[-1] == "triggerer" and p.poll() is None]
    os.killpg(triggerer.pid, signal.SIGKILL)
    triggerer.wait(timeout=30)
    try:
        api.clear(dag, waiter, ["work"])
        # The new try takes the place over (at once when it is stale already, else when its keeper's claims
        # stopped for two thirds of its TTL): the same owner and order, another capability.
        (after,) = wait(place, lambda rows: len(rows) == 1 and bytes(rows[0][2]) != bytes(before[2]), 240,
                        "the new try to take its place over")
        assert after[:2] == before[:2]
        wait(lambda: api.task_states(dag, waiter).get("work"), lambda s: s == "deferred", 120,
             "the new try deferred, keeping its place")
    finally:
        airflow._start("triggerer", "triggerer")
    tries = api.tries(dag, waiter, "work")
    assert len(tries) >= 2, tries
    assert not (MARKERS / f"retry-started-{waiter}").exists()
    (MARKERS / f"retry-let-go-{holder}").write_text("go")
    assert api.wait_for_run(dag, holder) == "success"
    started, token = marker(f"retry-started-{waiter}", timeout=240).split()
    assert int(token) > int(holder_token)
    (MARKERS / f"retry-let-go-{waiter}").write_text("go")
    assert api.wait_for_run(dag, waiter) == "success", api.task_states(dag, waiter)
    last = api.tries(dag, waiter, "work")[-1]
    assert last["state"] == "success" and last["try_number"] >= 2, last
    log = api.log(dag, waiter, "work", try_number=last["try_number"])
    assert "taken over from its stale keeper" in log, log[-3000:]
    assert store.waiters([key]) == [] and store.holder(key) is None
    assert not store.events.query(key=key, kind=EventKind.SKIPPED_BUFFER_FULL)


def test_replace_with_a_grace_over_the_api_waits_the_grace_then_takes_over_and_the_older_run_ends_skipped(
    airflow: Deployment, store: LeaseStore
) -> None:
    """on_overlap="replace", replace_grace=20 s on the API path: the newer run defers for the grace (its
    trigger polling the api-server), the older one does not finish, and the newer takes the lease over; the
    older task ends skipped naming it (not failed, not retried)."""
    api = airflow.api
    old = api.trigger("metadb_grace")
    started_old, token_old = marker(f"grace-started-{old}").split()
    new = api.trigger("metadb_grace")
    wait(lambda: api.task_states("metadb_grace", new).get("work"), lambda state: state == "deferred", 180,
         "the newer run's task to defer for the grace")
    assert store.holder("metadb-grace").token == int(token_old)  # the older keeps it through the grace
    started_new, token_new = marker(f"grace-started-{new}", timeout=240).split()
    assert float(started_new) - float(started_old) >= 20 - 1, "taken over before the grace was over"
    assert int(token_new) > int(token_old)
    assert api.wait_for_run("metadb_grace", old) == "success"  # its task skipped: the run did not fail
    assert api.task_states("metadb_grace", old) == {"work": "skipped"}
    reason = api.xcom("metadb_grace", old, "work", "lease_skip_reason")
    assert reason is not None and reason["replaced_by_token"] == int(token_new) and new in reason["reason"], reason
    assert not (MARKERS / f"grace-finished-{old}").exists()
    replaced = store.events.query(key="metadb-grace", kind=EventKind.REPLACED)
    assert [e.token for e in replaced] == [int(token_old)], replaced
    (MARKERS / f"grace-let-go-{new}").write_text("go")
    assert api.wait_for_run("metadb_grace", new) == "success", api.task_states("metadb_grace", new)
    assert store.holder("metadb-grace") is None


def test_the_leases_page_shows_both_keys_and_their_events(airflow: Deployment) -> None:
    """The Leases page (its HTML and the JSON it reads) as an authenticated user, on the metadata store."""
    assert "Leases" in ui_get(airflow, "/lease/ui/")
    page = ui_get(airflow, "/lease/api/leases")
    rows = {row["key"]: row for row in page["leases"]}
    assert {"metadb-overlap", "metadb-zombie"} <= set(rows), page
    assert page["store"]["schema"] == SCHEMA, page["store"]
    zombie = ui_get(airflow, "/lease/api/lease", key="metadb-zombie")["lease"]
    assert zombie["owner"].startswith("metadb_zombie/") and zombie["token"] == grant_row(airflow, "metadb-zombie")[1]
    kinds = {(e["key"], e["kind"]) for e in ui_get(airflow, "/lease/api/events", limit=500)["events"]}
    assert {("metadb-overlap", "acquired"), ("metadb-overlap", "skipped_overlap"), ("metadb-overlap", "released"),
            ("metadb-zombie", "acquired"), ("metadb-zombie", "released")} <= kinds, kinds
    zombie_events = ui_get(airflow, "/lease/api/events", key="metadb-zombie", kind="acquired")["events"]
    assert len({e["run_id"] for e in zombie_events}) == 2, zombie_events  # the frozen run's grant and the newer
    # The page's data is the UI login's: no login, no data.
    anonymous = httpx.get(f"{airflow.url}/lease/api/leases", timeout=30)
    assert anonymous.status_code in (401, 403), anonymous.text


# -- door B: an attacker over HTTP -----------------------------------------------------------------------------


def post(airflow: Deployment, path: str, credential: str | None, body: Any, *, raw: bytes | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {credential}"} if credential is not None else {}
    if raw is not None:
        response = httpx.post(f"{airflow.url}/lease/v1/{path}", content=raw,
                              headers={**headers, "Content-Type": "application/json"}, timeout=60)
    else:
        response = httpx.post(f"{airflow.url}/lease/v1/{path}", json=body, headers=headers, timeout=60)
    ANSWERS.append(response.text)
    return response


def get_check(airflow: Deployment, credential: str | None, params: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {credential}"} if credential is not None else {}
    response = httpx.get(f"{airflow.url}/lease/v1/check", params=params, headers=headers, timeout=60)
    ANSWERS.append(response.text)
    return response


def take(airflow: Deployment, key: str, owner: str, ttl: float = 600) -> tuple[dict[str, Any], str]:
    """A grant over HTTP with the secret: its (key, owner, token) and capability."""
    response = httpx.post(f"{airflow.url}/lease/v1/acquire", json={"key": key, "owner": owner, "ttl_seconds": ttl},
                          headers={"Authorization": f"Bearer {SECRET}"}, timeout=60)
    assert response.status_code == 200, response.text
    capability = response.json()["capability"]
    CAPABILITIES.append(capability)
    return {k: response.json()["lease"][k] for k in ("key", "owner", "token")}, capability


def snapshot(airflow: Deployment) -> tuple[list[Any], ...]:
    """Everything of the store an attack could change: the grants, the fences, their claims, the ledger."""
    return (
        execute(airflow.dsn, q("SELECT key, owner, token, acquired_at, renewed_at, expires_at, released_at, "
                               "api_capability FROM {schema}.lease ORDER BY key", SCHEMA)),
        execute(airflow.dsn, q("SELECT resource, key, token, owner FROM {schema}.fence ORDER BY resource, key", SCHEMA)),
        execute(airflow.dsn, q("SELECT resource, idempotency_key, token, owner FROM {schema}.fence_publish "
                               "ORDER BY resource, idempotency_key", SCHEMA)),
        execute(airflow.dsn, q("SELECT count(*), max(id) FROM {schema}.event", SCHEMA)),
        execute(airflow.dsn, q("SELECT key, owner, expires_at, api_capability FROM {schema}.lease_waiter "
                               "ORDER BY key, owner", SCHEMA)),
    )


#: The routes that act under a grant, each with the body it takes for a grant reference.
GRANT_ROUTES: dict[str, Any] = {
    "renew": lambda ref: ref,
    "release": lambda ref: ref,
    "check": lambda ref: ref,
    "check?": lambda ref: ref,  # GET, the grant in the query
    "fence": lambda ref: {**ref, "resource": "attack-target", "idempotency_key": "attack-slot"},
    "fence/give_back": lambda ref: {**ref, "resource": "attack-target", "idempotency_key": "attack-slot"},
    "event": lambda ref: {**ref, "kind": "lost", "detail": {"reason": "forged"}},
}


def send(airflow: Deployment, route: str, credential: str | None, ref: dict[str, Any]) -> httpx.Response:
    body = GRANT_ROUTES[route](ref)
    if route == "check?":
        return get_check(airflow, credential, body)
    return post(airflow, route, credential, body)


ALL_ROUTES = ["acquire", "renew", "release", "check", "check?", "fence", "fence/give_back", "event", "replaced_by",
              "holders", "waiters", "wait/claim", "wait/release"]


@pytest.mark.parametrize("header", [None, "Basic YWRtaW46YWRtaW4tcHc=", "Bearer", f"Basic {SECRET}", f"Token {SECRET}"],
                         ids=["none", "basic-login", "bearer-empty", "basic-secret", "token-secret"])
def test_every_lease_route_without_credentials_is_401_and_takes_nothing(airflow: Deployment, header: str | None) -> None:
    before = snapshot(airflow)
    body = {"key": "attack-401", "owner": "o", "token": 1, "ttl_seconds": 60, "resource": "r",
            "idempotency_key": "i", "kind": "skipped_overlap", "detail": {}, "keys": ["attack-401"],
            "max_waiting": 1, "request_id": secrets.token_urlsafe(24)}
    headers = {"Authorization": header} if header is not None else {}
    for route in ALL_ROUTES:
        if route == "check?":
            response = httpx.get(f"{airflow.url}/lease/v1/check", params={"key": "k", "owner": "o", "token": 1},
                                 headers=headers, timeout=60)
        else:
            response = httpx.post(f"{airflow.url}/lease/v1/{route}", json=body, headers=headers, timeout=60)
        ANSWERS.append(response.text)
        assert response.status_code == 401, (route, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
    assert snapshot(airflow) == before


def test_acquire_with_anything_but_the_secret_is_403_and_takes_nothing(airflow: Deployment) -> None:
    """A wrong secret, the secret with a byte more or less, a capability, an Airflow JWT (the UI login's or the
    REST API's token), the connection's login: 403, nothing taken, no event written."""
    ref, capability = take(airflow, "attack-acquire-other", "someone")
    jwt = airflow.api._token or airflow.api._login()
    before = snapshot(airflow)
    body = {"key": "attack-acquire", "owner": "attacker", "ttl_seconds": 60}
    for credential in ("wrong", SECRET[:-1], SECRET + "x", SECRET.upper(), capability, jwt, "http"):
        response = post(airflow, "acquire", credential, body)
        assert response.status_code == 403, response.text
        assert response.json()["detail"] == "wrong acquire secret"
    # Nor does the UI's cookie login stand in for it (the route reads only its own header).
    cookie = httpx.post(f"{airflow.url}/lease/v1/acquire", json=body, cookies={"_token": jwt}, timeout=60)
    ANSWERS.append(cookie.text)
    assert cookie.status_code == 401
    # Nor may a refusal event, or who-replaced-whom, be asked with anything but the secret.
    skip = {"kind": "skipped_overlap", "key": ref["key"], "owner": "attacker", "detail": {"holder_token": ref["token"]}}
    for credential in (capability, jwt, "wrong"):
        assert post(airflow, "event", credential, skip).status_code == 403
        assert post(airflow, "replaced_by", credential, ref).status_code == 403
    assert snapshot(airflow) == before
    assert post(airflow, "release", capability, ref).json()["released"] is True


def test_a_grant_s_routes_refuse_every_credential_but_its_own_capability_and_the_store_is_unchanged(
    airflow: Deployment,
) -> None:
    victim, victim_cap = take(airflow, "attack-victim", "victim-owner")
    # The victim has published under an idempotency key: a claim an attacker would like to give back.
    published = post(airflow, "fence", victim_cap, GRANT_ROUTES["fence"](victim))
    assert published.status_code == 200 and published.json()["accepted"] is True, published.text
    attacker, attacker_cap = take(airflow, "attack-other", "attacker")
    # A grant released, then the key taken by a newer grant: the old capability replayed.
    old, old_cap = take(airflow, "attack-replayed", "old-owner")
    assert post(airflow, "release", old_cap, old).json()["released"] is True
    newer, _newer_cap = take(airflow, "attack-replayed", "newer-owner")
    assert newer["token"] == old["token"] + 1
    jwt = airflow.api._token or airflow.api._login()
    (digest,), = execute(airflow.dsn, q("SELECT api_capability FROM {schema}.lease WHERE key = %s", SCHEMA),
                         (victim["key"],))
    stored_digest = base64.urlsafe_b64encode(bytes(digest)).rstrip(b"=").decode()
    assert len(stored_digest) == len(victim_cap)  # shaped like a capability

    attacks = [
        ("another grant's capability", attacker_cap, victim),
        ("a released grant's capability, its own grant since taken over", old_cap, old),
        ("a released grant's capability, for the newer grant", old_cap, newer),
        ("the right capability, another key", victim_cap, {**victim, "key": attacker["key"]}),
        ("the right capability, another owner", victim_cap, {**victim, "owner": "attacker"}),
        ("the right capability, the next token", victim_cap, {**victim, "token": victim["token"] + 1}),
        ("the acquire secret", SECRET, victim),
        ("an Airflow JWT", jwt, victim),
        ("a made-up capability", secrets.token_urlsafe(32), victim),
        ("the digest the store keeps (as a reader of the database has it)", stored_digest, victim),
    ]
    before = snapshot(airflow)
    for what, credential, ref in attacks:
        for route in GRANT_ROUTES:
            response = send(airflow, route, credential, ref)
            assert response.status_code == 403, (what, route, response.status_code, response.text)
            assert response.json()["detail"] == "not the holder's capability for this grant", (what, route)
    assert snapshot(airflow) == before

    # The victim's own capability still works, after all that: its grant and its claim are intact.
    assert post(airflow, "check", victim_cap, victim).json()["held"] is True
    assert post(airflow, "release", victim_cap, victim).json()["released"] is True


def test_a_released_grant_s_capability_replayed_before_a_newer_grant_changes_nothing(airflow: Deployment) -> None:
    """The row still holds the released grant: its capability may ask again (a release sent again answers the
    same, for a client whose answer was lost: docs/api.md), but never renews, fences or takes it back."""
    ref, capability = take(airflow, "attack-released", "owner-r")
    assert post(airflow, "release", capability, ref).json()["released"] is True
    before = snapshot(airflow)
    assert post(airflow, "renew", capability, ref).status_code == 409
    assert post(airflow, "check", capability, ref).json()["held"] is False
    assert get_check(airflow, capability, ref).json()["held"] is False
    refused = post(airflow, "fence", capability, {**ref, "resource": "attack-released-target"})
    assert refused.status_code == 409 and refused.json()["accepted"] is False
    assert post(airflow, "release", capability, ref).json()["released"] is True
    gave = post(airflow, "fence/give_back", capability, GRANT_ROUTES["fence/give_back"](ref))
    assert gave.status_code == 200 and gave.json()["given_back"] is False  # it had no claim
    assert snapshot(airflow) == before


@pytest.mark.parametrize(("what", "body", "status", "says"), [
    ("a key of 100,000 characters", {"key": "k" * 100_000, "owner": "o", "ttl_seconds": 60}, 422, "key"),
    ("an owner of 1 MB", {"key": "attack-huge", "owner": "o" * 1_000_000, "ttl_seconds": 60}, 422, "owner"),
    ("a NUL in the key", {"key": "attack\x00nul", "owner": "o", "ttl_seconds": 60}, 422, "NUL"),
    ("a NUL in the owner", {"key": "attack-nul", "owner": "o\x00", "ttl_seconds": 60}, 422, "NUL"),
    ("a negative TTL", {"key": "attack-neg", "owner": "o", "ttl_seconds": -1}, 422, "ttl_seconds"),
    ("a TTL as a string", {"key": "attack-str", "owner": "o", "ttl_seconds": "60"}, 422, "ttl_seconds"),
    ("a TTL of a year", {"key": "attack-year", "owner": "o", "ttl_seconds": 365 * 86400}, 422, "ttl_seconds"),
    ("a bidirectional override in the key", {"key": "attack\u202egnp", "owner": "o", "ttl_seconds": 60}, 422,
     "U+202E"),
    ("a list for a body", [1, 2, 3], 422, "body"),
    ("slots without their policy", {"key": "attack-slots", "owner": "o", "ttl_seconds": 60, "slots": 1000}, 422,
     "slots"),
])
def test_a_hostile_acquire_is_4xx_with_a_clear_message_and_takes_nothing(
    airflow: Deployment, what: str, body: Any, status: int, says: str
) -> None:
    before = snapshot(airflow)
    response = post(airflow, "acquire", SECRET, body)
    assert response.status_code == status, (what, response.text[:500])
    assert says in response.text, (what, response.text[:500])
    assert len(response.content) < 4096, what  # the answer does not echo a huge value back
    assert snapshot(airflow) == before


def test_hostile_bytes_and_a_token_as_a_string_on_the_grant_routes_are_4xx_and_change_nothing(
    airflow: Deployment,
) -> None:
    ref, capability = take(airflow, "attack-bytes", "owner-b")
    before = snapshot(airflow)
    not_utf8 = b'{"key": "attack-\xff\xfe", "owner": "o", "ttl_seconds": 60}'
    assert post(airflow, "acquire", SECRET, None, raw=not_utf8).status_code == 400
    assert post(airflow, "acquire", SECRET, None, raw=b'{"key": ').status_code in (400, 422)
    for route in ("renew", "release", "check", "fence", "event"):
        body = GRANT_ROUTES[route](ref)
        as_string = post(airflow, route, capability, {**body, "token": str(ref["token"])})
        assert as_string.status_code == 422 and "token" in as_string.text, (route, as_string.text)
        with_nul = post(airflow, route, capability, {**body, "key": ref["key"] + "\x00"})
        assert with_nul.status_code == 422 and "NUL" in with_nul.text, (route, with_nul.text)
        huge = post(airflow, route, capability, {**body, "owner": "o" * 1_000_000})
        assert huge.status_code == 422 and len(huge.content) < 4096, (route, huge.text[:300])
        negative = post(airflow, route, capability, {**body, "token": -ref["token"]})
        assert negative.status_code == 422 and "token" in negative.text, (route, negative.text)
    forged = post(airflow, "event", capability, {**ref, "kind": "lost", "detail": {"x": "y" * 100_000}})
    assert forged.status_code == 422 and "16384" in forged.text and len(forged.content) < 4096, forged.text[:300]
    assert get_check(airflow, capability, {**ref, "token": "1e3"}).status_code == 422
    assert snapshot(airflow) == before
    assert post(airflow, "release", capability, ref).json()["released"] is True


def _capability_shaped(text: str) -> set[str]:
    return set(re.findall(r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])", text))


def test_a_waiting_place_is_kept_and_given_back_by_its_taker_only_and_the_store_is_unchanged(
    airflow: Deployment
) -> None:
    """The waiting routes on the real api-server (docs/api.md, decision 9): another request id cannot keep or
    take over a place; another place's capability, the same owner's of another key, the secret, a grant's
    capability, and the taker's own once the place is given back: 403, nothing changed."""

    def claim(key: str, owner: str, request_id: str, max_waiting: int = 2) -> httpx.Response:
        body = {"key": key, "owner": owner, "ttl_seconds": 600, "max_waiting": max_waiting, "request_id": request_id}
        response = httpx.post(f"{airflow.url}/lease/v1/wait/claim", json=body,
                              headers={"Authorization": f"Bearer {SECRET}"}, timeout=60)
        if response.status_code != 200:  # a place's own answer carries its capability: not one to search
            ANSWERS.append(response.text)
        return response

    mine_id = secrets.token_urlsafe(24)
    taken = [claim("attack-wait", "victim", mine_id), claim("attack-wait", "other", secrets.token_urlsafe(24)),
             claim("attack-wait-2", "victim", secrets.token_urlsafe(24))]
    assert [r.status_code for r in taken] == [200, 200, 200], [r.text for r in taken]
    mine, other, elsewhere = (r.json()["capability"] for r in taken)
    CAPABILITIES.extend([mine, other, elsewhere])
    _, grant_capability = take(airflow, "attack-wait-grant", "someone")
    before = snapshot(airflow)
    assert claim("attack-wait", "victim", secrets.token_urlsafe(24)).status_code == 403  # not its request id
    assert claim("attack-wait", "third", secrets.token_urlsafe(24)).status_code == 409  # both places taken
    for credential in (other, elsewhere, SECRET, grant_capability, None):
        response = post(airflow, "wait/release", credential, {"key": "attack-wait", "owner": "victim"})
        assert response.status_code == (401 if credential is None else 403), response.text
    assert post(airflow, "wait/release", mine, {"key": "attack-wait", "owner": "other"}).status_code == 403
    assert snapshot(airflow) == before
    assert post(airflow, "wait/release", mine, {"key": "attack-wait", "owner": "victim"}).status_code == 200
    after = snapshot(airflow)
    assert post(airflow, "wait/release", mine, {"key": "attack-wait", "owner": "victim"}).status_code == 403  # replayed
    assert snapshot(airflow) == after
    for route, body in (("holders", {"key": "a\x00b"}), ("wait/claim", {"key": "k", "owner": "o", "ttl_seconds": 60,
                        "max_waiting": "1", "request_id": secrets.token_urlsafe(24)}), ("waiters", {"keys": "k"})):
        assert post(airflow, route, SECRET, body).status_code == 422, route
    assert snapshot(airflow) == after


def test_no_answer_and_no_log_carries_the_secret_or_a_capability(airflow: Deployment) -> None:
    """Every answer this module got (but a grant's own), the api-server's, scheduler's and dag-processor's logs
    and every task log: never the acquire secret, never a capability the test was given, and never the
    capability of a grant the tasks took (whose digest the store keeps: every 43-character URL-safe string in
    the task logs is checked against the digests of the rows)."""
    assert CAPABILITIES, "the attack tests gave no capability to look for"
    for answer in ANSWERS:
        assert SECRET not in answer
        assert not any(capability in answer for capability in CAPABILITIES)
    process_logs = {path: path.read_text(errors="replace") for path in airflow.logs.glob("*.log")}
    task_logs = {path: path.read_text(errors="replace") for path in (airflow.home / "logs").rglob("*") if path.is_file()}
    assert any("metadb_zombie" in str(path) for path in task_logs), sorted(map(str, task_logs))[:20]
    assert "/lease/v1/acquire" in process_logs[airflow.logs / "api-server.log"]  # the requests are logged...
    for path, text in {**process_logs, **task_logs}.items():
        assert SECRET not in text, path  # ... and nothing of their credentials
        assert not any(capability in text for capability in CAPABILITIES), path
    rows = execute(airflow.dsn, q("SELECT key, owner, token, api_capability FROM {schema}.lease "
                                  "WHERE api_capability IS NOT NULL", SCHEMA))
    digests = {bytes(digest) for *_ref, digest in rows}
    task_grants = [(key, owner, token) for key, owner, token, _digest in rows if key.startswith("metadb-")]
    assert {key for key, _owner, _token in task_grants} == {
        "metadb-overlap", "metadb-zombie", "metadb-wait", "metadb-buffer", "metadb-grace", "metadb-retry-place"}, rows
    for path, text in {**process_logs, **task_logs}.items():
        for candidate in _capability_shaped(text):
            for key, owner, token in task_grants:
                material = "\0".join((key, owner, str(token), candidate)).encode()
                assert hashlib.sha256(material).digest() not in digests, f"a task's capability in {path}"
