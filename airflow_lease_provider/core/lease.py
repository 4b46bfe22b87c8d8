"""Leases: locks with a TTL and a fencing token, on PostgreSQL.

Each operation is one statement and one round trip, and every expiry decision is made by the
database clock, so a worker whose clock is off changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import InvalidArgument, LeaseError
from airflow_lease_provider.core.events import EventKind
from airflow_lease_provider.core.store import Store

if TYPE_CHECKING:
    from airflow_lease_provider.core.keeper import LeaseKeeper

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """A lease as the database saw it. All times are database times.

    :ivar observed_at: the database clock when this state was read; ``expires_at - observed_at`` is how
        long the lease had left, measured without the local clock.
    """

    key: str
    owner: str
    token: int
    ttl: timedelta
    acquired_at: datetime
    renewed_at: datetime
    expires_at: datetime
    released_at: datetime | None
    observed_at: datetime

    @property
    def remaining(self) -> timedelta:
        """Time left when this state was read (never negative)."""
        return max(self.expires_at - self.observed_at, timedelta(0))

    @property
    def held(self) -> bool:
        """Whether the lease was valid when this state was read."""
        return self.released_at is None and self.expires_at > self.observed_at

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form, for XCom and the CLI."""
        return {
            "key": self.key,
            "owner": self.owner,
            "token": self.token,
            "ttl_seconds": self.ttl.total_seconds(),
            "acquired_at": self.acquired_at.isoformat(),
            "renewed_at": self.renewed_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "released_at": self.released_at.isoformat() if self.released_at else None,
            "observed_at": self.observed_at.isoformat(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lease:
        def when(name: str) -> datetime:
            return datetime.fromisoformat(data[name])

        return cls(
            key=data["key"],
            owner=data["owner"],
            token=int(data["token"]),
            ttl=timedelta(seconds=float(data["ttl_seconds"])),
            acquired_at=when("acquired_at"),
            renewed_at=when("renewed_at"),
            expires_at=when("expires_at"),
            released_at=when("released_at") if data.get("released_at") else None,
            observed_at=when("observed_at"),
        )

    def describe(self) -> str:
        """One line for logs and skip reasons: who holds it, with which token, until when."""
        seconds = int(self.remaining.total_seconds())
        return (
            f"held by {self.owner!r} with token {self.token} until {self.expires_at.isoformat()} "
            f"(expires in {seconds // 60}m{seconds % 60:02d}s)"
        )


def _lease(row: tuple[Any, ...]) -> Lease:
    return Lease(
        key=row[0],
        owner=row[1],
        token=int(row[2]),
        ttl=row[3],
        acquired_at=row[4],
        renewed_at=row[5],
        expires_at=row[6],
        released_at=row[7],
        observed_at=row[8],
    )


def checked(lease: object, parameter: str = "lease") -> Lease:
    """A :class:`Lease` whose identifying fields are valid (renew and release trust nothing else)."""
    if not isinstance(lease, Lease):
        raise InvalidArgument(parameter, lease, f"must be a Lease, not {type(lease).__name__}")
    validation.name("key", lease.key)
    validation.name("owner", lease.owner)
    validation.token("token", lease.token)
    return lease


def positive_limit(value: object, parameter: str = "limit", maximum: int = 100_000) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise InvalidArgument(parameter, value, f"must be an integer from 1 to {maximum}")
    return value


@dataclass(frozen=True)
class Acquisition:
    """The outcome of :meth:`LeaseStore.try_acquire`: the new lease, or who holds it now."""

    lease: Lease | None
    holder: Lease | None

    @property
    def acquired(self) -> bool:
        return self.lease is not None


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
        rows = self._ready().run("acquire", {"key": key, "owner": owner, "ttl": ttl}, durable=True)
        if not rows:
            # The row appeared between our snapshot and our insert: someone else just created it.
            return Acquisition(None, self.holder(key))
        acquired, *state = rows[0]
        lease = _lease(tuple(state))
        if acquired:
            if self.record_events:
                self.events.record(
                    EventKind.ACQUIRED, key, owner=owner, token=lease.token,
                    detail={
                        "ttl_seconds": ttl.total_seconds(),
                        "expires_at": lease.expires_at.isoformat(),
                        "host": self.host,
                    },
                )
            return Acquisition(lease, None)
        if not lease.held:
            # We lost a race to a holder our snapshot could not see yet: read who it is.
            return Acquisition(None, self.holder(key))
        return Acquisition(None, lease)

    def holder_host(self, lease: Lease) -> str | None:
        """The host that acquired ``lease`` (from its ``acquired`` event), or None if unrecorded."""
        try:
            events = self.events.query(key=lease.key, kind=EventKind.ACQUIRED, limit=20)
        except LeaseError:
            return None
        for event in events:
            if event.owner == lease.owner and event.token == lease.token:
                host = event.detail.get("host")
                return str(host) if host else None
        return None

    def acquire(self, key: str, owner: str, ttl: timedelta) -> Lease | None:
        """The lease, or ``None`` when someone else holds it (:meth:`try_acquire` says who)."""
        return self.try_acquire(key, owner, ttl).lease

    def holder(self, key: str) -> Lease | None:
        """The current valid lease on ``key``, or ``None`` when it is free."""
        validation.name("key", key)
        rows = self._ready().run("holder", {"key": key})
        return _lease(rows[0]) if rows else None

    def renew(self, lease: Lease, ttl: timedelta | None = None) -> Lease | None:
        """Extend the lease by ``ttl`` (default: its own TTL) from now, by the database clock.

        :returns: the extended lease, or ``None`` when it was lost (expired, released or taken). A lost
            lease is never brought back: the caller must stop and, if it wants, acquire anew.
        """
        checked(lease)
        ttl = validation.ttl("ttl", lease.ttl if ttl is None else ttl)
        rows = self._ready().run(
            "renew", {"key": lease.key, "owner": lease.owner, "token": lease.token, "ttl": ttl}, durable=True
        )
        return _lease(rows[0]) if rows else None

    def release(self, lease: Lease) -> bool:
        """Free the lease. True only if owner and token still matched (so nobody else's lease is freed)."""
        checked(lease)
        rows = self._ready().run(
            "release", {"key": lease.key, "owner": lease.owner, "token": lease.token}, durable=True
        )
        if rows and self.record_events:
            released = _lease(rows[0])
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
        previous = _lease(rows[0][:9])
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
        return [_lease(row) for row in self._ready().run("list_leases", {"limit": limit})]

    def keep(
        self,
        lease: Lease,
        *,
        renew_every: timedelta | None = None,
        on_lost: Any = None,
    ) -> LeaseKeeper:
        """A started :class:`LeaseKeeper` renewing ``lease`` every ``renew_every`` (default TTL/3)."""
        from airflow_lease_provider.core.keeper import LeaseKeeper

        keeper = LeaseKeeper(self, lease, renew_every=renew_every, on_lost=on_lost)
        keeper.start()
        return keeper
