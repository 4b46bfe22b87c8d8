"""The renewal keeper: a background thread that keeps a lease alive while work runs.

It renews every ``renew_every`` (default TTL/3, so two missed renewals still leave time), rides out
transient connection errors until the lease would expire, and marks the lease **lost** when a renewal is
refused or the time runs out. It never re-acquires on its own: a lost lease means someone else may hold
it now, and only the holder's code can decide what to do about the work in flight.

Time left is measured with the local *monotonic* clock from the database's own figure of the time
remaining, so neither a worker's wall clock nor its skew plays any part.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import LeaseError, LeaseLost, LeaseStoreUnavailable
from airflow_lease_provider.core.events import EventKind

if TYPE_CHECKING:
    from airflow_lease_provider.core.lease import Lease, LeaseStore

log = logging.getLogger(__name__)

#: The default renewal interval as a fraction of the TTL.
DEFAULT_RENEW_FRACTION = 1 / 3


class LeaseKeeper:
    """Renews a lease in a background thread until stopped or lost.

    :param store: the store the lease came from.
    :param lease: the lease just acquired.
    :param renew_every: interval between renewals (default TTL/3); must be shorter than the TTL.
    :param safety_margin: the lease is declared lost this long before it would expire without a
        renewal, so the holder stops before anybody else can get in (default: TTL/10, at most 5 s).
    :param on_lost: called once, from the keeper thread, with the :class:`LeaseLost` error.
    """

    def __init__(
        self,
        store: LeaseStore,
        lease: Lease,
        *,
        renew_every: timedelta | None = None,
        safety_margin: timedelta | None = None,
        on_lost: Callable[[LeaseLost], None] | None = None,
    ) -> None:
        self.store = store
        self.renew_every = validation.renew_every(
            lease.ttl * DEFAULT_RENEW_FRACTION if renew_every is None else renew_every, lease.ttl
        )
        from airflow_lease_provider.core.lease import checked

        checked(lease)
        margin = min(lease.ttl / 10, timedelta(seconds=5)) if safety_margin is None else safety_margin
        if not isinstance(margin, timedelta) or margin < timedelta(0) or margin >= lease.ttl:
            raise validation.InvalidArgument("safety_margin", safety_margin, "must be >= 0 and shorter than the TTL")
        self.safety_margin = margin
        self.on_lost = on_lost
        self.renewals = 0
        self.late_renewals = 0
        self._lease = lease
        self._state = threading.Lock()
        self._lost: LeaseLost | None = None
        self._lost_event = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost_recorder: threading.Thread | None = None
        self._deadline = self._deadline_for(lease)

    @staticmethod
    def _deadline_for(lease: Lease) -> float:
        # Monotonic instant when the lease expires, from the database's view of the time remaining.
        return time.monotonic() + lease.remaining.total_seconds()

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

    def check(self) -> Lease:
        """Raise :class:`LeaseLost` if the lease is gone; else return it. Call it before side effects."""
        lost = self._check_deadline()
        if lost is not None:
            raise lost
        return self.lease

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is lost (True) or ``timeout`` seconds pass (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._check_deadline() is not None:
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
        self._thread = threading.Thread(
            target=self._run, name=f"lease-keeper:{self._lease.key}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, *, release: bool = False) -> bool:
        """Stop renewing. With ``release=True``, also release the lease; returns whether that happened."""
        self._stop.set()
        bound = self.store.db.statement_timeout.total_seconds() + 5
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=bound)
        if self._lost_recorder is not None and self._lost_recorder is not threading.current_thread():
            # Let the ledger have the loss before the process goes on (or exits); bounded like a statement.
            self._lost_recorder.join(timeout=bound)
        if release and self._lost is None:
            return self.store.release(self.lease)
        return False

    def __enter__(self) -> LeaseKeeper:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(release=True)

    # -- the thread --------------------------------------------------------------------------------

    def _check_deadline(self) -> LeaseLost | None:
        if self._lost is None and time.monotonic() >= self._deadline - self.safety_margin.total_seconds():
            self._mark_lost("no successful renewal before the lease would expire")
        return self._lost

    def _mark_lost(self, reason: str) -> None:
        with self._state:
            if self._lost is not None:
                return
            lease = self._lease
            self._lost = LeaseLost(lease.key, lease.token, reason)
        self._lost_event.set()
        self._stop.set()
        log.error("lease %r (token %s) lost: %s", lease.key, lease.token, reason)
        if self.store.record_events:
            # In a thread of its own: when the store hangs, the keeper thread may hold the store's
            # connection, and the holder's check() must raise LeaseLost now, not after the hang.
            self._lost_recorder = threading.Thread(
                target=self.store.events.record,
                args=(EventKind.LOST, lease.key),
                kwargs={"owner": lease.owner, "token": lease.token, "detail": {"reason": reason}},
                name=f"lease-lost-event:{lease.key}",
                daemon=True,
            )
            self._lost_recorder.start()
        if self.on_lost is not None:
            try:
                self.on_lost(self._lost)
            except Exception:  # a callback bug must not hide the loss itself, which is already recorded
                log.exception("on_lost callback for lease %r failed", lease.key)

    def _run(self) -> None:
        interval = self.renew_every.total_seconds()
        next_at = time.monotonic() + interval
        failures = 0
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            if self._check_deadline() is not None:
                return
            lease = self.lease
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
            # The database says how much time was left just before this renewal; less than one
            # interval's worth means at least one renewal slot was missed.
            left_before = (lease.expires_at - renewed.renewed_at).total_seconds()
            with self._state:
                self._lease = renewed
                self._deadline = self._deadline_for(renewed)
            self.renewals += 1
            if failures or left_before < renewed.ttl.total_seconds() - 1.5 * interval:
                self.late_renewals += 1
                if self.store.record_events:
                    self.store.events.record(
                        EventKind.RENEWED_LATE, lease.key, owner=lease.owner, token=lease.token,
                        detail={"seconds_left": round(left_before, 3), "failed_attempts": failures},
                    )
            failures = 0
            next_at = time.monotonic() + interval
