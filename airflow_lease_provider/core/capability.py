"""The lease API's per-grant capability (docs/api.md, decision 4): Airflow-free, so the server side and its
tests need no api-server.

A grant made through the API gets a capability, 32 random bytes in URL-safe base64 (or, for an acquire that
names a ``request_id``, one derived from it, so a resent acquire finds its own grant). The store keeps only
:func:`digest` of it, bound to the grant's key, owner and token (``lease.api_capability``, migration 0018):
a digest an older grant left on the row never matches a newer grant. Renew, release, check and fence over
HTTP present it; :func:`grant` reads the grant it belongs to, or nothing.

Each grant is also kept in ``lease_api_grant`` (migration 0022) with the same digest, its lease key and the
run columns its acquire wrote, past the row's next grant: :func:`past_grant` reads the caller's OWN grant
that the row no longer holds, so that its loss (:func:`claim_lost`, once) and a refused late fence of it
are recorded. Nothing acts under such a grant; a grant its holder released (:func:`released`) is not one.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.identity import RunRef
from airflow_lease_provider.core.lease import wait_claim_params
from airflow_lease_provider.core.types import Lease, Waiter

#: Bytes of randomness in a capability.
CAPABILITY_BYTES = 32
#: The shortest request id an acquire may name: its capability is derived from it, so it must be as hard to
#: guess (22 URL-safe characters carry 132 bits).
MIN_REQUEST_ID = 22


def new_capability() -> str:
    return secrets.token_urlsafe(CAPABILITY_BYTES)


def from_request_id(request_id: str) -> str:
    """The capability of an acquire that named ``request_id`` (the same for every resend of it)."""
    raw = hashlib.sha256(b"airflow-lease-api-capability\0" + request_id.encode()).digest()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _grant_params(key: str, owner: str, token: int, capability: str) -> dict[str, Any]:
    """The statement parameters naming the grant (key, owner, token) and ``capability``'s digest for it, the
    names checked as the store checks them (a NUL, a lone surrogate, an oversized name: InvalidArgument,
    which the lease API answers 422, never a driver error), the key normalised as the store keeps it."""
    key = validation.lookup_name("key", key)
    owner = validation.owner("owner", owner)
    token = validation.token("token", token)
    return {"key": key, "owner": owner, "token": token, "digest": digest(key, owner, token, capability)}


def digest(key: str, owner: str, token: int, capability: str) -> bytes:
    """What the store keeps of ``capability``: bound to the grant (key, owner, token)."""
    material = "\0".join((key, owner, str(int(token)), capability)).encode()
    return hashlib.sha256(material).digest()


def bind(store: Any, lease: Lease, capability: str) -> bool:
    """Keep ``capability``'s digest on ``lease``'s row while it is the live grant, and the grant in the
    history of the API's grants (``lease_api_grant``, migration 0022; pruned per key past the store's event
    retention); False: it is gone."""
    params = {**_grant_params(lease.key, lease.owner, lease.token, capability), "keep": store.events.retention}
    return bool(store._ready().run("api_capability_bind", params, durable=True))


@dataclass(frozen=True)
class PastGrant:
    """A grant of the caller's own that the key's row no longer holds (:func:`past_grant`): what the server
    recorded of it when it was granted, never what a request says."""

    key: str
    owner: str
    token: int
    lease_key: str
    run: RunRef | None
    #: The token the key's row holds now (the newer grant's, or a force-release's).
    newest_grant: int


def past_grant(store: Any, key: str, owner: str, token: int, capability: str) -> PastGrant | None:
    """The grant (key, owner, token) when ``capability`` is its capability, its holder did not release it
    through the API, and the key's row holds another grant now: the caller's own lost grant. None otherwise
    (a forged capability, another grant's, a released grant's, or one the row still holds: :func:`grant`)."""
    rows = store._ready().run("api_past_grant", _grant_params(key, owner, token, capability))
    if not rows:
        return None
    row = rows[0]
    return PastGrant(row["key"], row["owner"], int(row["token"]), row["lease_key"], RunRef.from_columns(row),
                     int(row["newest_grant"]))


def released(store: Any, lease: Lease, capability: str) -> None:
    """Note that the holder of ``lease`` (whose ``capability`` was checked) asked to release it: from then on
    its capability records nothing of it (no loss, no refused fence), whatever becomes of the release."""
    store._ready().run("api_grant_released", _grant_params(lease.key, lease.owner, lease.token, capability),
                       durable=True)


def claim_lost(store: Any, key: str, owner: str, token: int, capability: str) -> bool:
    """Whether the 'lost' event of the grant (key, owner, token) may be recorded now: once per grant, never
    for one its holder released through the API, never with another capability than the kept grant's. A
    grant bound before migration 0022 is not kept: True. Call it once ``capability`` is checked
    (:func:`grant` or :func:`past_grant`): for a grant that is not kept, it does not check it."""
    rows = store._ready().run("api_grant_lost", _grant_params(key, owner, token, capability), durable=True)
    return bool(rows[0]["claimed"]) or not rows[0]["kept"]


def grant(store: Any, key: str, owner: str, token: int, capability: str) -> Lease | None:
    """The row of the grant (key, owner, token) when ``capability`` is its capability (held or not); None
    when it is not (another grant's, a made-up one, or the row holds another grant now)."""
    params = _grant_params(key, owner, token, capability)
    rows = store._ready().run("api_capability_grant", params)
    return Lease.from_row(rows[0]) if rows else None


def renew(store: Any, key: str, owner: str, token: int, capability: str, ttl: timedelta | None) -> Lease | None:
    """Renew the grant (key, owner, token) by ``ttl`` (None: its own TTL) when ``capability`` is its
    capability, in one statement (one round trip); None: lost, or not this grant's capability (the caller
    tells which with :func:`grant`, on that rare path only)."""
    params = {**_grant_params(key, owner, token, capability),
              "ttl": None if ttl is None else validation.ttl("ttl", ttl)}
    sent_at = time.monotonic()
    rows = store._ready().run("api_capability_renew", params, durable=True)
    return Lease.from_row(rows[0], sent_at) if rows else None


# -- waiting places (migrations/0021) -----------------------------------------------------------------


def place_capability(request_id: str) -> str:
    """The capability of a waiting place taken by a claim that named ``request_id`` (the same for every claim
    that names it: the taker keeps its place by naming it again). Another domain than a grant's."""
    raw = hashlib.sha256(b"airflow-lease-api-place\0" + request_id.encode()).digest()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def place_digest(key: str, owner: str, capability: str) -> bytes:
    """What the store keeps of a place's ``capability``: bound to the place (key, owner)."""
    return hashlib.sha256("\0".join(("place", key, owner, capability)).encode()).digest()


@dataclass(frozen=True)
class PlaceClaim:
    """The lease API's claim of a waiting place (:func:`wait_claim`): ``status`` is ``claimed`` (taken or
    kept), ``taken_over`` (the owner's stale place, taken with another capability, is the caller's now),
    ``full`` or ``other`` (the owner's live place was taken with another capability, or by the direct path);
    ``takeover_at``: for ``other``, from when a claim of the owner may take it over (None: never, a direct
    path's place); ``waiters``: every live waiter of the key, oldest first."""

    status: str
    waiters: list[Waiter]
    takeover_at: datetime | None = None


def wait_claim(
    store: Any, key: str, owner: str, ttl: timedelta, capability: str, *, max_waiting: int, run: Any = None
) -> PlaceClaim:
    """Take or keep ``owner``'s waiting place for ``key`` with ``capability`` (as
    :meth:`~airflow_lease_provider.core.LeaseStore.wait_claim`, atomic per key, at most ``max_waiting``
    places), or take over the owner's stale place taken with another capability (migrations/0023)."""
    params = wait_claim_params(key, owner, ttl, max_waiting, run)
    key, owner = params["key"], params["owner"]
    rows = store._ready().run("api_wait_claim", {**params, "digest": place_digest(key, owner, capability)}, durable=True)
    status = str(rows[0]["status"]) if rows else "full"
    return PlaceClaim(status, [Waiter.from_row(r, key) for r in rows if r["owner"] is not None],
                      rows[0]["takeover_at"] if rows else None)


def wait_release(store: Any, key: str, owner: str, capability: str) -> bool:
    """Give ``owner``'s waiting place for ``key`` back when ``capability`` is the one it was taken with;
    False: no such place (never taken with it, given back already, or lapsed and cleared)."""
    key = validation.lookup_name("key", key)
    owner = validation.owner("owner", owner)
    params = {"key": key, "owner": owner, "digest": place_digest(key, owner, capability)}
    return bool(store._ready().run("api_wait_release", params, durable=True))
