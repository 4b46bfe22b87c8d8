"""The resource-side gate: a write target remembers the largest fencing token it accepted.

The runner's own "do I still hold the lease?" check is only an early safety net; this is the final
gate. A zombie that wakes up late carries a smaller token than the run that replaced it and is turned
away here, whatever it believes about its lease.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.db import translate
from airflow_lease_provider.core.errors import DuplicatePublish, StaleFencingToken
from airflow_lease_provider.core.events import EventKind
from airflow_lease_provider.core.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FenceDecision:
    """What the fence said. ``outcome`` is ``accepted``, ``stale`` or ``duplicate``.

    :ivar current_token: the largest token the resource has accepted, after this decision.
    """

    resource: str
    token: int
    outcome: str
    current_token: int | None
    idempotency_key: str | None = None

    @property
    def accepted(self) -> bool:
        return self.outcome == "accepted"

    def raise_if_rejected(self) -> None:
        if self.outcome == "duplicate":
            assert self.idempotency_key is not None
            raise DuplicatePublish(self.resource, self.token, self.idempotency_key, self.current_token)
        if self.outcome != "accepted":
            raise StaleFencingToken(self.resource, self.token, self.current_token)


class FenceStore(Store):
    """Fences on PostgreSQL: usually the database you publish to, so the fence and the write can share
    a transaction.

    Takes :class:`~airflow_lease_provider.core.store.Store`'s arguments; ``record_events`` writes fence
    rejections to this database's event ledger.
    """

    @staticmethod
    def _params(
        resource: str, token: int, owner: str | None, idempotency_key: str | None
    ) -> dict[str, Any]:
        validation.name("resource", resource)
        validation.token("token", token)
        if owner is not None:
            validation.name("owner", owner)
        if idempotency_key is not None:
            validation.name("idempotency_key", idempotency_key)
        return {"resource": resource, "token": token, "owner": owner, "idempotency_key": idempotency_key}

    def _decided(self, params: dict[str, Any], row: tuple[Any, ...]) -> FenceDecision:
        decision = FenceDecision(
            params["resource"], params["token"], row[0],
            int(row[1]) if row[1] is not None else None, params["idempotency_key"],
        )
        if not decision.accepted:
            log.warning(
                "fence %r rejected token %s (%s); it has accepted token %s",
                decision.resource, decision.token, decision.outcome, decision.current_token,
            )
            if self.record_events:
                self.events.record(
                    EventKind.FENCE_REJECTED, decision.resource, owner=params["owner"], token=decision.token,
                    detail={
                        "outcome": decision.outcome,
                        "current_token": decision.current_token,
                        "idempotency_key": decision.idempotency_key,
                    },
                )
        return decision

    def advance(
        self,
        resource: str,
        token: int,
        *,
        owner: str | None = None,
        idempotency_key: str | None = None,
    ) -> FenceDecision:
        """Advance the fence to ``token`` if it is larger than every token accepted so far.

        With ``idempotency_key``, the publish is also recorded under that key, atomically, and a key
        already published is refused whatever the token. One statement, no read-then-write window.
        Never retried automatically: a resend after a lost reply would refuse its own first success.
        """
        params = self._params(resource, token, owner, idempotency_key)
        rows = self._ready().run("fence_advance", params, durable=True, retry=False)
        return self._decided(params, rows[0])

    def accept(
        self,
        resource: str,
        token: int,
        *,
        owner: str | None = None,
        idempotency_key: str | None = None,
    ) -> bool:
        """True iff ``token`` is larger than every token accepted so far (and the key is unused)."""
        return self.advance(resource, token, owner=owner, idempotency_key=idempotency_key).accepted

    def guard(
        self,
        resource: str,
        token: int,
        *,
        owner: str | None = None,
        idempotency_key: str | None = None,
    ) -> FenceDecision:
        """Like :meth:`advance`, but raise :class:`StaleFencingToken` (or :class:`DuplicatePublish`)."""
        decision = self.advance(resource, token, owner=owner, idempotency_key=idempotency_key)
        decision.raise_if_rejected()
        return decision

    def current(self, resource: str) -> int | None:
        """The largest token ``resource`` has accepted, or ``None``."""
        validation.name("resource", resource)
        rows = self._ready().run("fence_current", {"resource": resource})
        return int(rows[0][0]) if rows else None

    @contextmanager
    def transaction(
        self,
        resource: str,
        token: int,
        *,
        owner: str | None = None,
        idempotency_key: str | None = None,
    ) -> Iterator[Any]:
        """Advance the fence and write in one transaction: exactly once when the target is this database.

        Yields a cursor inside the transaction after the fence accepted ``token``; everything written
        through it commits together with the fence, or not at all. Raises :class:`StaleFencingToken`
        (nothing written) when the fence refuses the token.
        """
        params = self._params(resource, token, owner, idempotency_key)
        db = self._ready()
        rejected: FenceDecision | None = None
        with db.transaction() as cur:
            cur.execute(db.query_text("fence_advance", cur.connection), params)
            row = cur.fetchone()
            decision = FenceDecision(resource, token, row[0], row[1], idempotency_key)
            if decision.accepted:
                yield cur
            else:
                rejected = decision
        if rejected is not None:
            # Recorded after the (empty) transaction ended, on the autocommit connection.
            self._decided(params, (rejected.outcome, rejected.current_token))
            rejected.raise_if_rejected()

    def advance_in(
        self,
        cursor: Any,
        resource: str,
        token: int,
        *,
        owner: str | None = None,
        idempotency_key: str | None = None,
    ) -> FenceDecision:
        """Advance the fence inside the caller's own transaction (a psycopg2 cursor on this database).

        Raises :class:`StaleFencingToken` when refused; the caller's transaction should then roll back.
        The schema must already exist in that database (any store operation or ``ensure_schema`` makes it).
        """
        params = self._params(resource, token, owner, idempotency_key)
        query = sql.SQL(
            "SELECT outcome, current_token FROM {schema}.fence_advance("
            "%(resource)s, %(token)s, %(owner)s, %(idempotency_key)s)"
        ).format(schema=sql.Identifier(self.db.schema))
        try:
            cursor.execute(query, params)
            row = cursor.fetchone()
        except psycopg2.Error as exc:
            raise translate(exc, self.db.where) from exc
        decision = FenceDecision(resource, token, row[0], row[1], idempotency_key)
        if not decision.accepted:
            self._decided(params, (decision.outcome, decision.current_token))
        decision.raise_if_rejected()
        return decision
