"""The lease API (issue 41; docs/api.md): acquire, renew, release, check and fence over HTTP, on the api-server.

A FastAPI app of its own, mounted at ``/v1`` in the plugin's app (``/lease/v1/...``): the plugin's app makes
every route require the UI login, and these take their own credentials instead (docs/api.md, decisions 3
and 4):

- ``acquire``: ``Authorization: Bearer <password of the connection lease_api>``. No such connection, or one
  without a password: 403 "lease API not enabled" (never open by default).
- ``renew``, ``release``, ``check``, ``fence``: ``Authorization: Bearer <capability>``, the one the acquire
  answered, for the grant (key, owner, token) named in the request, which must be the row's current grant.
  One exception, for the caller's own grant only: after a newer grant took the row, that grant's capability
  (checked against the grant kept in ``lease_api_grant``, migration 22) may still record the grant's
  ``lost`` (``/event``, once) and a refused late fence's ``fence_rejected`` (``/fence`` answers 409 and never
  asks the fence), never act under it (docs/api.md, "A grant's own past").

No credentials: 401. The wrong ones: 403. The store unreachable: 503 (fail closed). Nothing here logs a
header, and no answer but the acquire's carries a capability.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from airflow_lease_provider import __version__, settings
from airflow_lease_provider.core import (
    FenceStore,
    InvalidArgument,
    Lease,
    LeaseError,
    LeaseStore,
    LeaseStoreUnavailable,
    RunRef,
    SlotCountMismatch,
    Waiter,
)
from airflow_lease_provider.core import capability as caps
from airflow_lease_provider.core.db import LeaseStoreError
from airflow_lease_provider.hooks import LeaseHook
from airflow_lease_provider.hooks.lease import _hostname, get_connection
from airflow_lease_provider.plugins import deps
from airflow_lease_provider.version_compat import AirflowNotFoundException

log = logging.getLogger(__name__)

#: The connection whose password authorizes acquires.
API_CONN_ID = "lease_api"
#: How long a looked-up acquire secret is reused (a changed password applies within this).
SECRET_CACHE_SECONDS = 10.0
#: The longest key, owner, resource or idempotency key the API takes (the core's limit).
MAX_NAME = 512


# -- the store --------------------------------------------------------------------------------------

#: One store (and one fence store) per request thread: a store runs one statement at a time, so the request
#: threads must not share one. All take their connection from one pool per server and settings, of at most
#: ``[lease] api_pool_size`` connections, and give it back when their statement is done
#: (core/db/pool.py): 1,000 leases renewing every 10 s through one api-server are 100 statements a second
#: on a few connections, not a queue on one, nor a connect per request.
_local = threading.local()


def get_api_store() -> LeaseStore:
    """The lease API's store: where the Leases page's is (hooks/lease.py ``api_server_location``), but
    writable: it creates the store on first use where none is yet, as a task does. This request thread's,
    on the shared pool."""
    store: LeaseStore | None = getattr(_local, "store", None)
    if store is None:
        location = LeaseHook.for_api_server(read_only=False).location
        store = LeaseStore(
            location.dsn, schema=location.schema, event_retention=settings.event_retention(), host=_hostname(),
            prepare=settings.prepare_statements(), idle_close=timedelta(0), pool_size=settings.api_pool_size(),
        )
        _local.store = store
    return store


def get_api_fences(store: Annotated[LeaseStore, Depends(get_api_store)]) -> FenceStore:
    """The fences in the lease store's own database and schema (external publishes: docs/core.md), this
    request thread's, on the same pool."""
    fences: FenceStore | None = getattr(_local, "fences", None)
    if fences is None or fences.schema != store.schema or fences.db.dsn != store.db.dsn:
        fences = FenceStore(store.db.dsn, schema=store.schema, idle_close=timedelta(0),
                            pool_size=settings.api_pool_size())
        _local.fences = fences
    return fences


StoreDep = Annotated[LeaseStore, Depends(get_api_store)]
FencesDep = Annotated[FenceStore, Depends(get_api_fences)]


# -- credentials ------------------------------------------------------------------------------------

_secret_cache: list[tuple[float, str | None]] = []


def _lookup_secret() -> str | None:
    """The password of ``lease_api``; None when the connection is not defined or has none."""
    try:
        conn = get_connection(API_CONN_ID)
    except AirflowNotFoundException:
        return None
    return str(conn.password) if conn.password else None


def acquire_secret() -> str | None:
    """:func:`_lookup_secret`, reused for :data:`SECRET_CACHE_SECONDS`."""
    now = time.monotonic()
    if _secret_cache and now - _secret_cache[0][0] < SECRET_CACHE_SECONDS:
        return _secret_cache[0][1]
    try:
        secret = _lookup_secret()
    except Exception as exc:  # a secrets backend down: fail closed
        # Only the error's type: Airflow's message about an unparsable URI may quote a piece of its password.
        log.warning("lease API: the connection %r could not be read (%s)", API_CONN_ID, type(exc).__name__)
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, "the lease API's configuration could not be read"
        ) from None
    _secret_cache[:] = [(now, secret)]
    return secret


def bearer(authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> str:
    """The bearer credential of the request; 401 without one."""
    scheme, _, credential = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "send Authorization: Bearer <credential>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return credential.strip()


BearerDep = Annotated[str, Depends(bearer)]


def may_acquire(credential: BearerDep) -> None:
    secret = acquire_secret()
    if secret is None:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"lease API not enabled: define the connection {API_CONN_ID!r} with a password (docs/api.md)",
        )
    if not hmac.compare_digest(credential.encode(), secret.encode()):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "wrong acquire secret")


# -- bodies and answers -----------------------------------------------------------------------------

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
#: A host name as the acquire records it: a DNS name or an address (letters, digits, ``.-_:[]``), at most 253
#: characters (a DNS name's limit); anything else is 422 naming ``host``, never stored.
HOST_PATTERN = r"^[A-Za-z0-9._:\[\]-]+$"
Host = Annotated[str, Field(min_length=1, max_length=253, pattern=HOST_PATTERN)]


class RunBody(BaseModel):
    dag_id: Name
    run_id: Name
    task_id: Name | None = None
    map_index: int = Field(default=-1, ge=-1, le=2**31 - 1)

    def ref(self) -> RunRef:
        return RunRef(self.dag_id, self.run_id, self.map_index, task_id=self.task_id)


class AcquireBody(BaseModel):
    key: Name
    owner: Name
    ttl_seconds: Seconds = Field(description="the lease's time to live")
    policy: Literal["single", "slots", "replace"] = Field(
        default="single",
        description="single: one holder; slots: at most `slots` holders (a semaphore); replace: take the lease "
        "over from a holder of an older run (`run_after`)",
    )
    slots: int = Field(default=1, ge=1, le=1000)
    run_after: datetime | None = Field(default=None, description="policy replace: this run's order (aware)")
    request_id: str | None = Field(
        default=None, min_length=caps.MIN_REQUEST_ID, max_length=200,
        description="a random string of the client's: the same request sent again answers the same grant "
        "(and capability) while that grant is live; secret like the capability it yields",
    )
    run: RunBody | None = Field(default=None, description="the task instance taking it (the events' run columns)")
    takeover: bool = Field(default=True, description="policy replace: False never takes over (the holder's "
                           "run is older: `holder_older` in the 409)")
    host: Host | None = Field(default=None, description="the task's host, recorded in the `acquired` event (default "
                              "the api-server's)")


#: A fencing token as the API takes it: a JSON integer, never a string or a float that looks like one (a
#: token is compared, not parsed: "7" or 7.0 is a client's bug, answered 422 naming the field).
Token = Annotated[int, Field(ge=1, le=2**63 - 1, strict=True)]
#: A TTL in seconds: a JSON number, never a string.
Seconds = Annotated[float, Field(gt=0, le=7 * 24 * 3600, strict=True)]


class GrantRef(BaseModel):
    key: Name
    owner: Name
    token: Token


class RenewBody(GrantRef):
    ttl_seconds: Seconds | None = None


#: What a task may record over the API with the acquire secret: that it was refused a key another holds
#: (docs/api.md, "The task's events"). Only while the holder it names holds the key.
REFUSAL_EVENTS = ("skipped_overlap", "overlap_failed")
#: What a grant's holder may record about its own grant, by its capability.
GRANT_EVENTS = ("lost", "renewed_late")


#: What a waiting task may record with the acquire secret (docs/api.md, decision 9): that it waits (while the
#: holder it names holds the key, or while it has a place itself), or that every waiting place is taken
#: (while the holder it names holds the key, or another run has a place).
WAIT_EVENTS = ("waiting", "skipped_buffer_full")


class EventBody(BaseModel):
    kind: Literal["skipped_overlap", "overlap_failed", "lost", "renewed_late", "waiting", "skipped_buffer_full"]
    key: Name
    owner: Name
    token: Token | None = Field(default=None, description="the grant (lost, renewed_late)")
    run: RunBody | None = Field(default=None, description="the task instance the event is about (run columns)")
    detail: dict[str, Any] = Field(default_factory=dict, description="as the direct path records it; a refusal "
                                   "names the holder in `holder_token`")


class FenceBody(GrantRef):
    resource: Name
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=MAX_NAME)


def lease_json(lease: Lease) -> dict[str, Any]:
    """A lease as the API answers it (no capability, no host)."""
    return {
        "key": lease.key, "lease_key": lease.lease_key, "owner": lease.owner, "token": lease.token,
        "ttl_seconds": lease.ttl.total_seconds(), "acquired_at": lease.acquired_at,
        "renewed_at": lease.renewed_at, "expires_at": lease.expires_at, "released_at": lease.released_at,
        "observed_at": lease.observed_at, "remaining_seconds": lease.remaining.total_seconds(),
        "held": lease.held, "slot": lease.slot, "slots": lease.slots, "count_epoch": lease.count_epoch,
    }


def holder_json(lease: Lease) -> dict[str, Any]:
    return {"owner": lease.owner, "token": lease.token, "expires_at": lease.expires_at, "slot": lease.slot,
            "slots": lease.slots}


def _conflict(content: dict[str, Any]) -> JSONResponse:
    return JSONResponse(jsonable_encoder(content), status_code=status.HTTP_409_CONFLICT)


def _holder_of(store: LeaseStore, ref: GrantRef, credential: str) -> Lease:
    """The grant ``ref`` names when ``credential`` is its capability; 403 otherwise."""
    lease = caps.grant(store, ref.key, ref.owner, ref.token, credential)
    if lease is None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "not the holder's capability for this grant")
    return lease


# -- the routes -------------------------------------------------------------------------------------


def acquire(body: AcquireBody, store: StoreDep, _: Annotated[None, Depends(may_acquire)]) -> Any:
    """Take the lease; 200 with the grant and its capability, or 409 with who holds it."""
    ttl = timedelta(seconds=body.ttl_seconds)
    if body.policy == "replace" and body.run_after is None:
        raise InvalidArgument("run_after", None, "is required with policy 'replace'")
    if body.policy != "slots" and body.slots != 1:
        raise InvalidArgument("slots", body.slots, "needs policy 'slots'")
    capability = caps.from_request_id(body.request_id) if body.request_id else caps.new_capability()
    run = body.run.ref() if body.run else None
    if body.request_id:
        # A resend of an acquire whose answer was lost: its grant, if it is live, with the same capability.
        for held in store.slot_holders(body.key):
            if held.owner == body.owner and caps.grant(store, held.key, held.owner, held.token, capability):
                return {"status": "granted", "lease": lease_json(held), "capability": capability, "resent": True}
    if body.policy == "replace":
        assert body.run_after is not None
        taken = store.try_replace(body.key, body.owner, ttl, run_after=body.run_after, run=run,
                                  takeover=body.takeover, **_caller_host(body))
    else:
        taken = store.try_acquire(body.key, body.owner, ttl, slots=body.slots, run=run, **_caller_host(body))
    lease = taken.lease
    if lease is None:
        holders = taken.holders or ((taken.holder,) if taken.holder is not None else ())
        return _conflict({"status": "held", "key": body.key, "holders": [holder_json(h) for h in holders],
                          "holder_older": taken.holder_older})
    if not caps.bind(store, lease, capability):
        return _conflict({"status": "lost", "key": body.key, "token": lease.token,
                          "detail": "the grant lapsed before it was answered"})
    answer: dict[str, Any] = {"status": "granted", "lease": lease_json(lease), "capability": capability,
                              "store_id": store.store_id}
    if taken.replaced is not None:
        answer["replaced"] = {"owner": taken.replaced.owner, "token": taken.replaced.token}
    return answer


def renew(body: RenewBody, store: StoreDep, credential: BearerDep) -> Any:
    """Extend the grant by its TTL (or ``ttl_seconds``) from now; 409 when it is lost."""
    ttl = timedelta(seconds=body.ttl_seconds) if body.ttl_seconds is not None else None
    # One statement checks the capability and renews (one round trip); only a refusal reads which it was.
    renewed = caps.renew(store, body.key, body.owner, body.token, credential, ttl)
    if renewed is None:
        _holder_of(store, body, credential)  # 403 when not this grant's capability
        return _conflict({"status": "lost", "key": body.key, "token": body.token})
    return {"status": "renewed", "lease": lease_json(renewed)}


def release(body: GrantRef, store: StoreDep, credential: BearerDep) -> Any:
    """Free the grant. Sent again, the same answer (the row says this grant was released by its holder)."""
    lease = _holder_of(store, body, credential)
    if lease.released_at is None:
        caps.released(store, lease, credential)  # before: a grant its holder ended never records a loss
    # The run columns of the 'released' event are the ones the grant's acquire wrote on its row (lease.run),
    # never the request's: the task instance's Lease tab finds it by them.
    if lease.released_at is not None or store.release(lease, run=lease.run):
        return {"status": "released", "released": True, "key": body.key, "token": body.token}
    return _conflict({"status": "lost", "released": False, "key": body.key, "token": body.token})


def _check(ref: GrantRef, store: LeaseStore, credential: str) -> dict[str, Any]:
    lease = _holder_of(store, ref, credential)
    return {"held": lease.held, "lease": lease_json(lease)}


def check_get(
    store: StoreDep, credential: BearerDep,
    key: Annotated[str, Query(min_length=1, max_length=MAX_NAME)],
    owner: Annotated[str, Query(min_length=1, max_length=MAX_NAME)],
    token: Annotated[int, Query(ge=1, le=2**63 - 1)],
) -> dict[str, Any]:
    """Whether the grant is still held (one read of the store)."""
    return _check(GrantRef(key=key, owner=owner, token=token), store, credential)


def check_post(body: GrantRef, store: StoreDep, credential: BearerDep) -> dict[str, Any]:
    """:func:`check_get` with a JSON body."""
    return _check(body, store, credential)


def fence(body: FenceBody, store: StoreDep, fences: FencesDep, credential: BearerDep) -> Any:
    """Check the grant is held, then advance the fence of ``resource`` to its token (docs/core.md, "The
    fence"): 200 accepted, or 409 with the fence's reason. An ``idempotency_key`` is claimed with it, once.
    A grant not held (lapsed, or the row holds a newer one): 409 ``lost``, the fence not asked
    (:func:`_late_fence`)."""
    lease = caps.grant(store, body.key, body.owner, body.token, credential)
    if lease is None or not lease.held:
        return _late_fence(body, lease, store, fences, credential)
    decision = fences.advance(
        body.resource, lease.token, key=lease.key, owner=lease.owner, idempotency_key=body.idempotency_key,
        store_id=store.store_id, count_epoch=lease.count_epoch, base_key=lease.lease_key, run=lease.run,
    )
    answer = {"accepted": decision.accepted, "resource": body.resource, "key": body.key, "token": body.token,
              "outcome": decision.outcome, "current_token": decision.current_token,
              "newest_grant": decision.newest_grant}
    if not decision.accepted:
        return _conflict({**answer, "status": "refused", "reason": decision.reason})
    return {**answer, "status": "accepted"}


def event(body: EventBody, store: StoreDep, credential: BearerDep) -> Any:
    """Record one of the task's own events in the ledger, as the direct path does (docs/api.md, "The task's
    events"). A refusal (``skipped_overlap``, ``overlap_failed``): the acquire secret, and only while the
    holder the detail names (``holder_token``) holds the key and is not ``owner``, so nobody records a skip
    that no acquire could have met. A grant's own event (``lost``, ``renewed_late``): that grant's capability."""
    if body.kind in WAIT_EVENTS:
        may_acquire(credential)
        if not _wait_event_true(body, store):
            return _conflict({"status": "not_held", "recorded": False, "key": body.key,
                              "detail": "neither the holder named in holder_token holds the key nor does a "
                              "waiting place say it"})
    elif body.kind in REFUSAL_EVENTS:
        may_acquire(credential)
        holder_token = body.detail.get("holder_token")
        holders = store.slot_holders(body.key)
        # The holder the detail names must be the one holding: its token, and its owner when it names one (the
        # Leases page links the skip to the run of `holder_owner`: a made-up one would blame another run).
        if not any(h.token == holder_token and h.owner != body.owner
                   and body.detail.get("holder_owner", h.owner) == h.owner for h in holders):
            return _conflict({"status": "not_held", "recorded": False, "key": body.key,
                              "detail": "the holder named in holder_token (and holder_owner) does not hold the key"})
    else:
        if body.token is None:
            raise InvalidArgument("token", None, f"is required for a {body.kind!r} event")
        return _grant_event(body, body.token, store, credential)
    run = body.run.ref() if body.run else None
    recorded = store.events.record(body.kind, body.key, owner=body.owner, token=body.token, detail=body.detail, run=run)
    if not recorded:
        raise LeaseStoreUnavailable("the event could not be recorded")
    return {"status": "recorded", "recorded": True, "kind": body.kind, "key": body.key}


def _wait_event_true(body: EventBody, store: LeaseStore) -> bool:
    """Whether a waiting event says no more than the store shows the secret's holder: the holder it names
    holds the key (and is not the event's owner), or a waiting place does (the owner's own for ``waiting``,
    another run's for ``skipped_buffer_full``, which may come while the key is free and runs wait for it)."""
    holder_token = body.detail.get("holder_token")
    if holder_token is not None and any(
        h.token == holder_token and h.owner != body.owner and body.detail.get("holder_owner", h.owner) == h.owner
        for h in store.slot_holders(body.key)
    ):
        return True
    placed = store.waiters([body.key])
    if body.kind == "waiting":
        return any(w.owner == body.owner for w in placed)
    return any(w.owner != body.owner for w in placed)


class GiveBackBody(GrantRef):
    resource: Name
    idempotency_key: str = Field(min_length=1, max_length=MAX_NAME)


def give_back(body: GiveBackBody, store: StoreDep, fences: FencesDep, credential: BearerDep) -> Any:
    """Give back the idempotency claim of this grant's external publish whose side effect failed (the
    ``with lease.fence(..., idempotency_key=...)`` block raised): only that publish's own claim (same
    resource, key, token, owner), and only while the grant is current (a lost grant keeps its claim: at most
    once, failing toward "not published again", docs/core.md)."""
    _holder_of(store, body, credential)
    given = fences._give_back({"resource": body.resource, "idempotency_key": body.idempotency_key,
                               "key": body.key, "token": body.token, "owner": body.owner})
    return {"given_back": given}


def replaced_by(body: GrantRef, store: StoreDep, _: Annotated[None, Depends(may_acquire)]) -> Any:
    """Who took the grant over (policy replace), or null: the replaced task ends skipped, naming that run.
    The acquire secret: it says no more than a refused acquire's 409 says to the same caller (who holds)."""
    now = datetime.now().astimezone()
    ref = Lease(key=body.key, owner=body.owner, token=body.token, ttl=timedelta(0), acquired_at=now, renewed_at=now,
                expires_at=now, released_at=None, observed_at=now)
    by = store.replaced_by(ref)
    if by is None:
        return {"replaced_by": None}
    return {"replaced_by": {"owner": by.owner, "token": by.token, "run": by.run.columns() if by.run else None}}


# -- waiting (docs/api.md, decision 9) --------------------------------------------------------------


class KeyBody(BaseModel):
    key: Name


class KeysBody(BaseModel):
    keys: list[Name] = Field(min_length=1, max_length=100, description="the keys whose waiters to list")


class WaitClaimBody(BaseModel):
    key: Name
    owner: Name
    ttl_seconds: Seconds = Field(description="the place's time to live: it lapses unless claimed again")
    max_waiting: int = Field(ge=1, le=10_000, strict=True, description="at most this many places per key")
    request_id: str = Field(
        min_length=caps.MIN_REQUEST_ID, max_length=200,
        description="a random string of the taker's, secret like the capability it yields: naming it again "
        "keeps (renews) the place; a claim naming another cannot touch it while it is live, and one of the same "
        "owner takes it over once it is stale (not claimed for two thirds of its TTL: its keeper is dead)",
    )
    run: RunBody | None = Field(default=None, description="the task instance waiting (the place's run columns)")


class WaitReleaseBody(BaseModel):
    key: Name
    owner: Name


def waiter_json(waiter: Waiter) -> dict[str, Any]:
    return {"key": waiter.key, "owner": waiter.owner, "since": waiter.since, "expires_at": waiter.expires_at,
            "run": _run_json(waiter.run)}


def _run_json(run: RunRef | None) -> dict[str, Any] | None:
    if run is None:
        return None
    return {"dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id, "map_index": run.map_index}


def holders(body: KeyBody, store: StoreDep, _: Annotated[None, Depends(may_acquire)]) -> Any:
    """Who holds ``key`` now (every live slot's holder; none: free), as a refused acquire's 409 names them:
    what a waiting task's trigger polls. The acquire secret: it says no more than an acquire would."""
    return {"key": body.key, "holders": [holder_json(h) for h in store.slot_holders(body.key)]}


def waiters(body: KeysBody, store: StoreDep, _: Annotated[None, Depends(may_acquire)]) -> Any:
    """The live waiting places of ``keys``, oldest first (no capability): a run with ``max_waiting`` queues
    behind them, and a run skipped because every place is taken names them."""
    return {"waiters": [waiter_json(w) for w in store.waiters(body.keys)]}


def wait_claim(body: WaitClaimBody, store: StoreDep, _: Annotated[None, Depends(may_acquire)]) -> Any:
    """Take or keep the owner's waiting place for ``key`` (as the direct store's ``wait_claim``: at most
    ``max_waiting`` places per key, in one statement under the key's lock): 200 ``claimed`` with the place's
    capability (derived from ``request_id``: the same for every claim naming it; ``taken_over`` true when the
    owner's stale place, taken with another request id, was taken over), 409 ``full`` naming the waiters, 403
    when the owner's live place was taken with another request id (``takeover_at``: from when a claim may
    take it over) or by the direct path (decision 9)."""
    capability = caps.place_capability(body.request_id)
    run = body.run.ref() if body.run else None
    got = caps.wait_claim(store, body.key, body.owner, timedelta(seconds=body.ttl_seconds), capability,
                          max_waiting=body.max_waiting, run=run)
    listed = [waiter_json(w) for w in got.waiters]
    if got.status == "other":
        return JSONResponse(jsonable_encoder({
            "detail": "this owner's waiting place was taken with another request id",
            "takeover_at": got.takeover_at,
        }), status_code=status.HTTP_403_FORBIDDEN)
    if got.status not in ("claimed", "taken_over"):
        return _conflict({"status": "full", "claimed": False, "key": body.key, "waiters": listed})
    return {"status": "claimed", "claimed": True, "taken_over": got.status == "taken_over", "key": body.key,
            "capability": capability, "waiters": listed}


def wait_release(body: WaitReleaseBody, store: StoreDep, credential: BearerDep) -> Any:
    """Give the waiting place back, by the capability it was taken with: 200 ``released``; 403 for any other
    credential, and once it is given back or gone (a forged capability and a spent one look alike)."""
    if not caps.wait_release(store, body.key, body.owner, credential):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "not the capability of a waiting place of this key and owner")
    return {"status": "released", "released": True, "key": body.key}


# -- a grant's own record: its loss and its late fences (docs/api.md, "A grant's own past") --------------


def _caller_host(body: AcquireBody) -> dict[str, Any]:
    """The acquire's ``host=`` for the store: the task's, when it sent one (checked by :data:`Host`)."""
    return {"host": body.host} if body.host is not None else {}


def _record(store: LeaseStore, kind: str, key: str, owner: str, token: int, detail: dict[str, Any],
            run: RunRef | None) -> None:
    if not store.events.record(kind, key, owner=owner, token=token, detail=detail, run=run):
        raise LeaseStoreUnavailable("the event could not be recorded")


def _grant_event(body: EventBody, token: int, store: LeaseStore, credential: str) -> Any:
    """A grant's own event (``lost``, ``renewed_late``), by that grant's capability. Its run columns are the
    ones its acquire wrote (the row's, or the kept grant's), never the request's. A ``lost`` is recorded at
    most once per grant, never for a grant its holder released through the API, and also for the caller's
    own grant after a newer grant took the key's row (:func:`caps.past_grant`); anything else is 403."""
    ref = GrantRef(key=body.key, owner=body.owner, token=token)
    lease = caps.grant(store, ref.key, ref.owner, ref.token, credential)
    if lease is not None:
        run = lease.run
    else:
        past = caps.past_grant(store, ref.key, ref.owner, ref.token, credential) if body.kind == "lost" else None
        if past is None:
            raise HTTPException(status.HTTP_403_FORBIDDEN, "not the holder's capability for this grant")
        run = past.run
    if body.kind == "lost" and not caps.claim_lost(store, ref.key, ref.owner, ref.token, credential):
        return _conflict({"status": "not_recorded", "recorded": False, "key": body.key,
                          "detail": "this grant's loss is recorded already, or its holder released it"})
    _record(store, body.kind, ref.key, ref.owner, ref.token, body.detail, run)
    return {"status": "recorded", "recorded": True, "kind": body.kind, "key": body.key}


def _late_fence(body: FenceBody, lease: Lease | None, store: LeaseStore, fences: FenceStore, credential: str) -> Any:
    """A fence asked under a grant that is not held: refused (409 ``lost``), the fence not asked, nothing
    written but the refusal's ``fence_rejected`` event, as the direct path's fence records a refusal. That
    event only for the caller's own grant that its holder did not release: the row's grant lapsed (``lease``),
    or a grant the row no longer holds (:func:`caps.past_grant`, with the run columns its acquire wrote); any
    other capability is 403 and records nothing."""
    refused = {"status": "lost", "accepted": False, "key": body.key, "token": body.token}
    if lease is not None:
        if lease.released_at is not None:  # released by its holder: asked again, nothing to record
            return _conflict(refused)
        lease_key, newest, outcome, run = lease.lease_key, None, "stale", lease.run
    else:
        past = caps.past_grant(store, body.key, body.owner, body.token, credential)
        if past is None:
            raise HTTPException(status.HTTP_403_FORBIDDEN, "not the holder's capability for this grant")
        lease_key, newest, outcome, run = past.lease_key, past.newest_grant, "superseded", past.run
    detail: dict[str, Any] = {
        "outcome": outcome, "reason": "lost", "lease_key": lease_key,
        "current_token": fences.current(body.resource, key=body.key), "idempotency_key": body.idempotency_key,
        "fence_at": "lease API: the grant is no longer held, the fence was not asked",
    }
    if newest is not None:
        detail["newest_grant"] = newest
    _record(store, "fence_rejected", body.resource, body.owner, body.token, detail, run)
    return _conflict({**refused, "newest_grant": newest})


# -- errors -----------------------------------------------------------------------------------------


def _error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status_code)


async def _lease_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, SlotCountMismatch):
        # The holders as a refused acquire names them, so that the client raises what the direct path raises.
        return _conflict({"status": "slot_count_mismatch", "detail": deps.public_message(exc), "key": exc.key,
                          "slots": exc.slots, "holders": [holder_json(h) for h in exc.holders]})
    if isinstance(exc, InvalidArgument):
        return _error(status.HTTP_422_UNPROCESSABLE_CONTENT, deps.public_message(exc))
    if isinstance(exc, (LeaseStoreUnavailable, LeaseStoreError)):
        log.warning("lease API: the store is unreachable: %s", deps.public_message(exc))
        return _error(status.HTTP_503_SERVICE_UNAVAILABLE, "the lease store is unreachable; nothing is known "
                      "to have changed (retry; a lease you hold lapses by its TTL)")
    log.warning("lease API: %s", deps.public_message(exc))
    return _error(status.HTTP_503_SERVICE_UNAVAILABLE, deps.public_message(exc))


async def _bad_input(request: Request, exc: Exception) -> JSONResponse:
    """422 naming each bad field and why, without echoing the value sent (a request id is a secret)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in errors]
    return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


def create_api() -> FastAPI:
    """The lease API's app (mounted at ``/v1`` of the plugin's app; ``docs/lease-api.openapi.json`` is its
    OpenAPI, written by ``scripts/lease_api_openapi.py``)."""
    app = FastAPI(
        title="Airflow lease API", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
        description="Leases with fencing tokens through the Airflow api-server (docs/api.md).",
    )
    app.add_exception_handler(LeaseError, _lease_error)
    app.add_exception_handler(RequestValidationError, _bad_input)
    responses: dict[int | str, dict[str, Any]] = {
        401: {"description": "no credentials"}, 403: {"description": "wrong credentials, or API not enabled"},
        409: {"description": "held, lost, or refused by the fence"}, 503: {"description": "store unreachable"},
    }
    app.add_api_route("/acquire", acquire, methods=["POST"], responses=responses)
    app.add_api_route("/renew", renew, methods=["POST"], responses=responses)
    app.add_api_route("/release", release, methods=["POST"], responses=responses)
    app.add_api_route("/check", check_get, methods=["GET"], responses=responses)
    app.add_api_route("/check", check_post, methods=["POST"], responses=responses)
    app.add_api_route("/fence", fence, methods=["POST"], responses=responses)
    app.add_api_route("/event", event, methods=["POST"], responses=responses)
    app.add_api_route("/fence/give_back", give_back, methods=["POST"], responses=responses)
    app.add_api_route("/replaced_by", replaced_by, methods=["POST"], responses=responses)
    app.add_api_route("/holders", holders, methods=["POST"], responses=responses)
    app.add_api_route("/waiters", waiters, methods=["POST"], responses=responses)
    app.add_api_route("/wait/claim", wait_claim, methods=["POST"], responses=responses)
    app.add_api_route("/wait/release", wait_release, methods=["POST"], responses=responses)
    return app
