"""The resource-side gate: a write target remembers the largest fencing token it accepted.

The PostgreSQL implementation of :class:`~airflow_lease_provider.core.fencing.Fence`: it decides inside one
plpgsql call (``fence_advance``, for atomicity), by the rule :func:`~airflow_lease_provider.core.fencing.decide`
states and the parity test checks it against (docs/core.md, "Fences").

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any, Unpack

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.db import CallerError, Row, callers_statements
from airflow_lease_provider.core.errors import LeaseError, OutcomeUnknown
from airflow_lease_provider.core.events import EventLedger
from airflow_lease_provider.core.fencing import (
    Fence,
    FenceDecision,
    Publish,
    checked_publish,
    publish_params,
    record_rejection,
)
from airflow_lease_provider.core.identity import RunRef
from airflow_lease_provider.core.schema import check_fence_schema, ensure_fence_schema
from airflow_lease_provider.core.store import Store

log = logging.getLogger(__name__)


class FenceStore(Store, Fence):
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
            # Not sent again after a lost answer: a resend could delete a claim the same grant made since.
            rows = self._ready().run("fence_claim_release", params, durable=True, retry=False)
        except OutcomeUnknown as exc:
            log.warning(
                "fence %r: the answer to giving back the claim of idempotency key %r was lost (%s); it may or "
                "may not be claimed still (fence_publish says)",
                params["resource"], params["idempotency_key"], exc,
            )
            return False
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
        self, resource: str, token: int, **publish: Unpack[Publish]
    ) -> FenceDecision:
        """Advance the fence of ``resource`` for lease ``key`` to ``token`` if it is larger than every token
        of that key accepted so far, or equal to the largest and published by its ``owner`` again (the
        same grant: a second task of a run lease, a mapped instance, a second publish of one task;
        not without an ``owner``, and not from another lease store). Tokens of other lease keys are never
        compared with it.

        With ``idempotency_key``, the publish is also recorded under that key (per resource, whatever the
        lease key), atomically, and a key already published is refused whatever the token. With
        ``store_id`` (the issuing :attr:`LeaseStore.store_id`) the fence records where its token came
        from, and, kept in that very store, also refuses a token below the key's newest grant
        (``superseded``: after a force-release, before a later token has published here). One statement,
        no read-then-write window. Never sent again after a lost answer (a resend would refuse its own
        first success): that raises :class:`~airflow_lease_provider.core.errors.OutcomeUnknown`, the publish
        may or may not have been accepted (docs/core.md, "Statements sent again after a lost connection").
        """
        params = checked_publish(resource, token, publish, self._params)
        rows = self._ready().run("fence_advance", params, durable=True, retry=False)
        return self._reported(params, self._decision(params, rows[0]), publish.get("run"))

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

    def published(self, resource: str, idempotency_key: str) -> bool:
        """Whether ``idempotency_key`` is claimed at ``resource`` (published, or its side effect in flight)."""
        params = {
            "resource": validation.lookup_name("resource", resource),
            "idempotency_key": validation.lookup_name("idempotency_key", idempotency_key),
        }
        return bool(self._ready().run("fence_published", params))

    @contextmanager
    def transaction(
        self, resource: str, token: int, *, timeout: timedelta | None = None, **publish: Unpack[Publish]
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
        params = checked_publish(resource, token, publish, self._params)
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
            self._reported(params, rejected, publish.get("run"))
            rejected.raise_if_rejected()

    def advance_in(
        self, cursor: Any, resource: str, token: int, **publish: Unpack[Publish]
    ) -> FenceDecision:
        """Advance the fence inside the caller's own transaction (a psycopg2 cursor on this database).

        Raises :class:`StaleFencingToken` when refused; the caller's transaction should then roll back.
        The schema must already exist in that database (any store operation or ``ensure_schema`` makes it).
        """
        params = checked_publish(resource, token, publish, self._params)
        decision = replace(self._decision(params, self.db.run_in(cursor, "fence_advance", params)[0]), _release=None)
        self._reported(params, decision, publish.get("run"))
        decision.raise_if_rejected()
        return decision

