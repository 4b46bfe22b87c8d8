"""The coordinator's half of a cell: reset and seed the arm's tables, read counters around the run."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg2
from psycopg2 import sql

from bench import arms, sqltext
from bench.figures import cell_figures
from bench.pool import CellSpec, ClientPool
from bench.server import Server, WalAttributor

#: Scenarios in table order, with their arms in table order (the run rotates the order per repeat).
SCENARIOS: dict[str, tuple[str, ...]] = {
    "floor": (arms.SELECT1, arms.COMMIT, arms.FLUSHED_COMMIT),
    "success": (
        arms.LEASE, arms.LEASE_EVENTS, arms.LEASE_TEXT, arms.LEASE_BEFORE, arms.NAIVE, arms.SHEDLOCK, arms.ADVISORY
    ),
    "hot": (
        arms.LEASE, arms.LEASE_TEXT, arms.LEASE_BEFORE, arms.NAIVE, arms.SHEDLOCK, arms.SHEDLOCK_UPDATE, arms.ADVISORY
    ),
    "handoff": (arms.LEASE, arms.NAIVE, arms.SHEDLOCK),
    "renew": (arms.LEASE, arms.LEASE_TEXT, arms.LEASE_FUNCTION, arms.LEASE_BEFORE, arms.NAIVE, arms.SHEDLOCK_EXTEND),
    "fence": (arms.FENCE, arms.RAW_FENCE),
    "many": (arms.LEASE, arms.NAIVE, arms.SHEDLOCK),
}

SCENARIO_TITLES = {
    "floor": "floors",
    "success": "success path (distinct free keys)",
    "hot": "hot key, already held (every attempt fails)",
    "handoff": "hand-off on one key (release -> next acquire)",
    "renew": "renew (own key per client)",
    "fence": "fence accept (increasing tokens, own resource per client)",
    "many": "10,000 keys (random key, acquire + release)",
    "renew-paced": "renew, paced (each client every 100 ms)",
    "pressure": "pressure: renew with an idle-in-transaction session",
}

#: Scenarios run only at the profile's highest concurrency, after the grid of each repeat.
TOP_ONLY: dict[str, tuple[str, ...]] = {
    "renew-paced": (arms.LEASE, arms.NAIVE, arms.SHEDLOCK_EXTEND),
}
#: Seconds between one client's renewals in the paced cell: 64 clients offer 640 renewals/s, about a
#: third of what they manage back to back here, so queueing does not dominate the latency.
PACED_INTERVAL = 0.1

# The tables an arm writes; the first is the one whose HOT share is reported.
ARM_TABLES: dict[str, tuple[str, ...]] = {
    arms.LEASE: ("lease", "event"),
    arms.LEASE_EVENTS: ("lease", "event"),
    arms.LEASE_BEFORE: ("lease", "event"),
    arms.LEASE_TEXT: ("lease", "event"),
    arms.LEASE_FUNCTION: ("lease", "event"),
    arms.NAIVE: ("naive_lease",),
    arms.SHEDLOCK: ("shedlock",),
    arms.SHEDLOCK_UPDATE: ("shedlock",),
    arms.SHEDLOCK_EXTEND: ("shedlock",),
    arms.FENCE: ("fence", "fence_publish"),
    arms.RAW_FENCE: ("raw_fence",),
    arms.ADVISORY: (),
    arms.SELECT1: (),
    arms.COMMIT: (),
    arms.FLUSHED_COMMIT: (),
}

#: Successful acquires per second (all clients together) that no arm reaches: a durable write cannot
#: beat a ``SELECT 1`` round trip (about 6,500/s from one client here). The success-path pools are sized
#: from it; a client that still runs out of free keys is flagged in the results.
RATE_CEILING = 10_000


def pool_size(clients: int, warmup: float, duration: float) -> int:
    return math.ceil(RATE_CEILING * (warmup + duration + 0.5) / clients) + 100


def _seed_free(server: Server, schema: str, arm: str, keys: str, params: dict[str, Any]) -> None:
    if ARM_TABLES[arm] == ("shedlock",):
        server.seed(schema, sqltext.SEED_SHEDLOCK_ROWS, params, keys=keys)
    else:
        server.seed(schema, sqltext.SEED_LEASE_ROWS, params, table=ARM_TABLES[arm][0], keys=keys)


def _seed_held(server: Server, schema: str, arm: str, key: str) -> None:
    if ARM_TABLES[arm] == ("shedlock",):
        server.seed(schema, sqltext.SEED_HELD_SHEDLOCK, {"key": key})
    else:
        server.seed(schema, sqltext.SEED_HELD_LEASE, {"key": key}, table=ARM_TABLES[arm][0])


@contextlib.contextmanager
def prepared(server: Server, schema: str, spec: CellSpec) -> Iterator[None]:
    """Fresh tables for the cell, seeded as its scenario needs; the hot advisory lock held throughout."""
    tables = ARM_TABLES[spec.arm]
    server.reset(schema, tables)
    holding_advisory = False
    if tables:
        if spec.scenario == "success":
            params = {"clients": spec.clients, "pool": spec.pool}
            _seed_free(server, schema, spec.arm, sqltext.POOL_KEYS, params)
        elif spec.scenario == "hot":
            _seed_held(server, schema, spec.arm, arms.HOT_KEY)
        elif spec.scenario == "handoff":
            _seed_free(server, schema, spec.arm, sqltext.ONE_KEY, {"key": arms.HANDOFF_KEY})
        elif spec.scenario == "many":
            _seed_free(server, schema, spec.arm, sqltext.MANY_KEYS, {"count": arms.MANY_KEYS})
        server.vacuum(schema, tables)
    elif spec.scenario == "hot" and spec.arm == arms.ADVISORY:
        server.execute("SELECT pg_advisory_lock(%s)", (arms.HOT_ADVISORY_LOCK,))
        holding_advisory = True
    try:
        yield
    finally:
        if holding_advisory:
            server.execute("SELECT pg_advisory_unlock(%s)", (arms.HOT_ADVISORY_LOCK,))


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs: the share of the machine in use, ours included."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


@dataclass
class IdleInTransaction:
    """A session that began a transaction, read the lease table and sits idle: it holds the xmin horizon."""

    dsn: str
    schema: str
    conn: Any = None
    pid: int = 0
    facts: dict[str, Any] = field(default_factory=dict)

    def open(self) -> None:
        self.conn = psycopg2.connect(self.dsn, application_name="lease-bench-idle-in-transaction")
        # REPEATABLE READ keeps the snapshot (and so the backend's xmin) after the SELECT; under READ
        # COMMITTED an idle transaction with no xid releases it when the statement ends.
        self.conn.set_session(isolation_level="REPEATABLE READ")
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(self.schema, "lease")))
            cur.fetchall()
        self.pid = int(self.conn.get_backend_pid())

    def observe(self, server: Server) -> None:
        rows = server.execute(
            "SELECT state, age(backend_xmin), now() - xact_start FROM pg_stat_activity WHERE pid = %s",
            (self.pid,),
        )
        if rows:
            state, xmin_age, open_for = rows[0]
            self.facts = {
                "state": state,
                "xmin_age_xids": int(xmin_age) if xmin_age is not None else None,
                "open_s": open_for.total_seconds() if open_for is not None else None,
            }

    def close(self) -> None:
        if self.conn is not None:
            self.conn.rollback()
            self.conn.close()
            self.conn = None


def run_cell(
    pool: ClientPool,
    server: Server,
    schema: str,
    spec: CellSpec,
    *,
    attributor: WalAttributor | None,
    repeat: int,
    variant: str = "",
    idle: IdleInTransaction | None = None,
) -> dict[str, Any]:
    """Run one cell and return its record: the spec, the figures, and the load it ran under."""
    tables = ARM_TABLES[spec.arm]
    main_table = tables[0] if tables else None
    before: dict[str, Any] = {}
    phases = {"t0": time.monotonic()}
    with prepared(server, schema, spec):
        if idle is not None:
            idle.open()
        try:
            filenodes = server.filenodes(schema)
            size_before = server.table_bytes(schema, main_table) if main_table else None

            def at_start() -> None:
                before["counters"] = server.counters(schema, main_table) if main_table else None
                before["activity"] = server.activity(pool.backend_pids)
                before["load1"] = os.getloadavg()[0]
                before["cpu"] = _cpu_jiffies()
                before["lsn"] = server.wal_lsn()
                before["t"] = time.monotonic()

            phases["setup"] = time.monotonic()
            results = pool.run(spec, at_start)
            phases["run"] = time.monotonic()
            lsn_after = server.wal_lsn()
            cpu_after = _cpu_jiffies()
            counters_after = server.counters(schema, main_table) if main_table else None
            if idle is not None:
                idle.observe(server)
            size_after = server.table_bytes(schema, main_table) if main_table else None
        finally:
            if idle is not None:
                idle.close()
    phases["after"] = time.monotonic()
    wal_attributed = None
    if attributor is not None:
        server.wait_flushed(lsn_after)
        wal_attributed = attributor.attribute(before["lsn"], lsn_after, filenodes)
    phases["wal"] = time.monotonic()
    hot = None
    if counters_after is not None and before["counters"] is not None:
        hot = (
            counters_after.upd - before["counters"].upd,
            counters_after.hot_upd - before["counters"].hot_upd,
        )
    figures = cell_figures(
        spec, results, wal_raw=lsn_after - before["lsn"], wal_attributed=wal_attributed, hot=hot
    )
    busy = cpu_after[0] - before["cpu"][0]
    total = cpu_after[1] - before["cpu"][1]
    figures["cpu_busy"] = busy / total if total else None
    figures["load1"] = before["load1"]
    figures.update(before["activity"])
    if counters_after is not None:
        figures["dead_tuples_after"] = counters_after.dead
        figures["table_bytes_before"] = size_before
        figures["table_bytes_after"] = size_after
    record: dict[str, Any] = {
        "scenario": spec.scenario,
        "arm": spec.arm,
        "clients": spec.clients,
        "repeat": repeat,
        "variant": variant,
        "warmup_s": spec.warmup,
        "duration_s": spec.duration,
        "figures": figures,
        "coordinator_s": {
            "setup": phases["setup"] - phases["t0"],
            "run": phases["run"] - phases["setup"],
            "after": phases["after"] - phases["run"],
            "wal": phases["wal"] - phases["after"],
        },
    }
    if idle is not None:
        record["idle_in_transaction"] = idle.facts
    return record
