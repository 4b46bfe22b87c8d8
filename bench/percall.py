"""What one held-key acquire costs, measured apart from the clients: ``python -m bench.percall``.

- server: the store's ``lease_acquire`` against version 8's (``bench_lease_acquire_v8``, with its
  ``SET search_path FROM CURRENT``) called ``--calls`` times in one ``DO`` loop each, interleaved, best and
  median of ``--rounds``: the function call and its statements, without parsing, network or client.
- client: Python function calls per ``LeaseStore.acquire()`` on a held key (cProfile, deterministic), with
  the ledger off and on.

Not part of ``python -m bench`` and writes nothing; it creates a schema ``lease_percall_<random>`` and drops it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
import uuid
from datetime import timedelta

import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core import LeaseStore
from bench import sqltext

CALLS = {
    "version 9 (no SET clause)": "lease_acquire",
    "version 8 (SET search_path)": sqltext.V8_ACQUIRE_NAME,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LEASE_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    schema = f"lease_percall_{uuid.uuid4().hex[:10]}"
    store = LeaseStore(args.dsn, schema=schema, record_events=False)
    logged = LeaseStore(args.dsn, schema=schema, record_events=True)
    conn = psycopg2.connect(args.dsn)
    conn.autocommit = True
    try:
        store.ensure_schema()
        ttl = timedelta(hours=1)
        store.acquire("hot", "holder", ttl)
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            cur.execute(sqltext.v8_acquire_function())
            cur.execute("RESET search_path")
            times: dict[str, list[float]] = {name: [] for name in CALLS}
            for round_ in range(args.rounds):
                order = list(CALLS.items()) if round_ % 2 == 0 else list(CALLS.items())[::-1]
                for name, function in order:
                    loop = sql.SQL(
                        "DO $d$ BEGIN FOR i IN 1..{n} LOOP "
                        "PERFORM * FROM {f}('hot', 'w1', interval '60 seconds'); END LOOP; END $d$"
                    ).format(n=sql.Literal(args.calls), f=sql.Identifier(schema, function))
                    started = time.perf_counter()
                    cur.execute(loop)
                    times[name].append((time.perf_counter() - started) / args.calls * 1e6)
        for name, values in times.items():
            values.sort()
            print(f"server, held key, {name}: best {values[0]:.1f} us/call, median {values[len(values) // 2]:.1f}")
        new, old = (sorted(times[n]) for n in CALLS)
        print(f"server: version 8 / version 9: best {old[0] / new[0]:.2f}x, median {old[len(old) // 2] / new[len(new) // 2]:.2f}x")
        for label, leases in (("ledger off", store), ("ledger on", logged)):
            for _ in range(100):
                leases.acquire("hot", "w1", ttl)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(2000):
                leases.acquire("hot", "w1", ttl)
            profile.disable()
            calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
            print(f"client, held key, {label}: {calls / 2000:.0f} Python calls per LeaseStore.acquire()")
    finally:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.close()
        store.close()
        logged.close()


if __name__ == "__main__":
    main()
