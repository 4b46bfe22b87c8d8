"""The fault injector: pauses holders past their TTL, kills sessions, kills the postmaster, locks tables.

Faults run one at a time from one thread (so a table lock never waits on the injector's own query), on
a randomised but seeded schedule; paused workers are woken by the same loop when their pause is over.
Skewed clocks are set when workers start (see :mod:`chaos.harness`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg2

from airflow_lease_provider.core import LeaseError, LeaseStore
from airflow_lease_provider.core.lease import LeaseChanged
from chaos import sql as chaos_sql
from chaos.api import ApiServer
from chaos.history import Recorder
from chaos.profiles import Profile
from chaos.server import PrivateServer, connect, db_time

_OWNER_RE = re.compile(r"^w(\d+)-\d+$")
#: The store logs every force-release as a warning; the nemesis's are recorded in the history instead.
logging.getLogger("airflow_lease_provider.core.lease").setLevel(logging.ERROR)


class Nemesis:
    def __init__(
        self,
        profile: Profile,
        server: PrivateServer,
        workers: dict[int, subprocess.Popen[bytes]],
        recorder: Recorder,
        rng: random.Random,
        api: ApiServer | None = None,
    ) -> None:
        self.profile = profile
        self.api = api
        #: The API server's pause (stopped at, wake at), and when the current window of lost replies ends.
        self.api_stopped: tuple[float, float] | None = None
        self.lossy_until: float | None = None
        self._restarting: threading.Thread | None = None
        self.server = server
        self.workers = workers
        self.rec = recorder
        self.rng = rng
        self.stopped: dict[int, tuple[float, float]] = {}  # worker -> (stopped at, wake at)
        self._nap = threading.Event()
        self.every = {
            "zombie": profile.zombie_every,
            "terminate": profile.terminate_every,
            "kill9": profile.kill_every,
            "stmt_timeout": profile.lock_every,
            "force_release": profile.force_every,
        }
        if api is not None:
            self.every.update(api_pause=profile.api_pause_every, api_kill=profile.api_kill_every,
                              lossy_api=profile.lossy_every)
        self._admin: LeaseStore | None = None

    # -- the schedule ------------------------------------------------------------------------------

    def run(self, seconds: float) -> None:
        start = time.monotonic()
        end = start + seconds
        # The first fault of each kind comes early (a short run still sees every kind), then they
        # follow at random intervals around their mean.
        # A kind whose mean interval is longer than the run is off for this run.
        due = {
            kind: start + self.rng.uniform(0.1, 0.4) * every
            for kind, every in self.every.items() if every <= seconds
        }
        if not due:
            self._nap.wait(seconds)
            return
        while True:
            self.wake_due()
            now = time.monotonic()
            if now >= end:
                return
            kind, at = min(due.items(), key=lambda item: item[1])
            wakes = [wake for _, wake in self.stopped.values()]
            if self.api_stopped is not None:
                wakes.append(self.api_stopped[1])
            if self.lossy_until is not None:
                wakes.append(self.lossy_until)
            if at > now:
                self._nap.wait(max(0.0, min([at, end, *wakes]) - now))
                continue
            getattr(self, "fault_" + kind)()
            due[kind] = time.monotonic() + self.rng.uniform(0.5, 1.5) * self.every[kind]

    def heal(self) -> None:
        """End every fault: wake paused workers, make sure the server runs."""
        for worker in list(self.stopped):
            self._wake(worker)
        if self.api is not None:
            if self._restarting is not None:
                self._restarting.join(120.0)
            self._lossy_off()
            if self.api_stopped is not None:
                self._wake_api()
            if self.api.proc is None or self.api.proc.poll() is not None:
                self.api.start()
                self.rec.fault("api_restart", why="found dead at heal")
        self.server.ensure_running()
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    # -- zombies: SIGSTOP a holder past its TTL, SIGCONT later ---------------------------------------

    def _rows(self, query: Any) -> list[tuple[Any, ...]]:
        """The rows of ``query`` on a connection of its own; none when the server does not answer."""
        try:
            conn = connect(self.server.dsn)
        except psycopg2.Error:
            return []
        try:
            with conn.cursor() as cur:
                cur.execute(query)
                return cur.fetchall()
        except psycopg2.Error:
            return []
        finally:
            conn.close()

    def _holders(self) -> list[tuple[int, str, int]]:
        found = []
        for owner, key, token in self._rows(chaos_sql.holders()):
            match = _OWNER_RE.match(owner)
            if match and int(match.group(1)) in self.workers:
                found.append((int(match.group(1)), key, int(token)))
        return found

    def _pick(self, holders: list[tuple[int, str, int]]) -> tuple[int, str, int]:
        """A holder; half the time one of a semaphore key's when there is one (they are fewer than the
        plain keys' holders, and their zombies are what the slot properties are about), and then a slot
        above 1 when there is one (the slots a lower count drops)."""
        pooled = [h for h in holders if h[1].startswith("pool-")]
        if not pooled or self.rng.random() >= 0.5:
            return self.rng.choice(holders)
        upper = [h for h in pooled if "#" in h[1]]
        return self.rng.choice(upper if upper and self.rng.random() < 0.7 else pooled)

    def _waiters(self) -> list[tuple[int, str]]:
        """The workers with a live waiting place, and its key."""
        found = []
        for owner, key in self._rows(chaos_sql.waiters()):
            match = _OWNER_RE.match(owner)
            if match and int(match.group(1)) in self.workers and int(match.group(1)) not in self.stopped:
                found.append((int(match.group(1)), key))
        return found

    def fault_zombie(self) -> None:
        """SIGSTOP a holder past its TTL; a quarter of the time a waiter when there is one (a paused
        triggerer: its place lapses meanwhile, and its next claim must not find it kept)."""
        waiters = self._waiters() if self.rng.random() < 0.25 else []
        if waiters:
            worker, waited = self.rng.choice(waiters)
            pause = self.profile.ttl * self.rng.uniform(1.3, 2.2) + 0.3
            self.workers[worker].send_signal(signal.SIGSTOP)
            now = time.monotonic()
            self.stopped[worker] = (now, now + pause)
            self.rec.fault("sigstop", w=worker, key=None, token=None, waiting=waited, pause_s=round(pause, 3),
                           db_time=db_time(self.server.dsn))
            return
        holders = [h for h in self._holders() if h[0] not in self.stopped]
        if holders:
            worker, key, token = self._pick(holders)
        else:
            idle = [w for w in self.workers if w not in self.stopped]
            if not idle:
                return
            worker, key, token = self.rng.choice(idle), None, None
        pause = self.profile.ttl * self.rng.uniform(1.3, 2.2) + 0.3
        self.workers[worker].send_signal(signal.SIGSTOP)
        now = time.monotonic()
        self.stopped[worker] = (now, now + pause)
        self.rec.fault("sigstop", w=worker, key=key, token=token, pause_s=round(pause, 3),
                       db_time=db_time(self.server.dsn))

    def wake_due(self) -> None:
        now = time.monotonic()
        for worker, (_, wake) in list(self.stopped.items()):
            if wake <= now:
                self._wake(worker)
        if self.api_stopped is not None and self.api_stopped[1] <= now:
            self._wake_api()
        if self.lossy_until is not None and self.lossy_until <= now:
            self._lossy_off()

    # -- the lease API server: paused, killed and restarted, losing replies after the store committed ---

    def fault_api_pause(self) -> None:
        assert self.api is not None
        if self.api_stopped is not None:
            return
        pause = self.profile.ttl * self.rng.uniform(1.3, 2.2) + 0.3
        self.api.signal(signal.SIGSTOP)
        now = time.monotonic()
        self.api_stopped = (now, now + pause)
        self.rec.fault("api_pause", pause_s=round(pause, 3))

    def _wake_api(self) -> None:
        assert self.api is not None and self.api_stopped is not None
        stopped_at, _ = self.api_stopped
        self.api_stopped = None
        self.api.signal(signal.SIGCONT)
        self.rec.fault("api_resume", stopped_s=round(time.monotonic() - stopped_at, 3))

    def fault_api_kill(self) -> None:
        """SIGKILL of the API server (in the middle of whatever requests it was running: a grant committed
        and its capability not yet bound, a fence advanced and not answered), then a new one on the port."""
        assert self.api is not None
        if self.api_stopped is not None:
            self._wake_api()
        t_kill = time.monotonic()
        pid = self.api.kill()
        self.api.start(wait=False)  # the spare takes the port; the next faults do not wait for it
        api = self.api

        def ready() -> None:
            try:
                api.wait_ready(90.0)
            except RuntimeError as exc:
                self.rec.fault("api_kill", t=t_kill, pid=pid, skipped=f"could not restart: {exc}")
                return
            t_ready = time.monotonic()
            self.rec.fault("api_kill", t=t_kill, t1=t_ready, pid=pid, downtime_s=round(t_ready - t_kill, 3))

        self._restarting = threading.Thread(target=ready, daemon=True)
        self._restarting.start()

    def fault_lossy_api(self) -> None:
        assert self.api is not None
        seconds = self.profile.lossy_seconds
        Path(self.api.cfg.lossy).write_text(json.dumps({"fraction": self.profile.lossy_fraction}))
        self.lossy_until = time.monotonic() + seconds
        self.rec.fault("lossy_api", seconds=seconds, fraction=self.profile.lossy_fraction)

    def _lossy_off(self) -> None:
        assert self.api is not None
        Path(self.api.cfg.lossy).unlink(missing_ok=True)
        if self.lossy_until is not None:
            self.lossy_until = None
            self.rec.fault("lossy_api_end")

    def _wake(self, worker: int) -> None:
        stopped_at, _ = self.stopped.pop(worker)
        self.workers[worker].send_signal(signal.SIGCONT)
        self.rec.fault("sigcont", w=worker, stopped_s=round(time.monotonic() - stopped_at, 3))

    # -- the admin: force-release a live holder's row (its token is bumped: docs/core.md) ----------------

    def fault_force_release(self) -> None:
        holders = self._holders()
        if not holders:
            self.rec.fault("force_release", skipped="nobody holds a lease")
            return
        worker, key, token = self._pick(holders)
        t0 = time.monotonic()
        if self._admin is None:
            self._admin = LeaseStore(
                self.server.dsn, schema=chaos_sql.LEASE_SCHEMA, connect_timeout=timedelta(seconds=2),
                statement_timeout=timedelta(seconds=self.profile.statement_timeout),
            )
        try:
            done = self._admin.force_release_with_token(key, by="chaos-admin", reason="chaos", expected_token=token)
        except LeaseChanged as exc:
            # Granted again since it was read (or a resend after a lost reply: the audit says which).
            self.rec.fault("force_release", t=t0, w=worker, key=key, token=token, outcome="changed",
                           current=exc.current.token, skipped="granted again since it was read")
            return
        except LeaseError as exc:
            self.rec.fault("force_release", t=t0, w=worker, key=key, token=token, outcome="unknown",
                           skipped=f"the store failed: {exc}")
            return
        self.rec.fault("force_release", t=t0, t1=time.monotonic(), w=worker, key=key, token=token,
                       outcome="ok" if done else "missing", new_token=done[1] if done else None)

    # -- sessions: pg_terminate_backend ----------------------------------------------------------

    def fault_terminate(self) -> None:
        try:
            conn = connect(self.server.dsn)
        except psycopg2.Error:
            self.rec.fault("terminate", killed=0, skipped="server unreachable")
            return
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT pid, state FROM pg_stat_activity "
                    "WHERE application_name = 'airflow-lease' AND pid <> pg_backend_pid()"
                )
                sessions = cur.fetchall()
                chosen = self.rng.sample(sessions, min(len(sessions), self.rng.randint(1, 3)))
                states = []
                for pid, state in chosen:
                    cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
                    if cur.fetchone()[0]:
                        states.append(state)
                self.rec.fault("terminate", killed=len(states), states=states)
        except psycopg2.Error as exc:
            self.rec.fault("terminate", killed=0, skipped=str(exc).strip())
        finally:
            conn.close()

    # -- the server: kill -9 of the postmaster, then a restart with crash recovery ----------------------

    def fault_kill9(self) -> None:
        before = db_time(self.server.dsn)
        t_kill = time.monotonic()
        pid = self.server.kill9()
        self.server.restart_after_crash()
        t_ready = time.monotonic()
        self.rec.fault(
            "kill9", t=t_kill, t1=t_ready, pid=pid, downtime_s=round(t_ready - t_kill, 3),
            db_time=before, db_time_after=db_time(self.server.dsn),
        )

    # -- statement timeouts: hold a table lock longer than the workers' statement timeout -------------

    def fault_stmt_timeout(self) -> None:
        table = self.rng.choice(["lease", "fence", "target"])
        schema = self.profile_schema(table)
        hold = self.profile.statement_timeout * self.rng.uniform(1.5, 2.5)
        t0 = time.monotonic()
        try:
            conn = connect(self.server.dsn)
        except psycopg2.Error:
            self.rec.fault("stmt_timeout", table=table, skipped="server unreachable")
            return
        try:
            conn.autocommit = False
            with conn.cursor() as cur:
                cur.execute("SET LOCAL lock_timeout = '2s'")
                cur.execute(chaos_sql.lock_table(schema, table))
                locked = time.monotonic()
                while time.monotonic() < locked + hold:
                    self.wake_due()  # paused workers still wake on time
                    self._nap.wait(min(0.05, locked + hold - time.monotonic()))
            conn.commit()
            self.rec.fault("stmt_timeout", t=t0, t1=time.monotonic(), table=table, hold_s=round(hold, 3))
        except psycopg2.Error as exc:
            self.rec.fault("stmt_timeout", table=table, skipped=str(exc).strip())
        finally:
            conn.close()

    @staticmethod
    def profile_schema(table: str) -> str:
        return chaos_sql.CHAOS_SCHEMA if table == "target" else chaos_sql.LEASE_SCHEMA


def kill_all(workers: dict[int, subprocess.Popen[bytes]]) -> None:
    """SIGKILL every worker at once (stopped ones too) and reap them."""
    for proc in workers.values():
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in workers.values():
        proc.wait()
