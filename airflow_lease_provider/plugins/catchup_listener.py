"""The plugin's catch-up listener: the scheduler records what each run's capped catch-up skipped or coalesced.

**Where it runs.** Airflow calls ``on_dag_run_running`` (``airflow/listeners/spec/dagrun.py``) when a DAG run
goes from queued to running, in ``SchedulerJobRunner._start_queued_dagruns`` (the same on 3.1, 3.2 and
3.3): in the scheduler process (each HA scheduler for the runs it starts), for every run whoever created
it (the scheduler's own scheduled runs; a run triggered through the REST API or the UI is created queued by
the api-server and started here too), and again for a run that is cleared and starts again. Nothing else
calls it: the api-server calls only the success and failed hooks (a run marked by hand). So every DAG on
:class:`~airflow_lease_provider.timetables.CappedCatchupTimetable` gets its record, leased tasks or not,
while the timetable stays free of I/O.

**What it costs the scheduler.** On its loop, for a scheduled run of a DAG on the timetable only: the pure
catch-up computation (:func:`~airflow_lease_provider.timetables.catchup_of_run`) and, for a skip, one
indexed read of the run before it on the scheduler's own session (no flush); every other run, one
``isinstance``. The record is then handed to a writer thread (:class:`CatchUpWriter`), so the scheduler
never waits for the lease store, and nothing here raises into the scheduler (a listener that raised would
also keep Airflow from calling the other plugins' listeners of that run).

**Where the record goes.** The writer's store is the one every hook of this provider resolves
(``LeaseHook()``: ``[lease] conn_id``, ``lease_default``; the embedded store where no second host can
exist), made on the first record, connected only while it writes (``[lease] hold_connection`` aside).
Without any lease connection where one is required (a distributed executor), the scheduler still logs and
counts the catch-up, with no record, and says once why.

**When the store is unreachable.** The write is retried from the writer thread, 5 s after the failure and
doubling up to 5 min between tries, for an hour; then the record is given up with a warning that carries its
line (``catch-up: N older slots of <dag> skipped``), so the scheduler's log keeps it. A leased task of the run
records it too (its own second chance, once the store answers): the ledger keeps one record per run
(:meth:`~airflow_lease_provider.core.EventLedger.record_catchup`), so whichever writes first reports it and
nothing is counted twice. Records not yet written when the scheduler stops are lost to the ledger, as are
records beyond :attr:`CatchUpWriter.max_pending` (both logged).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import select

from airflow_lease_provider import version_compat
from airflow_lease_provider.timetables.catchup_record import CatchUp, catchup_of_run
from airflow_lease_provider.version_compat import hookimpl, scheduler_session

log = logging.getLogger(__name__)


def previous_run(dag_run: Any) -> Any:
    """The run before ``dag_run`` by logical date (None: none), as a task asks Airflow for it
    (``ti.get_previous_dagrun()``: any state, any type), read on the scheduler's session that holds the run.

    Only its logical date and data interval are read (no ORM object joins the scheduler's session), and
    ``no_autoflush`` keeps the read from flushing the scheduler's pending changes early.

    :raises LookupError: the run is not attached to a session (not one the scheduler is starting), so
        the run before it is unknown (not "none": that would count every slot since the start date).
    """
    session = scheduler_session(dag_run)
    if session is None:
        raise LookupError(f"run {dag_run.run_id!r} of {dag_run.dag_id!r} has no session to read the run before it")
    if dag_run.logical_date is None:
        return None
    model = version_compat.DagRun
    query = (
        select(model.logical_date, model.data_interval_start, model.data_interval_end)
        .where(model.dag_id == dag_run.dag_id, model.logical_date < dag_run.logical_date)
        .order_by(model.logical_date.desc())
        .limit(1)
    )
    with session.no_autoflush:
        return session.execute(query).first()


@hookimpl
def on_dag_run_running(dag_run: Any, msg: str) -> None:
    """A run starts: work out what its catch-up skipped or coalesced, and hand it to the writer thread."""
    try:
        catchup = catchup_of_run(getattr(dag_run, "dag", None), dag_run, lambda: previous_run(dag_run))
        if catchup is not None:
            WRITER.submit(catchup)
    except Exception:  # the scheduler's loop must go on whatever happens here
        log.warning(
            "catch-up: could not work out what run %s of %s skipped or coalesced",
            getattr(dag_run, "run_id", "?"), getattr(dag_run, "dag_id", "?"), exc_info=True,
        )


@dataclass(order=True)
class _Pending:
    due: float
    order: int
    catchup: CatchUp = field(compare=False)
    since: float = field(compare=False)
    delay: float = field(compare=False)
    tries: int = field(default=0, compare=False)


class CatchUpWriter:
    """Writes catch-up records on a thread of its own, retrying while the store is unreachable.

    :param write: writes one record: True when done (written, found written, or reported without a
        store), False to try again later. Default: :class:`LeaseStoreRecorder`.
    :param max_pending: records waiting at most; one more is dropped with a warning (never blocks).
    :param first_retry: the wait after the first failure, doubled after each until ``last_retry``.
    :param give_up: a record still failing this long after its first try is dropped with a warning.
    """

    def __init__(
        self,
        write: Callable[[CatchUp], bool] | None = None,
        *,
        max_pending: int = 1000,
        first_retry: timedelta = timedelta(seconds=5),
        last_retry: timedelta = timedelta(minutes=5),
        give_up: timedelta = timedelta(hours=1),
    ) -> None:
        self.write = write or LeaseStoreRecorder()
        self.max_pending = max_pending
        self.first_retry = first_retry.total_seconds()
        self.last_retry = last_retry.total_seconds()
        self.give_up = give_up.total_seconds()
        self._order = itertools.count()
        self._start()

    def _start(self) -> None:
        """Fresh state: at construction, and in a forked child (which inherits the parent's queue and
        maybe its locks held, but not its thread: the parent writes what it queued)."""
        self._pid = os.getpid()
        self._ready = threading.Condition()
        self._pending: list[_Pending] = []
        self._writing = 0
        self._stopped = False
        self._thread: threading.Thread | None = None

    def submit(self, catchup: CatchUp) -> bool:
        """Queue ``catchup`` to be written; never blocks on the store. False when the queue is full."""
        if os.getpid() != self._pid:
            self._start()
        with self._ready:
            if self._stopped:
                return False
            if len(self._pending) + self._writing >= self.max_pending:
                log.warning(
                    "catch-up: %s records wait for the lease store already; not recording run %s of %s: "
                    "catch-up: %s", self.max_pending, catchup.run_id, catchup.dag_id, catchup.message(catchup.dag_id),
                )
                return False
            now = time.monotonic()
            heapq.heappush(self._pending, _Pending(now, next(self._order), catchup, now, self.first_retry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease-catch-up-writer", daemon=True)
                self._thread.start()
            self._ready.notify_all()
        return True

    def idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or being written (at most ``timeout`` seconds); whether it is."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while self._pending or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._ready.wait(left)
        return True

    def stop(self, timeout: float = 30) -> None:
        """Stop the thread after the record it is writing (waiting at most ``timeout`` seconds for it); what
        is queued is not written. For tests, and a process that wants its writer gone."""
        with self._ready:
            self._stopped = True
            self._pending.clear()
            self._ready.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _next(self) -> _Pending | None:
        with self._ready:
            while not self._stopped and (not self._pending or self._pending[0].due > time.monotonic()):
                self._ready.wait(self._pending[0].due - time.monotonic() if self._pending else None)
            if self._stopped:
                return None
            self._writing += 1
            return heapq.heappop(self._pending)

    def _run(self) -> None:
        while (item := self._next()) is not None:
            item.tries += 1
            try:
                done = self.write(item.catchup)
            except Exception:  # a bug, not an outage: trying again would fail the same way
                log.exception("catch-up: could not record run %s of %s", item.catchup.run_id, item.catchup.dag_id)
                done = True
            with self._ready:
                self._writing -= 1
                if not done:
                    self._retry(item)
                self._ready.notify_all()

    def _retry(self, item: _Pending) -> None:
        now = time.monotonic()
        if now - item.since >= self.give_up:
            log.warning(
                "catch-up: gave up recording run %s of %s after %s tries (the lease store was not reachable "
                "for %s s); catch-up: %s", item.catchup.run_id, item.catchup.dag_id, item.tries,
                round(now - item.since), item.catchup.message(item.catchup.dag_id),
            )
            return
        item.due, item.order = now + item.delay, next(self._order)
        item.delay = min(item.delay * 2, self.last_retry)
        heapq.heappush(self._pending, item)


class LeaseStoreRecorder:
    """Writes a scheduler's catch-up record to the lease store every hook of this provider resolves."""

    def __init__(self) -> None:
        self._store: Any = None
        self._said_no_store = False

    def __call__(self, catchup: CatchUp) -> bool:
        # Imported on the writer thread at the first record: the plugin module is imported by every Airflow
        # process, and only a scheduler that starts a run after a gap needs the store, the hooks and psycopg2.
        from airflow_lease_provider.core import RunRef
        from airflow_lease_provider.hooks.lease import LeaseConnectionMissing, LeaseHook
        from airflow_lease_provider.runtime.catchup import record_catchup

        run = RunRef(catchup.dag_id, catchup.run_id)
        try:
            if self._store is None:
                self._store = LeaseHook().get_store()
        except LeaseConnectionMissing as exc:
            if not self._said_no_store:
                self._said_no_store = True
                log.warning("catch-up: catch-ups are logged and counted here but not recorded: %s", exc)
            record_catchup(catchup, ledger=None, run=run, logger=log)
            return True
        except Exception as exc:  # an unreadable connection, an embedded store that did not start: retried
            log.warning("catch-up: no lease store for the record of run %s of %s yet: %s",
                        catchup.run_id, catchup.dag_id, exc)
            return False
        return record_catchup(catchup, ledger=self._store.events, run=run, logger=log) is not None


#: This process's writer (the scheduler's): its thread starts with the first record.
WRITER = CatchUpWriter()
