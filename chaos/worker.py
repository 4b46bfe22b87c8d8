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
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2

from airflow_lease_provider.core import (
    Acquisition,
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
from airflow_lease_provider.core.lease import SlotCountMismatch
from chaos import api
from chaos import sql as chaos_sql
from chaos.history import Recorder
from chaos.profiles import Profile
from chaos.stores import (
    ClientClockLeaseStore,
    CrossKeyFenceStore,
    FromConstructionKeeper,
    NoFenceStore,
    RecordingHttpLeaseStore,
    RecordingLeaseStore,
    ReplaceIgnoresSlotsLeaseStore,
    WaitIgnoresMaxLeaseStore,
    _OwnConnection,
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
    delay_fraction: float = 0.0
    join_fraction: float = 0.0
    # The semaphore keys' mix: the profile's fields (chaos/profiles.py, their one home), passed on by the
    # harness; the defaults are the profile's.
    slot_keys: int = Profile.slot_keys
    slot_fraction: float = Profile.slot_fraction
    slot_counts: tuple[int, ...] = Profile.slot_counts
    count_phase: float = Profile.count_phase
    stray_count_fraction: float = Profile.stray_count_fraction
    single_fraction: float = Profile.single_fraction
    replace_fraction: float = Profile.replace_fraction
    wait_fraction: float = Profile.wait_fraction
    wait_rounds: int = Profile.wait_rounds
    lapse_fraction: float = Profile.lapse_fraction
    forged_fraction: float = Profile.forged_fraction
    reclaim_fraction: float = Profile.reclaim_fraction
    #: The harness's monotonic clock when the workers were started (the same clock in every process, never
    #: faked): the slot-count phases and the replaces' run order count from it.
    started: float = 0.0
    lease_schema: str = chaos_sql.LEASE_SCHEMA
    chaos_schema: str = chaos_sql.CHAOS_SCHEMA
    #: An HTTP worker: the lease API's base URL (chaos.api), through which it takes, renews, releases and
    #: publishes (``HttpLeaseStore``, the fence through ``/fence``), and how long one request may take.
    api_url: str | None = None
    api_timeout: float = 1.5

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        data = json.loads(text)
        data["slot_counts"] = tuple(data.get("slot_counts", (2, 3, 1)))
        return cls(**data)


def key_of(index: int) -> str:
    return f"job-{index}"


def resource_of(index: int) -> str:
    """Two lease keys publish to each resource (job-0 and job-1 to target-0, ...): a fence is per
    (resource, lease key), so each key's holders must be accepted whatever the other key's tokens are."""
    return f"target-{index // 2}"


def max_waiting_of(key: str) -> int:
    """A key's ``max_waiting``, the same in every worker (so that the checker can hold each key to it):
    1 for ``job-0``, 2 for ``job-1``, 1 for ``job-2``, ... (the workers wait on ``job-N`` keys only)."""
    return 1 + int(key.rsplit("-", 1)[1]) % 2


def slot_key_of(index: int) -> str:
    """A semaphore key: acquired with N slots (N changing), with one holder, or replaced."""
    return f"pool-{index}"


def slot_resource_of(index: int) -> str:
    return f"pool-target-{index}"


#: The replaces' run order: this instant plus the harness's monotonic seconds (so the same in every
#: process, whatever its wall clock says).
RUN_BASE = datetime(2026, 1, 1, tzinfo=timezone.utc)


def count_of_phase(cfg: WorkerConfig, at: float) -> tuple[int, int]:
    """The slot-count phase at monotonic time ``at``, and its count."""
    phase = int(max(0.0, at - cfg.started) // cfg.count_phase)
    return phase, cfg.slot_counts[phase % len(cfg.slot_counts)]


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.rec = Recorder(Path(cfg.history), w=cfg.id, **({"http": True} if cfg.api_url else {}))
        self.rng = random.Random(cfg.seed)
        self.ttl = timedelta(seconds=cfg.ttl)
        self.held = False  # whether the last acquire was refused because the key is held
        self.nap = threading.Event()  # never set: its wait() is the sleep that works under libfaketime
        timeouts: dict[str, Any] = {
            "schema": cfg.lease_schema,
            "connect_timeout": timedelta(seconds=cfg.connect_timeout),
            "statement_timeout": timedelta(seconds=cfg.statement_timeout),
        }
        lease_cls = {
            "client-clock": ClientClockLeaseStore, "replace-ignores-slots": ReplaceIgnoresSlotsLeaseStore,
            "wait-ignores-max": WaitIgnoresMaxLeaseStore,
        }.get(cfg.variant, RecordingLeaseStore)
        self.http: RecordingHttpLeaseStore | None = None
        if cfg.api_url is not None:
            # The HTTP path: the worker never reaches the store; the API server does (its store is the real
            # one whatever the variant: the broken variants are of the direct path).
            self.http = RecordingHttpLeaseStore(cfg.api_url, api.SECRET, recorder=self.rec,
                                                timeout=timedelta(seconds=cfg.api_timeout))
            self.leases: LeaseStore = self.http  # type: ignore[assignment]
        else:
            self.leases = lease_cls(cfg.dsn, recorder=self.rec, **timeouts)
        fence_cls = {"fence-off": NoFenceStore, "fence-cross-key": CrossKeyFenceStore}.get(cfg.variant, FenceStore)
        self.fences: FenceStore = fence_cls(cfg.dsn, **timeouts)
        self.keeper_cls = FromConstructionKeeper if cfg.variant == "keeper-from-construction" else LeaseKeeper
        # The database clock, read just before a keeper check (a connection of its own).
        self.clock = _OwnConnection(cfg.dsn, cfg.connect_timeout, cfg.statement_timeout)
        if cfg.variant == "async-commit":
            commit_asynchronously(self.leases.db)
            commit_asynchronously(self.fences.db)
        self.insert = chaos_sql.insert_target(cfg.chaos_schema)

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        self.rec.write({
            "type": "worker_start", "t": time.monotonic(), "pid": os.getpid(), "skew": self.cfg.skew,
            "variant": self.cfg.variant, "client_minus_db_s": self._skew_seen(), "http": self.http is not None,
        })
        iteration = 0
        while True:
            iteration += 1
            owner = f"w{self.cfg.id}-{iteration}"
            if self.cfg.slot_keys and self.rng.random() < self.cfg.slot_fraction:
                index = self.rng.randrange(self.cfg.slot_keys)
                lease, backoff = self.acquire_pool(slot_key_of(index), owner)
                resource, in_store = slot_resource_of(index), True
            else:
                index = self.rng.randrange(self.cfg.keys)
                self.held = False
                lease, backoff = self.acquire(key_of(index), owner)
                resource, in_store = resource_of(index), False
                if lease is None and self.held and self.rng.random() < self.cfg.wait_fraction:
                    self.wait_place(key_of(index), owner)
                    continue
            if lease is None:
                self.nap.wait(backoff)
                continue
            self.hold(lease, resource, in_store=in_store)

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

    def acquire(self, key: str, owner: str, slots: int = 1, **shape: Any) -> tuple[Lease | None, float]:
        """The lease (``slots`` > 1: a semaphore's slot) or None, and how long to back off when None."""
        t0 = time.monotonic()
        try:
            got = self.leases.try_acquire(key, owner, self.ttl, slots=slots)
        except SlotCountMismatch as exc:  # documented: the key is held with another count
            self.rec.op("acquire", t0=t0, key=key, owner=owner, asked=slots, outcome="mismatch",
                        held=[(h.key, h.token, h.slots) for h in exc.holders], **shape)
            return None, self.rng.uniform(0.02, 0.1)
        except LeaseLost as exc:  # the lease API: granted, then lost before it could answer
            self.rec.op("acquire", t0=t0, key=key, owner=owner, asked=slots, outcome="lost", token=exc.token,
                        error=str(exc), **shape)
            return None, self.rng.uniform(0.02, 0.1)
        except LeaseError as exc:
            self.rec.op("acquire", t0=t0, key=key, owner=owner, asked=slots, outcome=outcome_of(exc),
                        error=str(exc), **shape)
            return None, self.rng.uniform(0.2, 0.5)
        except Exception as exc:  # an exception the core should have translated: recorded, checked
            self.rec.op("acquire", t0=t0, key=key, owner=owner, asked=slots, outcome="error", error=repr(exc),
                        **shape)
            return None, self.rng.uniform(0.2, 0.5)
        return self._answer("acquire", t0, key, owner, got, asked=slots, **shape)

    def _answer(self, op: str, t0: float, key: str, owner: str, got: Acquisition, **shape: Any) -> tuple[Lease | None, float]:
        if got.lease is not None:
            replaced = {}
            if got.replaced is not None:
                replaced = {"replaced_owner": got.replaced.owner, "replaced_token": got.replaced.token}
            self.rec.op(op, t0=t0, outcome="ok", ttl=self.cfg.ttl, lease_key=key, **replaced, **shape,
                        **lease_fields(got.lease))
            return got.lease, 0.0
        holder = got.holder
        self.held = True
        self.rec.op(
            op, t0=t0, key=key, owner=owner, outcome="held",
            holder_owner=holder.owner if holder else None, holder_token=holder.token if holder else None,
            holder_expires_at=holder.expires_at if holder else None,
            observed_at=holder.observed_at if holder else None, **shape,
        )
        return None, self.rng.uniform(0.02, 0.1)

    def acquire_pool(self, key: str, owner: str) -> tuple[Lease | None, float]:
        """A semaphore key: its phase's slot count, an older count, one holder, or a replace."""
        cfg, rng = self.cfg, self.rng
        phase, count = count_of_phase(cfg, time.monotonic())
        roll = rng.random()
        if roll < cfg.replace_fraction:
            return self.replace(key, owner, phase=phase)
        roll -= cfg.replace_fraction
        if roll < cfg.single_fraction:
            return self.acquire(key, owner, 1, phase=phase, how="single")
        if roll < cfg.single_fraction + cfg.stray_count_fraction:
            stray = cfg.slot_counts[(phase - 1) % len(cfg.slot_counts)]
            return self.acquire(key, owner, stray, phase=phase, how="stray")
        return self.acquire(key, owner, count, phase=phase, how="phase")

    def replace(self, key: str, owner: str, **shape: Any) -> tuple[Lease | None, float]:
        """``try_replace``: the run order mostly grows with time (a later run takes an older one's lease
        over), but may lag up to two TTLs behind (an older run that starts late, and must not)."""
        behind = self.rng.uniform(0.0, 2 * self.cfg.ttl)
        run_after = RUN_BASE + timedelta(seconds=max(0.0, time.monotonic() - self.cfg.started - behind))
        t0 = time.monotonic()
        fields: dict[str, Any] = {"run_after": run_after, "asked": 1, "how": "replace", **shape}
        try:
            got = self.leases.try_replace(key, owner, self.ttl, run_after=run_after)
        except SlotCountMismatch as exc:
            self.rec.op("replace", t0=t0, key=key, owner=owner, outcome="mismatch",
                        held=[(h.key, h.token, h.slots) for h in exc.holders], **fields)
            return None, self.rng.uniform(0.02, 0.1)
        except LeaseLost as exc:
            self.rec.op("replace", t0=t0, key=key, owner=owner, outcome="lost", token=exc.token, error=str(exc),
                        **fields)
            return None, self.rng.uniform(0.02, 0.1)
        except LeaseError as exc:
            self.rec.op("replace", t0=t0, key=key, owner=owner, outcome=outcome_of(exc), error=str(exc), **fields)
            return None, self.rng.uniform(0.2, 0.5)
        except Exception as exc:
            self.rec.op("replace", t0=t0, key=key, owner=owner, outcome="error", error=repr(exc), **fields)
            return None, self.rng.uniform(0.2, 0.5)
        return self._answer("replace", t0, key, owner, got, **fields)

    # -- waiting places ----------------------------------------------------------------------------

    def wait_place(self, key: str, owner: str) -> None:
        """Take a waiting place on ``key`` (held by another), keep it while polling, then give it back or let
        it lapse; over HTTP sometimes first give it back with a forged capability (refused, nothing changes:
        the place is claimed once more at once), and sometimes claim again with another place id after the
        give-back (a new place). Every call is recorded (``wait_claim``, ``wait_release``)."""
        rng, cfg = self.rng, self.cfg
        limit = max_waiting_of(key)
        place = self.http.new_place_id(owner) if self.http is not None else None
        maybe_placed = False
        for _ in range(rng.randint(1, cfg.wait_rounds)):
            outcome = self.wait_claim(key, owner, limit, place=place)
            if outcome in ("full", "other", "error"):
                break
            maybe_placed = True
            self.nap.wait(cfg.ttl * rng.uniform(0.03, 0.15))
        if not maybe_placed:
            return
        if rng.random() < cfg.lapse_fraction:
            return  # a dead waiter: the place lapses TTL after its last claim
        if self.http is not None and rng.random() < cfg.forged_fraction:
            self.wait_release(key, owner, place=place, forged=True)
            self.wait_claim(key, owner, limit, place=place, after_forged=True)
        self.wait_release(key, owner, place=place)
        if self.http is not None and rng.random() < cfg.reclaim_fraction:
            place = self.http.new_place_id(owner)
            if self.wait_claim(key, owner, limit, place=place, reclaim=True) in ("claimed", "unknown"):
                self.wait_release(key, owner, place=place)

    def wait_claim(self, key: str, owner: str, limit: int, **shape: Any) -> str:
        """One claim of ``owner``'s waiting place on ``key``; its outcome: ``claimed``, ``full`` (every place
        is another's), ``other`` (over HTTP: the owner's place was taken with another place id), ``unknown``
        (no answer: the place may or may not have been taken or kept), ``error``."""
        ttl = self.ttl
        fields: dict[str, Any] = {"key": key, "owner": owner, "max_waiting": limit, "ttl": self.cfg.ttl, **shape}
        if self.http is not None:
            fields["http"] = True
        t0 = time.monotonic()
        failed, got = self._attempt("wait_claim", t0, fields, lambda: self.leases.wait_claim(key, owner, ttl, max_waiting=limit))
        if failed is not None:
            return failed
        mine = next((w for w in got.waiters if w.owner == owner), None)
        if got.claimed:
            outcome = "claimed"
        else:
            outcome = "other" if self.http is not None and not got.waiters else "full"
        self.rec.op(
            "wait_claim", t0=t0, outcome=outcome,
            waiters=[(w.owner, w.since, w.expires_at) for w in got.waiters],
            since=mine.since if mine else None, expires_at=mine.expires_at if mine else None, **fields,
        )
        return outcome

    def wait_release(self, key: str, owner: str, *, forged: bool = False, **shape: Any) -> str:
        """Give ``owner``'s waiting place on ``key`` back (``forged``: over HTTP, with a capability that is not
        the place's); its outcome: ``ok``, ``refused`` (no such place), ``unknown``, ``error``."""
        fields: dict[str, Any] = {"key": key, "owner": owner, "forged": forged, **shape}
        if self.http is not None:
            fields["http"] = True
        http = self.http
        if forged:
            assert http is not None
            send: Callable[[], Any] = lambda: http.wait_release_with(key, owner, secrets.token_urlsafe(32))  # noqa: E731
        else:
            send = lambda: self.leases.wait_release(key, owner)  # noqa: E731
        t0 = time.monotonic()
        failed, released = self._attempt("wait_release", t0, fields, send)
        if failed is not None:
            return failed
        outcome = "ok" if released else "refused"
        self.rec.op("wait_release", t0=t0, outcome=outcome, **fields)
        return outcome

    def _attempt(self, op: str, t0: float, fields: dict[str, Any], send: Callable[[], Any]) -> tuple[str | None, Any]:
        """``send()``'s answer, with no outcome; or, when it raised, the outcome it was recorded with."""
        try:
            return None, send()
        except LeaseError as exc:
            outcome = outcome_of(exc)
            self.rec.op(op, t0=t0, outcome=outcome, error=str(exc), **fields)
            return outcome, None
        except Exception as exc:
            self.rec.op(op, t0=t0, outcome="error", error=repr(exc), **fields)
            return "error", None

    def db_now(self) -> datetime | None:
        """The database clock now, or None when it cannot be asked (a fault is on)."""
        try:
            with self.clock.get().cursor() as cur:
                cur.execute("SELECT clock_timestamp()")
                return cur.fetchone()[0]
        except LeaseStoreUnavailable:
            return None
        except psycopg2.Error as exc:
            self.clock.fail(exc)
            return None

    def start_keeper(self, lease: Lease) -> tuple[LeaseKeeper, Lease, str]:
        """A keeper for ``lease``: at once; after a pause (a slow XCom push, a GC pause), sometimes longer
        than the TTL; or by joining it the way a run-lease task does, reading its holder late."""
        rng, ttl = self.rng, self.cfg.ttl
        roll = rng.random()
        how = "at-once"
        if roll < self.cfg.delay_fraction:
            how = "delayed"
            self.nap.wait(ttl * rng.uniform(0.5, 1.6))
        elif roll < self.cfg.delay_fraction + self.cfg.join_fraction:
            how = "joined"
            # Join with 0.05-0.5 TTL left (by the acquire's figure), then a short gap before keep().
            self.nap.wait(max(0.0, lease.remaining.total_seconds() - ttl * rng.uniform(0.05, 0.5)))
            t0 = time.monotonic()
            try:
                if self.http is not None:  # over HTTP a grant is shown to its holder only
                    holder = self.http.holds(lease.key, lease.owner, token=lease.token).lease
                else:
                    holder = self.leases.holder(lease.key)
            except LeaseError:
                holder = None
            if holder is not None and (holder.owner, holder.token) == (lease.owner, lease.token):
                lease = holder
            self.rec.op("join", t0=t0, outcome="ok" if lease is holder else "missed", key=lease.key,
                        owner=lease.owner, token=lease.token,
                        observed_at=holder.observed_at if holder else None,
                        expires_at=holder.expires_at if holder else None)
            self.nap.wait(ttl * rng.uniform(0.0, 0.1))
        return self.keeper_cls(self.leases, lease).start(), lease, how

    def check(self, keeper: LeaseKeeper, lease: Lease, shape: dict[str, Any]) -> bool:
        """keeper.check() before publishing, with the database clock read just before it: a check that
        passes after the lease ended by that clock is the ``stale-check`` violation."""
        db_before = self.db_now()
        t0 = time.monotonic()
        try:
            keeper.check()
        except LeaseLost as exc:
            self.rec.op(
                "lost", t0=t0, outcome="reported", key=lease.key, owner=lease.owner, token=lease.token,
                reason=exc.reason, **shape,
            )
            keeper.stop()
            return False
        self.rec.op("check", t0=t0, outcome="held", key=lease.key, owner=lease.owner, token=lease.token,
                    db_before=db_before, **shape)
        return True

    def hold(self, lease: Lease, resource: str, *, in_store: bool = False) -> None:
        """Work under ``lease`` and publish to ``resource``; ``in_store``: the publish names this lease
        store (``store_id``, as the Airflow layer's do), so the fence also refuses a superseded grant."""
        rng = self.rng
        late = rng.random() < self.cfg.long_fraction
        work = self.cfg.ttl * (rng.uniform(1.2, 2.0) if late else rng.uniform(0.02, 0.3))
        keeper: LeaseKeeper | None = None
        how = "none"
        if rng.random() < self.cfg.keeper_fraction:
            keeper, lease, how = self.start_keeper(lease)
        checks = keeper is not None and rng.random() < self.cfg.check_fraction
        shape: dict[str, Any] = {"late": late, "keeper": keeper is not None, "checked": checks, "start": how}
        if keeper is not None and how != "at-once" and not self.check(keeper, lease, shape):
            return  # the body's first step: a keeper started late must say at once whether the lease is gone
        self.nap.wait(work)
        if keeper is not None and checks and not self.check(keeper, lease, shape):
            return
        self.publish(lease, resource, shape, store_id=self.store_id() if in_store else None)
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

    def store_id(self) -> str | None:
        """The lease store's id, or None while the store cannot be asked (the publish then names none)."""
        try:
            return self.leases.store_id
        except LeaseError:
            return None

    def publish(self, lease: Lease, resource: str, shape: dict[str, Any], store_id: str | None = None) -> None:
        if self.http is not None:
            self.publish_http(lease, resource, shape)
            return
        idem = f"{lease.owner}/publish" if self.rng.random() < self.cfg.idempotent_fraction else None
        for attempt in (1, 2):
            t0 = time.monotonic()
            fields: dict[str, Any] = {
                "key": lease.key, "owner": lease.owner, "token": lease.token, "resource": resource,
                "idem": idem, "attempt": attempt, "in_store": store_id is not None, **shape,
            }
            if lease.slots > 1:
                fields.update(lease_key=lease.lease_key, slot=lease.slot, slots=lease.slots)
            # Where the store has count epochs (issue 38), a publish that names the lease store also names its
            # grant's count epoch and the key acquired, as the Airflow layer's publishes do: the fence then
            # refuses a zombie of an earlier holding period of the key (a slot a count change dropped).
            grant: dict[str, Any] = {}
            if store_id is not None:
                grant["store_id"] = store_id
                if hasattr(lease, "count_epoch"):
                    grant.update(count_epoch=lease.count_epoch, base_key=lease.lease_key)
                    fields["count_epoch"] = lease.count_epoch
            try:
                with self.fences.transaction(
                    resource, lease.token, key=lease.key, owner=lease.owner, idempotency_key=idem, **grant
                ) as cur:
                    cur.execute(self.insert, {
                        "resource": resource, "key": lease.key, "token": lease.token, "owner": lease.owner,
                        "worker": self.cfg.id, "idem": idem,
                    })
                    at = cur.fetchone()[0]
            except DuplicatePublish as exc:
                self.rec.op("publish", t0=t0, outcome="duplicate", current=exc.current, **fields)
            except StaleFencingToken as exc:
                # "stale" (the fence accepted a larger token), or "superseded" (the store has granted past
                # this token), "other_store": each judged by the checker.
                reason = getattr(exc, "reason", "stale") or "stale"
                self.rec.op("publish", t0=t0, outcome=reason, current=exc.current, **fields)
            except LeaseStoreUnavailable as exc:
                self.rec.op("publish", t0=t0, outcome="unknown", error=str(exc), **fields)
                if attempt == 1 and idem is not None:
                    # The commit may or may not have happened. Resending is safe with an idempotency key:
                    # it makes the resend a duplicate if the first went through. Without one the fence
                    # would accept the resend (the same grant may publish again: docs/core.md, "The
                    # fence"), so none is sent; the checker verifies that no token or key was published twice.
                    self.nap.wait(self.rng.uniform(0.05, 0.2))
                    continue
            except Exception as exc:  # recorded and reported by the checker
                self.rec.op("publish", t0=t0, outcome="error", error=repr(exc), **fields)
            else:
                self.rec.op("publish", t0=t0, outcome="accepted", at=at, **fields)
            return

    def publish_http(self, lease: Lease, resource: str, shape: dict[str, Any]) -> None:
        """Publish through the lease API's ``/fence`` (an external publish: the fence of the store's own
        schema, the one the direct workers' transactions advance, with the grant's store and count epoch
        added by the API). What it committed is in the fence's audit; the checker reads it as this worker's
        publish (a target row of its own). Resent once after an unknown outcome, only with an idempotency
        key, as the direct publish."""
        assert self.http is not None
        idem = f"{lease.owner}/publish" if self.rng.random() < self.cfg.idempotent_fraction else None
        fences = self.http.fences()
        for attempt in (1, 2):
            t0 = time.monotonic()
            fields: dict[str, Any] = {
                "key": lease.key, "owner": lease.owner, "token": lease.token, "resource": resource,
                "idem": idem, "attempt": attempt, "in_store": True, "http": True, **shape,
            }
            if lease.slots > 1:
                fields.update(lease_key=lease.lease_key, slot=lease.slot, slots=lease.slots)
            try:
                fences.guard(resource, lease.token, key=lease.key, owner=lease.owner, idempotency_key=idem)
            except DuplicatePublish as exc:
                self.rec.op("publish", t0=t0, outcome="duplicate", current=exc.current, **fields)
            except StaleFencingToken as exc:
                reason = getattr(exc, "reason", "stale") or "stale"
                self.rec.op("publish", t0=t0, outcome=reason, current=exc.current, **fields)
            except LeaseLost as exc:  # the API refuses a grant that is no longer held before the fence
                self.rec.op("publish", t0=t0, outcome="lost", reason=exc.reason, **fields)
            except LeaseStoreUnavailable as exc:
                self.rec.op("publish", t0=t0, outcome="unknown", error=str(exc), **fields)
                if attempt == 1 and idem is not None:
                    self.nap.wait(self.rng.uniform(0.05, 0.2))
                    continue
            except Exception as exc:
                self.rec.op("publish", t0=t0, outcome="error", error=repr(exc), **fields)
            else:
                self.rec.op("publish", t0=t0, outcome="accepted", **fields)
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
