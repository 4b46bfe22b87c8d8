"""``slot_idempotency_key``: one key per slot for every kind of run, and no silent misuse."""

from __future__ import annotations

import datetime

import pendulum
import pytest
from airflow.timetables.base import DataInterval

from airflow_lease_provider.core import InvalidArgument
from airflow_lease_provider.timetables import slot_idempotency_key

NINE = pendulum.datetime(2025, 6, 15, 9, tz="UTC")
TEN = pendulum.datetime(2025, 6, 15, 10, tz="UTC")


def test_a_context_with_a_data_interval_is_keyed_by_its_start() -> None:
    """Scheduled, backfilled and manual-with-a-logical-date runs: the slot, whatever the run id."""
    scheduled = {"data_interval_start": NINE, "data_interval_end": TEN, "logical_date": NINE,
                 "run_id": "scheduled__2025-06-15T09:00:00+00:00"}
    backfill = {**scheduled, "run_id": "backfill__2025-06-15T09:00:00+00:00"}
    assert slot_idempotency_key("billing_close", scheduled) == "billing_close@2025-06-15T09:00:00Z"
    assert slot_idempotency_key("billing_close", backfill) == slot_idempotency_key("billing_close", scheduled)
    assert slot_idempotency_key("billing_close", scheduled) == slot_idempotency_key(
        "billing_close", DataInterval(NINE, TEN)
    )


def test_a_manual_run_without_a_logical_date_is_keyed_by_its_run_id() -> None:
    # What Airflow 3 gives a task of a run triggered with no logical date: no data interval keys at all.
    context = {"run_id": "manual__2025-06-15T09:12:44.120000+00:00", "dag_run": object()}
    key = slot_idempotency_key("article_publisher", context)
    assert key == "article_publisher@run:manual__2025-06-15T09:12:44.120000+00:00"
    # The same run (a retry, a cleared re-run) gets the same key; another manual run another one.
    assert slot_idempotency_key("article_publisher", dict(context)) == key
    assert slot_idempotency_key("article_publisher", {"run_id": "manual__2025-06-15T09:13:00+00:00"}) != key


def test_the_run_id_is_taken_from_the_dag_run_when_the_context_has_no_run_id() -> None:
    class Run:
        run_id = "manual__x"

    assert slot_idempotency_key("j", {"dag_run": Run(), "data_interval_start": None}) == "j@run:manual__x"


def test_none_says_why_and_what_to_pass_instead() -> None:
    with pytest.raises(InvalidArgument) as caught:
        slot_idempotency_key("billing_close", None)  # type: ignore[arg-type]
    assert caught.value.parameter == "slot"
    assert "no data interval" in str(caught.value) and "slot_idempotency_key(job, context)" in str(caught.value)


@pytest.mark.parametrize(
    ("job", "slot", "parameter"),
    [
        # The old example's mistake: two datetimes, where the signature is (job, slot).
        (NINE, TEN, "job"),
        ("", NINE, "job"),
        (None, NINE, "job"),
        ("billing_close", "2025-06-15T09:00:00", "slot"),
        ("billing_close", 1718441200, "slot"),
        ("billing_close", datetime.date(2025, 6, 15), "slot"),
        ("billing_close", {"ds": "2025-06-15"}, "slot"),
    ],
)
def test_a_wrong_argument_is_named(job: object, slot: object, parameter: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        slot_idempotency_key(job, slot)  # type: ignore[arg-type]
    assert caught.value.parameter == parameter
    assert str(caught.value).startswith(f"{parameter}=")
