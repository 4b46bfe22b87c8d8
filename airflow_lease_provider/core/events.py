"""The event ledger: what happened to leases and fences, with database timestamps.

Writing an event never blocks or breaks the lease path: a failed write is logged and dropped, and a
short statement timeout bounds how long it may take. Reading is for the UI, the CLI and TTL advice.

A catch-up record (what a capped catch-up skipped or coalesced before a DAG run) is written at most once
per kind and run, by :meth:`EventLedger.record_catchup`: the database decides which of its writers (the
scheduler, every task and try of the run) wrote it.
"""

from __future__ import annotations

import enum
import json
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.db import Database
from airflow_lease_provider.core.errors import InvalidArgument, LeaseError
from airflow_lease_provider.core.identity import RunRef, run_columns
from airflow_lease_provider.core.types import from_columns

log = logging.getLogger(__name__)

DEFAULT_RETENTION = timedelta(days=30)
#: Event detail is for people to read; a cap keeps one bad caller from filling the table.
MAX_DETAIL_BYTES = 16_384
# Prune old events on about one write in this many, so retention needs no scheduler of its own.
_PRUNE_EVERY = 200


class EventKind(str, enum.Enum):
    """What an event records. The values are stored; add new ones, never rename."""

    ACQUIRED = "acquired"
    SKIPPED_OVERLAP = "skipped_overlap"
    RENEWED_LATE = "renewed_late"
    RELEASED = "released"
    LOST = "lost"
    FORCE_RELEASED = "force_released"
    FENCE_REJECTED = "fence_rejected"
    SKIPPED_CATCHUP = "skipped_catchup"
    WAITING = "waiting"
    OVERLAP_FAILED = "overlap_failed"
    #: ``on_overlap="replace"``: the holder was taken over by a newer run (the event's owner, token and run
    #: columns are the replaced holder's; ``by_owner``, ``by_token`` and ``by_*`` in its detail the new one's).
    REPLACED = "replaced"
    #: ``on_overlap="wait"`` with ``max_waiting``: every waiting place was taken; the run
    #: is skipped, naming the waiters in its detail.
    SKIPPED_BUFFER_FULL = "skipped_buffer_full"
    #: A coalesced catch-up: the missed slots folded into one run's data interval (issue 26 item 4).
    COALESCED = "coalesced"

    def __str__(self) -> str:
        return self.value


#: The kinds a DAG run has at most one record of (migrations 0004, 0013, keyed by the run columns since
#: 0016), and the statement that writes each.
CATCHUP_KINDS: dict[str, str] = {
    EventKind.SKIPPED_CATCHUP.value: "record_skipped_catchup",
    EventKind.COALESCED.value: "record_coalesced",
}


def _has_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


def _payload(detail: dict[str, Any] | None) -> str:
    """``detail`` as the JSON the event table stores, or :class:`InvalidArgument` saying why it cannot be."""
    if detail is not None and not isinstance(detail, dict):
        raise InvalidArgument("detail", detail, f"must be a dict or None, not {type(detail).__name__}")
    try:
        # allow_nan=False: PostgreSQL's jsonb has no NaN or Infinity.
        payload = json.dumps(detail or {}, default=str, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument("detail", detail, f"is not storable as JSON: {exc}") from None
    if _has_nul(detail):
        raise InvalidArgument("detail", detail, "must not contain NUL characters (jsonb cannot store them)")
    if len(payload.encode()) > MAX_DETAIL_BYTES:
        raise InvalidArgument("detail", detail, f"is larger than {MAX_DETAIL_BYTES} bytes as JSON")
    return payload


def event_kind(value: object) -> str:
    """The stored value of an event kind, or :class:`InvalidArgument` naming the known ones."""
    try:
        return EventKind(value).value
    except ValueError:
        raise InvalidArgument("kind", value, f"must be one of {', '.join(k.value for k in EventKind)}") from None


@dataclass(frozen=True)
class Event:
    """One row of the ledger.

    :ivar run: the DAG run (and task instance) the event is about, from its run columns (migration
        0007); ``None`` for an event about no run (a core API user passed none).
    """

    id: int
    at: datetime
    kind: str
    key: str
    owner: str | None
    token: int | None
    detail: dict[str, Any] = field(default_factory=dict)
    run: RunRef | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Event:
        """An event from a row of the event table, read by column name."""
        return cls(
            id=row["id"], at=row["at"], kind=row["kind"], key=row["key"], owner=row["owner"],
            token=row["token"], detail=row["detail"] or {}, run=RunRef.from_columns(row),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at.isoformat(),
            "kind": self.kind,
            "key": self.key,
            "owner": self.owner,
            "token": self.token,
            "detail": self.detail,
            **run_columns(self.run),
        }


@dataclass(frozen=True)
class EventCount:
    key: str
    kind: str
    last_24h: int
    last_7d: int

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> EventCount:
        return from_columns(cls, row)


@dataclass(frozen=True)
class HoldStats:
    """How long one key's lease was held, from its ``released`` events (for TTL advice)."""

    key: str
    holds: int
    worst_seconds: float
    p95_seconds: float
    last_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> HoldStats:
        return from_columns(cls, row)


class EventLedger:
    """Records and reads events in the store's ``event`` table.

    :param db: the store's database boundary (shares the store's connection).
    :param retention: events older than this are deleted, a batch at a time, as new ones are written.
    """

    def __init__(
        self,
        db: Database,
        *,
        retention: timedelta = DEFAULT_RETENTION,
        prepare: Callable[[], object] | None = None,
    ) -> None:
        self.db = db
        self.retention = validation.positive_timedelta("retention", retention)
        # The owning store's "create the schema on first use", so the ledger can be the first user.
        self._prepare = prepare or (lambda: None)

    def record(
        self,
        kind: EventKind | str,
        key: str,
        *,
        owner: str | None = None,
        token: int | None = None,
        detail: dict[str, Any] | None = None,
        run: RunRef | None = None,
    ) -> bool:
        """Write one event. Returns False (and logs) instead of raising when the store fails.

        :param run: the DAG run (and task instance) the event is about, stored in the run columns;
            ``None`` (a core API user's event) leaves them NULL.

        Bad arguments still raise :class:`InvalidArgument`: that is the caller's bug, not an outage.
        """
        kind_value = event_kind(kind)
        columns = run_columns(run)
        key = validation.lookup_name("key", key)
        if owner is not None:
            validation.owner("owner", owner)
        if token is not None:
            validation.token("token", token)
        payload = _payload(detail)
        try:
            self._prepare()
            # Not sent again after a lost answer: the first send may have written it, and a ledger counts
            # events (docs/core.md, "Statements sent again after a lost connection"). Best effort: at most once.
            self.db.run(
                "record_event",
                {"kind": kind_value, "key": key, "owner": owner, "token": token, "detail": payload, **columns},
                durable=None, retry=False,
            )
        except LeaseError as exc:
            log.warning("event ledger: could not record %s for %r: %s", kind_value, key, exc)
            return False
        self.maybe_prune()
        return True

    def record_catchup(
        self, kind: EventKind | str, key: str, *, run: RunRef, detail: dict[str, Any], owner: str | None = None
    ) -> bool | None:
        """Write the catch-up record of ``run``'s DAG run unless it has one of this kind.

        One record per kind and DAG run, decided by the database: a unique index on the event's run columns
        ``(dag_id, run_id)`` (migration 0016) lets exactly one ``INSERT ... ON CONFLICT DO NOTHING``
        through, however many writers send it at once (the scheduler as the run starts, each task and try
        of the run, several schedulers). Only the caller that gets True should report it (log, metric).

        :param kind: ``skipped_catchup`` or ``coalesced``.
        :param key: the job's name in the ledger (a DAG id, a lease key).
        :param run: the DAG run (and the task instance writing the record, if any); its run columns key it.
        :param detail: what was skipped or coalesced (see ``docs/timetable.md``).
        :param owner: the event's owner; defaults to the run's (``dag_id/run_id``).
        :return: True when this call wrote the record, False when the run had it already, None when the
            store failed (logged, never raised: the ledger is best effort; the record is left to a writer
            that reaches the store). Bad arguments raise :class:`InvalidArgument`.
        """
        kind_value = event_kind(kind)
        query = CATCHUP_KINDS.get(kind_value)
        if query is None:
            raise InvalidArgument("kind", kind_value, f"must be one of {', '.join(CATCHUP_KINDS)}")
        if not isinstance(run, RunRef):
            raise InvalidArgument("run", run, f"must be the RunRef of a DAG run, not {type(run).__name__}")
        columns = run_columns(run)
        key = validation.lookup_name("key", key)
        owner = run.run.owner() if owner is None else validation.owner("owner", owner)
        payload = _payload(detail)
        try:
            # The store's schema is checked on its first use only (the store's prepare), not per record.
            self._prepare()
            rows = self.db.run(query, {"key": key, "owner": owner, "detail": payload, **columns}, durable=None)
        except LeaseError as exc:
            log.warning(
                "event ledger: could not record the %s record of %s/%s: %s", kind_value, run.dag_id, run.run_id, exc
            )
            return None
        if rows:
            self.maybe_prune()
        return bool(rows)

    def maybe_prune(self) -> None:
        """Prune once in every so many writes (at random): called after each event written, also by the
        lease statements that write their event themselves."""
        if random.randrange(_PRUNE_EVERY) == 0:
            self.prune()

    def prune(self) -> int:
        """Delete events past the retention. Best effort; returns how many went."""
        try:
            self._prepare()
            self.db.run("prune_events", {"retention": self.retention}, durable=None)
        except LeaseError as exc:
            log.warning("event ledger: pruning failed: %s", exc)
            return 0
        return 1

    def query(
        self,
        *,
        key: str | None = None,
        kind: EventKind | str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 100,
    ) -> list[Event]:
        """The newest events first, filtered by key, kind and time range."""
        if kind is not None:
            kind = event_kind(kind)
        if key is not None:
            key = validation.lookup_name("key", key)
        for name, value in (("since", since), ("until", until)):
            if value is not None and not (isinstance(value, datetime) and value.tzinfo is not None):
                raise InvalidArgument(name, value, "must be a timezone-aware datetime or None")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise InvalidArgument("limit", limit, "must be an integer from 1 to 10000")
        self._prepare()
        rows = self.db.run(
            "event_page",
            {
                "key": key, "kind": kind, "since": since, "until": until, "limit": limit,
                "before_at": None, "before_id": None, "dag_ids": None,
            },
        )
        return [Event.from_row(r) for r in rows]

    def fence_refusal(self, lease_key: str, *, owner: str, token: int) -> Event | None:
        """The newest ``fence_rejected`` event of ``token`` of ``lease_key`` published by ``owner`` (any
        fence, any resource), or ``None``: one range scan of the refusals of that lease key (its index),
        whatever the size of the ledger. Refusals past the retention are gone with their events."""
        lease_key = validation.lookup_name("lease_key", lease_key)
        validation.owner("owner", owner)
        validation.token("token", token)
        self._prepare()
        rows = self.db.run("fence_refusal", {"lease_key": lease_key, "owner": owner, "token": token})
        return Event.from_row(rows[0]) if rows else None

    def counts(self, *, dag_ids: list[str] | None = None) -> list[EventCount]:
        """Per key and kind: how many events in the last 24 hours and the last 7 days (of the events
        of ``dag_ids`` when given: their ``dag_id`` column)."""
        self._prepare()
        return [EventCount.from_row(r) for r in self.db.run("count_events", {"dag_ids": dag_ids})]

    def hold_stats(self, window: timedelta = DEFAULT_RETENTION, *, dag_ids: list[str] | None = None) -> list[HoldStats]:
        """Per key: released holds within ``window`` (by the database clock), the longest and the p95
        (of the events of ``dag_ids`` when given)."""
        validation.positive_timedelta("window", window)
        self._prepare()
        rows = self.db.run("hold_stats", {"window": window, "dag_ids": dag_ids})
        return [HoldStats.from_row(r) for r in rows]
