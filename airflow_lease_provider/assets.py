"""Leases keyed by asset, and the lease token on asset events.

**Leases keyed by asset.** ``lease_on="outlets"`` (:data:`LEASE_ON_OUTLETS`) on ``LeasedOperator`` or
``@task.leased`` takes the lease on the task's asset outlets instead of a hand-written key::

    @task.leased(lease_on="outlets", outlets=[Asset("daily_sales", uri="s3://lake/sales")],
                 lease_ttl=timedelta(minutes=30))
    def publish(lease=None): ...

The key of an asset is :func:`asset_lease_key`: ``asset:`` and the asset's URI as Airflow normalised it,
so any task of any DAG writing that asset takes the same key (Airflow keeps URIs unique among active
assets). In a run with a partition key (Airflow 3.2+ partitioned runs: ``partition_key`` in the context)
the key is per partition: ``asset:<uri>#<partition_key>``. A pair that would not give a valid key as it
stands, or not an unambiguous one (over 512 characters, not in NFC, a URI with ``#``, a ``~`` in either
part, ...), gets its readable start, ``~`` and the SHA-256 of ``["asset", uri, partition_key]``. No two
(URI, partition key) pairs share a key (tests/airflow/test_asset_keys.py).

A task with several asset outlets takes one lease per asset, in the sorted order of their keys, all or
nothing: when one is held by another run, the ones taken are released and ``on_overlap`` decides (skip,
wait on the held one, or fail). Two tasks with overlapping outlet sets therefore never deadlock (nobody
waits while holding) and never both run. All the leases are renewed while the task runs and released
after it; losing any one fails the task.

**The token on the asset event.** A leased task's asset events carry its lease in their ``extra``, under
:data:`EXTRA_KEY` (``"lease"``): ``{"key", "token", "owner", "store_id"}`` (plus ``"partition_key"``),
each asset its own lease's when keyed by outlets, else the task's one lease. Airflow shows the extra in
its asset views and hands it to consumers (``triggering_asset_events``). :func:`is_stale` tells a
consumer whether the producer's token has been superseded since: see there.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_lease_provider.core import InvalidArgument, validation

#: ``lease_on`` values: ``"key"`` (the default: ``lease_key``, or the default key) and ``"outlets"``.
LEASE_ON_KEY = "key"
LEASE_ON_OUTLETS = "outlets"
LEASE_ON = (LEASE_ON_KEY, LEASE_ON_OUTLETS)
#: Where a leased task's lease goes in its asset events' ``extra``.
EXTRA_KEY = "lease"
#: How much of the readable key a hashed asset key keeps in front of its digest.
HASHED_PREFIX = 200


def _usable(key: str) -> bool:
    try:
        return validation.name("key", key) == key
    except InvalidArgument:
        return False


def asset_lease_key(uri: str, partition_key: str | None = None) -> str:
    """The lease key of the asset with URI ``uri`` (as ``Asset.uri`` holds it), for one partition if given.

    Injective: two different ``(uri, partition_key)`` pairs never get one key (docs/airflow.md, "Leases
    keyed by asset"). Two forms, told apart by ``~``, which only the second has:

    - **readable**: ``asset:<uri>`` or ``asset:<uri>#<partition_key>``, the texts as they are, when the URI
      has no ``#``, neither part has a ``~``, and the result is a valid key as it stands (at most 512
      characters, in NFC, no whitespace at its end, no invisible character). The first ``#`` after
      ``asset:`` is then the separator, so the key gives back the pair;
    - **hashed**: ``<readable start>~<sha256 of ["asset", uri, partition_key] as JSON>``, for every other
      pair: the digest is of the texts as given (not normalised: two texts that differ only in their
      Unicode normal form are two URIs to Airflow and two objects to S3), and the start only helps people.
    """
    readable = f"asset:{uri}" if partition_key is None else f"asset:{uri}#{partition_key}"
    if "#" not in uri and "~" not in readable and _usable(readable):
        return readable
    identity = json.dumps(["asset", uri, partition_key], ensure_ascii=True)
    # JSON with ensure_ascii: one text per encoding (a lone surrogate too), so one digest per pair.
    digest = hashlib.sha256(identity.encode("ascii")).hexdigest()
    start = "".join(c for c in readable if c.isalnum() or c in ".:_-/[]#@")
    key = f"{start[:HASHED_PREFIX]}~{digest}"
    if not _usable(key):
        key = f"{''.join(c for c in start if c.isascii())[:HASHED_PREFIX]}~{digest}"
    return key


def outlet_assets(outlets: Iterable[Any] | None) -> list[Any]:
    """The concrete assets among ``outlets`` (``Asset`` objects; refs and aliases have no URI to key on)."""
    from airflow.sdk import Asset

    if isinstance(outlets, Asset):
        return [outlets]
    return [o for o in (outlets or ()) if isinstance(o, Asset)]


def check_outlets(outlets: Iterable[Any] | None) -> None:
    """``lease_on="outlets"`` needs at least one asset outlet: otherwise there is nothing to key on."""
    if not outlet_assets(outlets):
        raise InvalidArgument(
            "lease_on", LEASE_ON_OUTLETS,
            "takes the lease on the task's asset outlets, and this task has none: give it "
            "outlets=[Asset(...)] (asset refs and aliases cannot be keyed on), or a lease_key",
        )


def outlet_keys(outlets: Iterable[Any] | None, partition_key: str | None = None) -> dict[str, Any]:
    """The lease key of each asset outlet, in the order they are taken (sorted keys): key -> asset."""
    keys = {asset_lease_key(a.uri, partition_key): a for a in outlet_assets(outlets)}
    return {k: keys[k] for k in sorted(keys)}


# -- the token on asset events ----------------------------------------------------------------------------


def stamp(context: Mapping[str, Any], asset: Any, lease: Any, *, store_id: str, partition_key: str | None) -> None:
    """Put ``lease`` (key, token, owner) into the ``extra`` of the task's event for ``asset``."""
    events = context.get("outlet_events")
    if events is None:
        return
    entry: dict[str, Any] = {"key": lease.key, "token": lease.token, "owner": lease.owner, "store_id": store_id}
    if partition_key is not None:
        entry["partition_key"] = partition_key
    events[asset].extra[EXTRA_KEY] = entry


def _extra(event: Any) -> Mapping[str, Any]:
    extra = event if isinstance(event, Mapping) else getattr(event, "extra", None)
    return extra if isinstance(extra, Mapping) else {}


def carries_lease(event: Any) -> bool:
    """Whether ``event`` (an asset event, or its ``extra`` dict) has a lease entry (``extra["lease"]``) at
    all, well formed or not: what a consumer asks before :func:`staleness` (which calls a malformed one
    stale, and raises for an event with none)."""
    return _extra(event).get(EXTRA_KEY) is not None


@dataclass(frozen=True)
class EventLease:
    """The lease an asset event was published under (its ``extra["lease"]``)."""

    key: str
    token: int
    owner: str
    store_id: str | None = None

    @classmethod
    def of(cls, event: Any) -> EventLease | None:
        """The lease recorded in ``event`` (an asset event, or its ``extra`` dict); None if it has none.

        :raises ValueError: the extra has a lease entry that no store could have written (a key, token or
            owner of the wrong type or out of range): see :class:`MalformedEventLease`.
        """
        entry = _extra(event).get(EXTRA_KEY)
        if entry is None:
            return None
        if not isinstance(entry, Mapping) or not {"key", "token", "owner"} <= set(entry):
            raise MalformedEventLease(entry, "it is not a mapping with a key, a token and an owner")
        key, token, owner, store_id = entry["key"], entry["token"], entry["owner"], entry.get("store_id")
        # Exactly the types stamp() writes (a JSON round trip keeps them): a token of True, 1.0 or "1"
        # was not written by a leased task.
        if isinstance(token, bool) or not isinstance(token, int):
            raise MalformedEventLease(entry, f"its token {token!r} is not an integer")
        if not isinstance(key, str) or not isinstance(owner, str):
            raise MalformedEventLease(entry, "its key and owner must be strings")
        if store_id is not None and not isinstance(store_id, str):
            raise MalformedEventLease(entry, f"its store_id {store_id!r} is not a string")
        try:
            validation.token("token", token)
            validation.lookup_name("key", key)
            validation.owner("owner", owner)
        except InvalidArgument as exc:
            raise MalformedEventLease(entry, str(exc)) from None
        return cls(key, token, owner, store_id)


class MalformedEventLease(ValueError):
    """An asset event's ``extra["lease"]`` that no leased task wrote (wrong types, a token out of range, an
    invalid key or owner): :func:`staleness` calls it stale, since the store never issued it."""

    def __init__(self, entry: object, why: str) -> None:
        super().__init__(f"the event's lease {entry!r:.200} is malformed: {why}")
        self.why = why


@dataclass(frozen=True)
class Staleness:
    """The answer of :func:`staleness`: ``stale`` with the ``reason`` (``None`` when it is current)."""

    stale: bool
    reason: str | None
    lease: EventLease | None

    def __bool__(self) -> bool:
        return self.stale


def staleness(event: Any, *, conn_id: str | None = None) -> Staleness:
    """Whether the lease on ``event`` is not (or no longer) the store's current grant, read from the lease
    store (``conn_id``).

    Current only when the store's row of the event's lease key holds exactly the event's token, issued to
    the event's owner, and no fence refused that token of that key from that owner. Stale otherwise, and
    the reason says which: a newer token of the key was issued since (another run took the lease after the
    producer: its publish supersedes this one, or will); the token was never issued (above the key's
    newest, or a key the store never saw); the token was issued to another owner; a fence refused it (a
    ``fence_rejected`` event of that lease key, owner and token: what it wrote was refused); or the extra
    is malformed. So an extra written by anyone but the store's grant (a forged token, the right token
    with another owner, an unknown key) is stale. Two reads by index, whatever the size of the store:
    the key's row, and the refusals of that key.

    An event without a lease in its extra raises ``ValueError`` (nothing to check), and so does an event
    whose lease names another lease store (``store_id``): ask that store.
    """
    # Only where a consumer asks: a DAG file that imports is_stale is parsed without the hooks and the driver.
    from airflow_lease_provider.hooks import LeaseHook

    try:
        lease = EventLease.of(event)
    except MalformedEventLease as exc:
        return Staleness(True, f"{exc} (the lease store never issues such a lease)", None)
    if lease is None:
        raise ValueError("this asset event carries no lease (extra['lease']): it was not published by a leased task")
    store = LeaseHook(conn_id).get_store()
    if lease.store_id is not None and lease.store_id != store.store_id:
        raise ValueError(
            f"the event's lease is from store {lease.store_id!r}, not this connection's ({store.store_id!r})"
        )
    row = store.lease(lease.key)
    if row is None:
        return Staleness(True, f"the lease store never issued a lease of {lease.key!r}", lease)
    if row.token > lease.token:
        return Staleness(True, f"a newer token of {lease.key!r} was issued: {row.token} > {lease.token} "
                               f"(held by {row.owner})", lease)
    if row.token < lease.token:
        return Staleness(True, f"token {lease.token} of {lease.key!r} was never issued (its newest is "
                               f"{row.token})", lease)
    if row.owner != lease.owner:
        return Staleness(True, f"token {lease.token} of {lease.key!r} was issued to {row.owner!r}, not to "
                               f"{lease.owner!r}", lease)
    refused = store.events.fence_refusal(lease.key, owner=lease.owner, token=lease.token)
    if refused is not None:
        return Staleness(True, f"a fence refused token {lease.token} of {lease.key!r} (at {refused.key!r})", lease)
    return Staleness(False, None, lease)


def is_stale(event: Any, *, conn_id: str | None = None) -> bool:
    """Whether a triggering asset event's lease token is stale (see :func:`staleness`)::

        @task
        def consume(triggering_asset_events=None):
            for asset, events in triggering_asset_events.items():
                fresh = [e for e in events if not is_stale(e)]
    """
    return staleness(event, conn_id=conn_id).stale
