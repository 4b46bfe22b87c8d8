"""``is_stale`` on forged and real lease extras (issue 38, defect 5), against the real lease store.

Whoever may create asset events (the REST API, a task of any DAG) can write any ``extra["lease"]``; a
consumer's ``is_stale(event)`` must call current only the lease the store issued: that token of that key
to that owner, still the key's newest, never refused by a fence. Before the fix a forged token, the right
token with another owner and an unknown key were all "current", a refusal was found only among the newest
10,000 events, and a refusal of another key with the same owner and token made the event stale.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_lease_provider.assets import EXTRA_KEY, carries_lease, is_stale, staleness
from airflow_lease_provider.core import EventKind, LeaseStore
from tests.airflow.test_asset_order import lease_env  # noqa: F401 (a fixture)
from tests.pg import execute, q

TTL = timedelta(seconds=30)
OWNER = "producer/manual__1/write"

pytestmark = pytest.mark.usefixtures("lease_env")


def extra(key: str, token: Any, owner: Any, **more: Any) -> dict[str, Any]:
    return {EXTRA_KEY: {"key": key, "token": token, "owner": owner, **more}}


@pytest.fixture
def issued(store: LeaseStore) -> dict[str, Any]:
    """A lease the store issued (token 1 of 'asset:s3://lake/x' to OWNER), released as a producer does."""
    lease = store.acquire("asset:s3://lake/x", OWNER, TTL)
    assert lease is not None and lease.token == 1
    assert store.release(lease)
    return extra(lease.key, lease.token, lease.owner, store_id=store.store_id)


def test_the_lease_the_store_issued_is_current_until_a_newer_grant(store: LeaseStore, issued) -> None:
    assert staleness(issued) == staleness(SimpleNamespace(extra=issued))
    assert not is_stale(issued)
    assert store.acquire("asset:s3://lake/x", "someone/else", TTL) is not None
    answer = staleness(issued)
    assert answer.stale and "newer token" in (answer.reason or "")


@pytest.mark.parametrize(
    ("forged", "why"),
    [
        (extra("asset:s3://lake/x", 999, OWNER), "never issued"),  # a token above the key's newest
        (extra("asset:s3://lake/x", 1, "another/owner"), "issued to"),  # the right token, another owner
        (extra("asset:s3://lake/never-seen", 1, OWNER), "never issued a lease"),  # a key the store never saw
        (extra("asset:s3://lake/x", "1", OWNER), "malformed"),
        (extra("asset:s3://lake/x", True, OWNER), "malformed"),
        (extra("asset:s3://lake/x", 1.0, OWNER), "malformed"),
        (extra("asset:s3://lake/x", -1, OWNER), "malformed"),
        (extra("asset:s3://lake/x", 2**70, OWNER), "malformed"),
        (extra("asset:s3://lake/x\x00", 1, OWNER), "malformed"),
        (extra(["asset:s3://lake/x"], 1, OWNER), "malformed"),
        ({EXTRA_KEY: "asset:s3://lake/x"}, "malformed"),
        ({EXTRA_KEY: {"key": "asset:s3://lake/x", "token": 1}}, "malformed"),
    ],
)
def test_an_extra_the_store_did_not_issue_is_stale(issued, forged: dict[str, Any], why: str) -> None:
    answer = staleness(forged)
    assert answer.stale, f"{forged!r} was called current"
    assert why in (answer.reason or "")


def test_a_refusal_is_found_however_many_events_came_after_it(
    store: LeaseStore, issued, pg_dsn: str, schema: str
) -> None:
    store.events.record(
        EventKind.FENCE_REJECTED, "warehouse.sales", owner=OWNER, token=1,
        detail={"outcome": "stale", "lease_key": "asset:s3://lake/x", "current_token": 7},
    )
    # 10,001 newer refusals of other keys (the old check read the newest 10,000 events only).
    execute(
        pg_dsn,
        q(
            "INSERT INTO {schema}.event (kind, key, owner, token, detail) "
            "SELECT 'fence_rejected', 'warehouse.other', 'x/y', n, "
            "jsonb_build_object('outcome', 'stale', 'lease_key', 'asset:s3://lake/y') "
            "FROM generate_series(1, 10001) AS n",
            schema,
        ),
    )
    answer = staleness(issued)
    assert answer.stale and "fence refused" in (answer.reason or "") and "warehouse.sales" in (answer.reason or "")


def test_a_refusal_of_another_key_with_the_same_owner_and_token_leaves_it_current(store: LeaseStore, issued) -> None:
    """A task with two outlets holds token 1 of each key; the fence refused what it wrote under the other."""
    store.events.record(
        EventKind.FENCE_REJECTED, "warehouse.other", owner=OWNER, token=1,
        detail={"outcome": "stale", "lease_key": "asset:s3://lake/y", "current_token": 7},
    )
    assert not is_stale(issued)


def test_the_refusal_lookup_reads_the_refusals_of_one_key_by_its_index(store: LeaseStore, pg_dsn: str, schema: str) -> None:
    store.ensure_schema()
    execute(
        pg_dsn,
        q(
            "INSERT INTO {schema}.event (kind, key, owner, token, detail) "
            "SELECT CASE WHEN n %% 10 = 0 THEN 'fence_rejected' ELSE 'acquired' END, 'r', 'o', n, "
            "jsonb_build_object('lease_key', 'k' || (n %% 500)) FROM generate_series(1, 20000) AS n",
            schema,
        ),
    )
    execute(pg_dsn, q("ANALYZE {schema}.event", schema))
    plan = "\n".join(
        row[0] for row in execute(
            pg_dsn,
            q(
                "EXPLAIN SELECT e.id FROM {schema}.event e WHERE e.kind = 'fence_rejected' "
                "AND (e.detail->>'lease_key') = 'k' AND e.token = 1 AND e.owner = 'o' ORDER BY e.at DESC LIMIT 1",
                schema,
            ),
        )
    )
    assert "event_fence_lease_key_at_idx" in plan, plan


def test_what_a_consumer_asks_first_and_an_event_without_a_lease() -> None:
    """``carries_lease`` is true for any lease entry, malformed ones too (``staleness`` calls those stale),
    and false for an event without one, which ``staleness`` refuses: nothing to check."""
    assert carries_lease(extra("k", "forged", OWNER)) and carries_lease({EXTRA_KEY: "x"})
    assert not carries_lease({}) and not carries_lease(SimpleNamespace(extra=None))
    with pytest.raises(ValueError, match="carries no lease"):
        staleness({"other": 1})
