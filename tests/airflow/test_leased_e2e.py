"""End to end with real Airflow 3 (``airflow dags test``) and a real PostgreSQL lease store.

What a single task does with its lease. Where the point is scheduling (two runs at once, a frozen run
overtaken by a newer one, a crashed try's retry), the tests run under a real scheduler instead:
``tests/deployment/test_leased.py``.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import psycopg2
import pytest

from airflow_lease_provider.core import EventKind, LeaseStore
from tests.airflow.harness import EXAMPLES
from tests.pg import q

pytestmark = pytest.mark.airflow


def wait_until(predicate, timeout: float = 120, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def import_errors(home) -> dict[str, str]:
    """File name -> error of every DAG file that failed to import (the CLI's JSON, after its log lines)."""
    result = home.cli(["dags", "list-import-errors", "--local", "-o", "json"], timeout=180)
    # Exit status 1 means "there are import errors"; the JSON list is the answer either way.
    payload = next((line for line in reversed(result.stdout.splitlines()) if line.startswith("[")), None)
    assert payload is not None, result.stdout[-2000:] + result.stderr[-2000:]
    return {Path(e["filepath"]).name: e["error"] for e in json.loads(payload)}


def markers(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"markers-{name}"
    path.mkdir()
    return path


def test_unreachable_store_fails_the_task_and_the_body_never_runs(airflow_home, tmp_path) -> None:
    task_markers = markers(tmp_path, "u")
    home = airflow_home(
        "unreachable",
        extra_env={
            "LEASE_TEST_MARKERS": str(task_markers),
            "AIRFLOW_CONN_LEASE_DEFAULT": "postgresql://postgres:pw@127.0.0.1:1/nothing",
        },
    )
    result = home.dags_test("unreachable")
    assert home.task_states()[("body", -1)] == "failed"
    assert not (task_markers / "body-ran").exists(), "the body ran without a lease"
    assert "LeaseStoreUnavailable" in result.stdout + result.stderr
    # It fails at once (a refused connection is not waited on, nor retried for minutes). Measured on the
    # task itself, not the CLI around it: a loaded CI machine took 123 s for the whole `airflow dags test`
    # (the CLI's start is most of it), and a bound on that was red once.
    assert home.task_seconds("body") < 60, home.task_seconds("body")  # 2.6 s on the idle machine


def test_wait_defers_until_the_lease_is_released(airflow_home, store: LeaseStore, tmp_path) -> None:
    task_markers = markers(tmp_path, "w")
    home = airflow_home("waiter", extra_env={"LEASE_TEST_MARKERS": str(task_markers)})
    blocker = store.acquire("wait-key", owner="someone-else", ttl=timedelta(minutes=5))
    assert blocker is not None
    running = home.dags_test_background("waiter")
    wait_until(lambda: store.events.query(key="wait-key", kind=EventKind.WAITING), what="the task to defer")
    time.sleep(3)
    assert not (task_markers / "waited-ran").exists(), "the body ran while the lease was held"
    released_at = time.time()
    assert store.release(blocker)
    running.wait(timeout=180)
    assert home.task_states()[("waited", -1)] == "success"
    ran_at = float((task_markers / "waited-ran").read_text())
    assert ran_at >= released_at
    log = (home.path / "waiter.log").read_text()
    assert "deferring until it frees" in log


def test_mapped_leased_task_with_per_map_keys_and_a_leased_bash_operator(airflow_home, store: LeaseStore, tmp_path) -> None:
    home = airflow_home(
        "mapped",
        extra_env={"LEASE_TEST_MARKERS": str(markers(tmp_path, "m")), "AIRFLOW__LEASE__PUSH_LEASE_XCOM": "true"},
    )
    result = home.dags_test("mapped_and_bash")
    states = home.task_states()
    assert [states[("shard", i)] for i in range(3)] == ["success"] * 3, result.stdout[-3000:]
    assert states[("bash", -1)] == "success"
    assert "bash ran under a lease" in result.stdout + result.stderr
    keys = {lease.key: lease for lease in store.leases()}
    assert {"shard-0", "shard-1", "shard-2", "bash-mapped_and_bash"} <= set(keys)
    assert all(not lease.held for lease in keys.values())  # all released
    owners = [e.owner for e in store.events.query(kind="acquired") if e.key.startswith("shard-")]
    assert sorted(o.rsplit("/", 1)[1] for o in owners) == ["shard[0]", "shard[1]", "shard[2]"]  # task + map index
    lease = home.xcom("bash", "lease")  # pushed with [lease] push_lease_xcom = true, for downstream tasks
    assert isinstance(lease, dict) and lease["key"] == "bash-mapped_and_bash" and lease["token"] >= 1, lease


def test_by_default_a_task_runs_under_its_lease_without_the_lease_xcom(
    airflow_home, store: LeaseStore, tmp_path
) -> None:
    """``[lease] push_lease_xcom`` defaults to false in a real task process (issue 28 item 1); the test above
    sets it true and reads the pushed lease."""
    home = airflow_home("no_xcom", extra_env={"LEASE_TEST_MARKERS": str(markers(tmp_path, "x"))})
    result = home.dags_test("overlap")
    assert home.task_states() == {("hold", -1): "success", ("after", -1): "success"}, result.stdout[-3000:]
    assert home.xcom("hold", "lease") is None, "the lease was pushed to XCom by default"
    assert store.holder("overlap-key") is None
    assert [e.token for e in store.events.query(key="overlap-key", kind=EventKind.RELEASED)] == [1]


def test_run_scoped_lease_spans_three_tasks_and_an_overlapping_run_is_skipped_whole(airflow_home, store: LeaseStore, tmp_path) -> None:
    home = airflow_home("run", extra_env={"LEASE_TEST_MARKERS": str(markers(tmp_path, "r"))})
    result = home.dags_test("run_scoped")
    states = home.task_states()
    assert {t: s for (t, _), s in states.items()} == {
        "acquire_run_lease": "success", "one": "success", "two": "success", "three": "success",
        "release_run_lease": "success",
    }, result.stdout[-3000:]
    acquired = store.events.query(key="run-key", kind="acquired")
    released = store.events.query(key="run-key", kind="released")
    assert len(acquired) == 1 and len(released) == 1 and acquired[0].token == released[0].token
    # 9 s of work under a 6 s TTL: the tasks in between renewed the run's lease.
    assert released[0].detail["held_seconds"] > 6
    assert store.events.query(key="run-key", kind="lost") == []

    other = airflow_home("other", extra_env={"LEASE_TEST_MARKERS": str(markers(tmp_path, "o"))})
    squatter = store.acquire("run-key", owner="someone-else", ttl=timedelta(minutes=5))
    assert squatter is not None
    other.dags_test("run_scoped")
    states = {t: s for (t, _), s in other.task_states().items()}
    assert states["acquire_run_lease"] == "skipped"
    assert states["one"] == states["two"] == states["three"] == "skipped"
    assert states["release_run_lease"] == "skipped"
    assert store.holder("run-key").owner == "someone-else"  # the skipped run released nothing


def test_example_dags_load_and_pass_airflow_dags_test(airflow_home, store: LeaseStore, schema, tmp_path) -> None:
    home = airflow_home("examples", dags=EXAMPLES, extra_env={"LEASE_EXAMPLES_SCHEMA": schema})
    assert import_errors(home) == {}
    dag_ids = ("article_publisher", "billing_close", "sales_publisher")
    results = home.dags_test_many([(dag_id, "2026-11-29T10:00:00+00:00") for dag_id in dag_ids])
    for dag_id, result in zip(dag_ids, results, strict=True):
        states = {t: s for (t, _), s in home.task_states(dag_id).items()}
        assert states and set(states.values()) == {"success"}, result.stdout[-4000:]
        assert result.returncode == 0, result.stderr[-4000:]
    assert {lease.key for lease in store.leases()} == {
        "article-publisher", "billing-close", "asset:s3://example-lake/sales/daily", "asset:s3://example-lake/sales/summary",
    }


def test_bad_dag_arguments_fail_at_parse_time_naming_the_parameter(airflow_home) -> None:
    home = airflow_home("bad", dags=Path(__file__).parent / "bad_dags")
    errors = import_errors(home)
    assert "lease_ttl=datetime.timedelta(days=-1, seconds=86395)" in errors["bad_negative_ttl.py"]
    assert "lease_key=''" in errors["bad_empty_key.py"]
    assert "on_overlap='queue'" in errors["bad_unknown_policy.py"]
    assert "lease_on='outlets': takes the lease on the task's asset outlets, and this task has none" in errors[
        "bad_lease_on_outlets.py"
    ]
    assert "lease_ttl=datetime.timedelta(days=30)" in errors["bad_operator_ttl.py"]
    # Mapped (partial/expand) tasks are checked when parsed too.
    assert "lease_ttl=datetime.timedelta(days=-1, seconds=86393)" in errors["bad_mapped_negative_ttl.py"]
    assert "on_overlap='later'" in errors["bad_mapped_unknown_policy.py"]
    # A sensor that would give its lease back between pokes.
    assert "mode='reschedule'" in errors["bad_reschedule_sensor.py"]
    # A run-lease task has no TTL of its own, but an interval that can never work is refused all the same.
    assert "lease_renew_every=datetime.timedelta(days=-1, seconds=86395)" in errors["bad_run_scope_renew.py"]
    assert "lease_renew_every=datetime.timedelta(days=8)" in errors["bad_run_scope_renew_operator.py"]


@pytest.mark.parametrize("outcome", ["done", "raise"])
def test_a_release_that_fails_after_the_body_neither_fails_the_task_nor_hides_the_body_s_error(
    airflow_home, store: LeaseStore, pg_dsn: str, schema: str, tmp_path, outcome: str
) -> None:
    """The release waits on the lease row another connection holds FOR UPDATE, until the store's statement
    timeout (5 s) cuts it off: the task reports the body's result or error, and the lease is left to its TTL."""
    task_markers = markers(tmp_path, outcome)
    home = airflow_home(outcome, extra_env={"LEASE_TEST_MARKERS": str(task_markers)})
    dag_id, key = f"release_blocked_{outcome}", f"release-blocked-{outcome}"
    running = home.dags_test_background(dag_id)
    wait_until(lambda: (task_markers / "body-running").exists(), what="the body to start")
    locker = psycopg2.connect(pg_dsn)
    try:
        with locker.cursor() as cur:
            cur.execute(q("SELECT token FROM {schema}.lease WHERE key = %s FOR UPDATE", schema), (key,))
            assert cur.fetchone() is not None
            (task_markers / "row-locked").write_text("")
            running.wait(timeout=180)
    finally:
        locker.rollback()
        locker.close()
    log = (home.path / f"{dag_id}.log").read_text()
    state = home.task_states()[("body", -1)]
    if outcome == "done":
        assert state == "success", log[-4000:]
        assert home.xcom("body", "return_value") == "done"
        assert not (task_markers / "reported-exception").exists()
    else:
        assert state == "failed", log[-4000:]
        assert (task_markers / "reported-exception").read_text() == "ValueError"
    assert f"could not release {key!r}" in log, log[-4000:]
    assert "did not answer in time" in log  # the release's own error is logged, not lost
    # Not released: the lease is left to expire with its TTL (another run waits at most that long).
    holder = store.holder(key)
    assert holder is not None and holder.owner.startswith(f"{dag_id}/")


def test_default_keys_of_ids_that_read_alike_are_different_leases(airflow_home, store: LeaseStore, tmp_path) -> None:
    """DAG etl.daily task load, DAG etl task daily.load (a task group's) and task load, and the run lease of
    DAG etl.load: four identities, four keys (before, three of them were two keys)."""
    home = airflow_home("alike", extra_env={"LEASE_TEST_MARKERS": str(markers(tmp_path, "k"))})
    for result in home.dags_test_many(["etl.daily", "etl", "etl.load"]):
        assert "DagRun Finished" in result.stdout + result.stderr, result.stdout[-3000:]
    states = {t: s for (t, _), s in home.task_states().items()}
    assert set(states.values()) == {"success"}, states
    keys = {lease.key: lease.owner.split("/")[0] for lease in store.leases()}
    assert keys == {
        "etl.daily/load": "etl.daily",  # a DAG id with a '.' splits at '/'
        "etl.daily.load": "etl",  # DAG etl, task daily.load: the old key (a DAG id without '.')
        "etl.load": "etl",  # DAG etl, task load: the old key
        "etl.load/": "etl.load",  # the run lease of DAG etl.load
    }, keys


def test_the_longest_ids_airflow_takes_run_under_a_lease(airflow_home, store: LeaseStore, tmp_path) -> None:
    """A 240-character DAG id and task id parse, and the task runs: its owner is 518 characters (the owner
    limit is 1024), its default key `dag_id.task_id` (481 characters, within the key limit)."""
    home = airflow_home("long", extra_env={"LEASE_TEST_MARKERS": str(markers(tmp_path, "l"))})
    dag_id, task_id = "d" * 240, "t" * 240
    result = home.dags_test(dag_id)
    assert home.task_states()[(task_id, -1)] == "success", (result.stdout + result.stderr)[-4000:]
    (lease,) = store.leases()
    run_id = lease.owner[len(dag_id) + 1 : -len(task_id) - 1]
    assert lease.owner == f"{dag_id}/{run_id}/{task_id}" and run_id and "/" not in run_id, lease.owner
    assert len(lease.owner) > 512  # over the old owner limit (a 36-character run id makes it 518)
    assert lease.key == f"{dag_id}.{task_id}"  # 481 characters: within the key limit, so readable, not hashed
    assert not lease.held  # released
