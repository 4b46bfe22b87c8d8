"""The renewal keeper: a background thread that keeps a lease alive while work runs.

It renews every ``renew_every`` (default TTL/3, so two missed renewals still leave time), rides out
transient connection errors until the lease would expire, and marks the lease **lost** when a renewal is
refused or the time runs out. It never re-acquires on its own: a lost lease means someone else may hold
it now, and only the holder's code can decide what to do about the work in flight.

The deadline. Each lease state carries the database's figure of the time it had left
(``expires_at - observed_at``, both database times) and :attr:`Lease.sent_at`, this process's monotonic
clock just *before* the request that produced the figure was sent. The local deadline is
``sent_at + time left``: never later than the real expiry, whatever the request, a lock wait or a slow
reply cost (a slow reply only makes the deadline early, never late), and independent of the worker's wall
clock. The lease is lost at ``deadline - safety_margin``: a keeper built for a lease already past that
point (a pause between acquire and ``keep()``, a join with little time left) is lost at once, before the
body runs, and a thread of its own wakes up at that point whatever the renewals are doing.

A lease without ``sent_at`` (rebuilt from XCom or a dict) has no local timing; the keeper renews it once,
synchronously, when it is built, and counts from that renewal. A refused renewal means the lease is lost at
once; an unreachable store means its time left cannot be known, and it is lost at once too (fail closed).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import LeaseError, LeaseLost, LeaseStoreUnavailable
from airflow_lease_provider.core.events import EventKind
from airflow_lease_provider.core.identity import RunRef
from airflow_lease_provider.core.types import Lease, checked

log = logging.getLogger(__name__)

#: The default renewal interval as a fraction of the TTL.
DEFAULT_RENEW_FRACTION = 1 / 3


def _timed(lease: Lease, sent_at: float) -> Lease:
    """``lease`` with local timing: a store that did not measure it gets the time before the call."""
    return lease if lease.sent_at is not None else dataclasses.replace(lease, sent_at=sent_at)


class KeptStore(Protocol):
    """What the keeper uses of a store (:class:`~airflow_lease_provider.core.lease.LeaseStore`)."""

    db: Any
    events: Any
    record_events: bool

    def renew(self, lease: Lease, ttl: timedelta | None = None) -> Lease | None: ...

    def holder(self, key: str) -> Lease | None: ...

    def release(self, lease: Lease, *, run: RunRef | None = None) -> bool: ...


class LeaseKeeper:
    """Renews a lease in a background thread until stopped or lost.

    :param store: the store the lease came from.
    :param lease: the lease as last read from the store (acquired, renewed, or its holder read).
    :param renew_every: interval between renewals (default TTL/3); must be shorter than the TTL minus the
        safety margin (a renewal due later than that always comes too late).
    :param safety_margin: the lease is declared lost this long before it would expire without a
        renewal, so the holder stops before anybody else can get in (default: TTL/10, at most 5 s).
    :param on_lost: called once, from a keeper thread, with the :class:`LeaseLost` error.
    :param run: the run (task instance) holding the lease, for the ledger events the keeper writes
        (``lost``, ``renewed_late``); ``None`` leaves their run columns NULL.
    """

    def __init__(
        self,
        store: KeptStore,
        lease: Lease,
        *,
        renew_every: timedelta | None = None,
        safety_margin: timedelta | None = None,
        on_lost: Callable[[LeaseLost], None] | None = None,
        run: RunRef | None = None,
    ) -> None:
        self.store = store
        self.run = run
        checked(lease)
        self.safety_margin = validation.safety_margin(safety_margin, lease.ttl)
        self.renew_every = validation.renew_every(
            lease.ttl * DEFAULT_RENEW_FRACTION if renew_every is None else renew_every, lease.ttl,
            margin=self.safety_margin,
        )
        self.on_lost = on_lost
        self.renewals = 0
        self.late_renewals = 0
        self._lease = lease
        self._state = threading.Lock()
        self._lost: LeaseLost | None = None
        self._lost_event = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._lost_recorder: threading.Thread | None = None
        self._deadline = float("-inf")
        if lease.sent_at is None:
            self._refresh(lease)
        else:
            self._deadline = self._deadline_for(lease)
        # A lease already past its deadline (minus the margin) is lost now, before any work runs.
        self._check_deadline()

    def _measured_from(self, lease: Lease) -> float:
        """The monotonic instant the lease's time-left figure counts from: just before its request was sent."""
        assert lease.sent_at is not None
        return lease.sent_at

    def _deadline_for(self, lease: Lease) -> float:
        # Monotonic instant when the lease expires, from the database's own figure of the time left.
        return self._measured_from(lease) + lease.remaining.total_seconds()

    def _refresh(self, lease: Lease) -> None:
        """A lease with no local timing (from XCom, a dict): renew it now and count from that renewal."""
        sent_at = time.monotonic()
        try:
            renewed = self.store.renew(lease)
        except LeaseError as exc:
            self._mark_lost(f"its time left could not be confirmed (the lease came without local timing): {exc}")
            return
        if renewed is None:
            self._mark_lost("renewal refused: the lease expired or was taken before the keeper started")
            return
        renewed = _timed(renewed, sent_at)
        self.renewals += 1
        self._lease = renewed
        self._deadline = self._deadline_for(renewed)

    # -- what the holder uses --------------------------------------------------------------------

    @property
    def lease(self) -> Lease:
        """The lease as last renewed."""
        with self._state:
            return self._lease

    @property
    def lost(self) -> bool:
        return self._check_deadline() is not None

    @property
    def lost_reason(self) -> str | None:
        lost = self._check_deadline()
        return lost.reason if lost else None

    def time_left(self) -> timedelta:
        """How long until the keeper declares the lease lost unless a renewal succeeds (0 once lost)."""
        if self._check_deadline() is not None:
            return timedelta(0)
        left = self._deadline - self.safety_margin.total_seconds() - time.monotonic()
        return timedelta(seconds=max(left, 0.0))

    def check(self) -> Lease:
        """Raise :class:`LeaseLost` if the lease is gone; else return it. Call it before side effects."""
        lost = self._check_deadline()
        if lost is not None:
            raise lost
        return self.lease

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost (True) or ``timeout`` seconds pass (False).

        When it returns True, ``on_lost`` has been called (or the keeper gave up waiting for it, 5 s).
        """
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._check_deadline() is not None:
                self._lost_event.wait(5.0)
                return True
            now = time.monotonic()
            wake = self._deadline - self.safety_margin.total_seconds()
            if end is not None:
                if now >= end:
                    return False
                wake = min(wake, end)
            self._lost_event.wait(max(0.0, min(wake - now, 1.0)))

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> LeaseKeeper:
        if self._thread is not None:
            raise RuntimeError("keeper already started")
        key = self._lease.key
        self._thread = threading.Thread(target=self._run, name=f"lease-keeper:{key}", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name=f"lease-deadline:{key}", daemon=True)
        self._thread.start()
        self._watcher.start()
        return self

    def stop(self, *, release: bool = False) -> bool:
        """Stop renewing. With ``release=True``, also release the lease; returns whether that happened."""
        self._stop.set()
        bound = self.store.db.statement_timeout.total_seconds() + 5
        for thread in (self._thread, self._watcher, self._lost_recorder):
            # The loss reaches the ledger before the process goes on (or exits); bounded like a statement.
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=bound)
        if release and self._lost is None:
            return self.store.release(self.lease, run=self.run)
        return False

    def __enter__(self) -> LeaseKeeper:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(release=True)

    # -- the threads -------------------------------------------------------------------------------

    def _check_deadline(self) -> LeaseLost | None:
        if self._lost is None and time.monotonic() >= self._deadline - self.safety_margin.total_seconds():
            self._mark_lost("no successful renewal before the lease would expire", deadline=True)
        return self._lost

    def _mark_lost(self, reason: str, *, deadline: bool = False) -> None:
        with self._state:
            if self._lost is not None:
                return
            if deadline and time.monotonic() < self._deadline - self.safety_margin.total_seconds():
                return  # a renewal moved the deadline meanwhile
            lease = self._lease
            self._lost = LeaseLost(lease.key, lease.token, reason)
        self._stop.set()
        log.error("lease %r (token %s) lost: %s", lease.key, lease.token, reason)
        if self.store.record_events:
            # In a thread of its own: when the store hangs, the keeper thread may hold the store's
            # connection, and the holder's check() must raise LeaseLost now, not after the hang.
            self._lost_recorder = threading.Thread(
                target=self.store.events.record,
                args=(EventKind.LOST, lease.key),
                kwargs={"owner": lease.owner, "token": lease.token, "detail": {"reason": reason}, "run": self.run},
                name=f"lease-lost-event:{lease.key}",
                daemon=True,
            )
            self._lost_recorder.start()
        if self.on_lost is not None:
            try:
                self.on_lost(self._lost)
            except Exception:  # a callback bug must not hide the loss itself, which is already recorded
                log.exception("on_lost callback for lease %r failed", lease.key)
        self._lost_event.set()  # wait_lost() returns once on_lost has run, whichever thread declared the loss

    def _watch(self) -> None:
        """Wake up at the deadline itself (minus the margin), even while a renewal hangs in the store."""
        while True:
            wake = self._deadline - self.safety_margin.total_seconds() - time.monotonic()
            if self._stop.wait(max(0.0, wake)):
                return
            if self._check_deadline() is not None:
                return

    def _next_renewal(self) -> float:
        """When to renew next: ``renew_every`` after the last renewal was sent, but while time is left.

        When that would be at or past the point of loss (a lease joined with little time left, a renewal
        that came back late), renew halfway between now and that point instead.
        """
        due = self._measured_from(self.lease) + self.renew_every.total_seconds()
        stop_at = self._deadline - self.safety_margin.total_seconds()
        now = time.monotonic()
        if due >= stop_at:
            due = now + max(0.0, (stop_at - now) / 2)
        return due

    def _run(self) -> None:
        interval = self.renew_every.total_seconds()
        failures = 0
        next_at = self._next_renewal()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            if self._check_deadline() is not None:
                return
            lease = self.lease
            sent_at = time.monotonic()
            try:
                renewed = self.store.renew(lease)
            except LeaseStoreUnavailable as exc:
                failures += 1
                left = self._deadline - self.safety_margin.total_seconds() - time.monotonic()
                log.warning(
                    "lease %r: renewal failed (%s); %.1fs left to retry", lease.key, exc, max(left, 0.0)
                )
                if left <= 0:
                    self._mark_lost(f"store unreachable until the lease ran out: {exc}")
                    return
                # Retry soon, but not in a hot loop: a quarter of the interval or 1 s, whichever is less.
                next_at = time.monotonic() + min(interval / 4, 1.0, left)
                continue
            except LeaseError as exc:
                self._mark_lost(f"renewal failed: {exc}")
                return
            if renewed is None:
                holder = None
                try:
                    holder = self.store.holder(lease.key)
                except LeaseError:
                    pass
                who = holder.describe() if holder else "nobody holds it now"
                self._mark_lost(f"renewal refused: the lease expired or was taken ({who})")
                return
            renewed = _timed(renewed, sent_at)
            # The database says how much time was left just before this renewal; less than one
            # interval's worth means at least one renewal slot was missed.
            left_before = (lease.expires_at - renewed.renewed_at).total_seconds()
            with self._state:
                if self._lost is not None:
                    return  # declared lost while the renewal was in flight: a lost lease is never brought back
                self._lease = renewed
                self._deadline = self._deadline_for(renewed)
            self.renewals += 1
            if failures or left_before < renewed.ttl.total_seconds() - 1.5 * interval:
                self.late_renewals += 1
                if self.store.record_events:
                    self.store.events.record(
                        EventKind.RENEWED_LATE, lease.key, owner=lease.owner, token=lease.token,
                        detail={"seconds_left": round(left_before, 3), "failed_attempts": failures},
                        run=self.run,
                    )
            failures = 0
            next_at = self._next_renewal()
