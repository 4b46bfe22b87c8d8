"""A timetable whose catch-up after downtime is capped to the newest ``max_backfill`` slots.

Airflow offers two catch-up policies: every missed slot (``catchup=True``: a week offline is 672 runs of
a quarter-hourly job) or only the latest (``catchup=False``). :class:`CappedCatchupTimetable` adds the
one in between: with ``catchup=True`` only the newest ``max_backfill`` missed slots become runs, older
ones never do, and an optional ``catchup_window`` drops slots older than a duration.

Rules the implementation keeps (``docs/timetable.md`` explains the choices):

* **Pure, but for one move.** :meth:`next_dagrun_info` and every other method read no database; the
  clock is read in one place, :func:`_utcnow`, which tests replace. The one exception is
  :meth:`next_run_info_from_dag_model` when the stored run is older than the newest due slot: it then
  reads the DAG's ``catchup`` and ``end_date`` (``serialized_dag``) and, when it moves the run, the logical
  dates its runs already have (``dag_run``) through the scheduler's session, as
  :mod:`airflow_lease_provider.timetables._scheduler` says; nothing otherwise.
* **No cost per missed or kept slot.** The newest slots are counted back from now by calendar arithmetic
  (:mod:`airflow_lease_provider.timetables._grid`), never by walking the gap, so a call after a 50-year
  outage with ``max_backfill=10000`` costs about what Airflow's own cron timetable's call does
  (docs/benchmarks.md, issue 28 item 2).
* **Backfills are not clipped.** Airflow asks with ``restriction.latest`` set for ``airflow backfill``;
  those ranges are scheduled slot by slot, whatever the cap says.
* **Kept runs run one at a time.** With ``max_backfill > 1`` the timetable's ``active_runs_limit`` is 1
  (Airflow then refuses a DAG with ``max_active_runs`` above 1 at parse time), so the kept slots run
  back to back and a leased task in one never finds the lease held by another kept slot's run.
  ``parallel_catchup=True`` lifts that, for jobs whose runs may overlap.
* **Coalesced catch-up (``coalesce=True``).** Where the cap drops missed slots, the oldest kept run's data
  interval starts where the last run's ended instead, so the dropped range is folded into that run, not
  lost (apache/airflow #25265). Only with ``catchup=True`` and outside backfills; the logical date of that
  run is its interval's start, the one the scheduler stored before the outage.
* **The stored next run cannot slip a stale slot in.** Before an outage the scheduler stores the next
  run in ``DagModel`` and, after the outage, creates it without asking :meth:`next_dagrun_info`; so
  :meth:`next_run_info_from_dag_model` re-applies the cap to that stored run.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import zoneinfo
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pendulum
from airflow.timetables.base import DagRunInfo, DataInterval, Timetable
from croniter import CroniterBadCronError, CroniterBadDateError, CroniterError, croniter

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import InvalidArgument
from airflow_lease_provider.timetables import _scheduler
from airflow_lease_provider.timetables._grid import CronGrid, DeltaGrid, Grid, to_utc
from airflow_lease_provider.version_compat import cron_presets

if TYPE_CHECKING:
    from airflow.timetables.base import TimeRestriction
    from pendulum import DateTime
    from pendulum.tz.timezone import FixedTimezone, Timezone

    from airflow_lease_provider.version_compat import DagModel

log = logging.getLogger(__name__)

#: The largest accepted ``max_backfill`` (the range the timetable bench measures); past this, use Airflow's
#: own ``catchup=True``.
MAX_BACKFILL = 10_000
#: The shortest accepted ``catchup_window``. The scheduler creates a run a few seconds after its slot;
#: a shorter window would drop on-time runs (Temporal enforces the same floor, Kubernetes warns of it).
MIN_CATCHUP_WINDOW = datetime.timedelta(seconds=10)
# Airflow presets that are not periodic and cannot be capped.
_NOT_PERIODIC = frozenset({"@once", "@continuous", "none"})


def _utcnow() -> DateTime:
    """The only clock read of this module: tests replace it to freeze time."""
    return pendulum.now("UTC")


# -- argument validation (runs when the DAG file is parsed) ----------------------------------------------


def _timezone_arg(value: object) -> Timezone | FixedTimezone:
    if isinstance(value, (pendulum.Timezone, pendulum.FixedTimezone)):
        return value
    # Standard-library zones (a DAG's own timezone may be one) become pendulum's, which serialize by name.
    if isinstance(value, zoneinfo.ZoneInfo):
        value = value.key
    elif isinstance(value, datetime.timezone):
        offset = value.utcoffset(None)
        value = "UTC" if not offset else int(offset.total_seconds())
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidArgument(
            "timezone", value, "must be an IANA name such as 'Europe/Berlin' or a pendulum timezone"
        )
    if isinstance(value, int) and not -86_400 < value < 86_400:
        raise InvalidArgument("timezone", value, "as a UTC offset in seconds must be within one day")
    try:
        return pendulum.timezone(value)
    except (ValueError, pendulum.tz.exceptions.TimezoneError) as exc:
        raise InvalidArgument("timezone", value, f"is not a known timezone ({exc})") from None
    except OSError:  # a name the zone files' directory cannot even look up (too long for a file name)
        raise InvalidArgument("timezone", value, "is not a known timezone") from None


def _schedule_arg(value: object, timezone: Timezone | FixedTimezone) -> CronGrid | datetime.timedelta:
    if isinstance(value, datetime.timedelta):
        if value <= datetime.timedelta(0):
            raise InvalidArgument("schedule", value, "must be a positive interval")
        return value
    if not isinstance(value, str):
        raise InvalidArgument(
            "schedule",
            value,
            f"must be a cron expression or a datetime.timedelta, not {type(value).__name__}",
        )
    expression = value.strip()
    if expression.lower() in _NOT_PERIODIC:
        raise InvalidArgument("schedule", value, "is not a periodic schedule; there is nothing to catch up")
    expression = cron_presets.get(expression, expression)
    try:
        # One step proves the expression can fire at all ("0 0 30 2 *" parses but never matches).
        croniter(expression).get_next(datetime.datetime)
    except CroniterBadDateError:
        raise InvalidArgument("schedule", value, "never fires: no date matches it") from None
    except (CroniterBadCronError, CroniterError, ValueError, KeyError) as exc:
        raise InvalidArgument("schedule", value, f"is not a valid cron expression ({exc})") from None
    return CronGrid(expression, timezone)


def _max_backfill_arg(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument("max_backfill", value, f"must be an int, not {type(value).__name__}")
    if value < 0:
        raise InvalidArgument("max_backfill", value, "must not be negative")
    if value > MAX_BACKFILL:
        raise InvalidArgument(
            "max_backfill",
            value,
            f"must be at most {MAX_BACKFILL}; to run every missed slot use catchup=True alone",
        )
    return value


def _catchup_window_arg(value: object) -> datetime.timedelta | None:
    if value is None:
        return None
    if not isinstance(value, datetime.timedelta):
        raise InvalidArgument(
            "catchup_window", value, f"must be a datetime.timedelta or None, not {type(value).__name__}"
        )
    if value <= datetime.timedelta(0):
        raise InvalidArgument("catchup_window", value, "must be positive")
    if value < MIN_CATCHUP_WINDOW:
        raise InvalidArgument(
            "catchup_window",
            value,
            f"must be at least {MIN_CATCHUP_WINDOW.total_seconds():g} s, or on-time runs the scheduler "
            "creates a few seconds late would be dropped",
        )
    return value


def _encode_timezone(timezone: Timezone | FixedTimezone) -> str | int:
    # Same encoding as Airflow's serializer: UTC by name (pendulum.timezone(0) is "+00:00", not UTC).
    if isinstance(timezone, pendulum.FixedTimezone):
        return "UTC" if timezone.offset == 0 else timezone.offset
    return timezone.name


# -- skipped slots -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SkippedSlots:
    """The slots a capped catch-up never ran, between two consecutive automated runs.

    Slots are given as the data interval their run would have had (``start`` is its logical date).
    """

    count: int
    first: DataInterval
    last: DataInterval

    def detail(self) -> dict[str, Any]:
        """A JSON-ready summary for the event ledger."""
        return {
            "count": self.count,
            "first_start": self.first.start.isoformat(),
            "first_end": self.first.end.isoformat(),
            "last_start": self.last.start.isoformat(),
            "last_end": self.last.end.isoformat(),
        }


def slot_idempotency_key(job: str, slot: DataInterval | datetime.datetime | Mapping[str, Any]) -> str:
    """A stable key for one slot of ``job``: the same for every retry and re-run of that slot.

    Use it as the idempotency key of an irreversible publish (billing, notifications) so a slot that is
    retried, cleared or caught up twice is published at most once.

    Pass the task context (``slot_idempotency_key("billing_close", context)``) to cover every kind of
    run: a run with a data interval (scheduled, backfilled, or manual with a logical date) is keyed by
    the interval's start, ``"billing_close@2025-06-15T09:00:00Z"``; an Airflow 3 manual run triggered
    without a logical date (the UI's default, ``airflow dags trigger`` and the REST API) has no slot, so it
    is keyed by its run id, ``"billing_close@run:manual__2025-06-15T09:12:44.120+00:00"``: its retries
    and clears publish once, and two manual runs are two publishes.

    :param job: what is published (a DAG id, a lease key); part of the key.
    :param slot: the task context, the run's data interval, or its logical date (a datetime).
    :raises InvalidArgument: a ``ValueError`` naming ``job`` or ``slot``, e.g. for ``slot=None`` (the
        ``data_interval_start`` of a run without a logical date: pass the context instead).
    """
    validation.name("job", job)
    if isinstance(slot, Mapping):
        return _key_from_context(job, slot)
    if slot is None:
        raise InvalidArgument(
            "slot",
            slot,
            "is None: this run has no data interval (an Airflow 3 manual run triggered without a logical "
            "date has none); pass the task context, slot_idempotency_key(job, context), to key such a run "
            "by its run id",
        )
    start: datetime.datetime
    if isinstance(slot, DataInterval):
        start = slot.start
    elif isinstance(slot, datetime.datetime):
        start = slot
    else:
        raise InvalidArgument(
            "slot",
            slot,
            "must be the task context, a DataInterval or a datetime (the slot's logical date), "
            f"not {type(slot).__name__}",
        )
    # UTC, so the key does not change with the DAG's timezone or a DST fold.
    utc = to_utc(start)
    stamp = utc.strftime("%Y-%m-%dT%H:%M:%S.%f" if utc.microsecond else "%Y-%m-%dT%H:%M:%S")
    return f"{job}@{stamp}Z"


def _key_from_context(job: str, context: Mapping[str, Any]) -> str:
    start = context.get("data_interval_start") or context.get("logical_date")
    if start is not None:
        return slot_idempotency_key(job, start)
    dag_run = context.get("dag_run")
    run_id = context.get("run_id") or getattr(dag_run, "run_id", None)
    if not isinstance(run_id, str) or not run_id:
        raise InvalidArgument(
            "slot",
            f"<context with keys {sorted(context)}>",
            "is a mapping with neither data_interval_start, logical_date nor run_id; pass the task context",
        )
    return validation.name("slot", f"{job}@run:{run_id}")


# -- the timetable -------------------------------------------------------------------------------------


class CappedCatchupTimetable(Timetable):
    """Runs on a cron expression or fixed interval; after downtime, runs only the newest missed slots.

    With the DAG's ``catchup=True``, the newest ``max_backfill`` slots that came due while nothing ran
    become runs (oldest first), older ones are skipped and ``catchup_window`` drops any older than that
    duration. With ``catchup=False`` it is Airflow's latest-only schedule (the window still applies).
    An explicit backfill is never clipped.

    :param schedule: a cron expression (or preset such as ``@hourly``), or a ``datetime.timedelta`` for
        fixed intervals that cron cannot express ("every 45 minutes").
    :param max_backfill: how many of the newest due slots run after downtime, counting the newest one.
        1 (the default) is for freshness-only jobs; irreversible jobs use more together with an
        idempotency key per slot (:func:`slot_idempotency_key`). 0 runs none of them: if a newer slot came
        due while a slot waited, both are skipped and the schedule resumes with the next slot.
    :param catchup_window: slots whose time is older than this never run, whatever ``max_backfill`` says.
    :param timezone: the timezone a cron expression is read in (IANA name or pendulum timezone).
    :param data_interval: True (default) for data-interval runs: a run for the slot at ``T`` covers
        ``[previous slot, T]`` and starts at ``T``, like ``CronDataIntervalTimetable``. False for trigger
        runs, Airflow 3's default for cron strings: a run at ``T`` has logical date ``T`` and an empty
        interval, like ``CronTriggerTimetable``.
    :param parallel_catchup: False (default): with ``max_backfill > 1`` the DAG runs one run at a time
        (``active_runs_limit = 1``; the DAG must say ``max_active_runs=1``, Airflow refuses more at parse
        time), so kept catch-up slots run back to back instead of together, where a leased task would
        skip all but one. True: no limit from the timetable, kept runs may run together.
    :param coalesce: False (default): the slots the cap drops are skipped (recorded ``skipped_catchup``).
        True: they are folded into the oldest kept run, whose data interval then starts where the last
        run's ended (recorded ``coalesced``); the other kept runs are normal slots. Needs
        ``data_interval=True`` (a trigger-style run has no interval to widen) and no ``catchup_window``
        (which drops a range that coalescing would keep); applies with ``catchup=True`` only.
    :raises InvalidArgument: a ``ValueError`` naming the bad parameter, raised when the DAG is parsed.
    """

    def __init__(
        self,
        schedule: str | datetime.timedelta,
        *,
        max_backfill: int = 1,
        catchup_window: datetime.timedelta | None = None,
        timezone: str | Timezone | FixedTimezone = "UTC",
        data_interval: bool = True,
        parallel_catchup: bool = False,
        coalesce: bool = False,
    ) -> None:
        self._timezone = _timezone_arg(timezone)
        parsed = _schedule_arg(schedule, self._timezone)
        self._cron: CronGrid | None = parsed if isinstance(parsed, CronGrid) else None
        self._delta: datetime.timedelta | None = parsed if isinstance(parsed, datetime.timedelta) else None
        self._max_backfill = _max_backfill_arg(max_backfill)
        self._catchup_window = _catchup_window_arg(catchup_window)
        if not isinstance(data_interval, bool):
            raise InvalidArgument("data_interval", data_interval, "must be True or False")
        self._data_interval = data_interval
        if not isinstance(parallel_catchup, bool):
            raise InvalidArgument("parallel_catchup", parallel_catchup, "must be True or False")
        self._parallel_catchup = parallel_catchup
        if not isinstance(coalesce, bool):
            raise InvalidArgument("coalesce", coalesce, "must be True or False")
        if coalesce and not data_interval:
            raise InvalidArgument(
                "coalesce",
                coalesce,
                "needs data_interval=True: a trigger-style run (data_interval=False) has an empty data "
                "interval, so there is no range to fold the missed slots into",
            )
        if coalesce and self._catchup_window is not None:
            raise InvalidArgument(
                "coalesce",
                coalesce,
                f"cannot be combined with catchup_window={self._catchup_window!r}: the window drops the "
                "missed range that coalesce=True folds into the oldest kept run; use one or the other",
            )
        self._coalesce = coalesce
        #: Airflow's hook (``Timetable.active_runs_limit``, checked against the DAG's ``max_active_runs``
        #: when the DAG is built): kept catch-up slots run one at a time unless told otherwise.
        self.active_runs_limit: int | None = 1 if self._max_backfill > 1 and not parallel_catchup else None
        self.description = self._describe()

    # -- parameters -----------------------------------------------------------------------------------

    @property
    def schedule(self) -> str | datetime.timedelta:
        """The cron expression (presets expanded) or the fixed interval."""
        if self._cron is not None:
            return self._cron.expression
        assert self._delta is not None
        return self._delta

    @property
    def max_backfill(self) -> int:
        return self._max_backfill

    @property
    def catchup_window(self) -> datetime.timedelta | None:
        return self._catchup_window

    @property
    def timezone(self) -> Timezone | FixedTimezone:
        return self._timezone

    @property
    def data_interval(self) -> bool:
        return self._data_interval

    @property
    def parallel_catchup(self) -> bool:
        return self._parallel_catchup

    @property
    def coalesce(self) -> bool:
        return self._coalesce

    # -- serialization: a compatibility contract (add keys, never rename) ------------------------------

    def serialize(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "max_backfill": self._max_backfill,
            "catchup_window": None if self._catchup_window is None else self._catchup_window.total_seconds(),
            "timezone": _encode_timezone(self._timezone),
            "data_interval": self._data_interval,
            "parallel_catchup": self._parallel_catchup,
        }
        if self._cron is not None:
            data["cron"] = self._cron.expression
        else:
            assert self._delta is not None
            data["delta"] = self._delta.total_seconds()
        if self._coalesce:
            # Only when set: the forms stored for every other DAG stay byte for byte what they were (no
            # re-serialization on upgrade); a form without the key is coalesce=False.
            data["coalesce"] = True
        return data

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> CappedCatchupTimetable:
        schedule: str | datetime.timedelta
        schedule = data["cron"] if "cron" in data else datetime.timedelta(seconds=data["delta"])
        window = data.get("catchup_window")
        return cls(
            schedule,
            max_backfill=data.get("max_backfill", 1),
            catchup_window=None if window is None else datetime.timedelta(seconds=window),
            timezone=data.get("timezone", "UTC"),
            data_interval=data.get("data_interval", True),
            parallel_catchup=data.get("parallel_catchup", False),
            coalesce=data.get("coalesce", False),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CappedCatchupTimetable):
            return NotImplemented
        return self.serialize() == other.serialize()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.serialize().items())))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.schedule!r}, max_backfill={self._max_backfill}, "
            f"catchup_window={self._catchup_window!r}, timezone={_encode_timezone(self._timezone)!r}, "
            f"data_interval={self._data_interval}, parallel_catchup={self._parallel_catchup}"
            + (", coalesce=True)" if self._coalesce else ")")
        )

    # -- UI ---------------------------------------------------------------------------------------------

    @property
    def summary(self) -> str:
        schedule = self._cron.expression if self._cron is not None else f"every {self._delta}"
        cap = f"catch-up: newest {self._max_backfill}"
        if self._catchup_window is not None:
            cap += f", window {self._catchup_window}"
        if self._coalesce:
            cap += ", rest coalesced"
        return f"{schedule} ({cap})"

    def _describe(self) -> str:
        if self._cron is not None:
            base = self._cron.description or self._cron.expression
        else:
            base = f"Every {self._delta}"
        if self._max_backfill == 0:
            cap = "after downtime no missed run is made up"
        elif self._max_backfill == 1:
            cap = "after downtime only the newest missed run is made up"
        else:
            cap = f"after downtime at most the newest {self._max_backfill} missed runs are made up"
        if self._catchup_window is not None:
            cap += f", none older than {self._catchup_window}"
        if self._coalesce:
            cap += "; the older ones are coalesced into the oldest kept run's data interval"
        if self.active_runs_limit == 1:
            cap += ", one at a time"
        return f"{base}; {cap} (with catchup=True)"

    # -- scheduling -------------------------------------------------------------------------------------

    def _now(self) -> DateTime:
        return to_utc(_utcnow())

    def _grid(self, anchor: datetime.datetime | None) -> Grid:
        """The slot grid; a fixed interval is laid through ``anchor`` (the last run), or the epoch."""
        if self._cron is not None:
            return self._cron
        assert self._delta is not None
        return DeltaGrid(self._delta, anchor)

    def _first_slot_from(self, grid: Grid, earliest: DateTime) -> DateTime:
        """The first slot whose run starts no earlier than ``earliest`` (the DAG's start_date)."""
        first = grid.at_or_after(earliest)
        # A data-interval run is due when its interval ends, so the first one fires a slot later.
        return grid.after(first) if self._data_interval else first

    def _info(self, grid: Grid, slot: DateTime) -> DagRunInfo:
        if self._data_interval:
            return DagRunInfo.interval(start=grid.before(slot), end=slot)
        return DagRunInfo.exact(slot)

    def _slot_interval(self, grid: Grid, slot: DateTime) -> DataInterval:
        info = self._info(grid, slot)
        assert info.data_interval is not None
        return info.data_interval

    def _apply_cap(
        self, grid: Grid, resume: DateTime | None, now: DateTime, cap: int, newest: DateTime | None = None
    ) -> DateTime:
        """The slot to run next, given the slot the schedule would resume at and how many may catch up.

        ``newest`` is the newest slot allowed at all (the DAG's ``end_date``), when known.

        The work is O(min(cap, missed slots)) croniter steps however long the outage was: the newest
        slots are found by stepping back from now, and not at all when counting is cheaper (the calls
        that follow the first one of a catch-up, whose gap is at most ``cap`` slots).
        """
        newest_due = grid.at_or_before(now)
        if newest is not None and newest < newest_due:
            newest_due = newest
        if resume is not None and resume > newest_due:
            return resume  # nothing is due yet: no outage to cap
        start = newest_due if resume is None else resume
        if cap == 0:
            # The slot the schedule waited for still runs when merely late; once a newer slot has come
            # due it was missed, and with it every other due slot.
            slot = start if start == newest_due else grid.after(newest_due)
        elif start == newest_due or self._due_fit_in(grid, start, newest_due, cap):
            slot = start
        else:
            # The oldest of the newest ``cap`` due slots, ``cap - 1`` back, counted by the grid's arithmetic.
            slot = max(start, grid.back_from(newest_due, cap - 1, stop=start))
        if self._catchup_window is not None:
            slot = max(slot, grid.at_or_after(now - self._catchup_window))
        if newest is not None and slot > newest:
            # Every slot up to the end_date is older than the window: the newest of them, never one past it.
            slot = newest
        return slot

    @staticmethod
    def _due_fit_in(grid: Grid, start: DateTime, newest_due: DateTime, cap: int) -> bool:
        """Whether the due slots ``start`` .. ``newest_due`` are at most ``cap``, when counting is cheap."""
        if grid.count_cost(start, newest_due, limit=cap) >= cap:
            return False  # unknown; stepping back (at most cap - 1 steps) will tell
        return grid.count_between(start, newest_due) + 2 <= cap

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
    ) -> DagRunInfo | None:
        last_end = to_utc(last_automated_data_interval.end) if last_automated_data_interval else None
        earliest = to_utc(restriction.earliest) if restriction.earliest is not None else None
        latest = to_utc(restriction.latest) if restriction.latest is not None else None
        grid = self._grid(anchor=last_end or earliest)

        # Where the schedule resumes: the slot after the last automated run, or the first from start_date.
        # The last run is only a lower bound: after an outage the cap below moves past it, which is what
        # keeps the slot right after a pre-outage run from slipping in.
        candidates = []
        if last_end is not None:
            candidates.append(grid.after(last_end))
        if earliest is not None:
            candidates.append(self._first_slot_from(grid, earliest))
        resume = max(candidates) if candidates else None

        capped = not (restriction.catchup and latest is not None)
        if not capped:
            # An explicit backfill (or a DAG with an end_date; Airflow passes both the same way): every
            # slot in the range, never clipped.
            slot = resume if resume is not None else grid.at_or_before(self._now())
        else:
            cap = self._max_backfill if restriction.catchup else 1
            slot = self._apply_cap(grid, resume, self._now(), cap)

        info = self._info(grid, slot)
        if self._data_interval and last_automated_data_interval is not None:
            # A schedule change (to a coarser cron) can land the new interval's start on the last run's:
            # step once more rather than collide on the unique logical date, as Airflow's own timetables do.
            assert info.logical_date is not None
            if info.logical_date <= to_utc(last_automated_data_interval.start):
                info = self._info(grid, grid.after(slot))
        if capped and restriction.catchup and resume is not None:
            info = self._coalesced(grid, info, resume, last_end)
        if latest is not None and info.logical_date is not None and info.logical_date > latest:
            return None
        return info

    def _coalesced(
        self, grid: Grid, info: DagRunInfo, resume: DateTime, last_end: DateTime | None
    ) -> DagRunInfo:
        """``info`` widened back to where the schedule resumes, if the cap moved it past missed slots.

        The start is the last run's interval end (the slot after it is where the schedule resumed), or
        for a DAG's first run the start of its first slot's interval (from ``start_date``).
        """
        if not self._coalesce or info.data_interval is None or info.data_interval.end <= resume:
            return info
        start = last_end if last_end is not None and grid.after(last_end) == resume else grid.before(resume)
        return DagRunInfo.interval(start=start, end=info.data_interval.end)

    def next_run_info_from_dag_model(self, *, dag_model: DagModel) -> DagRunInfo | None:
        """The run the scheduler is about to create from ``DagModel``, with the cap re-applied.

        The scheduler stores the next run when it creates the previous one. After an outage it creates
        that stored run without asking :meth:`next_dagrun_info` again, so the oldest missed slot would
        slip in before the capped ones. Here the stored run is moved forward to the oldest slot the cap
        allows now. It is never moved back, and explicit backfills do not pass through here.
        """
        info = super().next_run_info_from_dag_model(dag_model=dag_model)
        if info is None or info.data_interval is None:
            return info
        stored = to_utc(info.data_interval.end)
        grid = self._grid(anchor=stored)
        now = self._now()
        # With one slot kept the stored run stays only if it is the newest due slot (or not due yet); that
        # holds for every cap and both catchup flags, and then nothing is read.
        if self._apply_cap(grid, stored, now, 1) == stored:
            return info
        # Moving the run forward: the scheduler has checked only the stored run for an existing run and
        # hands us neither the DAG's catchup flag nor its end_date, so read them where it reads them (its
        # session; nothing when detached). catchup=False keeps only the newest slot, as next_dagrun_info
        # does: keeping max_backfill here would let one older run in before the schedule jumps to the newest.
        restriction = _scheduler.dag_time_restriction(dag_model)
        cap = self._max_backfill if restriction is None or restriction.catchup else 1
        latest = restriction.latest if restriction is not None else None
        newest = None
        if latest is not None:
            # The newest slot the end_date allows (Airflow's rule: its logical date is not after it).
            start = grid.at_or_before(to_utc(latest))
            newest = grid.after(start) if self._data_interval else start
        slot = max(stored, self._apply_cap(grid, stored, now, cap, newest=newest))
        if slot == stored:
            return info
        if self._coalesce and (restriction is None or restriction.catchup):
            # The stored run keeps its start (and logical date, which the scheduler has checked is free)
            # and is widened to the kept slot: the missed range is folded into it, not dropped.
            log.warning(
                "capped catch-up: the stored next run (slot %s) is older than the newest %d slots; "
                "scheduling slot %s with the missed range coalesced into it, from %s",
                stored.isoformat(),
                cap,
                slot.isoformat(),
                to_utc(info.data_interval.start).isoformat(),
            )
            return DagRunInfo.interval(start=to_utc(info.data_interval.start), end=slot)
        moved = self._info(grid, slot)
        assert moved.logical_date is not None
        taken = _scheduler.taken_logical_dates(dag_model, moved.logical_date)
        while taken and moved.logical_date in taken:
            # A run (manual with a logical date, a backfill) already has this slot: the next one, as the
            # scheduler itself moves past an existing stored run.
            slot = grid.after(slot)
            moved = self._info(grid, slot)
            assert moved.logical_date is not None
        log.warning(
            "capped catch-up: the stored next run (slot %s) is older than the newest %d slots; "
            "scheduling slot %s instead",
            stored.isoformat(),
            cap,
            slot.isoformat(),
        )
        return moved

    def infer_manual_data_interval(self, *, run_after: DateTime) -> DataInterval:
        run_after = to_utc(run_after)
        if not self._data_interval:
            return DataInterval.exact(run_after)
        if self._delta is not None:
            return DataInterval(start=to_utc(run_after - self._delta), end=run_after)
        # The last complete interval before the trigger, as CronDataIntervalTimetable does.
        grid = self._grid(anchor=None)
        end = grid.at_or_before(run_after)
        return DataInterval(start=grid.before(end), end=end)

    # -- skipped slots ------------------------------------------------------------------------------------

    def _slot_of(self, run: DataInterval | datetime.datetime) -> DateTime:
        """The slot (run time) of a run given by its data interval or its logical date."""
        if isinstance(run, DataInterval):
            return to_utc(run.end)
        logical = to_utc(run)
        return self._grid(anchor=logical).after(logical) if self._data_interval else logical

    def skipped_slots(
        self,
        run: DataInterval | datetime.datetime,
        previous: DataInterval | datetime.datetime | None,
        *,
        earliest: datetime.datetime | None = None,
    ) -> SkippedSlots | None:
        """Which slots between the previous automated run and ``run`` never ran; None when there are none.

        Pure and fast: the count is computed, not enumerated (a year of per-minute slots takes
        milliseconds). Runs are given by data interval or logical date.

        :param run: the run being executed.
        :param previous: the automated run before it, or None for the DAG's first run.
        :param earliest: the DAG's start_date; with no previous run, slots from there on count as skipped.
        """
        slot = self._slot_of(run)
        if previous is not None:
            previous_slot = self._slot_of(previous)
            grid = self._grid(anchor=previous_slot)
            first = grid.after(previous_slot)
            if first >= slot:
                return None
            count = grid.count_between(previous_slot, slot)
        elif earliest is not None:
            start = to_utc(earliest)
            grid = self._grid(anchor=start)
            first = self._first_slot_from(grid, start)
            if first >= slot:
                return None
            count = 1 + grid.count_between(first, slot)
        else:
            return None
        return SkippedSlots(
            count, self._slot_interval(grid, first), self._slot_interval(grid, grid.before(slot))
        )


    def coalesced_slots(self, run: DataInterval) -> SkippedSlots | None:
        """Which slots a coalesced run (``coalesce=True``) folded into its data interval; None for none.

        The slots strictly inside the run's interval, each given as the interval its own run would have
        had (a one-slot interval folds none). Pure, and counted, not enumerated, as :meth:`skipped_slots`.
        """
        if not self._data_interval:
            return None
        start, end = to_utc(run.start), to_utc(run.end)
        grid = self._grid(anchor=end)
        first = grid.after(start)
        if first >= end:
            return None
        return SkippedSlots(
            grid.count_between(start, end), self._slot_interval(grid, first), self._slot_interval(grid, grid.before(end))
        )


def skipped_slots(
    timetable: CappedCatchupTimetable,
    run: DataInterval | datetime.datetime,
    previous: DataInterval | datetime.datetime | None,
    *,
    earliest: datetime.datetime | None = None,
) -> SkippedSlots | None:
    """Function form of :meth:`CappedCatchupTimetable.skipped_slots`."""
    return timetable.skipped_slots(run, previous, earliest=earliest)
