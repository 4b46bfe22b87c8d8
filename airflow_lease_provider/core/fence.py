"""The resource-side gate: a write target remembers the largest fencing token it accepted.

The runner's own "do I still hold the lease?" check is only an early safety net; this is the final
gate. A zombie that wakes up late carries a smaller token than the run that replaced it and is turned
away here, whatever it believes about its lease.

A fence is kept per (resource, lease key): tokens are counted per lease key, so a token is only ever
compared with tokens of the same key. Holders of different keys were never mutually exclusive, so their
token order says nothing about which of them is stale (docs/core.md, "The fence").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.db import translate
from airflow_lease_provider.core.errors import DuplicatePublish, StaleFencingToken
from airflow_lease_provider.core.events import EventKind
from airflow_lease_provider.core.identity import RunRef
from airflow_lease_provider.core.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FenceDecision:
    """What the fence said. ``outcome`` is ``accepted``, ``stale`` or ``duplicate``.

    :ivar current_token: the largest token the resource has accepted for this lease key, after this decision.
    """

    resource: str
    token: int
    outcome: str
    current_token: int | None
    idempotency_key: str | None = None
    key: str | None = None

    @property
    def accepted(self) -> bool:
        return self.outcome == "accepted"

    def raise_if_rejected(self) -> None:
        if self.outcome == "duplicate":
            assert self.idempotency_key is not None
            raise DuplicatePublish(self.resource, self.token, self.idempotency_key, self.current_token)
        if self.outcome != "accepted":
            raise StaleFencingToken(self.resource, self.token, self.current_token)


class _CallerError(Exception):
    """Carries an error of the caller's own SQL inside :meth:`FenceStore.transaction` past the store's
    error translation, so the caller gets the driver's exception itself."""

    def __init__(self, error: psycopg2.Error) -> None:
        super().__init__(str(error))
        self.error = error


class FenceStore(Store):
    """Fences on PostgreSQL: usually the database you publish to, so the fence and the write can share
    a transaction. One fence per (resource, lease key): pass the lease's key as ``key``.

    Takes :class:`~airflow_lease_provider.core.store.Store`'s arguments; ``record_events`` writes fence
    rejections to this database's event ledger. Every publish takes ``run=``: the
    :class:`~airflow_lease_provider.core.identity.RunRef` publishing, stored with a rejection's event.
    """

    @staticmethod
    def _params(
        resource: str, key: str, token: int, owner: str | None, idempotency_key: str | None
    ) -> dict[str, Any]:
        resource = validation.name("resource", resource)
        key = validation.lookup_name("key", key)
        validation.token("token", token)
        if owner is not None:
            validation.owner("owner", owner)
        if idempotency_key is not None:
            idempotency_key = validation.name("idempotency_key", idempotency_key)
        return {
            "resource": resource, "key": key, "token": token, "owner": owner, "idempotency_key": idempotency_key,
        }

    @staticmethod
    def _decision(params: dict[str, Any], row: tuple[Any, ...]) -> FenceDecision:
        return FenceDecision(
            params["resource"], params["token"], row[0], int(row[1]) if row[1] is not None else None,
            params["idempotency_key"], params["key"],
        )

    def _decided(self, params: dict[str, Any], row: tuple[Any, ...], run: RunRef | None) -> FenceDecision:
        decision = self._decision(params, row)
        if not decision.accepted:
            log.warning(
                "fence %r (lease key %r) rejected token %s (%s); it has accepted token %s",
                decision.resource, decision.key, decision.token, decision.outcome, decision.current_token,
            )
            if self.record_events:
                self.events.record(
                    EventKind.FENCE_REJECTED, decision.resource, owner=params["owner"], token=decision.token,
                    detail={
                        "outcome": decision.outcome,
                        "lease_key": decision.key,
                        "current_token": decision.current_token,
                        "idempotency_key": decision.idempotency_key,
                    },
                    run=run,
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
    ) -> FenceDecision:
        """Advance the fence of ``resource`` for lease ``key`` to ``token`` if it is larger than every token
        of that key accepted so far. Tokens of other lease keys are never compared with it.

        With ``idempotency_key``, the publish is also recorded under that key (per resource, whatever the
        lease key), atomically, and a key already published is refused whatever the token. One statement,
        no read-then-write window. Never retried automatically: a resend after a lost reply would refuse its
        own first success.
        """
        params = self._params(resource, key, token, owner, idempotency_key)
        rows = self._ready().run("fence_advance", params, durable=True, retry=False)
        return self._decided(params, rows[0], run)

    def accept(
        self,
        resource: str,
        token: int,
        *,
        key: str,
        owner: str | None = None,
        idempotency_key: str | None = None,
        run: RunRef | None = None,
    ) -> bool:
        """True iff ``token`` is larger than every token of lease ``key`` accepted so far (and the
        idempotency key is unused)."""
        return self.advance(resource, token, key=key, owner=owner, idempotency_key=idempotency_key, run=run).accepted

    def guard(
        self,
        resource: str,
        token: int,
        *,
        key: str,
        owner: str | None = None,
        idempotency_key: str | None = None,
        run: RunRef | None = None,
    ) -> FenceDecision:
        """Like :meth:`advance`, but raise :class:`StaleFencingToken` (or :class:`DuplicatePublish`)."""
        decision = self.advance(resource, token, key=key, owner=owner, idempotency_key=idempotency_key, run=run)
        decision.raise_if_rejected()
        return decision

    def current(self, resource: str, *, key: str) -> int | None:
        """The token a publish of lease ``key`` to ``resource`` must exceed (the largest accepted), or ``None``."""
        resource = validation.lookup_name("resource", resource)
        key = validation.lookup_name("key", key)
        rows = self._ready().run("fence_current", {"resource": resource, "key": key})
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    def tokens(self, resource: str) -> dict[str, int]:
        """Every lease key's largest accepted token at ``resource`` (for status pages)."""
        resource = validation.lookup_name("resource", resource)
        return {row[0]: int(row[1]) for row in self._ready().run("fence_tokens", {"resource": resource})}

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
        :class:`~airflow_lease_provider.core.db.LeaseStoreError`.
        """
        params = self._params(resource, key, token, owner, idempotency_key)
        if timeout is not None:
            validation.positive_timedelta("timeout", timeout)
        db = self._ready()
        rejected: FenceDecision | None = None
        try:
            with db.transaction() as cur:
                cur.execute(db.query_text("fence_advance", cur.connection), params)
                decision = self._decision(params, cur.fetchone())
                if decision.accepted:
                    cur.execute(db.statement_timeout_sql(timeout))
                    try:
                        yield cur
                    except psycopg2.Error as exc:
                        raise _CallerError(exc) from exc
                else:
                    rejected = decision
        except _CallerError as wrapped:
            raise wrapped.error from None
        if rejected is not None:
            # Recorded after the (empty) transaction ended, on the autocommit connection.
            self._decided(params, (rejected.outcome, rejected.current_token), run)
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
    ) -> FenceDecision:
        """Advance the fence inside the caller's own transaction (a psycopg2 cursor on this database).

        Raises :class:`StaleFencingToken` when refused; the caller's transaction should then roll back.
        The schema must already exist in that database (any store operation or ``ensure_schema`` makes it).
        """
        params = self._params(resource, key, token, owner, idempotency_key)
        query = sql.SQL(
            "SELECT outcome, current_token FROM {schema}.fence_advance("
            "%(resource)s, %(key)s, %(token)s, %(owner)s, %(idempotency_key)s)"
        ).format(schema=sql.Identifier(self.db.schema))
        try:
            cursor.execute(query, params)
            row = cursor.fetchone()
        except psycopg2.Error as exc:
            raise translate(exc, self.db.where) from exc
        decision = self._decision(params, row)
        if not decision.accepted:
            self._decided(params, (decision.outcome, decision.current_token), run)
        decision.raise_if_rejected()
        return decision
