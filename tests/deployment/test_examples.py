"""Every example DAG, under a real scheduler, for every kind of run a user makes.

* manual, triggered through the REST API with **no logical date** (the Airflow 3 default: the UI's
  Trigger button, ``airflow dags trigger`` and the REST API): there is no data interval;
* manual with a logical date;
* a cleared task re-run of a published slot (it writes nothing and is skipped, "published already");
* a backfill (``POST /api/v2/backfills``).

Scheduled runs (the capped catch-up after "downtime") are in ``test_demo.py``, whose deployment
schedules; this one runs with ``[scheduler] use_job_schedule = False`` so that only the runs a test
makes exist (a catch-up run beside a manual one would overlap it, and be skipped by the lease).

Each ends in the state the example's docstring documents, read back through the API. The two examples
share nothing (their own leases, tables and fences), so each test drives both at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg2
import pytest
from psycopg2 import sql

from airflow_lease_provider.timetables import slot_idempotency_key
from demo.airflow_api import wait
from demo.deployment import EXAMPLES, Deployment, MetadataTemplate
from tests.deployment.conftest import deployment_for

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

ARTICLE, BILLING = "article_publisher", "billing_close"
BILLING_TASKS = {"acquire_run_lease", "collect_usage", "price", "publish_invoices", "release_run_lease"}
QUICK = {"work_seconds": 0}


@pytest.fixture(scope="module")
def airflow(metadata_template: MetadataTemplate) -> Iterator[Deployment]:
    files = sorted(EXAMPLES.glob("*.py"))
    no_schedule = {"AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False"}
    with deployment_for(metadata_template, files, {ARTICLE, BILLING}, no_schedule) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def manual_runs(airflow: Deployment) -> dict[str, str]:
    """One run of each example triggered with no logical date, finished: dag_id -> run_id."""
    runs = {dag_id: airflow.api.trigger(dag_id, QUICK) for dag_id in (ARTICLE, BILLING)}
    for dag_id in runs:
        airflow.api.unpause(dag_id)  # a paused DAG's manual runs are created but never start
    for dag_id, run_id in runs.items():
        finish(airflow, dag_id, run_id)
    return runs


def finish(airflow: Deployment, dag_id: str, run_id: str, timeout: float = 240) -> str:
    state = airflow.api.wait_for_run(dag_id, run_id, timeout=timeout)
    return state


def explain(airflow: Deployment, dag_id: str, run_id: str) -> str:
    """Task states and the logs of failed tasks, for an assertion message."""
    states = airflow.api.task_states(dag_id, run_id)
    logs = [
        f"--- {task} ---\n{airflow.api.log(dag_id, run_id, task, ti['try_number'])[-3000:]}"
        for task, ti in airflow.api.task_instances(dag_id, run_id).items()
        if ti["state"] in ("failed", "up_for_retry") and ti["try_number"]
    ]
    return f"{dag_id}/{run_id}: {states}\n" + "\n".join(logs)


def rows(airflow: Deployment, table: str) -> dict[str, int]:
    """slot -> token of an example's output table (what the user reads in their own database)."""
    conn = psycopg2.connect(airflow.dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT slot, token FROM {}").format(sql.Identifier("public", table)))
            return {slot: token for slot, token in cur.fetchall()}
    finally:
        conn.close()


def assert_published(airflow: Deployment, dag_id: str, run_id: str, slot: str) -> None:
    state = airflow.api.run(dag_id, run_id)["state"]
    assert state == "success", explain(airflow, dag_id, run_id)
    if dag_id == ARTICLE:
        assert airflow.api.task_states(dag_id, run_id) == {"write_and_publish": "success"}
        result = airflow.api.xcom(dag_id, run_id, "write_and_publish")
        assert result["slot"] == slot, result
        assert slot in rows(airflow, "example_articles")
    else:
        assert airflow.api.task_states(dag_id, run_id) == dict.fromkeys(BILLING_TASKS, "success")
        assert airflow.api.xcom(dag_id, run_id, "price")["slot"] == slot
        assert rows(airflow, "example_invoices")[slot] == airflow.api.xcom(dag_id, run_id, "publish_invoices")


def test_a_manual_run_without_a_logical_date_publishes_under_its_run_id(
    airflow: Deployment, manual_runs: dict[str, str]
) -> None:
    for dag_id, run_id in manual_runs.items():
        run = airflow.api.run(dag_id, run_id)
        assert run["logical_date"] is None and run["data_interval_start"] is None, run
        assert_published(airflow, dag_id, run_id, f"{dag_id}@run:{run_id}")


def test_a_cleared_rerun_of_a_published_run_writes_nothing_and_is_skipped(
    airflow: Deployment, manual_runs: dict[str, str]
) -> None:
    before = {table: rows(airflow, table) for table in ("example_articles", "example_invoices")}
    cleared = {ARTICLE: "write_and_publish", BILLING: "publish_invoices"}
    for dag_id, task_id in cleared.items():
        tis = airflow.api.clear(dag_id, manual_runs[dag_id], [task_id])
        assert task_id in {ti["task_id"] for ti in tis}, tis
    for dag_id, task_id in cleared.items():
        run_id = manual_runs[dag_id]
        # Clearing resets the run to queued; wait for the task's second try to finish, then the run.
        wait(lambda: airflow.api.task_instances(dag_id, run_id)[task_id],  # noqa: B023 - called at once
             lambda ti: ti["try_number"] == 2 and ti["state"] in ("success", "failed", "skipped"), 240,
             f"the second try of {dag_id}.{task_id}")
        assert finish(airflow, dag_id, run_id) == "success", explain(airflow, dag_id, run_id)
        assert airflow.api.task_states(dag_id, run_id)[task_id] == "skipped", explain(airflow, dag_id, run_id)
        log = airflow.api.log(dag_id, run_id, task_id, try_number=2)
        assert "published already" in log or "was already published" in log, log[-3000:]
    # Nothing was written twice.
    assert {table: rows(airflow, table) for table in before} == before
    # A cleared billing task re-ran its setup (the run lease) too: the lease was taken and given back.
    assert airflow.api.task_states(BILLING, manual_runs[BILLING]) == {
        **dict.fromkeys(BILLING_TASKS, "success"), "publish_invoices": "skipped"
    }


def test_a_manual_run_with_a_logical_date_publishes_its_slot(airflow: Deployment, manual_runs: dict[str, str]) -> None:
    runs = {
        dag_id: airflow.api.trigger(dag_id, QUICK, logical_date="2026-03-02T09:00:00+00:00")
        for dag_id in (ARTICLE, BILLING)
    }
    for dag_id, run_id in runs.items():
        finish(airflow, dag_id, run_id)
    for dag_id, run_id in runs.items():
        run = airflow.api.run(dag_id, run_id)
        assert run["data_interval_start"] is not None, run
        assert_published(airflow, dag_id, run_id, slot_idempotency_key(dag_id, _parse(run["data_interval_start"])))


def test_a_backfill_publishes_every_slot_once(airflow: Deployment, manual_runs: dict[str, str]) -> None:
    # One run at a time: two runs of the same job at once are an overlap, and one would be skipped.
    for dag_id in (ARTICLE, BILLING):
        airflow.api.backfill(dag_id, "2026-02-01T00:00:00+00:00", "2026-02-01T01:00:00+00:00",
                             max_active_runs=1, dag_run_conf=QUICK)
    backfilled: dict[str, list[dict]] = {}
    for dag_id in (ARTICLE, BILLING):
        backfilled[dag_id] = wait(
            lambda: [r for r in airflow.api.runs(dag_id) if r["run_type"] == "backfill"],  # noqa: B023
            lambda found: len(found) >= 2 and all(r["state"] in ("success", "failed") for r in found),
            300, f"the backfill runs of {dag_id}",
        )
    for dag_id, runs in backfilled.items():
        slots = {slot_idempotency_key(dag_id, _parse(r["data_interval_start"])) for r in runs}
        assert len(slots) == len(runs), runs  # one slot each
        for run in runs:
            slot = slot_idempotency_key(dag_id, _parse(run["data_interval_start"]))
            assert_published(airflow, dag_id, run["dag_run_id"], slot)


def _parse(stamp: str):  # type: ignore[no-untyped-def]
    import pendulum

    return pendulum.parse(stamp)
