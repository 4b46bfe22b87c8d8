"""A new try of a waiting task keeps its owner's waiting place over the lease API (docs/api.md, decision 9;
migrations/0023): a claim of the SAME owner with another request id takes the place over only once it is
stale (not claimed for two thirds of the TTL it was last claimed for: its keeper, which claims every third,
is dead), on the real route code and a real PostgreSQL store. The attacker's cases: a live place of the same
owner is not taken (403, with the time it may be), the old try's capability after a takeover keeps and gives
back nothing (403), another owner's claim gets nothing new (a stale place is not another owner's to take),
a place of the direct path is never taken over, and two tries claiming at once get one place. Then the task
side: ``HttpLeaseStore`` reports when the place may be taken over, and the ``wait`` policy's new try waits
for it and keeps the place instead of being skipped."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg2
import pytest
from fastapi.testclient import TestClient
from psycopg2 import sql

from airflow_lease_provider.core import LeaseStore, RunRef
from airflow_lease_provider.core import capability as caps
from tests.api.test_client import PausableClient, http_store, server  # noqa: F401 (fixtures)
from tests.api.test_lease_api import SECRET, auth, enabled, make_client  # noqa: F401 (fixtures)
from tests.api.test_wait_places import api, claim, places, release, rid  # noqa: F401 (fixtures)

OWNER = "dag/run-1/wait_task"


def age(store: LeaseStore, key: str, seconds: float) -> None:
    """``seconds`` of the key's places' time pass: their last claim and their expiry move back by as much."""
    with psycopg2.connect(store.db.dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("UPDATE {}.lease_waiter SET expires_at = expires_at - %s, "
                            "api_renewed_at = api_renewed_at - %s WHERE key = %s").format(
                                sql.Identifier(store.schema)),
                    (timedelta(seconds=seconds), timedelta(seconds=seconds), key))
    conn.close()


def rows(store: LeaseStore, key: str) -> list[tuple[Any, ...]]:
    """The key's places as stored (owner, since, expiry, digest, last API claim)."""
    with psycopg2.connect(store.db.dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT owner, since, expires_at, api_capability, api_renewed_at "
                            "FROM {}.lease_waiter WHERE key = %s ORDER BY owner").format(sql.Identifier(store.schema)),
                    (key,))
        found = [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in cur.fetchall()]
    conn.close()
    return found


def capability_of(request_id: str) -> str:
    return caps.place_capability(request_id)


def test_a_live_place_of_the_same_owner_is_not_taken_over_and_says_when_it_may_be(
    api: TestClient, store: LeaseStore  # noqa: F811
) -> None:
    old = rid()
    assert claim(api, "k", OWNER, old, ttl=60).status_code == 200
    before = rows(store, "k")
    age(store, "k", 30)  # 30 s of a 60 s place: under two thirds, its keeper (every 20 s) may be late once
    aged = rows(store, "k")
    refused = claim(api, "k", OWNER, rid(), ttl=60)
    assert refused.status_code == 403, refused.text
    takeover_at = datetime.fromisoformat(refused.json()["takeover_at"])
    renewed = aged[0][4]
    assert takeover_at == renewed + timedelta(seconds=40)  # two thirds of its 60 s TTL after its last claim
    assert "capability" not in refused.json() and SECRET not in refused.text
    assert rows(store, "k") == aged != before  # nothing changed by the refusal
    # Its keeper claims again: still its place, renewed (and its takeover time moves on).
    assert claim(api, "k", OWNER, old, ttl=60).status_code == 200
    age(store, "k", 30)
    assert claim(api, "k", OWNER, rid(), ttl=60).status_code == 403


def test_a_stale_place_is_taken_over_by_a_new_try_and_the_old_capability_is_spent(
    api: TestClient, store: LeaseStore  # noqa: F811
) -> None:
    old, new = rid(), rid()
    assert claim(api, "k", "ahead", rid(), max_waiting=2, ttl=60).status_code == 200
    assert claim(api, "k", OWNER, old, max_waiting=2, ttl=60).status_code == 200
    since = {r[0]: r[1] for r in rows(store, "k")}
    age(store, "k", 41)  # the keeper missed its claims: stale, not lapsed (19 s left)
    taken = claim(api, "k", OWNER, new, max_waiting=2, ttl=60)
    assert taken.status_code == 200, taken.text
    body = taken.json()
    assert body["claimed"] and body["taken_over"] and body["capability"] == capability_of(new)
    assert [w["owner"] for w in body["waiters"]] == ["ahead", OWNER]  # its place in the queue is kept
    after = {r[0]: r for r in rows(store, "k")}
    assert after[OWNER][1] == since[OWNER]
    assert after[OWNER][3] == caps.place_digest("k", OWNER, capability_of(new))
    # The previous try's capability keeps nothing and gives nothing back: 403, nothing changed.
    assert claim(api, "k", OWNER, old, max_waiting=2, ttl=60).status_code == 403
    assert release(api, "k", OWNER, capability_of(old)).status_code == 403
    assert {r[0]: r for r in rows(store, "k")} == after
    # The new try keeps and gives back its place.
    again = claim(api, "k", OWNER, new, max_waiting=2, ttl=60)
    assert again.status_code == 200 and not again.json()["taken_over"]
    assert release(api, "k", OWNER, capability_of(new)).status_code == 200
    assert [o for o, _ in places(store, "k")] == ["ahead"]


def test_another_owner_gets_nothing_from_a_stale_place(api: TestClient, store: LeaseStore) -> None:  # noqa: F811
    assert claim(api, "k", OWNER, rid(), ttl=60).status_code == 200
    age(store, "k", 50)
    before = rows(store, "k")
    full = claim(api, "k", "another/run/task", rid(), ttl=60)  # one place, stale but live: still full
    assert full.status_code == 409, full.text
    assert [w["owner"] for w in full.json()["waiters"]] == [OWNER] and "capability" not in full.json()
    assert rows(store, "k") == before
    # Nor by a release with the acquire secret or with its own place's capability.
    mine = rid()
    assert claim(api, "k", "another/run/task", mine, max_waiting=2, ttl=60).status_code == 200
    for credential in (SECRET, capability_of(mine)):
        assert release(api, "k", OWNER, credential).status_code == 403
    assert [o for o, _ in places(store, "k")] == [OWNER, "another/run/task"]


def test_a_place_of_the_direct_path_is_never_taken_over(api: TestClient, store: LeaseStore) -> None:  # noqa: F811
    assert store.wait_claim("k", OWNER, timedelta(seconds=60), max_waiting=1).claimed
    with psycopg2.connect(store.db.dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("UPDATE {}.lease_waiter SET expires_at = clock_timestamp() + interval '1 second'")
                    .format(sql.Identifier(store.schema)))
    conn.close()
    before = rows(store, "k")
    refused = claim(api, "k", OWNER, rid(), ttl=60)
    assert refused.status_code == 403 and refused.json()["takeover_at"] is None
    assert rows(store, "k") == before


def _two_claims_at_once(store: LeaseStore, key: str, ids: list[str]) -> list[int]:
    """Two claims of OWNER's place, one per request id, sent together (a barrier), each by its own client."""
    codes = [0, 0]
    barrier = threading.Barrier(2)

    def take(i: int) -> None:
        with make_client(store) as c:
            barrier.wait()
            codes[i] = claim(c, key, OWNER, ids[i], ttl=60).status_code

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def test_two_tries_taking_over_at_once_get_one_place(store: LeaseStore, enabled: None) -> None:  # noqa: F811
    for attempt in range(5):
        key = f"k{attempt}"
        with make_client(store) as c:
            assert claim(c, key, OWNER, rid(), ttl=60).status_code == 200
        age(store, key, 45)
        ids = [rid(), rid()]
        codes = _two_claims_at_once(store, key, ids)
        assert sorted(codes) == [200, 403], codes  # one took it over; the other's place is now live: refused
        winner = ids[codes.index(200)]
        (row,) = rows(store, key)
        assert row[3] == caps.place_digest(key, OWNER, capability_of(winner))


# -- the task side ---------------------------------------------------------------------------------------


class _Task:
    max_waiting = 1


class _Contender:
    """What :meth:`Wait.take_over_place` reads of the leased task: its store, owner, run and log."""

    def __init__(self, store: Any, owner: str, run: RunRef) -> None:
        import logging

        self.store, self.owner, self.run, self.task = store, owner, run, _Task()
        self.log = logging.getLogger("test")


@pytest.fixture
def tries(server: PausableClient) -> Iterator[tuple[Any, Any]]:  # noqa: F811
    """Two tries of one task instance: two ``HttpLeaseStore`` with place ids of their own."""
    yield http_store(server), http_store(server)


def test_a_new_try_waits_for_its_previous_try_s_place_to_go_stale_and_keeps_it(
    tries: tuple[Any, Any], store: LeaseStore
) -> None:
    from airflow_lease_provider.runtime.policies import Wait

    previous, new = tries
    run = RunRef("dag", "run-1", task_id="wait_task")
    ttl = timedelta(seconds=3)
    assert previous.wait_claim("k", OWNER, ttl, max_waiting=1, run=run).claimed  # then its trigger dies
    refused = new.wait_claim("k", OWNER, ttl, max_waiting=1, run=run)
    assert not refused.claimed and refused.takeover_at is not None
    lease = _Contender(new, OWNER, run)
    end = datetime.now(refused.takeover_at.tzinfo) + timedelta(minutes=1)
    kept = Wait().take_over_place(lease, refused, key="k", places=1, end=end)  # type: ignore[arg-type]
    assert kept.claimed and [w.owner for w in kept.waiters] == [OWNER]
    assert datetime.now(refused.takeover_at.tzinfo) >= refused.takeover_at
    assert not previous.wait_claim("k", OWNER, ttl, max_waiting=1, run=run).claimed  # the old try's: spent
    assert new.wait_release("k", OWNER) and store.waiters(["k"]) == []


def test_a_new_try_does_not_wait_past_its_deadline_for_a_place(tries: tuple[Any, Any], store: LeaseStore) -> None:
    from airflow_lease_provider.runtime.policies import Wait

    previous, new = tries
    run = RunRef("dag", "run-1", task_id="wait_task")
    assert previous.wait_claim("k", OWNER, timedelta(seconds=60), max_waiting=1, run=run).claimed
    refused = new.wait_claim("k", OWNER, timedelta(seconds=60), max_waiting=1, run=run)
    assert refused.takeover_at is not None
    started = datetime.now(refused.takeover_at.tzinfo)
    kept = Wait().take_over_place(_Contender(new, OWNER, run), refused, key="k", places=1,  # type: ignore[arg-type]
                                  end=started + timedelta(seconds=5))
    assert kept is refused and (datetime.now(started.tzinfo) - started) < timedelta(seconds=2)
    assert [w.owner for w in store.waiters(["k"])] == [OWNER]


def test_a_place_claimed_before_migration_23_is_kept_by_its_taker_and_never_taken_over_until_claimed_again(
    pg_dsn: str, schema: str, enabled: None  # noqa: F811
) -> None:
    """A store at version 22 with a live API place (no last-claim time): after the upgrade its taker keeps it,
    a new try's claim is 403 with no takeover time (it lapses as before); once its taker claims it again it
    is a place of version 23 (stale two thirds of its TTL later)."""
    from tests.pg import execute, q, store_at_version

    store_at_version(pg_dsn, schema, 22)
    old = rid()
    execute(pg_dsn, q("SELECT * FROM {schema}.lease_wait_claim_api('k', %s, interval '60 seconds', 1, %s, "
                      "NULL, NULL, NULL, NULL)", schema), (OWNER, caps.place_digest("k", OWNER, capability_of(old))))
    upgraded = LeaseStore(pg_dsn, schema=schema)
    try:
        assert [w.owner for w in upgraded.waiters(["k"])] == [OWNER]  # the store's first use migrates it
        with make_client(upgraded) as api:
            (row,) = rows(upgraded, "k")
            assert row[4] is None  # claimed before version 23
            refused = claim(api, "k", OWNER, rid(), ttl=60)
            assert refused.status_code == 403 and refused.json()["takeover_at"] is None
            assert rows(upgraded, "k") == [row]
            assert claim(api, "k", OWNER, old, ttl=60).status_code == 200
            age(upgraded, "k", 41)
            assert claim(api, "k", OWNER, rid(), ttl=60).json()["taken_over"] is True
    finally:
        upgraded.close()
