"""``python -m bench.layers``: where a held-key acquire's throughput goes, layer by layer, at high concurrency.

The same statement (the store's SET LOCAL prefix and ``lease_acquire`` as text, ``prepare=False``, so every
arm sends the same bytes) on a key someone holds, from N client processes at once, each with one connection:

- ``psycopg2``: a bare cursor on a plain ``psycopg2.connect(dsn)``, one cursor for the run;
- ``store connection``: the store's own connection (its options) and a new cursor per call, as the store does;
- ``Database.run``: the store's query path (lock, connection check, watchdog bookkeeping, error handling);
- ``LeaseStore.acquire``: the whole call (argument validation, the row made into a ``Lease``).

The arms run interleaved, ``--rounds`` times, ``--seconds`` each; medians are printed. Nothing is written but
a throwaway schema, dropped at the end. A figure is attempts per second of all clients together.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg2

from airflow_lease_provider.core import LeaseStore
from bench.server import Server

ARMS = ("psycopg2", "store connection", "Database.run", "LeaseStore.acquire")
TTL = timedelta(seconds=60)


def _attempt(arm: str, dsn: str, schema: str) -> Callable[[], Any]:
    store = LeaseStore(dsn, schema=schema, record_events=False, prepare=False)
    store.acquire("hot", "w1", TTL)  # connects, checks the schema, builds the statement
    params = {"key": "hot", "owner": "w1", "ttl": TTL}
    if arm == "LeaseStore.acquire":
        return lambda: store.acquire("hot", "w1", TTL)
    db = store.db
    if arm == "Database.run":
        return lambda: db.run("acquire", params, durable=True)
    text = db._statement("acquire", True, db._conn).plain
    if arm == "store connection":
        conn = db._conn

        def with_store_connection() -> Any:
            with conn.cursor() as cur:
                cur.execute(text, params)
                return cur.fetchall()

        return with_store_connection
    store.close()  # one connection per client in every arm
    plain = psycopg2.connect(dsn)
    plain.autocommit = True
    cur = plain.cursor()

    def bare() -> Any:
        cur.execute(text, params)
        return cur.fetchall()

    return bare


def _client(arm: str, dsn: str, schema: str, start: float, seconds: float, out: Any) -> None:
    try:
        attempt = _attempt(arm, dsn, schema)
        while time.time() < start:
            time.sleep(0.001)
        count, end = 0, start + seconds
        while time.time() < end:
            attempt()
            count += 1
        out.put(count)
    except Exception as exc:  # reported by the coordinator
        out.put(repr(exc))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LEASE_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    schema = "lease_layers_" + uuid.uuid4().hex[:10]
    holder = LeaseStore(args.dsn, schema=schema, record_events=False)
    holder.ensure_schema()
    assert holder.acquire("hot", "holder", timedelta(hours=1)) is not None
    ctx = mp.get_context("fork")
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    try:
        for round_ in range(args.rounds):
            order = ARMS if round_ % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                out = ctx.Queue()
                start = time.time() + 3.0  # every client connected and ready by then
                procs = [
                    ctx.Process(target=_client, args=(arm, args.dsn, schema, start, args.seconds, out))
                    for _ in range(args.clients)
                ]
                for proc in procs:
                    proc.start()
                results = [out.get(timeout=120) for _ in procs]
                for proc in procs:
                    proc.join()
                errors = [r for r in results if isinstance(r, str)]
                if errors:
                    raise RuntimeError(f"{arm}: {len(errors)} clients failed, e.g. {errors[0]}")
                rates[arm].append(sum(results) / args.seconds)
                time.sleep(1.0)
    finally:
        holder.close()
        server = Server(args.dsn)
        try:
            server.drop_schema(schema)
        finally:
            server.close()
    base = statistics.median(rates["psycopg2"])
    print(f"held-key acquire, {args.clients} clients, {args.rounds} rounds of {args.seconds:g} s (median, min-max):")
    for arm in ARMS:
        values = rates[arm]
        print(f"  {arm:20s} {statistics.median(values):9,.0f}/s ({min(values):,.0f}-{max(values):,.0f})"
              f"  {statistics.median(values) / base:.2f}x of psycopg2")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
