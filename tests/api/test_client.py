"""The task side of the lease API (client.py): a lease kept over HTTP by the same keeper as a direct one, loss
when the api-server stops answering (fail closed, before the lease could be anybody else's), and the path
choice. The api-server side is the real route code on a real PostgreSQL store, through FastAPI's TestClient."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from airflow_lease_provider import settings
from airflow_lease_provider.client import HttpLeaseStore, LeaseAPIRefused, choose_access
from airflow_lease_provider.core import LeaseKeeper, LeaseLost, LeaseStore, SlotCountMismatch
from tests.api.live_server import serving
from tests.api.test_lease_api import SECRET, make_client


class PausableClient(TestClient):
    """The api-server, which can stop answering (each request then times out, as a hung server's would)."""

    paused: threading.Event

    def _maybe_hang(self, kwargs: dict[str, Any]) -> None:
        if self.paused.is_set():
            time.sleep(float(kwargs.get("timeout") or 1))
            raise httpx.ReadTimeout("no answer")

    def post(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._maybe_hang(kwargs)
        return super().post(*args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._maybe_hang(kwargs)
        return super().get(*args, **kwargs)


@pytest.fixture
def server(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[PausableClient]:
    import json

    from airflow_lease_provider.plugins import lease_api

    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", json.dumps({"conn_type": "http", "password": SECRET}))
    monkeypatch.setattr(lease_api, "_secret_cache", [])
    app = make_client(store).app
    with PausableClient(app) as client:
        client.paused = threading.Event()
        yield client


def http_store(client: TestClient, timeout: float = 2.0) -> HttpLeaseStore:
    return HttpLeaseStore(str(client.base_url), SECRET, timeout=timedelta(seconds=timeout), client=client)


def test_acquire_held_and_a_wrong_secret(server: PausableClient) -> None:
    http = http_store(server)
    lease = http.acquire("k", "a", timedelta(seconds=30))
    assert lease is not None and lease.sent_at is not None
    taken = http.try_acquire("k", "b", timedelta(seconds=30))
    assert taken.lease is None and taken.holder is not None and taken.holder.owner == "a"
    assert http.check(lease)
    with pytest.raises(LeaseAPIRefused):
        HttpLeaseStore(str(server.base_url), SECRET + "x", client=server).acquire("k2", "a", timedelta(seconds=30))
    assert SECRET not in repr(http)


def test_the_keeper_renews_over_http_every_interval(server: PausableClient, store: LeaseStore) -> None:
    http = http_store(server)
    lease = http.acquire("kept", "me", timedelta(seconds=3))
    assert lease is not None
    keeper = LeaseKeeper(http, lease, renew_every=timedelta(seconds=0.5))
    with keeper:
        time.sleep(4)  # longer than the TTL: only the renewals keep it
        assert not keeper.lost
        held = store.holder("kept")
        assert held is not None and held.token == lease.token and held.expires_at > lease.expires_at
    assert keeper.renewals >= 3
    assert http.release(keeper.lease)
    assert store.holder("kept") is None


def test_an_api_server_that_stops_answering_loses_the_lease_before_it_expires(
    server: PausableClient, store: LeaseStore
) -> None:
    http = http_store(server, timeout=0.5)
    lease = http.acquire("hung", "me", timedelta(seconds=3))
    assert lease is not None
    seen: list[Any] = []
    lost = threading.Event()

    def on_lost(error: LeaseLost) -> None:
        # At the moment the holder is told, the store still has its grant: nobody else can have it yet.
        seen.append(store.holder("hung"))
        lost.set()

    keeper = LeaseKeeper(http, lease, renew_every=timedelta(seconds=0.5), on_lost=on_lost)
    with keeper:
        time.sleep(0.8)
        assert keeper.renewals >= 1
        server.paused.set()
        assert lost.wait(6), "the keeper never declared the lease lost"
    assert seen and seen[0] is not None and seen[0].token == lease.token
    assert keeper.lost
    time.sleep(3.2)
    assert store.holder("hung") is None  # and it lapsed by its TTL, as a crashed holder's does


def test_the_path_choice() -> None:
    assert choose_access("direct", lambda: None) == "direct"
    assert choose_access("api", lambda: ("127.0.0.1", 5432)) == "api"
    assert choose_access("auto", lambda: None) == "api"  # no lease connection
    assert choose_access("auto", lambda: ("127.0.0.1", 1)) == "api"  # defined, but no route to it


def test_auto_is_direct_where_the_store_answers(pg_dsn: str) -> None:
    parts = urlsplit(pg_dsn)
    if not parts.hostname:
        pytest.skip("the test server listens on a Unix socket")
    assert choose_access("auto", lambda: (parts.hostname, parts.port or 5432)) == "direct"


def test_settings_access_and_the_api_server_url(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings.access() == "auto"
    monkeypatch.setenv("AIRFLOW__LEASE__ACCESS", "api")
    assert settings.access() == "api"
    monkeypatch.setenv("AIRFLOW__LEASE__ACCESS", "sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        settings.access()
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "http://api.example:8080/execution/")
    assert settings.api_server_url() == "http://api.example:8080"


def test_a_skip_over_http_is_recorded_once_through_the_task_outcome_path(server: PausableClient, store: LeaseStore) -> None:
    """``outcomes.report`` on the API path writes the skip as on the direct path: one event, the run columns."""
    from airflow_lease_provider.core import RunRef
    from airflow_lease_provider.runtime.outcomes import Outcome, report

    http = http_store(server)
    holder = http.acquire("skipped", "first-run", timedelta(seconds=30))
    assert holder is not None
    run = RunRef("dag", "scheduled__2", task_id="t")
    refused = http.try_acquire("skipped", run.owner(), timedelta(seconds=30))
    assert refused.lease is None and refused.holder is not None
    report(Outcome.SKIPPED_OVERLAP, store=http, key="skipped", owner=run.owner(), message="skipping", run=run,
           detail={"holder_owner": refused.holder.owner, "holder_token": refused.holder.token, "policy": "skip"})
    skips = [e for e in store.events.query(key="skipped") if e.kind == "skipped_overlap"]
    assert len(skips) == 1 and skips[0].run == run and skips[0].owner == run.owner()
    # The keeper's loss, by the grant's capability.
    assert http.events.record("lost", "skipped", owner="first-run", token=holder.token, detail={"reason": "test"})
    assert [e.token for e in store.events.query(key="skipped") if e.kind == "lost"] == [holder.token]


def test_auto_takes_the_api_path_when_the_lease_connection_does_not_answer_from_here(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``[lease] access = auto`` with a lease connection that is defined but unreachable from the worker (its
    port closed): a short probe within the connect timeout, then the lease API, logged once; a connection
    that answers stays direct, and without ``lease_api`` the direct path (and its error) stands."""
    import json
    import socket

    from airflow_lease_provider.core import LeaseStore
    from airflow_lease_provider.runtime import store as runtime_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    parts = urlsplit(pg_dsn)
    closed = {"conn_type": "postgres", "host": "127.0.0.1", "port": closed_port, "login": parts.username or "postgres",
              "schema": parts.path.lstrip("/") or "postgres", "extra": {"connect_timeout": 2}}
    monkeypatch.setenv("AIRFLOW__LEASE__ACCESS", "auto")
    monkeypatch.setenv("AIRFLOW__LEASE__API_URL", "http://api-server.invalid:8080")
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", json.dumps(closed))
    monkeypatch.setattr(runtime_store, "_logged_unreachable", set())
    monkeypatch.setattr(runtime_store, "_reachable_endpoints", set())
    task = type("Task", (), {"lease_ttl": timedelta(seconds=30), "lease_renew_every": None, "on_overlap": "skip"})()
    # Without the lease API: the direct path stands (its connect error says what is wrong).
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_API", raising=False)
    assert isinstance(runtime_store.task_store(task, None), LeaseStore)
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", json.dumps({"conn_type": "http", "password": SECRET}))
    caplog.set_level("INFO")
    started = time.monotonic()
    first = runtime_store.task_store(task, None)
    assert isinstance(first, HttpLeaseStore) and time.monotonic() - started < 10
    assert isinstance(runtime_store.task_store(task, None), HttpLeaseStore)
    said = [r for r in caplog.records if "does not answer from this host" in r.getMessage()]
    assert len(said) == 1 and "lease API" in said[0].getMessage()
    # A lease connection that answers: direct.
    reachable = {**closed, "host": parts.hostname or "127.0.0.1", "port": parts.port or 5432}
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", json.dumps(reachable))
    assert isinstance(runtime_store.task_store(task, None), LeaseStore)


@pytest.mark.parametrize(("dsn", "endpoint"), [
    ("postgresql://u:p/a@ss@db.example:6543/x", ("db.example", 6543)),  # a password with / and @, as libpq misreads
    ("postgresql://[::1]:5433/d", ("::1", 5433)),
    ("host=10.0.0.1 dbname=x", ("10.0.0.1", 5432)),
    ("host=/tmp dbname=x", None),  # a Unix socket: not probed
    ("host=h1,h2 dbname=x", None),  # several hosts: libpq's choice, not probed
    ("postgresql:///db", None),
])
def test_the_endpoint_auto_probes(dsn: str, endpoint: tuple[str, int] | None) -> None:
    from airflow_lease_provider.core.db.dsn import server_endpoint

    assert server_endpoint(dsn) == endpoint


@pytest.fixture
def slow_server(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The lease API on a real port (uvicorn, the real routes, the real store), answering every renewal
    :data:`RENEW_DELAY` late, as an api-server slowed down by load does."""
    import asyncio
    import json

    from fastapi import FastAPI, Request

    from airflow_lease_provider.plugins import lease_api

    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", json.dumps({"conn_type": "http", "password": SECRET}))
    monkeypatch.setattr(lease_api, "_secret_cache", [])
    app = make_client(store).app  # the routes of the TestClient tests, here on a real port
    assert isinstance(app, FastAPI)

    @app.middleware("http")
    async def slow_renewals(request: Request, call_next: Any) -> Any:
        if request.url.path.endswith("/renew"):
            await asyncio.sleep(RENEW_DELAY)
        return await call_next(request)

    with serving(app) as url:
        yield url


#: How late the slow server answers each renewal: longer than the store's request timeout in the test below,
#: well within the lease's time left.
RENEW_DELAY = 1.5


def test_a_renewal_answered_after_the_request_timeout_but_within_the_time_left_keeps_the_lease(
    slow_server: str, store: LeaseStore
) -> None:
    """Issue 41 item 5: a renewal waits for its answer as long as the lease can still be saved, not just the
    store's request timeout. With every renewal answered 1.5 s late and a 0.5 s request timeout, renewals
    given up at the timeout (and sent again a moment later, each one done by the server all the same) lost
    every lease of a thousand on a loaded api-server; here the lease is kept past two TTLs. (A 12 s TTL renewed
    every 2 s: a renewal may then wait about 4 s for its 1.5 s-late answer. With a 6 s TTL renewed every
    second the margin was a quarter of a second, and a full suite's load on 2 cores ate it.)"""
    warm = HttpLeaseStore(slow_server, SECRET)  # the server's first request (its secret and store looked up)
    assert warm.acquire("warm-up", "me", timedelta(seconds=30)) is not None
    warm.close()
    # The acquire at the default request timeout (only renewals are answered late; a 0.5 s acquire timed out
    # on a loaded machine), then the 0.5 s timeout the renewals are measured against.
    http = HttpLeaseStore(slow_server, SECRET)
    try:
        lease = http.acquire("slow", "me", timedelta(seconds=12))
        assert lease is not None and lease.sent_at is not None
        http.timeout = timedelta(seconds=0.5)
        # The renewal may wait for half the lease's time left (about the TTL now: a retry has the other half),
        # never less than the timeout.
        now = time.monotonic()
        assert http.renew_timeout(lease, now) == pytest.approx((12 - (now - lease.sent_at)) / 2, abs=0.01)
        assert http.renew_timeout(lease, now) <= 6.0
        assert http.renew_timeout(lease, lease.sent_at + 8) == pytest.approx(2.0, abs=0.1)
        assert http.renew_timeout(lease, lease.sent_at + 20) == pytest.approx(0.5)
        keeper = LeaseKeeper(http, lease, renew_every=timedelta(seconds=2))
        with keeper:
            time.sleep(25)  # over two TTLs: only renewals answered 1.5 s late keep it
            assert not keeper.lost, keeper.lost_reason
            held = store.holder("slow")
            assert held is not None and held.token == lease.token and held.expires_at > lease.expires_at
        assert keeper.renewals >= 3
        assert store.holder("slow") is None  # released when the keeper stopped
    finally:
        http.close()


def test_a_plain_http_api_server_url_loads_no_ca_bundle_and_https_verifies() -> None:
    """Issue 41 item 5: every leased task on the API path makes a store; on a plain ``http://`` URL its client
    loads no CA bundle (40-70 ms of CPU per task for nothing: there is no TLS, and no redirect is followed),
    while an ``https://`` URL keeps the default verification."""
    import ssl

    from airflow_lease_provider.client import tls_verify

    def context(store: HttpLeaseStore) -> ssl.SSLContext:
        return store._client._transport._pool._ssl_context  # type: ignore[attr-defined,no-any-return]

    plain, tls = HttpLeaseStore("http://127.0.0.1:1", SECRET), HttpLeaseStore("https://127.0.0.1:1", SECRET)
    try:
        assert not tls_verify("http://airflow:8080") and not tls_verify("HTTP://airflow") and tls_verify("https://a")
        assert context(plain).cert_store_stats()["x509_ca"] == 0
        assert context(tls).verify_mode == ssl.CERT_REQUIRED and context(tls).cert_store_stats()["x509_ca"] > 0
        assert not plain._client.follow_redirects and not tls._client.follow_redirects
    finally:
        plain.close()
        tls.close()


# -- what the chaos harness's HTTP workers found (issue 41; docs/testing.md) ---------------------------------


def test_a_slot_count_mismatch_over_http_is_the_direct_paths_slot_count_mismatch(server: PausableClient) -> None:
    """The key held with slots=2: an acquire with slots=3 through the API raises SlotCountMismatch naming the
    holders, as the direct store does (it was a bare LeaseError "answered 409", an unexpected error)."""
    http = http_store(server)
    held = http.try_acquire("pool", "a", timedelta(seconds=30), slots=2).lease
    assert held is not None and held.slots == 2
    with pytest.raises(SlotCountMismatch) as refused:
        http.try_acquire("pool", "b", timedelta(seconds=30), slots=3)
    assert refused.value.key == "pool" and refused.value.slots == 3
    assert [(h.owner, h.token, h.slots) for h in refused.value.holders] == [("a", held.token, 2)]


def test_an_acquire_granted_and_lost_before_its_answer_raises_lease_lost(
    server: PausableClient, store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant is taken over (here force-released) between the store's grant and the API binding its
    capability: the API answers 409 lost, and the client raises LeaseLost for that token (it was a bare
    LeaseError), never a lease it does not hold."""
    from airflow_lease_provider.plugins import lease_api

    real_bind = lease_api.caps.bind

    def bind_after_a_takeover(api_store: Any, lease: Any, capability: str) -> bool:
        store.force_release(lease.key, by="test")
        return real_bind(api_store, lease, capability)

    monkeypatch.setattr(lease_api.caps, "bind", bind_after_a_takeover)
    http = http_store(server)
    with pytest.raises(LeaseLost) as lost:
        http.try_acquire("lapsed", "me", timedelta(seconds=30))
    taken = store.holder("lapsed")
    assert taken is None  # force-released: nobody holds it
    assert lost.value.key == "lapsed" and lost.value.token >= 1
    assert not http._capabilities  # no capability kept for a grant it does not hold


def test_a_replace_sent_again_with_its_request_id_gets_the_same_grant(server: PausableClient) -> None:
    """try_replace sends its request_id (it was swallowed): a resend after a lost answer gets the first
    send's grant and capability, not a second grant (a re-entry with a larger token)."""
    http = http_store(server)
    request_id = secrets.token_urlsafe(24)
    order = datetime(2026, 1, 1, tzinfo=timezone.utc)
    first = http.try_replace("replaced", "me", timedelta(seconds=30), run_after=order, request_id=request_id).lease
    again = http.try_replace("replaced", "me", timedelta(seconds=30), run_after=order, request_id=request_id).lease
    assert first is not None and again is not None
    assert again.token == first.token
    assert http.renew(again) is not None
