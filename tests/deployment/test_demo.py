"""The demo's scenes and their checks, played on a real scheduler, and scheduled runs of the examples.

``demo/airflow_demo.py`` plays three scenes on ``airflow standalone`` and checks each claim through the
REST API and the lease ledger. Here the same scenes (``play``) run against a deployment of the tier
with the same DAG files, so a claim the demo makes that stops being true fails CI; and the checks are
shown to fail when a claim is false (a check that cannot fail would prove nothing).

This deployment schedules (unlike ``test_examples.py``'s): the catch-up scene is the scheduled
``article_publisher`` run after "downtime", and ``billing_close``'s scheduled catch-up runs here too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.timetables import slot_idempotency_key
from demo import airflow_demo
from demo.airflow_api import wait
from demo.deployment import DEMO_DAGS, EXAMPLES, Deployment, MetadataTemplate
from tests.deployment.conftest import deployment_for

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def airflow(metadata_template: MetadataTemplate) -> Iterator[Deployment]:
    files = [*sorted(EXAMPLES.glob("*.py")), DEMO_DAGS / "zombie_demo.py"]
    with deployment_for(metadata_template, files, {"article_publisher", "billing_close", "zombie_demo"}) as d:
        yield d


@pytest.fixture(scope="module")
def store(airflow: Deployment) -> Iterator[LeaseStore]:
    with LeaseStore(airflow.dsn) as leases:
        yield leases


@pytest.fixture(scope="module")
def played(airflow: Deployment, store: LeaseStore) -> dict[str, Any]:
    """The demo's three scenes, each checked by the demo itself (``ClaimFalse`` fails the fixture)."""
    return airflow_demo.play(airflow.api, store, airflow.home / "demo-markers")


def test_every_claim_of_the_demo_holds(airflow: Deployment, played: dict[str, Any]) -> None:
    api = airflow.api
    # Re-read independently of the demo's own checks: the states a user sees in the UI.
    assert api.run("article_publisher", played["catchup"])["run_type"] == "scheduled"
    assert api.task_states("article_publisher", played["writer"]) == {"write_and_publish": "success"}
    assert api.task_states("article_publisher", played["skipped"]) == {"write_and_publish": "skipped"}
    assert api.run("zombie_demo", played["zombie"])["state"] == "failed"
    failed = api.get("/dags/~/dagRuns", params={"state": "failed"})["dag_runs"]
    assert [r["dag_run_id"] for r in failed] == [played["zombie"]]


def test_the_checks_fail_when_a_claim_is_false(
    airflow: Deployment, store: LeaseStore, played: dict[str, Any]
) -> None:
    # The writer's run is not the zombie's: "the only red run is the zombie's" is false for it.
    with pytest.raises(airflow_demo.ClaimFalse) as caught:
        airflow_demo.check_only_red(airflow.api, played["writer"])
    assert caught.value.scene == "no other red"
    # Two runs that both wrote (the catch-up run and the overlap's writer) are no overlap skip.
    with pytest.raises(airflow_demo.ClaimFalse) as caught:
        airflow_demo.check_overlap(airflow.api, store, [played["catchup"], played["writer"]])
    assert caught.value.scene == "overlap skip" and "one run should write" in str(caught.value)


def test_billing_close_scheduled_after_downtime_closes_the_newest_slots_one_at_a_time(
    airflow: Deployment, played: dict[str, Any]
) -> None:
    api = airflow.api
    api.unpause("billing_close")
    runs = wait(
        lambda: [r for r in api.runs("billing_close") if r["run_type"] == "scheduled"],
        lambda found: sum(r["state"] == "success" for r in found) >= 2 or any(r["state"] == "failed" for r in found),
        300, "two scheduled billing_close runs",
    )
    api.pause("billing_close")
    done = [r for r in runs if r["state"] in ("success", "failed")]
    assert all(r["state"] == "success" for r in done), runs
    # max_backfill=24 of hourly slots, oldest first: the first two are 24 and 23 hours ago.
    starts = [r["data_interval_start"] for r in runs]
    assert starts == sorted(starts) and len(set(starts)) == len(starts), starts
    for run in done:
        slot = slot_idempotency_key("billing_close", _parse(run["data_interval_start"]))
        assert api.xcom("billing_close", run["dag_run_id"], "price")["slot"] == slot
        assert api.task_states("billing_close", run["dag_run_id"])["publish_invoices"] == "success"


def _parse(stamp: str):  # type: ignore[no-untyped-def]
    import pendulum

    return pendulum.parse(stamp)
