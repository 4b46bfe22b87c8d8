"""Task-side record of the slots a capped catch-up skipped.

The timetable itself must stay side-effect free (the scheduler calls it over and over), so the first run
after a gap records what was skipped: one ledger event (kind ``skipped_catchup``), one warning
``catch-up: N older slots of <job> skipped`` and ``scheduled.skipped_catchup`` increased by N (the warning
and the metric reported as every outcome is, by :func:`airflow_lease_provider.runtime.outcomes.report`).
Leased tasks call :func:`record_skipped_catchup` themselves; any other task can call it too::

    @task
    def publish(**context):
        record_skipped_catchup(context, ledger=store.events)
        ...

**Once per gap per DAG, decided by the database.** Every leased task of the run, every try and every
parallel instance may call it; a unique index on the event table (migration 0004: one ``skipped_catchup``
event per ``(dag_id, run_id)``) lets exactly one ``INSERT ... ON CONFLICT DO NOTHING`` through, and only
the caller whose insert went through logs the warning and counts the metric.

**Coalesced catch-up** (``CappedCatchupTimetable(..., coalesce=True)``): the dropped slots are not
skipped but folded into the oldest kept run's data interval, and that run records them instead, the
same way once per run (kind ``coalesced``, migration 0013's unique index): ``catch-up: N missed slots of
<job> coalesced into this run (<start> to <end>)`` and ``scheduled.coalesced`` increased by N. The same
call records either, whichever applies to the run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow.timetables.base import DataInterval

from airflow_lease_provider.core.errors import InvalidArgument, LeaseError
from airflow_lease_provider.core.identity import RunRef
from airflow_lease_provider.timetables.capped_catchup import CappedCatchupTimetable, SkippedSlots

if TYPE_CHECKING:
    from airflow_lease_provider.core.events import EventLedger

log = logging.getLogger(__name__)

#: The ledger's event kind (``airflow_lease_provider.core.EventKind.SKIPPED_CATCHUP``).
SKIPPED_CATCHUP = "skipped_catchup"
#: The counter, on the task-side Stats (``airflow.sdk.observability.stats``).
METRIC = "scheduled.skipped_catchup"
#: The ledger's event kind of a coalesced catch-up (``EventKind.COALESCED``) and its counter.
COALESCED = "coalesced"
COALESCED_METRIC = "scheduled.coalesced"


def _value(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _run_slot(dag_run: Any) -> DataInterval | Any | None:
    """A run's data interval when it has one, else its logical date, else None."""
    start, end = _value(dag_run, "data_interval_start"), _value(dag_run, "data_interval_end")
    if start is not None and end is not None:
        return DataInterval(start, end)
    return _value(dag_run, "logical_date")


def _run_type(dag_run: Any) -> str:
    run_type = _value(dag_run, "run_type")
    return str(getattr(run_type, "value", run_type))


def skipped_catchup_slots(context: Mapping[str, Any]) -> SkippedSlots | None:
    """The slots skipped right before this run, from the task context; None when nothing was skipped.

    Only scheduled runs of a DAG on :class:`CappedCatchupTimetable` can follow skipped slots. The previous
    run is the one Airflow reports as previous by logical date (``ti.get_previous_dagrun()``); a manual
    run in the gap makes the recorded gap shorter, never longer. For a DAG's first run with
    ``catchup=True``, slots since ``start_date`` count as skipped.
    """
    dag, dag_run = context.get("dag"), context.get("dag_run")
    if dag is None or dag_run is None or _run_type(dag_run) != "scheduled":
        return None
    timetable = getattr(dag, "timetable", None)
    if not isinstance(timetable, CappedCatchupTimetable):
        return None
    run = _run_slot(dag_run)
    if run is None:
        return None
    ti = context.get("ti")
    previous_run = ti.get_previous_dagrun() if ti is not None and hasattr(ti, "get_previous_dagrun") else None
    previous = _run_slot(previous_run) if previous_run is not None else None
    earliest = (
        getattr(dag, "start_date", None) if previous is None and getattr(dag, "catchup", False) else None
    )
    return timetable.skipped_slots(run, previous, earliest=earliest)


def coalesced_catchup_slots(context: Mapping[str, Any]) -> tuple[DataInterval, SkippedSlots] | None:
    """The run's data interval and the slots coalesced into it, from the task context; None when none were.

    Only scheduled runs of a DAG on ``CappedCatchupTimetable(..., coalesce=True)`` are coalesced: the slots
    strictly inside the run's data interval are those it stands for besides its own.
    """
    dag, dag_run = context.get("dag"), context.get("dag_run")
    if dag is None or dag_run is None or _run_type(dag_run) != "scheduled":
        return None
    timetable = getattr(dag, "timetable", None)
    if not isinstance(timetable, CappedCatchupTimetable) or not timetable.coalesce:
        return None
    run = _run_slot(dag_run)
    if not isinstance(run, DataInterval):
        return None
    folded = timetable.coalesced_slots(run)
    return None if folded is None else (run, folded)


def _insert_once(
    ledger: EventLedger, job: str, run: RunRef, detail: dict[str, Any], query: str = "record_skipped_catchup"
) -> bool | None:
    """Write the run's record unless it exists: True when this call wrote it, False when it existed.

    None when the store could not be reached or failed: the ledger is best effort by design and must
    not fail the task; the record (and the metric) is then left to a task or try that can write it.
    """
    from airflow_lease_provider.core.identity import run_columns
    from airflow_lease_provider.core.schema import ensure_schema

    payload = json.dumps(detail, default=str, sort_keys=True)
    try:
        ensure_schema(ledger.db)  # cheap when current (one query); the record may be a store's first use
        rows = ledger.db.run(
            query,
            {"key": job, "owner": run.run.owner(), "detail": payload, **run_columns(run)},
            durable=None,
        )
    except LeaseError as exc:
        log.warning("catch-up: could not record the skipped slots of %r: %s", job, exc)
        return None
    return bool(rows)


def record_skipped_catchup(
    context: Mapping[str, Any],
    *,
    ledger: EventLedger | None = None,
    key: str | None = None,
    logger: logging.Logger | Any | None = None,
) -> SkippedSlots | None:
    """Record the slots skipped before this run, once: ledger event, one warning and the metric.

    On ``CappedCatchupTimetable(..., coalesce=True)`` a run whose data interval spans missed slots records
    them as coalesced instead (event ``coalesced``, metric ``scheduled.coalesced``) and returns them.

    Call it from a task of the first run after a gap (calling it from every run is fine: runs without a
    gap record nothing). With a ledger, every task, try and parallel instance of the run may call it at
    the same time: the database keeps one record per run (so per gap) and only the caller that wrote it
    logs and counts. Without one, only a task's first try logs and counts, so call it from one task.

    :param context: the task's Airflow context.
    :param ledger: the event ledger of a lease store (``LeaseStore(...).events``); without one, only the
        log and metric.
    :param key: the job's name in the ledger and the log, e.g. the lease key; defaults to the DAG id.
        The record is per DAG run whatever the key: with tasks of different keys, the first writer's
        key is the one stored.
    :param logger: where the warning goes (e.g. an operator's ``self.log``); defaults to this module's.
    :return: what was skipped (also to the callers that found the record written), or None when nothing was.
    :raises InvalidArgument: ``ledger`` is not a lease store's event ledger.
    """
    if ledger is not None and not hasattr(getattr(ledger, "db", None), "run"):
        raise InvalidArgument(
            "ledger", type(ledger).__name__, "must be a lease store's event ledger (LeaseStore(...).events)"
        )
    coalesced = coalesced_catchup_slots(context)
    if coalesced is not None:
        return _record_coalesced(context, coalesced, ledger=ledger, key=key, logger=logger)
    skipped = skipped_catchup_slots(context)
    if skipped is None:
        return None
    dag_run = context["dag_run"]
    dag_id, run_id = str(_value(dag_run, "dag_id")), str(_value(dag_run, "run_id"))
    job = key or dag_id
    if ledger is not None:
        timetable = context["dag"].timetable
        detail = {
            **skipped.detail(),
            "dag_id": dag_id,
            "run_id": run_id,
            "max_backfill": timetable.max_backfill,
        }
        # The run columns: this run, and the task instance writing the record when the context has one.
        ti = context.get("ti")
        task_id, map_index = _value(ti, "task_id"), _value(ti, "map_index")
        run = RunRef(dag_id, run_id, -1 if map_index is None else int(map_index), task_id=str(task_id)) if task_id else (
            RunRef(dag_id, run_id)
        )
        if not _insert_once(ledger, job, run, detail):
            return skipped  # another task or try wrote the record and counted it (or will)
    else:
        ti = context.get("ti")
        if ti is not None and (_value(ti, "try_number") or 1) > 1:
            return skipped  # the first try already logged and counted it
    # Reported through the one path of every outcome (the event is this record's own, written above).
    from airflow_lease_provider.runtime.outcomes import Outcome, report

    report(
        Outcome.SKIPPED_CATCHUP, store=None, key=job, owner=dag_id, recorded=True, logger=logger or log,
        message=f"{skipped.count} older slots of {job} skipped", tags={"dag_id": dag_id}, count=skipped.count,
        extra={
            "skipped_first": skipped.first.start.isoformat(),
            "skipped_last": skipped.last.start.isoformat(),
            "run_id": run_id,
        },
    )
    return skipped


def _run_ref(context: Mapping[str, Any], dag_id: str, run_id: str) -> RunRef:
    """The run columns: this run, and the task instance writing the record when the context has one."""
    ti = context.get("ti")
    task_id, map_index = _value(ti, "task_id"), _value(ti, "map_index")
    if not task_id:
        return RunRef(dag_id, run_id)
    return RunRef(dag_id, run_id, -1 if map_index is None else int(map_index), task_id=str(task_id))


def _record_coalesced(
    context: Mapping[str, Any],
    coalesced: tuple[DataInterval, SkippedSlots],
    *,
    ledger: EventLedger | None,
    key: str | None,
    logger: logging.Logger | Any | None,
) -> SkippedSlots:
    """Record the slots coalesced into this run, once: ledger event ``coalesced``, one line, the metric."""
    interval, folded = coalesced
    dag_run = context["dag_run"]
    dag_id, run_id = str(_value(dag_run, "dag_id")), str(_value(dag_run, "run_id"))
    job = key or dag_id
    start, end = interval.start.isoformat(), interval.end.isoformat()
    if ledger is not None:
        detail = {
            **folded.detail(),
            "coalesced_start": start,
            "coalesced_end": end,
            "dag_id": dag_id,
            "run_id": run_id,
            "max_backfill": context["dag"].timetable.max_backfill,
        }
        if not _insert_once(ledger, job, _run_ref(context, dag_id, run_id), detail, query="record_coalesced"):
            return folded  # another task or try wrote the record and counted it (or will)
    else:
        ti = context.get("ti")
        if ti is not None and (_value(ti, "try_number") or 1) > 1:
            return folded  # the first try already logged and counted it
    from airflow_lease_provider.runtime.outcomes import Outcome, report

    report(
        Outcome.COALESCED, store=None, key=job, owner=dag_id, recorded=True, logger=logger or log,
        message=f"{folded.count} missed slots of {job} coalesced into this run ({start} to {end})",
        tags={"dag_id": dag_id}, count=folded.count,
        extra={"coalesced_start": start, "coalesced_end": end, "run_id": run_id},
    )
    return folded
