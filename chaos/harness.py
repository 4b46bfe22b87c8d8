"""One run: private server, workers, faults, the final crash, the probe, the ground-truth dump."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg2

from airflow_lease_provider.core import FenceStore, LeaseError, LeaseStore, StaleFencingToken
from chaos import history
from chaos import sql as chaos_sql
from chaos.api import ApiConfig, ApiServer, free_port
from chaos.history import Recorder
from chaos.nemesis import Nemesis, kill_all
from chaos.profiles import SKEWS, Profile
from chaos.server import PrivateServer, connect, db_time
from chaos.worker import WorkerConfig, key_of, resource_of, slot_key_of, slot_resource_of

log = logging.getLogger("chaos")

REPO = Path(__file__).resolve().parent.parent
LIBFAKETIME = next(
    (p for pattern in ("*/faketime/libfaketime.so.1", "faketime/libfaketime.so.1") for p in Path("/usr/lib").glob(pattern)),
    None,
)


def worker_env(skew: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("LD_PRELOAD", "FAKETIME", "DONT_FAKE_MONOTONIC"):
        env.pop(name, None)
    if skew is not None:
        # The monotonic clock stays real: the keeper measures time left with it, and the history's
        # t0/t1 must be comparable across processes.
        env.update({"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": skew, "DONT_FAKE_MONOTONIC": "1"})
    return env


def http_ids(profile: Profile) -> list[int]:
    """The HTTP workers: the last ``http_workers`` (the skewed clocks are the first ones')."""
    return list(range(max(0, profile.workers - profile.http_workers), profile.workers))


def _spawn(
    profile: Profile, variant: str, dsn: str, work: Path, seed: int, started: float, api_url: str | None = None
) -> dict[int, subprocess.Popen[bytes]]:
    (work / "logs").mkdir(exist_ok=True)
    workers = {}
    for wid in range(profile.workers):
        skew = SKEWS[wid % len(SKEWS)] if wid < profile.skewed and LIBFAKETIME is not None else None
        cfg = WorkerConfig(
            id=wid, dsn=dsn, history=str(work / f"w{wid}.jsonl"), seed=seed * 1000 + wid, keys=profile.keys,
            ttl=profile.ttl, statement_timeout=profile.statement_timeout, connect_timeout=profile.connect_timeout,
            variant=variant, skew=skew, long_fraction=profile.long_fraction,
            keeper_fraction=profile.keeper_fraction, check_fraction=profile.check_fraction,
            idempotent_fraction=profile.idempotent_fraction, delay_fraction=profile.delay_fraction,
            join_fraction=profile.join_fraction, slot_keys=profile.slot_keys,
            slot_fraction=profile.slot_fraction, slot_counts=profile.slot_counts, count_phase=profile.count_phase,
            stray_count_fraction=profile.stray_count_fraction, single_fraction=profile.single_fraction,
            replace_fraction=profile.replace_fraction,
            wait_fraction=profile.http_wait_fraction if wid in http_ids(profile) else profile.wait_fraction,
            wait_rounds=profile.wait_rounds, lapse_fraction=profile.lapse_fraction,
            forged_fraction=profile.forged_fraction, reclaim_fraction=profile.reclaim_fraction, started=started,
            api_url=api_url if wid in http_ids(profile) else None, api_timeout=profile.api_timeout,
        )
        logfile = (work / "logs" / f"w{wid}.log").open("wb")
        workers[wid] = subprocess.Popen(
            [sys.executable, "-m", "chaos.worker", cfg.to_json()],
            cwd=REPO, env=worker_env(skew), stdout=logfile, stderr=subprocess.STDOUT,
        )
        logfile.close()
    return workers


def _wait_started(work: Path, workers: dict[int, subprocess.Popen[bytes]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for wid, proc in workers.items():
        path = work / f"w{wid}.jsonl"
        while not (path.exists() and path.stat().st_size > 0):
            if proc.poll() is not None:
                raise RuntimeError(f"worker {wid} exited with {proc.returncode}: see {work / 'logs'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {wid} did not start within {timeout:.0f}s")
            time.sleep(0.05)


def _setup(dsn: str) -> None:
    for store in (LeaseStore(dsn, schema=chaos_sql.LEASE_SCHEMA), FenceStore(dsn, schema=chaos_sql.LEASE_SCHEMA)):
        store.ensure_schema()
        store.close()
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(chaos_sql.ddl())
    finally:
        conn.close()


def _probe(dsn: str, profile: Profile, rec: Recorder) -> None:
    """After every worker crashed at once: how long until a fresh client holds each key, and publishes."""
    ttl = timedelta(seconds=profile.ttl)
    store = LeaseStore(dsn, schema=chaos_sql.LEASE_SCHEMA, record_events=False)
    fences = FenceStore(dsn, schema=chaos_sql.LEASE_SCHEMA, record_events=False)
    pending = set(range(profile.keys))
    deadline = time.monotonic() + 3 * profile.ttl + 10
    nap = threading.Event()
    while pending and time.monotonic() < deadline:
        for index in sorted(pending):
            try:
                lease = store.acquire(key_of(index), owner=f"probe-{index}", ttl=ttl)
            except LeaseError:
                continue
            if lease is None:
                continue
            pending.discard(index)
            try:
                fences.guard(resource_of(index), lease.token, key=lease.key, owner=lease.owner)
                published = "accepted"
            except StaleFencingToken as exc:
                published = f"rejected: {exc}"
            except LeaseError as exc:
                published = f"unknown: {exc}"
            rec.write({
                "type": "probe", "t": time.monotonic(), "key": lease.key, "token": lease.token,
                "acquired_at": lease.acquired_at, "publish": published,
            })
        nap.wait(0.05)
    for index in pending:
        rec.write({"type": "probe", "t": time.monotonic(), "key": key_of(index), "token": None, "acquired_at": None})
    store.close()
    fences.close()


def _probe_waiters(dsn: str, rec: Recorder) -> None:
    """After every worker crashed at once: the live waiting places, as a fresh client lists them
    (``LeaseStore.waiters``), between two readings of the database clock."""
    store = LeaseStore(dsn, schema=chaos_sql.LEASE_SCHEMA, record_events=False)
    try:
        before = db_time(dsn)
        listed = store.waiters()
        after = db_time(dsn)
    except LeaseError as exc:
        rec.write({"type": "probe_waiters", "t": time.monotonic(), "error": str(exc)})
        return
    finally:
        store.close()
    rec.write({
        "type": "probe_waiters", "t": time.monotonic(), "db_before": before, "db_after": after,
        "waiters": [(w.key, w.owner, w.since, w.expires_at) for w in listed],
    })


def _dump(dsn: str) -> list[dict[str, Any]]:
    conn = connect(dsn)
    out: list[dict[str, Any]] = []
    try:
        with conn.cursor() as cur:
            for kind, query in chaos_sql.dump_queries().items():
                cur.execute(query)
                columns = [c.name for c in cur.description]
                out.extend({"type": kind, **dict(zip(columns, row, strict=True))} for row in cur.fetchall())
    finally:
        conn.close()
    return out


def run(profile: Profile, variant: str, out: Path, seed: int, say: Any = print) -> Path:
    """Run the harness; returns the path of the merged history (``out/history.jsonl``)."""
    out.mkdir(parents=True, exist_ok=True)
    work = out / "parts"
    work.mkdir(exist_ok=True)
    for stale in [*work.glob("*.jsonl"), out / "history.jsonl"]:
        stale.unlink(missing_ok=True)
    rng = random.Random(seed)
    server = PrivateServer()
    workers: dict[int, subprocess.Popen[bytes]] = {}
    rec: Recorder | None = None
    api_server: ApiServer | None = None
    try:
        say(f"chaos: starting a private PostgreSQL in {server.root}")
        # Two store connections per worker (three for a broken variant), the API server's pool, plus the
        # harness's own.
        dsn = server.start(max_connections=3 * profile.workers + 40)
        _setup(dsn)
        if profile.http_workers:
            api_server = ApiServer(ApiConfig(
                dsn=dsn, schema=chaos_sql.LEASE_SCHEMA, port=free_port(), history="", lossy=str(work / "lossy"),
                seed=seed, statement_timeout=profile.statement_timeout, connect_timeout=profile.connect_timeout,
                hold=profile.api_timeout + 1.0,
            ), work, worker_env(None))
            api_server.start()
            say(f"chaos: lease API server up at {api_server.url}")
        rec = Recorder(work / "harness.jsonl")
        started = time.monotonic()
        rec.write({
            "type": "meta", "t": started, "profile": asdict(profile), "variant": variant, "seed": seed,
            "ttl": profile.ttl, "keys": [key_of(i) for i in range(profile.keys)],
            "slot_keys": [slot_key_of(i) for i in range(profile.slot_keys)],
            "resources": {
                **{
                    resource_of(i): [key_of(j) for j in range(profile.keys) if resource_of(j) == resource_of(i)]
                    for i in range(profile.keys)
                },
                **{slot_resource_of(i): [slot_key_of(i)] for i in range(profile.slot_keys)},
            },
            "faketime": str(LIBFAKETIME) if LIBFAKETIME else None, "db_time": db_time(dsn),
            "http_workers": http_ids(profile),
        })
        workers = _spawn(profile, variant, dsn, work, seed, started, api_server.url if api_server else None)
        _wait_started(work, workers)
        for wid in range(min(profile.skewed, profile.workers)):
            if LIBFAKETIME is not None:
                rec.fault("clock_skew", w=wid, offset=SKEWS[wid % len(SKEWS)])
        say(f"chaos: {profile.workers} workers up ({min(profile.skewed, profile.workers)} with a skewed clock, "
            f"{profile.http_workers} through the lease API); faults for {profile.duration:.0f}s")
        nemesis = Nemesis(profile, server, workers, rec, rng, api_server)
        nemesis.run(profile.duration)
        nemesis.heal()
        rec.write({"type": "heal", "t": time.monotonic(), "db_time": db_time(dsn)})
        say(f"chaos: faults stopped; settling {profile.settle:.0f}s, then every worker crashes at once")
        threading.Event().wait(profile.settle)
        for wid, proc in workers.items():
            if proc.poll() is not None:  # a worker that died by itself hit something the core let through
                rec.write({"type": "worker_exit", "t": time.monotonic(), "w": wid, "code": proc.returncode,
                           "log": str(work / "logs" / f"w{wid}.log")})
        kill_all(workers)
        if api_server is not None:
            api_server.stop()
        rec.write({"type": "crash_all", "t": time.monotonic(), "db_time": db_time(dsn)})
        _probe_waiters(dsn, rec)
        _probe(dsn, profile, rec)
        tail = _dump(dsn)
        rec.close()
        target = out / "history.jsonl"
        count = history.merge(sorted(work.glob("*.jsonl")), target, tail)
        say(f"chaos: {count} records in {target}")
        return target
    finally:
        kill_all(workers)
        if api_server is not None:
            api_server.stop()
        try:
            server.stop()
        except (OSError, psycopg2.Error, RuntimeError) as exc:
            log.warning("could not stop the private server: %s", exc)
