"""The arms, as seen from one client process: what one attempt of each (scenario, arm) pair does.

Each client process has exactly one connection. The project's arms go through the public
``LeaseStore``/``FenceStore`` API; the baselines send their statements on that same connection (same
connection settings, autocommit, one statement each where the original is one). One connection per
process matters on the shared server: 64 clients x several stores would exceed ``max_connections``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from airflow_lease_provider.core import FenceStore, Lease, LeaseStore
from bench import sqltext

#: TTL of every lease the arms take (the store accepts 1 s to 7 days). Success-path keys are used once
#: and hand-off/10k-key leases are released at once, so the value never decides an outcome.
TTL = timedelta(seconds=60)
TTL_SECONDS = TTL.total_seconds()
#: The key every hot-key and hand-off attempt goes for.
HOT_KEY = "hot"
HANDOFF_KEY = "handoff"
#: The advisory lock the coordinator holds during the hot-key cell (an arbitrary 64-bit number).
HOT_ADVISORY_LOCK = 0x1EA5E_0000_0001
#: How many keys the 10k-key scenario spreads over.
MANY_KEYS = 10_000


def pool_key(worker: int, n: int) -> str:
    """The n-th free key of ``worker``'s success-path pool (the coordinator seeds the same names)."""
    return f"s{worker}-{n}"


def many_key(n: int) -> str:
    return f"k{n}"


@dataclass
class Attempt:
    """One scenario-arm pair in one client process.

    :ivar attempt: makes one attempt; True when it succeeded.
    :ivar release: for cycle scenarios (hand-off, 10k keys), frees what a successful attempt took.
    """

    attempt: Callable[[], bool]
    release: Callable[[], None] | None = None


class Client:
    """One client process's connection and stores, created after the fork."""

    def __init__(self, worker: int, dsn: str, schema: str) -> None:
        self.worker = worker
        self.owner = f"w{worker}"
        self.schema = schema
        self.leases = LeaseStore(dsn, schema=schema, record_events=False)
        self.leases.ensure_schema()
        self.fences = FenceStore(dsn, schema=schema, record_events=False)
        # Share the lease store's Database (and so its one connection) with the fence store.
        self.fences.db = self.leases.db
        self.fences.ensure_schema()
        # The baselines run on the very connection the store uses: same settings, same backend.
        self.conn: Any = self.leases.db._connection()
        self.cur: Any = self.conn.cursor()
        self._text: dict[str, str] = {}

    def backend_pid(self) -> int:
        return int(self.conn.get_backend_pid())

    def q(self, text: str) -> str:
        """A baseline statement with the schema filled in, rendered once."""
        rendered = self._text.get(text)
        if rendered is None:
            rendered = self._text[text] = sqltext.compose(text, self.schema).as_string(self.conn)
        return rendered

    def flush_stats(self) -> None:
        # The backend sends its table counters when it next goes idle; forcing it lets the coordinator
        # read exact per-cell n_tup_upd / n_tup_hot_upd deltas without waiting a second.
        self.cur.execute("SELECT pg_stat_force_next_flush()")
        self.cur.fetchall()

    def close(self) -> None:
        self.leases.close()

    # -- the arms -------------------------------------------------------------------------------------

    def build(self, scenario: str, arm: str, pool: int) -> Attempt:
        """The attempt function of ``arm`` in ``scenario``; runs any per-client preparation now."""
        builder = _BUILDERS.get((scenario, arm))
        if builder is None:
            raise ValueError(f"no arm {arm!r} in scenario {scenario!r}")
        self.leases.record_events = False  # only the +events arms turn it on, for their cell
        # Only the before arms swap the statements and send them as text (as do the as-text arms, with the
        # core's own); everyone else gets the core's own again, prepared as the store prepares them.
        self.leases.db._compiled.pop("acquire", None)
        self.leases.db._compiled.pop("renew", None)
        self.leases.db.prepare = True
        return builder(self, pool)

    def use_before_sql(self) -> None:
        """Send version 6's acquire function and renew statement where the store sends its own (same code
        path, same prefix, same parsing of the row into a Lease), as plain text as it was sent then: the
        before arm of a before/after pair."""
        self.leases.db._compiled["acquire"] = self.q(sqltext.BEFORE_ACQUIRE_CALL)
        self.leases.db._compiled["renew"] = self.q(sqltext.BEFORE_RENEW)
        self.leases.db.prepare = False


# -- project arms ----------------------------------------------------------------------------------------


def _lease_pool(client: Client, pool: int) -> Attempt:
    keys = iter(_cycled_pool(client.worker, pool))

    def attempt() -> bool:
        return client.leases.acquire(next(keys), client.owner, TTL) is not None

    return Attempt(attempt)


def _lease_pool_events(client: Client, pool: int) -> Attempt:
    client.leases.record_events = True
    return _lease_pool(client, pool)


def _before_pool(client: Client, pool: int) -> Attempt:
    client.use_before_sql()
    return _lease_pool(client, pool)


def _text_pool(client: Client, pool: int) -> Attempt:
    client.leases.db.prepare = False
    return _lease_pool(client, pool)


def _text_hot(client: Client, pool: int) -> Attempt:
    client.leases.db.prepare = False
    return _lease_hot(client, pool)


def _text_renew(client: Client, pool: int) -> Attempt:
    client.leases.db.prepare = False
    return _lease_renew(client, pool)


def _function_renew(client: Client, pool: int) -> Attempt:
    # The lease_renew() call the store sent before (prepared like the store's own): the same code path.
    client.leases.db._compiled["renew"] = client.q(sqltext.FUNCTION_RENEW)
    return _lease_renew(client, pool)


def _before_hot(client: Client, pool: int) -> Attempt:
    client.use_before_sql()
    return _lease_hot(client, pool)


def _before_renew(client: Client, pool: int) -> Attempt:
    client.use_before_sql()
    return _lease_renew(client, pool)


def _lease_hot(client: Client, pool: int) -> Attempt:
    def attempt() -> bool:
        return client.leases.acquire(HOT_KEY, client.owner, TTL) is not None

    return Attempt(attempt)


def _lease_cycle(client: Client, keys: Callable[[], str]) -> Attempt:
    held: list[Lease] = []

    def attempt() -> bool:
        lease = client.leases.acquire(keys(), client.owner, TTL)
        if lease is None:
            return False
        held.append(lease)
        return True

    def release() -> None:
        client.leases.release(held.pop())

    return Attempt(attempt, release)


def _lease_handoff(client: Client, pool: int) -> Attempt:
    return _lease_cycle(client, lambda: HANDOFF_KEY)


def _lease_handoff_events(client: Client, pool: int) -> Attempt:
    client.leases.record_events = True
    return _lease_handoff(client, pool)


def _lease_many(client: Client, pool: int) -> Attempt:
    rng = random.Random(client.worker)
    return _lease_cycle(client, lambda: many_key(rng.randrange(MANY_KEYS)))


def _lease_renew(client: Client, pool: int) -> Attempt:
    lease = client.leases.acquire(f"r{client.worker}", client.owner, TTL)
    if lease is None:
        raise RuntimeError("renew setup: could not take the client's own key")

    def attempt() -> bool:
        return client.leases.renew(lease) is not None

    return Attempt(attempt)


def _fence_accept(client: Client, pool: int) -> Attempt:
    resource = f"f{client.worker}"
    token = [0]

    def attempt() -> bool:
        token[0] += 1
        return client.fences.accept(resource, token[0], key=resource, owner=client.owner)

    return Attempt(attempt)


# -- ShedLock-style arms ---------------------------------------------------------------------------------


def _shed_params(client: Client, name: str) -> dict[str, Any]:
    return {"name": name, "secs": TTL_SECONDS, "by": client.owner}


def _shed_try(client: Client, statement: str, name: str) -> bool:
    # ShedLock decides by the update count, not by a returned row.
    client.cur.execute(client.q(statement), _shed_params(client, name))
    return bool(client.cur.rowcount == 1)


def _shed_pool(client: Client, pool: int) -> Attempt:
    keys = iter(_cycled_pool(client.worker, pool))
    return Attempt(lambda: _shed_try(client, sqltext.SHEDLOCK_UPSERT, next(keys)))


def _shed_hot(client: Client, pool: int) -> Attempt:
    return Attempt(lambda: _shed_try(client, sqltext.SHEDLOCK_UPSERT, HOT_KEY))


def _shed_update_hot(client: Client, pool: int) -> Attempt:
    return Attempt(lambda: _shed_try(client, sqltext.SHEDLOCK_UPDATE, HOT_KEY))


def _shed_cycle(client: Client, keys: Callable[[], str]) -> Attempt:
    held: list[str] = []

    def attempt() -> bool:
        name = keys()
        if not _shed_try(client, sqltext.SHEDLOCK_UPSERT, name):
            return False
        held.append(name)
        return True

    def release() -> None:
        client.cur.execute(client.q(sqltext.SHEDLOCK_UNLOCK), _shed_params(client, held.pop()))

    return Attempt(attempt, release)


def _shed_handoff(client: Client, pool: int) -> Attempt:
    return _shed_cycle(client, lambda: HANDOFF_KEY)


def _shed_many(client: Client, pool: int) -> Attempt:
    rng = random.Random(client.worker)
    return _shed_cycle(client, lambda: many_key(rng.randrange(MANY_KEYS)))


def _shed_renew(client: Client, pool: int) -> Attempt:
    name = f"r{client.worker}"
    if not _shed_try(client, sqltext.SHEDLOCK_UPSERT, name):
        raise RuntimeError("renew setup: could not take the client's own ShedLock row")
    return Attempt(lambda: _shed_try(client, sqltext.SHEDLOCK_EXTEND, name))


# -- naive read-then-compare-and-set arms ---------------------------------------------------------------


def _naive_acquire(client: Client, key: str) -> int | None:
    """SELECT, then a conditional UPDATE on the token read (or an INSERT for a new key): the new token."""
    cur = client.cur
    params = {"key": key, "owner": client.owner, "ttl": TTL}
    cur.execute(client.q(sqltext.NAIVE_READ), params)
    row = cur.fetchone()
    if row is None:
        cur.execute(client.q(sqltext.NAIVE_INSERT), params)
    elif row[2]:
        params["token"] = row[0]
        cur.execute(client.q(sqltext.NAIVE_CAS), params)
    else:
        return None  # held: a sensible client does not send the UPDATE
    won = cur.fetchone()
    return None if won is None else int(won[0])


def _naive_pool(client: Client, pool: int) -> Attempt:
    keys = iter(_cycled_pool(client.worker, pool))
    return Attempt(lambda: _naive_acquire(client, next(keys)) is not None)


def _naive_hot(client: Client, pool: int) -> Attempt:
    return Attempt(lambda: _naive_acquire(client, HOT_KEY) is not None)


def _naive_cycle(client: Client, keys: Callable[[], str]) -> Attempt:
    held: list[tuple[str, int]] = []

    def attempt() -> bool:
        key = keys()
        token = _naive_acquire(client, key)
        if token is None:
            return False
        held.append((key, token))
        return True

    def release() -> None:
        key, token = held.pop()
        client.cur.execute(
            client.q(sqltext.NAIVE_RELEASE), {"key": key, "owner": client.owner, "token": token}
        )

    return Attempt(attempt, release)


def _naive_handoff(client: Client, pool: int) -> Attempt:
    return _naive_cycle(client, lambda: HANDOFF_KEY)


def _naive_many(client: Client, pool: int) -> Attempt:
    rng = random.Random(client.worker)
    return _naive_cycle(client, lambda: many_key(rng.randrange(MANY_KEYS)))


def _naive_renew(client: Client, pool: int) -> Attempt:
    key = f"r{client.worker}"
    token = _naive_acquire(client, key)
    if token is None:
        raise RuntimeError("renew setup: could not take the client's own naive row")
    params = {"key": key, "owner": client.owner, "token": token, "ttl": TTL}

    def attempt() -> bool:
        client.cur.execute(client.q(sqltext.NAIVE_RENEW_READ), params)
        row = client.cur.fetchone()
        if row is None or not row[0]:
            return False
        client.cur.execute(client.q(sqltext.NAIVE_RENEW), params)
        return bool(client.cur.rowcount == 1)

    return Attempt(attempt)


# -- fence baseline and floors ----------------------------------------------------------------------------


def _raw_fence(client: Client, pool: int) -> Attempt:
    params: dict[str, Any] = {"resource": f"f{client.worker}", "token": 0, "owner": client.owner}

    def attempt() -> bool:
        params["token"] += 1
        client.cur.execute(client.q(sqltext.RAW_FENCE), params)
        return client.cur.fetchone() is not None

    return Attempt(attempt)


def _select_one(client: Client, pool: int) -> Attempt:
    def attempt() -> bool:
        client.cur.execute(sqltext.SELECT_ONE)
        return client.cur.fetchone() is not None

    return Attempt(attempt)


def _commit_floor(client: Client, pool: int) -> Attempt:
    # txid_current() gives the implicit transaction an xid, so its commit writes a commit record; but a
    # transaction that wrote no other WAL commits without waiting for the flush (RecordTransactionCommit
    # waits only when the transaction wrote WAL), so this is the floor of a commit, not of a durable one.
    def attempt() -> bool:
        client.cur.execute(sqltext.COMMIT_FLOOR)
        return client.cur.fetchone() is not None

    return Attempt(attempt)


def _flush_floor(client: Client, pool: int) -> Attempt:
    # One transactional WAL record (a logical message, no table) and the commit that waits for its flush
    # with synchronous_commit = on: the floor of any durable write, such as a grant.
    def attempt() -> bool:
        client.cur.execute(sqltext.FLUSH_FLOOR)
        return client.cur.fetchone() is not None

    return Attempt(attempt)


def _advisory(client: Client, lock: int) -> Attempt:
    params = {"lock": lock}

    def attempt() -> bool:
        client.cur.execute(sqltext.ADVISORY_TRY_XACT, params)
        return bool(client.cur.fetchone()[0])

    return Attempt(attempt)


def _advisory_pool(client: Client, pool: int) -> Attempt:
    # A lock of this client's own: always free, released when the implicit transaction ends.
    return _advisory(client, client.worker + 1)


def _advisory_hot(client: Client, pool: int) -> Attempt:
    return _advisory(client, HOT_ADVISORY_LOCK)


def _cycled_pool(worker: int, pool: int) -> Any:
    """The client's free keys in order; past the end it wraps (those attempts fail and are counted)."""
    n = 0
    while True:
        yield pool_key(worker, n % pool)
        n += 1


# Arm names as printed. The scenario lists below give the order of the table.
LEASE = "lease"
LEASE_EVENTS = "lease+events"
LEASE_BEFORE = "lease, SQL of version 6 (before)"
LEASE_TEXT = "lease, as text (prepare=False)"
LEASE_FUNCTION = "lease, renew through lease_renew() (before)"
NAIVE = "read-then-CAS"
SHEDLOCK = "ShedLock upsert"
SHEDLOCK_UPDATE = "ShedLock UPDATE"
SHEDLOCK_EXTEND = "ShedLock extend"
ADVISORY = "advisory xact lock"
SELECT1 = "SELECT 1"
COMMIT = "commit (txid_current)"
FLUSHED_COMMIT = "durable commit (1 WAL record, flushed)"
FENCE = "FenceStore.accept"
RAW_FENCE = "fence upsert (SQL)"

_BUILDERS: dict[tuple[str, str], Callable[[Client, int], Attempt]] = {
    ("floor", SELECT1): _select_one,
    ("floor", COMMIT): _commit_floor,
    ("floor", FLUSHED_COMMIT): _flush_floor,
    ("success", LEASE): _lease_pool,
    ("success", LEASE_EVENTS): _lease_pool_events,
    ("success", LEASE_BEFORE): _before_pool,
    ("success", LEASE_TEXT): _text_pool,
    ("success", NAIVE): _naive_pool,
    ("success", SHEDLOCK): _shed_pool,
    ("success", ADVISORY): _advisory_pool,
    ("hot", LEASE): _lease_hot,
    ("hot", LEASE_BEFORE): _before_hot,
    ("hot", LEASE_TEXT): _text_hot,
    ("hot", NAIVE): _naive_hot,
    ("hot", SHEDLOCK): _shed_hot,
    ("hot", SHEDLOCK_UPDATE): _shed_update_hot,
    ("hot", ADVISORY): _advisory_hot,
    ("handoff", LEASE): _lease_handoff,
    ("handoff", LEASE_EVENTS): _lease_handoff_events,
    ("handoff", NAIVE): _naive_handoff,
    ("handoff", SHEDLOCK): _shed_handoff,
    ("renew", LEASE): _lease_renew,
    ("renew", LEASE_BEFORE): _before_renew,
    ("renew", LEASE_TEXT): _text_renew,
    ("renew", LEASE_FUNCTION): _function_renew,
    ("renew", NAIVE): _naive_renew,
    ("renew", SHEDLOCK_EXTEND): _shed_renew,
    ("renew-paced", LEASE): _lease_renew,
    ("renew-paced", NAIVE): _naive_renew,
    ("renew-paced", SHEDLOCK_EXTEND): _shed_renew,
    ("fence", FENCE): _fence_accept,
    ("fence", RAW_FENCE): _raw_fence,
    ("many", LEASE): _lease_many,
    ("many", NAIVE): _naive_many,
    ("many", SHEDLOCK): _shed_many,
    ("pressure", LEASE): _lease_renew,
}
