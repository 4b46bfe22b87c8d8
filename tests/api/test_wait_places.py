"""Waiting over the lease API (docs/api.md, decision 9): who holds a key (``/holders``), the waiting places
(``/wait/claim``, ``/wait/release``, ``/waiters``) on the real route code and a real PostgreSQL store, through
FastAPI's TestClient: 401 without credentials, 403 for the wrong taker (another place's capability, one
replayed after its place was given back, the right one for another key or owner, the acquire secret), the
store unchanged by each; ``max_waiting`` kept by the store under concurrency; hostile bodies 4xx; no secret
or capability in an answer that is not the taker's own, nor in a log line. Then the task side
(``HttpLeaseStore``) against the direct store's semantics, and the trigger waiting through a real port."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg2
import pytest
from fastapi.testclient import TestClient
from psycopg2 import sql

from airflow_lease_provider.core import LeaseStore, RunRef
from airflow_lease_provider.core import capability as caps
from tests.api.test_client import PausableClient, http_store, server  # noqa: F401 (fixtures)
from tests.api.test_contract import served  # noqa: F401 (fixture)
from tests.api.test_lease_api import SECRET, acquire, auth, enabled, grant, make_client  # noqa: F401 (fixtures)


@pytest.fixture
def api(store: LeaseStore, enabled: None, caplog: pytest.LogCaptureFixture) -> Iterator[TestClient]:  # noqa: F811
    """The lease API's routes on the test's store; no acquire secret in any log line of the test."""
    caplog.set_level(logging.DEBUG)
    with make_client(store) as c:
        yield c
    assert SECRET not in caplog.text


WAIT_ROUTES = ["/lease/v1/holders", "/lease/v1/waiters", "/lease/v1/wait/claim", "/lease/v1/wait/release"]


def rid() -> str:
    return secrets.token_urlsafe(24)


def claim(api: TestClient, key: str, owner: str, request_id: str, *, max_waiting: int = 1, ttl: float = 60,
          credential: str = SECRET, **extra: Any) -> Any:
    return api.post("/lease/v1/wait/claim", headers=auth(credential), json={
        "key": key, "owner": owner, "ttl_seconds": ttl, "max_waiting": max_waiting, "request_id": request_id, **extra})


def release(api: TestClient, key: str, owner: str, credential: str) -> Any:
    return api.post("/lease/v1/wait/release", headers=auth(credential), json={"key": key, "owner": owner})


def places(store: LeaseStore, key: str) -> list[tuple[str, datetime]]:
    return [(w.owner, w.expires_at) for w in store.waiters([key])]


@pytest.mark.parametrize("path", WAIT_ROUTES)
@pytest.mark.parametrize("header", [None, "Basic abc", "Bearer "])
def test_no_credentials_is_401(api: TestClient, store: LeaseStore, path: str, header: str | None) -> None:
    headers = {"Authorization": header} if header is not None else {}
    body = {"key": "k", "owner": "o", "keys": ["k"], "ttl_seconds": 5, "max_waiting": 1, "request_id": rid()}
    response = api.post(path, json=body, headers=headers)
    assert response.status_code == 401, response.text
    assert places(store, "k") == []


@pytest.mark.parametrize("path", ["/lease/v1/holders", "/lease/v1/waiters", "/lease/v1/wait/claim"])
def test_the_secret_routes_refuse_a_wrong_secret_and_a_grant_s_capability_403(
    api: TestClient, store: LeaseStore, path: str
) -> None:
    _, capability = grant(acquire(api, "k", "holder"))
    body = {"key": "k", "owner": "o", "keys": ["k"], "ttl_seconds": 5, "max_waiting": 1, "request_id": rid()}
    for credential in (SECRET + "x", capability):
        response = api.post(path, json=body, headers=auth(credential))
        assert response.status_code == 403, response.text
        assert capability not in response.text
    assert places(store, "k") == []


def test_holders_names_who_holds_as_a_refused_acquire_does(api: TestClient) -> None:
    assert api.post("/lease/v1/holders", json={"key": "k"}, headers=auth(SECRET)).json()["holders"] == []
    ref, capability = grant(acquire(api, "k", "run-1"))
    answer = api.post("/lease/v1/holders", json={"key": "k"}, headers=auth(SECRET))
    assert answer.status_code == 200
    assert [(h["owner"], h["token"]) for h in answer.json()["holders"]] == [("run-1", ref["token"])]
    assert capability not in answer.text
    api.post("/lease/v1/release", json=ref, headers=auth(capability))
    assert api.post("/lease/v1/holders", json={"key": "k"}, headers=auth(SECRET)).json()["holders"] == []


def test_a_place_is_taken_kept_by_its_request_id_and_the_next_is_full_naming_the_waiters(
    api: TestClient, store: LeaseStore
) -> None:
    first_id = rid()
    taken = claim(api, "k", "run-1", first_id, run={"dag_id": "d", "run_id": "r1", "task_id": "t"})
    assert taken.status_code == 200, taken.text
    capability = taken.json()["capability"]
    assert capability == caps.place_capability(first_id) and taken.json()["claimed"]
    assert [w["owner"] for w in taken.json()["waiters"]] == ["run-1"]
    assert store.waiters(["k"])[0].run == RunRef("d", "r1", task_id="t")
    (_, expires), = places(store, "k")
    # The store keeps a digest bound to the place, never the capability.
    with psycopg2.connect(store.db.dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT api_capability FROM {}.lease_waiter").format(sql.Identifier(store.schema)))
        (kept,), = cur.fetchall()
    conn.close()
    assert bytes(kept) == caps.place_digest("k", "run-1", capability) and capability.encode() not in bytes(kept)
    # Claimed again with its request id: kept (renewed), one place.
    again = claim(api, "k", "run-1", first_id)
    assert again.status_code == 200 and again.json()["capability"] == capability
    (_, renewed), = places(store, "k")
    assert renewed > expires
    # Every place taken (max_waiting 1): 409 full naming the waiter, no capability, nothing taken.
    full = claim(api, "k", "run-2", rid())
    assert full.status_code == 409 and full.json()["status"] == "full" and not full.json()["claimed"]
    assert [w["owner"] for w in full.json()["waiters"]] == ["run-1"]
    assert "capability" not in full.json() and capability not in full.text
    assert [o for o, _ in places(store, "k")] == ["run-1"]
    # With two places the next run gets the second.
    assert claim(api, "k", "run-2", rid(), max_waiting=2).status_code == 200
    assert [o for o, _ in places(store, "k")] == ["run-1", "run-2"]


def test_another_request_id_cannot_keep_or_take_over_the_owner_s_place(api: TestClient, store: LeaseStore) -> None:
    taken = claim(api, "k", "run-1", rid(), ttl=60)
    before = places(store, "k")
    # An attacker with the acquire secret naming the owner but not its request id: 403, the place as it was.
    stolen = claim(api, "k", "run-1", rid(), ttl=600)
    assert stolen.status_code == 403 and "capability" not in stolen.text
    assert places(store, "k") == before
    assert taken.json()["capability"] not in stolen.text
    # A place the direct path took (no capability) is nobody's over HTTP either.
    store.wait_claim("k2", "run-9", timedelta(seconds=60), max_waiting=1)
    direct_before = places(store, "k2")
    assert claim(api, "k2", "run-9", rid(), ttl=600).status_code == 403
    assert places(store, "k2") == direct_before


def test_only_the_taker_gives_its_place_back(api: TestClient, store: LeaseStore) -> None:
    mine = claim(api, "k", "run-1", rid(), max_waiting=3).json()["capability"]
    other = claim(api, "k", "run-2", rid(), max_waiting=3).json()["capability"]
    on_other_key = claim(api, "k-other", "run-1", rid(), max_waiting=3).json()["capability"]
    _, grant_capability = grant(acquire(api, "k", "holder"))
    refused = [
        release(api, "k", "run-1", other),  # another place's capability
        release(api, "k", "run-1", on_other_key),  # the same owner's place of another key
        release(api, "k", "run-2", mine),  # the right capability, another owner
        release(api, "k", "run-1", SECRET),  # the acquire secret
        release(api, "k", "run-1", grant_capability),  # a grant's capability
        release(api, "k", "run-1", caps.place_digest("k", "run-1", mine).hex()),  # the digest
    ]
    assert [r.status_code for r in refused] == [403] * len(refused)
    assert all(mine not in r.text and other not in r.text for r in refused)
    assert [o for o, _ in places(store, "k")] == ["run-1", "run-2"]
    given = release(api, "k", "run-1", mine)
    assert given.status_code == 200 and given.json()["released"]
    assert [o for o, _ in places(store, "k")] == ["run-2"]
    # Replayed after the place was given back: 403, and the other places stay.
    assert release(api, "k", "run-1", mine).status_code == 403
    assert [o for o, _ in places(store, "k")] == ["run-2"]
    assert [o for o, _ in places(store, "k-other")] == ["run-1"]


def test_max_waiting_is_kept_by_the_store_when_many_claim_at_once(api: TestClient, store: LeaseStore) -> None:
    answers: list[int] = []
    start = threading.Barrier(8)

    def one(n: int) -> None:
        start.wait()
        answers.append(claim(api, "busy", f"run-{n}", rid(), max_waiting=2).status_code)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(answers) == [200, 200] + [409] * 6
    assert len(places(store, "busy")) == 2


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/lease/v1/wait/claim", {"key": "a\x00b"}, "key"),
    ("/lease/v1/wait/claim", {"owner": "x" * 600}, "owner"),
    ("/lease/v1/wait/claim", {"max_waiting": 0}, "max_waiting"),
    ("/lease/v1/wait/claim", {"max_waiting": "1"}, "max_waiting"),
    ("/lease/v1/wait/claim", {"max_waiting": 10_001}, "max_waiting"),
    ("/lease/v1/wait/claim", {"ttl_seconds": -1}, "ttl_seconds"),
    ("/lease/v1/wait/claim", {"request_id": "short"}, "request_id"),
    ("/lease/v1/wait/claim", {"request_id": None}, "request_id"),
    ("/lease/v1/holders", {"key": ""}, "key"),
    ("/lease/v1/waiters", {"keys": []}, "keys"),
    ("/lease/v1/waiters", {"keys": ["k"] * 101}, "keys"),
    ("/lease/v1/waiters", {"keys": "k"}, "keys"),
])
def test_hostile_bodies_are_422_naming_the_field_and_take_nothing(
    api: TestClient, store: LeaseStore, path: str, body: dict[str, Any], field: str
) -> None:
    full = {"key": "k", "keys": ["k"], "owner": "o", "ttl_seconds": 30, "max_waiting": 1, "request_id": rid(), **body}
    response = api.post(path, json=full, headers=auth(SECRET))
    assert response.status_code == 422, response.text
    assert field in response.text
    assert places(store, "k") == []


def test_a_nul_in_a_release_is_422_and_a_body_that_is_not_json_is_4xx(api: TestClient) -> None:
    assert release(api, "a\x00b", "o", "x" * 43).status_code == 422
    response = api.post("/lease/v1/wait/claim", content=b"\xff\xfe", headers=auth(SECRET))
    assert 400 <= response.status_code < 500


# -- the task side: HttpLeaseStore as the direct store -------------------------------------------------------


def test_the_http_store_waits_as_the_direct_store_does(server: PausableClient, store: LeaseStore) -> None:  # noqa: F811
    http = http_store(server)
    ttl = timedelta(seconds=60)
    assert http.holder("k") is None and http.slot_holders("k") == []
    held = http.acquire("k", "holder", ttl)
    assert held is not None
    assert (http.holder("k") or held).owner == "holder" and http.holder("k").token == held.token  # type: ignore[union-attr]
    run = RunRef("d", "r1", task_id="t")
    first = http.wait_claim("k", "run-1", ttl, max_waiting=1, run=run)
    assert first.claimed and [w.owner for w in first.waiters] == ["run-1"] and first.waiters[0].run == run
    again = http.wait_claim("k", "run-1", ttl, max_waiting=1, run=run)  # kept, as the direct store keeps it
    assert again.claimed
    full = http_store(server).wait_claim("k", "run-2", ttl, max_waiting=1)
    assert not full.claimed and [w.owner for w in full.others] == ["run-1"]
    assert [w.owner for w in http.waiters(["k"])] == ["run-1"] == [w.owner for w in store.waiters(["k"])]
    # Another process (the trigger, the resumed task) keeps and gives back the place by the place id alone.
    elsewhere = http_store(server)
    elsewhere.adopt_place("run-1", http.place_id("run-1"))
    assert elsewhere.wait_claim("k", "run-1", ttl, max_waiting=1).claimed
    # Without it, the owner's place is not this store's: not claimed, not given back, left as it was.
    stranger = http_store(server)
    assert not stranger.wait_claim("k", "run-1", ttl, max_waiting=1).claimed
    assert not stranger.wait_release("k", "run-1")
    assert [w.owner for w in store.waiters(["k"])] == ["run-1"]
    assert elsewhere.wait_release("k", "run-1")
    assert not http.wait_release("k", "run-1")  # given back already: as the direct store's False
    assert store.waiters(["k"]) == []
    assert SECRET not in json.dumps(http.place_id("run-1"))


def test_an_api_server_that_does_not_answer_is_a_store_error(server: PausableClient) -> None:  # noqa: F811
    from airflow_lease_provider.core import LeaseStoreUnavailable

    http = http_store(server, timeout=0.3)
    server.paused.set()
    with pytest.raises(LeaseStoreUnavailable):
        http.holder("k")
    with pytest.raises(LeaseStoreUnavailable):
        http.wait_claim("k", "run-1", timedelta(seconds=60), max_waiting=1)


# -- the trigger through a real port ----------------------------------------------------------------------


@pytest.fixture
def api_url(served: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:  # noqa: F811
    monkeypatch.setenv("AIRFLOW__LEASE__API_URL", served)
    yield served


def test_the_trigger_waits_through_the_api_keeping_its_place_with_the_secret_read_in_the_triggerer(
    api_url: str, store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    from airflow_lease_provider.client import HttpLeaseStore
    from airflow_lease_provider.triggers.lease_free import LeaseFreeTrigger

    caplog.set_level(logging.DEBUG)
    task_side = HttpLeaseStore(api_url, SECRET)
    holder = task_side.acquire("tk", "holder", timedelta(minutes=5))
    assert holder is not None
    run = RunRef("job", "r1", task_id="work")
    assert task_side.wait_claim("tk", "job/r1/work", timedelta(seconds=1.5), max_waiting=1, run=run).claimed
    now = datetime.now(timezone.utc)
    trigger = LeaseFreeTrigger(
        key="tk", conn_id=None, schema="(lease API)", poll_interval=0.3, access="api",
        deadline=(now + timedelta(minutes=1)).isoformat(), not_before=(now + timedelta(seconds=1)).isoformat(),
        waiter={"owner": "job/r1/work", "ttl_seconds": 1.5, "max_waiting": 1, "place": task_side.place_id("job/r1/work"),
                **run.columns()},
    )
    path, kwargs = trigger.serialize()
    assert SECRET not in json.dumps(kwargs) and kwargs["access"] == "api"  # the kwargs go to the metadata DB
    trigger = LeaseFreeTrigger(**kwargs)

    async def scenario() -> tuple[list[str], dict]:
        seen: list[str] = []
        events = trigger.run()
        first = asyncio.ensure_future(events.__anext__())
        for _ in range(3):  # 3 s: past the place's 1.5 s TTL, kept alive over HTTP
            await asyncio.sleep(1)
            seen += [w.owner for w in await asyncio.to_thread(store.waiters, ["tk"])]
        assert not first.done()
        await asyncio.to_thread(task_side.release, holder)
        payload = (await asyncio.wait_for(first, 15)).payload
        await events.aclose()
        return seen, payload

    seen, payload = asyncio.run(scenario())
    assert seen == ["job/r1/work"] * 3 and payload == {"status": "free", "key": "tk"}
    assert [w.owner for w in store.waiters(["tk"])] == ["job/r1/work"]  # claimed again for the resume
    asyncio.run(trigger.on_kill())  # killed: the place goes back, over HTTP
    assert store.waiters(["tk"]) == []
    assert SECRET not in caplog.text


def test_the_trigger_fails_closed_when_the_api_server_does_not_answer(
    store: LeaseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_lease_provider.triggers.lease_free import LeaseFreeTrigger
    from tests.api.live_server import free_port

    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", json.dumps({"conn_type": "http", "password": SECRET}))
    monkeypatch.setenv("AIRFLOW__LEASE__API_URL", f"http://127.0.0.1:{free_port()}")  # nobody listens
    now = datetime.now(timezone.utc)
    trigger = LeaseFreeTrigger(key="gone", conn_id=None, schema="(lease API)", poll_interval=0.2, access="api",
                               deadline=(now + timedelta(seconds=2)).isoformat(), not_before=None)

    async def first() -> dict:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("no event")

    # The key is free in the store, but the trigger cannot know: it never says free, and times out.
    assert asyncio.run(first()) == {"status": "timeout", "key": "gone"}


def test_the_trigger_without_the_lease_api_connection_fails(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_lease_provider.core import LeaseStoreUnavailable
    from airflow_lease_provider.triggers import lease_free

    async def none() -> None:
        return None

    monkeypatch.setattr(lease_free, "api_secret_async", none)
    now = datetime.now(timezone.utc)
    trigger = lease_free.LeaseFreeTrigger(key="k", conn_id=None, schema="x", poll_interval=0.2, access="api",
                                          deadline=(now + timedelta(seconds=2)).isoformat())

    async def first() -> Any:
        async for event in trigger.run():
            return event.payload
        return None

    with pytest.raises(LeaseStoreUnavailable, match="lease_api"):
        asyncio.run(first())
