"""Failover of the store to a streaming standby under load (docs/core.md, "Failover of the store").

Each run starts its own primary and standby (PostgreSQL's binaries, private ports, a temp directory),
runs client threads through the core API, lets the standby lag, kills the primary, promotes the standby
and runs on against it; about 15 s each.
"""

from __future__ import annotations

import time
from datetime import timedelta

import psycopg2
import pytest

from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.types import EPOCH_SHIFT
from tests.reliability.failover import StandbyPair, available, broken, run_failover


@pytest.fixture(autouse=True)
def _binaries() -> None:
    """PostgreSQL's programs are always there (the embedded package's at least): only a ``LEASE_PG_BIN``
    naming a directory without them stops the tier, and that is a mistake to show, not a skip."""
    if (reason := available()) is not None:
        pytest.fail(reason, pytrace=False)

TTL = timedelta(seconds=30)
def test_sync_replication_loses_nothing_acknowledged() -> None:
    run = run_failover(synchronous=True)
    counts = run.report.violation_counts()
    assert counts == {}, run.report.format()
    assert run.figures["acquired_after_promotion"] > 0, run.figures
    # The standby lagged: no commit could be acknowledged until the primary was gone.
    assert run.figures["acquired_while_lagging"] == 0, run.figures


def test_async_replication_with_the_epoch_never_reissues_a_token() -> None:
    run = run_failover(synchronous=False)
    assert run.figures["acquired_while_lagging"] > 0, run.figures  # grants were lost in the failover
    assert run.figures["acquired_after_promotion"] > 0, run.figures
    assert run.figures["epoch_after"] > run.figures["epoch_before"], run.figures
    assert broken(run.report, synchronous=False) == {}, run.report.format()
    before = [r["token"] for r in run.records if r.get("op") == "acquire" and r.get("outcome") == "ok"
              and r["token"] < 1 << EPOCH_SHIFT]
    after = [r["token"] for r in run.records if r.get("op") == "acquire" and r.get("outcome") == "ok"
             and r["token"] >= 1 << EPOCH_SHIFT]
    assert before and after and min(after) > max(before)


def test_async_replication_without_the_epoch_reissues_tokens() -> None:
    """The broken variant: the store as before migration 0006. The checker must catch it."""
    run = run_failover(synchronous=False, epoch=False)
    assert run.figures["acquired_while_lagging"] > 0, run.figures
    assert run.report.violation_counts().get("token-reissued", 0) > 0, run.report.format()
    assert "token-reissued" in broken(run.report, synchronous=False)


def test_epoch_bump_by_hand_and_on_a_new_timeline() -> None:
    """``bump_epoch`` (airflow-lease failover) and the automatic bump on promotion, on one key's tokens."""
    pair = StandbyPair(synchronous=False)
    try:
        pair.start()
        with LeaseStore(pair.dsn) as store:
            first = store.acquire("k", "a", ttl=TTL)
            assert first is not None and first.token == 1
            assert store.token_epoch().epoch == 0
            bumped = store.bump_epoch("restored from a dump")
            assert bumped.epoch == 1 and bumped.reason == "restored from a dump"
            second = store.acquire("k", "a", ttl=TTL)
            assert second is not None and second.token == (1 << EPOCH_SHIFT) + 1
            fresh = store.acquire("new-key", "a", ttl=TTL)
            assert fresh is not None and fresh.token == (1 << EPOCH_SHIFT) + 1
            forced = store.force_release("k", by="test")
            assert forced is not None and forced.token == second.token
            after_force = store.lease("k")
            assert after_force is not None and after_force.token == second.token + 1
        _wait_replayed(pair)
        pair.fail_primary()
        pair.promote()
        with LeaseStore(pair.dsn) as store:
            third = store.acquire("k", "b", ttl=TTL)
            epoch = store.token_epoch()
            assert epoch.timeline == 2 and epoch.epoch == 2, epoch
            assert third is not None and third.token == (2 << EPOCH_SHIFT) + 1
            # Within an epoch tokens count on by one, as always.
            again = store.acquire("k", "b", ttl=TTL)
            assert again is not None and again.token == third.token + 1
    finally:
        pair.stop()


def _wait_replayed(pair: StandbyPair) -> None:
    conn = psycopg2.connect(host="127.0.0.1", port=pair.primary_port, user="postgres", dbname="postgres")
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for _ in range(100):
                cur.execute("SELECT replay_lsn >= pg_current_wal_lsn() FROM pg_stat_replication")
                if cur.fetchone()[0]:
                    return
                time.sleep(0.1)
    finally:
        conn.close()
    raise AssertionError("the standby never caught up")
