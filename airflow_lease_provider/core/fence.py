"""The resource-side gate: a write target remembers the largest fencing token it accepted.

The runner's own "do I still hold the lease?" check is only an early safety net; this is the final
gate. A zombie that wakes up late carries a smaller token than the run that replaced it and is turned
away here, whatever it believes about its lease. The holder of the largest token may publish again
(an equal token from the same owner of the same lease store is the same grant: docs/core.md, "The fence").

A fence is kept per (resource, lease key): tokens are counted per lease key, so a token is only ever
compared with tokens of the same key. Holders of different keys were never mutually exclusive, so their
token order says nothing about which of them is stale (docs/core.md, "The fence").
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from types import TracebackType
from typing import Any

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.db import CallerError, Row, callers_statements
from airflow_lease_provider.core.errors import (
    DuplicatePublish,
    InvalidArgument,
    LeaseError,
    StaleFencingToken,
)
from airflow_lease_provider.core.events import EventKind, EventLedger
from airflow_lease_provider.core.identity import RunRef
from airflow_lease_provider.core.schema import check_fence_schema, ensure_fence_schema
from airflow_lease_provider.core.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FenceDecision:
    """What the fence said. ``outcome`` is ``accepted``, ``stale``, ``superseded``, ``count_epoch`` or
    ``duplicate``.

    :ivar current_token: the largest token the resource has accepted for this lease key, after this decision.
    :ivar store_id: the lease store the publish said its token came from (``None``: not said).
    :ivar current_store: the lease store the fence's current token came from (``None``: unknown).
    :ivar newest_grant: the key's newest grant, where the fence is kept in the lease store that issued the
        token (``superseded``: the token is below it); for ``count_epoch``, the key's count epoch the token
        is at or below (a later holding period of the key began above it).

    Also a context manager for a side effect outside the database, with an idempotency key: the claim of
    the key is given back when the block raises, so a failed side effect can be retried (see
    :meth:`FenceStore.guard`). A block that completes, or a process that dies inside it, keeps the claim.
    """

    resource: str
    token: int
    outcome: str
    current_token: int | None
    idempotency_key: str | None = None
    key: str | None = None
    store_id: str | None = None
    current_store: str | None = None
    newest_grant: int | None = None
    _release: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    @property
    def accepted(self) -> bool:
        return self.outcome == "accepted"

    @property
    def other_store(self) -> bool:
        """Refused, and the fence's token came from another lease store than this publish's."""
        return (
            self.outcome == "stale" and self.store_id is not None and self.current_store is not None
            and self.store_id != self.current_store
        )

    @property
    def reason(self) -> str:
        """Why it was refused: ``stale``, ``superseded``, ``count_epoch``, ``other_store``, ``duplicate``
        (``accepted`` if not)."""
        return "other_store" if self.other_store else self.outcome

    def raise_if_rejected(self) -> None:
        if self.outcome == "duplicate":
            assert self.idempotency_key is not None
            raise DuplicatePublish(self.resource, self.token, self.idempotency_key, self.current_token)
        if self.outcome != "accepted":
            raise StaleFencingToken(
                self.resource, self.token, self.current_token, self.reason, newest=self.newest_grant, key=self.key
            )

    def release(self) -> bool:
        """Give back this publish's idempotency claim (its side effect did not happen). True if one was given
        back; False without an idempotency key, or when the claim could not be given back (logged)."""
        return self._release() if self._release is not None else False

    def __enter__(self) -> FenceDecision:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self.release()


def _store_id(value: object) -> str | None:
    if value is None:
        return None
    try:
        return str(uuid.UUID(str(value))) if isinstance(value, str | uuid.UUID) else _bad_store_id(value)
    except ValueError:
        return _bad_store_id(value)


def _bad_store_id(value: object) -> str:
    raise InvalidArgument("store_id", value, "must be a lease store's id (LeaseStore.store_id), a UUID")


def publish_params(
    resource: str, key: str, token: int, owner: str | None, idempotency_key: str | None,
    store_id: str | None = None,
) -> dict[str, Any]:
    """A publish's arguments, checked (each bad one named in an :class:`InvalidArgument`): what every
    fence (this module's, :mod:`~airflow_lease_provider.core.dbapi_fence`'s) is asked with."""
    resource = validation.name("resource", resource)
    key = validation.lookup_name("key", key)
    validation.token("token", token)
    if owner is not None:
        validation.owner("owner", owner)
    if idempotency_key is not None:
        idempotency_key = validation.name("idempotency_key", idempotency_key)
    return {
        "resource": resource, "key": key, "token": token, "owner": owner, "idempotency_key": idempotency_key,
        "store_id": _store_id(store_id),
    }


def count_epoch_params(params: dict[str, Any], count_epoch: int | None, base_key: str | None) -> dict[str, Any]:
    """The count epoch a publish names, checked against its :func:`publish_params`
    (:func:`validation.count_epoch <airflow_lease_provider.core.validation.count_epoch>`): what every fence is
    asked with besides them."""
    epoch, base = validation.count_epoch(params["key"], params["token"], count_epoch, base_key)
    return {"count_epoch": epoch, "base_key": base}


def record_rejection(
    decision: FenceDecision, *, owner: str | None, run: RunRef | None, fence_at: str | None,
    ledger: EventLedger | None,
) -> None:
    """Log a refusal of the fence, and record it (``fence_rejected``) in ``ledger`` when given: the lease
    store's, best effort (:meth:`EventLedger.record` logs instead of raising). ``fence_at``: where the
    fence is kept, when that is not the ledger's own database."""
    log.warning(
        "fence %r (lease key %r) rejected token %s (%s); it has accepted token %s",
        decision.resource, decision.key, decision.token, decision.reason, decision.current_token,
    )
    if ledger is None:
        return
    detail: dict[str, Any] = {
        "outcome": decision.outcome,
        "lease_key": decision.key,
        "current_token": decision.current_token,
        "idempotency_key": decision.idempotency_key,
    }
    if decision.reason != decision.outcome:
        detail["reason"] = decision.reason
    if decision.newest_grant is not None:
        detail["newest_grant"] = decision.newest_grant
    if fence_at is not None:
        detail["fence_at"] = fence_at
    ledger.record(EventKind.FENCE_REJECTED, decision.resource, owner=owner, token=decision.token, detail=detail, run=run)


class FenceStore(Store):
    """Fences on PostgreSQL: usually the database you publish to, so the fence and the write can share
    a transaction. One fence per (resource, lease key): pass the lease's key as ``key``.

    Takes :class:`~airflow_lease_provider.core.store.Store`'s arguments; ``record_events`` writes fence
    rejections to the event ledger. Every publish takes ``run=``: the
    :class:`~airflow_lease_provider.core.identity.RunRef` publishing, stored with a rejection's event,
    and ``store_id=``: the id of the lease store that issued the token (:attr:`LeaseStore.store_id`), so
    a refusal can tell a recreated store, and a fence in that store can refuse a token below the key's
    newest grant.

    :param fence_only: for a write target that holds no lease store: where there is no store schema yet,
        create only what the fence needs (its two tables and two functions, no lease, ledger or epoch).
        A schema that holds a whole store already (an older version made one) is used, and migrated, as
        it is. Rejections then go to ``ledger`` (nothing else is written there).
    :param ledger: the event ledger that records rejections (the lease store's ``events``); default this
        database's own (none with ``fence_only``: rejections are then only logged).
    """

    #: A publish's checked arguments (:func:`publish_params`), through one method of the store so that a
    #: subclass sees every publish's parameters: the fault harness's broken-on-purpose fences
    #: (``chaos/stores.py``) override it, and the checker must catch them.
    _params = staticmethod(publish_params)

    def __init__(
        self, dsn: str, *, fence_only: bool = False, ledger: EventLedger | None = None, **kwargs: Any
    ) -> None:
        super().__init__(dsn, **kwargs)
        self.fence_only = fence_only
        self._own_ledger = ledger is None and not fence_only
        if ledger is not None:
            self.events = ledger

    def _ready(self) -> Any:
        if not self.fence_only:
            return super()._ready()
        if not self._schema_ready:
            if self.read_only:
                check_fence_schema(self.db)
            else:
                ensure_fence_schema(self.db)
            self._schema_ready = True
        return self.db

    def ensure_schema(self) -> int:
        """Create or migrate the schema now (with ``fence_only``, only the fence where no store is)."""
        if not self.fence_only:
            return super().ensure_schema()
        version = ensure_fence_schema(self.db)
        self._schema_ready = True
        return version

    @property
    def _records(self) -> bool:
        return self.record_events and (self._own_ledger or self.events.db is not self.db)

    def _publish(
        self, resource: str, key: str, token: int, owner: str | None, idempotency_key: str | None,
        store_id: str | None, count_epoch: int | None, base_key: str | None,
    ) -> dict[str, Any]:
        """A publish's checked arguments: :attr:`_params`' and the count epoch's (:func:`count_epoch_params`)."""
        params = self._params(resource, key, token, owner, idempotency_key, store_id)
        return {**params, **count_epoch_params(params, count_epoch, base_key)}

    def _decision(self, params: dict[str, Any], row: Row) -> FenceDecision:
        """The decision of a ``fence_advance`` row (outcome, current_token, current_store, newest_grant)."""
        release = None
        if row["outcome"] == "accepted" and params["idempotency_key"] is not None:

            def release() -> bool:
                return self._give_back(params)

        current, store, newest = row["current_token"], row["current_store"], row["newest_grant"]
        return FenceDecision(
            params["resource"], params["token"], row["outcome"], None if current is None else int(current),
            params["idempotency_key"], params["key"], params["store_id"],
            None if store is None else str(store), None if newest is None else int(newest),
            release,
        )

    def _give_back(self, params: dict[str, Any]) -> bool:
        """Delete this publish's idempotency claim (its own: same resource, key, token and owner)."""
        try:
            rows = self._ready().run("fence_claim_release", params, durable=True, retry=False)
        except LeaseError as exc:
            log.warning(
                "fence %r: could not give back the claim of idempotency key %r (%s); it stays claimed: the "
                "slot counts as published until the claim is deleted",
                params["resource"], params["idempotency_key"], exc,
            )
            return False
        given_back = bool(rows)
        if given_back:
            log.info(
                "fence %r: the side effect failed; idempotency key %r is free again",
                params["resource"], params["idempotency_key"],
            )
        return given_back

    def _reported(self, params: dict[str, Any], decision: FenceDecision, run: RunRef | None) -> FenceDecision:
        """``decision``, logged and recorded in the ledger when it is a rejection."""
        if not decision.accepted:
            record_rejection(
                decision, owner=params["owner"], run=run,
                fence_at=f"{self.db.where} schema {self.schema}" if self.events.db is not self.db else None,
                ledger=self.events if self._records else None,
            )
        return decision

    def advance(
        self,
        resource: str,
        token: int,
        *,
        key: str,
        owner: str | None = None,
        idempotency_key: str | None = None,
        run: RunRef | None = None,
        store_id: str | None = None,
        count_epoch: int | None = None,
        base_key: str | None = None,
    ) -> FenceDecision:
        """Advance the fence of ``resource`` for lease ``key`` to ``token`` if it is larger than every token
        of that key accepted so far, or equal to the largest and published by its ``owner`` again (the
        same grant: a second task of a run-scoped lease, a mapped instance, a second publish of one task;
        not without an ``owner``, and not from another lease store). Tokens of other lease keys are never
        compared with it.

        With ``idempotency_key``, the publish is also recorded under that key (per resource, whatever the
        lease key), atomically, and a key already published is refused whatever the token. With
        ``store_id`` (the issuing :attr:`LeaseStore.store_id`) the fence records where its token came
        from, and, kept in that very store, also refuses a token below the key's newest grant
        (``superseded``: after a force-release, before a later token has published here). One statement,
        no read-then-write window. Never retried automatically: a resend after a lost reply would refuse
        its own first success.
        """
        params = self._publish(resource, key, token, owner, idempotency_key, store_id, count_epoch, base_key)
        rows = self._ready().run("fence_advance", params, durable=True, retry=False)
        return self._reported(params, self._decision(params, rows[0]), run)

    def accept(
        self,
        resource: str,
        token: int,
        *,
        key: str,
        owner: str | None = None,
        idempotency_key: str | None = None,
        run: RunRef | None = None,
        store_id: str | None = None,
        count_epoch: int | None = None,
        base_key: str | None = None,
    ) -> bool:
        """True iff the fence accepted ``token`` (see :meth:`advance`) and the idempotency key was unused."""
        return self.advance(
            resource, token, key=key, owner=owner, idempotency_key=idempotency_key, run=run, store_id=store_id,
            count_epoch=count_epoch, base_key=base_key,
        ).accepted

    def guard(
        self,
        resource: str,
        token: int,
        *,
        key: str,
        owner: str | None = None,
        idempotency_key: str | None = None,
        run: RunRef | None = None,
        store_id: str | None = None,
        count_epoch: int | None = None,
        base_key: str | None = None,
    ) -> FenceDecision:
        """Like :meth:`advance`, but raise :class:`StaleFencingToken` (or :class:`DuplicatePublish`).

        For a side effect outside this database, use the decision as a context manager around it::

            with fences.guard("git:site", token, key=key, owner=owner, idempotency_key=slot):
                push(token)

        The idempotency key is claimed before the block; an exception out of the block gives the claim back
        (the side effect did not happen), so a retry can publish the slot. A block that completes keeps it,
        and so does a process that dies inside the block: at most once, failing toward "not published again"
        (docs/core.md, "At most once outside the database"). The fence's token stays advanced either way,
        which the same holder may publish with again.
        """
        decision = self.advance(
            resource, token, key=key, owner=owner, idempotency_key=idempotency_key, run=run, store_id=store_id,
            count_epoch=count_epoch, base_key=base_key,
        )
        decision.raise_if_rejected()
        return decision

    def current(self, resource: str, *, key: str) -> int | None:
        """The largest token of lease ``key`` accepted at ``resource`` (or ``None``): a publish must exceed
        it, or equal it from the same owner (the same grant)."""
        resource = validation.lookup_name("resource", resource)
        key = validation.lookup_name("key", key)
        rows = self._ready().run("fence_current", {"resource": resource, "key": key})
        return int(rows[0]["token"]) if rows and rows[0]["token"] is not None else None

    def tokens(self, resource: str) -> dict[str, int]:
        """Every lease key's largest accepted token at ``resource`` (for status pages)."""
        resource = validation.lookup_name("resource", resource)
        return {row["key"]: int(row["token"]) for row in self._ready().run("fence_tokens", {"resource": resource})}

    @contextmanager
    def transaction(
        self,
        resource: str,
        token: int,
        *,
        key: str,
        owner: str | None = None,
        idempotency_key: str | None = None,
        timeout: timedelta | None = None,
        run: RunRef | None = None,
        store_id: str | None = None,
        count_epoch: int | None = None,
        base_key: str | None = None,
    ) -> Iterator[Any]:
        """Advance the fence and write in one transaction: exactly once when the target is this database.

        Yields a cursor inside the transaction after the fence accepted ``token`` for lease ``key``;
        everything written through it commits together with the fence, or not at all. Raises
        :class:`StaleFencingToken` (nothing written) when the fence refuses the token.

        :param timeout: the server-side ``statement_timeout`` of each of *your* statements through the
            cursor. Default ``None``: no limit from the store (the server's or role's own setting applies).
            The fence statement keeps the store's ``statement_timeout``, and the commit is watched like any
            store statement; your statements are never cut off by the store's watchdog.

        An error in your own SQL (``SELECT 1/0``, a constraint violation, a timeout you set) reaches you as
        the driver's own exception (e.g. ``psycopg2.errors.DivisionByZero``), after the transaction was
        rolled back (the fence did not advance); the store's errors stay :class:`LeaseStoreUnavailable` /
        :class:`~airflow_lease_provider.core.db.LeaseStoreError`, and so does a connection that dies under
        one of your statements (the server crashed or was cut off): nothing of the transaction committed,
        since its commit was never sent.
        """
        params = self._publish(resource, key, token, owner, idempotency_key, store_id, count_epoch, base_key)
        if timeout is not None:
            validation.positive_timedelta("timeout", timeout)
        db = self._ready()
        rejected: FenceDecision | None = None
        try:
            with db.transaction() as cur:
                decision = replace(self._decision(params, db.run_in(cur, "fence_advance", params)[0]), _release=None)
                if decision.accepted:
                    cur.execute(db.statement_timeout_sql(timeout))
                    # A driver error of the caller's own SQL reaches the caller as it is; a connection
                    # that died under it (the server crashed or was cut off) is the store unavailable.
                    with callers_statements(cur):
                        yield cur
                else:
                    rejected = decision
        except CallerError as wrapped:
            raise wrapped.error from None
        if rejected is not None:
            # Recorded after the (empty) transaction ended, on the autocommit connection.
            self._reported(params, rejected, run)
            rejected.raise_if_rejected()

    def advance_in(
        self,
        cursor: Any,
        resource: str,
        token: int,
        *,
        key: str,
        owner: str | None = None,
        idempotency_key: str | None = None,
        run: RunRef | None = None,
        store_id: str | None = None,
        count_epoch: int | None = None,
        base_key: str | None = None,
    ) -> FenceDecision:
        """Advance the fence inside the caller's own transaction (a psycopg2 cursor on this database).

        Raises :class:`StaleFencingToken` when refused; the caller's transaction should then roll back.
        The schema must already exist in that database (any store operation or ``ensure_schema`` makes it).
        """
        params = self._publish(resource, key, token, owner, idempotency_key, store_id, count_epoch, base_key)
        decision = replace(self._decision(params, self.db.run_in(cursor, "fence_advance", params)[0]), _release=None)
        self._reported(params, decision, run)
        decision.raise_if_rejected()
        return decision

