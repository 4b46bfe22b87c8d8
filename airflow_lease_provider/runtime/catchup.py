"""Recording a catch-up: the ledger event once per DAG run, then the warning and the metric, once.

The scheduler records each run's catch-up as the run starts (the ``lease`` plugin's listener,
:mod:`airflow_lease_provider.plugins.catchup_listener`), for every DAG on the timetable, leased or not.
Leased tasks record it too (:meth:`.task_lease.TaskLease.record_catchup`), which covers a run the
scheduler could not record (its store was unreachable); any task can call :func:`record_skipped_catchup`
with a ledger of its own choosing.

**Once per gap per DAG, decided by the database.** The scheduler, every task of the run, every try and
every parallel instance may write it; the ledger keeps one record per kind and DAG run
(:meth:`~airflow_lease_provider.core.EventLedger.record_catchup`, a unique index on the run columns), and
only the writer whose insert went through logs the warning and counts the metric, through the one path of
every outcome (:func:`.outcomes.report`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from airflow_lease_provider.core import EventLedger, InvalidArgument, RunRef
from airflow_lease_provider.runtime.outcomes import Outcome, report
from airflow_lease_provider.timetables.capped_catchup import SkippedSlots
from airflow_lease_provider.timetables.catchup_record import CatchUp, catchup_of_context

log = logging.getLogger(__name__)


def record_catchup(
    catchup: CatchUp,
    *,
    ledger: EventLedger | None,
    run: RunRef,
    key: str | None = None,
    logger: logging.Logger | Any | None = None,
    first_try: bool = True,
) -> bool | None:
    """Record ``catchup`` once and, if this call recorded it, report it (warning line and metric).

    :param ledger: the lease store's ledger; None: no record, only the line and the metric, and only on a
        task's ``first_try`` (a caller without a ledger cannot tell whether another reported it).
    :param run: the DAG run, or the task instance writing the record: the event's run columns.
    :param key: the job's name in the ledger and the line (default: the DAG id).
    :return: True when this call recorded and reported it; False when it was recorded already (or, without
        a ledger, on a retry); None when the store failed (logged; nothing reported, so the count stays
        exact: the record is left to a writer that reaches the store).
    """
    job = key or catchup.dag_id
    if ledger is not None:
        written = ledger.record_catchup(catchup.kind, job, run=run, detail=catchup.detail())
        if not written:
            return written
    elif not first_try:
        return False
    report(
        Outcome(catchup.kind), store=None, key=job, owner=catchup.dag_id,
        recorded=True, logger=logger or log, message=catchup.message(job), tags={"dag_id": catchup.dag_id},
        count=catchup.slots.count, extra=catchup.extra(),
    )
    return True


def _value(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def record_skipped_catchup(
    context: Mapping[str, Any],
    *,
    ledger: EventLedger | None = None,
    key: str | None = None,
    logger: logging.Logger | Any | None = None,
) -> SkippedSlots | None:
    """From a task: record the slots skipped before this run (or coalesced into it), once.

    The scheduler already records every run of a DAG on the timetable as it starts; this is for a task
    that wants the record in a ledger of its own choosing, and the leased tasks' second chance. On
    ``CappedCatchupTimetable(..., coalesce=True)`` a run whose data interval spans missed slots records them
    as coalesced (event ``coalesced``, metric ``scheduled.coalesced``) and returns them.

    Every task, try and parallel instance of the run may call it at the same time: the ledger keeps one
    record per run (so per gap) and only the caller that wrote it logs and counts. Without a ledger, only a
    task's first try logs and counts, so call it from one task.

    :param context: the task's Airflow context.
    :param ledger: the event ledger of a lease store (``LeaseStore(...).events``); without one, only the
        log and metric.
    :param key: the job's name in the ledger and the log, e.g. the lease key; defaults to the DAG id.
        The record is per DAG run whatever the key: the first writer's key is the one stored (the
        scheduler's, the DAG id, when it reached the store first).
    :param logger: where the warning goes (e.g. an operator's ``self.log``); defaults to this module's.
    :return: what was skipped or coalesced (also to the callers that found the record written), or None.
    :raises InvalidArgument: ``ledger`` is not a lease store's event ledger.
    """
    if ledger is not None and not isinstance(ledger, EventLedger):
        raise InvalidArgument(
            "ledger", type(ledger).__name__, "must be a lease store's event ledger (LeaseStore(...).events)"
        )
    catchup = catchup_of_context(context)
    if catchup is None:
        return None
    # The run columns: this run, and the task instance writing the record when the context has one.
    ti = context.get("ti")
    task_id, map_index = _value(ti, "task_id"), _value(ti, "map_index")
    run = RunRef(catchup.dag_id, catchup.run_id)
    if task_id:
        run = RunRef(catchup.dag_id, catchup.run_id, -1 if map_index is None else int(map_index), task_id=str(task_id))
    first_try = ti is None or (_value(ti, "try_number") or 1) <= 1
    record_catchup(catchup, ledger=ledger, run=run, key=key, logger=logger, first_try=first_try)
    return catchup.slots
