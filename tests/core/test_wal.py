"""A failed acquire on a held key writes nothing: no WAL, no row version, no event."""

from __future__ import annotations

from datetime import timedelta

import psycopg2

from airflow_lease_provider.core import LeaseStore


def _lsn(cur) -> int:
    cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
    return int(cur.fetchone()[0])


def test_failed_acquire_on_a_held_key_writes_no_wal(store: LeaseStore, pg_dsn: str) -> None:
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
