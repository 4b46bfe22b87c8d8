"""The token epoch (migrations/0006) on one server: what changes, and what does not, without a failover.

The failover itself (a promoted standby: a new timeline) is in tests/reliability/test_failover.py.
"""

from __future__ import annotations

from datetime import timedelta

import psycopg2
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import InvalidArgument, LeaseStore
from airflow_lease_provider.core.types import EPOCH_SHIFT

TTL = timedelta(seconds=30)


def test_a_store_that_never_failed_over_counts_tokens_from_one(store: LeaseStore) -> None:
    epoch = store.token_epoch()
    assert epoch.epoch == 0 and epoch.floor == 0 and epoch.reason == "created"
    tokens = [store.acquire("k", "a", TTL).token for _ in range(3)]  # type: ignore[union-attr]
    assert tokens == [1, 2, 3]
    assert store.token_epoch() == epoch  # asking does not bump it


def test_bump_epoch_puts_every_later_token_above_every_earlier_one(store: LeaseStore) -> None:
    old = store.acquire("old", "a", TTL)
    assert old is not None and old.token == 1
    bumped = store.bump_epoch("restored from a dump")
    assert (bumped.epoch, bumped.reason) == (1, "restored from a dump")
    assert store.token_epoch() == bumped
    renewed = store.renew(old)
    assert renewed is not None and renewed.token == 1  # a held lease keeps its token: renew issues none
    taken = store.acquire("old", "a", TTL)  # the same owner re-enters: a new token of the new epoch
    assert taken is not None and taken.token == (1 << EPOCH_SHIFT) + 1
    assert store.acquire("new", "a", TTL).token == (1 << EPOCH_SHIFT) + 1  # type: ignore[union-attr]
    again = store.acquire("old", "a", TTL)
    assert again is not None and again.token == taken.token + 1
    forced = store.force_release("old", by="admin")
    assert forced is not None and store.lease("old").token == again.token + 1  # type: ignore[union-attr]
    assert store.bump_epoch("second").epoch == 2
    forced = store.force_release("old", by="admin")
    assert store.lease("old").token == (2 << EPOCH_SHIFT) + 1  # type: ignore[union-attr]


def test_bump_epoch_names_a_bad_reason(store: LeaseStore) -> None:
    with pytest.raises(InvalidArgument, match="reason"):
        store.bump_epoch("")
    assert store.token_epoch().epoch == 0


def test_a_rolled_back_session_cache_still_works(pg_dsn: str, store: LeaseStore, schema: str) -> None:
    """The system identifier is cached in a session setting; a transaction that set it and rolled back
    leaves it empty, not broken."""
    store.acquire("k", "a", TTL)
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT {}.lease_token_floor()").format(sql.Identifier(schema)))
            conn.rollback()
            cur.execute(sql.SQL("SELECT {}.lease_token_floor()").format(sql.Identifier(schema)))
            assert cur.fetchone()[0] == 0
            cur.execute(sql.SQL("SELECT token FROM {}.lease_acquire('k', 'b', '1 s')").format(sql.Identifier(schema)))
        conn.rollback()
    finally:
        conn.close()
