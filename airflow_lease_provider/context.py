"""What leased task code sees: the lease, the keeper, and fenced publishing.

Inside a leased task (``LeasedOperator``, ``@task.leased``, or a run-scoped task),
:func:`current_lease` returns the :class:`LeaseContext`; a TaskFlow function can also take it as a
parameter named ``lease`` (``def publish(lease=None)``). Publishing goes through two gates:

1. the early safety net, :meth:`LeaseContext.check`: the keeper has not reported a loss, and a fresh
   read of the store shows this owner still holding this token;
2. the final gate, the fence at the write target, which accepts the token only if it is larger than
   every token it accepted before (:meth:`LeaseContext.fence`, :meth:`LeaseContext.fenced_transaction`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from airflow_lease_provider import metrics
from airflow_lease_provider.core import (
    FenceDecision,
    Lease,
    LeaseKeeper,
    LeaseLost,
    LeaseStore,
    StaleFencingToken,
)

_current: contextvars.ContextVar[LeaseContext | None] = contextvars.ContextVar("lease_context", default=None)


def current_lease() -> LeaseContext:
    """The lease of the running leased task. Raises ``RuntimeError`` outside one."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "no lease is held here: current_lease() works inside LeasedOperator, @task.leased, "
            "run-scoped tasks and @task.fenced_publish"
        )
    return ctx


@dataclass
class LeaseContext:
    """A held lease, as the task sees it.

    :ivar lease: the lease as last renewed (key, owner, token, expiry in database time).
    :ivar store: the lease store it came from.
    :ivar keeper: the keeper renewing it, or ``None`` where nothing renews it (e.g. a publish task).
    """

    lease: Lease
    store: LeaseStore
    keeper: LeaseKeeper | None = None
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.lease.key

    @property
    def owner(self) -> str:
        return self.lease.owner

    @property
    def token(self) -> int:
        return self.lease.token

    def check(self) -> Lease:
        """The early safety net: raise :class:`LeaseLost` unless this owner still holds this token.

        Checks the keeper's verdict, then reads the store afresh (one round trip).
        """
        if self.keeper is not None:
            self.lease = self.keeper.check()
        holder = self.store.holder(self.key)
        if holder is None or holder.owner != self.owner or holder.token != self.token:
            who = holder.describe() if holder else "nobody holds it"
            lost = LeaseLost(self.key, self.token, f"the store no longer shows it as ours ({who})")
            metrics.incr("lease.lost", self.tags)
            raise lost
        return holder

    def fence(
        self, resource: str, *, conn_id: str | None = None, idempotency_key: str | None = None
    ) -> FenceDecision:
        """Check the lease, then advance the fence of ``resource`` to this token.

        For side effects outside PostgreSQL: call this first, then do the side effect carrying
        :attr:`token` so the target can check it too. A crash in between burns the token (safe).
        Raises :class:`StaleFencingToken` (or ``DuplicatePublish``) when the fence refuses.
        """
        from airflow_lease_provider.hooks import FenceHook

        self.check()
        fences = FenceHook(conn_id).get_store()
        try:
            return fences.guard(resource, self.token, key=self.key, owner=self.owner, idempotency_key=idempotency_key)
        except StaleFencingToken:
            metrics.incr("lease.fence_rejected", {**self.tags, "resource": resource})
            raise

    @contextmanager
    def fenced_transaction(
        self, resource: str, *, conn_id: str | None = None, idempotency_key: str | None = None
    ) -> Iterator[Any]:
        """Check the lease, then advance the fence and write in one transaction (exactly once).

        ``conn_id`` is the connection of the target database (default: the lease store's). The
        yielded psycopg2 cursor writes in the same transaction as the fence advance.
        """
        from airflow_lease_provider.hooks import FenceHook

        self.check()
        fences = FenceHook(conn_id).get_store()
        try:
            with fences.transaction(
                resource, self.token, key=self.key, owner=self.owner, idempotency_key=idempotency_key
            ) as cur:
                yield cur
        except StaleFencingToken:
            metrics.incr("lease.fence_rejected", {**self.tags, "resource": resource})
            raise

    def to_dict(self) -> dict[str, Any]:
        return self.lease.to_dict()


@contextmanager
def activated(ctx: LeaseContext) -> Iterator[LeaseContext]:
    """Make ``ctx`` what :func:`current_lease` returns for the duration."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
