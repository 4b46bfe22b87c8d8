"""Leases: locks with a TTL and a fencing token, on PostgreSQL.

Each operation is one statement and one round trip, and every expiry decision is made by the
database clock, so a worker whose clock is off changes nothing.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import InvalidArgument
from airflow_lease_provider.core.events import EventKind
from airflow_lease_provider.core.keeper import LeaseKeeper
from airflow_lease_provider.core.store import Store
from airflow_lease_provider.core.types import Acquisition, Lease, checked, lease_from_row

__all__ = ["Acquisition", "Lease", "LeaseStore", "checked", "positive_limit"]

log = logging.getLogger(__name__)


def positive_limit(value: object, parameter: str = "limit", maximum: int = 100_000) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise InvalidArgument(parameter, value, f"must be an integer from 1 to {maximum}")
    return value


class LeaseStore(Store):
    """Leases on PostgreSQL. Creates or migrates its schema on first use.

    Takes :class:`~airflow_lease_provider.core.store.Store`'s arguments: ``dsn``, and optionally
    ``schema`` (default ``airflow_lease``), ``connect_timeout``, ``statement_timeout``,
    ``record_events`` (acquired/released/force-released events) and ``event_retention``.
    """

    # -- the lease operations ----------------------------------------------------------------------

    def try_acquire(self, key: str, owner: str, ttl: timedelta) -> Acquisition:
        """Take the lease if it is free, expired, or already this owner's (which bumps the token).

        :returns: the new lease, or the current holder when someone else holds it.
        """
        validation.name("key", key)
        validation.name("owner", owner)
        validation.ttl("ttl", ttl)
        # Retrying after a lost connection is safe: if the first attempt did commit, the retry is the
        # same owner re-entering, which only burns the unseen token.
        db = self._ready()
        sent_at = time.monotonic()  # before the request: the keeper counts the time left from here
        rows = db.run("acquire", {"key": key, "owner": owner, "ttl": ttl}, durable=True)
        if not rows:
            # The row appeared between our snapshot and our insert: someone else just created it.
            return Acquisition(None, self.holder(key))
        acquired, *state = rows[0]
        lease = lease_from_row(tuple(state), sent_at)
        if acquired:
            if self.record_events:
                self.events.record(
                    EventKind.ACQUIRED, key, owner=owner, token=lease.token,
                    detail={"ttl_seconds": ttl.total_seconds(), "expires_at": lease.expires_at.isoformat()},
                )
            return Acquisition(lease, None)
        if not lease.held:
            # We lost a race to a holder our snapshot could not see yet: read who it is.
            return Acquisition(None, self.holder(key))
        return Acquisition(None, lease)

    def acquire(self, key: str, owner: str, ttl: timedelta) -> Lease | None:
        """The lease, or ``None`` when someone else holds it (:meth:`try_acquire` says who)."""
        return self.try_acquire(key, owner, ttl).lease

    def holder(self, key: str) -> Lease | None:
        """The current valid lease on ``key``, or ``None`` when it is free."""
        validation.name("key", key)
        db = self._ready()
        sent_at = time.monotonic()
        rows = db.run("holder", {"key": key})
        return lease_from_row(rows[0], sent_at) if rows else None

    def renew(self, lease: Lease, ttl: timedelta | None = None) -> Lease | None:
        """Extend the lease by ``ttl`` (default: its own TTL) from now, by the database clock.

        :returns: the extended lease, or ``None`` when it was lost (expired, released or taken). A lost
            lease is never brought back: the caller must stop and, if it wants, acquire anew.
        """
        checked(lease)
        ttl = validation.ttl("ttl", lease.ttl if ttl is None else ttl)
        db = self._ready()
        sent_at = time.monotonic()
        rows = db.run(
            "renew", {"key": lease.key, "owner": lease.owner, "token": lease.token, "ttl": ttl}, durable=True
        )
        return lease_from_row(rows[0], sent_at) if rows else None

    def release(self, lease: Lease) -> bool:
        """Free the lease. True only if owner and token still matched (so nobody else's lease is freed)."""
        checked(lease)
        rows = self._ready().run(
            "release", {"key": lease.key, "owner": lease.owner, "token": lease.token}, durable=True
        )
        if rows and self.record_events:
            released = lease_from_row(rows[0])
            self.events.record(
                EventKind.RELEASED, lease.key, owner=lease.owner, token=lease.token,
                detail={
                    "held_seconds": (released.observed_at - lease.acquired_at).total_seconds(),
                    "released_at": released.observed_at.isoformat(),
                },
            )
        return bool(rows)

    def force_release(self, key: str, *, by: str = "admin", reason: str = "") -> Lease | None:
        """Admin action: free ``key`` whoever holds it, and bump its token so the old holder is fenced out.

        :param by: who did it, for the ledger.
        :returns: the lease as it was just before (whether or not it was still valid), or ``None`` when
            the key was never acquired.
        """
        validation.name("key", key)
        validation.name("by", by)
        if not isinstance(reason, str) or "\x00" in reason or len(reason) > validation.MAX_NAME_LENGTH:
            raise InvalidArgument(
                "reason", reason, f"must be a string of at most {validation.MAX_NAME_LENGTH} characters without NUL"
            )
        rows = self._ready().run("force_release", {"key": key}, durable=True)
        if not rows:
            return None
        previous = lease_from_row(rows[0][:9])
        new_token = int(rows[0][9])
        if self.record_events:
            self.events.record(
                EventKind.FORCE_RELEASED, key, owner=previous.owner, token=previous.token,
                detail={"by": by, "reason": reason, "was_held": previous.held, "new_token": new_token},
            )
        log.warning("lease %r force-released by %s (was %s)", key, by, previous.describe())
        return previous

    def leases(self, limit: int = 1000) -> list[Lease]:
        """Every key the store knows, held or not (see :attr:`Lease.held`)."""
        positive_limit(limit)
        db = self._ready()
        sent_at = time.monotonic()
        return [lease_from_row(row, sent_at) for row in db.run("list_leases", {"limit": limit})]

    def keep(
        self,
        lease: Lease,
        *,
        renew_every: timedelta | None = None,
        on_lost: Any = None,
    ) -> LeaseKeeper:
        """A started :class:`LeaseKeeper` renewing ``lease`` every ``renew_every`` (default TTL/3).

        The keeper counts the time left from when ``lease`` was read (:attr:`Lease.sent_at`), not from
        this call: a lease kept after a pause longer than its time left is reported lost at once.
        """
        keeper = LeaseKeeper(self, lease, renew_every=renew_every, on_lost=on_lost)
        keeper.start()
        return keeper
