"""Serialization round trip, UI text, and a real DAG through DagBag and DAG serialization.

The DAG test goes through the ``airflow.plugins`` entry point: serializing a DAG with a custom timetable
fails unless a registered plugin lists the class.
"""

from __future__ import annotations

import datetime
import json
import textwrap
import zoneinfo
from pathlib import Path
from typing import Any

import pendulum
import pytest
from airflow.timetables.base import DataInterval

from airflow_lease_provider.timetables import CappedCatchupTimetable

VARIANTS: list[tuple[Any, dict[str, Any]]] = [
    ("*/5 * * * *", {}),
    (
        "@daily",
        {"max_backfill": 7, "catchup_window": datetime.timedelta(days=2), "timezone": "Europe/Berlin"},
    ),
    ("30 2 * * 1-5", {"max_backfill": 0, "data_interval": False, "timezone": "America/New_York"}),
    (datetime.timedelta(minutes=45), {"max_backfill": 3, "catchup_window": datetime.timedelta(seconds=10.5)}),
    (
        datetime.timedelta(hours=1, microseconds=7),
        {"timezone": pendulum.timezone(5400), "data_interval": False},
    ),
    ("0 * * * *", {"timezone": pendulum.UTC}),
    ("0 * * * *", {"timezone": zoneinfo.ZoneInfo("Asia/Kolkata")}),
    ("0 * * * *", {"timezone": datetime.timezone(datetime.timedelta(hours=-3))}),
    ("0 * * * *", {"timezone": datetime.timezone.utc}),
    ("0 * * * *", {"max_backfill": 24, "parallel_catchup": True}),
    ("*/5 * * * *", {"max_backfill": 3, "coalesce": True, "timezone": "Europe/Berlin"}),
]


@pytest.mark.parametrize(("schedule", "kwargs"), VARIANTS)
def test_round_trip_keeps_every_parameter(schedule: Any, kwargs: dict[str, Any]) -> None:
    timetable = CappedCatchupTimetable(schedule, **kwargs)
    data = json.loads(json.dumps(timetable.serialize()))
    restored = CappedCatchupTimetable.deserialize(data)
    assert restored == timetable
    assert hash(restored) == hash(timetable)
    for name in ("schedule", "max_backfill", "catchup_window", "data_interval", "parallel_catchup", "coalesce"):
        assert getattr(restored, name) == getattr(timetable, name), name
    assert restored.timezone.utcoffset(datetime.datetime(2025, 1, 1)) == timetable.timezone.utcoffset(
        datetime.datetime(2025, 1, 1)
    )
    assert restored.summary == timetable.summary
    assert restored.description == timetable.description
    assert restored.active_runs_limit == timetable.active_runs_limit


def test_serialized_form_is_stable() -> None:
    """The stored form is a compatibility contract: keys may be added, never renamed."""
    timetable = CappedCatchupTimetable(
        "*/5 * * * *", max_backfill=3, catchup_window=datetime.timedelta(hours=2), timezone="Europe/Berlin"
    )
    assert timetable.serialize() == {
        "cron": "*/5 * * * *",
        "max_backfill": 3,
        "catchup_window": 7200.0,
        "timezone": "Europe/Berlin",
        "data_interval": True,
        "parallel_catchup": False,
    }
    assert CappedCatchupTimetable.deserialize({"delta": 2700.0}) == CappedCatchupTimetable(
        datetime.timedelta(minutes=45)
    )
    # A form stored before parallel_catchup existed loads with its default.
    old = {"cron": "*/5 * * * *", "max_backfill": 3, "catchup_window": None, "timezone": "UTC", "data_interval": True}
    assert CappedCatchupTimetable.deserialize(old).active_runs_limit == 1


def test_summary_and_description_show_cap_and_window() -> None:
    timetable = CappedCatchupTimetable(
        "*/5 * * * *", max_backfill=3, catchup_window=datetime.timedelta(hours=2)
    )
    assert timetable.summary == "*/5 * * * * (catch-up: newest 3, window 2:00:00)"
    assert timetable.description == (
        "Every 5 minutes; after downtime at most the newest 3 missed runs are made up, "
        "none older than 2:00:00, one at a time (with catchup=True)"
    )
    fixed = CappedCatchupTimetable(datetime.timedelta(minutes=45))
    assert fixed.summary == "every 0:45:00 (catch-up: newest 1)"
    assert "only the newest missed run" in fixed.description


def test_plugin_registers_the_timetable_through_the_entry_point() -> None:
    from importlib.metadata import entry_points

    from airflow import plugins_manager

    (entry_point,) = [e for e in entry_points(group="airflow.plugins") if e.name == "lease"]
    plugin = entry_point.load()
    assert plugin.name == "lease"
    assert CappedCatchupTimetable in plugin.timetables
    registered = plugins_manager.get_timetables_plugins()
    assert (
        registered["airflow_lease_provider.timetables.capped_catchup.CappedCatchupTimetable"]
        is CappedCatchupTimetable
    )


DAG_FILE = """
from __future__ import annotations

import datetime

import pendulum
from airflow.sdk import DAG, task

from airflow_lease_provider.timetables import CappedCatchupTimetable

with DAG(
    dag_id="capped_catchup_example",
    schedule=CappedCatchupTimetable(
        "*/5 * * * *", max_backfill={max_backfill}, catchup_window=datetime.timedelta(hours=2), timezone="Europe/Berlin"
    ),
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=True,
    max_active_runs={max_active_runs},
):

    @task
    def publish() -> None:
        pass

    publish()
"""


def _dag_bag(folder: Path) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(folder), bundle_path=folder, bundle_name="tests")


def test_dag_round_trips_through_dagbag_and_serialization(tmp_path: Path) -> None:
    from airflow.serialization.serialized_objects import DagSerialization

    (tmp_path / "capped.py").write_text(textwrap.dedent(DAG_FILE.format(max_backfill=3, max_active_runs=1)))
    bag = _dag_bag(tmp_path)
    assert bag.import_errors == {}
    dag = bag.dags["capped_catchup_example"]

    data = json.loads(json.dumps(DagSerialization.to_dict(dag)))
    encoded = data["dag"]["timetable"]
    assert encoded["__type"] == "airflow_lease_provider.timetables.capped_catchup.CappedCatchupTimetable"
    serialized_dag = DagSerialization.from_dict(data)
    assert serialized_dag.timetable == dag.timetable
    assert serialized_dag.timetable.max_backfill == 3
    assert serialized_dag.catchup is True

    # `airflow backfill create` goes through this: every slot of the range, not clipped to 3.
    infos = list(
        serialized_dag.iter_dagrun_infos_between(
            pendulum.datetime(2025, 6, 1, 0, 0, tz="UTC"), pendulum.datetime(2025, 6, 1, 2, 0, tz="UTC")
        )
    )
    assert len(infos) == 25
    assert infos[0].data_interval == DataInterval(
        pendulum.datetime(2025, 6, 1, 0, 0, tz="UTC"), pendulum.datetime(2025, 6, 1, 0, 5, tz="UTC")
    )


def test_bad_argument_is_an_import_error_naming_the_parameter(tmp_path: Path) -> None:
    (tmp_path / "capped.py").write_text(textwrap.dedent(DAG_FILE.format(max_backfill=-2, max_active_runs=1)))
    bag = _dag_bag(tmp_path)
    assert bag.dags == {}
    (message,) = bag.import_errors.values()
    assert "max_backfill=-2: must not be negative" in message


def test_kept_runs_more_than_one_need_max_active_runs_1_at_parse_time(tmp_path: Path) -> None:
    """max_backfill > 1: Airflow refuses the DAG's default max_active_runs (16), naming it."""
    (tmp_path / "capped.py").write_text(textwrap.dedent(DAG_FILE.format(max_backfill=3, max_active_runs=16)))
    bag = _dag_bag(tmp_path)
    assert bag.dags == {}
    (message,) = bag.import_errors.values()
    assert "Invalid max_active_runs: CappedCatchupTimetable requires max_active_runs <= 1" in message
