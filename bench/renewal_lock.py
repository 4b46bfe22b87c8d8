"""The cost of migration 17 (a grant locks every row of its key before it reads them), before and after.

``.venv/bin/python -m bench.renewal_lock [ROUNDS] [BEFORE]`` against ``$LEASE_TEST_DSN`` (default the test
server). ``BEFORE`` is the migration whose ``lease_key_state`` the ``before`` arm gets (default 15; 17 measures
migration 19's record of a slot-spelled key's epoch). ``client_grant_slotlike`` grants the free key ``cfree#2``
(a key spelled like a slot, which migration 19 makes write its epoch).
Two schemas: ``after`` is this checkout's store; ``before`` is the same store with ``lease_key_state`` put
back as migration 15 defined it (no row locks). Interleaved rounds (the order alternates), best and median
per arm. The server figures are ``DO`` loops in one transaction (as docs/benchmarks.md's issue-38 figures:
a 0-second TTL so each call grants a free key; a key someone else holds; the renew statement); the client
figures are one ``LeaseStore`` call each with its durable commit (a grant of a free key, then its release,
untimed; a renewal). The renew statement is the same in both arms: its figures show the noise.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core import LeaseStore

DSN = os.environ.get("LEASE_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
MIGRATIONS = Path(__file__).parent.parent / "airflow_lease_provider/core/sql/migrations"

SERVER_GRANT = """DO $$ BEGIN FOR i IN 1..4000 LOOP
  PERFORM * FROM {schema}.lease_acquire('free', 'o' || (i % 2), interval '0 seconds', NULL, NULL, NULL, NULL);
END LOOP; END $$"""
SERVER_HELD = """DO $$ BEGIN FOR i IN 1..20000 LOOP
  PERFORM * FROM {schema}.lease_acquire('held', 'other', interval '5 minutes', NULL, NULL, NULL, NULL);
END LOOP; END $$"""
SERVER_RENEW = """DO $$ DECLARE t bigint; BEGIN
  SELECT token INTO t FROM {schema}.lease WHERE key = 'held';
  FOR i IN 1..20000 LOOP
    UPDATE {schema}.lease AS l
       SET renewed_at = clock_timestamp(), expires_at = clock_timestamp() + interval '5 minutes',
           ttl = interval '5 minutes'
     WHERE l.key = 'held' AND l.owner = 'h' AND l.token = t AND l.expires_at > clock_timestamp()
       AND l.released_at IS NULL;
  END LOOP;
END $$"""
ARMS = {"before": "bench_renewal_lock_before", "after": "bench_renewal_lock_after"}
FIGURES = ("server_grant", "server_held", "server_renew", "client_grant", "client_grant_slotlike", "client_renew")


def _execute(query: sql.Composable) -> None:
    conn = psycopg2.connect(DSN)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(query)
    finally:
        conn.close()


def make(schema: str, before: bool, migration: int = 15) -> None:
    _execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    store = LeaseStore(DSN, schema=schema)
    store.ensure_schema()
    store.try_acquire("held", "h", timedelta(minutes=5))
    store.close()
    if before:
        path = next(MIGRATIONS.glob(f"{migration:04d}_*.sql"))
        found = re.search(
            r"CREATE (?:OR REPLACE )?FUNCTION \{schema\}\.lease_key_state.*?\$\$;\n", path.read_text(), re.S
        )
        assert found is not None
        body = re.sub(r"^CREATE (?:OR REPLACE )?FUNCTION", "CREATE OR REPLACE FUNCTION", found.group(0))
        _execute(sql.SQL(body).format(schema=sql.Identifier(schema)))


def server(conn: psycopg2.extensions.connection, query: str, schema: str, n: int) -> float:
    with conn.cursor() as cur:
        started = time.perf_counter()
        cur.execute(sql.SQL(query).format(schema=sql.Identifier(schema)))
        conn.commit()
    return (time.perf_counter() - started) / n * 1e6


def client_grant(schema: str, n: int = 1500, key: str = "cfree") -> float:
    store = LeaseStore(DSN, schema=schema)
    total = 0.0
    for _ in range(n):
        started = time.perf_counter()
        lease = store.try_acquire(key, "o", timedelta(seconds=60)).lease
        total += time.perf_counter() - started
        assert lease is not None
        store.release(lease)
    store.close()
    return total / n * 1e6


def client_renew(schema: str, n: int = 1500) -> float:
    store = LeaseStore(DSN, schema=schema)
    lease = store.try_acquire("crenew", "r", timedelta(minutes=5)).lease
    started = time.perf_counter()
    for _ in range(n):
        assert lease is not None
        lease = store.renew(lease)
    took = (time.perf_counter() - started) / n * 1e6
    store.close()
    return took


def main(rounds: int, migration: int = 15) -> None:
    for arm, schema in ARMS.items():
        make(schema, arm == "before", migration)
    results: dict[tuple[str, str], list[float]] = {(a, f): [] for a in ARMS for f in FIGURES}
    conn = psycopg2.connect(DSN)
    try:
        for r in range(rounds):
            order = list(ARMS.items()) if r % 2 == 0 else list(reversed(ARMS.items()))
            for arm, schema in order:
                results[(arm, "server_grant")].append(server(conn, SERVER_GRANT, schema, 4000))
                results[(arm, "server_held")].append(server(conn, SERVER_HELD, schema, 20000))
                results[(arm, "server_renew")].append(server(conn, SERVER_RENEW, schema, 20000))
                results[(arm, "client_grant")].append(client_grant(schema))
                results[(arm, "client_grant_slotlike")].append(client_grant(schema, key="cfree#2"))
                results[(arm, "client_renew")].append(client_renew(schema))
    finally:
        conn.close()
        for schema in ARMS.values():
            _execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    for figure in FIGURES:
        b, a = results[("before", figure)], results[("after", figure)]
        print(
            f"{figure:21s} best before {min(b):7.1f} us after {min(a):7.1f} us ({min(a) / min(b):.2f}x); "
            f"median {statistics.median(b):7.1f} / {statistics.median(a):7.1f} us"
        )
    print("load average", " ".join(Path("/proc/loadavg").read_text().split()[:3]))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7, int(sys.argv[2]) if len(sys.argv) > 2 else 15)
