"""What happened to a leased task, said once: the ledger event, the metric and the log line of each outcome.

The one path every outcome is reported through: the task lease's (:mod:`.task_lease`), the lease context's
(a loss, a fence refusal) and the catch-up record's (:mod:`.catchup`, from the scheduler's listener or a task).
Call sites state only the outcome (``report(Outcome.SKIPPED_OVERLAP, ...)``); this table decides what
that writes. Some events are written by the core store itself, in the same call that caused them (an
acquire, a release, a fence refusal): for those only the metric and the log line come from here. A loss
is recorded by the keeper when the keeper found it; elsewhere (a fresh read of the store, a run lease
that is gone) the caller says ``recorded=False`` and the event is written here. Either way: one loss,
one event, one ``lease.lost``. A skipped or coalesced catch-up is written once per run by its record itself
(``EventLedger.record_catchup``: an insert the database lets through once), whose writer then reports it
here with ``recorded=True``.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from airflow_lease_provider import metrics
from airflow_lease_provider.core import EventKind, LeaseStore, RunRef

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    ACQUIRED = "acquired"
    SKIPPED_OVERLAP = "skipped_overlap"
    OVERLAP_FAILED = "overlap_failed"
    WAITING = "waiting"
    LOST = "lost"
    FENCE_REJECTED = "fence_rejected"
    RELEASED = "released"
    SKIPPED_CATCHUP = "skipped_catchup"
    REPLACED = "replaced"
    SKIPPED_REPLACED = "skipped_replaced"
    SKIPPED_BUFFER_FULL = "skipped_buffer_full"
    COALESCED = "coalesced"


@dataclass(frozen=True)
class OutcomeSpec:
    """:ivar event: the ledger event. :ivar by_store: the core store writes it itself.
    :ivar metric: the counter (None: none). :ivar level: the log level of the line.
    :ivar topic: what the log line starts with (``lease: ...``)."""

    event: EventKind
    by_store: bool
    metric: str | None
    level: int
    topic: str = "lease"


OUTCOMES: dict[Outcome, OutcomeSpec] = {
    Outcome.ACQUIRED: OutcomeSpec(EventKind.ACQUIRED, True, "lease.acquired", logging.INFO),
    Outcome.SKIPPED_OVERLAP: OutcomeSpec(EventKind.SKIPPED_OVERLAP, False, "scheduled.skipped_overlap", logging.INFO),
    Outcome.OVERLAP_FAILED: OutcomeSpec(EventKind.OVERLAP_FAILED, False, "lease.overlap_failed", logging.ERROR),
    Outcome.WAITING: OutcomeSpec(EventKind.WAITING, False, "lease.waiting", logging.INFO),
    Outcome.LOST: OutcomeSpec(EventKind.LOST, False, "lease.lost", logging.ERROR),
    Outcome.FENCE_REJECTED: OutcomeSpec(EventKind.FENCE_REJECTED, True, "lease.fence_rejected", logging.WARNING),
    Outcome.RELEASED: OutcomeSpec(EventKind.RELEASED, True, None, logging.INFO),
    # replace: the takeover, reported by the replacing task (its 'replaced' event written by the takeover
    # statement itself), and the replaced task's end, reported when it finds out (the same event).
    Outcome.REPLACED: OutcomeSpec(EventKind.REPLACED, True, "lease.replaced", logging.WARNING),
    Outcome.SKIPPED_REPLACED: OutcomeSpec(EventKind.REPLACED, True, "scheduled.skipped_replaced", logging.WARNING),
    Outcome.SKIPPED_BUFFER_FULL: OutcomeSpec(
        EventKind.SKIPPED_BUFFER_FULL, False, "scheduled.skipped_buffer_full", logging.INFO
    ),
    Outcome.SKIPPED_CATCHUP: OutcomeSpec(
        EventKind.SKIPPED_CATCHUP, False, "scheduled.skipped_catchup", logging.WARNING, topic="catch-up"
    ),
    Outcome.COALESCED: OutcomeSpec(
        EventKind.COALESCED, False, "scheduled.coalesced", logging.WARNING, topic="catch-up"
    ),
}


def report(
    outcome: Outcome,
    *,
    store: LeaseStore | None,
    key: str,
    owner: str,
    message: str,
    token: int | None = None,
    detail: dict[str, Any] | None = None,
    tags: dict[str, str] | None = None,
    logger: Any = None,
    recorded: bool = False,
    run: RunRef | None = None,
    count: int = 1,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write what ``outcome`` writes: its ledger event (unless the store or the caller ``recorded`` it
    already), its metric (by ``count``) and its log line ``<topic>: <message>`` (with ``extra`` on the
    record). Never raises for the ledger or metrics.

    ``store``: where the event goes (None: none, e.g. a catch-up recorded without a ledger).
    ``run``: the task instance the outcome is about, for the event's run columns."""
    spec = OUTCOMES[outcome]
    if not (spec.by_store or recorded) and store is not None and store.record_events:
        store.events.record(spec.event, key, owner=owner, token=token, detail=detail, run=run)
    if spec.metric is not None:
        metrics.incr(spec.metric, tags, count=count)
    (logger or log).log(spec.level, "%s: %s", spec.topic, message, extra=extra)
