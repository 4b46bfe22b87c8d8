"""Reads of the event ledger by one lease key or one DAG and a time range: the timeline and the trends.

Every read names a key or a DAG and a time range, so each is an index range scan however large the
ledger (``event_key_at_idx``; ``event_fence_lease_key_at_idx`` of migration 0005, ``event_dag_at_idx``
of migration 0011). What the rows mean (holdings, skip share) is worked out by the read model,
:mod:`airflow_lease_provider.plugins.timeline`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.db import Row
from airflow_lease_provider.core.errors import InvalidArgument
from airflow_lease_provider.core.events import Event
from airflow_lease_provider.core.store import Store
from airflow_lease_provider.core.types import Lease

#: Trend buckets: hours or days, UTC.
UNITS = ("hour", "day")


@dataclass(frozen=True)
class TrendRow:
    """Events of one kind in one bucket (``bucket`` None: the whole range)."""

    bucket: datetime | None
    kind: str
    events: int
    #: Distinct owners: for acquisitions, how many runs (task instances) took the lease.
    owners: int
    #: Catch-up slots skipped (the ``count`` of ``skipped_catchup`` records).
    slots: int


@dataclass(frozen=True)
class KeyUse:
    """A lease key one DAG's runs used in a range: how many events, and the last one's time."""

    key: str
    events: int
    last_at: datetime


def _range(since: object, until: object) -> None:
    for name, value in (("since", since), ("until", until)):
        if not (isinstance(value, datetime) and value.tzinfo is not None):
            raise InvalidArgument(name, value, "must be a timezone-aware datetime")
    assert isinstance(since, datetime) and isinstance(until, datetime)
    if since >= until:
        raise InvalidArgument("since", since, f"must be before until ({until.isoformat()})")


def _limit(value: object, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise InvalidArgument("limit", value, f"must be an integer from 1 to {maximum}")
    return value


def _dags(dag_ids: Collection[str] | None) -> list[str] | None:
    return None if dag_ids is None else sorted(dag_ids)


class LeaseHistory:
    """The ledger of ``store`` (a lease or fence store) read by key or DAG and time range."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def _run(self, name: str, params: dict[str, Any]) -> list[Row]:
        return self.store._ready().run(name, params)

    def _events(self, name: str, params: dict[str, Any]) -> list[Event]:
        return [Event.from_row(r) for r in self._run(name, params)]

    def now(self) -> datetime:
        """The database clock."""
        value = self._run("db_now", {})[0]["now"]
        assert isinstance(value, datetime)
        return value

    def key_events(
        self,
        key: str,
        since: datetime,
        until: datetime,
        *,
        dag_ids: Collection[str] | None = None,
        limit: int = 20_000,
    ) -> list[Event]:
        """The events of ``key`` in ``[since, until)``, newest first: those recorded under the key and the
        fence rejections of its tokens. At most ``limit`` (the newest).

        :param dag_ids: only the events of these DAGs (their ``dag_id`` column).
        """
        key = validation.lookup_name("key", key)
        _range(since, until)
        params = {"key": key, "since": since, "until": until, "dag_ids": _dags(dag_ids),
                  "limit": _limit(limit, 100_000)}
        return self._events("timeline_events", params)

    def open_holding(self, key: str, since: datetime) -> list[Event]:
        """The last acquisition of ``key`` before ``since`` and the events that ended it before ``since``
        (empty when the key was never acquired before): the holding that may still run at ``since``."""
        key = validation.lookup_name("key", key)
        if not (isinstance(since, datetime) and since.tzinfo is not None):
            raise InvalidArgument("since", since, "must be a timezone-aware datetime")
        return self._events("timeline_open_holding", {"key": key, "since": since})

    def catchup_events(
        self,
        dag_ids: Collection[str],
        since: datetime,
        until: datetime,
        *,
        limit: int = 1000,
        coalesced: bool = False,
    ) -> list[Event]:
        """The skipped catch-up records (one per gap) of these DAGs in ``[since, until)``, newest first;
        with ``coalesced``, the coalesced catch-up records (one per coalesced run) too."""
        _range(since, until)
        dags = sorted(dag_ids)
        if not dags:
            return []
        params = {"dag_ids": dags, "since": since, "until": until, "limit": _limit(limit, 100_000)}
        return self._events("catchup_and_coalesced_events" if coalesced else "catchup_events", params)

    def _trend(self, name: str, params: dict[str, Any]) -> list[TrendRow]:
        if params["unit"] not in UNITS:
            raise InvalidArgument("unit", params["unit"], f"must be one of {', '.join(UNITS)}")
        _range(params["since"], params["until"])
        return [
            TrendRow(r["bucket"], r["kind"], int(r["events"]), int(r["owners"]), int(r["slots"]))
            for r in self._run(name, params)
        ]

    def key_trend(
        self,
        key: str,
        since: datetime,
        until: datetime,
        *,
        unit: str = "day",
        dag_ids: Collection[str] | None = None,
    ) -> list[TrendRow]:
        """Acquisitions, skips, failures, catch-up slots, losses and force-releases of ``key`` per
        ``unit`` (UTC) and for the whole range (rows with ``bucket`` None)."""
        key = validation.lookup_name("key", key)
        params = {"key": key, "since": since, "until": until, "unit": unit, "dag_ids": _dags(dag_ids)}
        return self._trend("trend_key", params)

    def dag_trend(self, dag_id: str, since: datetime, until: datetime, *, unit: str = "day") -> list[TrendRow]:
        """:meth:`key_trend` for the events of one DAG (every key its runs used)."""
        validation.identifier("dag_id", dag_id)
        return self._trend("trend_dag", {"dag_id": dag_id, "since": since, "until": until, "unit": unit})

    def dag_keys(self, dag_id: str, since: datetime, until: datetime, *, limit: int = 100) -> list[KeyUse]:
        """The lease keys the runs of ``dag_id`` used in ``[since, until)``, most recently used first."""
        validation.identifier("dag_id", dag_id)
        _range(since, until)
        params = {"dag_id": dag_id, "since": since, "until": until, "limit": _limit(limit, 10_000)}
        return [KeyUse(r["lease_key"], int(r["events"]), r["last_at"]) for r in self._run("dag_keys", params)]

    def dag_leases(self, dag_id: str, *, limit: int = 1000) -> list[Lease]:
        """The lease rows whose holder (or last holder) is a run of ``dag_id`` (the run the acquire named:
        the lease's ``dag_id`` column), in key order."""
        validation.identifier("dag_id", dag_id)
        params = {"dag_id": dag_id, "limit": _limit(limit, 100_000)}
        return [Lease.from_row(r) for r in self._run("dag_leases", params)]
