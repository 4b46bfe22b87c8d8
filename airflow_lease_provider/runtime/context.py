"""What leased task code sees: the lease, the keeper, and fenced publishing.

Inside a leased task (``LeasedOperator``, ``@task.leased``, or a run-lease task),
:func:`current_lease` returns the :class:`LeaseContext`; a TaskFlow function can also take it as a
parameter named ``lease`` (``def publish(lease=None)``). Publishing goes through two gates:

1. the early safety net, :meth:`LeaseContext.check`: the keeper has not reported a loss, and a fresh
   read of the store shows this owner still holding this token;
2. the final gate, the fence at the write target, which accepts the token only if it is larger than
   every token it accepted before, or equal to the largest from this same holder publishing again
   (:meth:`LeaseContext.fence`, :meth:`LeaseContext.fenced_transaction`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from airflow_lease_provider.assets import asset_lease_key
from airflow_lease_provider.core import (
    DuplicatePublish,
    EventKind,
    FenceDecision,
    InvalidArgument,
    Lease,
    LeaseKeeper,
    LeaseLost,
    LeaseStore,
    RunRef,
    StaleFencingToken,
)
from airflow_lease_provider.runtime.outcomes import Outcome, report

#: XCom keys this provider writes. ``lease`` is also the key of the :class:`LeaseContext` in the task's context.
XCOM_LEASE = "lease"
XCOM_SKIP_REASON = "lease_skip_reason"

_current: contextvars.ContextVar[LeaseContext | None] = contextvars.ContextVar("lease_context", default=None)


def active() -> LeaseContext | None:
    """The lease of the running leased task, or None outside one."""
    return _current.get()


def current_lease() -> LeaseContext:
    """The lease of the running leased task. Raises ``RuntimeError`` outside one."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "no lease is held here: current_lease() works inside LeasedOperator, @task.leased, "
            "run-lease tasks and @task.fenced_publish"
        )
    return ctx


@dataclass
class LeaseContext:
    """A held lease, as the task sees it.

    :ivar lease: the lease as last renewed (key, owner, token, expiry in database time).
    :ivar store: the lease store it came from.
    :ivar keeper: the keeper renewing it, or ``None`` where nothing renews it (e.g. a publish task).
    :ivar conn_id: the connection of the lease's store (the task's ``lease_conn_id``; ``None`` is
        ``[lease] conn_id``): fences use it unless given another.
    :ivar detail: who holds it (dag_id, run_id, task_id, ...), for the ledger events it causes.
    :ivar run: the task instance holding it, for the run columns of the ledger events it causes.
    """

    lease: Lease
    store: LeaseStore
    keeper: LeaseKeeper | None = None
    tags: dict[str, str] = field(default_factory=dict)
    conn_id: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    run: RunRef | None = None
    #: With ``lease_on="outlets"``: the context of every lease the task holds, by key (this one included).
    leases: dict[str, LeaseContext] = field(default_factory=dict, repr=False, compare=False)
    #: The run's partition key (Airflow 3.2+), part of an asset's lease key.
    partition_key: str | None = None
    _loss_reported: bool = field(default=False, init=False, repr=False)
    _lease: Lease = field(init=False, repr=False, compare=False)

    @property
    def key(self) -> str:
        return self.lease.key

    @property
    def owner(self) -> str:
        return self.lease.owner

    @property
    def token(self) -> int:
        return self.lease.token

    @property
    def slot(self) -> int:
        """The slot held of a semaphore (``lease_slots=N``; :attr:`key` is then the slot's key, the one it
        fences under); 1 for a single-holder lease."""
        return self.lease.slot

    @property
    def slots(self) -> int:
        """The semaphore's slot count (``lease_slots``); 1 for a single-holder lease."""
        return self.lease.slots

    def for_key(self, key: str) -> LeaseContext:
        """The context of the task's lease on ``key`` (a task keyed by its outlets holds one per asset)."""
        if key == self.key:
            return self
        try:
            return self.leases[key]
        except KeyError:
            raise KeyError(f"this task holds no lease on {key!r} (it holds {sorted(self.leases) or [self.key]})") from None

    def for_asset(self, asset: Any) -> LeaseContext:
        """The lease of ``asset`` (an outlet of a task with ``lease_on="outlets"``): fence and publish what
        you write to that asset with it, so the fence sees that asset's token. The context the task gets
        (``lease``, ``current_lease()``) is the one of the first key in sorted order."""
        uri = getattr(asset, "uri", None)
        if not isinstance(uri, str):
            raise InvalidArgument("asset", asset, "must be an Asset, one of this task's outlets")
        try:
            return self.for_key(asset_lease_key(uri, self.partition_key))
        except KeyError:
            raise InvalidArgument(
                "asset", asset, f"is not an outlet this task holds a lease for (it holds {sorted(self.leases) or [self.key]})"
            ) from None

    def check(self) -> Lease:
        """The early safety net: raise :class:`LeaseLost` unless this owner still holds this token.

        Checks the keeper's verdict, then reads the store afresh (one round trip).
        """
        if self.keeper is not None:
            self.lease = self.keeper.check()
        holding = self.store.holds(self.key, self.owner, token=self.token)
        if holding.lease is None:
            lost = LeaseLost(self.key, self.token, f"the store no longer shows it as ours ({holding.who()})")
            self.report_loss(lost)
            raise lost
        return holding.lease

    def report_loss(self, lost: LeaseLost, logger: Any = None) -> None:
        """Record the loss of this lease once (ledger event, ``lease.lost``, log), however often it is seen.

        The keeper writes the event itself when it was the one to find the loss; then only the metric
        and the log line are added here.
        """
        if self._loss_reported:
            return
        self._loss_reported = True
        found_by_keeper = False
        if self.keeper is not None:
            self.keeper.stop()
            found_by_keeper = self.keeper.lost
            self.keeper.stop()  # waits for the keeper's own event, if asking just now declared the loss
        report(
            Outcome.LOST, store=self.store, key=self.key, owner=self.owner, token=self.token,
            detail={**self.detail, "reason": lost.reason}, tags=self.tags, logger=logger,
            message=f"{lost}; the task fails", recorded=found_by_keeper, run=self.run,
        )

    def fence(
        self, resource: str, *, conn_id: str | None = None, idempotency_key: str | None = None, asset: Any = None
    ) -> FenceDecision:
        """Check the lease, then advance the fence of ``resource`` to this token.

        For side effects outside PostgreSQL: call this first, then do the side effect carrying
        :attr:`token` so the target can check it too. A crash in between burns the token (safe).
        Raises :class:`StaleFencingToken` (or ``DuplicatePublish``) when the fence refuses.
        ``conn_id``: where the fence lives (default: the lease's own store, :attr:`conn_id`).

        With an ``idempotency_key``, use it as a context manager around the side effect::

            with lease.fence("blog.git", idempotency_key=slot):
                push_article(body, token=lease.token)

        An exception out of the block gives the key's claim back (the push failed: a retry may publish
        the slot); a block that completes, or a process killed inside it, keeps it (at most once: docs/core.md).
        The same holder may call this again for the same resource: an equal token from the same owner is
        accepted (docs/core.md, "The fence"). ``asset``: publish under the lease of that outlet asset
        (a task with ``lease_on="outlets"`` holds one per asset), as :meth:`for_asset` does.
        """
        if asset is not None:
            return self.for_asset(asset).fence(resource, conn_id=conn_id, idempotency_key=idempotency_key)
        self.check()
        fences = self._fences(conn_id)
        with self._refusal_reported(resource):
            decision: FenceDecision = fences.guard(resource, self.token, **self._as_holder(idempotency_key))
            return decision

    @contextmanager
    def fenced_transaction(
        self, resource: str, *, conn_id: str | None = None, idempotency_key: str | None = None, asset: Any = None
    ) -> Iterator[Any]:
        """Check the lease, then advance the fence and write in one transaction (exactly once).

        ``conn_id`` is the connection of the target database (default: the lease's own store,
        :attr:`conn_id`): PostgreSQL, or any connection whose hook is a common.sql ``DbApiHook`` of a
        dialect the fence is known to work on (SQLite; others are refused: docs/airflow.md, "Where the
        fence is kept"). The fence's tables are kept in that database, and the yielded DB-API cursor (the
        driver's own: psycopg2's, sqlite3's) writes in the same transaction as the fence advance.
        ``asset``: publish under the lease of that outlet asset (see :meth:`fence`). The lease is checked
        again after the block, before the commit: lost meanwhile (replaced, force-released, expired), the
        block's writes are rolled back and :class:`LeaseLost` is raised.
        """
        holder = self if asset is None else self.for_asset(asset)
        if holder is not self:
            with holder.fenced_transaction(resource, conn_id=conn_id, idempotency_key=idempotency_key) as cur:
                yield cur
            return
        self.check()
        fences = self._fences(conn_id)
        with self._refusal_reported(resource), fences.transaction(
            resource, self.token, **self._as_holder(idempotency_key)
        ) as cur:
            yield cur
            # Checked again right before the commit: a takeover (on_overlap="replace"), a force-release or a
            # loss while the caller's statements ran rolls them back (LeaseLost), where the fence, which
            # decided at the start, would have let them commit after it.
            self.check()

    def fenced_put(
        self,
        bucket: str,
        key: str,
        body: bytes | str,
        *,
        aws_conn_id: str | None = "aws_default",
        idempotency_key: str | None = None,
        asset: Any = None,
        **put_args: Any,
    ) -> Any:
        """Check the lease, then write ``body`` to ``s3://bucket/key`` fenced by the object store itself.

        The write is a compare-and-swap on the object's ETag carrying this lease's token in the object's
        metadata (:meth:`ObjectFence.put <airflow_lease_provider.fences.s3.ObjectFence.put>`): the
        store refuses it when a larger token of this lease key wrote the object since, and this raises
        :class:`StaleFencingToken` (``DuplicatePublish`` for a used ``idempotency_key``). The client comes
        from the Amazon provider's ``S3Hook(aws_conn_id)`` (the ``s3`` extra). ``put_args``: ``metadata``,
        ``content_type``, ``extra_args``. Returns the :class:`ObjectPublish` (the new ETag). ``asset``: write
        under the lease of that outlet asset (a task with ``lease_on="outlets"`` holds one per asset; default
        this context's lease, the first key's in sorted order).
        """
        from airflow_lease_provider.hooks.s3_fence import S3FenceHook  # needs the s3 extra (botocore)

        if asset is not None:
            return self.for_asset(asset).fenced_put(
                bucket, key, body, aws_conn_id=aws_conn_id, idempotency_key=idempotency_key, **put_args
            )
        self.check()
        try:
            return S3FenceHook(aws_conn_id).put(
                bucket, key, body, token=self.token, lease_key=self.key, owner=self.owner,
                store_id=self.store.store_id, idempotency_key=idempotency_key,
                count_epoch=self.lease.count_epoch, base_key=self.lease.lease_key, **put_args,
            )
        except StaleFencingToken as refused:
            resource = f"s3://{bucket}/{key}"
            if self.store.record_events:  # the object store keeps no ledger: the lease store's records it
                detail: dict[str, Any] = {
                    "outcome": "duplicate" if isinstance(refused, DuplicatePublish) else "stale",
                    "lease_key": self.key, "current_token": refused.current, "fence_at": "object store",
                    "idempotency_key": idempotency_key,
                }
                if refused.reason not in ("stale", "duplicate"):
                    detail["reason"] = refused.reason
                self.store.events.record(
                    EventKind.FENCE_REJECTED, resource, owner=self.owner, token=self.token, detail=detail,
                    run=self.run,
                )
            self._rejected(resource, refused)
            raise

    def _fences(self, conn_id: str | None) -> Any:
        """The fence kept in the database of ``conn_id`` (default the lease store's): the store's own fence
        on PostgreSQL, the DB-API fence on another DbApiHook connection (hooks/dbapi_fence.py)."""
        from airflow_lease_provider.hooks.dbapi_fence import fence_store  # not paid by tasks that never fence

        if conn_id is None and hasattr(self.store, "fences"):  # the API path: the api-server's fence (docs/api.md)
            return self.store.fences()
        return fence_store(conn_id, default_conn_id=self.conn_id, lease_store=self.store)

    def _as_holder(self, idempotency_key: str | None) -> dict[str, Any]:
        """Who asks the fence: this lease's key (the slot's), owner, task instance and store, and its grant's
        count epoch with the lease key it is of, so the fence refuses a holder of an earlier holding period of
        the key (a zombie of a slot dropped when the slot count was lowered: docs/core.md, "The fence")."""
        lease = self.lease
        return {
            "key": self.key, "owner": self.owner, "idempotency_key": idempotency_key, "run": self.run,
            "store_id": self.store.store_id, "count_epoch": lease.count_epoch, "base_key": lease.lease_key,
        }

    @contextmanager
    def _refusal_reported(self, resource: str) -> Iterator[None]:
        """A refusal of the fence of ``resource`` is reported (``fence_rejected``), then raised."""
        try:
            yield
        except StaleFencingToken as refused:
            self._rejected(resource, refused)
            raise

    def _rejected(self, resource: str, refused: StaleFencingToken) -> None:
        report(
            Outcome.FENCE_REJECTED, store=self.store, key=resource, owner=self.owner, token=self.token,
            tags={**self.tags, "resource": resource}, message=f"the fence of {resource!r} refused: {refused}",
            run=self.run,
        )

    def to_dict(self) -> dict[str, Any]:
        return self.lease.to_dict()


def _current_lease(self: LeaseContext) -> Lease:
    """The lease as last renewed: the keeper's, while one keeps it (it renews in its own thread)."""
    keeper = self.keeper
    return keeper.lease if keeper is not None else self._lease


def _set_lease(self: LeaseContext, lease: Lease) -> None:
    self._lease = lease


# ``lease`` stays the dataclass's first field (``LeaseContext(lease=...)``); reading it asks the keeper, so
# it is the lease as last renewed, not the one the task acquired (whose expiry is one TTL after the acquire).
LeaseContext.lease = property(_current_lease, _set_lease)  # type: ignore[assignment]


@contextmanager
def activated(ctx: LeaseContext) -> Iterator[LeaseContext]:
    """Make ``ctx`` what :func:`current_lease` returns for the duration."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
