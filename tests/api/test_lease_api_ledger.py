"""The ledger of the lease API path (docs/api.md, "What is done on the API path"): a lapsed grant taken by a
newer run records its own ``lost`` and its refused late fence's ``fence_rejected`` by its capability (kept
past its row in ``lease_api_grant``, migration 22), and nothing else; ``released`` carries the run columns
its acquire wrote; ``acquired`` records the task's host. TestClient on the real routes, a real PostgreSQL
store; the attacks (a forged capability, another grant's, a released grant's replayed, another key) are 403
with the store and the ledger unchanged."""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from airflow_lease_provider.client import HttpLeaseStore, sendable_host
from airflow_lease_provider.core import EventKind, FenceStore, LeaseLost, LeaseStore, RunRef
from airflow_lease_provider.plugins import lease_api
from airflow_lease_provider.reading import task_instance_events
from airflow_lease_provider.runtime.context import LeaseContext
from tests.api.test_lease_api import SECRET, acquire, auth, grant, make_client
from tests.pg import execute, q

RUN_A = {"dag_id": "d", "run_id": "scheduled__2026-12-01", "task_id": "t", "map_index": -1}
RUN_B = {"dag_id": "d", "run_id": "scheduled__2026-12-02", "task_id": "t", "map_index": -1}


@pytest.fixture
def api(store: LeaseStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[TestClient]:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_API", json.dumps({"conn_type": "http", "password": SECRET}))
    monkeypatch.setattr(lease_api, "_secret_cache", [])
    caplog.set_level(logging.DEBUG)
    with make_client(store) as c:
        yield c
    assert SECRET not in caplog.text


def kinds(store: LeaseStore, key: str, kind: str) -> list[Any]:
    return [e for e in store.events.query(key=key, limit=1000) if e.kind == kind]


def snapshot(store: LeaseStore) -> tuple[list[Any], ...]:
    """Everything an attack could change: the grants, the kept grants, the fences, their claims, the ledger."""
    dsn, schema = store.db.dsn, store.schema
    return (
        execute(dsn, q("SELECT key, owner, token, expires_at, released_at, api_capability FROM {schema}.lease "
                       "ORDER BY key", schema)),
        execute(dsn, q("SELECT key, token, released_at, lost_at FROM {schema}.lease_api_grant ORDER BY key, token",
                       schema)),
        execute(dsn, q("SELECT resource, key, token, owner FROM {schema}.fence ORDER BY resource, key", schema)),
        execute(dsn, q("SELECT resource, idempotency_key FROM {schema}.fence_publish ORDER BY 1, 2", schema)),
        execute(dsn, q("SELECT count(*), max(id) FROM {schema}.event", schema)),
    )


def lapse_and_take(api: TestClient, key: str) -> tuple[dict[str, Any], str, dict[str, Any], str]:
    """Grant A (run A, a 1 s TTL) lapses; a newer run B takes the key: A's grant is no longer the row's."""
    old, old_cap = grant(acquire(api, key, "owner-a", ttl=1, run=RUN_A))
    time.sleep(1.2)
    newer, newer_cap = grant(acquire(api, key, "owner-b", ttl=60, run=RUN_B))
    assert newer["token"] > old["token"]
    return old, old_cap, newer, newer_cap


def test_a_lapsed_grant_taken_by_a_newer_run_records_its_own_lost_once_with_its_acquire_s_run(
    api: TestClient, store: LeaseStore
) -> None:
    old, old_cap, newer, _ = lapse_and_take(api, "lapsed")
    # The body's run is not the one recorded: the grant's acquire's is (a caller cannot move its loss elsewhere).
    lost = {"kind": "lost", **old, "run": RUN_B, "detail": {"reason": "the keeper's deadline passed"}}
    answer = api.post("/lease/v1/event", json=lost, headers=auth(old_cap))
    assert answer.status_code == 200, answer.text
    assert answer.json()["recorded"] is True
    recorded = kinds(store, "lapsed", "lost")
    assert [(e.owner, e.token) for e in recorded] == [("owner-a", old["token"])]
    assert recorded[0].run == RunRef("d", RUN_A["run_id"], task_id="t")
    assert recorded[0].detail["reason"] == "the keeper's deadline passed"
    # Sent again (a replay): not recorded twice.
    again = api.post("/lease/v1/event", json=lost, headers=auth(old_cap))
    assert again.status_code == 409 and again.json()["recorded"] is False, again.text
    assert len(kinds(store, "lapsed", "lost")) == 1
    # The old capability still acts under nothing: the newer grant holds, untouched.
    before = snapshot(store)
    for path in ("/lease/v1/renew", "/lease/v1/release", "/lease/v1/check"):
        assert api.post(path, json=old, headers=auth(old_cap)).status_code == 403, path
    assert api.post("/lease/v1/event", json={**lost, "kind": "renewed_late"}, headers=auth(old_cap)).status_code == 403
    assert snapshot(store) == before
    held = store.holder("lapsed")
    assert held is not None and (held.owner, held.token) == ("owner-b", newer["token"])


def test_a_late_fence_of_a_lapsed_grant_is_refused_writes_nothing_and_records_fence_rejected(
    api: TestClient, store: LeaseStore
) -> None:
    old, old_cap, newer, newer_cap = lapse_and_take(api, "late")
    fences = FenceStore(store.db.dsn, schema=store.schema)
    published = api.post("/lease/v1/fence", json={**newer, "resource": "s3://out/late"}, headers=auth(newer_cap))
    assert published.status_code == 200 and published.json()["accepted"] is True
    late = {**old, "resource": "s3://out/late", "idempotency_key": "slot-7"}
    refused = api.post("/lease/v1/fence", json=late, headers=auth(old_cap))
    assert refused.status_code == 409, refused.text
    assert refused.json()["status"] == "lost" and refused.json()["accepted"] is False
    # Nothing written by it: the fence still holds the newer token, and the idempotency key is not claimed.
    assert fences.current("s3://out/late", key="late") == newer["token"]
    assert not fences.published("s3://out/late", "slot-7")
    rejected = [e for e in store.events.query(key="s3://out/late") if e.kind == EventKind.FENCE_REJECTED]
    assert [(e.owner, e.token) for e in rejected] == [("owner-a", old["token"])]
    detail = rejected[0].detail
    assert detail["lease_key"] == "late" and detail["outcome"] == "superseded"
    assert detail["newest_grant"] == newer["token"] and detail["current_token"] == newer["token"]
    assert detail["idempotency_key"] == "slot-7"
    assert rejected[0].run == RunRef("d", RUN_A["run_id"], task_id="t")
    # The task instance's Lease tab lists A's acquire, its refused fence (and B's run lists B's acquire only).
    tab = task_instance_events(store, "d", RUN_A["run_id"], "t")
    assert {"acquired", "fence_rejected"} <= {row["kind"] for row in tab["events"]}
    assert "fence_rejected" not in {row["kind"] for row in task_instance_events(store, "d", RUN_B["run_id"], "t")["events"]}
    fences.close()


def test_a_lapsed_grant_s_row_not_yet_taken_records_its_refused_late_fence(api: TestClient, store: LeaseStore) -> None:
    ref, capability = grant(acquire(api, "lapsed-free", "me", ttl=1, run=RUN_A))
    time.sleep(1.2)
    refused = api.post("/lease/v1/fence", json={**ref, "resource": "r-free"}, headers=auth(capability))
    assert refused.status_code == 409 and refused.json()["status"] == "lost"
    rejected = [e for e in store.events.query(key="r-free") if e.kind == EventKind.FENCE_REJECTED]
    assert len(rejected) == 1 and rejected[0].detail["outcome"] == "stale" and rejected[0].token == ref["token"]
    assert FenceStore(store.db.dsn, schema=store.schema).current("r-free", key="lapsed-free") is None


def test_every_other_capability_is_403_on_a_past_grant_and_the_ledger_is_unchanged(
    api: TestClient, store: LeaseStore
) -> None:
    old, old_cap, newer, newer_cap = lapse_and_take(api, "victim")
    other, other_cap = grant(acquire(api, "other-key", "owner-a"))
    # A grant released by its holder, then the key taken by a newer grant: its capability replayed.
    released, released_cap = grant(acquire(api, "released", "owner-r", run=RUN_A))
    assert api.post("/lease/v1/release", json=released, headers=auth(released_cap)).json()["released"] is True
    after_release, _ = grant(acquire(api, "released", "owner-s"))
    # A grant of the direct path (no capability), lapsed and taken over.
    direct = store.acquire("direct", "owner-d", timedelta(seconds=1))
    assert direct is not None
    time.sleep(1.2)
    assert store.acquire("direct", "owner-e", timedelta(seconds=60)) is not None
    direct_ref = {"key": "direct", "owner": "owner-d", "token": direct.token}
    attacks = [
        ("a made-up capability", secrets.token_urlsafe(32), old),
        ("the acquire secret", SECRET, old),
        ("the newer grant's capability for the old grant", newer_cap, old),
        ("another key's grant's capability", other_cap, old),
        ("the old capability naming the newer grant", old_cap, newer),
        ("the old capability, another owner", old_cap, {**old, "owner": "owner-b"}),
        ("the old capability, the next token", old_cap, {**old, "token": old["token"] + 1}),
        ("the old capability, another key", old_cap, {**old, "key": "other-key"}),
        ("the old capability for the other key's grant", old_cap, other),
        ("a released grant's capability replayed after a newer grant", released_cap, released),
        ("a released grant's capability for the newer grant", released_cap, after_release),
        ("a capability for a direct-path grant", old_cap, direct_ref),
    ]
    before = snapshot(store)
    for what, credential, ref in attacks:
        lost = api.post("/lease/v1/event", json={"kind": "lost", **ref, "detail": {"reason": "forged"}},
                        headers=auth(credential))
        fenced = api.post("/lease/v1/fence", json={**ref, "resource": "target", "idempotency_key": "k"},
                          headers=auth(credential))
        for response in (lost, fenced):
            assert response.status_code == 403, (what, response.status_code, response.text)
            assert response.json()["detail"] == "not the holder's capability for this grant", what
            assert old_cap not in response.text and newer_cap not in response.text
    assert snapshot(store) == before
    # The old capability still records its own loss after all that (and only once).
    own = api.post("/lease/v1/event", json={"kind": "lost", **old, "detail": {}}, headers=auth(old_cap))
    assert own.status_code == 200, own.text
    assert [e.token for e in kinds(store, "victim", "lost")] == [old["token"]]


def test_a_grant_its_holder_released_records_no_loss_even_while_its_row_holds_it(
    api: TestClient, store: LeaseStore
) -> None:
    ref, capability = grant(acquire(api, "done", "me"))
    assert api.post("/lease/v1/release", json=ref, headers=auth(capability)).json()["released"] is True
    before = snapshot(store)
    answer = api.post("/lease/v1/event", json={"kind": "lost", **ref, "detail": {}}, headers=auth(capability))
    assert answer.status_code == 409 and answer.json()["recorded"] is False
    assert api.post("/lease/v1/fence", json={**ref, "resource": "done-r"}, headers=auth(capability)).status_code == 409
    assert snapshot(store) == before


def test_released_carries_the_run_columns_of_the_grant_s_acquire(api: TestClient, store: LeaseStore) -> None:
    ref, capability = grant(acquire(api, "tab", "d/scheduled__2026-12-01/t", run=RUN_A))
    # The release takes no run: a body naming another is answered as without it (the field is not read).
    forged = api.post("/lease/v1/release", json={**ref, "run": RUN_B}, headers=auth(capability))
    assert forged.status_code == 200, forged.text
    released = kinds(store, "tab", "released")
    assert len(released) == 1 and released[0].token == ref["token"]
    assert released[0].run == RunRef("d", RUN_A["run_id"], task_id="t")
    tab = task_instance_events(store, "d", RUN_A["run_id"], "t")
    assert [row["kind"] for row in tab["events"]] == ["released", "acquired"]
    assert not task_instance_events(store, "d", RUN_B["run_id"], "t")["events"]


def test_acquired_records_the_task_s_host(api: TestClient, store: LeaseStore) -> None:
    grant(acquire(api, "hosted", "a", host="worker-7.edge.example.com"))
    grant(acquire(api, "unhosted", "a"))
    grant(acquire(api, "hosted-slots", "a", policy="slots", slots=2, host="10.0.0.7"))
    assert kinds(store, "hosted", "acquired")[0].detail["host"] == "worker-7.edge.example.com"
    assert kinds(store, "unhosted", "acquired")[0].detail["host"] == store.host  # the api-server's store's
    assert kinds(store, "hosted-slots", "acquired")[0].detail["host"] == "10.0.0.7"


@pytest.mark.parametrize("host", ["", "two words", "h" * 254, "nul\x00host", "h\u00e9te", "evil;rm", "a/b",
                                  "\u202ehost", 7, ["h"]])
def test_a_bad_host_is_422_naming_it_and_takes_nothing(api: TestClient, store: LeaseStore, host: Any) -> None:
    response = acquire(api, "bad-host", "a", host=host)
    assert response.status_code == 422, response.text
    assert ["body", "host"] in [e["loc"] for e in response.json()["detail"]]
    assert len(response.content) < 2048
    assert store.lease("bad-host") is None


def test_the_client_sends_its_host_and_never_one_the_api_would_refuse(api: TestClient, store: LeaseStore) -> None:
    http = HttpLeaseStore(str(api.base_url), SECRET, client=api, host="worker-3.example")
    assert http.acquire("client-host", "a", timedelta(seconds=30)) is not None
    assert kinds(store, "client-host", "acquired")[0].detail["host"] == "worker-3.example"
    odd = HttpLeaseStore(str(api.base_url), SECRET, client=api, host="a host with spaces")
    assert odd.host is None
    assert odd.acquire("client-odd", "a", timedelta(seconds=30)) is not None  # not refused for its host
    assert kinds(store, "client-odd", "acquired")[0].detail["host"] == store.host
    assert sendable_host("h" * 253) == "h" * 253 and sendable_host("h" * 254) is None


def test_a_task_s_late_fence_over_http_records_its_loss_and_a_fence_rejected(api: TestClient, store: LeaseStore) -> None:
    """The task side: a holder frozen past its TTL while a newer run took the key. Its lease.fence() checks
    first (LeaseLost, the loss recorded once); a fence asked without that check (a race, or a client in
    another language) is refused by the API, LeaseLost, and the refusal recorded."""
    http = HttpLeaseStore(str(api.base_url), SECRET, timeout=timedelta(seconds=5), client=api)
    run = RunRef("d", RUN_A["run_id"], task_id="t")
    lease = http.acquire("frozen", run.owner(), timedelta(seconds=1), run=run)
    assert lease is not None
    time.sleep(1.2)
    assert store.acquire("frozen", "d/scheduled__2026-12-02/t", timedelta(seconds=60)) is not None
    ctx = LeaseContext(lease=lease, store=http, run=run)  # type: ignore[arg-type]
    with pytest.raises(LeaseLost):
        ctx.fence("s3://out/frozen")
    with pytest.raises(LeaseLost):
        ctx.fence("s3://out/frozen")
    lost = kinds(store, "frozen", "lost")
    assert [(e.owner, e.token, e.run) for e in lost] == [(run.owner(), lease.token, run)]
    with pytest.raises(LeaseLost):
        http.fences().guard("s3://out/frozen", lease.token, key="frozen", owner=lease.owner)
    rejected = [e for e in store.events.query(key="s3://out/frozen") if e.kind == EventKind.FENCE_REJECTED]
    assert [(e.owner, e.token, e.run) for e in rejected] == [(run.owner(), lease.token, run)]
    assert FenceStore(store.db.dsn, schema=store.schema).current("s3://out/frozen", key="frozen") is None
    # The ledger's own record of the loss is once, whoever sends it again.
    assert not http.events.record(EventKind.LOST, "frozen", owner=lease.owner, token=lease.token, detail={})
    assert len(kinds(store, "frozen", "lost")) == 1


def test_kept_grants_of_a_key_older_than_the_retention_are_deleted_at_its_next_grant(
    api: TestClient, store: LeaseStore
) -> None:
    first, _ = grant(acquire(api, "pruned", "a", ttl=1))
    time.sleep(1.2)
    store.events.retention = timedelta(milliseconds=500)
    second, _ = grant(acquire(api, "pruned", "b", ttl=60))
    kept = execute(store.db.dsn, q("SELECT token FROM {schema}.lease_api_grant WHERE key = 'pruned' ORDER BY 1",
                                   store.schema))
    assert kept == [(second["token"],)], (first, kept)


def test_a_lost_sent_at_once_from_many_connections_is_claimed_once(api: TestClient, store: LeaseStore) -> None:
    """The claim is one conditional UPDATE of the kept grant: of eight senders at once (each on a connection
    of its own, as the api-server's request threads are), exactly one may record the grant's loss."""
    import threading

    from airflow_lease_provider.core import capability as caps

    old, old_cap, _newer, _ = lapse_and_take(api, "racing")
    stores = [LeaseStore(store.db.dsn, schema=store.schema) for _ in range(8)]
    start = threading.Barrier(len(stores))
    claimed: list[bool] = []

    def send(own: LeaseStore) -> None:
        start.wait()
        claimed.append(caps.claim_lost(own, old["key"], old["owner"], old["token"], old_cap))

    threads = [threading.Thread(target=send, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in stores:
        s.close()
    assert sorted(claimed) == [False] * 7 + [True]
    # A forged capability claims nothing, even for a kept grant whose loss is not recorded yet.
    other, other_cap, _, _ = lapse_and_take(api, "racing-2")
    assert caps.claim_lost(store, other["key"], other["owner"], other["token"], secrets.token_urlsafe(32)) is False
    assert caps.claim_lost(store, other["key"], other["owner"], other["token"], other_cap) is True


def test_a_fence_refusal_of_a_held_grant_is_recorded_under_its_acquire_s_run(api: TestClient, store: LeaseStore) -> None:
    ref, capability = grant(acquire(api, "held-refused", "me", run=RUN_A))
    FenceStore(store.db.dsn, schema=store.schema).advance("r-moved", ref["token"] + 5, key="held-refused")
    refused = api.post("/lease/v1/fence", json={**ref, "resource": "r-moved"}, headers=auth(capability))
    assert refused.status_code == 409 and refused.json()["status"] == "refused", refused.text
    rejected = [e for e in store.events.query(key="r-moved") if e.kind == EventKind.FENCE_REJECTED]
    assert [(e.token, e.run) for e in rejected] == [(ref["token"], RunRef("d", RUN_A["run_id"], task_id="t"))]
