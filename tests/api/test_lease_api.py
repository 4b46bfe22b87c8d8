"""The lease API's routes (plugins/lease_api.py; docs/api.md) on a real PostgreSQL store, through FastAPI's
TestClient: authentication (401), authorization per grant (403), the policies, idempotent resends, the fence,
bad input (422), an unreachable store (503), and no secret in any answer or log line."""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from airflow_lease_provider.core import FenceStore, LeaseStore, RunRef
from airflow_lease_provider.plugins import lease_api

SECRET = "acquire-" + secrets.token_urlsafe(16)


def make_client(store: LeaseStore) -> TestClient:
    app = FastAPI()
    api = lease_api.create_api()
    api.dependency_overrides[lease_api.get_api_store] = lambda: store
    api.dependency_overrides[lease_api.get_api_fences] = lambda: FenceStore(store.db.dsn, schema=store.schema)
    app.mount("/lease/v1", api)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", json.dumps({"conn_type": "http", "password": SECRET}))
    monkeypatch.setattr(lease_api, "_secret_cache", [])


@pytest.fixture
def client(store: LeaseStore, enabled: None, caplog: pytest.LogCaptureFixture) -> Iterator[TestClient]:
    caplog.set_level(logging.DEBUG)
    with make_client(store) as c:
        yield c
    assert SECRET not in caplog.text


def auth(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


def acquire(client: TestClient, key: str, owner: str, ttl: float = 30, **extra: Any) -> Any:
    return client.post("/lease/v1/acquire", json={"key": key, "owner": owner, "ttl_seconds": ttl, **extra},
                       headers=auth(SECRET))


def grant(response: Any) -> tuple[dict[str, Any], str]:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "granted"
    return {k: body["lease"][k] for k in ("key", "owner", "token")}, body["capability"]


ROUTES = [("POST", "/lease/v1/acquire"), ("POST", "/lease/v1/renew"), ("POST", "/lease/v1/release"),
          ("POST", "/lease/v1/check"), ("GET", "/lease/v1/check?key=k&owner=o&token=1"), ("POST", "/lease/v1/fence"),
          ("POST", "/lease/v1/event")]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("header", [None, "Basic abc", "Bearer ", "Bearer"])
def test_no_credentials_is_401(client: TestClient, method: str, path: str, header: str | None) -> None:
    headers = {"Authorization": header} if header is not None else {}
    body = {"key": "k", "owner": "o", "token": 1, "ttl_seconds": 5, "resource": "r"}
    response = client.request(method, path, json=body if method == "POST" else None, headers=headers)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"


def test_acquire_with_the_wrong_secret_is_403_and_takes_nothing(client: TestClient, store: LeaseStore) -> None:
    response = client.post("/lease/v1/acquire", json={"key": "k", "owner": "o", "ttl_seconds": 30},
                           headers=auth(SECRET + "x"))
    assert response.status_code == 403
    assert store.holder("k") is None


def test_without_the_lease_api_connection_acquire_is_403_not_enabled(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_LEASE_API", raising=False)
    monkeypatch.setattr(lease_api, "_secret_cache", [])
    monkeypatch.setattr(lease_api, "_lookup_secret", lambda: None)  # the lookup as it answers "not defined"
    with make_client(store) as client:
        response = acquire(client, "k", "o")
    assert response.status_code == 403
    assert "lease API not enabled" in response.json()["detail"]
    assert store.holder("k") is None


def test_the_connection_lookup_answers_none_when_lease_api_is_undefined(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_lease_provider.hooks import lease as hooks

    def missing(conn_id: str) -> Any:
        assert conn_id == "lease_api"
        raise hooks.AirflowNotFoundException(conn_id)

    monkeypatch.setattr(hooks, "_get_connection", missing)
    assert lease_api._lookup_secret() is None


def test_acquire_renew_check_release_and_their_resends(client: TestClient, store: LeaseStore) -> None:
    ref, capability = grant(acquire(client, "daily", "run-1", ttl=30))
    assert store.holder("daily").token == ref["token"]
    # Held by another: 409 with who holds it, and no capability.
    held = acquire(client, "daily", "run-2")
    assert held.status_code == 409
    assert held.json()["status"] == "held"
    assert [(h["owner"], h["token"]) for h in held.json()["holders"]] == [("run-1", ref["token"])]
    assert "capability" not in held.text
    first = client.post("/lease/v1/renew", json=ref, headers=auth(capability))
    second = client.post("/lease/v1/renew", json=ref, headers=auth(capability))
    assert first.status_code == second.status_code == 200, first.text
    assert second.json()["lease"]["expires_at"] >= first.json()["lease"]["expires_at"]
    assert capability not in first.text
    checked = client.get("/lease/v1/check", params=ref, headers=auth(capability))
    assert checked.status_code == 200 and checked.json()["held"] is True
    assert client.post("/lease/v1/check", json=ref, headers=auth(capability)).json()["held"] is True
    released = [client.post("/lease/v1/release", json=ref, headers=auth(capability)) for _ in range(2)]
    assert [r.status_code for r in released] == [200, 200]
    assert released[0].json() == released[1].json()
    assert released[0].json()["released"] is True
    assert store.holder("daily") is None
    assert client.post("/lease/v1/check", json=ref, headers=auth(capability)).json()["held"] is False
    # The next grant is another's: the old capability acts under nothing.
    ref2, _ = grant(acquire(client, "daily", "run-2"))
    assert ref2["token"] > ref["token"]
    for path in ("/lease/v1/renew", "/lease/v1/release", "/lease/v1/check"):
        assert client.post(path, json=ref, headers=auth(capability)).status_code == 403, path
    assert store.holder("daily").owner == "run-2"


def test_a_capability_acts_only_under_its_own_grant(client: TestClient, store: LeaseStore) -> None:
    a, cap_a = grant(acquire(client, "key-a", "a"))
    b, cap_b = grant(acquire(client, "key-b", "b"))
    assert cap_a != cap_b
    # B's capability for A's grant, A's with a made-up token or owner, a made-up capability: all 403.
    attempts = [(a, cap_b), ({**a, "token": a["token"] + 1}, cap_a), ({**a, "owner": "b"}, cap_a),
                (a, secrets.token_urlsafe(32)), (a, SECRET)]
    for ref, credential in attempts:
        for path in ("/lease/v1/renew", "/lease/v1/release", "/lease/v1/check"):
            response = client.post(path, json=ref, headers=auth(credential))
            assert response.status_code == 403, (path, ref, response.text)
        fenced = client.post("/lease/v1/fence", json={**ref, "resource": "r"}, headers=auth(credential))
        assert fenced.status_code == 403
    assert store.holder("key-a").token == a["token"] and store.holder("key-a").released_at is None
    # A direct-path grant (no capability on its row) cannot be acted under at all.
    direct = store.acquire("direct", "task", timedelta(seconds=30))
    assert direct is not None
    ref = {"key": "direct", "owner": "task", "token": direct.token}
    assert client.post("/lease/v1/release", json=ref, headers=auth(cap_a)).status_code == 403
    assert store.holder("direct") is not None


def test_a_lapsed_grant_renews_as_lost(client: TestClient) -> None:
    ref, capability = grant(acquire(client, "short", "me", ttl=1))
    time.sleep(1.3)
    response = client.post("/lease/v1/renew", json=ref, headers=auth(capability))
    assert response.status_code == 409
    assert response.json()["status"] == "lost"
    fenced = client.post("/lease/v1/fence", json={**ref, "resource": "r"}, headers=auth(capability))
    assert fenced.status_code == 409


def test_an_acquire_sent_again_with_its_request_id_gets_the_same_grant(client: TestClient, store: LeaseStore) -> None:
    request_id = secrets.token_urlsafe(24)
    first = acquire(client, "resent", "me", request_id=request_id)
    second = acquire(client, "resent", "me", request_id=request_id)
    assert grant(first) == grant(second)
    assert second.json().get("resent") is True
    assert store.holder("resent").token == first.json()["lease"]["token"]
    # Another request id of the same owner re-enters: a new grant, the first's capability is void.
    ref, capability = grant(first)
    third, _ = grant(acquire(client, "resent", "me", request_id=secrets.token_urlsafe(24)))
    assert third["token"] > ref["token"]
    assert client.post("/lease/v1/renew", json=ref, headers=auth(capability)).status_code == 403


def test_slots_policy(client: TestClient) -> None:
    got = [grant(acquire(client, "sem", f"w{i}", policy="slots", slots=2)) for i in range(2)]
    assert {ref["key"] for ref, _ in got} == {"sem", "sem#2"}
    refused = acquire(client, "sem", "w3", policy="slots", slots=2)
    assert refused.status_code == 409
    assert sorted(h["owner"] for h in refused.json()["holders"]) == ["w0", "w1"]
    # Each slot's holder renews under its own slot key; a slot count change while held: 409.
    for ref, capability in got:
        assert client.post("/lease/v1/renew", json=ref, headers=auth(capability)).status_code == 200
    assert acquire(client, "sem", "w4", policy="slots", slots=3).status_code == 409


def test_replace_policy_takes_over_from_an_older_run(client: TestClient) -> None:
    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
    old, old_cap = grant(acquire(client, "rep", "run-1", policy="replace", run_after=t0.isoformat()))
    taken = acquire(client, "rep", "run-2", policy="replace", run_after=(t0 + timedelta(days=1)).isoformat())
    new, _ = grant(taken)
    assert new["token"] > old["token"]
    assert taken.json()["replaced"] == {"owner": "run-1", "token": old["token"]}
    assert client.post("/lease/v1/renew", json=old, headers=auth(old_cap)).status_code == 403
    older = acquire(client, "rep", "run-0", policy="replace", run_after=(t0 - timedelta(days=1)).isoformat())
    assert older.status_code == 409


def test_fence_accepts_the_holder_once_per_idempotency_key_and_refuses_a_stale_token(
    client: TestClient, store: LeaseStore
) -> None:
    ref, capability = grant(acquire(client, "pub", "me"))
    body = {**ref, "resource": "blog", "idempotency_key": "2026-12-07"}
    accepted = client.post("/lease/v1/fence", json=body, headers=auth(capability))
    assert accepted.status_code == 200 and accepted.json()["accepted"] is True
    again = client.post("/lease/v1/fence", json=body, headers=auth(capability))
    assert again.status_code == 409 and again.json()["status"] == "refused"
    fences = FenceStore(store.db.dsn, schema=store.schema)
    try:
        assert fences.current("blog", key="pub") == ref["token"]
        # A newer token of the key published directly: this holder's next publish is refused by the fence.
        assert fences.accept("blog", ref["token"] + 1, key="pub")
    finally:
        fences.close()
    stale = client.post("/lease/v1/fence", json={**ref, "resource": "blog"}, headers=auth(capability))
    assert stale.status_code == 409 and stale.json()["accepted"] is False and stale.json()["reason"]


@pytest.mark.parametrize(
    ("body", "field"),
    [({"key": "k", "owner": "o", "ttl_seconds": 0}, "ttl_seconds"),
     ({"key": "", "owner": "o", "ttl_seconds": 5}, "key"),
     ({"key": "k" * 513, "owner": "o", "ttl_seconds": 5}, "key"),
     ({"key": "k", "owner": "o", "ttl_seconds": 5, "policy": "replace"}, "run_after"),
     ({"key": "k", "owner": "o", "ttl_seconds": 5, "slots": 2}, "slots"),
     ({"key": "k", "owner": "o", "ttl_seconds": 5, "policy": "mine"}, "policy"),
     ({"key": "k", "owner": "o", "ttl_seconds": 5, "request_id": "short-secret"}, "request_id"),
     ({"key": "k\x00", "owner": "o", "ttl_seconds": 5}, "key")],
)
def test_bad_input_is_422_naming_the_field(client: TestClient, store: LeaseStore, body: dict[str, Any], field: str) -> None:
    response = client.post("/lease/v1/acquire", json=body, headers=auth(SECRET))
    assert response.status_code == 422, response.text
    assert field in response.text
    if "request_id" in body:
        assert body["request_id"] not in response.text  # a request id is a secret: never echoed
    assert store.holder("k") is None


def test_a_secrets_backend_that_fails_is_503_and_takes_nothing(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> Any:
        raise RuntimeError(f"backend down (it said {SECRET})")

    monkeypatch.setattr(lease_api, "_secret_cache", [])
    monkeypatch.setattr(lease_api, "_lookup_secret", broken)
    with make_client(store) as client:
        response = acquire(client, "k", "o")
    assert response.status_code == 503
    assert SECRET not in response.text and SECRET not in caplog.text
    assert store.holder("k") is None


def test_an_unreachable_store_is_503(enabled: None) -> None:
    dead = LeaseStore("postgresql://postgres@127.0.0.1:1/none", connect_timeout=timedelta(seconds=1))
    with make_client(dead) as client:
        acquired = acquire(client, "k", "o")
        renewed = client.post("/lease/v1/renew", json={"key": "k", "owner": "o", "token": 1}, headers=auth("x" * 43))
    assert acquired.status_code == renewed.status_code == 503
    assert "127.0.0.1" not in acquired.text + renewed.text


RUN = {"dag_id": "d", "run_id": "scheduled__2026-12-01", "task_id": "t", "map_index": -1}


def test_a_skip_is_recorded_once_with_the_run_columns_while_the_named_holder_holds_the_key(
    client: TestClient, store: LeaseStore
) -> None:
    ref, capability = grant(acquire(client, "ev", "holder"))
    skip = {"kind": "skipped_overlap", "key": "ev", "owner": "d/scheduled__2026-12-01/t", "run": RUN,
            "detail": {"holder_owner": "holder", "holder_token": ref["token"], "policy": "skip"}}
    # A capability is not the acquire secret (a refusal is recorded with the secret only).
    assert client.post("/lease/v1/event", json=skip, headers=auth(capability)).status_code == 403
    assert client.post("/lease/v1/event", json=skip, headers=auth(SECRET + "x")).status_code == 403
    # A holder that does not hold the key (a forged history): refused, nothing recorded.
    forged = {**skip, "detail": {**skip["detail"], "holder_token": ref["token"] + 7}}
    assert client.post("/lease/v1/event", json=forged, headers=auth(SECRET)).status_code == 409
    # Nor may it name the holder's token with another run as its owner (the page would blame that run).
    blamed = {**skip, "detail": {**skip["detail"], "holder_owner": "d/scheduled__2026-11-30/innocent"}}
    refused = client.post("/lease/v1/event", json=blamed, headers=auth(SECRET))
    assert refused.status_code == 409 and refused.json()["status"] == "not_held", refused.text
    # Nor may the holder "skip" against itself.
    assert client.post("/lease/v1/event", json={**skip, "owner": "holder"}, headers=auth(SECRET)).status_code == 409
    assert not [e for e in store.events.query(key="ev") if e.kind == "skipped_overlap"]
    answer = client.post("/lease/v1/event", json=skip, headers=auth(SECRET))
    assert answer.status_code == 200, answer.text
    skips = [e for e in store.events.query(key="ev") if e.kind == "skipped_overlap"]
    assert len(skips) == 1
    assert skips[0].owner == "d/scheduled__2026-12-01/t"
    assert skips[0].run == RunRef("d", "scheduled__2026-12-01", task_id="t")
    assert skips[0].detail["holder_token"] == ref["token"]
    # Once the holder released, no skip against it is recorded any more.
    assert client.post("/lease/v1/release", json=ref, headers=auth(capability)).status_code == 200
    assert client.post("/lease/v1/event", json=skip, headers=auth(SECRET)).status_code == 409


def test_a_grant_event_needs_that_grant_s_capability(client: TestClient, store: LeaseStore) -> None:
    ref, capability = grant(acquire(client, "ev2", "holder"))
    other_ref, other_capability = grant(acquire(client, "ev3", "holder"))
    lost = {"kind": "lost", **ref, "detail": {"reason": "the api-server stopped answering"}}
    assert client.post("/lease/v1/event", json=lost, headers=auth(SECRET)).status_code == 403
    assert client.post("/lease/v1/event", json=lost, headers=auth(other_capability)).status_code == 403
    no_token = {k: v for k, v in lost.items() if k != "token"}
    assert client.post("/lease/v1/event", json=no_token, headers=auth(capability)).status_code == 422
    assert client.post("/lease/v1/event", json=lost, headers=auth(capability)).status_code == 200
    events = [e for e in store.events.query(key="ev2") if e.kind == "lost"]
    assert len(events) == 1 and events[0].token == ref["token"]
    assert not [e for e in store.events.query(key="ev3") if e.kind == "lost"]


def test_a_renewal_is_one_statement_checking_the_capability(
    client: TestClient, store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 leases renewing through one api-server: each renewal is one round trip to the store."""
    ref, capability = grant(acquire(client, "one-trip", "o", ttl=30))
    db = store._ready()
    sent: list[str] = []
    real_run = db.run
    monkeypatch.setattr(db, "run", lambda name, *a, **kw: (sent.append(name), real_run(name, *a, **kw))[1])
    renewed = client.post("/lease/v1/renew", json={**ref, "ttl_seconds": 40}, headers=auth(capability))
    assert renewed.status_code == 200 and renewed.json()["lease"]["ttl_seconds"] == 40
    assert sent == ["api_capability_renew"]
    # Its own TTL when none is sent; a wrong capability is still 403 (read only on that path), a lapsed one 409.
    sent.clear()
    assert client.post("/lease/v1/renew", json=ref, headers=auth(capability)).json()["lease"]["ttl_seconds"] == 40
    assert sent == ["api_capability_renew"]
    assert client.post("/lease/v1/renew", json=ref, headers=auth(capability + "x")).status_code == 403


def test_request_threads_have_stores_of_their_own_on_one_pool_of_api_pool_size(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request thread renews on a store of its own (a store runs one statement at a time), and all of
    them share at most ``[lease] api_pool_size`` connections: nobody queues on one connection."""
    import threading
    from types import SimpleNamespace

    from airflow_lease_provider import settings
    from airflow_lease_provider.core import capability as caps

    monkeypatch.setenv("AIRFLOW__LEASE__API_POOL_SIZE", "3")
    assert settings.api_pool_size() == 3
    where = SimpleNamespace(location=SimpleNamespace(dsn=store.db.dsn, schema=store.schema))
    monkeypatch.setattr(lease_api.LeaseHook, "for_api_server", lambda **_: where)
    monkeypatch.setattr(lease_api, "_local", threading.local())
    grants = []
    for n in range(8):
        lease = store.acquire(f"pooled-{n}", "o", timedelta(seconds=30))
        assert lease is not None
        capability = caps.new_capability()
        assert caps.bind(store, lease, capability)
        grants.append((lease, capability))
    stores: list[LeaseStore] = []
    renewed: list[bool] = []
    start = threading.Barrier(8)

    def renew_many(lease: Any, capability: str) -> None:
        mine = lease_api.get_api_store()
        stores.append(mine)
        assert lease_api.get_api_store() is mine  # one per thread, kept
        start.wait()
        for _ in range(10):
            renewed.append(caps.renew(mine, lease.key, lease.owner, lease.token, capability, None) is not None)

    threads = [threading.Thread(target=renew_many, args=g) for g in grants]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert renewed == [True] * 80
    assert len({id(s) for s in stores}) == 8
    pools = {id(s.db._shared_pool()) for s in stores}
    assert len(pools) == 1
    pool = stores[0].db._shared_pool()
    assert pool.size == 3 and pool.connects <= 3 and pool.reuses >= 70
    with pytest.raises(ValueError, match="api_pool_size"):
        monkeypatch.setenv("AIRFLOW__LEASE__API_POOL_SIZE", "0")
        settings.api_pool_size()


@pytest.mark.parametrize("path", ["renew", "release", "check", "check?", "fence", "fence/give_back", "event"])
@pytest.mark.parametrize("field", ["key", "owner"])
def test_a_nul_in_the_grant_named_on_a_capability_route_is_422_naming_the_field_and_changes_nothing(
    client: TestClient, store: LeaseStore, path: str, field: str
) -> None:
    """Found by issue 41's attack tier: these reached the driver unchecked and answered 500 (an unhandled ValueError: "A string
    literal cannot contain NUL"), with a traceback in the api-server's log; now the capability's lookup checks
    the names as the store does."""
    ref, capability = grant(acquire(client, "nul-key", "nul-owner"))
    before = store.holder("nul-key")
    hostile = {**ref, field: ref[field] + "\x00", "resource": "nul-target", "idempotency_key": "i", "kind": "lost"}
    if path == "check?":
        response = client.get("/lease/v1/check", params=hostile, headers=auth(capability))
    else:
        response = client.post(f"/lease/v1/{path}", json=hostile, headers=auth(capability))
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith(f"{field}=") and "NUL" in response.json()["detail"]
    assert capability not in response.text
    after = store.holder("nul-key")
    assert after is not None and before is not None
    assert (after.token, after.renewed_at, after.released_at) == (before.token, before.renewed_at, None)


@pytest.mark.parametrize(("path", "change"), [
    ("renew", {"token": "STR"}), ("renew", {"token": "FLOAT"}), ("check", {"token": "STR"}),
    ("fence", {"token": "STR"}), ("renew", {"ttl_seconds": "30"}),
])
def test_a_token_or_ttl_sent_as_a_string_or_float_is_422_not_coerced(
    client: TestClient, store: LeaseStore, path: str, change: dict[str, Any]
) -> None:
    """A token is compared, never parsed: "7" (or 7.0) for 7 is a client's bug, refused naming the field, as
    a ttl_seconds sent as a string (pydantic's lax mode took both before)."""
    ref, capability = grant(acquire(client, "strict-key", "strict-owner"))
    before = store.holder("strict-key")
    body: dict[str, Any] = {**ref, "resource": "strict-target"}
    for name, value in change.items():
        body[name] = str(ref["token"]) if value == "STR" else float(ref["token"]) if value == "FLOAT" else value
    response = client.post(f"/lease/v1/{path}", json=body, headers=auth(capability))
    assert response.status_code == 422, response.text
    assert [e["loc"] for e in response.json()["detail"]] == [["body", next(iter(change))]], response.text
    after = store.holder("strict-key")
    assert after is not None and before is not None and after.renewed_at == before.renewed_at
    acquired = client.post("/lease/v1/acquire", json={"key": "strict-2", "owner": "o", "ttl_seconds": "30"},
                           headers=auth(SECRET))
    assert acquired.status_code == 422 and store.holder("strict-2") is None


def test_give_back_with_a_grant_of_another_key_under_the_same_owner_and_token_cannot_free_a_claim(
    client: TestClient, store: LeaseStore
) -> None:
    """An attacker with the acquire secret takes a key of its own under the victim's owner name (owners are
    free text, and shown by every 409) until its token is the victim's (each new key starts at the same floor;
    a release and an acquire add one), then gives back the victim's idempotency claim with its own capability:
    the victim's slot could be published twice. Fixed by migrations/0020: the claim names its lease key, and
    only a grant of that key gives it back."""
    victim, victim_cap = grant(acquire(client, "victim-key", "victim-task"))
    claimed = client.post("/lease/v1/fence", json={**victim, "resource": "exports", "idempotency_key": "2026-12-07"},
                          headers=auth(victim_cap))
    assert claimed.status_code == 200 and claimed.json()["accepted"] is True, claimed.text
    attacker, attacker_cap = grant(acquire(client, "attacker-key", "victim-task"))
    while attacker["token"] < victim["token"]:
        client.post("/lease/v1/release", json=attacker, headers=auth(attacker_cap))
        attacker, attacker_cap = grant(acquire(client, "attacker-key", "victim-task"))
    assert attacker["token"] == victim["token"]
    attack = client.post("/lease/v1/fence/give_back", json={**attacker, "resource": "exports",
                                                            "idempotency_key": "2026-12-07"}, headers=auth(attacker_cap))
    assert attack.status_code == 200 and attack.json() == {"given_back": False}, attack.text
    fences = FenceStore(store.db.dsn, schema=store.schema)
    try:
        assert fences.published("exports", "2026-12-07"), "another key's grant gave back the victim's claim"
        # The grant that made the claim still gives it back (its side effect failed).
        own = client.post("/lease/v1/fence/give_back", json={**victim, "resource": "exports",
                                                             "idempotency_key": "2026-12-07"}, headers=auth(victim_cap))
        assert own.status_code == 200 and own.json() == {"given_back": True}, own.text
        assert not fences.published("exports", "2026-12-07")
    finally:
        fences.close()
