"""What a DAG run's catch-up record says: the slots a capped catch-up skipped or coalesced before it.

Pure, like the timetable: nothing here reads a database or writes anything. A run on
:class:`CappedCatchupTimetable` that follows a gap has one :class:`CatchUp`, worked out from the DAG, the
run and the run before it (:func:`catchup_of_run`; :func:`catchup_of_context` from a task's context).
Recording it (the ledger event once per run, the warning, the metric) is the callers' part: the scheduler,
through the ``lease`` plugin's listener as each run starts (:mod:`airflow_lease_provider.plugins.catchup_listener`),
and leased tasks, through :func:`airflow_lease_provider.runtime.catchup.record_skipped_catchup`; the ledger
keeps one record per run (:meth:`airflow_lease_provider.core.EventLedger.record_catchup`).

**Skipped** (the default): the slots the cap dropped between the previous run and this one; kind
``skipped_catchup``, ``catch-up: N older slots of <job> skipped``, ``scheduled.skipped_catchup`` by N.

**Coalesced** (``CappedCatchupTimetable(..., coalesce=True)``): the dropped slots are folded into the
oldest kept run's data interval; kind ``coalesced``, ``catch-up: N missed slots of <job> coalesced into this
run (<start> to <end>)``, ``scheduled.coalesced`` by N. A run is one or the other, never both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow.timetables.base import DataInterval

from airflow_lease_provider.timetables.capped_catchup import CappedCatchupTimetable, SkippedSlots

#: The ledger's event kind (``airflow_lease_provider.core.EventKind.SKIPPED_CATCHUP``) and its counter.
SKIPPED_CATCHUP = "skipped_catchup"
METRIC = "scheduled.skipped_catchup"
#: The ledger's event kind of a coalesced catch-up (``EventKind.COALESCED``) and its counter.
COALESCED = "coalesced"
COALESCED_METRIC = "scheduled.coalesced"


@dataclass(frozen=True)
class CatchUp:
    """The catch-up record of one DAG run: what the cap skipped before it, or coalesced into it.

    :ivar kind: :data:`SKIPPED_CATCHUP` or :data:`COALESCED`.
    :ivar slots: the slots skipped, or folded into the run (each as the interval its own run would have had).
    :ivar interval: a coalesced run's whole data interval; None for a skip.
    """

    kind: str
    slots: SkippedSlots
    dag_id: str
    run_id: str
    max_backfill: int
    interval: DataInterval | None = None

    def detail(self) -> dict[str, Any]:
        """The ledger event's detail (docs/timetable.md, "Recording what was skipped")."""
        span = {}
        if self.interval is not None:
            span = {"coalesced_start": self.interval.start.isoformat(), "coalesced_end": self.interval.end.isoformat()}
        return {
            **self.slots.detail(), **span, "dag_id": self.dag_id, "run_id": self.run_id, "max_backfill": self.max_backfill,
        }

    def message(self, job: str) -> str:
        """The log line, after ``catch-up: ``."""
        if self.interval is None:
            return f"{self.slots.count} older slots of {job} skipped"
        span = f"{self.interval.start.isoformat()} to {self.interval.end.isoformat()}"
        return f"{self.slots.count} missed slots of {job} coalesced into this run ({span})"

    def extra(self) -> dict[str, Any]:
        """The log record's structured values."""
        if self.interval is None:
            return {
                "skipped_first": self.slots.first.start.isoformat(),
                "skipped_last": self.slots.last.start.isoformat(),
                "run_id": self.run_id,
            }
        return {
            "coalesced_start": self.interval.start.isoformat(),
            "coalesced_end": self.interval.end.isoformat(),
            "run_id": self.run_id,
        }


def _value(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _run_slot(dag_run: Any) -> DataInterval | Any | None:
    """A run's data interval when it has one, else its logical date, else None."""
    start, end = _value(dag_run, "data_interval_start"), _value(dag_run, "data_interval_end")
    if start is not None and end is not None:
        return DataInterval(start, end)
    return _value(dag_run, "logical_date")


def _capped(dag: Any, dag_run: Any) -> CappedCatchupTimetable | None:
    """The DAG's capped timetable when ``dag_run`` is a scheduled run of it (only those follow a gap)."""
    if dag is None or dag_run is None:
        return None
    run_type = _value(dag_run, "run_type")
    if str(getattr(run_type, "value", run_type)) != "scheduled":
        return None
    timetable = getattr(dag, "timetable", None)
    return timetable if isinstance(timetable, CappedCatchupTimetable) else None


def _coalesced(timetable: CappedCatchupTimetable, dag_run: Any) -> tuple[DataInterval, SkippedSlots] | None:
    if not timetable.coalesce:
        return None
    run = _run_slot(dag_run)
    if not isinstance(run, DataInterval):
        return None
    folded = timetable.coalesced_slots(run)
    return None if folded is None else (run, folded)


def _skipped(timetable: CappedCatchupTimetable, dag: Any, dag_run: Any, previous: Callable[[], Any]) -> SkippedSlots | None:
    run = _run_slot(dag_run)
    if run is None:
        return None
    previous_run = previous()
    before = _run_slot(previous_run) if previous_run is not None else None
    earliest = getattr(dag, "start_date", None) if before is None and getattr(dag, "catchup", False) else None
    return timetable.skipped_slots(run, before, earliest=earliest)


def catchup_of_run(dag: Any, dag_run: Any, previous: Callable[[], Any]) -> CatchUp | None:
    """The catch-up record of ``dag_run``, or None when it follows no gap (or is not a scheduled run of a DAG
    on :class:`CappedCatchupTimetable`).

    :param dag: the run's DAG (a task's, or the scheduler's serialized DAG): its timetable, and for its first
        run with ``catchup=True`` its ``start_date`` (slots since then count as skipped).
    :param dag_run: the run (anything with ``dag_id``, ``run_id``, ``run_type``, ``logical_date`` and the data
        interval's ``data_interval_start`` / ``data_interval_end``).
    :param previous: returns the run before it by logical date (None: none), called only when needed (a
        skip, not a coalesced run). A manual run in the gap makes the recorded gap shorter, never longer.
    """
    timetable = _capped(dag, dag_run)
    if timetable is None:
        return None
    dag_id, run_id = str(_value(dag_run, "dag_id")), str(_value(dag_run, "run_id"))
    coalesced = _coalesced(timetable, dag_run)
    if coalesced is not None:
        interval, folded = coalesced
        return CatchUp(COALESCED, folded, dag_id, run_id, timetable.max_backfill, interval)
    skipped = _skipped(timetable, dag, dag_run, previous)
    if skipped is None:
        return None
    return CatchUp(SKIPPED_CATCHUP, skipped, dag_id, run_id, timetable.max_backfill)


def _previous_of(context: Mapping[str, Any]) -> Callable[[], Any]:
    """The run before the task's run, as Airflow reports it to the task (``ti.get_previous_dagrun()``)."""
    ti = context.get("ti")
    return lambda: ti.get_previous_dagrun() if ti is not None and hasattr(ti, "get_previous_dagrun") else None


def catchup_of_context(context: Mapping[str, Any]) -> CatchUp | None:
    """:func:`catchup_of_run` of the run a task's Airflow context is about."""
    return catchup_of_run(context.get("dag"), context.get("dag_run"), _previous_of(context))


def skipped_catchup_slots(context: Mapping[str, Any]) -> SkippedSlots | None:
    """The slots skipped right before this run, from the task context; None when nothing was skipped.

    Only scheduled runs of a DAG on :class:`CappedCatchupTimetable` can follow skipped slots. The previous
    run is the one Airflow reports as previous by logical date (``ti.get_previous_dagrun()``); a manual
    run in the gap makes the recorded gap shorter, never longer. For a DAG's first run with
    ``catchup=True``, slots since ``start_date`` count as skipped.
    """
    dag, dag_run = context.get("dag"), context.get("dag_run")
    timetable = _capped(dag, dag_run)
    return None if timetable is None else _skipped(timetable, dag, dag_run, _previous_of(context))


def coalesced_catchup_slots(context: Mapping[str, Any]) -> tuple[DataInterval, SkippedSlots] | None:
    """The run's data interval and the slots coalesced into it, from the task context; None when none were.

    Only scheduled runs of a DAG on ``CappedCatchupTimetable(..., coalesce=True)`` are coalesced: the slots
    strictly inside the run's data interval are those it stands for besides its own.
    """
    timetable = _capped(context.get("dag"), context.get("dag_run"))
    return None if timetable is None else _coalesced(timetable, context["dag_run"])
