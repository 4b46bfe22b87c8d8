"""Task-side record of the slots a capped catch-up skipped.

The timetable itself must stay side-effect free (the scheduler calls it over and over), so the first run
after a gap records what was skipped: one ledger event (kind ``skipped_catchup``), one warning
``catch-up: N older slots of <job> skipped`` and ``scheduled.skipped_catchup`` increased by N.
Leased tasks call :func:`record_skipped_catchup` themselves; any other task can call it too::

    @task
    def publish(**context):
        record_skipped_catchup(context, ledger=store.events)
        ...
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from airflow.timetables.base import DataInterval

from airflow_lease_provider.core.errors import LeaseError
from airflow_lease_provider.timetables.capped_catchup import CappedCatchupTimetable, SkippedSlots

log = logging.getLogger(__name__)

#: The ledger's event kind (``airflow_lease_provider.core.EventKind.SKIPPED_CATCHUP``).
SKIPPED_CATCHUP = "skipped_catchup"
#: The counter, on the task-side Stats (``airflow.sdk.observability.stats``).
METRIC = "scheduled.skipped_catchup"
# How many of the job's newest skipped_catchup events to look through for this run's own record.
_DEDUPE_WINDOW = 50


class Ledger(Protocol):
    """What this module needs of :class:`airflow_lease_provider.core.EventLedger`."""

    def record(
        self,
        kind: Any,
        key: str,
        *,
        owner: str | None = None,
        token: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> bool: ...

    def query(self, *, key: str | None = None, kind: Any = None, limit: int = 100) -> list[Any]: ...


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


def _already_recorded(ledger: Ledger, key: str, dag_id: str, run_id: str) -> bool:
    """Whether another task or an earlier try of this run has recorded its skipped slots."""
    try:
        events = ledger.query(key=key, kind=SKIPPED_CATCHUP, limit=_DEDUPE_WINDOW)
    except LeaseError as exc:
        # The ledger is best effort by design (its writes never fail a task); an unreadable ledger
        # must not either. Recording may then happen twice, which beats not at all.
        log.warning("catch-up: could not read the event ledger for %r: %s", key, exc)
        return False
    for event in events:
        detail = _value(event, "detail") or {}
        if detail.get("dag_id") == dag_id and detail.get("run_id") == run_id:
            return True
    return False


def record_skipped_catchup(
    context: Mapping[str, Any],
    *,
    ledger: Ledger | None = None,
    key: str | None = None,
    logger: logging.Logger | Any | None = None,
) -> SkippedSlots | None:
    """Record the slots skipped before this run, once: ledger event, one warning and the metric.

    Call it from a task of the first run after a gap (calling it from every run is fine: runs without a
    gap record nothing). With a ledger, every task and retry of the run may call it and only the first
    records; without one, only a task's first try logs and counts, so call it from one task.

    :param context: the task's Airflow context.
    :param ledger: the event ledger (``LeaseStore(...).events``); without one, only the log and metric.
    :param key: the job's name in the ledger and the log, e.g. the lease key; defaults to the DAG id.
    :param logger: where the warning goes (e.g. an operator's ``self.log``); defaults to this module's.
    :return: what was skipped, or None when nothing was.
    """
    skipped = skipped_catchup_slots(context)
    if skipped is None:
        return None
    dag_run = context["dag_run"]
    dag_id, run_id = str(_value(dag_run, "dag_id")), str(_value(dag_run, "run_id"))
    job = key or dag_id
    if ledger is not None:
        if _already_recorded(ledger, job, dag_id, run_id):
            return skipped
        timetable = context["dag"].timetable
        detail = {
            **skipped.detail(),
            "dag_id": dag_id,
            "run_id": run_id,
            "max_backfill": timetable.max_backfill,
        }
        # A failed write is logged by the ledger and must not fail the task: the skip still happened,
        # and the warning and metric below still say so.
        ledger.record(SKIPPED_CATCHUP, job, owner=f"{dag_id}/{run_id}", detail=detail)
    else:
        ti = context.get("ti")
        if ti is not None and (_value(ti, "try_number") or 1) > 1:
            return skipped  # the first try already logged and counted it
    (logger or log).warning(
        "catch-up: %d older slots of %s skipped",
        skipped.count,
        job,
        extra={
            "skipped_first": skipped.first.start.isoformat(),
            "skipped_last": skipped.last.start.isoformat(),
            "run_id": run_id,
        },
    )
    # The package's metrics module: task-side Stats, and a metrics failure never fails the task.
    from airflow_lease_provider import metrics

    metrics.incr(METRIC, tags={"dag_id": dag_id}, count=skipped.count)
    return skipped
