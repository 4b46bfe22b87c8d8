"""Bad arguments fail when the DAG file is parsed, naming the parameter and the value."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from airflow_lease_provider.core.errors import InvalidArgument
from airflow_lease_provider.timetables import CappedCatchupTimetable


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"max_backfill": -1}, "max_backfill"),
        ({"max_backfill": 1.0}, "max_backfill"),
        ({"max_backfill": "3"}, "max_backfill"),
        ({"max_backfill": True}, "max_backfill"),  # bool is an int subclass, but not a count
        ({"max_backfill": None}, "max_backfill"),
        ({"max_backfill": 10_001}, "max_backfill"),
        ({"catchup_window": datetime.timedelta(0)}, "catchup_window"),
        ({"catchup_window": datetime.timedelta(minutes=-5)}, "catchup_window"),
        ({"catchup_window": datetime.timedelta(seconds=5)}, "catchup_window"),
        ({"catchup_window": 3600}, "catchup_window"),
        ({"timezone": "Mars/Olympus_Mons"}, "timezone"),
        ({"timezone": None}, "timezone"),
        ({"timezone": "x" * 512}, "timezone"),  # the zone file's name is too long for the file system
        ({"timezone": "Europe/Berlin/" + "a" * 300}, "timezone"),
        ({"data_interval": "yes"}, "data_interval"),
        ({"parallel_catchup": 1}, "parallel_catchup"),
        ({"parallel_catchup": None}, "parallel_catchup"),
    ],
)
def test_bad_keyword_arguments(kwargs: dict[str, Any], parameter: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        CappedCatchupTimetable("* * * * *", **kwargs)
    assert caught.value.parameter == parameter
    assert str(caught.value).startswith(f"{parameter}=")
    assert repr(next(iter(kwargs.values())))[:20] in str(caught.value)


@pytest.mark.parametrize(
    "schedule",
    [
        "61 * * * *",
        "* * *",
        "not a cron",
        "",
        "0 0 30 2 *",  # parses, never fires
        "@once",
        "@continuous",
        datetime.timedelta(0),
        datetime.timedelta(minutes=-1),
        None,
        3600,
    ],
)
def test_bad_schedules(schedule: Any) -> None:
    with pytest.raises(InvalidArgument) as caught:
        CappedCatchupTimetable(schedule)
    assert caught.value.parameter == "schedule"
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "schedule", ["* * * * *", "@hourly", "@daily", "0 0 L * *", "0 12 * * 1#2", datetime.timedelta(seconds=1)]
)
def test_good_schedules(schedule: Any) -> None:
    CappedCatchupTimetable(schedule, max_backfill=0, catchup_window=datetime.timedelta(seconds=10))


def test_presets_are_expanded() -> None:
    assert CappedCatchupTimetable("@hourly").schedule == "0 * * * *"
