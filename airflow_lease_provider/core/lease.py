"""Leases: locks with a TTL and a fencing token, on PostgreSQL.

Each operation is one statement and one round trip, and every expiry decision is made by the
database clock, so a worker whose clock is off changes nothing.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Any

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import (
    InvalidArgument,
    LeaseError,
    LeaseStoreUnavailable,
    OutcomeUnknown,
)
from airflow_lease_provider.core.events import Event, EventCount, EventKind, HoldStats, event_kind
from airflow_lease_provider.core.identity import RunRef, run_columns
from airflow_lease_provider.core.keeper import LeaseKeeper
from airflow_lease_provider.core.store import Store
from airflow_lease_provider.core.types import (
    Acquisition,
    Holding,
    Lease,
    TokenEpoch,
    TokenHolder,
    WaitClaim,
    Waiter,
    checked,
    slot_key,
)

__all__ = [
    "Acquisition", "Holding", "Lease", "LeaseStore", "SlotCountMismatch", "TokenEpoch", "TokenHolder", "WaitClaim", "Waiter", "checked",
    "positive_limit",
]

log = logging.getLogger(__name__)


#: Token epochs are below this (the CHECK of lease_epoch.epoch, migrations/0006).
MAX_EPOCH = 8_388_608


def wait_claim_params(
    key: str, owner: str, ttl: timedelta, max_waiting: int, run: RunRef | None
) -> dict[str, Any]:
    """A waiting-place claim's checked parameters (the direct store's and the lease API's claims): a clear
    :class:`InvalidArgument` for a bad key, owner, TTL or ``max_waiting``, before anything is asked."""
    key = validation.name("key", key)
    owner = validation.owner("owner", owner)
    validation.ttl("ttl", ttl)
    positive_limit(max_waiting, "max_waiting", maximum=10_000)
    return {"key": key, "owner": owner, "ttl": ttl, "max_waiting": max_waiting, **run_columns(run)}


def positive_limit(value: object, parameter: str = "limit", maximum: int = 100_000) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise InvalidArgument(parameter, value, f"must be an integer from 1 to {maximum}")
    return value


class LeaseChanged(LeaseError):
    """A force-release with an expected token found another token: nothing was released.

    :ivar current: the lease as it is now.
    """

    def __init__(self, key: str, expected: int | None, current: Lease) -> None:
        super().__init__(
            f"lease {key!r} has token {current.token}, not {expected}: it changed since you looked; "
            "nothing was released"
        )
        self.key = key
        self.expected = expected
        self.current = current


#: The most slots a semaphore may have.
MAX_SLOTS = 1000


def slot_count(value: object, parameter: str = "slots") -> int:
    """A semaphore's slot count: an int from 1 to :data:`MAX_SLOTS`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SLOTS:
        raise InvalidArgument(parameter, value, f"must be an integer from 1 to {MAX_SLOTS} (how many holders at once)")
    return value


class SlotCountMismatch(InvalidArgument):
    """An acquire with ``slots=N`` found the key's slots held with another slot count (or a single-holder
    acquire or replace found a semaphore's slot of the key held): a key's slot count changes only while
    none of its slots is held. Nothing was written.

    :ivar holders: the live holders of the key, by slot.
    """

    def __init__(self, key: str, slots: int, holders: list[Lease]) -> None:
        held = sorted({h.slots for h in holders if h.slots != slots}) or sorted({h.slots for h in holders})
        who = "; ".join(f"slot {h.slot} of {h.slots}: {h.owner!r} (token {h.token})" for h in holders) or "nobody now"
        super().__init__(
            "slots", slots,
            f"lease {key!r} is held with {' and '.join(f'slots={n}' for n in held)} ({who}), not slots={slots}: "
            "a key's slot count can change only while none of its slots is held; use the same slot count "
            "everywhere for this key, or wait until its holders are done",
        )
        self.key = key
        self.slots = slots
        self.holders = holders


def _dag_list(dag_ids: Collection[str] | None) -> list[str] | None:
    if dag_ids is None:
        return None
    if isinstance(dag_ids, str) or not all(isinstance(d, str) for d in dag_ids):
        raise InvalidArgument("dag_ids", dag_ids, "must be a collection of DAG ids or None")
    return sorted(dag_ids)


def _aware(parameter: str, value: object) -> None:
    if value is not None and not (isinstance(value, datetime) and value.tzinfo is not None):
        raise InvalidArgument(parameter, value, "must be a timezone-aware datetime or None")


class LeaseStore(Store):
    """Leases on PostgreSQL. Creates or migrates its schema on first use.

    Takes :class:`~airflow_lease_provider.core.store.Store`'s arguments: ``dsn``, and optionally
    ``schema`` (default ``airflow_lease``), ``connect_timeout``, ``statement_timeout``,
    ``record_events`` (acquired/released/force-released events) and ``event_retention``.

    The calls that write an event take ``run=``: the :class:`~airflow_lease_provider.core.identity.RunRef`
    the event is about, stored in the event's run columns (the Airflow layer passes the task instance;
    without it the columns are NULL).
    """

    # Read once per store object (store_id), and again after the store was made again under a shared
    # database (Database.schema_generation).
    _store_id: str | None = None
    _store_id_generation = 0

    # -- the lease operations ----------------------------------------------------------------------

    def try_acquire(
        self, key: str, owner: str, ttl: timedelta, *, run: RunRef | None = None, slots: int = 1,
        host: str | None = None,
    ) -> Acquisition:
        """Take the lease if it is free, expired, or already this owner's (which bumps the token).

        With ``slots=N`` (N > 1) the key is a semaphore: at most N holders at once, each in its own slot
        (:attr:`Lease.slot`) with its own token; see :meth:`_try_acquire_slots`.

        ``host``: the host recorded in the ``acquired`` event (default this store's :attr:`host`): the lease
        API records the task's, not the api-server's.

        :returns: the new lease, or the current holder when someone else holds it.
        :raises SlotCountMismatch: the key's slots are held with another slot count (or as a single lease).
        """
        key = validation.name("key", key)
        owner = validation.owner("owner", owner)
        validation.ttl("ttl", ttl)
        columns = run_columns(run)  # checked before anything is sent
        if slots != 1 or type(slots) is not int:
            return self._try_acquire_slots(key, owner, ttl, slot_count(slots), columns, host)
        # Retrying after a lost connection is safe: if the first attempt did commit, the retry is the
        # same owner re-entering, which only burns the unseen token.
        db = self._ready()
        sent_at = time.monotonic()  # before the request: the keeper counts the time left from here
        # The holder's run goes to the lease row's run columns (and to the 'acquired' event's).
        params: dict[str, Any] = {"key": key, "owner": owner, "ttl": ttl, **columns}
        if self.record_events:
            # The grant and its 'acquired' event in one transaction (one durable commit, one round trip);
            # the statement adds the expiry to this detail.
            params["detail"] = self._acquire_detail(ttl, host)
            rows = db.run("acquire_logged", params, durable=True)
        else:
            rows = db.run("acquire", params, durable=True)
        if not rows:
            # The row appeared between our snapshot and our insert: someone else just created it.
            return Acquisition(None, self.holder(key))
        row = rows[0]
        lease = Lease.from_row(row, sent_at)
        if row["acquired"]:
            if self.record_events:
                self._logged(row["logged"], EventKind.ACQUIRED, key)
            return Acquisition(lease, None)
        if not lease.held:
            # We lost a race to a holder our snapshot could not see yet: read who it is.
            return Acquisition(None, self.holder(key))
        if lease.key != key or lease.owner == owner:
            # The answer is a slot of the key held with another slot count (migrations/0014, 0015): another
            # slot's row, or this owner's own slot 1 (a semaphore's: it cannot turn into a single holder).
            raise SlotCountMismatch(key, 1, self.slot_holders(key))
        return Acquisition(None, lease)

    def _try_acquire_slots(
        self, key: str, owner: str, ttl: timedelta, slots: int, columns: dict[str, Any], host: str | None = None
    ) -> Acquisition:
        """A semaphore's acquire, one statement (lease_acquire_slots, migrations/0014).

        Slot 1 is the key's own row, slot ``i > 1`` the row :func:`slot_key` ``(key, i)``; each has its own
        token, strictly increasing per slot, and the holder renews, releases, force-releases and fences under
        its row's key (:attr:`Lease.key`), so N valid holders never refuse each other at a fence. The owner's
        own slot is granted again with a larger token; else the lowest free slot. The slot count is part of
        the key while any slot is held: an acquire with another count is refused
        (:class:`SlotCountMismatch`, naming both); once no slot is held, the new count applies.
        """
        if len(slot_key(key, slots)) > validation.MAX_NAME_LENGTH:
            raise InvalidArgument(
                "key", key, f"with slots={slots} its slot keys ({slot_key(key, slots)!r}) exceed "
                f"{validation.MAX_NAME_LENGTH} characters",
            )
        db = self._ready()
        sent_at = time.monotonic()
        params: dict[str, Any] = {
            "key": key, "owner": owner, "ttl": ttl, "slots": slots,
            "detail": self._acquire_detail(ttl, host) if self.record_events else None, **columns,
        }
        rows = db.run("acquire_slots", params, durable=True)
        if rows and rows[0]["acquired"]:
            if self.record_events:
                self._logged(rows[0]["logged"], EventKind.ACQUIRED, key)
            return Acquisition(Lease.from_row(rows[0], sent_at), None)
        holders = tuple(Lease.from_row(r, sent_at) for r in rows)
        if any(h.slots != slots for h in holders):
            raise SlotCountMismatch(key, slots, list(holders))
        return Acquisition(None, holders[0] if holders else None, holders=holders)

    def slot_holders(self, key: str) -> list[Lease]:
        """The live holders of ``key``'s slots, by slot: one (or none) for a single-holder lease, up to N for
        a semaphore of N slots (:attr:`Lease.slot`, :attr:`Lease.slots`)."""
        key = validation.lookup_name("key", key)
        db = self._ready()
        sent_at = time.monotonic()
        return [Lease.from_row(r, sent_at) for r in db.run("slot_holders", {"key": key})]

    def try_replace(
        self, key: str, owner: str, ttl: timedelta, *, run_after: datetime, run: RunRef | None = None,
        takeover: bool = True, host: str | None = None,
    ) -> Acquisition:
        """The replace policy's acquire: take the lease if it is free, expired or this owner's (as
        :meth:`try_acquire` does), or take it over from a holder of an older run, in one statement.

        A holder is older when its grant came from this call too and its ``run_after`` is strictly earlier
        than ``run_after`` (the caller's run order: Airflow's DAG run ``run_after``). A holder of a later or
        equal run, or of unknown order (granted by :meth:`try_acquire`), keeps the lease: the answer names
        it, as a failed acquire does. A takeover gives the lease a token larger than the replaced one, so
        the old holder's renewal is refused and its fenced writes are refused by a fence in this store's
        schema from that moment (superseded); with the ledger on, an ``acquired`` event and a ``replaced``
        event (about the old holder, naming the new one) are written in the same transaction.

        With ``takeover=False`` (a grace period not over yet) no holder is taken over: a free, expired or own
        lease is granted (with ``run_after``), and a held one is answered with ``holder_older`` saying
        whether its run is older (whether a takeover would take it).

        A replace is a single-holder grant (docs/core.md, "Who may hold a key"): a semaphore's slot holder is
        never taken over (its slot 1 answers as a held lease), and while another slot of the key is held the
        replace is refused with :class:`SlotCountMismatch`, as :meth:`try_acquire` is.

        :returns: the new lease with ``replaced`` set to the holder taken over (None: it was free), or the
            holder that keeps it.
        :raises SlotCountMismatch: a slot i > 1 of the key is held.
        """
        key = validation.name("key", key)
        owner = validation.owner("owner", owner)
        validation.ttl("ttl", ttl)
        _aware("run_after", run_after)
        if run_after is None:
            raise InvalidArgument("run_after", run_after, "is required: the run order of the replacing run")
        columns = run_columns(run)
        db = self._ready()
        sent_at = time.monotonic()
        params: dict[str, Any] = {
            "key": key, "owner": owner, "ttl": ttl, "run_after": run_after, "takeover": bool(takeover),
            "detail": self._acquire_detail(ttl, host) if self.record_events else None, **columns,
        }
        rows = db.run("replace", params, durable=True)
        if not rows:
            return Acquisition(None, self.holder(key))
        row = rows[0]
        lease = Lease.from_row(row, sent_at)
        if not row["acquired"]:
            if not lease.held:
                return Acquisition(None, self.holder(key))
            if lease.key != key or lease.owner == owner:
                # A slot of the key is held (another slot, or this owner's own slot 1): a replace is a
                # single-holder grant, refused as try_acquire's (migrations/0015; a semaphore's holder is never
                # taken over).
                raise SlotCountMismatch(key, 1, self.slot_holders(key))
            return Acquisition(None, lease, holder_older=bool(row["older"]))
        if self.record_events:
            self._logged(row["logged"], EventKind.ACQUIRED, key)
        replaced = None
        if row["replaced_token"] is not None:
            replaced = TokenHolder(row["replaced_owner"], int(row["replaced_token"]))
            log.warning("lease %r: %s replaced %s with token %d", key, owner, replaced.describe(), lease.token)
        return Acquisition(lease, None, replaced)

    def replaced_by(self, lease: Lease) -> TokenHolder | None:
        """Who took ``lease`` over (:meth:`try_replace`), or None when it was not replaced (it expired, was
        released or force-released, or is still held).

        The lease row says it while the replacing grant is the key's newest; after that, the ledger's
        ``replaced`` event (when the ledger is on)."""
        checked(lease)
        rows = self._ready().run("replacement", {"key": lease.key, "token": lease.token})
        if rows:
            row = rows[0]
            return TokenHolder(row["owner"], int(row["token"]), RunRef.from_columns(row))
        if not self.record_events:
            return None
        for event in self.events.query(key=lease.key, kind=EventKind.REPLACED, limit=100):
            if event.token == lease.token and event.owner == lease.owner:
                d = event.detail
                run = RunRef.from_columns({
                    "dag_id": d.get("by_dag_id"), "run_id": d.get("by_run_id"), "task_id": d.get("by_task_id"),
                    "map_index": d.get("by_map_index"),
                })
                return TokenHolder(str(d.get("by_owner")), int(d.get("by_token") or 0), run)
        return None

    def wait_claim(
        self, key: str, owner: str, ttl: timedelta, *, max_waiting: int = 1, run: RunRef | None = None
    ) -> WaitClaim:
        """Take (or keep, renewing it for ``ttl``) ``owner``'s place among the waiters of ``key``: at most
        ``max_waiting`` runs wait for one key. Atomic per key: of many callers at once, exactly as many as
        there are free places get one. A place lapses ``ttl`` after its last claim (a dead waiter's frees
        itself); :meth:`wait_release` gives it back at once.

        :returns: whether ``owner`` has a place now, and every live waiter of the key (who fills the places
            when it has none)."""
        params = wait_claim_params(key, owner, ttl, max_waiting, run)
        rows = self._ready().run("wait_claim", params, durable=True)
        key = params["key"]
        waiters = tuple(Waiter.from_row(r, key) for r in rows)
        claimed = bool(rows[0]["claimed"]) if rows else False
        return WaitClaim(key, owner, claimed, waiters)

    def wait_release(self, key: str, owner: str) -> bool:
        """Give ``owner``'s waiting place for ``key`` back; whether it had one."""
        key = validation.lookup_name("key", key)
        owner = validation.owner("owner", owner)
        return bool(self._ready().run("wait_release", {"key": key, "owner": owner}, durable=True))

    def waiters(
        self, keys: Collection[str] | None = None, *, dag_ids: Collection[str] | None = None, limit: int = 1000
    ) -> list[Waiter]:
        """The live waiters of ``keys`` (None: of every key), by key, oldest first; of ``dag_ids`` when given."""
        positive_limit(limit)
        key_list = None
        if keys is not None:
            if isinstance(keys, str):
                raise InvalidArgument("keys", keys, "must be a collection of keys or None")
            key_list = sorted(validation.lookup_name("key", k) for k in keys)
        rows = self._ready().run("waiters", {"keys": key_list, "dag_ids": _dag_list(dag_ids), "limit": limit})
        return [Waiter.from_row(r) for r in rows]

    def _acquire_detail(self, ttl: timedelta, host: str | None = None) -> str:
        """The 'acquired' event's detail from the caller's side (host, TTL), as JSON: encoded once per
        (host, TTL) and kept, since encoding it cost more client time than the rest of the call. ``host``:
        another host than this store's (the lease API's caller's)."""
        if host is not None and (not isinstance(host, str) or "\x00" in host):
            raise InvalidArgument("host", host, "must be a string without NUL characters")
        cache = self._acquire_details
        host = self.host if host is None else host
        cache_key = (host, ttl)
        detail = cache.get(cache_key)
        if detail is None:
            if len(cache) >= 64:  # a caller cycling through TTLs: keep the cache small
                cache.clear()
            detail = cache[cache_key] = json.dumps({"host": host, "ttl_seconds": ttl.total_seconds()}, sort_keys=True)
        return detail

    def _logged(self, logged: bool, kind: EventKind, key: str) -> None:
        """After a lease statement that wrote its own event: the ledger's warning if it could not."""
        if logged:
            self.events.maybe_prune()
        else:
            log.warning("event ledger: could not record %s for %r (the lease operation itself succeeded)", kind.value, key)

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

    def acquire(self, key: str, owner: str, ttl: timedelta, *, run: RunRef | None = None) -> Lease | None:
        """The lease, or ``None`` when someone else holds it (:meth:`try_acquire` says who)."""
        return self.try_acquire(key, owner, ttl, run=run).lease

    def holder(self, key: str) -> Lease | None:
        """The current valid lease on ``key``, or ``None`` when it is free."""
        key = validation.lookup_name("key", key)
        db = self._ready()
        sent_at = time.monotonic()
        rows = db.run("holder", {"key": key})
        return Lease.from_row(rows[0], sent_at) if rows else None

    def holds(self, key: str, owner: str, *, token: int | None = None) -> Holding:
        """Does ``owner`` (with ``token``, when given) hold ``key`` right now? One read of the store.

        The answer carries the current holder either way, to say who holds it instead.
        """
        owner = validation.owner("owner", owner)
        key = validation.lookup_name("key", key)
        if token is not None:
            validation.token("token", token)
        return Holding(key, owner, token, self.holder(key))

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
        return Lease.from_row(rows[0], sent_at) if rows else None

    def release(self, lease: Lease, *, run: RunRef | None = None) -> bool:
        """Free the lease. True only if owner and token still matched (so nobody else's lease is freed).

        A release whose answer was lost is sent once more: the same release again changes nothing if the
        first was applied (it needs the lease unreleased), and then the row tells (this owner and token,
        released) whether it was. A second lost answer raises :class:`OutcomeUnknown`.
        """
        checked(lease)
        params: dict[str, Any] = {"key": lease.key, "owner": lease.owner, "token": lease.token}
        if self.record_events:
            # The release and its 'released' event (held_seconds, released_at) in one transaction.
            name, params = "release_logged", {**params, "detail": "{}", **run_columns(run)}
        else:
            name = "release"
        db = self._ready()
        try:
            rows = db.run(name, params, durable=True, retry=False)
        except OutcomeUnknown as exc:
            log.warning("lease %r: the answer to its release was lost (%s); releasing again", lease.key, exc)
            rows = db.run(name, params, durable=True, retry=False)
            if not rows:
                return self._released(lease)
        if rows and self.record_events:
            self._logged(rows[0]["logged"], EventKind.RELEASED, lease.key)
        return bool(rows)

    def _released(self, lease: Lease) -> bool:
        """Whether ``lease`` is released, as its holder releases it: only this owner with this token sets
        ``released_at`` and keeps the token (a force-release bumps it, a new grant clears it)."""
        row = self.lease(lease.key)
        return row is not None and (row.owner, row.token) == (lease.owner, lease.token) and row.released_at is not None

    def lease(self, key: str) -> Lease | None:
        """The row of ``key``, held or not (see :attr:`Lease.held`); ``None`` when it was never acquired.

        One index lookup, whatever the number of keys (unlike scanning :meth:`leases`).
        """
        key = validation.lookup_name("key", key)
        rows = self._ready().run("lease_by_key", {"key": key})
        return Lease.from_row(rows[0]) if rows else None

    def force_release(
        self, key: str, *, by: str = "admin", reason: str = "", expected_token: int | None = None,
        run: RunRef | None = None,
    ) -> Lease | None:
        """Admin action: free ``key`` whoever holds it, and bump its token so the old holder is fenced out.

        :returns: the lease as it was just before, or ``None`` when the key was never acquired; see
            :meth:`force_release_with_token` for the token it has now.
        """
        done = self.force_release_with_token(key, by=by, reason=reason, expected_token=expected_token, run=run)
        return None if done is None else done[0]

    def force_release_with_token(
        self, key: str, *, by: str = "admin", reason: str = "", expected_token: int | None = None,
        run: RunRef | None = None,
    ) -> tuple[Lease, int] | None:
        """:meth:`force_release`, returning ``(the lease as it was just before, the token it has now)``.

        With ``expected_token`` the row is compared and released under one row lock, so a lease re-acquired
        or bumped since the caller looked is never released by mistake. With the ledger on, the release and
        its ``force_released`` event are one transaction under a request id: when its answer is lost, it is
        asked again and found applied (never applied twice, never reported as "nothing was released");
        when no answer can be had, :class:`OutcomeUnknown`. With the ledger off it is one statement, never
        sent twice: a lost answer is :class:`OutcomeUnknown` (docs/core.md, "Statements sent again after
        a lost connection").

        :param by: who did it, for the ledger.
        :param expected_token: release only if the lease still has this token; otherwise raise
            :class:`LeaseChanged` (carrying the lease as it is) and write nothing.
        :param run: the run whose lease this was, for the ledger (the caller knows its owner format; the
            core never guesses a run from an owner).
        :returns: the lease as it was just before (whether or not it was still valid) and its new token:
            ``previous.token + 1``, or the token epoch's floor + 1 after a failover. ``None`` when the key
            was never acquired.
        """
        key = validation.lookup_name("key", key)
        by = validation.owner("by", by)
        if not isinstance(reason, str) or "\x00" in reason or len(reason) > validation.MAX_NAME_LENGTH:
            raise InvalidArgument(
                "reason", reason, f"must be a string of at most {validation.MAX_NAME_LENGTH} characters without NUL"
            )
        if expected_token is not None:
            validation.token("expected_token", expected_token)
        columns = run_columns(run)
        if self.record_events:
            row = self._force_release_logged(key, by, reason, expected_token, columns)
        else:
            # Without the ledger there is nowhere to find the request again: never sent twice. A lost
            # answer raises OutcomeUnknown (the token may have been bumped, or not).
            rows = self._ready().run(
                "force_release_expected", {"key": key, "expected_token": expected_token}, durable=True, retry=False
            )
            row = rows[0] if rows else None
        if row is None:
            return None
        previous = Lease.from_row(row)
        if row["new_token"] is None:
            raise LeaseChanged(key, expected_token, previous)
        new_token = int(row["new_token"])
        log.warning("lease %r force-released by %r (was %s)", key, by, previous.describe())
        return previous, new_token

    #: How often a force-release whose answer was lost is sent again (the same request: applied once).
    FORCE_RELEASE_SENDS = 3

    def _force_release_logged(
        self, key: str, by: str, reason: str, expected_token: int | None, columns: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The force-release and its ``force_released`` event in one transaction, under a request id: a send
        whose answer was lost (the connection dropped after the commit) is sent again, and the resend finds
        the request applied (its event) and answers what it did, instead of bumping the token a second time
        or calling it "changed, nothing released". Its row, or ``None`` when the key was never acquired.

        :raises OutcomeUnknown: no send's answer came back: it may or may not have been applied.
        """
        request = uuid.uuid4().hex
        detail = json.dumps({"by": by, "reason": reason}, sort_keys=True)
        params = {"key": key, "expected_token": expected_token, "request": request, "detail": detail, **columns}
        lost: OutcomeUnknown | None = None
        for _ in range(self.FORCE_RELEASE_SENDS):
            db = self._ready()
            try:
                with db.transaction() as cur:
                    if not db.run_in(cur, "force_release_lock", params):
                        return None
                    if lost is not None:
                        done = db.run_in(cur, "force_release_done", params)
                        if done:
                            log.info("lease %r: the force-release whose answer was lost had been applied", key)
                            return done[0]
                    rows = db.run_in(cur, "force_release_logged", params)
            except OutcomeUnknown as exc:
                lost = exc
                log.warning("lease %r: the answer to a force-release was lost (%s); asking again", key, exc)
                continue
            except LeaseStoreUnavailable as exc:
                if lost is None:
                    raise  # nothing was committed: the first send failed before its commit
                raise self._unknown_force_release(key, exc) from exc
            self.events.maybe_prune()
            return rows[0] if rows else None
        assert lost is not None
        raise self._unknown_force_release(key, lost) from lost

    @staticmethod
    def _unknown_force_release(key: str, cause: LeaseError) -> OutcomeUnknown:
        return OutcomeUnknown(
            f"force-release of {key!r}: the store's answer was lost and asking again failed ({cause}): the lease "
            "may or may not have been released; look at it again (its token and the force_released event say)"
        )

    def leases(
        self,
        limit: int = 1000,
        *,
        after: str | None = None,
        held_only: bool = False,
        dag_ids: Collection[str] | None = None,
    ) -> list[Lease]:
        """Keys the store knows, held or not (see :attr:`Lease.held`), in key order, a page at a time.

        :param limit: at most this many.
        :param after: the keys after this one (the last key of the previous page): keyset pagination,
            so every page costs one index range scan however many keys there are.
        :param held_only: only the leases valid right now.
        :param dag_ids: only the leases whose holder's run (the ``run=`` its acquire passed, stored in the
            lease's ``dag_id`` column) is of one of these DAGs; ``None`` for all, including leases of no run.
        """
        positive_limit(limit)
        if after is not None:
            validation.identifier("after", after)  # a stored key, as stored (keyset pagination)
        params = {"limit": limit, "after": after, "held_only": bool(held_only), "dag_ids": _dag_list(dag_ids)}
        db = self._ready()
        sent_at = time.monotonic()
        return [Lease.from_row(row, sent_at) for row in db.run("lease_page", params)]

    def event_page(
        self,
        *,
        key: str | None = None,
        kind: EventKind | str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        before: tuple[datetime, int] | None = None,
        dag_ids: Collection[str] | None = None,
        limit: int = 100,
    ) -> list[Event]:
        """Events newest first, like :meth:`EventLedger.query`, keyset-paginated and scoped to DAGs.

        :param before: ``(at, id)`` of the last event of the previous page: the page continues after it.
        :param dag_ids: only events of these DAGs (their ``dag_id`` column: the run their writer passed).
        """
        if kind is not None:
            kind = event_kind(kind)
        if key is not None:
            key = validation.lookup_name("key", key)
        _aware("since", since)
        _aware("until", until)
        before_at, before_id = None, None
        if before is not None:
            if not (
                isinstance(before, tuple) and len(before) == 2 and isinstance(before[1], int)
                and not isinstance(before[1], bool) and 0 <= before[1] <= validation.MAX_TOKEN
            ):
                raise InvalidArgument("before", before, "must be (at, id) of an event (an id is a bigint)")
            _aware("before", before[0])
            before_at, before_id = before
        positive_limit(limit, maximum=10_000)
        rows = self._ready().run(
            "event_page",
            {
                "key": key, "kind": kind, "since": since, "until": until, "limit": limit,
                "before_at": before_at, "before_id": before_id, "dag_ids": _dag_list(dag_ids),
            },
        )
        return [Event.from_row(r) for r in rows]

    def run_events(
        self,
        dag_id: str,
        run_id: str,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 10_000,
    ) -> list[Event]:
        """The events of one DAG run, newest first, selected in SQL by their run columns (migration 0007:
        the run the Airflow layer passed when it wrote them; events from before are filled in from their
        detail or owner)."""
        validation.identifier("dag_id", dag_id)
        validation.identifier("run_id", run_id)
        _aware("since", since)
        _aware("until", until)
        positive_limit(limit, maximum=100_000)
        rows = self._ready().run(
            "run_events", {"dag_id": dag_id, "run_id": run_id, "since": since, "until": until, "limit": limit}
        )
        return [Event.from_row(r) for r in rows]

    def event_counts(self, *, dag_ids: Collection[str] | None = None) -> list[EventCount]:
        """:meth:`EventLedger.counts`, limited to the events of ``dag_ids`` when given."""
        return self.events.counts(dag_ids=_dag_list(dag_ids))

    def hold_stats(
        self, window: timedelta, *, dag_ids: Collection[str] | None = None
    ) -> list[HoldStats]:
        """:meth:`EventLedger.hold_stats`, limited to the events of ``dag_ids`` when given."""
        validation.positive_timedelta("window", window)
        return self.events.hold_stats(window, dag_ids=_dag_list(dag_ids))

    def keep(
        self,
        lease: Lease,
        *,
        renew_every: timedelta | None = None,
        on_lost: Any = None,
        run: RunRef | None = None,
    ) -> LeaseKeeper:
        """A started :class:`LeaseKeeper` renewing ``lease`` every ``renew_every`` (default TTL/3).

        The keeper counts the time left from when ``lease`` was read (:attr:`Lease.sent_at`), not from
        this call: a lease kept after a pause longer than its time left is reported lost at once.
        """
        keeper = LeaseKeeper(self, lease, renew_every=renew_every, on_lost=on_lost, run=run)
        keeper.start()
        return keeper

    # -- the token epoch (failover) ----------------------------------------------------------------

    def token_epoch(self) -> TokenEpoch:
        """The token epoch tokens are issued in now (docs/core.md, "Failover of the store").

        Like every acquire, it first moves to a new epoch when the store runs on another server history
        than the one it recorded (a promoted standby: a new timeline; another cluster).
        """
        db = self._ready()
        db.run("token_floor", {}, durable=True)
        return TokenEpoch.from_row(db.run("token_epoch", {})[0])

    def bump_epoch(self, reason: str, *, above: int | None = None) -> TokenEpoch:
        """Start a new token epoch: every token issued from now on is larger than any issued before.

        The operator's step after a failover or restore the store cannot detect by itself (a schema
        restored from a dump into the same cluster). Harmless when not needed: tokens only jump up.

        :param reason: why, recorded with the epoch.
        :param above: also make every token from now on larger than this one: a token a fence kept in
            another database accepted from this store before it was recreated (the fence's refusal names
            it; docs/deploy.md, "Restoring or recreating the lease store").
        """
        return self.bump_epoch_from(reason, above=above)[1]

    def bump_epoch_from(self, reason: str, *, above: int | None = None) -> tuple[TokenEpoch, TokenEpoch]:
        """:meth:`bump_epoch`, returning ``(previous, new)``: the epoch it moved from, and the new one.

        Read and changed in one transaction, with the epoch's row locked first: of two concurrent bumps
        one waits for the other, so they report ``0 -> 1`` and ``1 -> 2`` (reading ``previous`` apart
        from the bump made both say they moved from 0). Like every acquire, the store first moves to a
        new epoch when it runs on another server history; ``previous`` is the epoch after that move.
        """
        validation.identifier("reason", reason)
        if above is not None:
            validation.token("above", above)
            if above >= (MAX_EPOCH - 1) << 40:
                raise InvalidArgument("above", above, f"must be below {(MAX_EPOCH - 1) << 40} (the last token epoch)")
        db = self._ready()
        with db.transaction() as cur:
            db.run_in(cur, "token_floor")
            previous = TokenEpoch.from_row(db.run_in(cur, "token_epoch_locked")[0])
            if above is None:
                epoch = TokenEpoch.from_row(db.run_in(cur, "token_epoch_bump", {"reason": reason})[0])
            else:
                epoch = TokenEpoch.from_row(db.run_in(cur, "token_epoch_raise", {"reason": reason, "above": above})[0])
        log.warning("token epoch bumped from %d to %d (%s)", previous.epoch, epoch.epoch, reason)
        return previous, epoch

    @property
    def store_id(self) -> str:
        """This lease store's identity (a UUID made once with the store, kept by a dump and restore, new
        for a store created again). Fenced publishes pass it (``store_id=``) so a fence records where its
        tokens came from. Read once per store object (again once its tables were found gone and made again)."""
        if self._store_id is None or self._store_id_generation != self.db.schema_generation:
            self._store_id = str(self._ready().run("store_id", {})[0]["store_id"])
            self._store_id_generation = self.db.schema_generation  # after the read: it may have made it again
        return self._store_id
