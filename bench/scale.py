"""``python -m bench --scale``: a thousand leases held at once on one store (docs/benchmarks.md).

Each lease has its own client: its own :class:`LeaseStore` (its own connection handling) and its own
:class:`LeaseKeeper`, as a running leased task has in Airflow. Clients are threads, ``--scale-per-process``
to a process, so that the GIL of one process does not become the figure. Every client takes its lease
at a random instant in the first ``--scale-ramp`` seconds (tasks do not all start in one second), then
keeps it (TTL 30 s, renewal every 10 s) for ``--scale-seconds`` from then, then releases it.

Arms, each against a private embedded PostgreSQL with ``max_connections = 100``:

* ``direct``: the stores close their connection as soon as it is idle (``idle_close=timedelta(0)``, what
  the Airflow hooks use by default), straight to the server;
* ``pgbouncer``: the same clients through pgbouncer in transaction pooling mode with a pool of 20;
* ``direct-hold``: the stores keep their connection open (``[lease] hold_connection = true``): the
  failure the library used to have by default, for comparison (``--scale-hold-seconds``, default 60).

Figures per arm: leases held, leases lost, fail-closed errors (an acquire that raised
``LeaseStoreUnavailable``, or a lost lease: what would fail a leased task), renewal attempts that failed
and were retried by the keeper in time, renewal latency p50/p99/max, peak server connections (client backends,
sampled every 0.2 s), connects per second (client side, and sessions the server saw).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import psycopg2

from airflow_lease_provider.core import LeaseStore, LeaseStoreUnavailable
from airflow_lease_provider.core.embedded import EmbeddedPostgres
from bench.provenance import provenance as provenance_of_checkout

REPO = Path(__file__).resolve().parent.parent
TTL = datetime.timedelta(seconds=30)
ARMS = ("direct", "pgbouncer", "direct-hold")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- the clients (in worker processes) ---------------------------------------------------------------


def _client(index: int, dsn: str, schema: str, hold: bool, start_at: float, end_at: float, out: dict[str, Any]) -> None:
    store = LeaseStore(dsn, schema=schema, idle_close=None if hold else datetime.timedelta(0))
    latencies: list[float] = out["renew_ms"]
    real_renew = store.renew

    def timed_renew(lease: Any, ttl: Any = None) -> Any:
        started = time.monotonic()
        try:
            return real_renew(lease, ttl)
        except LeaseStoreUnavailable:
            out["renew_errors"] += 1
            raise
        finally:
            latencies.append((time.monotonic() - started) * 1000)

    store.renew = timed_renew  # type: ignore[method-assign]
    lost: list[str] = []
    try:
        time.sleep(max(0.0, start_at - time.monotonic()))
        try:
            lease = store.acquire(f"scale-{index}", f"client-{index}", TTL)
        except LeaseStoreUnavailable as exc:
            out["acquire_errors"] += 1
            out["errors"].append(str(exc)[:200])
            return
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


def _worker(first: int, count: int, dsn: str, schema: str, hold: bool, ramp: float, duration: float,
            go_at_wall: float, queue: Any) -> None:
    # Wall clock only to agree on the common start across processes; everything else is monotonic.
    offset = time.monotonic() - time.time()
    go = go_at_wall + offset
    out: dict[str, Any] = {
        "held": 0, "refused": 0, "lost": 0, "acquire_errors": 0, "renew_errors": 0, "release_errors": 0,
        "connects": 0,
        "renew_ms": [], "errors": [],
    }
    rng = random.Random(first)
    threads = []
    for index in range(first, first + count):
        start_at = go + rng.uniform(0, ramp)
        # Each lease is held for ``duration`` from its own start, so releases are spread like acquires.
        thread = threading.Thread(
            target=_client, args=(index, dsn, schema, hold, start_at, start_at + duration, out), daemon=True
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    queue.put(out)


# -- the coordinator -------------------------------------------------------------------------------


class _ConnectionSampler:
    """Samples the server's client backends every 0.2 s; keeps the peak."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg2.connect(dsn)
        self.conn.autocommit = True
        self.peak = 0
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self.conn.cursor() as cur:
            while not self._stop.wait(0.2):
                cur.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                    "AND pid <> pg_backend_pid()"
                )
                value = int(cur.fetchone()[0])
                self.samples.append(value)
                self.peak = max(self.peak, value)

    def sessions(self) -> int:
        with self.conn.cursor() as cur:
            cur.execute("SELECT sum(sessions) FROM pg_stat_database")
            return int(cur.fetchone()[0] or 0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.conn.close()


def run_arm(arm: str, server_dsn: str, leases: int, per_process: int, ramp: float, duration: float) -> dict[str, Any]:
    schema = f"lease_scale_{uuid.uuid4().hex[:8]}"
    bouncer = None
    dsn = server_dsn
    if arm == "pgbouncer":
        from tests.reliability.pgbouncer import PgBouncer

        bouncer = PgBouncer(
            server_dsn,
            {
                "default_pool_size": "20",
                "max_client_conn": str(leases + 100),
                "query_wait_timeout": "5",
                "server_login_retry": "1",
            },
        )
        dsn = bouncer.dsn
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    go_at = time.time() + 3.0
    procs = []
    for first in range(0, leases, per_process):
        count = min(per_process, leases - first)
        proc = ctx.Process(
            target=_worker, args=(first, count, dsn, schema, arm == "direct-hold", ramp, duration, go_at, queue)
        )
        proc.start()
        procs.append(proc)
    sampler = _ConnectionSampler(server_dsn)  # after the forks: the children inherit no thread of it
    sessions_before = sampler.sessions()
    started = time.monotonic()
    results = [queue.get(timeout=ramp + duration + 300) for _ in procs]
    elapsed = time.monotonic() - started
    for proc in procs:
        proc.join(timeout=30)
    sessions = sampler.sessions() - sessions_before
    sampler.close()
    if bouncer is not None:
        bouncer.stop()
    with psycopg2.connect(server_dsn) as admin, admin.cursor() as cur:
        cur.execute(psycopg2.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(psycopg2.sql.Identifier(schema)))
    admin.close()
    renew = [v for r in results for v in r["renew_ms"]]
    counted = ("held", "refused", "lost", "acquire_errors", "renew_errors", "release_errors", "connects")
    total = {k: sum(r[k] for r in results) for k in counted}
    errors = [e for r in results for e in r["errors"]]
    return {
        "arm": arm,
        "leases": leases,
        "processes": len(procs),
        "ramp_s": ramp,
        "hold_s": duration,
        "elapsed_s": round(elapsed, 1),
        **total,
        # What would fail a leased task: an acquire that could not reach the store, or a lost lease. A
        # renewal attempt that failed and was retried in time by the keeper fails nothing.
        "fail_closed": total["acquire_errors"] + total["lost"],
        "renewals_retried": total["renew_errors"],
        "renewals": len(renew),
        "renew_p50_ms": _percentile(renew, 0.5),
        "renew_p99_ms": _percentile(renew, 0.99),
        "renew_max_ms": max(renew) if renew else None,
        "peak_server_connections": sampler.peak,
        "client_connects_per_s": round(total["connects"] / elapsed, 1),
        "server_sessions_per_s": round(sessions / elapsed, 1),
        "first_errors": sorted(set(errors))[:5],
    }


def render(results: dict[str, Any]) -> str:
    lines = [
        "| arm | held | lost | fail-closed | renewals (retried) | renew p50 / p99 / max (ms) | peak server conns "
        "| connects/s (client / server) |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for a in results["arms"]:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        lines.append(
            f"| {a['arm']} ({a['hold_s']:g} s) | {a['held']} / {a['leases']} | {a['lost']} | {a['fail_closed']} "
            f"| {a['renewals']} ({a.get('renewals_retried', a['renew_errors'])}) | {ms(a['renew_p50_ms'])} / {ms(a['renew_p99_ms'])} / {ms(a['renew_max_ms'])} "
            f"| {a['peak_server_connections']} | {a['client_connects_per_s']} / {a['server_sessions_per_s']} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --scale", description=__doc__.split("\n")[0])
    parser.add_argument("--scale", action="store_true")
    parser.add_argument("--scale-leases", type=int, default=1000)
    parser.add_argument("--scale-seconds", type=float, default=300.0, help="how long every lease is held")
    parser.add_argument("--scale-hold-seconds", type=float, default=60.0, help="length of the direct-hold arm")
    parser.add_argument("--scale-ramp", type=float, default=20.0, help="acquires spread over this many seconds")
    parser.add_argument("--scale-per-process", type=int, default=100, help="clients (threads) per process")
    parser.add_argument("--scale-arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results-scale.json")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.scale_arms.split(",") if a.strip()]
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms: {', '.join(sorted(unknown))}")
    root = Path(tempfile.mkdtemp(prefix="lease-scale-pg-", dir="/tmp"))
    root.chmod(0o755)  # the embedded server runs as its own system user when we are root
    embedded = EmbeddedPostgres(root / "data", keep=False)
    provenance = provenance_of_checkout()
    started_at = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    try:
        dsn = embedded.start()
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("ALTER SYSTEM SET max_connections = 100")
        conn.close()
        dsn = embedded.restart()
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT current_setting('max_connections'), current_setting('server_version')")
            max_connections, version = cur.fetchone()
        conn.close()
        _log(f"private server PostgreSQL {version}, max_connections = {max_connections}")
        out = []
        for arm in arms:
            duration = args.scale_hold_seconds if arm == "direct-hold" else args.scale_seconds
            _log(f"arm {arm}: {args.scale_leases} leases, held {duration:g} s ...")
            result = run_arm(arm, dsn, args.scale_leases, args.scale_per_process, args.scale_ramp, duration)
            _log(json.dumps({k: v for k, v in result.items() if k != "first_errors"}))
            out.append(result)
    finally:
        embedded.cleanup()
        shutil.rmtree(root, ignore_errors=True)
    results = {
        "meta": {
            "command": "python -m bench " + " ".join(argv),
            "started_at": started_at.isoformat(timespec="seconds"),
            "server": f"embedded PostgreSQL {version}, max_connections = {max_connections}",
            "ttl_s": TTL.total_seconds(),
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
