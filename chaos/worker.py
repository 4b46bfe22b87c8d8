"""One worker process: acquire, work, publish through the fence, release; forever, recording everything.

Started by the harness as ``python -m chaos.worker CONFIG_JSON``, some under libfaketime with their clock
10 minutes off. It never sleeps with ``time.sleep`` (it raises EINVAL under libfaketime on Python 3.11):
every pause is ``threading.Event().wait``. It runs until the harness kills it.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2

from airflow_lease_provider.core import (
    DuplicatePublish,
    FenceStore,
    Lease,
    LeaseError,
    LeaseKeeper,
    LeaseLost,
    LeaseStore,
    LeaseStoreUnavailable,
    StaleFencingToken,
)
from chaos import sql as chaos_sql
from chaos.history import Recorder
from chaos.stores import (
    ClientClockLeaseStore,
    NoFenceStore,
    RecordingLeaseStore,
    commit_asynchronously,
    lease_fields,
    outcome_of,
)


@dataclass(frozen=True)
class WorkerConfig:
    id: int
    dsn: str
    history: str
    seed: int
    keys: int
    ttl: float
    statement_timeout: float
    connect_timeout: float
    variant: str = "correct"
    skew: str | None = None
    long_fraction: float = 0.15
    keeper_fraction: float = 0.7
    check_fraction: float = 0.5
    idempotent_fraction: float = 0.5
    lease_schema: str = chaos_sql.LEASE_SCHEMA
    chaos_schema: str = chaos_sql.CHAOS_SCHEMA

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        return cls(**json.loads(text))


def key_of(index: int) -> str:
    return f"job-{index}"


def resource_of(index: int) -> str:
    return f"target-{index}"


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.rec = Recorder(Path(cfg.history), w=cfg.id)
        self.rng = random.Random(cfg.seed)
        self.ttl = timedelta(seconds=cfg.ttl)
        self.nap = threading.Event()  # never set: its wait() is the sleep that works under libfaketime
        timeouts: dict[str, Any] = {
            "schema": cfg.lease_schema,
            "connect_timeout": timedelta(seconds=cfg.connect_timeout),
            "statement_timeout": timedelta(seconds=cfg.statement_timeout),
        }
        lease_cls = ClientClockLeaseStore if cfg.variant == "client-clock" else RecordingLeaseStore
        self.leases: LeaseStore = lease_cls(cfg.dsn, recorder=self.rec, **timeouts)
        fence_cls = NoFenceStore if cfg.variant == "fence-off" else FenceStore
        self.fences: FenceStore = fence_cls(cfg.dsn, **timeouts)
        if cfg.variant == "async-commit":
            commit_asynchronously(self.leases.db)
            commit_asynchronously(self.fences.db)
        self.insert = chaos_sql.insert_target(cfg.chaos_schema)

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        self.rec.write({
            "type": "worker_start", "t": time.monotonic(), "pid": os.getpid(), "skew": self.cfg.skew,
            "variant": self.cfg.variant, "client_minus_db_s": self._skew_seen(),
        })
        iteration = 0
        while True:
            iteration += 1
            index = self.rng.randrange(self.cfg.keys)
            owner = f"w{self.cfg.id}-{iteration}"
            lease, backoff = self.acquire(key_of(index), owner)
            if lease is None:
                self.nap.wait(backoff)
                continue
            self.hold(lease, resource_of(index))

    def _skew_seen(self) -> float | None:
        """This process's clock minus the database's: proof that libfaketime really moved it."""
        try:
            conn = psycopg2.connect(self.cfg.dsn, connect_timeout=max(2, round(self.cfg.connect_timeout)))
        except psycopg2.Error:
            return None
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT clock_timestamp()")
                db_now = cur.fetchone()[0]
            return round((datetime.now(timezone.utc) - db_now).total_seconds(), 3)
        except psycopg2.Error:
            return None
        finally:
            conn.close()

    # -- operations --------------------------------------------------------------------------------

    def acquire(self, key: str, owner: str) -> tuple[Lease | None, float]:
        """The lease or None, and how long to back off when None."""
        t0 = time.monotonic()
        try:
            got = self.leases.try_acquire(key, owner, self.ttl)
        except LeaseError as exc:
            self.rec.op("acquire", t0=t0, key=key, owner=owner, outcome=outcome_of(exc), error=str(exc))
            return None, self.rng.uniform(0.2, 0.5)
        except Exception as exc:  # an exception the core should have translated: recorded, checked
            self.rec.op("acquire", t0=t0, key=key, owner=owner, outcome="error", error=repr(exc))
            return None, self.rng.uniform(0.2, 0.5)
        if got.lease is not None:
            self.rec.op("acquire", t0=t0, outcome="ok", ttl=self.cfg.ttl, **lease_fields(got.lease))
            return got.lease, 0.0
        holder = got.holder
        self.rec.op(
            "acquire", t0=t0, key=key, owner=owner, outcome="held",
            holder_owner=holder.owner if holder else None, holder_token=holder.token if holder else None,
            holder_expires_at=holder.expires_at if holder else None,
            observed_at=holder.observed_at if holder else None,
        )
        return None, self.rng.uniform(0.02, 0.1)

    def hold(self, lease: Lease, resource: str) -> None:
        rng = self.rng
        late = rng.random() < self.cfg.long_fraction
        work = self.cfg.ttl * (rng.uniform(1.2, 2.0) if late else rng.uniform(0.02, 0.3))
        keeper: LeaseKeeper | None = self.leases.keep(lease) if rng.random() < self.cfg.keeper_fraction else None
        checks = keeper is not None and rng.random() < self.cfg.check_fraction
        self.nap.wait(work)
        shape = {"late": late, "keeper": keeper is not None, "checked": checks}
        if keeper is not None and checks:
            t0 = time.monotonic()
            try:
                keeper.check()
            except LeaseLost as exc:
                self.rec.op(
                    "lost", t0=t0, outcome="reported", key=lease.key, owner=lease.owner, token=lease.token,
                    reason=exc.reason,
                )
                keeper.stop()
                return
        self.publish(lease, resource, shape)
        t0 = time.monotonic()
        try:
            if keeper is not None:
                if keeper.lost:
                    self.rec.op(
                        "lost", t0=t0, outcome="reported", key=lease.key, owner=lease.owner,
                        token=lease.token, reason=keeper.lost_reason,
                    )
                keeper.stop(release=True)  # releases through the recording store unless lost
            else:
                self.leases.release(lease)
        except LeaseError:
            pass  # already recorded by the store

    def publish(self, lease: Lease, resource: str, shape: dict[str, bool]) -> None:
        idem = f"{lease.owner}/publish" if self.rng.random() < self.cfg.idempotent_fraction else None
        for attempt in (1, 2):
            t0 = time.monotonic()
            fields: dict[str, Any] = {
                "key": lease.key, "owner": lease.owner, "token": lease.token, "resource": resource,
                "idem": idem, "attempt": attempt, **shape,
            }
            try:
                with self.fences.transaction(
                    resource, lease.token, key=lease.key, owner=lease.owner, idempotency_key=idem
                ) as cur:
                    cur.execute(self.insert, {
                        "resource": resource, "token": lease.token, "owner": lease.owner,
                        "worker": self.cfg.id, "idem": idem,
                    })
                    at = cur.fetchone()[0]
            except DuplicatePublish as exc:
                self.rec.op("publish", t0=t0, outcome="duplicate", current=exc.current, **fields)
            except StaleFencingToken as exc:
                self.rec.op("publish", t0=t0, outcome="stale", current=exc.current, **fields)
            except LeaseStoreUnavailable as exc:
                self.rec.op("publish", t0=t0, outcome="unknown", error=str(exc), **fields)
                if attempt == 1:
                    # The commit may or may not have happened. Resending is safe either way: the fence
                    # refuses the same token twice (and the idempotency key, when there is one, makes
                    # it a duplicate); the checker verifies that no token or key was published twice.
                    self.nap.wait(self.rng.uniform(0.05, 0.2))
                    continue
            except Exception as exc:  # recorded and reported by the checker
                self.rec.op("publish", t0=t0, outcome="error", error=repr(exc), **fields)
            else:
                self.rec.op("publish", t0=t0, outcome="accepted", at=at, **fields)
            return


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL us if the harness dies first, so no worker outlives a killed run."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    _die_with_parent()
    Worker(WorkerConfig.from_json(argv[1])).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
