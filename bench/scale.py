"""``python -m bench --scale``: thousands of leases held at once on one server (docs/benchmarks.md).

Each lease has its own client: its own :class:`LeaseStore` and its own :class:`LeaseKeeper` (the product's
acquire, renew and release, renewal every TTL/3), as a running leased task has in Airflow. Clients are
threads, ``--scale-per-process`` to a process (so that no one process's GIL becomes the figure). Every client
takes its lease at a random instant of its arm's ramp, keeps it for the arm's hold from then, and releases it.

The server is a throwaway cluster (``bench/cluster.py``: initdb + pg_ctl, ``max_connections = 100``); the
clients log in as an ordinary role, the sampler as a superuser. Arms (``ARM_SPECS``):

* ``pgbouncer-10k`` (issue 28 item 3's first target): 10,000 leases through pgbouncer (transaction pooling,
  pool of 20), TTL 5 min, acquires over 60 s, each held 110 s (all 10,000 at once from 60 s to 110 s);
* ``direct-burst`` (the second): 1,000 leases straight to the server, acquires within one second, TTL 30 s;
* ``direct``, ``pgbouncer``, ``direct-hold``: the earlier 1,000-lease profile (issue 14).

The target arms' stores close their connection after each operation (``idle_close=timedelta(0)``, the
Airflow hooks' default) and share ``--scale-pool-size`` connections per process (``pool_size``,
core/db/pool.py); ``--scale-pool-size 0`` measures them without. Figures per arm: leases held (and, counted on
the server every second, held at once), lost (a keeper reported loss, or a renewal found the lease taken),
fail-closed (an acquire that raised ``LeaseStoreUnavailable``, or a lost lease), renewals retried by the
keeper in time, renewal latency p50/p99/max, peak server connections (client backends in
``pg_stat_activity``, every 0.2 s), connects per second (client side, and sessions the server saw), and the
machine's 1-minute load.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import platform
import random
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.sql

from airflow_lease_provider.core import LeaseStore, LeaseStoreUnavailable
from bench.cluster import ThrowawayCluster
from bench.provenance import provenance as provenance_of_checkout

REPO = Path(__file__).resolve().parent.parent


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- the clients (in worker processes) ---------------------------------------------------------------


def _client(
    index: int, dsn: str, schema: str, hold: bool, ttl: datetime.timedelta, start_at: float, end_at: float,
    out: dict[str, Any], pool_size: int | None,
) -> None:
    store = LeaseStore(dsn, schema=schema, idle_close=None if hold else datetime.timedelta(0), pool_size=pool_size)
    latencies: list[float] = out["renew_ms"]
    real_renew = store.renew

    def timed_renew(lease: Any, renew_ttl: Any = None) -> Any:
        started = time.monotonic()
        try:
            return real_renew(lease, renew_ttl)
        except LeaseStoreUnavailable:
            out["renew_errors"] += 1
            raise
        finally:
            latencies.append((time.monotonic() - started) * 1000)

    store.renew = timed_renew  # type: ignore[method-assign,assignment]
    lost: list[str] = []
    try:
        time.sleep(max(0.0, start_at - time.monotonic()))
        sent = time.time()  # wall clock: compared across processes (the burst's spread)
        out["sent_at"].append(sent)
        try:
            lease = store.acquire(f"scale-{index}", f"client-{index}", ttl)
        except LeaseStoreUnavailable as exc:
            out["acquire_errors"] += 1
            out["failed_at"].append(sent)
            out["errors"].append(str(exc)[:200])
            return
        out["acquire_ms"].append((time.time() - sent) * 1000)
        if lease is None:
            out["refused"] += 1
            return
        out["held"] += 1
        keeper = store.keep(lease, on_lost=lambda exc: lost.append(exc.reason))
        time.sleep(max(0.0, end_at - time.monotonic()))
        out["lost"] += 1 if (lost or keeper.lost) else 0
        if lost:
            out["errors"].append(lost[0][:200])
        try:
            keeper.stop(release=not lost)
        except LeaseStoreUnavailable as exc:  # the lease lapses by its TTL instead; nothing fails
            out["release_errors"] += 1
            out["errors"].append(str(exc)[:200])
    except Exception:  # noqa: BLE001 - a bench bug is reported, not hidden
        out["errors"].append(traceback.format_exc()[-400:])
    finally:
        out["connects"] += store.db.connects
        store.close()


def _worker(first: int, count: int, dsn: str, schema: str, hold: bool, ttl_s: float, ramp: float, duration: float,
            go_at_wall: float, queue: Any, pool_size: int | None) -> None:
    # Thousands of mostly sleeping threads per process (a holder and the keeper's two per lease): a
    # smaller stack than the 8 MB default keeps their address space modest; nothing here recurses deeply.
    threading.stack_size(512 * 1024)
    ttl = datetime.timedelta(seconds=ttl_s)
    # Wall clock only to agree on the common start across processes; everything else is monotonic.
    offset = time.monotonic() - time.time()
    go = go_at_wall + offset
    out: dict[str, Any] = {
        "held": 0, "refused": 0, "lost": 0, "acquire_errors": 0, "renew_errors": 0, "release_errors": 0,
        "connects": 0,
        "renew_ms": [], "errors": [], "sent_at": [], "failed_at": [], "acquire_ms": [],
    }
    rng = random.Random(first)
    threads = []
    for index in range(first, first + count):
        start_at = go + rng.uniform(0, ramp)
        # Each lease is held for ``duration`` from its own start, so releases are spread like acquires.
        thread = threading.Thread(
            target=_client, args=(index, dsn, schema, hold, ttl, start_at, start_at + duration, out, pool_size), daemon=True
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    from airflow_lease_provider.core.db import pool

    out["pool_connects"] = sum(p.connects for p in pool.current_pid_pools())
    out["pool_reuses"] = sum(p.reuses for p in pool.current_pid_pools())
    queue.put(out)


# -- the coordinator -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: how the clients reach the server, how many leases, their TTL, and when they come and go."""

    name: str
    via: str  # "direct" or "pgbouncer"
    leases: int
    ttl_s: float
    ramp_s: float  # acquires spread uniformly over this many seconds
    hold_s: float  # each lease is held this long from its own acquire, then released
    hold_connection: bool = False
    target: str | None = None
    pool_size: int | None = None  # Database(pool_size=...): connections shared by a process's stores  # the target row this arm answers, if any


ARM_SPECS = {
    # Issue 28 item 3, first target: 10,000 held at once through pgbouncer (TTL 5 min, starts over 60 s).
    # Held 110 s from its start: all 10,000 overlap from 60 s to 110 s, and each renews once (at TTL/3).
    "pgbouncer-10k": Arm(
        "pgbouncer-10k", "pgbouncer", 10_000, 300.0, 60.0, 110.0,
        target="through pgbouncer (transaction pooling, pool 20), max_connections = 100: 10,000 leases held "
        "at once (TTL 5 min, starts over 60 s), 0 lost, 0 fail-closed",
    ),
    # Second target: 1,000 acquires arriving within one second, straight to the server (TTL 30 s). Held
    # 40 s, so the renewals come in the same synchronised bursts three times.
    # Scheduled over 0.5 s, so that a loaded machine's late thread wake-ups still send all within 1 s.
    "direct-burst": Arm(
        "direct-burst", "direct", 1_000, 30.0, 0.5, 40.0,
        target="direct, max_connections = 100: 1,000 leases whose acquires all arrive within one second "
        "(TTL 30 s), 0 lost, 0 fail-closed",
    ),
    # The earlier profile (issue 14): 1,000 leases over 20 s, held 5 minutes.
    "direct": Arm("direct", "direct", 1_000, 30.0, 20.0, 300.0),
    "pgbouncer": Arm("pgbouncer", "pgbouncer", 1_000, 30.0, 20.0, 300.0),
    "direct-hold": Arm("direct-hold", "direct", 1_000, 30.0, 20.0, 60.0, hold_connection=True),
}
TARGET_ARMS = ("pgbouncer-10k", "direct-burst")
#: Connections per process the target arms' stores share (core/db/pool.py).
DEFAULT_POOL = 4
ARMS = tuple(ARM_SPECS)


class _Sampler:
    """Every 0.2 s: the server's client backends (the peak is the figure); every second the leases the
    server holds unexpired and unreleased in the arm's schema, and this machine's 1-minute load."""

    def __init__(self, admin_dsn: str, schema: str) -> None:
        self.conn = psycopg2.connect(admin_dsn)
        self.conn.autocommit = True
        self.schema = schema
        self.peak = 0
        self.peak_held = 0
        self.samples: list[int] = []
        self.load: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        held_query = psycopg2.sql.SQL(
            "SELECT count(*) FROM {}.lease WHERE released_at IS NULL AND expires_at > clock_timestamp()"
        ).format(psycopg2.sql.Identifier(self.schema))
        ticks = 0
        with self.conn.cursor() as cur:
            while not self._stop.wait(0.2):
                cur.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                    "AND pid <> pg_backend_pid()"
                )
                value = int(cur.fetchone()[0])
                self.samples.append(value)
                self.peak = max(self.peak, value)
                ticks += 1
                if ticks % 5 == 0:
                    self.load.append(os.getloadavg()[0])
                    try:
                        cur.execute(held_query)
                        self.peak_held = max(self.peak_held, int(cur.fetchone()[0]))
                    except psycopg2.errors.UndefinedTable:
                        pass  # the first store has not created the schema yet

    def sessions(self) -> int:
        with self.conn.cursor() as cur:
            cur.execute("SELECT sum(sessions) FROM pg_stat_database")
            return int(cur.fetchone()[0] or 0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.conn.close()


def run_arm(arm: Arm, admin_dsn: str, app_dsn: str, per_process: int) -> dict[str, Any]:
    schema = f"lease_scale_{uuid.uuid4().hex[:8]}"
    bouncer = None
    dsn = app_dsn
    if arm.via == "pgbouncer":
        from tests.reliability.pgbouncer import PgBouncer

        bouncer = PgBouncer(
            app_dsn,
            {
                "default_pool_size": "20",
                "max_client_conn": str(arm.leases + 100),
                "query_wait_timeout": "5",
                "server_login_retry": "1",
            },
        )
        dsn = bouncer.dsn
    # The schema exists before the first lease, as in a deployment (where it was made once, long before):
    # otherwise the first thousand stores all queue on the migration's advisory lock, and the figure is
    # that of creating a schema, not of leases.
    setup = LeaseStore(app_dsn, schema=schema)
    setup.ensure_schema()
    setup.close()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    go_at = time.time() + 3.0 + arm.leases / 2000  # time for every process to start its threads
    procs = []
    for first in range(0, arm.leases, per_process):
        count = min(per_process, arm.leases - first)
        proc = ctx.Process(
            target=_worker,
            args=(
                first, count, dsn, schema, arm.hold_connection, arm.ttl_s, arm.ramp_s, arm.hold_s, go_at, queue,
                arm.pool_size,
            ),
        )
        proc.start()
        procs.append(proc)
    sampler = _Sampler(admin_dsn, schema)  # after the forks: the children inherit no thread of it
    sessions_before = sampler.sessions()
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    try:
        results = [queue.get(timeout=arm.ramp_s + arm.hold_s + 300) for _ in procs]
    finally:
        elapsed = time.monotonic() - started
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        sessions = sampler.sessions() - sessions_before
        sampler.close()
        if bouncer is not None:
            bouncer.stop()
        with psycopg2.connect(admin_dsn) as admin, admin.cursor() as cur:
            cur.execute(psycopg2.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(psycopg2.sql.Identifier(schema)))
        admin.close()
    renew = [v for r in results for v in r["renew_ms"]]
    sent = [v for r in results for v in r["sent_at"]]
    acquire_ms = [v for r in results for v in r["acquire_ms"]]
    t0 = min(sent, default=0.0)
    # When (seconds after the first acquire was sent) the acquires that failed closed were sent, by second.
    failed_by_second: dict[int, int] = {}
    for r in results:
        for v in r["failed_at"]:
            failed_by_second[int(v - t0)] = failed_by_second.get(int(v - t0), 0) + 1
    counted = (
        "held", "refused", "lost", "acquire_errors", "renew_errors", "release_errors", "connects", "pool_reuses",
    )
    total = {k: sum(r[k] for r in results) for k in counted}
    errors = [e for r in results for e in r["errors"]]
    # Connects per second over the span the leases were live (ramp + hold), not the set-up around it.
    live_s = arm.ramp_s + arm.hold_s
    return {
        "arm": arm.name,
        "via": arm.via,
        "leases": arm.leases,
        "ttl_s": arm.ttl_s,
        "processes": len(procs),
        "ramp_s": arm.ramp_s,
        "hold_s": arm.hold_s,
        "hold_connection": arm.hold_connection,
        "pool_size_per_process": arm.pool_size,
        "elapsed_s": round(elapsed, 1),
        **total,
        # What would fail a leased task: an acquire that could not reach the store, or a lost lease. A
        # renewal attempt that failed and was retried in time by the keeper fails nothing.
        "fail_closed": total["acquire_errors"] + total["lost"],
        "renewals_retried": total["renew_errors"],
        "renewals": len(renew),
        "peak_held_at_once": sampler.peak_held,
        "acquires_sent_over_s": round(max(sent) - min(sent), 3) if sent else None,
        "acquire_p50_ms": _percentile(acquire_ms, 0.5),
        "acquire_p99_ms": _percentile(acquire_ms, 0.99),
        "failed_acquires_by_second": dict(sorted(failed_by_second.items())),
        "renew_p50_ms": _percentile(renew, 0.5),
        "renew_p99_ms": _percentile(renew, 0.99),
        "renew_max_ms": max(renew) if renew else None,
        "peak_server_connections": sampler.peak,
        "client_connects_per_s": round(total["connects"] / live_s, 1),
        "server_sessions_per_s": round(sessions / live_s, 1),
        "load_1min": {
            "start": round(load_start, 2),
            "max": round(max(sampler.load, default=load_start), 2),
            "end": round(os.getloadavg()[0], 2),
        },
        "first_errors": sorted(set(errors))[:5],
    }


def verdict(arm: Arm, result: dict[str, Any]) -> str:
    """PASS, or MISS and why, for an arm that answers a target."""
    misses = []
    if result["held"] != arm.leases:
        misses.append(f"{result['held']} of {arm.leases} acquired")
    if arm.name == "pgbouncer-10k" and result["peak_held_at_once"] < arm.leases:
        misses.append(f"at most {result['peak_held_at_once']} held at once")
    if result["lost"]:
        misses.append(f"{result['lost']} lost")
    if result["fail_closed"]:
        misses.append(f"{result['fail_closed']} fail-closed")
    spread = result["acquires_sent_over_s"]
    if arm.name == "direct-burst" and spread is not None and spread > 1.0:
        misses.append(f"the acquires were sent over {spread:.2f} s, not within one second (the bench's clients)")
    return "PASS" if not misses else "MISS: " + "; ".join(misses)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def render(results: dict[str, Any]) -> str:
    lines = []
    targets = [a for a in results["arms"] if a.get("target")]
    if targets:
        lines += [
            "### Issue 28 item 3 targets (ten thousand leases)",
            "",
            "| target | measured | verdict |",
            "| --- | --- | --- |",
        ]
        for a in targets:
            measured = (
                f"held {a['held']:,} / {a['leases']:,} (at once, server-side: {a['peak_held_at_once']:,}); "
                f"lost {a['lost']}; fail-closed {a['fail_closed']}; acquires sent over {a['acquires_sent_over_s']} s; "
                f"renew p99 {_ms(a['renew_p99_ms'])} ms ({a['renewals']:,} renewals, {a['renewals_retried']} retried); "
                f"peak server connections {a['peak_server_connections']}; connects/s client "
                f"{a['client_connects_per_s']} / server {a['server_sessions_per_s']}"
            )
            lines.append(f"| {a['target']} | {measured} | {a['verdict']} |")
        lines.append("")
    lines += [
        "| arm | held (at once) | lost | fail-closed | renewals (retried) | renew p50 / p99 / max (ms) "
        "| peak server conns | connects/s (client / server) | load 1-min start / max / end |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |",
    ]
    for a in results["arms"]:
        load = a.get("load_1min") or {}
        lines.append(
            f"| {a['arm']} ({a['leases']:,} leases, TTL {a.get('ttl_s', 30):g} s, over {a['ramp_s']:g} s, "
            f"held {a['hold_s']:g} s) | {a['held']:,} ({a.get('peak_held_at_once', '-')}) | {a['lost']} "
            f"| {a['fail_closed']} | {a['renewals']:,} ({a.get('renewals_retried', a['renew_errors'])}) "
            f"| {_ms(a['renew_p50_ms'])} / {_ms(a['renew_p99_ms'])} / {_ms(a['renew_max_ms'])} "
            f"| {a['peak_server_connections']} | {a['client_connects_per_s']} / {a['server_sessions_per_s']} "
            f"| {load.get('start', '-')} / {load.get('max', '-')} / {load.get('end', '-')} |"
        )
    return "\n".join(lines)


def _prepare_app(admin_dsn: str) -> tuple[str, str]:
    """An ordinary role and database for the clients: they get the 97 slots a non-superuser may use, and
    the sampler (a superuser) one of the reserved ones."""
    with psycopg2.connect(admin_dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE ROLE lease_app LOGIN")
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE DATABASE lease_scale OWNER lease_app")
    conn.close()
    admin_app = admin_dsn.rsplit("/", 1)[0] + "/lease_scale"
    return admin_app, admin_app.replace("postgres@", "lease_app@", 1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --scale", description=__doc__.split("\n")[0])
    parser.add_argument("--scale", action="store_true")
    parser.add_argument(
        "--scale-arms", default=",".join(TARGET_ARMS), help=f"comma-separated subset of {','.join(ARMS)}"
    )
    parser.add_argument("--scale-leases", type=int, default=None, help="override every arm's lease count")
    parser.add_argument("--scale-seconds", type=float, default=None, help="override how long each lease is held")
    parser.add_argument("--scale-per-process", type=int, default=400, help="clients (threads) per process")
    parser.add_argument(
        "--scale-pool-size", type=int, default=DEFAULT_POOL,
        help="the target arms' stores share this many connections per process (LeaseStore(pool_size=N); "
        "0: a connection per store, closed after each operation, as before)",
    )
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results-scale.json")
    parser.add_argument("--report", type=Path, default=None, help="run nothing: print the tables of a saved run")
    args = parser.parse_args(argv)
    if args.report is not None:
        print(render(json.loads(args.report.read_text())))
        return 0
    names = [a.strip() for a in args.scale_arms.split(",") if a.strip()]
    unknown = set(names) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms: {', '.join(sorted(unknown))}")
    arms = []
    for name in names:
        arm = ARM_SPECS[name]
        if args.scale_leases is not None:
            arm = dataclasses.replace(arm, leases=args.scale_leases)
        if args.scale_seconds is not None:
            arm = dataclasses.replace(arm, hold_s=args.scale_seconds)
        if arm.target:
            arm = dataclasses.replace(arm, pool_size=args.scale_pool_size or None)
        arms.append(arm)
    cluster = ThrowawayCluster({"max_connections": "100"})
    provenance = provenance_of_checkout()
    started_at = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    try:
        admin_dsn = cluster.start()
        server = cluster.describe()
        admin_dsn, app_dsn = _prepare_app(admin_dsn)  # the sampler reads the clients' database
        _log(f"private server PostgreSQL {server['server_version']}, max_connections = {server['max_connections']}")
        out = []
        for arm in arms:
            _log(f"arm {arm.name}: {arm.leases} leases via {arm.via}, TTL {arm.ttl_s:g} s, over {arm.ramp_s:g} s, "
                 f"held {arm.hold_s:g} s ...")
            # The burst's 1,000 threads in few processes would start late: at most 100 to a process there.
            per_process = min(args.scale_per_process, 100) if arm.ramp_s <= 1.0 else args.scale_per_process
            result = run_arm(arm, admin_dsn, app_dsn, per_process)
            if arm.target:
                result["target"] = arm.target
                result["verdict"] = verdict(arm, result)
            _log(json.dumps({k: v for k, v in result.items() if k != "first_errors"}))
            out.append(result)
    finally:
        cluster.cleanup()
    results = {
        "meta": {
            "command": "python -m bench " + " ".join(argv),
            "started_at": started_at.isoformat(timespec="seconds"),
            "server": f"PostgreSQL {server['server_version']}, max_connections = {server['max_connections']} "
            f"({server['superuser_reserved_connections']} reserved for superusers; clients log in as an ordinary "
            f"role), {server['where']}",
            "cpus": os.cpu_count(),
            "machine": platform.platform(),
            "python": platform.python_version(),
            "load_start": " ".join(f"{v:.2f}" for v in load_start),
            "load_end": " ".join(f"{v:.2f}" for v in os.getloadavg()),
            **provenance,
        },
        "arms": out,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(render(results))
    _log(f"results written to {args.output}")
    return 0
