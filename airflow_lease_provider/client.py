"""The task side of the lease API (issue 41; docs/api.md): :class:`HttpLeaseStore`, the lease operations over
HTTP through the api-server, and :func:`choose_access`, the path a task takes.

:class:`HttpLeaseStore` offers what :class:`~airflow_lease_provider.core.keeper.LeaseKeeper` uses of a store
(``renew``, ``holder``, ``release``, ``db.statement_timeout``, ``record_events``), so a lease taken over HTTP
is kept exactly like a direct one: renewed every TTL/3, its deadline counted from just *before* each request
was sent (``Lease.sent_at``) with the time left the store measured, lost at ``deadline - safety margin``
whatever the api-server does. An api-server that does not answer in time, answers 5xx, or cannot be reached
is an unreachable store (:class:`~airflow_lease_provider.core.LeaseStoreUnavailable`): the keeper retries
until the deadline and then declares the lease lost (fail closed, as the direct path). A renewal refused
(409) or no longer this grant's (403) is a lost lease.

Airflow-free: it needs the api-server's URL and the acquire secret (the password of the ``lease_api``
connection, which a task reads through Airflow like any connection).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
import socket
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import httpx

from airflow_lease_provider.core import (
    Acquisition,
    FenceDecision,
    Holding,
    InvalidArgument,
    Lease,
    LeaseError,
    LeaseLost,
    LeaseStoreUnavailable,
    RunRef,
    SlotCountMismatch,
    TokenHolder,
    WaitClaim,
    Waiter,
)
from airflow_lease_provider.core.capability import place_capability

log = logging.getLogger(__name__)

#: How long one request may take by default: an answer later than this is no answer (the keeper retries).
DEFAULT_TIMEOUT = timedelta(seconds=5)
#: Where the lease API is under the api-server's base URL.
API_PATH = "/lease/v1"


class LeaseAPIRefused(LeaseError):
    """The lease API refused the credentials (401, 403): the acquire secret, or a capability no longer
    this grant's."""


def lease_from_json(data: dict[str, Any], sent_at: float | None) -> Lease:
    def when(name: str) -> datetime | None:
        value = data.get(name)
        return datetime.fromisoformat(value) if value else None

    return Lease(
        key=data["key"], owner=data["owner"], token=int(data["token"]), ttl=timedelta(seconds=data["ttl_seconds"]),
        acquired_at=when("acquired_at"), renewed_at=when("renewed_at"),  # type: ignore[arg-type]
        expires_at=when("expires_at"), released_at=when("released_at"),  # type: ignore[arg-type]
        observed_at=when("observed_at"), sent_at=sent_at,  # type: ignore[arg-type]
        slot=int(data.get("slot", 1)), slots=int(data.get("slots", 1)), count_epoch=int(data.get("count_epoch", 0)),
    )


class HttpLeaseStore:
    """Leases through the api-server's lease API.

    :param base_url: the api-server's base URL (``[lease] access = api`` uses
        :func:`~airflow_lease_provider.settings.api_server_url`).
    :param secret: the acquire secret (the ``lease_api`` connection's password). Never logged or repeated.
    :param timeout: how long one request may take.
    :param client: an ``httpx.Client`` to send through (tests pass FastAPI's ``TestClient``).
    :param host: this task's host, sent with each acquire for its ``acquired`` event (default this machine's
        name); one the lease API would refuse (not a DNS name or address) is not sent (the api-server's then).
    """

    #: The api-server's store records the acquired and released events itself; the task's own (a skip, an
    #: overlap failure) and the keeper's (lost, renewed late) are sent to ``/event`` (:class:`HttpLedger`).
    record_events = True
    #: What the task runtime reads of a store: not a shared database (the runtime closes it after the task),
    #: and the schema is the api-server's business.
    shared = False
    schema = "(lease API)"

    def __init__(
        self, base_url: str, secret: str, *, timeout: timedelta = DEFAULT_TIMEOUT, client: httpx.Client | None = None,
        host: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/") + API_PATH
        self._secret = secret
        self.timeout = timeout
        # What the keeper bounds its waits by (a store's statement timeout), and what the task runtime's
        # preparation reads (no schema to check here: runtime/store.py).
        self.db = SimpleNamespace(statement_timeout=timeout, schema_current=True)
        self._client = client or httpx.Client(timeout=timeout.total_seconds(), verify=tls_verify(self.base_url))
        self._own_client = client is None
        #: The capability of each grant this store took, by (key, owner, token): kept in memory only.
        self._capabilities: dict[tuple[str, str, int], str] = {}
        self._store_id: str | None = None
        self.events = HttpLedger(self)
        #: The waiting places' ids by owner, and the capability of each place claimed, by (key, owner).
        self._place_ids: dict[str, str] = {}
        self._places: dict[tuple[str, str], str] = {}
        self.host = sendable_host(host if host is not None else socket.gethostname())

    def __repr__(self) -> str:  # never the secret
        return f"HttpLeaseStore({self.base_url!r})"

    # -- HTTP ---------------------------------------------------------------------------------------

    def _send(self, method: str, path: str, credential: str, body: dict[str, Any],
              timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {credential}"}
        wait = self.timeout.total_seconds() if timeout is None else timeout
        try:
            if method == "GET":
                response = self._client.get(self.base_url + path, params=body, headers=headers, timeout=wait)
            else:
                response = self._client.post(self.base_url + path, json=body, headers=headers, timeout=wait)
        except httpx.TimeoutException as exc:
            raise LeaseStoreUnavailable(
                f"the lease API did not answer {path} within {wait:.3g}s ({type(exc).__name__})"
            ) from None
        except httpx.HTTPError as exc:
            raise LeaseStoreUnavailable(f"the lease API could not be reached for {path} ({type(exc).__name__})") from None
        try:
            answer = response.json()
        except ValueError:
            answer = {"detail": response.text[:200]}
        code = response.status_code
        if code >= 500:
            raise LeaseStoreUnavailable(f"the lease API answered {code} to {path}: {answer.get('detail', '')}")
        if code == 422:
            raise InvalidArgument("request", path, f"refused by the lease API: {answer.get('detail')}")
        if code in (401, 403) and path == "/acquire":
            raise LeaseAPIRefused(f"the lease API refused the acquire ({code}): {answer.get('detail')}")
        return code, answer

    def _capability(self, lease: Lease) -> str:
        capability = self._capabilities.get((lease.key, lease.owner, lease.token))
        if capability is None:
            raise LeaseAPIRefused(f"no capability for lease {lease.key!r} token {lease.token}: not taken through this store")
        return capability

    @staticmethod
    def _ref(lease: Lease) -> dict[str, Any]:
        return {"key": lease.key, "owner": lease.owner, "token": lease.token}

    # -- the operations -------------------------------------------------------------------------------

    def _acquire(self, body: dict[str, Any]) -> Acquisition:
        if self.host is not None:
            body["host"] = self.host
        sent_at = time.monotonic()
        code, answer = self._send("POST", "/acquire", self._secret, body)
        if code == 200:
            lease = lease_from_json(answer["lease"], sent_at)
            self._capabilities[(lease.key, lease.owner, lease.token)] = answer["capability"]
            self._store_id = answer.get("store_id") or self._store_id
            replaced = answer.get("replaced")
            return Acquisition(lease, None, TokenHolder(replaced["owner"], int(replaced["token"])) if replaced else None)
        if code == 409 and answer.get("status") == "held":
            holders = tuple(_holder(h, body["key"], sent_at) for h in answer.get("holders", []))
            return Acquisition(None, holders[0] if holders else None, holders=holders if len(holders) > 1 else (),
                               holder_older=bool(answer.get("holder_older")))
        if code == 409 and answer.get("status") == "slot_count_mismatch":
            # As the direct store raises it: the key is held with another slot count (nothing was written).
            raise SlotCountMismatch(body["key"], int(body.get("slots", 1)),
                                    [_holder(h, body["key"], sent_at) for h in answer.get("holders", [])])
        if code == 409 and answer.get("status") == "lost":
            # Granted, then taken over, force-released or expired before the API could bind its capability:
            # the grant is nobody's, and this caller does not hold the key.
            raise LeaseLost(body["key"], int(answer.get("token") or 0),
                            "granted, then lost before the lease API answered the acquire")
        raise LeaseError(f"the lease API answered {code} to the acquire: {answer.get('detail', answer.get('status'))}")

    def try_acquire(self, key: str, owner: str, ttl: timedelta, *, slots: int = 1, request_id: str | None = None,
                    run: RunRef | None = None, **_: Any) -> Acquisition:
        body: dict[str, Any] = {"key": key, "owner": owner, "ttl_seconds": ttl.total_seconds(),
                                "policy": "slots" if slots != 1 else "single", "slots": slots, "run": _run(run)}
        if request_id:
            body["request_id"] = request_id
        return self._acquire(body)

    def try_replace(self, key: str, owner: str, ttl: timedelta, *, run_after: datetime, run: RunRef | None = None,
                    takeover: bool = True, request_id: str | None = None, **_: Any) -> Acquisition:
        body: dict[str, Any] = {"key": key, "owner": owner, "ttl_seconds": ttl.total_seconds(), "policy": "replace",
                                "run_after": run_after.isoformat(), "run": _run(run), "takeover": takeover}
        if request_id:
            body["request_id"] = request_id  # a resend answers the first send's grant, as for try_acquire
        return self._acquire(body)

    def replaced_by(self, lease: Lease) -> TokenHolder | None:
        """Who took ``lease`` over (policy replace), or None: not replaced (lost otherwise, or still held)."""
        code, answer = self._send("POST", "/replaced_by", self._secret, self._ref(lease))
        if code != 200:
            raise LeaseError(f"the lease API answered {code} to replaced_by: {answer.get('detail')}")
        by = answer.get("replaced_by")
        if not by:
            return None
        return TokenHolder(str(by["owner"]), int(by["token"]), RunRef.from_columns(by["run"]) if by.get("run") else None)

    def acquire(self, key: str, owner: str, ttl: timedelta, **kwargs: Any) -> Lease | None:
        return self.try_acquire(key, owner, ttl, **kwargs).lease

    def renew(self, lease: Lease, ttl: timedelta | None = None) -> Lease | None:
        """The renewed lease, or None when it is lost (refused, or the grant is no longer this one)."""
        body = self._ref(lease)
        if ttl is not None:
            body["ttl_seconds"] = ttl.total_seconds()
        sent_at = time.monotonic()
        code, answer = self._send("POST", "/renew", self._capability(lease), body, self.renew_timeout(lease, sent_at))
        if code == 200:
            return lease_from_json(answer["lease"], sent_at)
        if code in (403, 409):
            return None
        raise LeaseError(f"the lease API answered {code} to the renewal: {answer.get('detail')}")

    def renew_timeout(self, lease: Lease, now: float) -> float:
        """How long a renewal of ``lease`` may wait for its answer: half the lease's time left (counted as the
        keeper counts it: from before the request that last extended it), so that a retry on a new connection
        still has the other half (a connection that died without a word answers nothing, ever), and never
        less than :attr:`timeout`.

        A renewal answered late but within the lease's time left keeps the lease; given up at the request
        timeout instead, its work on the api-server is wasted (the renewal is usually done there all the same)
        and the keeper sends another a second later: on an api-server slowed down by load (issue 41 item 5: a
        thousand leases on a machine at load 30, every renewal given up after TTL/10), each lease then asked
        about every 4 s instead of every TTL/3 and the server fell further behind until the leases were lost.
        Waiting is safe: the keeper's deadline thread declares the lease lost at its deadline whatever a
        request in flight does, and an answer after that never brings a lost lease back."""
        base = self.timeout.total_seconds()
        if lease.sent_at is None:
            return base
        return max(base, (lease.sent_at + lease.remaining.total_seconds() - now) / 2)

    def release(self, lease: Lease, **_: Any) -> bool:
        code, answer = self._send("POST", "/release", self._capability(lease), self._ref(lease))
        return code == 200 and bool(answer.get("released"))

    def check(self, lease: Lease) -> bool:
        """Whether the grant is still held (one read of the store, through the api-server)."""
        code, answer = self._send("GET", "/check", self._capability(lease), self._ref(lease))
        return code == 200 and bool(answer.get("held"))

    def holds(self, key: str, owner: str, *, token: int | None = None) -> Holding:
        """Whether this process's grant of ``key`` by ``owner`` (``token``, when given) is still held, read
        afresh through the api-server; who else holds it is not shown over HTTP (the holder is then None)."""
        mine = [(k, o, t) for (k, o, t) in self._capabilities if k == key and o == owner and token in (None, t)]
        for ref in sorted(mine, key=lambda r: r[2], reverse=True):
            sent_at = time.monotonic()
            code, answer = self._send("POST", "/check", self._capabilities[ref], {"key": ref[0], "owner": ref[1], "token": ref[2]})
            if code == 200 and answer.get("held"):
                return Holding(key, owner, token, lease_from_json(answer["lease"], sent_at))
        return Holding(key, owner, token, None)

    def holder_host(self, lease: Lease) -> str | None:
        return None  # not shown over HTTP

    @property
    def store_id(self) -> str:
        """The api-server's lease store's id, as its last grant here said (an object fence records it)."""
        if self._store_id is None:
            raise LeaseError("no grant was taken through this lease API store yet: its store id is not known")
        return self._store_id

    def fences(self) -> HttpFences:
        """The fences of the api-server's store, for this store's grants (``lease.fence()`` on the API path)."""
        return HttpFences(self)

    # -- waiting (docs/api.md, decision 9) -----------------------------------------------------------

    #: On the API path: a waiting task's trigger polls through the api-server too (``LeaseFreeTrigger``).
    via_api = True

    def slot_holders(self, key: str) -> list[Lease]:
        """Who holds ``key`` now, by slot (none: free), as a refused acquire names them (owner, token, expiry)."""
        sent_at = time.monotonic()
        code, answer = self._send("POST", "/holders", self._secret, {"key": key})
        if code != 200:
            raise LeaseError(f"the lease API answered {code} to holders: {answer.get('detail')}")
        return [_holder(h, key, sent_at) for h in answer.get("holders", [])]

    def holder(self, key: str) -> Lease | None:
        """The holder of ``key`` (a semaphore's first slot's), or None when it is free."""
        found = self.slot_holders(key)
        return found[0] if found else None

    def waiters(self, keys: Any = None, **_: Any) -> list[Waiter]:
        """The live waiters of ``keys`` (a collection of keys: the API lists no more than that)."""
        if keys is None or isinstance(keys, str):
            raise InvalidArgument("keys", keys, "must be a collection of keys over the lease API")
        code, answer = self._send("POST", "/waiters", self._secret, {"keys": sorted(keys)})
        if code != 200:
            raise LeaseError(f"the lease API answered {code} to waiters: {answer.get('detail')}")
        return [_waiter(w) for w in answer.get("waiters", [])]

    def place_id(self, owner: str) -> str:
        """The random id of ``owner``'s waiting places through this store, made on first use. A waiting task
        hands it on to its trigger and to its resumed self (:meth:`adopt_place`), which derive the places'
        request ids from it with the acquire secret (:meth:`_place_request`): it carries no right alone, so
        it may be serialized with the trigger (the secret never is)."""
        return self._place_ids.setdefault(owner, secrets.token_urlsafe(24))

    def adopt_place(self, owner: str, place_id: str) -> None:
        """Keep (renew, give back) ``owner``'s places taken under ``place_id`` by another process."""
        self._place_ids[owner] = place_id

    def _place_request(self, key: str, owner: str) -> str:
        material = "\0".join(("lease-wait-place", self.place_id(owner), key)).encode()
        return base64.urlsafe_b64encode(hmac.new(self._secret.encode(), material, hashlib.sha256).digest()).decode()

    def wait_claim(self, key: str, owner: str, ttl: timedelta, *, max_waiting: int = 1,
                   run: RunRef | None = None) -> WaitClaim:
        """Take or keep ``owner``'s waiting place for ``key`` (as the direct store's ``wait_claim``: the store
        gives at most ``max_waiting`` places per key, atomically). Not claimed: every place is another's, or
        the owner's place was taken through another process whose place id this store does not have."""
        body: dict[str, Any] = {"key": key, "owner": owner, "ttl_seconds": ttl.total_seconds(),
                                "max_waiting": max_waiting, "request_id": self._place_request(key, owner),
                                "run": _run(run)}
        code, answer = self._send("POST", "/wait/claim", self._secret, body)
        if code in (200, 409) and "waiters" in answer:
            places = tuple(_waiter(w) for w in answer["waiters"])
            if code == 200:
                self._places[(key, owner)] = str(answer["capability"])
                if answer.get("taken_over"):
                    log.info("lease: the waiting place of %r for %r was taken over from its stale keeper "
                             "(a previous try's, which claimed it no more)", owner, key)
            return WaitClaim(key, owner, code == 200, places)
        if code == 403:
            at = answer.get("takeover_at")
            log.warning("lease: the waiting place of %r for %r was taken through another place id%s", owner, key,
                        f" (it may be taken over from {at}, when its keeper is dead)" if at else "")
            return WaitClaim(key, owner, False, (), takeover_at=datetime.fromisoformat(at) if at else None)
        raise LeaseError(f"the lease API answered {code} to the waiting place's claim: {answer.get('detail')}")

    def wait_release(self, key: str, owner: str) -> bool:
        """Give ``owner``'s waiting place for ``key`` back; whether it had one (through this place id)."""
        capability = self._places.pop((key, owner), None) or place_capability(self._place_request(key, owner))
        code, _ = self._send("POST", "/wait/release", capability, {"key": key, "owner": owner})
        return code == 200

    def fence(self, lease: Lease, resource: str, *, idempotency_key: str | None = None) -> tuple[bool, str]:
        """Advance the fence of ``resource`` to the grant's token (the store's own fence); (accepted, reason)."""
        body = {**self._ref(lease), "resource": resource}
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        code, answer = self._send("POST", "/fence", self._capability(lease), body)
        if code == 403:
            return False, "not this grant's capability any more (the lease changed)"
        return bool(answer.get("accepted")), str(answer.get("reason") or answer.get("status") or "")

    def close(self) -> None:
        if self._own_client:
            self._client.close()


class HttpFences:
    """The fence of the api-server's lease store, through the lease API, as a task's lease context uses a
    :class:`~airflow_lease_provider.core.FenceStore` (``guard``): the decision, raised when refused
    (:class:`~airflow_lease_provider.core.StaleFencingToken`, ``DuplicatePublish``), and with an idempotency
    key the claim given back when the block around the side effect raises, as on the direct path. A fenced
    transaction needs a connection to the database the fence is in: not on the API path."""

    def __init__(self, store: HttpLeaseStore) -> None:
        self._store = store

    def guard(self, resource: str, token: int, *, key: str, owner: str | None = None,
              idempotency_key: str | None = None, **_: Any) -> FenceDecision:
        ref = {"key": key, "owner": owner or "", "token": token}
        capability = self._store._capabilities.get((key, owner or "", token))
        if capability is None:
            raise LeaseAPIRefused(f"no capability for lease {key!r} token {token}: not taken through this store")
        body: dict[str, Any] = {**ref, "resource": resource}
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        code, answer = self._store._send("POST", "/fence", capability, body)
        if code == 403:
            raise LeaseLost(key, token, "the lease API no longer takes this grant's capability (the lease changed)")
        if code == 409 and answer.get("status") == "lost":
            raise LeaseLost(key, token, "the lease API says the lease is no longer held")
        if code not in (200, 409) or "outcome" not in answer:
            raise LeaseError(f"the lease API answered {code} to the fence: {answer.get('detail', answer.get('status'))}")

        def give_back() -> bool:
            try:
                _, given = self._store._send("POST", "/fence/give_back", capability,
                                             {**body, "idempotency_key": idempotency_key})
            except LeaseError:
                return False
            return bool(given.get("given_back"))

        decision = FenceDecision(
            resource, token, str(answer["outcome"]), answer.get("current_token"), idempotency_key=idempotency_key,
            key=key, newest_grant=answer.get("newest_grant"),
            _release=give_back if idempotency_key is not None and answer.get("accepted") else None,
        )
        decision.raise_if_rejected()
        return decision

    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        raise LeaseError(
            "a fenced transaction in the lease store's database needs a connection to it; with [lease] access "
            "= api (or auto without one) use lease.fence() and carry the token, or publish to another "
            "database with conn_id (docs/api.md)"
        )


class HttpLedger:
    """The ledger of a store on the API path: :meth:`record` sends the task's own events to the lease API's
    ``/event`` (a refusal with the acquire secret, a grant's event with its capability; docs/api.md). Sent
    once, never again after a lost answer (as the direct ledger: at most once), and never raises. Anything
    else a ledger offers (a catch-up record, queries) is not offered over HTTP: a no-op."""

    def __init__(self, store: HttpLeaseStore) -> None:
        self._store = store

    def record(self, kind: Any, key: str, *, owner: str | None = None, token: int | None = None,
               detail: dict[str, Any] | None = None, run: Any = None) -> bool:
        kind = str(getattr(kind, "value", kind))
        body: dict[str, Any] = {"kind": kind, "key": key, "owner": owner, "token": token, "detail": detail or {}}
        if run is not None:
            body["run"] = _run(run)
        try:
            if kind in ("skipped_overlap", "overlap_failed", "waiting", "skipped_buffer_full"):
                credential = self._store._secret
            else:
                credential = self._store._capabilities.get((key, owner or "", token or 0)) or ""
                if not credential:
                    log.warning("lease: the %s event of %r is not recorded: no capability for it here", kind, key)
                    return False
            code, answer = self._store._send("POST", "/event", credential, body)
        except LeaseError as exc:
            log.warning("lease: the %s event of %r could not be recorded over the lease API: %s", kind, key, exc)
            return False
        if code != 200:
            log.warning("lease: the lease API did not record the %s event of %r (%s): %s", kind, key, code,
                        answer.get("detail", answer.get("status")))
            return False
        return True

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def tls_verify(url: str) -> bool:
    """Whether a client for ``url`` needs TLS verification set up: not for a plain ``http://`` api-server URL.

    ``httpx.Client()`` loads the CA bundle when it is made, whatever the URL: 40-70 ms of CPU, a third of a
    no-op task under a LocalExecutor, paid by every leased task on the API path (issue 41 item 5). On a
    plain-HTTP URL there is no TLS to verify, and the client follows no redirect (httpx's default), so nothing
    is sent anywhere else; an ``https://`` URL gets the default verification, ``SSL_CERT_FILE`` and all."""
    return urlsplit(url).scheme.lower() != "http"


#: What the lease API takes as an acquire's ``host`` (plugins/lease_api.py ``Host``: the same rule).
_HOST = re.compile(r"[A-Za-z0-9._:\[\]-]{1,253}")


def sendable_host(host: str | None) -> str | None:
    """``host`` when the lease API takes it as the acquire's host; else None (logged once at debug: the
    api-server's host is recorded instead, and the acquire is never refused for it)."""
    if isinstance(host, str) and _HOST.fullmatch(host):
        return host
    log.debug("lease: the host name %r is not sent to the lease API (not a DNS name or address)", host)
    return None


def _run(run: RunRef | None) -> dict[str, Any] | None:
    if run is None:
        return None
    return {"dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id, "map_index": run.map_index}


def _waiter(data: dict[str, Any]) -> Waiter:
    run = data.get("run")
    return Waiter(key=str(data["key"]), owner=str(data["owner"]), since=datetime.fromisoformat(data["since"]),
                  expires_at=datetime.fromisoformat(data["expires_at"]), run=RunRef.from_columns(run) if run else None)


def _holder(data: dict[str, Any], key: str, sent_at: float) -> Lease:
    """A holder as the acquire's 409 names it (owner, token, expiry; no more is shown to a non-holder)."""
    expires = datetime.fromisoformat(data["expires_at"])
    return Lease(key=key, owner=data["owner"], token=int(data["token"]), ttl=timedelta(0), acquired_at=expires,
                 renewed_at=expires, expires_at=expires, released_at=None, observed_at=expires, sent_at=sent_at,
                 slot=int(data.get("slot", 1)), slots=int(data.get("slots", 1)))


def reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout`` (the direct path's precondition)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def choose_access(setting: str, connection_endpoint: Callable[[], tuple[str, int] | None]) -> str:
    """``direct`` or ``api``: the path a task takes (``[lease] access``, docs/api.md).

    ``direct`` and ``api`` are taken as set. ``auto``: direct when ``connection_endpoint()`` names the lease
    connection's server (None: no connection is defined) and it answers from here; else api.
    """
    if setting in ("direct", "api"):
        return setting
    endpoint = connection_endpoint()
    return "direct" if endpoint is not None and reachable(*endpoint) else "api"
