"""Failover of the store: a primary and a streaming standby, clients under load, a promotion.

PostgreSQL's own binaries (``initdb``, ``pg_basebackup``, ``pg_ctl promote``) on private ports, data
directories under a temp directory, run as an unprivileged user; :meth:`StandbyPair.stop` removes it all.
The binaries are :func:`tests.pg.server_programs` (the embedded PostgreSQL's unless the tests use the machine's).

A run (:func:`run_failover`): several client threads acquire, publish (fence), renew and release a few
keys through the core API, on one multi-host DSN (``target_session_attrs=read-write``) naming both servers.
Under that load the standby falls behind (its walsender is stopped), the primary dies (``kill -9`` of
the walsender and an immediate shutdown), the standby is promoted, and the clients carry on against it.
What the clients were told is checked with :func:`chaos.checker.check_acknowledged`.

With synchronous replication nothing acknowledged is lost: the commits that the lagging standby has
not confirmed are never acknowledged. With asynchronous replication the grants acknowledged while the
standby lagged are lost; without the token epoch (``epoch=False``: the store as before migration 0006)
the promoted standby issues their tokens again, and the checker reports ``token-reissued``.

Command (the figures in docs/reliability.md)::

    .venv/bin/python -m tests.reliability.failover --replication async [--no-epoch]
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core import FenceStore, LeaseError, LeaseStore
from chaos.checker import Report, check_acknowledged
from demo.deployment import free_port
from tests.pg import server_programs
from tests.reliability.pgbouncer import _unprivileged

PG_BIN = server_programs()
SCHEMA = "airflow_lease"
#: What the clients are promised across an asynchronous failover with the epoch (docs/core.md); a
#: synchronous one also keeps ``overlap`` away.
ASYNC_PROMISES = ("token-reissued", "token-order", "fence-order", "duplicate-publish", "unexpected-error")


def promises(*, synchronous: bool) -> tuple[str, ...]:
    return (*ASYNC_PROMISES, "overlap") if synchronous else ASYNC_PROMISES


def broken(report: Report, *, synchronous: bool) -> dict[str, int]:
    """The violations of what the set-up promises (docs/core.md, "Failover of the store")."""
    kept = promises(synchronous=synchronous)
    return {kind: n for kind, n in report.violation_counts().items() if kind in kept}


def available() -> str | None:
    """Why a pair cannot be run here, or None when it can."""
    for tool in ("initdb", "pg_ctl", "pg_basebackup", "postgres"):
        if not (PG_BIN / tool).exists():
            return f"{PG_BIN / tool} not found (set LEASE_PG_BIN)"
    return None


def _connect(port: int) -> Any:
    conn = psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres", connect_timeout=3)
    conn.autocommit = True
    return conn


def _one(port: int, query: str, params: tuple[Any, ...] = ()) -> Any:
    conn = _connect(port)
    try:
        with conn.cursor() as cur:
            cur.execute(query, params)
            row = cur.fetchone()
            return row[0] if row else None
    finally:
        conn.close()


class StandbyPair:
    """A primary and a streaming standby on 127.0.0.1, synchronous or not."""

    def __init__(self, *, synchronous: bool) -> None:
        self.synchronous = synchronous
        self.user = os.environ.get("USER", "") if os.geteuid() != 0 else _unprivileged()
        self.root = Path(tempfile.mkdtemp(prefix="lease-failover-", dir="/tmp"))
        self.root.chmod(0o755)
        if os.geteuid() == 0:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.primary_port, self.standby_port = free_port(), free_port()
        self.primary, self.standby = self.root / "primary", self.root / "standby"
        self.paused: int | None = None

    @property
    def dsn(self) -> str:
        """Both servers; libpq connects to whichever accepts writes (the primary, then the promoted standby)."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary_port},{self.standby_port} user=postgres dbname=postgres "
            "target_session_attrs=read-write"
        )

    def _pg(self, tool: str, *args: str, timeout: float = 60) -> None:
        kwargs: dict[str, Any] = {"user": self.user} if os.geteuid() == 0 else {}
        subprocess.run(
            [str(PG_BIN / tool), *args], check=True, capture_output=True, timeout=timeout, cwd=self.root, **kwargs
        )

    def _configure(self, data: Path, lines: list[str]) -> None:
        with (data / "postgresql.auto.conf").open("a", encoding="utf-8") as conf:
            conf.write("\n".join(lines) + "\n")

    def start(self) -> None:
        self._pg("initdb", "-D", str(self.primary), "-U", "postgres", "--auth=trust", "-N", "-E", "UTF8")
        self._configure(self.primary, [
            f"port = {self.primary_port}", "listen_addresses = '127.0.0.1'", f"unix_socket_directories = '{self.root}'",
            "wal_level = replica", "max_wal_senders = 4", "max_connections = 40", "shared_buffers = '16MB'",
            "fsync = off", "restart_after_crash = off", "wal_sender_timeout = '60s'",
            "synchronous_commit = on",
            "synchronous_standby_names = '" + ("standby1" if self.synchronous else "") + "'",
        ])
        self._pg("pg_ctl", "-D", str(self.primary), "-l", str(self.root / "primary.log"), "-w", "start")
        self._pg(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary_port), "-U", "postgres",
            "-D", str(self.standby), "-R", "-X", "stream", "--checkpoint=fast",
        )
        # The promoted standby stands alone: it must not wait for a standby of its own (docs/core.md).
        self._configure(self.standby, [
            f"port = {self.standby_port}", "synchronous_standby_names = ''", "hot_standby = on",
            f"primary_conninfo = 'host=127.0.0.1 port={self.primary_port} user=postgres application_name=standby1'",
        ])
        self._pg("pg_ctl", "-D", str(self.standby), "-l", str(self.root / "standby.log"), "-w", "start")
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + 30
        while _one(self.primary_port, "SELECT sync_state FROM pg_stat_replication "
                   "WHERE application_name = 'standby1' AND state = 'streaming'") != wanted:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby never became a streaming {wanted} standby")
            time.sleep(0.1)

    def lag_behind(self) -> None:
        """Stop the primary's walsender: the standby receives nothing more (a slow or cut link)."""
        pid = _one(self.primary_port, "SELECT pid FROM pg_stat_replication WHERE application_name = 'standby1'")
        os.kill(int(pid), signal.SIGSTOP)
        self.paused = int(pid)

    def fail_primary(self) -> None:
        """The primary dies at once: its stopped walsender is killed, the postmaster shuts down immediately."""
        pid = int((self.primary / "postmaster.pid").read_text().split()[0])
        if self.paused is not None:
            os.kill(self.paused, signal.SIGKILL)
        os.kill(pid, signal.SIGQUIT)  # immediate shutdown: every backend exits, nothing more is written
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)

    def promote(self) -> None:
        self._pg("pg_ctl", "-D", str(self.standby), "-w", "promote")

    def stop(self) -> None:
        for data in (self.primary, self.standby):
            if (data / "postmaster.pid").exists():
                try:
                    self._pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop", timeout=30)
                except (subprocess.SubprocessError, OSError):
                    pass
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class Load:
    """Client threads acquiring, publishing, renewing and releasing a few keys; their history."""

    dsn: str
    workers: int = 4
    keys: int = 3
    ttl: timedelta = timedelta(seconds=2)
    records: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _op(self, op: str, t0: float, **fields: Any) -> None:
        with self.lock:
            self.records.append({"type": "op", "op": op, "t0": t0, "t1": time.monotonic(), **fields})

    def run_worker(self, w: int) -> None:
        try:
            self._work(w)
        except Exception as exc:  # anything but the library's own errors: the checker's unexpected-error
            self._op("worker", time.monotonic(), w=w, outcome="error", error=f"{type(exc).__name__}: {exc}")

    def _work(self, w: int) -> None:
        rng = random.Random(w)
        timeout = timedelta(seconds=2)
        leases = LeaseStore(self.dsn, connect_timeout=timeout, statement_timeout=timeout, record_events=False)
        fences = FenceStore(self.dsn, connect_timeout=timeout, statement_timeout=timeout, record_events=False)
        n = 0
        try:
            while not self.stop.is_set():
                n += 1
                key, owner = f"key-{rng.randrange(self.keys)}", f"w{w}-{n}"
                t0 = time.monotonic()
                try:
                    lease = leases.acquire(key, owner, self.ttl)
                except LeaseError as exc:
                    self._op("acquire", t0, w=w, key=key, owner=owner, outcome="unknown", error=type(exc).__name__)
                    time.sleep(0.05)
                    continue
                if lease is None:
                    self._op("acquire", t0, w=w, key=key, owner=owner, outcome="held")
                    time.sleep(0.005)
                    continue
                self._op(
                    "acquire", t0, w=w, key=key, owner=owner, outcome="ok", token=lease.token,
                    acquired_at=lease.acquired_at.isoformat(), expires_at=lease.expires_at.isoformat(),
                    observed_at=lease.observed_at.isoformat(),
                )
                if not self._hold(w, lease, leases, fences):
                    time.sleep(0.05)
        finally:
            leases.close()
            fences.close()

    def _hold(self, w: int, lease: Any, leases: LeaseStore, fences: FenceStore) -> bool:
        """Publish, renew, release; gives the lease up at the first store error (the caller fails closed)."""
        common = {"w": w, "key": lease.key, "owner": lease.owner, "token": lease.token}
        t0 = time.monotonic()
        try:
            decision = fences.advance(f"target-{lease.key}", lease.token, key=lease.key, owner=lease.owner)
        except LeaseError as exc:
            self._op("publish", t0, resource=f"target-{lease.key}", outcome="unknown", error=type(exc).__name__, **common)
            return False
        self._op(
            "publish", t0, resource=f"target-{lease.key}", outcome=decision.outcome, current=decision.current_token,
            **common,
        )
        t0 = time.monotonic()
        try:
            renewed = leases.renew(lease)
        except LeaseError as exc:
            self._op("renew", t0, outcome="unknown", error=type(exc).__name__, **common)
            return False
        if renewed is None:
            self._op("renew", t0, outcome="refused", **common)
            return True
        self._op(
            "renew", t0, outcome="ok", expires_at=renewed.expires_at.isoformat(),
            observed_at=renewed.observed_at.isoformat(), **common,
        )
        t0 = time.monotonic()
        try:
            released = leases.release(renewed)
        except LeaseError as exc:
            self._op("release", t0, outcome="unknown", error=type(exc).__name__, **common)
            return False
        self._op("release", t0, outcome="ok" if released else "refused", **common)
        return True


def _without_epoch(dsn: str) -> None:
    """The broken variant: the store as before migration 0006, tokens counted on from whatever rows the
    server has (the epoch's floor is always 0)."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL(
                "CREATE OR REPLACE FUNCTION {}.lease_token_floor() RETURNS bigint LANGUAGE sql AS $$ SELECT 0::bigint $$"
            ).format(sql.Identifier(SCHEMA)))
    finally:
        conn.close()


@dataclass
class FailoverRun:
    report: Report
    figures: dict[str, Any]
    records: list[dict[str, Any]]


def run_failover(
    *, synchronous: bool, epoch: bool = True, before: float = 2.0, lag: float = 1.5, after: float = 3.0,
    workers: int = 4, keys: int = 3,
) -> FailoverRun:
    """One run: load on the primary for ``before`` s, the standby lagging for ``lag`` s, the primary dies,
    the standby is promoted, load on it for ``after`` s. Returns the checker's report and the figures."""
    pair = StandbyPair(synchronous=synchronous)
    load = Load(pair.dsn, workers=workers, keys=keys)
    threads: list[threading.Thread] = []
    figures: dict[str, Any] = {"replication": "sync" if synchronous else "async", "epoch": epoch}
    try:
        pair.start()
        with LeaseStore(pair.dsn) as store:
            store.ensure_schema()
            figures["epoch_before"] = store.token_epoch().epoch
        if not epoch:
            _without_epoch(pair.dsn)
        threads = [threading.Thread(target=load.run_worker, args=(w,), daemon=True) for w in range(workers)]
        for thread in threads:
            thread.start()
        time.sleep(before)
        pair.lag_behind()
        lag_at = time.monotonic()
        time.sleep(lag)
        pair.fail_primary()
        failed_at = time.monotonic()
        pair.promote()
        promoted_at = time.monotonic()
        time.sleep(after)
        load.stop.set()
        for thread in threads:
            thread.join(30)
        with LeaseStore(pair.dsn) as store:
            figures["epoch_after"] = store.token_epoch().epoch
        acks = [r for r in load.records if r["op"] == "acquire" and r["outcome"] == "ok"]
        first_after = min((r["t1"] for r in acks if r["t0"] > promoted_at), default=None)
        figures.update({
            # Requested after the standby stopped receiving (plus 50 ms for the signal): with synchronous
            # replication none can be acknowledged; a call answered then but sent before may be.
            "acquired_while_lagging": sum(1 for r in acks if lag_at + 0.05 <= r["t0"] and r["t1"] < failed_at),
            "acquired_after_promotion": sum(1 for r in acks if r["t0"] > promoted_at),
            "promotion_s": round(promoted_at - failed_at, 3),
            "first_grant_after_failure_s": round(first_after - failed_at, 3) if first_after else None,
        })
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(30)
        pair.stop()
    records = [{"type": "meta", "ttl": load.ttl.total_seconds(), "profile": "failover"}, *load.records]
    return FailoverRun(check_acknowledged(records), figures, records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replication", choices=("sync", "async"), default="async")
    parser.add_argument("--no-epoch", action="store_true", help="the broken variant: no token epoch")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--after", type=float, default=3.0)
    args = parser.parse_args(argv)
    problem = available()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    result = run_failover(
        synchronous=args.replication == "sync", epoch=not args.no_epoch, workers=args.workers, after=args.after
    )
    print(json.dumps(result.figures))
    print(result.report.format())
    violated = broken(result.report, synchronous=args.replication == "sync")
    print(f"promised with {args.replication} replication: {', '.join(promises(synchronous=args.replication == 'sync'))}")
    print("PROMISES: " + (f"BROKEN {violated}" if violated else "KEPT"))
    return 1 if violated else 0


if __name__ == "__main__":
    raise SystemExit(main())
