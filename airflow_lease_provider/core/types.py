"""The core's value types: a lease as the database saw it, and the outcome of an acquire.

They live apart from the store (``core/lease.py``) and the keeper (``core/keeper.py``) so that neither of
those has to import the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any, TypeVar

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import InvalidArgument
from airflow_lease_provider.core.identity import RunRef, run_columns


@dataclass(frozen=True)
class Lease:
    """A lease as the database saw it. All times are database times.

    :ivar observed_at: the database clock when this state was read; ``expires_at - observed_at`` is how
        long the lease had left, measured without the local clock.
    :ivar sent_at: this process's ``time.monotonic()`` just *before* the request that produced this state
        was sent, or ``None`` when the value did not come from this process's store (rebuilt from XCom or
        a dict, or made by hand). The keeper counts the time left from here:
        ``sent_at + (expires_at - observed_at)`` is never later than the real expiry, however long the
        request and its reply took. Not part of equality, ``repr`` or :meth:`to_dict`: it means nothing in
        another process.
    :ivar run: the holder's run as its acquire named it (``run=``; the lease's run columns, migration
        0011), read with the lease's row (:meth:`LeaseStore.holder`, :meth:`~LeaseStore.lease`,
        :meth:`~LeaseStore.leases`); ``None`` for a holder that named no run, and where the row was not read
        from the lease table (an acquire's or renewal's answer, XCom, a dict). The DAG-scoped reads go by
        it, never by the owner string. Not part of equality, ``repr`` or :meth:`to_dict`.
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
    sent_at: float | None = field(default=None, compare=False, repr=False)
    run: RunRef | None = field(default=None, compare=False, repr=False)
    #: The holder's slot of a semaphore (``slots=N`` of :meth:`LeaseStore.try_acquire`, migration 0014), and
    #: the semaphore's slot count; 1 and 1 for a single-holder lease. For slot ``i > 1`` :attr:`key` is the
    #: slot's own key (:func:`slot_key`): the key the holder renews, releases and fences under.
    slot: int = 1
    slots: int = 1
    #: The grant's count epoch (migration 0015; docs/core.md, "Who may hold a key"): the token floor of the key's
    #: holding period the grant belongs to. A grant of a key none of whose grants with its slot count is live
    #: begins a period (every change of the slot count does); every token of the period is above this, every
    #: token the key issued before the period (any slot) at or below it. A publish passes it to the fence
    #: (``count_epoch=``, with ``base_key=`` :attr:`lease_key`), which then refuses every token of the key at
    #: or below it: a zombie of a dropped slot is refused once a holder of the new count published. 0 where
    #: unknown (a lease made by hand, or read from a row that predates the migration). Not the token epoch of a
    #: failover (:class:`TokenEpoch`). Not part of equality or ``repr`` (the token says which grant it is).
    count_epoch: int = field(default=0, compare=False, repr=False)

    @property
    def lease_key(self) -> str:
        """The key that was acquired: :attr:`key` itself, or for slot ``i > 1`` the semaphore's key."""
        return base_key(self.key, self.slot)

    @property
    def slot_label(self) -> str:
        """``"slot 2 of 3"`` for a semaphore's holder, ``""`` for a single-holder lease."""
        return f"slot {self.slot} of {self.slots}" if self.slots > 1 else ""

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
            # A semaphore's slot (a single-holder lease's dict is unchanged).
            **({"slot": self.slot, "slots": self.slots, "lease_key": self.lease_key} if self.slots > 1 else {}),
            "count_epoch": self.count_epoch,
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any], sent_at: float | None = None) -> Lease:
        """A lease from a row of the store's lease columns, read by name; ``sent_at`` as for
        :attr:`sent_at` (when the request that read it was sent)."""
        return cls(
            key=row["key"], owner=row["owner"], token=int(row["token"]), ttl=row["ttl"],
            acquired_at=row["acquired_at"], renewed_at=row["renewed_at"], expires_at=row["expires_at"],
            released_at=row["released_at"], observed_at=row["observed_at"], sent_at=sent_at,
            run=RunRef.from_columns(row) if "dag_id" in row else None,
            slot=int(row["slot"]) if "slot" in row else 1, slots=int(row["slots"]) if "slots" in row else 1,
            count_epoch=int(row["count_epoch"]) if row.get("count_epoch") is not None else 0,
        )

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
            slot=int(data.get("slot", 1)), slots=int(data.get("slots", 1)),
            count_epoch=int(data.get("count_epoch", 0)),
        )

    def describe(self) -> str:
        """One line for logs and skip reasons: who holds it, with which token, until when."""
        seconds = int(self.remaining.total_seconds())
        where = f"{self.slot_label} of {self.lease_key!r} " if self.slots > 1 else ""
        return (
            f"{where}held by {self.owner!r} with token {self.token} until {self.expires_at.isoformat()} "
            f"(expires in {seconds // 60}m{seconds % 60:02d}s)"
        )


#: A semaphore's slot ``i > 1`` of key ``K`` is the lease row ``K#i`` (migrations/0014).
SLOT_SEPARATOR = "#"


def slot_key(key: str, slot: int) -> str:
    """The row key of ``slot`` of the semaphore ``key``: ``key`` itself for slot 1, else ``key#slot``."""
    return key if slot == 1 else f"{key}{SLOT_SEPARATOR}{slot}"


def base_key(key: str, slot: int) -> str:
    """The semaphore's key of the row ``key`` of ``slot`` (:func:`slot_key` undone)."""
    suffix = f"{SLOT_SEPARATOR}{slot}"
    return key[: -len(suffix)] if slot > 1 and key.endswith(suffix) else key


_Row = TypeVar("_Row")


def from_columns(cls: type[_Row], row: Mapping[str, Any]) -> _Row:
    """The dataclass ``cls`` whose fields are named like the columns of ``row``, read by name."""
    return cls(**{f.name: row[f.name] for f in fields(cls)})  # type: ignore[arg-type]


def checked(lease: object, parameter: str = "lease") -> Lease:
    """A :class:`Lease` whose identifying fields are valid (renew and release trust nothing else)."""
    if not isinstance(lease, Lease):
        raise InvalidArgument(parameter, lease, f"must be a Lease, not {type(lease).__name__}")
    validation.identifier("key", lease.key)  # as stored: renew and release match it exactly
    validation.owner("owner", lease.owner)
    validation.token("token", lease.token)
    return lease


@dataclass(frozen=True)
class TokenHolder:
    """One grant of a lease, by who got it: its owner, its token and its run (``None``: none named)."""

    owner: str
    token: int
    run: RunRef | None = None

    def describe(self) -> str:
        return f"{self.owner!r} (token {self.token})"


@dataclass(frozen=True)
class Acquisition:
    """The outcome of :meth:`LeaseStore.try_acquire` (and :meth:`~LeaseStore.try_replace`): the new lease,
    or who holds it now; ``replaced``: the holder a replace took the lease over from (``None``: it was free)."""

    lease: Lease | None
    holder: Lease | None
    replaced: TokenHolder | None = None
    #: A semaphore's refused acquire (``slots=N``): every live holder of the key, by slot (``holder`` is the
    #: first). Empty for a single-holder lease.
    holders: tuple[Lease, ...] = ()
    #: :meth:`~LeaseStore.try_replace` with ``takeover=False``: the holder's run is older (it would have
    #: been taken over).
    holder_older: bool = False

    @property
    def acquired(self) -> bool:
        return self.lease is not None


@dataclass(frozen=True)
class Holding:
    """The answer of :meth:`LeaseStore.holds`: does ``owner`` hold ``key`` (with ``token``, when given)?

    :ivar holder: the valid lease on ``key`` when it was read, whoever holds it (``None``: free).
    """

    key: str
    owner: str
    token: int | None
    holder: Lease | None

    @property
    def held(self) -> bool:
        h = self.holder
        return h is not None and h.owner == self.owner and (self.token is None or h.token == self.token)

    @property
    def lease(self) -> Lease | None:
        """The owner's lease when it holds it, else ``None``."""
        return self.holder if self.held else None

    def who(self) -> str:
        """Who holds the key instead, for messages: the holder's :meth:`Lease.describe` or "nobody holds it"."""
        return self.holder.describe() if self.holder is not None else "nobody holds it"


@dataclass(frozen=True)
class Waiter:
    """A run's place among the waiters of a key (migration 0012): since when, until when unless renewed."""

    key: str
    owner: str
    since: datetime
    expires_at: datetime
    run: RunRef | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any], key: str | None = None) -> Waiter:
        return cls(key=row["key"] if key is None else key, owner=row["owner"], since=row["since"],
                   expires_at=row["expires_at"], run=RunRef.from_columns(row))

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "owner": self.owner, "since": self.since.isoformat(),
                "expires_at": self.expires_at.isoformat(), **run_columns(self.run)}


@dataclass(frozen=True)
class WaitClaim:
    """The answer of :meth:`LeaseStore.wait_claim`: whether the owner has a place now, and every live
    waiter of the key, oldest first (the owner's own place among them when it has one)."""

    key: str
    owner: str
    claimed: bool
    waiters: tuple[Waiter, ...]
    #: Over the lease API only: the owner's place is live but was taken with another request id (a previous
    #: try's, whose keeper may be dead), and from this time a claim may take it over (docs/api.md, decision 9).
    takeover_at: datetime | None = None

    @property
    def others(self) -> list[Waiter]:
        """The waiters that are not the owner: when the claim was refused, those who fill the places."""
        return [w for w in self.waiters if w.owner != self.owner]


#: Every token is at least ``(epoch << EPOCH_SHIFT) + 1`` (migrations/0006): tokens of a later epoch are
#: larger than any token of an earlier one, as long as a key takes fewer than 2**40 tokens in one epoch.
EPOCH_SHIFT = 40


@dataclass(frozen=True)
class TokenEpoch:
    """The store's token epoch and the server history it was recorded on (docs/core.md, "Failover").

    :ivar epoch: every token issued now is at least ``(epoch << 40) + 1``.
    :ivar system_identifier: the PostgreSQL cluster's system identifier when the epoch was recorded.
    :ivar timeline: the server's timeline when the epoch was recorded.
    :ivar changed_at: when (database clock) it was recorded; ``reason`` says why.
    """

    epoch: int
    system_identifier: int
    timeline: int
    changed_at: datetime
    reason: str

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TokenEpoch:
        """The epoch from a row of ``lease_epoch`` (or of a function returning its columns), by name."""
        return from_columns(cls, row)

    @property
    def floor(self) -> int:
        """The largest token this epoch never issues: every token of it is above."""
        return self.epoch << EPOCH_SHIFT
