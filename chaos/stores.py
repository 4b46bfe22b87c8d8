"""The stores the workers use: the real ones with recording, and several broken on purpose.

The broken variants exist to prove the checker can fail. Each breaks exactly one defence:

* ``client-clock`` judges lease expiry with the worker's own clock instead of the database's (what a
  lock library does without ShedLock's ``usingDbTime()``): a worker whose clock runs 10 minutes ahead
  believes every lease has expired and takes it from its valid holder.
* ``fence-off`` publishes without advancing the fence: a zombie that wakes up late writes over newer work.
* ``keeper-from-construction`` counts the keeper's deadline from the keeper's own construction (and renews
  first one interval after it), not from when the lease was read: a worker that starts its keeper after a
  pause, or joins a lease late, believes in a lease that has already expired (the ``stale-check``
  property).
* ``fence-cross-key`` compares tokens of different lease keys at one resource (one fence row per
  resource, as before migration 3): a valid holder of a key whose count is behind is refused as stale
  (the ``valid-refused`` property).
* ``replace-ignores-slots`` replaces as the store did before issue 38: it reads and writes the key's own
  row only, so it grants a single holder beside a semaphore's live slot (the ``exclusion`` properties).
* ``wait-ignores-max`` claims waiting places as if every key allowed 10,000 waiters, whatever
  ``max_waiting`` the caller asked for: more places live at once than the key's limit (the ``wait-over-max``
  property).

A third, ``async-commit``, drops the store's ``SET LOCAL synchronous_commit = on`` (decision 4) on a
server whose default is off: after a SIGKILL of the server, acknowledged tokens and publishes can vanish,
which the checker's ``lost-ack`` property (and then ``token-reissued``) must catch.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg2
from psycopg2 import sql

from airflow_lease_provider.client import HttpLeaseStore
from airflow_lease_provider.core import (
    Acquisition,
    FenceStore,
    Lease,
    LeaseError,
    LeaseKeeper,
    LeaseStore,
    LeaseStoreUnavailable,
    RunRef,
    TokenHolder,
    WaitClaim,
    validation,
)
from airflow_lease_provider.core.db import Database
from chaos.history import Recorder


def commit_asynchronously(db: Database) -> None:
    """BROKEN ON PURPOSE: every statement of ``db`` commits without waiting for its WAL to reach disk."""
    prefix = db._prefix  # the private hook where the store adds SET LOCAL synchronous_commit = on
    db._prefix = lambda durable: prefix(False) + "SET LOCAL synchronous_commit = off; "  # type: ignore[method-assign]


def outcome_of(exc: BaseException) -> str:
    """``unknown`` for an unreachable store (the call may or may not have taken effect), else ``error``."""
    return "unknown" if isinstance(exc, LeaseStoreUnavailable) else "error"


def lease_fields(lease: Lease) -> dict[str, Any]:
    return {
        "key": lease.key, "owner": lease.owner, "token": lease.token,
        "acquired_at": lease.acquired_at, "renewed_at": lease.renewed_at,
        "expires_at": lease.expires_at, "observed_at": lease.observed_at, "slot": lease.slot, "slots": lease.slots,
        **({"count_epoch": lease.count_epoch} if hasattr(lease, "count_epoch") else {}),
    }


def recorded_renewal(
    recorder: Recorder, lease: Lease, renew: Callable[[], Lease | None], **marks: Any
) -> Lease | None:
    """``renew()`` (a store's renewal of ``lease``, made by the keeper thread), recorded: its outcome, and the
    renewed lease's fields when it was granted. ``marks`` go into each record (``http=True``: through the
    lease API). The one wrapper of the direct and the HTTP store."""
    t0 = time.monotonic()
    ident = {"key": lease.key, "owner": lease.owner, "token": lease.token, **marks}
    try:
        renewed = renew()
    except LeaseError as exc:
        recorder.op("renew", t0=t0, outcome=outcome_of(exc), error=str(exc), **ident)
        raise
    if renewed is None:
        recorder.op("renew", t0=t0, outcome="refused", **ident)
    else:
        recorder.op("renew", t0=t0, outcome="ok", **marks, **lease_fields(renewed))
    return renewed


def recorded_release(recorder: Recorder, lease: Lease, release: Callable[[], bool], **marks: Any) -> bool:
    """``release()`` (a store's release of ``lease``), recorded as :func:`recorded_renewal` records a renewal."""
    t0 = time.monotonic()
    ident = {"key": lease.key, "owner": lease.owner, "token": lease.token, **marks}
    try:
        released = release()
    except LeaseError as exc:
        recorder.op("release", t0=t0, outcome=outcome_of(exc), error=str(exc), **ident)
        raise
    recorder.op("release", t0=t0, outcome="ok" if released else "refused", **ident)
    return released


class RecordingLeaseStore(LeaseStore):
    """The real :class:`LeaseStore`; renewals (made by the keeper thread) and releases are recorded."""

    def __init__(self, dsn: str, *, recorder: Recorder, **kwargs: Any) -> None:
        super().__init__(dsn, **kwargs)
        self.recorder = recorder

    def renew(self, lease: Lease, ttl: timedelta | None = None) -> Lease | None:
        return recorded_renewal(self.recorder, lease, lambda: super(RecordingLeaseStore, self).renew(lease, ttl))

    def release(self, lease: Lease, *, run: RunRef | None = None) -> bool:
        return recorded_release(self.recorder, lease, lambda: super(RecordingLeaseStore, self).release(lease, run=run))


class _OwnConnection:
    """A plain autocommit connection for the broken variants' own SQL, reconnected after failures."""

    def __init__(self, dsn: str, connect_timeout: float, statement_timeout: float) -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.statement_timeout_ms = round(statement_timeout * 1000)
        self.conn: Any = None

    def get(self) -> Any:
        if self.conn is None or self.conn.closed:
            try:
                self.conn = psycopg2.connect(
                    self.dsn, connect_timeout=max(2, round(self.connect_timeout)),
                    application_name="airflow-lease",
                    options=f"-c statement_timeout={self.statement_timeout_ms}",
                )
            except psycopg2.Error as exc:
                raise LeaseStoreUnavailable(f"broken variant: {exc}") from exc
            self.conn.autocommit = True
        return self.conn

    def fail(self, exc: psycopg2.Error) -> LeaseStoreUnavailable:
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg2.Error:
                pass
            self.conn = None
        return LeaseStoreUnavailable(f"broken variant: {exc}")


class ClientClockLeaseStore(RecordingLeaseStore):
    """BROKEN ON PURPOSE: acquire reads the lease, then decides with ``datetime.now()`` whether it expired.

    The take itself is a compare-and-set on the token, so tokens stay unique and increasing: only the
    expiry judgement is wrong, which is the bug the checker's overlap property must catch.
    """

    def __init__(self, dsn: str, *, recorder: Recorder, **kwargs: Any) -> None:
        super().__init__(dsn, recorder=recorder, **kwargs)
        self._own = _OwnConnection(
            dsn, kwargs["connect_timeout"].total_seconds(), kwargs["statement_timeout"].total_seconds()
        )
        self._table = sql.SQL("{}.lease").format(sql.Identifier(self.schema))

    def try_acquire(
        self, key: str, owner: str, ttl: timedelta, *, run: RunRef | None = None, slots: int = 1
    ) -> Acquisition:
        if slots != 1:
            return super().try_acquire(key, owner, ttl, run=run, slots=slots)  # only the plain acquire is broken
        validation.name("key", key)
        validation.name("owner", owner)
        validation.ttl("ttl", ttl)
        conn = self._own.get()
        try:
            with conn.cursor() as cur:
                cur.execute(
                    sql.SQL("SELECT owner, token, expires_at, released_at FROM {} WHERE key = %s").format(self._table),
                    (key,),
                )
                row = cur.fetchone()
                if row is None:
                    return super().try_acquire(key, owner, ttl, run=run)  # a new key: the real insert
                holder_owner, token, expires_at, released_at = row
                client_now = datetime.now(timezone.utc)  # THE BUG: the worker's clock decides
                if released_at is None and expires_at > client_now and holder_owner != owner:
                    return Acquisition(None, self.holder(key))
                cur.execute(
                    sql.SQL(
                        "UPDATE {} SET owner = %(owner)s, token = token + 1, ttl = %(ttl)s, "
                        "acquired_at = clock_timestamp(), renewed_at = clock_timestamp(), "
                        "expires_at = clock_timestamp() + %(ttl)s, released_at = NULL "
                        "WHERE key = %(key)s AND token = %(token)s "
                        "RETURNING key, owner, token, ttl, acquired_at, renewed_at, expires_at, released_at, "
                        "clock_timestamp()"
                    ).format(self._table),
                    {"owner": owner, "ttl": ttl, "key": key, "token": token},
                )
                taken = cur.fetchone()
        except psycopg2.Error as exc:
            raise self._own.fail(exc) from exc
        if taken is None:
            return Acquisition(None, self.holder(key))
        return Acquisition(Lease(*taken[:2], int(taken[2]), *taken[3:]), None)  # no sent_at: the keeper renews first


class ReplaceIgnoresSlotsLeaseStore(RecordingLeaseStore):
    """BROKEN ON PURPOSE: the replace of before issue 38 (``lease_replace`` of migrations 12 and 14). It reads
    and writes only the key's own row, never the rows of the key's other slots: with slot 1 free and slot 2
    held by a semaphore's holder, it grants the key to one holder who believes it is alone (the checker's
    ``exclusion`` properties). The rest of the store is the real one.
    """

    def __init__(self, dsn: str, *, recorder: Recorder, **kwargs: Any) -> None:
        super().__init__(dsn, recorder=recorder, **kwargs)
        self._own = _OwnConnection(
            dsn, kwargs["connect_timeout"].total_seconds(), kwargs["statement_timeout"].total_seconds()
        )
        self._table = sql.SQL("{}.lease").format(sql.Identifier(self.schema))
        self._floor = sql.SQL("{}.lease_token_floor()").format(sql.Identifier(self.schema))

    def try_replace(
        self, key: str, owner: str, ttl: timedelta, *, run_after: datetime, run: RunRef | None = None,
        takeover: bool = True,
    ) -> Acquisition:
        validation.name("key", key)
        validation.name("owner", owner)
        validation.ttl("ttl", ttl)
        conn = self._own.get()
        try:
            conn.autocommit = False
            with conn, conn.cursor() as cur:
                cur.execute(
                    sql.SQL(
                        "SELECT owner, token, expires_at > clock_timestamp(), run_after FROM {} WHERE key = %s FOR UPDATE"
                    ).format(self._table),
                    (key,),
                )
                old = cur.fetchone()
                params = {"key": key, "owner": owner, "ttl": ttl, "run_after": run_after}
                if old is None:
                    cur.execute(
                        sql.SQL(
                            "INSERT INTO {} (key, owner, token, ttl, acquired_at, renewed_at, expires_at, run_after) "
                            "VALUES (%(key)s, %(owner)s, {} + 1, %(ttl)s, clock_timestamp(), clock_timestamp(), "
                            "clock_timestamp() + %(ttl)s, %(run_after)s) ON CONFLICT (key) DO NOTHING "
                            "RETURNING key, owner, token, ttl, acquired_at, renewed_at, expires_at, released_at, clock_timestamp()"
                        ).format(self._table, self._floor),
                        params,
                    )
                    taken, replaced = cur.fetchone(), None
                else:
                    holder_owner, token, live, holder_run_after = old
                    older = holder_run_after is not None and holder_run_after < run_after
                    if live and holder_owner != owner and not (takeover and older):
                        taken, replaced = None, None
                    else:
                        # THE BUG: the rows of the key's other slots (slot_of = key) are never looked at.
                        cur.execute(
                            sql.SQL(
                                "UPDATE {} SET owner = %(owner)s, token = greatest(token + 1, {} + 1), ttl = %(ttl)s, "
                                "acquired_at = clock_timestamp(), renewed_at = clock_timestamp(), "
                                "expires_at = clock_timestamp() + %(ttl)s, released_at = NULL, "
                                "dag_id = NULL, run_id = NULL, task_id = NULL, map_index = NULL, "
                                "run_after = %(run_after)s, replaced_token = %(replaced)s, "
                                "slots = 1, slot = 1, slot_of = NULL "
                                "WHERE key = %(key)s "
                                "RETURNING key, owner, token, ttl, acquired_at, renewed_at, expires_at, released_at, "
                                "clock_timestamp()"
                            ).format(self._table, self._floor),
                            {**params, "replaced": token if live and holder_owner != owner else None},
                        )
                        taken = cur.fetchone()
                        replaced = TokenHolder(holder_owner, int(token)) if live and holder_owner != owner else None
        except psycopg2.Error as exc:
            raise self._own.fail(exc) from exc
        finally:
            if self._own.conn is not None and not self._own.conn.closed:
                self._own.conn.autocommit = True
        if taken is None:
            return Acquisition(None, self.holder(key))
        return Acquisition(Lease(*taken[:2], int(taken[2]), *taken[3:]), None, replaced)


class WaitIgnoresMaxLeaseStore(RecordingLeaseStore):
    """BROKEN ON PURPOSE: a waiting-place claim ignores the caller's ``max_waiting`` (as a store whose claim
    never counted the live places would): every claim gets a place. The rest of the store is the real one."""

    def wait_claim(self, key: str, owner: str, ttl: timedelta, *, max_waiting: int = 1,
                   run: RunRef | None = None) -> WaitClaim:
        return super().wait_claim(key, owner, ttl, max_waiting=IGNORED_MAX, run=run)  # THE BUG


#: The limit the broken claim uses instead of the caller's (the largest the store accepts).
IGNORED_MAX = 10_000


class FromConstructionKeeper(LeaseKeeper):
    """BROKEN ON PURPOSE: the keeper of before issue 10. It counts the time left from the moment the keeper
    itself is built (or a renewal's reply arrives), so a pause between reading the lease and keeping it is
    not counted, and its first renewal comes one interval after that moment."""

    def _measured_from(self, lease: Lease) -> float:
        return time.monotonic()

    def _next_renewal(self) -> float:
        return time.monotonic() + self.renew_every.total_seconds()


#: The one fence row every lease key of a resource shares in the cross-key variant.
CROSS_KEY = "*"


class CrossKeyFenceStore(FenceStore):
    """BROKEN ON PURPOSE: one fence per resource, whatever the lease key: tokens of different keys are
    compared, so a valid holder of a key whose count is behind another key's is refused."""

    @staticmethod
    def _params(
        resource: str, key: str, token: int, owner: str | None, idempotency_key: str | None,
        store_id: str | None = None,
    ) -> dict[str, Any]:
        return {**FenceStore._params(resource, key, token, owner, idempotency_key, store_id), "key": CROSS_KEY}


class NoFenceStore(FenceStore):
    """BROKEN ON PURPOSE: ``transaction()`` writes without advancing (or even reading) the fence."""

    def __init__(self, dsn: str, **kwargs: Any) -> None:
        super().__init__(dsn, **kwargs)
        self._own = _OwnConnection(
            dsn, kwargs["connect_timeout"].total_seconds(), kwargs["statement_timeout"].total_seconds()
        )

    @contextmanager
    def transaction(  # type: ignore[override]
        self, resource: str, token: int, *, key: str, owner: str | None = None, idempotency_key: str | None = None,
        timeout: timedelta | None = None, run: RunRef | None = None, **fence_args: Any,
    ) -> Iterator[Any]:
        conn = self._own.get()
        try:
            conn.autocommit = False
            with conn, conn.cursor() as cur:
                yield cur
        except psycopg2.Error as exc:
            raise self._own.fail(exc) from exc
        finally:
            if self._own.conn is not None and not self._own.conn.closed:
                self._own.conn.autocommit = True


class RecordingHttpLeaseStore(HttpLeaseStore):
    """The real :class:`~airflow_lease_provider.client.HttpLeaseStore` (the lease API through the harness's
    API server); renewals (made by the keeper thread) and releases are recorded as the direct store's are.

    An acquire names a ``request_id`` and, when its answer is lost (a timeout, a 5xx, a refused connection:
    ``LeaseStoreUnavailable``), is sent once more with the same id, as a client of the API should: the API
    answers the grant the first send made (and its capability) while it is live, and must never grant the
    same request twice (the checker's ``api-granted-twice``). The first send's loss is recorded."""

    def __init__(self, base_url: str, secret: str, *, recorder: Recorder, timeout: timedelta) -> None:
        super().__init__(base_url, secret, timeout=timeout)
        self.recorder = recorder

    def _resent(self, op: str, call: Any, key: str, owner: str, **fields: Any) -> Acquisition:
        request_id = secrets.token_urlsafe(24)
        t0 = time.monotonic()
        try:
            return call(request_id)  # type: ignore[no-any-return]
        except LeaseStoreUnavailable as exc:
            self.recorder.op(op, t0=t0, key=key, owner=owner, outcome="unknown", error=str(exc), resent=True,
                             http=True, **fields)
        return call(request_id)

    def try_acquire(self, key: str, owner: str, ttl: timedelta, *, slots: int = 1, **kwargs: Any) -> Acquisition:
        return self._resent(
            "acquire", lambda rid: super(RecordingHttpLeaseStore, self).try_acquire(
                key, owner, ttl, slots=slots, request_id=rid, **kwargs),
            key, owner, asked=slots,
        )

    def try_replace(self, key: str, owner: str, ttl: timedelta, *, run_after: datetime, **kwargs: Any) -> Acquisition:
        return self._resent(
            "replace", lambda rid: super(RecordingHttpLeaseStore, self).try_replace(
                key, owner, ttl, run_after=run_after, request_id=rid, **kwargs),
            key, owner, asked=1, run_after=run_after,
        )

    def renew(self, lease: Lease, ttl: timedelta | None = None) -> Lease | None:
        return recorded_renewal(
            self.recorder, lease, lambda: super(RecordingHttpLeaseStore, self).renew(lease, ttl), http=True
        )

    def new_place_id(self, owner: str) -> str:
        """Forget ``owner``'s place id (and the capabilities of its places): its next claim names another
        request id, as a new process of the owner that was not handed the place id would."""
        self._place_ids.pop(owner, None)
        for place in [p for p in self._places if p[1] == owner]:
            del self._places[place]
        return self.place_id(owner)

    def wait_release_with(self, key: str, owner: str, capability: str) -> bool:
        """``/wait/release`` with ``capability`` as the credential (the chaos worker's forged one): whether
        the API answered 200 (it gave a place back)."""
        code, _ = self._send("POST", "/wait/release", capability, {"key": key, "owner": owner})
        return code == 200

    def release(self, lease: Lease, **kwargs: Any) -> bool:
        return recorded_release(
            self.recorder, lease, lambda: super(RecordingHttpLeaseStore, self).release(lease, **kwargs), http=True
        )
