"""Fixtures for the timetable tests: a frozen clock and a croniter call counter."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from typing import Any

import pendulum
import pytest

from airflow_lease_provider.timetables import _grid, capped_catchup


class FrozenClock:
    """The time :func:`capped_catchup._utcnow` returns; tests move it with :meth:`set`."""

    def __init__(self, now: datetime.datetime) -> None:
        self.now = pendulum.instance(now)

    def set(self, now: datetime.datetime) -> None:
        self.now = pendulum.instance(now)

    def __call__(self) -> pendulum.DateTime:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FrozenClock:
    """Freeze the timetable's clock (its one clock read) at 2025-06-15 12:00:30 UTC."""
    frozen = FrozenClock(pendulum.datetime(2025, 6, 15, 12, 0, 30, tz="UTC"))
    monkeypatch.setattr(capped_catchup, "_utcnow", frozen)
    return frozen


class CroniterCalls:
    """Counts every croniter construction made by Airflow's CronMixin and by this package."""

    def __init__(self) -> None:
        self.count = 0

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        return counting


@pytest.fixture
def croniter_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[CroniterCalls]:
    """Patch croniter where it is looked up (``airflow.timetables._cron`` and our modules) to count calls.

    Each CronMixin step constructs one croniter and asks it for one neighbour, so constructions count
    steps.
    """
    import airflow.timetables._cron as airflow_cron

    calls = CroniterCalls()
    for module in (airflow_cron, _grid, capped_catchup):
        monkeypatch.setattr(module, "croniter", calls.wrap(module.croniter))
    yield calls
