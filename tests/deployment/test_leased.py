"""Leased tasks where the point is scheduling: two runs at once, a frozen run, a crashed try's retry.

The DAGs of ``tests/airflow/dags`` (and ``dags/retry_e2e.py``) under a real scheduler; every run is
triggered through the REST API with no logical date and read back through it. Markers in a directory
the test shares with the task processes say when a task reached a point (``_util.mark``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_lease_provider.core import EventKind, LeaseStore
from demo.airflow_api import wait
from demo.deployment import ROOT, Deployment, MetadataTemplate
from tests.deployment.conftest import Markers, deployment_for
from tests.pg import execute, q, scratch_dir

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

E2E_DAGS = ROOT / "tests" / "airflow" / "dags"
TIER_DAGS = Path(__file__).parent / "dags"
MARKERS = scratch_dir("lease-tier-markers-")
SCHEMA = "airflow_lease"


@pytest.fixture(scope="module")
def airflow(metadata_template: MetadataTemplate) -> Iterator[Deployment]:
    files = [E2E_DAGS / "lease_e2e.py", E2E_DAGS / "_util.py", TIER_DAGS / "retry_e2e.py",
             TIER_DAGS / "marked_failed.py", TIER_DAGS / "held_connection.py",
             TIER_DAGS / "default_args_ttl.py", TIER_DAGS / "wait_overlap.py", TIER_DAGS / "replace_frozen.py",
             TIER_DAGS / "buffer_three.py", TIER_DAGS / "semaphore_three.py", TIER_DAGS / "mixed_slots.py"]
    # Every task here keeps its store connection (the other tiers run the default: one per operation).
    env = {"LEASE_TEST_MARKERS": str(MARKERS), "LEASE_TEST_HOLD_SECONDS": "240", "AIRFLOW__LEASE__SCHEMA": SCHEMA,
           "AIRFLOW__LEASE__HOLD_CONNECTION": "true"}
    dag_ids = {"overlap", "zombie", "retry_after_crash", "mapped_and_bash", "marked_failed", "held_connection",
               "default_args_ttl", "wait_overlap", "replace_frozen", "buffer_three", "semaphore_three",
               "mixed_slots_x", "mixed_replace_y"}
    # With a triggerer: on_overlap="wait" defers, and the triggerer is what resumes the task.
    with deployment_for(metadata_template, files, dag_ids, env, triggerer=True) as deployment:
        for dag_id in dag_ids:
            deployment.api.unpause(dag_id)
        yield deployment
    import shutil

    shutil.rmtree(MARKERS, ignore_errors=True)


# ``store`` (conftest's): the deployment's lease store in SCHEMA (its ``AIRFLOW__LEASE__SCHEMA``), whose ledger
# is what ``airflow-lease events`` shows.
marker = Markers(MARKERS, timeout=120)


def test_two_runs_at_once_one_holds_and_the_other_is_skipped_with_the_holder_named(
    airflow: Deployment, store: LeaseStore
) -> None:
    api = airflow.api
    first = api.trigger("overlap")
    marker("hold-started")
    holder = store.holder("overlap-key")
    assert holder is not None and holder.owner.startswith(f"overlap/{first}"), holder

    second = api.trigger("overlap")
    assert api.wait_for_run("overlap", second) == "success"  # skipped tasks: the run did not fail
    assert api.task_states("overlap", second) == {"hold": "skipped", "after": "skipped"}
    reason = api.xcom("overlap", second, "hold", "lease_skip_reason")
    assert reason is not None and holder.owner in reason["reason"] and f"token {holder.token}" in reason["reason"]
    assert reason["holder_token"] == holder.token
    assert holder.owner in api.log("overlap", second, "hold")
    skips = store.events.query(key="overlap-key", kind=EventKind.SKIPPED_OVERLAP)
    assert len(skips) == 1 and skips[0].detail["holder_owner"] == holder.owner
    assert api.run("overlap", first)["state"] == "running"  # the holder was never disturbed
    # Counted as a skip, not as a failure.
    wait(lambda: airflow.statsd.count("scheduled.skipped_overlap"), lambda n: n == 1, 10, "the skip metric")
    assert airflow.statsd.count("ti_failures") == 0

    (MARKERS / "let-go").write_text("done")
    assert api.wait_for_run("overlap", first) == "success"
    assert api.task_states("overlap", first) == {"hold": "success", "after": "success"}
    assert store.holder("overlap-key") is None  # released on success


def test_a_frozen_run_cannot_publish_after_a_newer_run_took_over(airflow: Deployment, store: LeaseStore) -> None:
    api = airflow.api
    zombie = api.trigger("zombie")
    pid = int(marker("zombie-pid"))
    old = store.holder("zombie-key")
    assert old is not None and old.owner.startswith(f"zombie/{zombie}"), old
    os.kill(pid, signal.SIGSTOP)  # frozen past its 4 s TTL: a lost VM, a GC pause
    try:
        time.sleep(5)
        (MARKERS / "go").write_text("now")  # the newer run goes straight through; the frozen one sees it later
        fresh = api.trigger("zombie")
        assert api.wait_for_run("zombie", fresh) == "success", api.task_states("zombie", fresh)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert api.wait_for_run("zombie", zombie) == "failed"
    assert api.task_states("zombie", zombie) == {"publish": "failed"}

    rows = execute(airflow.dsn, q("SELECT writer, token FROM {schema}.zombie_target", SCHEMA))
    assert len(rows) == 1 and rows[0][1] == old.token + 1, f"only the newer write may land: {rows}"
    assert not (MARKERS / f"published-{old.token}").exists()
    # Why the frozen run stopped, in the ledger and in its task log: lease lost, or refused by the fence.
    lost = store.events.query(key="zombie-key", kind=EventKind.LOST)
    rejected = store.events.query(kind=EventKind.FENCE_REJECTED)
    assert any(e.token == old.token for e in lost + rejected), (lost, rejected)
    log = api.log("zombie", zombie, "publish")
    assert "LeaseLost" in log or "StaleFencingToken" in log, log[-3000:]


def test_a_retry_after_a_crash_re_enters_at_once_with_a_larger_token(
    airflow: Deployment, store: LeaseStore
) -> None:
    api = airflow.api
    started = time.monotonic()
    run = api.trigger("retry_after_crash")
    assert api.wait_for_run("retry_after_crash", run, timeout=240) == "success"
    # The first try died holding a 10-minute lease; the retry did not wait for it to lapse.
    assert time.monotonic() - started < 240
    ti = api.task_instances("retry_after_crash", run)["crash_then_succeed"]
    assert ti["state"] == "success" and ti["try_number"] == 2, ti
    first, second = int(marker("try-1")), int(marker("try-2"))
    assert second > first, (first, second)
    assert api.xcom("retry_after_crash", run, "crash_then_succeed")["token"] == second
    assert store.holder("retry-key") is None


def test_a_running_leased_task_marked_failed_gives_its_lease_back_and_the_next_run_takes_it_at_once(
    airflow: Deployment, store: LeaseStore
) -> None:
    """Marked failed through the REST API (as the UI does it) while its body runs: Airflow's supervisor
    sends SIGTERM, the body stops and the lease is released, so the next run is not skipped for the rest
    of its 10-minute TTL."""
    api = airflow.api
    first = api.trigger("marked_failed")
    token = int(marker(f"marked-started-{first}"))
    held = store.holder("marked-key")
    assert held is not None and held.owner == f"marked_failed/{first}/work" and held.token == token, held

    api.set_task_state("marked_failed", first, "work", "failed")
    wait(lambda: store.holder("marked-key"), lambda h: h is None, 30, "the marked-failed task's lease to be released")
    assert api.wait_for_run("marked_failed", first) == "failed"
    assert api.task_states("marked_failed", first) == {"work": "failed"}
    assert not (MARKERS / f"marked-finished-{first}").exists(), "the body went on after it was marked failed"
    released = [e for e in store.events.query(key="marked-key", kind=EventKind.RELEASED) if e.token == token]
    assert len(released) == 1 and released[0].owner == held.owner, released  # released, not lapsed

    second = api.trigger("marked_failed")
    assert int(marker(f"marked-started-{second}")) == token + 1  # it ran (not skipped), with the next token
    (MARKERS / f"marked-let-go-{second}").write_text("go")
    assert api.wait_for_run("marked_failed", second) == "success", api.task_states("marked_failed", second)
    assert store.holder("marked-key") is None


def test_a_task_holding_its_connection_renews_with_the_prepared_statement(airflow: Deployment) -> None:
    """[lease] hold_connection = true: the keeper's renewals go over the task's one connection, prepared from
    the second on (docs/core.md, "Prepared statements"); read back from the task's XCom."""
    api = airflow.api
    run = api.trigger("held_connection")
    assert api.wait_for_run("held_connection", run) == "success", api.task_states("held_connection", run)
    seen = api.xcom("held_connection", run, "work")
    assert seen["held"] and seen["renewals"] >= 3 and seen["connects"] == 1, seen
    assert seen["renew_prepared"], seen


def test_task_leased_takes_its_ttl_from_default_args_mapped_or_not(airflow: Deployment) -> None:
    """``@task.leased()`` in a DAG whose ``default_args`` set ``lease_ttl`` parses (it was an import error,
    "lease_ttl=None: is required") and runs with that TTL; a task group's ``default_args`` win over the DAG's."""
    api = airflow.api
    run = api.trigger("default_args_ttl")
    assert api.wait_for_run("default_args_ttl", run) == "success", api.task_states("default_args_ttl", run)
    assert api.xcom("default_args_ttl", run, "plain") == 45.0
    assert [api.xcom("default_args_ttl", run, "mapped", map_index=i) for i in (0, 1)] == [
        [1, 45.0, "default_args_ttl.mapped[0]"], [2, 45.0, "default_args_ttl.mapped[1]"]
    ]
    assert api.xcom("default_args_ttl", run, "overridden", map_index=0) == [3, 45.0, "over-0"]
    assert api.xcom("default_args_ttl", run, "group.in_group") == 50.0


def test_lease_owners_and_default_keys_are_the_task_instance(airflow: Deployment, store: LeaseStore) -> None:
    """The shared decision: owner ``dag_id/run_id/task_id[map_index]``, no try number."""
    api = airflow.api
    run = api.trigger("mapped_and_bash")
    assert api.wait_for_run("mapped_and_bash", run) == "success", api.task_states("mapped_and_bash", run)
    for index in range(3):
        shard = api.xcom("mapped_and_bash", run, "shard", map_index=index)
        assert shard["owner"] == f"mapped_and_bash/{run}/shard[{index}]", shard
        assert shard["key"] == f"shard-{index}", shard  # an explicit key is kept as given
    retried = [r["dag_run_id"] for r in api.runs("retry_after_crash")]
    for run_id in retried:
        result = api.xcom("retry_after_crash", run_id, "crash_then_succeed")
        assert result["owner"] == f"retry_after_crash/{run_id}/crash_then_succeed", result


def _lease_api(api: Any, path: str, **params: Any) -> Any:
    """GET a Leases plugin endpoint (``/lease/api/...``) as the deployment's API user."""
    token = api._token or api._login()
    reply = api._client.get(path, params=params, headers={"Authorization": f"Bearer {token}"})
    assert reply.status_code == 200, (path, reply.status_code, reply.text[:2000])
    return reply.json()


def test_the_events_of_a_run_carry_its_columns_and_are_found_by_them_through_rest_and_cli(
    airflow: Deployment, store: LeaseStore
) -> None:
    """Every event a real run caused (also those the store writes: acquired, released) names its task
    instance in the run columns, and the UI's task-instance endpoint and the CLI find them by it."""
    api = airflow.api
    run = api.trigger("mapped_and_bash")  # no logical date
    assert api.wait_for_run("mapped_and_bash", run) == "success", api.task_states("mapped_and_bash", run)

    found = store.run_events("mapped_and_bash", run)
    assert {e.run.run_id for e in found if e.run} == {run} and all(e.run for e in found)
    by_instance = {(e.kind, e.run.task_id, e.run.map_index) for e in found if e.run}
    for kind in (EventKind.ACQUIRED.value, EventKind.RELEASED.value):
        assert {(kind, "shard", i) for i in range(3)} | {(kind, "bash", -1)} <= by_instance, by_instance
    # The columns are what the owner says, written with the event (not matched on the owner afterwards).
    rows = execute(
        airflow.dsn,
        q("SELECT owner, dag_id, run_id, task_id, map_index FROM {schema}.event WHERE starts_with(owner, %s)", SCHEMA),
        (f"mapped_and_bash/{run}/",),
    )
    assert rows and all(
        owner == f"{dag}/{run_id}/{task}" + (f"[{index}]" if index >= 0 else "") for owner, dag, run_id, task, index in rows
    ), rows

    # The task tab's endpoint, for one mapped instance: only that instance's events, with their columns.
    shown = _lease_api(
        api, "/lease/api/task-instance", dag_id="mapped_and_bash", run_id=run, task_id="shard", map_index="1"
    )
    kinds = [e["kind"] for e in shown["events"]]
    assert "acquired" in kinds and "released" in kinds, shown
    assert {(e["dag_id"], e["run_id"], e["task_id"], e["map_index"]) for e in shown["events"]} == {
        ("mapped_and_bash", run, "shard", 1)
    }
    assert all(e["task"]["path"].endswith("/tasks/shard/mapped/1") for e in shown["events"]), shown

    # The CLI shows the same columns.
    result = subprocess.run(
        [str(Path(sys.executable).parent / "airflow-lease"), "--dsn", airflow.dsn, "--schema", SCHEMA, "--json",
         "events", "--key", "shard-1", "--kind", "acquired"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    newest = json.loads(result.stdout)["events"][0]
    assert (newest["dag_id"], newest["run_id"], newest["task_id"], newest["map_index"]) == (
        "mapped_and_bash", run, "shard", 1
    ), newest


def test_a_waiting_run_defers_and_runs_after_the_holder_releases_never_alongside_it(
    airflow: Deployment, store: LeaseStore
) -> None:
    """on_overlap="wait" through the real scheduler and triggerer: the second run's task defers (no worker
    slot held), the triggerer resumes it once the first released the lease, and it runs with the next
    token, after the first finished: both runs succeed, nothing was skipped or failed."""
    api = airflow.api
    first = api.trigger("wait_overlap")
    started_first, token_first = marker(f"wait-started-{first}").split()
    second = api.trigger("wait_overlap")
    wait(lambda: api.task_states("wait_overlap", second).get("work"), lambda state: state == "deferred", 120,
         "the second run's task to defer")
    assert not (MARKERS / f"wait-started-{second}").exists()  # it never ran alongside the holder
    waiting = store.events.query(key="wait-overlap-key", kind=EventKind.WAITING)
    assert waiting and all(e.detail.get("holder_token") in (None, int(token_first)) for e in waiting), waiting

    (MARKERS / f"wait-let-go-{first}").write_text("go")
    assert api.wait_for_run("wait_overlap", first) == "success"
    finished_first = float(marker(f"wait-finished-{first}"))
    started_second, token_second = marker(f"wait-started-{second}", timeout=180).split()
    assert float(started_second) > finished_first, "the waiter ran while the holder still held the lease"
    assert int(token_second) > int(token_first)
    (MARKERS / f"wait-let-go-{second}").write_text("go")
    assert api.wait_for_run("wait_overlap", second) == "success", api.task_states("wait_overlap", second)
    assert api.task_states("wait_overlap", second) == {"work": "success"}
    assert api.xcom("wait_overlap", second, "work", "return_value") == int(token_second)
    assert store.holder("wait-overlap-key") is None  # released on success
    assert store.events.query(key="wait-overlap-key", kind=EventKind.SKIPPED_OVERLAP) == []


def test_a_newer_run_replaces_a_frozen_holder_whose_late_writes_are_refused_and_whose_task_is_skipped(
    airflow: Deployment, store: LeaseStore
) -> None:
    """on_overlap="replace" (issue 26): the old run's task process is frozen (SIGSTOP) while it holds the
    lease; a newer run takes it over with a larger token and publishes. Resumed, the old run's write through
    the fence alone is refused (superseded) and its write through the lease is refused (lease taken); its
    task ends skipped, naming the newer run, with no retry (it has retries=2), and its run succeeds."""
    api = airflow.api
    old = api.trigger("replace_frozen")
    pid, old_token = int(marker(f"replace-pid-{old}")), int(marker(f"replace-token-{old}"))
    os.kill(pid, signal.SIGSTOP)
    try:
        new = api.trigger("replace_frozen")
        new_token = int(marker(f"replace-token-{new}"))
        assert new_token > old_token
        (MARKERS / f"replace-go-{new}").write_text("go")
        assert api.wait_for_run("replace_frozen", new) == "success", api.task_states("replace_frozen", new)
        (MARKERS / f"replace-go-{old}").write_text("go")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert api.wait_for_run("replace_frozen", old) == "success"  # a skipped task: the run did not fail
    ti = api.task_instances("replace_frozen", old)["publish"]
    assert ti["state"] == "skipped" and ti["try_number"] == 1, ti  # not failed, not retried into the lease

    assert marker(f"replace-raw-refused-{old}") == "superseded"
    assert (MARKERS / f"replace-write-refused-{old}").exists()
    assert not (MARKERS / f"replace-published-{old}").exists()
    assert marker(f"replace-published-{new}") == str(new_token)
    rows = execute(airflow.dsn, q("SELECT writer, token FROM {schema}.replace_target", SCHEMA))
    assert rows == [(f"replace_frozen/{new}/publish", new_token)], rows

    reason = api.xcom("replace_frozen", old, "publish", "lease_skip_reason")
    assert reason["replaced_by_owner"] == f"replace_frozen/{new}/publish" and reason["replaced_by_token"] == new_token
    assert f"replace_frozen/{new}/publish" in api.log("replace_frozen", old, "publish")
    (replaced,) = store.events.query(key="replace-key", kind=EventKind.REPLACED)
    assert (replaced.owner, replaced.token) == (f"replace_frozen/{old}/publish", old_token)
    assert (replaced.detail["by_owner"], replaced.detail["by_token"]) == (f"replace_frozen/{new}/publish", new_token)
    wait(lambda: airflow.statsd.count("scheduled.skipped_replaced"), lambda n: n == 1, 10, "the replaced metric")
    assert airflow.statsd.count("lease.replaced") == 1
    assert store.holder("replace-key") is None


def test_one_waiting_place_of_three_runs_started_together_one_runs_one_waits_then_runs_one_is_skipped(
    airflow: Deployment, store: LeaseStore
) -> None:
    """on_overlap="wait", max_waiting=1 (issue 26) through the real scheduler and triggerer."""
    api = airflow.api
    runs = [api.trigger("buffer_three") for _ in range(3)]

    def states() -> dict[str, str | None]:
        return {run: api.task_states("buffer_three", run).get("work") for run in runs}

    settled = wait(states, lambda s: sorted(map(str, s.values())) == ["deferred", "running", "skipped"], 180,
                   "one run holding, one deferred, one skipped")
    holder = next(r for r, state in settled.items() if state == "running")
    waiter = next(r for r, state in settled.items() if state == "deferred")
    skipped = next(r for r, state in settled.items() if state == "skipped")
    _, holder_token = marker(f"buffer-started-{holder}").split()
    reason = api.xcom("buffer_three", skipped, "work", "lease_skip_reason")
    assert [w["owner"] for w in reason["waiters"]] == [f"buffer_three/{waiter}/work"], reason
    assert f"buffer_three/{waiter}/work" in reason["reason"]
    assert [w.owner for w in store.waiters(["buffer-key"])] == [f"buffer_three/{waiter}/work"]
    (full,) = store.events.query(key="buffer-key", kind=EventKind.SKIPPED_BUFFER_FULL)
    assert full.run is not None and full.run.run_id == skipped

    (MARKERS / f"buffer-let-go-{holder}").write_text("go")
    assert api.wait_for_run("buffer_three", holder) == "success"
    finished = float(marker(f"buffer-finished-{holder}"))
    started, token = marker(f"buffer-started-{waiter}", timeout=180).split()
    assert float(started) > finished and int(token) > int(holder_token)
    (MARKERS / f"buffer-let-go-{waiter}").write_text("go")
    assert api.wait_for_run("buffer_three", waiter) == "success", api.task_states("buffer_three", waiter)
    assert api.wait_for_run("buffer_three", skipped) == "success"  # skipped, not failed
    assert store.waiters(["buffer-key"]) == [] and store.holder("buffer-key") is None
    assert airflow.statsd.count("scheduled.skipped_buffer_full") == 1


def test_a_semaphore_of_two_with_three_runs_two_hold_at_once_both_publish_the_third_skips(
    airflow: Deployment, store: LeaseStore
) -> None:
    """lease_slots=2 (issue 26 item 3) through the real scheduler, runs triggered over REST together."""
    api = airflow.api
    runs = [api.trigger("semaphore_three") for _ in range(3)]

    def states() -> dict[str, str | None]:
        return {run: api.task_states("semaphore_three", run).get("work") for run in runs}

    settled = wait(states, lambda s: sorted(map(str, s.values())) == ["running", "running", "skipped"], 180,
                   "two runs holding a slot each, one skipped")
    holders = [r for r, state in settled.items() if state == "running"]
    (skipped,) = [r for r, state in settled.items() if state == "skipped"]
    started = {r: marker(f"semaphore-started-{r}").split() for r in holders}
    assert sorted(int(slot) for slot, _ in started.values()) == [1, 2], started
    owners = [f"semaphore_three/{r}/work" for r in holders]
    reason = api.xcom("semaphore_three", skipped, "work", "lease_skip_reason")
    assert all(o in reason["reason"] for o in owners) and "all 2 slots" in reason["reason"], reason
    assert sorted(h["owner"] for h in reason["holders"]) == sorted(owners) and reason["slots"] == 2
    # Both held at once, by the ledger: each slot's grant came before either was released.
    grants = [e for key in ("semaphore-key", "semaphore-key#2")
              for e in store.events.query(key=key, kind=EventKind.ACQUIRED)]
    assert sorted(e.owner for e in grants) == sorted(owners)
    assert sorted(e.detail["slot"] for e in grants) == [1, 2]
    assert [(h.slot, h.owner in owners) for h in store.slot_holders("semaphore-key")] == [(1, True), (2, True)]

    # The target, made here: two CREATE TABLE IF NOT EXISTS at the same moment can both try to create it.
    execute(airflow.dsn, q("CREATE TABLE IF NOT EXISTS {schema}.semaphore_target (writer text, slot int, token bigint)",
                           SCHEMA))
    (MARKERS / "semaphore-publish").write_text("go")  # both publish while both hold
    for run in holders:
        assert api.wait_for_run("semaphore_three", run) == "success", api.log("semaphore_three", run, "work")
    assert api.wait_for_run("semaphore_three", skipped) == "success"  # skipped, not failed
    rows = execute(airflow.dsn, q("SELECT writer, slot, token FROM {schema}.semaphore_target ORDER BY slot", SCHEMA))
    assert [(w, s, t) for w, s, t in rows] == sorted(
        ((f"semaphore_three/{r}/work", int(started[r][0]), int(started[r][1])) for r in holders),
        key=lambda row: row[1],
    ), rows
    released = [e for key in ("semaphore-key", "semaphore-key#2")
                for e in store.events.query(key=key, kind=EventKind.RELEASED)]
    assert len(released) == 2 and max(g.at for g in grants) < min(e.at for e in released)
    assert store.slot_holders("semaphore-key") == []


def test_a_replace_dag_on_a_semaphores_key_is_never_granted_beside_a_slot(
    airflow: Deployment, store: LeaseStore
) -> None:
    """Issue 38, defect 1, through the real scheduler: DAG X holds key K with lease_slots=2 in two runs; DAG Y
    asks for K with on_overlap="replace". While X's slot 1 is held, Y's task is skipped (a slot holder is
    never replaced); with only X's slot 2 held, Y's task fails with SlotCountMismatch (at 72519bc it was
    granted: K held by Y, believing itself alone, beside X's slot 2); once X's runs are done, Y is granted."""
    api = airflow.api
    x_runs = [api.trigger("mixed_slots_x") for _ in range(2)]
    held = {run: marker(f"mixed-x-{run}").split() for run in x_runs}
    by_slot = {int(slot): run for run, (slot, _token) in held.items()}
    assert sorted(by_slot) == [1, 2], held

    skipped = api.trigger("mixed_replace_y")
    assert api.wait_for_run("mixed_replace_y", skipped) == "success"
    assert api.task_states("mixed_replace_y", skipped)["single"] == "skipped"
    reason = api.xcom("mixed_replace_y", skipped, "single", "lease_skip_reason")
    assert f"mixed_slots_x/{by_slot[1]}/hold" in reason["reason"], reason

    (MARKERS / f"mixed-x-done-{by_slot[1]}").write_text("go")  # slot 1 ends; slot 2 is still held
    assert api.wait_for_run("mixed_slots_x", by_slot[1]) == "success"
    refused = api.trigger("mixed_replace_y")
    assert api.wait_for_run("mixed_replace_y", refused) == "failed"
    log = api.log("mixed_replace_y", refused, "single")
    assert "SlotCountMismatch" in log and "slots=2" in log and f"mixed_slots_x/{by_slot[2]}/hold" in log, log[-3000:]
    assert [(h.slot, h.owner) for h in store.slot_holders("mixed-key")] == [(2, f"mixed_slots_x/{by_slot[2]}/hold")]

    (MARKERS / f"mixed-x-done-{by_slot[2]}").write_text("go")
    assert api.wait_for_run("mixed_slots_x", by_slot[2]) == "success"
    granted = api.trigger("mixed_replace_y")  # nobody holds a slot: the replace is a single holder's grant
    assert api.wait_for_run("mixed_replace_y", granted) == "success"
    slots, token = marker(f"mixed-y-granted-{granted}").split()
    assert slots == "1" and int(token) > max(int(t) for _slot, t in held.values())
    assert not (MARKERS / f"mixed-y-granted-{skipped}").exists()
    assert not (MARKERS / f"mixed-y-granted-{refused}").exists()
    assert store.events.query(key="mixed-key", kind=EventKind.REPLACED) == []
