"""A failed acquire on a held key writes nothing: no WAL, no row version, no event."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg2
import pytest

from airflow_lease_provider.core import LeaseStore
from tests.pg import EmbeddedServer


@pytest.fixture
def quiet_server() -> Iterator[str]:
    """A private server: WAL is counted server-wide, and the shared test server has other test files
    writing at the same time (the suite runs files in parallel)."""
    server = EmbeddedServer()
    try:
        yield server.dsn
    finally:
        server.stop()


def _lsn(cur) -> int:
    cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
    return int(cur.fetchone()[0])


def test_failed_acquire_on_a_held_key_writes_no_wal(quiet_server: str) -> None:
    pg_dsn = quiet_server
    store = LeaseStore(pg_dsn)
    lease = store.acquire("hot", owner="holder", ttl=timedelta(minutes=5))
    assert lease is not None
    contender = LeaseStore(pg_dsn, schema=store.schema, record_events=False)
    assert contender.acquire("hot", owner="warm-up", ttl=timedelta(minutes=5)) is None
    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            # Autovacuum or another database's activity may write in between; a quiet window of
            # 200 failed attempts with no WAL at all is what we look for, in up to ten tries.
            written = []
            for _ in range(10):
                before = _lsn(cur)
                for i in range(200):
                    assert contender.acquire("hot", owner=f"c{i}", ttl=timedelta(minutes=5)) is None
                written.append(_lsn(cur) - before)
                if written[-1] == 0:
                    break
    finally:
        conn.close()
    assert written[-1] == 0, f"WAL bytes written over 200 failed attempts, per try: {written}"
    holder = store.holder("hot")
    assert holder is not None and holder.token == lease.token
    assert [e.kind for e in store.events.query(key="hot")] == ["acquired"]
    contender.close()
    store.close()


def test_with_the_ledger_on_a_grant_and_its_event_are_one_commit(pg_dsn: str) -> None:
    """Acquire and release with events cost the server exactly the commits they cost without: the lease
    write and its event share one transaction (issue 15: the ledger was a second commit per operation).
    Counted by the server (pg_stat_database) in a database of the test's own."""
    import time
    import uuid

    from psycopg2 import sql

    from tests.pg import execute

    name = "lease_commits_" + uuid.uuid4().hex[:8]
    execute(pg_dsn, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = psycopg2.extensions.make_dsn(pg_dsn, dbname=name)

    def commits() -> int:
        """The database's commit count once no backend is connected to it (a backend reports its counters as
        it exits) and the count has stopped moving."""
        seen: list[int] = []
        for _ in range(80):
            connected, count = execute(
                pg_dsn,
                "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = %s),"
                " (SELECT xact_commit FROM pg_stat_database WHERE datname = %s)",
                (name, name),
            )[0]
            seen.append(int(count))
            if not connected and len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]:
                break
            time.sleep(0.25)
        return seen[-1]

    def spent(record_events: bool, schema: str) -> int:
        before = commits()
        store = LeaseStore(dsn, schema=schema, record_events=record_events)
        store.ensure_schema()
        for i in range(10):
            lease = store.acquire(f"k{i}", owner="a", ttl=timedelta(minutes=5))
            assert lease is not None
            assert store.release(lease) is True
        store.close()
        return commits() - before

    try:
        for schema in ("without_events", "with_events"):
            with LeaseStore(dsn, schema=schema) as setup:  # migrations are not what is counted
                setup.ensure_schema()
        # Autovacuum's workers commit in this database too (a transaction per new table, when it chooses): they
        # only add, so each side's cost is its fewest commits over three interleaved repeats.
        without, with_events = [], []
        for _ in range(3):
            without.append(spent(False, "without_events"))
            with_events.append(spent(True, "with_events"))
        with LeaseStore(dsn, schema="with_events") as reader:
            kinds = [e.kind for e in reader.events.query(limit=1000)]
        assert sorted(kinds) == ["acquired"] * 30 + ["released"] * 30
        # A prune of the ledger (one write in a hundred, at random) may add one commit.
        assert min(without) <= min(with_events) <= min(without) + 1, (
            f"{with_events} commits with events, {without} without"
        )
    finally:
        execute(pg_dsn, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
