"""Query plans of the timeline and trend reads on a big ledger: 10,000 keys, 1,000,000 events.

    .venv/bin/python -m bench.ui_plans --dsn postgresql://postgres@127.0.0.1:5432/test

Seeds a fresh schema with ``generate_series`` in SQL (30 days of events, 100 per key, 1,000 DAGs of 10
keys each, the kinds mixed as a busy deployment writes them), runs ``EXPLAIN (ANALYZE, BUFFERS)`` on each
named query the timeline, the trends and the DAG tab use (the queries of core/sql/queries.sql, as the
store sends them), then again without migration 0005's indexes and 0007's run index (dropped inside a
transaction that is rolled back), and drops the schema. Prints one line per query; docs/ui.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from datetime import timedelta
from typing import Any

import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.db import Database

KEYS = 10_000
EVENTS = 1_000_000
DAGS = 1_000
DAYS = 30

SEED = """
INSERT INTO {schema}.lease (key, owner, token, ttl, acquired_at, renewed_at, expires_at, released_at)
SELECT format('dag_%s.task_%s', k % {dags}, k), format('dag_%s/scheduled__%s/task_%s', k % {dags}, k, k),
       100, interval '10 minutes', now() - interval '1 hour', now() - interval '1 hour',
       now() + CASE WHEN k % 10 = 0 THEN interval '5 minutes' ELSE -interval '50 minutes' END,
       CASE WHEN k % 10 = 0 THEN NULL ELSE now() - interval '50 minutes' END
  FROM generate_series(0, {keys} - 1) AS k;

INSERT INTO {schema}.event (at, kind, key, owner, token, detail, dag_id, run_id, task_id, map_index)
SELECT now() - (i * interval '{days} days' / {events}),
       kind,
       CASE WHEN kind = 'fence_rejected' THEN format('resource_%s', k % 500) ELSE format('dag_%s.task_%s', k % {dags}, k) END,
       format('dag_%s/run_%s/task_%s', k % {dags}, i, k),
       CASE WHEN kind IN ('skipped_overlap', 'skipped_catchup') THEN NULL ELSE i END,
       CASE kind
         WHEN 'acquired' THEN jsonb_build_object('ttl_seconds', 600, 'host', 'worker-1')
         WHEN 'released' THEN jsonb_build_object('held_seconds', 120 + i % 300)
         WHEN 'skipped_overlap' THEN jsonb_build_object('dag_id', format('dag_%s', k % {dags}),
             'run_id', format('run_%s', i), 'task_id', format('task_%s', k), 'reason', 'held',
             'holder_owner', format('dag_%s/run_%s/task_%s', k % {dags}, i - 1, k), 'holder_token', i - 1)
         WHEN 'fence_rejected' THEN jsonb_build_object('lease_key', format('dag_%s.task_%s', k % {dags}, k),
             'outcome', 'stale', 'current_token', i + 1)
         WHEN 'skipped_catchup' THEN jsonb_build_object('dag_id', format('dag_%s', k % {dags}),
             'run_id', format('scheduled__%s', i), 'count', 1 + i % 7)
         ELSE jsonb_build_object('reason', 'renewal failed')
       END,
       -- the run columns (migration 0007), as the operators write them: the task instance of the owner
       format('dag_%s', k % {dags}), format('run_%s', i), format('task_%s', k), -1
  FROM (
    SELECT i, i % {keys} AS k,
           CASE WHEN i % 100 < 46 THEN 'acquired' WHEN i % 100 < 92 THEN 'released'
                WHEN i % 100 < 96 THEN 'skipped_overlap' WHEN i % 100 < 98 THEN 'fence_rejected'
                WHEN i % 100 < 99 THEN 'lost' ELSE 'skipped_catchup' END AS kind
      FROM generate_series(1, {events}) AS i
  ) s;
ANALYZE {schema}.lease;
ANALYZE {schema}.event;
"""

NEW_INDEXES = ("event_dag_at_idx", "event_fence_lease_key_at_idx", "event_run_at_idx")


def plans(cur: Any, db: Database, conn: Any) -> list[dict[str, Any]]:
    cur.execute("SELECT now()")
    now = cur.fetchone()[0]
    key, dag = "dag_7.task_4007", "dag_7"
    week, month = now - timedelta(days=7), now - timedelta(days=30)
    cases = [
        ("timeline_events", "a key's events and fence rejections, 7 d",
         {"key": key, "since": week, "until": now, "dag_ids": None, "limit": 20_000}),
        ("timeline_events", "the same, scoped to the viewer's DAGs",
         {"key": key, "since": week, "until": now, "dag_ids": [dag, "dag_8"], "limit": 20_000}),
        ("timeline_open_holding", "the holding open at the range start",
         {"key": key, "since": week}),
        ("trend_key", "a key's runs and skips per day, 30 d",
         {"key": key, "since": month, "until": now, "unit": "day", "dag_ids": None}),
        ("trend_dag", "a DAG's runs and skips per day, 30 d",
         {"dag_id": dag, "since": month, "until": now, "unit": "day"}),
        ("dag_keys", "the keys a DAG's runs used, 30 d",
         {"dag_id": dag, "since": month, "until": now, "limit": 100}),
        ("catchup_events", "catch-up gaps of a DAG, 30 d",
         {"dag_ids": [dag], "since": month, "until": now, "limit": 1000}),
        ("run_events", "the events of one run (the task tab)",
         {"dag_id": dag, "run_id": "run_4007", "since": None, "until": None, "limit": 10_000}),
        ("dag_leases", "the lease rows of a DAG's runs",
         {"dag_id": dag, "limit": 1000}),
    ]
    found = []
    for name, what, params in cases:
        text = db.query_text(name, conn)
        cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text, params)
        plan = cur.fetchone()[0][0]
        found.append({
            "query": name,
            "what": what,
            "planning_ms": round(plan["Planning Time"], 3),
            "execution_ms": round(plan["Execution Time"], 3),
            "rows": plan["Plan"]["Actual Rows"],
            "buffers": _buffers(plan["Plan"]),
            "indexes": sorted(_indexes(plan["Plan"])),
            "seq_scans": sorted(_seq(plan["Plan"])),
        })
    return found


def _walk(node: dict[str, Any]) -> Any:
    yield node
    for child in node.get("Plans", []):
        yield from _walk(child)


def _indexes(node: dict[str, Any]) -> set[str]:
    return {n["Index Name"] for n in _walk(node) if "Index Name" in n}


def _seq(node: dict[str, Any]) -> set[str]:
    return {n["Relation Name"] for n in _walk(node) if n["Node Type"] == "Seq Scan"}


def _buffers(node: dict[str, Any]) -> int:
    return int(node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    schema = "lease_plans_" + secrets.token_hex(4)
    store = LeaseStore(args.dsn, schema=schema)
    conn = psycopg2.connect(args.dsn)
    try:
        store.ensure_schema()
        started = time.monotonic()
        with conn, conn.cursor() as cur:
            cur.execute(sql.SQL(SEED.format(schema="{schema}", keys=KEYS, events=EVENTS, dags=DAGS, days=DAYS))
                        .format(schema=sql.Identifier(schema)))
        seeded = time.monotonic() - started
        with conn, conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*) FROM {}.event").format(sql.Identifier(schema)))
            events = cur.fetchone()[0]
            with_indexes = plans(cur, store.db, conn)
        with conn, conn.cursor() as cur:
            for index in NEW_INDEXES:
                cur.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(schema, index)))
            without = plans(cur, store.db, conn)
            conn.rollback()
        result = {"keys": KEYS, "events": events, "seed_seconds": round(seeded, 1),
                  "with_0005": with_indexes, "without_0005": without}
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            print(f"{KEYS} keys, {events} events, seeded in {seeded:.0f} s")
            for label, rows in (("with migration 0005", with_indexes), ("without its indexes", without)):
                print(f"-- {label}")
                for r in rows:
                    print(f"{r['query']:22} {r['execution_ms']:9.3f} ms exec {r['planning_ms']:7.3f} ms plan "
                          f"{r['rows']:6} rows {r['buffers']:7} buffers  {','.join(r['indexes']) or '-'}"
                          f"{'  SEQ ' + ','.join(r['seq_scans']) if r['seq_scans'] else ''}  ({r['what']})")
    finally:
        conn.close()
        store.close()
        cleanup = psycopg2.connect(args.dsn)
        cleanup.autocommit = True
        with cleanup.cursor() as cur:
            cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        cleanup.close()


if __name__ == "__main__":
    main()
