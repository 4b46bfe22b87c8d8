"""The plugin's routes on a real ``airflow api-server``: login required everywhere, viewers read,
only admins force-release (checked through Airflow's auth manager), and a force-release is recorded."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import quote

import pytest

from airflow_lease_provider.core import EventKind
from airflow_lease_provider.core.identity import RunRef
from airflow_lease_provider.reading import encode_cursor
from tests.pg import execute, q
from tests.ui.conftest import API_KEY, BUFFER_KEY, REPLACE_KEY, SCRIPT_KEY, World, policy_run, seed_policies
from tests.ui.server import DAG_ID, LEASE_KEY

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

JSON_ROUTES = [
    "/lease/api/me",
    "/lease/api/leases",
    "/lease/api/events",
    "/lease/api/counts",
    "/lease/api/ttl-advice",
    f"/lease/api/task-instance?dag_id={DAG_ID}&run_id=r&task_id=publish",
    "/lease/static/leases.js",
]


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_no_login_is_401(world: World, path: str) -> None:
    response = world.server.request("GET", path)
    assert response.status_code == 401, response.text


def test_no_login_force_release_is_401_and_changes_nothing(world: World) -> None:
    before = world.store.holder(API_KEY)
    response = world.server.request(
        "POST", "/lease/api/force-release", json={"key": API_KEY, "confirm": API_KEY}
    )
    assert response.status_code == 401
    after = world.store.holder(API_KEY)
    assert before is not None and after is not None and after.token == before.token


def test_no_login_page_redirects_to_login(world: World) -> None:
    response = world.server.request("GET", "/lease/ui/")
    assert response.status_code == 303
    assert response.headers["location"].startswith("/auth/login?next=")


def test_bad_token_is_refused(world: World) -> None:
    response = world.server.request("GET", "/lease/api/leases", headers={"Authorization": "Bearer not-a-jwt"})
    assert response.status_code in (401, 403)


def test_viewer_sees_the_overlap_skip(world: World) -> None:
    server = world.server
    assert server.request("GET", "/lease/api/me", "viewer").json() == {
        "user": "viewer",
        "can_force_release": False,
    }

    leases = {
        row["key"]: row for row in server.request("GET", "/lease/api/leases", "viewer").json()["leases"]
    }
    held = leases[LEASE_KEY]
    assert held["held"] and held["holder_run"]["dag_id"] == DAG_ID
    assert held["holder_run"]["run_id"] == world.holder_run
    assert held["holder_run"]["path"] == f"dags/{DAG_ID}/runs/{quote(world.holder_run, safe='')}"

    events = server.request(
        "GET", "/lease/api/events", "viewer", params={"key": LEASE_KEY, "kind": "skipped_overlap"}
    ).json()["events"]
    (skip,) = events
    assert skip["run"]["run_id"] == world.skipped_run
    assert skip["task"]["task_id"] == "publish"
    assert skip["blocked_by"]["run_id"] == world.holder_run

    kinds = {e["kind"] for e in server.request("GET", "/lease/api/events", "viewer").json()["events"]}
    assert {"acquired", "skipped_overlap", "skipped_catchup", "fence_rejected", "released"} <= kinds

    counts = {
        c["key"]: c["kinds"] for c in server.request("GET", "/lease/api/counts", "viewer").json()["counts"]
    }
    assert counts[LEASE_KEY]["skipped_overlap"] == {"last_24h": 1, "last_7d": 1}

    advice = {a["key"]: a for a in server.request("GET", "/lease/api/ttl-advice", "viewer").json()["advice"]}
    assert advice[API_KEY]["verdict"] == "ok"  # TTL 5m, worst hold 90 s
    assert advice["browser-key"]["verdict"] == "too_long"  # TTL 3h, worst hold ~10 min

    ti = server.request(
        "GET",
        "/lease/api/task-instance",
        "viewer",
        params={
            "dag_id": DAG_ID,
            "run_id": world.skipped_run,
            "task_id": "publish",
            "map_index": "{MAP_INDEX}",
        },
    ).json()
    assert world.holder_run in ti["skip_reason"]
    # The crashed holder's own tab: its acquisition, and its late (zombie) publish the fence rejected.
    held_ti = server.request(
        "GET",
        "/lease/api/task-instance",
        "viewer",
        params={"dag_id": DAG_ID, "run_id": world.holder_run, "task_id": "publish"},
    ).json()
    assert held_ti["skip_reason"] is None
    assert {e["kind"] for e in held_ti["events"]} == {"acquired", "fence_rejected"}

    page = server.request("GET", "/lease/ui/", "viewer")
    assert page.status_code == 200 and "<h1>Leases</h1>" in page.text
    assert page.headers["cache-control"] == "no-store"


def test_store_details_are_not_shown(world: World) -> None:
    body = world.server.request("GET", "/lease/api/leases", "viewer").json()
    assert set(body["store"]) == {"schema", "embedded"}


def test_plugin_registers_the_views(world: World) -> None:
    plugins = world.server.request("GET", "/api/v2/plugins", "admin").json()["plugins"]
    (lease,) = [p for p in plugins if p["name"] == "lease"]
    views = {v["url_route"]: v for v in lease["external_views"]}
    assert views["leases"]["destination"] == "nav" and views["leases"]["href"] == "/lease/ui/"
    assert views["lease"]["destination"] == "task_instance"


@pytest.mark.parametrize("user", ["viewer", "user", "op"])
def test_non_admin_with_a_malformed_body_gets_403_not_422(world: World, user: str) -> None:
    for body in ("{not json", '{"key": 3}', ""):
        response = world.server.request(
            "POST", "/lease/api/force-release", user, content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 403, (body, response.text)


def test_keys_with_no_dag_are_for_admins_only(world: World) -> None:
    def keys(user: str) -> set[str]:
        return {row["key"] for row in world.server.request("GET", "/lease/api/leases", user).json()["leases"]}

    assert SCRIPT_KEY in keys("admin")
    assert SCRIPT_KEY not in keys("viewer") and API_KEY in keys("viewer")
    assert world.server.request("GET", "/lease/api/lease", "viewer", params={"key": SCRIPT_KEY}).status_code == 404
    assert world.server.request("GET", "/lease/api/lease", "admin", params={"key": SCRIPT_KEY}).status_code == 200


BULK = 1005


def test_more_than_a_thousand_keys_page_through_and_look_up(world: World) -> None:
    server, store = world.server, world.store
    insert = q(
        "INSERT INTO {schema}.lease (key, owner, token, ttl, acquired_at, renewed_at, expires_at,"
        " dag_id, run_id, task_id, map_index) "
        "SELECT 'zz-bulk-' || lpad(i::text, 4, '0'), %s || '/bulk_' || i || '/publish', 1, interval '10 minutes', "
        "clock_timestamp(), clock_timestamp(), clock_timestamp() + interval '10 minutes', "
        "%s, 'bulk_' || i, 'publish', -1 "  # the run columns, as an acquire with run= writes them
        "FROM generate_series(0, %s) AS i",
        store.schema,
    )
    execute(store.db.dsn, insert, (DAG_ID, DAG_ID, BULK - 1))
    try:
        seen: list[str] = []
        cursor = None
        pages = 0
        while True:
            params = {"limit": 400, **({"cursor": cursor} if cursor else {})}
            page = server.request("GET", "/lease/api/leases", "viewer", params=params).json()
            seen += [row["key"] for row in page["leases"]]
            pages += 1
            cursor = page["next_cursor"]
            if cursor is None:
                break
        bulk = [k for k in seen if k.startswith("zz-bulk-")]
        assert len(bulk) == BULK and len(seen) == len(set(seen)) and seen == sorted(seen)
        assert pages == -(-len(seen) // 400) or pages == -(-len(seen) // 400) + 1
        assert server.request("GET", "/lease/api/leases", "viewer", params={"cursor": "junk!"}).status_code == 400

        last = f"zz-bulk-{BULK - 1:04d}"
        one = server.request("GET", "/lease/api/lease", "viewer", params={"key": last})
        assert one.status_code == 200 and one.json()["lease"]["token"] == 1
        done = server.request("POST", "/lease/api/force-release", "admin", json={"key": last, "confirm": last})
        assert done.status_code == 200, done.text
        assert done.json()["new_token"] == 2
    finally:
        execute(store.db.dsn, q("DELETE FROM {schema}.lease WHERE key LIKE 'zz-bulk-%%'", store.schema))
        execute(store.db.dsn, q("DELETE FROM {schema}.event WHERE key LIKE 'zz-bulk-%%'", store.schema))


def test_events_page_through_with_a_cursor(world: World) -> None:
    server = world.server
    first = server.request("GET", "/lease/api/events", "viewer", params={"limit": 1000}).json()
    everything = [e["id"] for e in first["events"]]
    assert len(everything) >= 4
    paged: list[int] = []
    cursor = None
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = server.request("GET", "/lease/api/events", "viewer", params=params).json()
        paged += [e["id"] for e in page["events"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert paged == everything


@pytest.mark.parametrize("event_id", [2**63, -(2**63) - 1, 10**30, -1])
def test_an_event_cursor_with_an_id_out_of_range_is_400_not_500(world: World, event_id: int) -> None:
    """A hostile cursor (base64 JSON anyone can build) whose event id is no bigint was a 500 from
    PostgreSQL ("bigint out of range")."""
    cursor = encode_cursor(["2026-11-29T00:00:00+00:00", event_id])
    response = world.server.request("GET", "/lease/api/events", "viewer", params={"cursor": cursor})
    assert response.status_code == 400, response.text
    assert "cursor" in response.json()["detail"]


def test_the_task_tab_finds_its_run_among_thousands_of_other_events(world: World) -> None:
    """The tab selects its run's events in SQL: 2,100 newer events of other runs in the same time window
    (the old code read the window's newest 2,000 and filtered them in Python) hide nothing."""
    server, store = world.server, world.store
    params = {"dag_id": DAG_ID, "run_id": world.holder_run, "task_id": "publish"}
    before = server.request("GET", "/lease/api/task-instance", "viewer", params=params).json()["events"]
    assert {e["kind"] for e in before} == {"acquired", "fence_rejected"}
    newest = max(e["at"] for e in before)
    noise = q(
        "INSERT INTO {schema}.event (at, kind, key, owner, token, detail) "
        "SELECT %s::timestamptz + i * interval '1 microsecond', 'acquired', 'noise-key', "
        "'other_dag/run_' || i || '/t', 1, '{{}}'::jsonb FROM generate_series(1, 2100) AS i",
        store.schema,
    )
    execute(store.db.dsn, noise, (newest,))
    try:
        after = server.request("GET", "/lease/api/task-instance", "viewer", params=params).json()["events"]
        assert [e["id"] for e in after] == [e["id"] for e in before]
    finally:
        execute(store.db.dsn, q("DELETE FROM {schema}.event WHERE key = 'noise-key'", store.schema))


@pytest.mark.parametrize("user", ["viewer", "user", "op"])
def test_non_admin_force_release_is_403(world: World, user: str) -> None:
    before = world.store.holder(API_KEY)
    assert before is not None
    response = world.server.request(
        "POST",
        "/lease/api/force-release",
        user,
        json={"key": API_KEY, "confirm": API_KEY, "expected_token": before.token},
    )
    assert response.status_code == 403, response.text
    after = world.store.holder(API_KEY)
    assert after is not None and after.token == before.token


def test_admin_force_release_bumps_the_token_and_is_recorded(world: World) -> None:
    server, store = world.server, world.store
    before = store.holder(API_KEY)
    assert before is not None
    assert server.request("GET", "/lease/api/me", "admin").json()["can_force_release"] is True

    wrong = server.request(
        "POST", "/lease/api/force-release", "admin", json={"key": API_KEY, "confirm": "api"}
    )
    assert wrong.status_code == 400
    stale = server.request(
        "POST",
        "/lease/api/force-release",
        "admin",
        json={"key": API_KEY, "confirm": API_KEY, "expected_token": before.token + 1},
    )
    assert stale.status_code == 409
    missing = server.request(
        "POST", "/lease/api/force-release", "admin", json={"key": "nope", "confirm": "nope"}
    )
    assert missing.status_code == 404
    # Malformed, not "changed since you looked": a token out of the tokens' range (it was 409) and a
    # reason over the core's 512 characters (it was a 400 from the store, after the lease was read).
    for bad in ({"expected_token": 2**70}, {"expected_token": 0}, {"expected_token": -1}, {"reason": "r" * 513}):
        malformed = server.request(
            "POST", "/lease/api/force-release", "admin", json={"key": API_KEY, "confirm": API_KEY, **bad}
        )
        assert malformed.status_code == 422, (bad, malformed.text)
    unchanged = store.holder(API_KEY)
    assert unchanged is not None and unchanged.token == before.token

    done = server.request(
        "POST",
        "/lease/api/force-release",
        "admin",
        json={
            "key": API_KEY,
            "confirm": API_KEY,
            "reason": "test: host lost",
            "expected_token": before.token,
        },
    )
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["by"] == "admin" and body["new_token"] == before.token + 1
    assert body["previous"]["owner"] == before.owner and body["previous"]["token"] == before.token
    assert store.holder(API_KEY) is None

    (event,) = store.events.query(key=API_KEY, kind=EventKind.FORCE_RELEASED)
    assert event.owner == before.owner and event.token == before.token
    assert event.detail["by"] == "admin" and event.detail["reason"] == "test: host lost"
    assert event.detail["new_token"] == before.token + 1
    # and a viewer sees it in the ledger
    events = server.request("GET", "/lease/api/events", "viewer", params={"kind": "force_released"}).json()
    assert any(e["key"] == API_KEY and "force-released by admin" in e["summary"] for e in events["events"])


def test_an_owner_whose_task_id_is_a_unicode_digit_is_read_everywhere(world: World) -> None:
    """Airflow accepts ``task_id='²'``; ``int('²')`` in the owner's parse was a 500 on every route that
    shows the lease or its events (for everyone who could see it), and ``map_index=²`` on the task tab."""
    server, store = world.server, world.store
    key, owner = "unicode-digit-key", f"{DAG_ID}/manual__2026-12-01/²"
    # As the operator writes it: the task instance passed as the run.
    run = RunRef(DAG_ID, "manual__2026-12-01", task_id="²")
    assert store.acquire(key, owner, timedelta(minutes=5), run=run) is not None
    try:
        task = {"dag_id": DAG_ID, "run_id": "manual__2026-12-01", "task_id": "²"}
        for path, params in (
            ("/lease/api/leases", {}),
            ("/lease/api/lease", {"key": key}),
            ("/lease/api/events", {}),
            ("/lease/api/timeline", {"key": key}),
            ("/lease/api/dag", {"dag_id": DAG_ID}),
            ("/lease/api/task-instance", task),
            ("/lease/api/task-instance", {**task, "map_index": "²"}),
        ):
            for user in ("admin", "viewer"):
                response = server.request("GET", path, user, params=params)
                assert response.status_code == 200, (path, params, user, response.text)
        row = server.request("GET", "/lease/api/lease", "viewer", params={"key": key}).json()["lease"]
        assert row["holder_run"]["run_id"] == "manual__2026-12-01" and row["holder_run"]["map_index"] == -1
        tab = server.request("GET", "/lease/api/task-instance", "viewer", params={**task, "map_index": "²"}).json()
        assert tab["map_index"] == -1
    finally:
        execute(store.db.dsn, q("DELETE FROM {schema}.lease WHERE key = %s", store.schema), (key,))
        execute(store.db.dsn, q("DELETE FROM {schema}.event WHERE key = %s", store.schema), (key,))


def test_replaced_and_buffered_runs_are_shown_on_the_page_the_timeline_and_the_task_tab(world: World) -> None:
    """Issue 26, item 5: a run replaced by a newer one, a run waiting in the buffer and a run skipped
    because the waiting place was taken, through the plugin's JSON (what the pages draw)."""
    server = world.server
    seed_policies(world.store)
    old, new, waiter, skipped = policy_run(1), policy_run(2), policy_run(4), policy_run(5)

    leases = {row["key"]: row for row in server.request("GET", "/lease/api/leases", "viewer").json()["leases"]}
    assert [w["owner"] for w in leases[BUFFER_KEY]["waiting"]] == [waiter.owner()]
    assert leases[BUFFER_KEY]["waiting"][0]["run"]["run_id"] == waiter.run_id
    assert leases[REPLACE_KEY]["waiting"] == [] and leases[REPLACE_KEY]["owner"] == new.owner()

    (replaced,) = server.request(
        "GET", "/lease/api/events", "viewer", params={"key": REPLACE_KEY, "kind": "replaced"}
    ).json()["events"]
    assert replaced["run"]["run_id"] == old.run_id and replaced["blocked_by"]["run_id"] == new.run_id
    assert new.owner() in replaced["summary"] and "replaced" in replaced["summary"]
    (full,) = server.request(
        "GET", "/lease/api/events", "viewer", params={"key": BUFFER_KEY, "kind": "skipped_buffer_full"}
    ).json()["events"]
    assert [w["run_id"] for w in full["waiting"]] == [waiter.run_id] and waiter.owner() in full["summary"]

    def tab(ref: RunRef) -> dict:
        return server.request("GET", "/lease/api/task-instance", "viewer", params={
            "dag_id": DAG_ID, "run_id": ref.run_id, "task_id": "publish"}).json()

    old_tab = tab(old)
    assert new.owner() in old_tab["skip_reason"] and [e["kind"] for e in old_tab["events"]] == ["replaced", "acquired"]
    assert waiter.owner() in tab(skipped)["skip_reason"]
    assert [e["kind"] for e in tab(waiter)["events"]] == ["waiting"]
    assert "waiting place 1 of 1" in tab(waiter)["events"][0]["summary"]

    timeline = server.request("GET", "/lease/api/timeline", "viewer", params={"key": REPLACE_KEY}).json()
    outcomes = {h["owner"]: h["outcome"] for h in timeline["holdings"]}
    assert outcomes == {old.owner(): "replaced", new.owner(): "held"}, timeline["holdings"]
    buffered = server.request("GET", "/lease/api/timeline", "viewer", params={"key": BUFFER_KEY}).json()
    assert {"waiting", "skipped_buffer_full"} <= {m["kind"] for m in buffered["markers"]}


def test_a_semaphores_slots_are_shown_on_the_page_the_timeline_and_the_task_tab(world: World) -> None:
    """Issue 26, items 3 and 5: which slot of a semaphore (lease_slots=2) is held by whom, through the
    plugin's JSON (what the pages draw); written through the core as the operator writes it."""
    server, store, key = world.server, world.store, "sem-ui-key"
    first, second, third = policy_run(6), policy_run(7), policy_run(8)
    try:
        held = [store.try_acquire(key, ref.owner(), timedelta(minutes=30), slots=2, run=ref).lease
                for ref in (first, second)]
        assert all(held)
        store.events.record(
            EventKind.SKIPPED_OVERLAP, key, owner=third.owner(), run=third,
            detail={"reason": f"lease {key!r} is held in all 2 slots", "slots": 2, "policy": "skip",
                    "holders": [{"slot": h.slot, "owner": h.owner, "token": h.token} for h in held if h]},
        )
        leases = {row["key"]: row for row in server.request("GET", "/lease/api/leases", "viewer").json()["leases"]}
        assert [(leases[k]["slot_label"], leases[k]["lease_key"], leases[k]["owner"]) for k in (key, f"{key}#2")] == [
            ("slot 1 of 2", key, first.owner()), ("slot 2 of 2", key, second.owner())
        ]
        timeline = server.request("GET", "/lease/api/timeline", "viewer", params={"key": key}).json()
        assert sorted((h["slot"], h["owner"]) for h in timeline["holdings"]) == [(1, first.owner()), (2, second.owner())]

        def tab(ref: RunRef) -> dict:
            return server.request("GET", "/lease/api/task-instance", "viewer", params={
                "dag_id": DAG_ID, "run_id": ref.run_id, "task_id": "publish"}).json()

        (acquired,) = tab(second)["events"]
        assert acquired["detail"]["slot"] == 2 and f"slot 2 of 2 of {key!r}" in acquired["summary"]
        skip = tab(third)
        assert [h["owner"] for h in skip["events"][0]["detail"]["holders"]] == [first.owner(), second.owner()]
        assert first.owner() in skip["events"][0]["summary"] and second.owner() in skip["events"][0]["summary"]
    finally:
        for k in (key, f"{key}#2"):
            execute(store.db.dsn, q("DELETE FROM {schema}.lease WHERE key = %s", store.schema), (k,))
            execute(store.db.dsn, q("DELETE FROM {schema}.event WHERE key = %s", store.schema), (k,))
