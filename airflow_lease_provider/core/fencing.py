"""Fences: one interface, one rule (docs/core.md, "Fences").

A fence is kept at a write target per (resource, lease key): it remembers the largest fencing token it
accepted and refuses a publish under an older one. Every fence of this package decides with :func:`decide`,
the rule written once here, and answers with a :class:`FenceDecision`:

- :class:`~airflow_lease_provider.core.fence.FenceStore`: on PostgreSQL, the lease store's own database or a
  target holding only the fence; it decides inside one plpgsql call (``fence_advance``) for atomicity, and
  the parity test (``tests/core/test_fence_parity.py``) checks that call against :func:`decide`;
- :class:`~airflow_lease_provider.core.dbapi_fence.DbApiFence`: in any SQL database a DB-API connection
  reaches (standard SQL, conditional ``UPDATE``), checked the same way;
- :class:`~airflow_lease_provider.fences.s3.ObjectFence`: at an S3-compatible object store, where the fence
  lives in the object's metadata and the decision is :func:`decide` itself, made before a conditional PUT.

:class:`FenceView` is what every fence answers (``current``, ``tokens``, ``published``); :class:`Fence` is a
fence kept beside the target's data, decided apart from the write (``advance``, ``accept``, ``guard``,
``transaction``). The object store's fence is the write itself (``ObjectFence.put``), so it is a view only.
"""

from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Required, TypedDict, Unpack

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import (
    DuplicatePublish,
    Interruption,
    InvalidArgument,
    LeaseLost,
    StaleFencingToken,
)
from airflow_lease_provider.core.events import EventKind, EventLedger
from airflow_lease_provider.core.identity import RunRef

log = logging.getLogger(__name__)

#: The outcomes of a publish, as :attr:`FenceDecision.outcome` names them.
OUTCOMES = ("accepted", "duplicate", "superseded", "count_epoch", "stale")


@dataclass(frozen=True)
class FenceEntry:
    """One lease key's fence at a resource: the largest token accepted, and who it was issued to."""

    token: int
    owner: str | None = None
    store_id: str | None = None


@dataclass(frozen=True)
class FenceState:
    """What a fence holds for one publish's (resource, lease key), read before it decides.

    :ivar entry: the key's fence (``None``: no token of the key accepted yet).
    :ivar count_epoch: the largest count epoch the base key's holders told this fence (``None``: none yet).
    :ivar claimed: the publish's idempotency key is claimed already at this resource.
    :ivar floor: a pre-version-3 fence's one token for every key of the resource (PostgreSQL only; else None).
    :ivar newest_grant: kept in the lease store that issued the token: the key's newest grant (else None).
    :ivar store_count_epoch: likewise: the key's count epoch in that store (else None).
    """

    entry: FenceEntry | None = None
    count_epoch: int | None = None
    claimed: bool = False
    floor: FenceEntry | None = None
    newest_grant: int | None = None
    store_count_epoch: int | None = None


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
    :meth:`Fence.guard`). A block that completes, or a process that dies inside it, keeps the claim,
    and so does a block interrupted from outside (:func:`outcome_unknown`: the side effect may have happened).
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
        """Refused, and the fence's token came from another lease store than this publish's (refused as stale,
        or below a count epoch that store's holders named: a recreated store's tokens start again at 1)."""
        return (
            self.outcome in ("stale", "count_epoch") and self.store_id is not None
            and self.current_store is not None and self.store_id != self.current_store
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
            current = self.current_token
            if self.other_store and self.newest_grant is not None:
                # The floor to raise the recreated store's tokens above is the larger of the two.
                current = max(current or 0, self.newest_grant)
            raise StaleFencingToken(
                self.resource, self.token, current, self.reason, newest=self.newest_grant, key=self.key
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
        if exc is None:
            return
        if outcome_unknown(exc):
            if self.idempotency_key is not None and self._release is not None:
                log.warning(
                    "fence %r: the side effect was interrupted (%s) and may have happened; idempotency key %r "
                    "stays claimed (delete its fence_publish row to publish the slot again)",
                    self.resource, type(exc).__name__, self.idempotency_key,
                )
            return
        self.release()


def outcome_unknown(exc: BaseException) -> bool:
    """Whether ``exc`` interrupted the code it came out of at a moment that code did not choose, so what it
    was doing may have completed: a lost lease (the keeper raises it in the task's main thread), an
    :class:`~airflow_lease_provider.core.errors.Interruption` (SIGTERM's ``TaskTerminated``), or anything
    that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``). A claim is never given back on one."""
    return isinstance(exc, LeaseLost | Interruption) or not isinstance(exc, Exception)


def store_id_of(value: object) -> str | None:
    """A lease store's id as its canonical UUID text (``None`` stays ``None``); :class:`InvalidArgument` else."""
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
    fence is asked with."""
    resource = validation.name("resource", resource)
    key = validation.lookup_name("key", key)
    validation.token("token", token)
    if owner is not None:
        validation.owner("owner", owner)
    if idempotency_key is not None:
        idempotency_key = validation.name("idempotency_key", idempotency_key)
    return {
        "resource": resource, "key": key, "token": token, "owner": owner, "idempotency_key": idempotency_key,
        "store_id": store_id_of(store_id),
    }


def count_epoch_params(params: dict[str, Any], count_epoch: int | None, base_key: str | None) -> dict[str, Any]:
    """The count epoch a publish names, checked against its :func:`publish_params`
    (:func:`validation.count_epoch <airflow_lease_provider.core.validation.count_epoch>`): what every fence is
    asked with besides them."""
    epoch, base = validation.count_epoch(params["key"], params["token"], count_epoch, base_key)
    return {"count_epoch": epoch, "base_key": base}


def checked_publish(
    resource: str, token: int, publish: Publish, params: Callable[..., dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A publish's arguments (``resource``, ``token`` and a :class:`Publish`), checked: ``params``' (default
    :func:`publish_params`) and :func:`count_epoch_params`, in one dict. ``TypeError`` for a missing ``key``
    or a name :class:`Publish` does not have, as a signature would."""
    unknown = sorted(set(publish) - set(Publish.__annotations__))
    if unknown:
        raise TypeError(f"a publish takes no argument {unknown[0]!r}")
    if "key" not in publish:
        raise TypeError("a publish needs key= (the lease's key)")
    checked = (params or publish_params)(
        resource, publish["key"], token, publish.get("owner"), publish.get("idempotency_key"), publish.get("store_id")
    )
    return {**checked, **count_epoch_params(checked, publish.get("count_epoch"), publish.get("base_key"))}


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


def decide(
    state: FenceState,
    *,
    resource: str,
    key: str,
    token: int,
    owner: str | None = None,
    store_id: str | None = None,
    idempotency_key: str | None = None,
    count_epoch: int | None = None,
) -> FenceDecision:
    """The fence rule (docs/core.md, "Fences"): what a fence holding ``state`` decides on a publish of
    ``token`` for lease ``key`` at ``resource``. Pure: the reference every fence follows.

    In this order: an idempotency key already claimed is ``duplicate``; kept in the issuing lease store, a
    token below the key's newest grant is ``superseded`` and one at or below the key's count epoch there is
    ``count_epoch``; with a ``count_epoch`` (the grant's), a token at or below the larger of it and the
    count epoch the base key's holders told this fence is ``count_epoch``; then the token is ``accepted`` if
    no token of the key was accepted yet, or it is larger than the largest, or equal to it from the same
    ``owner`` (not ``None``) of the same lease store (either store unknown counts as the same): the grant
    that token was issued for, publishing again. Anything else is ``stale``. Tokens of other lease keys are
    never compared with it.
    """
    current = state.entry if state.entry is not None else state.floor

    def refused(outcome: str, newest: int | None) -> FenceDecision:
        return FenceDecision(
            resource, token, outcome, None if current is None else current.token, idempotency_key, key, store_id,
            None if current is None else current.store_id, newest,
        )

    if idempotency_key is not None and state.claimed:
        return refused("duplicate", None)
    newest = state.newest_grant
    if newest is not None and token < newest:
        return refused("superseded", newest)
    if state.store_count_epoch is not None and token <= state.store_count_epoch:
        return refused("count_epoch", state.store_count_epoch)
    if count_epoch is not None:
        epoch = count_epoch if state.count_epoch is None else max(count_epoch, state.count_epoch)
        if token <= epoch:
            return refused("count_epoch", epoch)
    if not _accepts(state, token, owner, store_id):
        return refused("stale", newest)
    return FenceDecision(
        resource, token, "accepted", token, idempotency_key, key, store_id, advanced(state.entry, token, owner,
                                                                                    store_id).store_id, newest,
    )


def _accepts(state: FenceState, token: int, owner: str | None, store_id: str | None) -> bool:
    if state.floor is not None and token <= state.floor.token:
        return False
    entry = state.entry
    if entry is None or token > entry.token:
        return True
    return (
        token == entry.token and owner is not None and entry.owner == owner
        and (entry.store_id is None or store_id is None or entry.store_id == store_id)
    )


def advanced(entry: FenceEntry | None, token: int, owner: str | None, store_id: str | None) -> FenceEntry:
    """The key's fence after an accepted publish: its token and owner, and its lease store (a larger token's;
    the same grant's again keeps the one already known)."""
    if entry is None or token > entry.token:
        return FenceEntry(token, owner, store_id)
    return FenceEntry(token, owner, entry.store_id or store_id)


class Publish(TypedDict, total=False):
    """A publish's arguments besides the resource and token (see :meth:`Fence.advance`)."""

    key: Required[str]
    owner: str | None
    idempotency_key: str | None
    run: RunRef | None
    store_id: str | None
    count_epoch: int | None
    base_key: str | None


class FenceView(ABC):
    """What every fence answers about what it has accepted."""

    @abstractmethod
    def current(self, resource: str, *, key: str) -> int | None:
        """The largest token of lease ``key`` accepted at ``resource`` (``None``: none): a publish must exceed
        it, or equal it from the same owner (the same grant)."""

    @abstractmethod
    def tokens(self, resource: str) -> dict[str, int]:
        """Every lease key's largest accepted token at ``resource`` (for status pages)."""

    @abstractmethod
    def published(self, resource: str, idempotency_key: str) -> bool:
        """Whether ``idempotency_key`` is claimed at ``resource`` (published, or its publish in flight)."""


class Fence(FenceView):
    """A fence kept beside the target's data, decided apart from the write: the PostgreSQL and DB-API fences.

    Implementations give :meth:`advance` and :meth:`transaction`; :meth:`accept` and :meth:`guard` are
    :meth:`advance`'s decision as a bool and as an exception.
    """

    @abstractmethod
    def advance(self, resource: str, token: int, **publish: Unpack[Publish]) -> FenceDecision:
        """Advance the fence of ``resource`` for lease ``key`` to ``token`` by :func:`decide`'s rule, committed
        at once, and return the decision, refusals included (logged, and recorded in the ledger).

        :param key: the lease's key (required): tokens of other keys are never compared with ``token``.

        :param owner: the lease's owner: with it the same grant may publish again with an equal token.
        :param idempotency_key: claimed per resource with the publish; a key already claimed is refused
            (``duplicate``) whatever the token.
        :param run: the run publishing, stored with a refusal's event.
        :param store_id: the issuing lease store's id (:attr:`LeaseStore.store_id`).
        :param count_epoch: the grant's count epoch (:attr:`Lease.count_epoch`), with ``base_key`` the lease
            key whose slot ``key`` is (:attr:`Lease.lease_key`).
        """

    @abstractmethod
    def transaction(self, resource: str, token: int, **publish: Unpack[Publish]) -> AbstractContextManager[Any]:
        """Advance the fence and write in one transaction of the target: yields a cursor after the fence
        accepted ``token``; what is written through it commits with the fence, or not at all. Raises
        :class:`StaleFencingToken` (:class:`DuplicatePublish`) with nothing written when refused."""

    def accept(self, resource: str, token: int, **publish: Unpack[Publish]) -> bool:
        """True iff the fence accepted ``token`` (see :meth:`advance`) and the idempotency key was unused."""
        return self.advance(resource, token, **publish).accepted

    def guard(self, resource: str, token: int, **publish: Unpack[Publish]) -> FenceDecision:
        """:meth:`advance`, raising :class:`StaleFencingToken` (or :class:`DuplicatePublish`) when refused.

        For a side effect outside the target, use the decision as a context manager around it::

            with fences.guard("git:site", token, key=key, owner=owner, idempotency_key=slot):
                push(token)

        The idempotency key is claimed before the block; an exception out of the block gives the claim back
        (the side effect did not happen), so a retry can publish the slot. A block that completes keeps it,
        and so does a process that dies inside the block: at most once, failing toward "not published again"
        (docs/core.md, "At most once outside the database"). The fence's token stays advanced either way,
        which the same holder may publish with again.
        """
        decision = self.advance(resource, token, **publish)
        decision.raise_if_rejected()
        return decision
