"""The exclusion rule of docs/core.md ("Who may hold a key"), checked by a model over the real store (issue 38).

A Hypothesis state machine drives the real lease store (three store objects, three connections) and three
real fences (the one in the store's own schema, a fence-only PostgreSQL schema, a DB-API fence on a SQLite
file) with every way a key is granted: a single-holder acquire, a semaphore's acquire with 2 or 3 slots
(the count changing between busy periods), a replace, and the same on a plain key spelled like a slot of
another (``a#2``), plus renew, release, expiry (a holder frozen past its TTL: its row's expiry moved to now,
the way tests/core/test_concurrency.py ages a lease), force-release, and publishes by current and stale
holders. Two rules make grants overlap for real: one grants inside a transaction held open on a connection
of its own while another store grants the same key from a thread (the window of issue 38's defect 2), one
releases two or three stores' grants at a barrier.

After every step, and over the history it recorded, it checks:

- the live grants of a key (the lease rows of its slots, read from the store) never exceed what its rule
  allows: one slot count at a time, at most that many, one per slot, a single holder alone;
- the tokens of every lease row strictly increase in the order the rows were granted, and never repeat;
- no fence accepts a superseded grant: a publish by a holder whose row was granted again (or force-released),
  or whose key was granted since under another slot count, is refused by the fence in the store's schema at
  once and by a fence elsewhere once a superseding holder published there;
- no fence refuses a valid holder (a grant still live and the newest of its row): N holders of one count
  never refuse each other.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extras
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from airflow_lease_provider.core import FenceStore, Lease, LeaseStore, SlotCountMismatch
from airflow_lease_provider.core.dbapi_fence import DbApiFence
from airflow_lease_provider.core.types import Acquisition
from tests.pg import drop_schema, new_schema_name, q

TTL = timedelta(minutes=5)
#: The keys a machine uses: two semaphore-or-single keys, and a plain key spelled like slot 2 of the first.
BASES = ("a", "b", "a#2")
OWNERS = ("o1", "o2", "o3", "o4")
#: How a key is asked for: a single holder, a semaphore of 2 or 3 slots, a replace.
KINDS = ("single", "slots2", "slots3", "replace")
FENCES = ("store", "elsewhere", "sqlite")
RESOURCES = ("r1", "r2")
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

# The suite's run (about 40 s on the 2-core machine); LEASE_EXCLUSION_PROFILE=exclusion-model-deep searches
# longer (a few minutes), for a change to the statements.
settings.register_profile(
    "exclusion-model", max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "exclusion-model-deep", max_examples=400, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MODEL = settings.get_profile(os.environ.get("LEASE_EXCLUSION_PROFILE", "exclusion-model"))


def publish_args(lease: Lease) -> dict[str, Any]:
    """What a holder tells a fence about its grant besides its key, owner and token (docs/core.md, "The
    fence"): the Airflow layer passes the same."""
    return {"count_epoch": lease.count_epoch, "base_key": lease.lease_key}


@dataclass(eq=False)
class Grant:
    """One grant the store answered, as the model saw it."""

    n: int
    base: str
    kind: str
    lease: Lease
    released: bool = False
    expired: bool = False
    force_released: bool = False
    #: (fence, resource) pairs whose fence accepted a publish of this grant.
    published: set[tuple[str, str]] = field(default_factory=set)

    @property
    def row(self) -> str:
        return self.lease.key

    @property
    def ended(self) -> bool:
        return self.released or self.expired or self.force_released

    def __repr__(self) -> str:
        lease = self.lease
        return f"#{self.n} {self.kind} {lease.key!r} slot {lease.slot}/{lease.slots} {lease.owner} token {lease.token}"


@dataclass
class World:
    """What a machine works on: the store's schema, three store objects, the three fences."""

    dsn: str
    schema: str
    stores: list[LeaseStore]
    fences: dict[str, Any]
    store_id: str
    #: An autocommit connection of the test's own: the checks' reads, the expiries, the lock waits.
    conn: Any


def kind_call(store: LeaseStore, kind: str, key: str, owner: str, run_after: datetime) -> Acquisition:
    if kind == "replace":
        return store.try_replace(key, owner, TTL, run_after=run_after)
    return store.try_acquire(key, owner, TTL, slots={"single": 1, "slots2": 2, "slots3": 3}[kind])


def open_grant_sql(kind: str) -> str:
    """The statement a kind's grant runs (queries.sql), called directly inside a transaction held open."""
    if kind == "single":
        return "SELECT * FROM {schema}.lease_acquire(%s, %s, %s, NULL, NULL, NULL, NULL)"
    if kind == "replace":
        return "SELECT * FROM {schema}.lease_replace(%s, %s, %s, %s, true, NULL, NULL, NULL, NULL, NULL)"
    return "SELECT * FROM {schema}.lease_acquire_slots(%s, %s, %s, %s, NULL, NULL, NULL, NULL, NULL)"


def open_grant_params(kind: str, key: str, owner: str, run_after: datetime) -> tuple[Any, ...]:
    if kind == "single":
        return (key, owner, TTL)
    if kind == "replace":
        return (key, owner, TTL, run_after)
    return (key, owner, TTL, {"slots2": 2, "slots3": 3}[kind])


class ExclusionMachine(RuleBasedStateMachine):
    world: World

    def __init__(self) -> None:
        super().__init__()
        self.run = uuid.uuid4().hex[:8]  # machines share the schema: each gets keys and resources of its own
        self.grants: list[Grant] = []
        self.n = 0
        #: (fence, resource) -> the grants whose publish it accepted, in order.
        self.accepted: dict[tuple[str, str], list[Grant]] = {}
        #: row key -> the model step numbers at which it was force-released.
        self.bumped: dict[str, list[int]] = {}

    def k(self, base: str) -> str:
        return f"{self.run}:{base}"

    def _next(self) -> int:
        self.n += 1
        return self.n

    # -- what the model knows ----------------------------------------------------------------------

    def _newest_of_row(self, g: Grant) -> bool:
        return not any(o.row == g.row and o.lease.token > g.lease.token for o in self.grants)

    def _valid(self, g: Grant) -> bool:
        """Still held by the model's account: not released, expired or force-released, and its row not
        granted since (a takeover or the owner's own re-entry supersedes it)."""
        return not g.ended and self._newest_of_row(g)

    def _superseding(self, g: Grant) -> list[Grant]:
        """The grants that make ``g`` stale for every fence: its row granted again (a larger token), or its
        key granted since under another slot count (a dropped or changed slot is never granted again)."""
        return [
            o for o in self.grants
            if o is not g and (
                (o.row == g.row and o.lease.token > g.lease.token)
                or (o.base == g.base and o.lease.slots != g.lease.slots and o.n > g.n)
            )
        ]

    def _record(self, kind: str, base: str, got: Acquisition | None, *, n: int | None = None) -> Grant | None:
        if got is None:
            return None
        if got.lease is None:
            # Refused: the answer names who holds it.
            assert got.holder is not None or got.holders, f"{kind} of {base!r} refused naming nobody"
            return None
        g = Grant(self._next() if n is None else n, base, kind, got.lease)
        assert got.lease.lease_key == base, (g, base)
        if got.lease.slots > 1:
            assert got.lease.key == (base if got.lease.slot == 1 else f"{base}#{got.lease.slot}"), g
        self.grants.append(g)
        return g

    # -- the rules ---------------------------------------------------------------------------------

    @rule(store=st.integers(0, 2), base=st.sampled_from(BASES), owner=st.sampled_from(OWNERS),
          kind=st.sampled_from(KINDS), order=st.integers(0, 3))
    def acquire(self, store: int, base: str, owner: str, kind: str, order: int) -> None:
        try:
            got = kind_call(self.world.stores[store], kind, self.k(base), owner, T0 + timedelta(minutes=order))
        except SlotCountMismatch as refused:
            assert refused.holders, "a slot-count refusal names the holders"
            return
        self._record(kind, self.k(base), got)

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 10_000))
    def renew(self, i: int) -> None:
        g = self.grants[i % len(self.grants)]
        renewed = self.world.stores[i % 3].renew(g.lease)
        assert (renewed is not None) == self._valid(g), (g, renewed)

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 10_000))
    def release(self, i: int) -> None:
        g = self.grants[i % len(self.grants)]
        released = self.world.stores[i % 3].release(g.lease)
        expected = not g.released and not g.force_released and self._newest_of_row(g)
        assert released is expected, (g, released)
        g.released = g.released or released

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 10_000))
    def expire(self, i: int) -> None:
        """The holder froze past its TTL: its lease lapses (its row's expiry moved to now), it runs on."""
        g = self.grants[i % len(self.grants)]
        if not self._valid(g):
            return
        with self.world.conn.cursor() as cur:
            cur.execute(
                q("UPDATE {schema}.lease SET expires_at = clock_timestamp() WHERE key = %s AND token = %s"
                  " AND owner = %s", self.world.schema),
                (g.row, g.lease.token, g.lease.owner),
            )
            assert cur.rowcount == 1, g
        g.expired = True

    @rule(base=st.sampled_from(BASES), slot=st.integers(1, 3))
    def force_release(self, base: str, slot: int) -> None:
        row = self.k(base) if slot == 1 else f"{self.k(base)}#{slot}"
        previous = self.world.stores[0].force_release(row, by="model")
        granted = [g for g in self.grants if g.row == row]
        assert (previous is None) == (not granted), (row, previous)
        for g in granted:
            if self._newest_of_row(g):
                g.force_released = True
        self.bumped.setdefault(row, []).append(self._next())

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 10_000), fence=st.sampled_from(FENCES), resource=st.sampled_from(RESOURCES))
    def publish(self, i: int, fence: str, resource: str) -> None:
        g = self.grants[i % len(self.grants)]
        res = self.k(resource)
        lease = g.lease
        decision = self.world.fences[fence].advance(
            res, lease.token, key=lease.key, owner=lease.owner, store_id=self.world.store_id, **publish_args(lease)
        )
        superseding = self._superseding(g)
        if fence == "store":
            # Kept in the store that issued the token: refused from the moment a superseding grant (or a
            # force-release of its row) happened, before anyone published.
            stale = superseding + [b for b in self.bumped.get(g.row, []) if b > g.n]
        else:
            # Elsewhere the fence sees only publishes: refused once a superseding holder published here.
            seen = self.accepted.get((fence, res), [])
            stale = [o for o in superseding if o in seen]
        if decision.accepted:
            assert not stale, f"the {fence} fence accepted {g} at {resource}, superseded by {stale}"
            g.published.add((fence, res))
            self.accepted.setdefault((fence, res), []).append(g)
        else:
            assert not self._valid(g), f"the {fence} fence refused the valid holder {g} at {resource}: {decision}"

    @rule(first=st.sampled_from(KINDS), second=st.sampled_from(KINDS), base=st.sampled_from(BASES),
          owners=st.sampled_from([(a, b) for a in OWNERS for b in OWNERS if a != b]), store=st.integers(0, 2),
          order=st.tuples(st.integers(0, 3), st.integers(0, 3)))
    def race_an_open_grant(
        self, first: str, second: str, base: str, owners: tuple[str, str], store: int, order: tuple[int, int]
    ) -> None:
        """One grant runs inside a transaction held open on its own connection; meanwhile another store
        asks for the same key from a thread, which either answers or waits for a lock; then the first
        commits. Both answers are what the two callers would see."""
        key = self.k(base)
        conn = psycopg2.connect(self.world.dsn)
        try:
            with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
                cur.execute(q(open_grant_sql(first), self.world.schema),
                            open_grant_params(first, key, owners[0], T0 + timedelta(minutes=order[0])))
                rows = [dict(r) for r in cur.fetchall()]
            other = self.world.stores[store]
            pid = other.db._connection().get_backend_pid()
            answer: list[Any] = []

            def ask() -> None:
                try:
                    answer.append(kind_call(other, second, key, owners[1], T0 + timedelta(minutes=order[1])))
                except SlotCountMismatch as exc:
                    answer.append(exc)
                except Exception as exc:  # reported by the test
                    answer.append(exc)

            thread = threading.Thread(target=ask)
            thread.start()
            wait_answered_or_waiting(self.world.conn, pid, thread)
            conn.commit()
            thread.join(timeout=60)
            assert not thread.is_alive(), "the second grant never answered"
        finally:
            conn.close()
        n = self._next()
        granted = rows[0] if rows and rows[0]["acquired"] else None
        if granted is not None:
            self._record(first, key, Acquisition(Lease.from_row(granted), None), n=n)
        (got,) = answer
        if isinstance(got, SlotCountMismatch):
            return
        if isinstance(got, Exception):
            raise got
        self._record(second, key, got)

    @rule(kinds=st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(OWNERS)), min_size=2, max_size=3,
                         unique_by=lambda t: t[1]),
          base=st.sampled_from(BASES))
    def race_at_a_barrier(self, kinds: list[tuple[str, str]], base: str) -> None:
        """Two or three stores ask for one key at once, from threads released together."""
        key = self.k(base)
        barrier = threading.Barrier(len(kinds))
        answers: list[Any] = [None] * len(kinds)

        def ask(i: int, kind: str, owner: str) -> None:
            barrier.wait(timeout=30)
            try:
                answers[i] = (kind, kind_call(self.world.stores[i], kind, key, owner, T0 + timedelta(minutes=i)))
            except Exception as exc:  # SlotCountMismatch, or reported below
                answers[i] = (kind, exc)

        threads = [threading.Thread(target=ask, args=(i, kind, owner)) for i, (kind, owner) in enumerate(kinds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        for kind, got in answers:
            if isinstance(got, SlotCountMismatch):
                continue
            if isinstance(got, Exception):
                raise got
            self._record(kind, key, got)

    # -- the checks ----------------------------------------------------------------------------------

    @invariant()
    def live_grants_follow_the_rule(self) -> None:
        """From the store's rows: per key, one slot count at a time, at most that many holders, one per
        slot; a single holder alone."""
        rows = _rows(self.world.conn, self.world.schema, f"{self.run}:")
        for base in (self.k(b) for b in BASES):
            live = [
                r for r in rows
                if r["live"] and ((r["key"] == base and r["slot"] == 1) or (r["slot_of"] == base and r["slot"] > 1))
            ]
            counts = {r["slots"] for r in live}
            assert len(counts) <= 1, f"{base!r} is held with several slot counts at once: {live}"
            if live:
                (count,) = counts
                assert len(live) <= count, f"{base!r}: {len(live)} holders for {count} slots: {live}"
                assert len({r["slot"] for r in live}) == len(live), f"{base!r}: a slot held twice: {live}"

    @invariant()
    def valid_grants_follow_the_rule(self) -> None:
        """From the answers the callers got: the grants still valid by the model's account, per key."""
        for base in {g.base for g in self.grants}:
            valid = [g for g in self.grants if g.base == base and self._valid(g)]
            counts = {g.lease.slots for g in valid}
            assert len(counts) <= 1, f"valid holders of {base!r} with several slot counts: {valid}"
            if valid:
                (count,) = counts
                assert len(valid) <= count, f"{base!r}: {len(valid)} valid holders for {count} slots: {valid}"
                assert len({g.lease.slot for g in valid}) == len(valid), f"{base!r}: a slot held twice: {valid}"

    @invariant()
    def tokens_increase_per_row(self) -> None:
        by_row: dict[str, list[Grant]] = {}
        for g in self.grants:
            by_row.setdefault(g.row, []).append(g)
        for row, grants in by_row.items():
            ordered = sorted(grants, key=lambda g: (g.lease.acquired_at, g.lease.token))
            tokens = [g.lease.token for g in ordered]
            assert tokens == sorted(set(tokens)), f"tokens of {row!r} repeat or go back in grant order: {ordered}"


def wait_answered_or_waiting(conn: Any, pid: int, thread: threading.Thread, timeout: float = 30.0) -> None:
    """Until ``thread``'s call has answered, or its backend ``pid`` waits for a lock (the open grant's)."""
    deadline = time.monotonic() + timeout
    with conn.cursor() as cur:
        while thread.is_alive() and time.monotonic() < deadline:
            cur.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (pid,))
            (waiting,) = cur.fetchone()
            if waiting:
                return
            time.sleep(0.002)


def _rows(conn: Any, schema: str, prefix: str) -> list[dict[str, Any]]:
    with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
        cur.execute(
            q("SELECT key, owner, token, slots, slot, slot_of, released_at IS NULL"
              " AND expires_at > clock_timestamp() AS live FROM {schema}.lease WHERE starts_with(key, %s)",
              schema),
            (prefix,),
        )
        return [dict(r) for r in cur.fetchall()]


@pytest.fixture
def world(pg_dsn: str, schema: str, tmp_path: Path) -> Iterator[World]:
    stores = [LeaseStore(pg_dsn, schema=schema) for _ in range(3)]
    stores[0].ensure_schema()
    elsewhere = new_schema_name()
    fences = {
        "store": FenceStore(pg_dsn, schema=schema),
        "elsewhere": FenceStore(pg_dsn, schema=elsewhere, fence_only=True),
        "sqlite": DbApiFence(lambda: sqlite3.connect(tmp_path / "fence.db", timeout=30), dialect="sqlite",
                             where="sqlite 'fence.db'"),
    }
    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True
    yield World(pg_dsn, schema, stores, fences, stores[0].store_id, conn)
    conn.close()
    for s in stores:
        s.close()
    fences["store"].close()
    fences["elsewhere"].close()
    drop_schema(pg_dsn, elsewhere)


def run_model(world: World, machine: type[ExclusionMachine] = ExclusionMachine,
              chosen: settings = MODEL) -> None:
    machine.world = world
    run_state_machine_as_test(machine, settings=chosen)


def test_every_way_of_granting_a_key_keeps_the_exclusion_rule_and_the_fences(world: World) -> None:
    run_model(world)

