"""A thousand leases held at once through one api-server (issue 41 item 5; ``python -m bench --api``).

A real ``airflow api-server`` (one uvicorn worker, ``[lease] api_pool_size`` as configured: 8 as shipped)
with the ``lease_api`` connection and the lease store in the deployment's metadata database. Each lease has
its own client, as each leased task on the API path has: its own :class:`~airflow_lease_provider.client.
HttpLeaseStore` (its own HTTP client and connection, the task runtime's request timeout ``min(5 s, TTL/10)``)
and its own :class:`~airflow_lease_provider.core.keeper.LeaseKeeper` (renewal every ``renew_every``, the
deadline counted from before each request). Clients are threads, ``per_process`` to a process.

Every client acquires its key at a random instant of the ramp and keeps it for ``ramp_s + hold_s`` from then,
so all are held at once from the end of the ramp for ``hold_s``; a few seconds before that ends the store itself
is read: every key must be held (unexpired, unreleased) by its client's owner. Then each client, at its own
instant, stops its keeper and releases over HTTP (releases spread as the acquires were).

Counted: leases held; lost (the keeper declared the lease lost: a renewal answered lost, or no answer before
the deadline); renewals, late renewals (the keeper's ``renewed_late``), every HTTP answer by route and
status and every request that got no answer (timeout, refused connection); renewal latency (client side,
send to answer) p50/p99/max; the api-server's CPU seconds (its process and children) over the hold; the
metadata database's backends (peak, sampled); and the machine's load average.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import random
import ssl
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Any

#: The lease keys of this benchmark (``api-scale-<i>``), held by ``api-scale-client-<i>``.
KEY_PREFIX = "api-scale-"


def _log(text: str) -> None:
    print(f"[bench --api] {text}", file=sys.stderr, flush=True)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- the clients (threads in worker processes) ---------------------------------------------------------


def _client(index: int, url: str, secret: str, ttl: datetime.timedelta, renew_every: datetime.timedelta,
            start_at: float, end_at: float, out: dict[str, Any], lock: threading.Lock, context: ssl.SSLContext) -> None:
    import httpx

    from airflow_lease_provider.client import DEFAULT_TIMEOUT, HttpLeaseStore
    from airflow_lease_provider.core import LeaseStoreUnavailable
    from airflow_lease_provider.core.keeper import LeaseKeeper

    # The task runtime's request timeout (runtime/store.py: api_task_store); one TLS context for all (plain HTTP).
    timeout = min(DEFAULT_TIMEOUT, ttl / 10)
    client = httpx.Client(timeout=timeout.total_seconds(), verify=context)
    store = HttpLeaseStore(url, secret, timeout=timeout, client=client)
    real_send = store._send

    def counted_send(method: str, path: str, credential: str, body: dict[str, Any],
                     timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        started = time.monotonic()
        try:
            code, answer = real_send(method, path, credential, body, timeout)
        except Exception as exc:
            with lock:
                out["no_answer"][path] += 1
                if len(out["errors"]) < 20:
                    out["errors"].append(f"{path}: {type(exc).__name__}: {str(exc)[:160]}")
            raise
        with lock:
            out["answers"][f"{path} {code}"] += 1
            if path == "/renew":
                out["renew_ms"].append((time.monotonic() - started) * 1000)
            elif path == "/acquire":
                out["acquire_ms"].append((time.monotonic() - started) * 1000)
        return code, answer

    store._send = counted_send  # type: ignore[method-assign]
    lost: list[str] = []
    try:
        time.sleep(max(0.0, start_at - time.monotonic()))
        try:
            lease = store.acquire(f"{KEY_PREFIX}{index}", f"api-scale-client-{index}", ttl)
        except LeaseStoreUnavailable:
            with lock:
                out["acquire_failed"] += 1
            return
        if lease is None:
            with lock:
                out["refused"] += 1
            return
        keeper = LeaseKeeper(store, lease, renew_every=renew_every, on_lost=lambda exc: lost.append(exc.reason)).start()
        with lock:
            out["held"] += 1
        time.sleep(max(0.0, end_at - time.monotonic()))
        is_lost = bool(lost) or keeper.lost
        try:
            released = keeper.stop(release=not is_lost)
        except LeaseStoreUnavailable:
            released = False
        with lock:
            out["lost"] += 1 if is_lost else 0
            out["renewals"] += keeper.renewals
            out["late_renewals"] += keeper.late_renewals
            out["released"] += 1 if released else 0
            if lost and len(out["errors"]) < 20:
                out["errors"].append(f"lost {lease.key}: {lost[0][:160]}")
    except Exception:  # noqa: BLE001 - a bench bug is reported, not hidden
        with lock:
            out["errors"].append(traceback.format_exc()[-400:])
    finally:
        store.close()
        client.close()


def _worker(first: int, count: int, url: str, secret: str, ttl_s: float, renew_every_s: float, ramp_s: float,
            hold_s: float, go_wall: float, queue: Any) -> None:
    threading.stack_size(512 * 1024)  # thousands of mostly sleeping threads (a holder, a keeper, a watcher)
    offset = time.monotonic() - time.time()
    out: dict[str, Any] = {"held": 0, "refused": 0, "acquire_failed": 0, "lost": 0, "renewals": 0,
                           "late_renewals": 0, "released": 0, "answers": Counter(), "no_answer": Counter(),
                           "renew_ms": [], "acquire_ms": [], "errors": []}
    lock = threading.Lock()
    context = ssl.create_default_context()
    rng = random.Random(first)
    ttl, every = datetime.timedelta(seconds=ttl_s), datetime.timedelta(seconds=renew_every_s)
    threads = []
    for index in range(first, first + count):
        start_at = go_wall + offset + rng.uniform(0, ramp_s)
        # Each lease is kept ``ramp_s + hold_s`` from its own acquire: all are held at once from the ramp's end to
        # the coordinator's ``end``, and the releases are spread as the acquires were (a thousand tasks do not end in one instant).
        thread = threading.Thread(target=_client, args=(index, url, secret, ttl, every, start_at,
                                                        start_at + ramp_s + hold_s, out, lock, context), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    queue.put(out)


# -- the coordinator -------------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (the api-server and what it forked)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
    except psutil.NoSuchProcess:
        pass
    return total


def _store_reader(dsn: str, schema: str) -> Any:
    import psycopg2

    conn = psycopg2.connect(dsn, connect_timeout=10)
    conn.autocommit = True
    return conn


def _held_by_owner(conn: Any, schema: str) -> tuple[int, list[str]]:
    """How many ``api-scale-<i>`` keys the store shows held now (unexpired, unreleased) by ``api-scale-client-<i>``,
    and up to 10 keys that are not."""
    from psycopg2 import sql

    with conn.cursor() as cur:
        cur.execute(sql.SQL(
            "SELECT key, owner = 'api-scale-client-' || substr(key, {n}) AND released_at IS NULL "
            "AND expires_at > clock_timestamp() FROM {}.lease WHERE key LIKE %s"
        ).format(sql.Identifier(schema), n=sql.Literal(len(KEY_PREFIX) + 1)), (KEY_PREFIX + "%",))
        rows = cur.fetchall()
    return sum(ok for _, ok in rows), [key for key, ok in rows if not ok][:10]


def _backends(conn: Any) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND backend_type = 'client backend'")
        return int(cur.fetchone()[0])


def run_api_scale(url: str, secret: str, store_dsn: str, schema: str, api_server_pid: int, *, leases: int = 1000,
                  ttl_s: float = 30.0, renew_every_s: float = 10.0, ramp_s: float = 20.0, hold_s: float = 60.0,
                  per_process: int = 250, pool_size: int = 8) -> dict[str, Any]:
    """Measure; returns the figures (``verdict`` PASS when every lease was held, none lost, every request
    answered 200, the store showed all held by their owners near the end, and all were released)."""
    processes = max(1, -(-leases // per_process))
    ctx = multiprocessing.get_context("spawn")  # no copy of the bench's threads and connections
    queue = ctx.Queue()
    go = time.time() + 5.0 + 1.5 * processes  # the workers' imports and threads first
    end = go + ramp_s + hold_s  # all are held at once from go + ramp_s to here; each is released ramp_s + hold_s after its acquire
    workers = []
    for p in range(processes):
        first, count = p * per_process, min(per_process, leases - p * per_process)
        worker = ctx.Process(target=_worker, args=(first, count, url, secret, ttl_s, renew_every_s, ramp_s, hold_s,
                                                   go, queue), daemon=True)
        worker.start()
        workers.append(worker)
    reader = _store_reader(store_dsn, schema)
    samples: list[tuple[float, int, int]] = []
    verified: tuple[int, list[str]] | None = None
    try:
        time.sleep(max(0.0, go + ramp_s - time.time()))
        cpu_start, cpu_at = _cpu_seconds(api_server_pid), time.monotonic()
        load_during: list[float] = []
        while time.time() < end - 3.0:
            held, _ = _held_by_owner(reader, schema)
            samples.append((round(time.time() - go, 1), held, _backends(reader)))
            load_during.append(os.getloadavg()[0])
            time.sleep(min(2.0, max(0.0, end - 3.0 - time.time())))
        verified = _held_by_owner(reader, schema)
        cpu_s, window = _cpu_seconds(api_server_pid) - cpu_start, time.monotonic() - cpu_at
        found: list[dict[str, Any]] = []
        for _ in workers:
            found.append(queue.get(timeout=2 * ramp_s + hold_s + 120))
        for worker in workers:
            worker.join(timeout=30)
        left_held, _ = _held_by_owner(reader, schema)
    finally:
        reader.close()
    answers: Counter[str] = sum((f["answers"] for f in found), Counter())
    no_answer: Counter[str] = sum((f["no_answer"] for f in found), Counter())
    renew_ms = [v for f in found for v in f["renew_ms"]]
    acquire_ms = [v for f in found for v in f["acquire_ms"]]
    total = {k: sum(f[k] for f in found) for k in ("held", "refused", "acquire_failed", "lost", "renewals",
                                                  "late_renewals", "released")}
    http_errors = sum(n for answer, n in answers.items() if not answer.endswith(" 200")) + sum(no_answer.values())
    result: dict[str, Any] = {
        "leases": leases, "ttl_s": ttl_s, "renew_every_s": renew_every_s, "ramp_s": ramp_s, "hold_s": hold_s,
        "client_processes": processes, "api_pool_size": pool_size, "api_server_workers": 1, **total,
        "held_at_once_verified": verified[0] if verified else None,
        "not_held_at_verification": verified[1] if verified else None,
        "held_after_release": left_held,
        "http_answers": dict(sorted(answers.items())), "no_answer": dict(no_answer), "http_errors": http_errors,
        "renew_p50_ms": _percentile(renew_ms, 0.5), "renew_p99_ms": _percentile(renew_ms, 0.99),
        "renew_max_ms": max(renew_ms) if renew_ms else None,
        "acquire_p50_ms": _percentile(acquire_ms, 0.5), "acquire_p99_ms": _percentile(acquire_ms, 0.99),
        "renewals_per_s": total["renewals"] / (ramp_s + hold_s),
        "api_server_cpu_s": round(cpu_s, 2), "api_server_cpu_window_s": round(window, 1),
        "api_server_cores": round(cpu_s / window, 3) if window else None,
        "peak_database_backends": max((s[2] for s in samples), default=None),
        "samples_s_held_backends": samples,
        "load_1min_during": {"min": min(load_during), "max": max(load_during)} if load_during else None,
        "errors": [e for f in found for e in f["errors"]][:20],
    }
    result["verdict"] = verdict(result)
    return result


def verdict(result: dict[str, Any]) -> str:
    """PASS when every lease was held at once and kept (none lost, none late past its TTL), every request was
    answered 200, and every lease was released; MISS naming what failed."""
    n = result["leases"]
    failed = [what for what, bad in (
        (f"held {result['held']} of {n}", result["held"] != n),
        (f"{result['lost']} lost", result["lost"] != 0),
        (f"{result['http_errors']} HTTP errors", result["http_errors"] != 0),
        (f"{result['held_at_once_verified']} of {n} held by their owners in the store",
         result["held_at_once_verified"] != n),
        (f"{result['released']} of {n} releases answered ({result.get('held_after_release')} left held in the store)",
         result["released"] != n),
        (f"renewal p99 {result['renew_p99_ms']} ms", (result["renew_p99_ms"] or 0) >= result["ttl_s"] * 1000),
    ) if bad]
    return "PASS" if not failed else "MISS: " + "; ".join(failed)
