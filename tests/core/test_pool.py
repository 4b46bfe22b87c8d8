"""``pool_size``: the stores of one process share a few connections (core/db/pool.py), against real servers.

Each test goes through the store's own operations (acquire, renew, release, a keeper, the schema on
first use); the server is the test server, a pgbouncer in transaction pooling mode in front of it, or a
throwaway cluster with a small ``max_connections``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from airflow_lease_provider.core import LeaseStore, LeaseStoreUnavailable
from airflow_lease_provider.core.db import pool as pool_module
from airflow_lease_provider.core.errors import InvalidArgument
from tests.pg import drop_schema, execute, new_schema_name, server_programs

TTL = timedelta(seconds=30)


def _pool_of(store: LeaseStore) -> pool_module.ConnectionPool:
    return store.db._shared_pool()


def _backend_of(store: LeaseStore) -> int:
    """The server pid behind the store's pooled connection, read on that connection inside an operation."""
    with store.db.transaction() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return int(cur.fetchone()[0])


@pytest.fixture
def app_name() -> str:
    # A pool is per (server, settings): a name of the test's own gives each test a fresh pool.
    return f"lease-pool-test-{new_schema_name()[-8:]}"


def _stores(dsn: str, schema: str, app: str, n: int, size: int, **kwargs: object) -> list[LeaseStore]:
    stores = [
        LeaseStore(dsn, schema=schema, idle_close=timedelta(0), pool_size=size, **kwargs)  # type: ignore[arg-type]
        for _ in range(n)
    ]
    for s in stores:
        s.db.application_name = app
    return stores


def test_pool_size_is_validated(pg_dsn: str) -> None:
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(InvalidArgument):
            LeaseStore(pg_dsn, pool_size=bad)  # type: ignore[arg-type]


def test_stores_of_a_process_share_one_connection_and_each_operation_gives_it_back(
    pg_dsn: str, schema: str, app_name: str
) -> None:
    a, b = _stores(pg_dsn, schema, app_name, 2, size=4)
    lease = a.acquire("k", "owner-a", TTL)
    assert lease is not None
    renewed = b.renew(lease)  # another store of the same process, same server: the same connection
    assert renewed is not None and renewed.token == lease.token
    assert a.release(renewed)
    pool = _pool_of(a)
    assert pool is _pool_of(b)
    assert pool.connects == 1, "every operation after the first reused the pooled connection"
    assert a.db.connects + b.db.connects == 1
    assert a.db._conn is None and b.db._conn is None, "no store keeps the connection after its operation"


def test_no_session_state_survives_an_operation_on_a_pooled_connection(pg_dsn: str, schema: str, app_name: str) -> None:
    (store,) = _stores(pg_dsn, schema, app_name, 1, size=1)
    default_timeout = execute(pg_dsn, "SELECT current_setting('statement_timeout')")[0][0]
    store.ensure_schema()  # a transaction with a transaction-scoped advisory lock
    lease = store.acquire("k", "o", TTL)  # SET LOCAL statement_timeout, isolation, synchronous_commit
    assert lease is not None
    pid = _backend_of(store)
    with store.db.transaction() as cur:
        cur.execute("SELECT pg_backend_pid()")
        assert cur.fetchone()[0] == pid, "the one pooled connection was reused"
    # Looked at from outside, between operations: idle, nothing held, no setting moved.
    rows = execute(
        pg_dsn,
        "SELECT state, (SELECT count(*) FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory') "
        "FROM pg_stat_activity a WHERE pid = %s",
        (pid,),
    )
    assert rows == [("idle", 0)]
    conn, new = _pool_of(store).get(lambda: pytest.fail("the pooled connection should be reused"), 1.0)
    try:
        assert not new
        with conn.cursor() as cur:
            cur.execute(
                "SELECT current_setting('statement_timeout'), current_setting('transaction_isolation'), "
                "current_setting('synchronous_commit')"
            )
            timeout, isolation, sync = cur.fetchone()
        assert timeout == default_timeout
        assert isolation == execute(pg_dsn, "SELECT current_setting('transaction_isolation')")[0][0]
        assert sync == execute(pg_dsn, "SELECT current_setting('synchronous_commit')")[0][0]
    finally:
        _pool_of(store).put(conn)


def test_a_statement_prepared_by_one_store_does_not_trouble_the_next(pg_dsn: str, schema: str, app_name: str) -> None:
    # A store with a positive idle_close prepares its hot statements (from their second use), then its
    # idle connection goes back to the pool with them; the next store finds them there by name.
    (holder,) = _stores(pg_dsn, schema, app_name, 1, size=1)
    holder.db.idle_close = timedelta(seconds=30)
    lease = holder.acquire("k", "o", TTL)
    assert lease is not None
    for _ in range(3):
        lease = holder.renew(lease)
        assert lease is not None
    assert holder.db._prepared_on, "the renew statement was prepared on the connection"
    holder.db._close_if_idle(time.monotonic() + 60)  # as the watchdog does: back to the pool
    assert holder.db._conn is None
    (other,) = _stores(pg_dsn, schema, app_name, 1, size=1)
    other.db.idle_close = timedelta(seconds=30)
    for _ in range(4):
        lease = other.renew(lease)
        assert lease is not None
    assert other.db.connects == 0, "the other store worked on the same pooled connection"
    assert other.release(lease)


def test_the_pool_is_bounded_and_a_wait_past_connect_timeout_fails_closed(
    pg_dsn: str, schema: str, app_name: str
) -> None:
    busy, waiting = _stores(pg_dsn, schema, app_name, 2, size=1, connect_timeout=timedelta(seconds=1))
    busy.ensure_schema()
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with busy.db.transaction() as cur:
            cur.execute("SELECT 1")
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert inside.wait(10)
        started = time.monotonic()
        with pytest.raises(LeaseStoreUnavailable, match="pool"):
            waiting.acquire("k", "o", TTL)
        assert 0.9 <= time.monotonic() - started < 3
    finally:
        leave.set()
        thread.join()
    assert waiting.acquire("k", "o", TTL) is not None, "once the connection is back it serves the next"
    assert _pool_of(busy).open == 1


def test_an_unused_pooled_connection_is_closed_within_the_linger(pg_dsn: str, schema: str, app_name: str) -> None:
    (store,) = _stores(pg_dsn, schema, app_name, 1, size=2)
    lease = store.acquire("k", "o", TTL)
    assert lease is not None
    pid = _backend_of(store)
    deadline = time.monotonic() + pool_module.LINGER + 2.0
    while execute(pg_dsn, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)):
        assert time.monotonic() < deadline, "the idle pooled connection outlived the linger"
        time.sleep(0.05)
    assert _pool_of(store).open == 0
    assert store.renew(lease) is not None  # and the next operation connects again


def test_a_pooled_connection_killed_while_idle_is_replaced(pg_dsn: str, schema: str, app_name: str) -> None:
    (store,) = _stores(pg_dsn, schema, app_name, 1, size=2)
    lease = store.acquire("k", "o", TTL)
    assert lease is not None
    pid = _backend_of(store)
    execute(pg_dsn, "SELECT pg_terminate_backend(%s)", (pid,))
    time.sleep(0.1)
    renewed = store.renew(lease)  # resent once on a new connection, as for a held connection
    assert renewed is not None
    assert _pool_of(store).open <= 2


@pytest.mark.needs("pgbouncer")
def test_many_keepers_through_pgbouncer_transaction_pooling(pg_dsn: str, schema: str, app_name: str) -> None:
    from tests.reliability.pgbouncer import PgBouncer

    bouncer = PgBouncer(pg_dsn)  # transaction pooling, 3 server sessions
    try:
        stores = _stores(bouncer.dsn, schema, app_name, 40, size=4)
        leases = []
        errors: list[BaseException] = []

        def take(i: int) -> None:
            try:
                lease = stores[i].acquire(f"k{i}", f"o{i}", timedelta(seconds=3))
                assert lease is not None
                leases.append(lease)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=take, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        keepers = [stores[int(lease.key[1:])].keep(lease, renew_every=timedelta(seconds=0.5)) for lease in leases]
        time.sleep(2.5)  # five renewals each, 40 keepers on at most 4 client connections to pgbouncer
        assert not [k for k in keepers if k.lost]
        assert all(k.renewals >= 3 for k in keepers)
        for k in keepers:
            assert k.stop(release=True)
        assert _pool_of(stores[0]).connects <= 4 + 2, "40 stores renewing 5 times each reused a few connections"
    finally:
        bouncer.stop()


# -- the burst the pool is for ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_server() -> Iterator[str]:
    """A throwaway cluster with ``max_connections = 12`` (the test server's setting is not ours to change)."""
    from bench.cluster import ThrowawayCluster

    cluster = ThrowawayCluster({"max_connections": "12", "superuser_reserved_connections": "2"}, server_programs())
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()


def _burst(dsn: str, pool_size: int | None, n: int = 60) -> tuple[int, list[str]]:
    schema = new_schema_name()
    # Created first, so that the burst is acquires, not 60 schema creations on one advisory lock.
    LeaseStore(dsn, schema=schema).ensure_schema()
    stores = [
        LeaseStore(dsn, schema=schema, idle_close=timedelta(0), pool_size=pool_size, record_events=True)
        for _ in range(n)
    ]
    go = threading.Event()
    held: list[int] = []
    errors: list[str] = []

    def take(i: int) -> None:
        go.wait()
        try:
            if stores[i].acquire(f"burst-{i}", f"o{i}", TTL) is not None:
                held.append(i)
        except LeaseStoreUnavailable as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    drop_schema(dsn, schema)
    return len(held), errors


def test_a_burst_of_acquires_beyond_max_connections_all_succeed_with_a_pool(small_server: str) -> None:
    # 60 stores in one process acquire at the same instant against 10 usable server connections. With
    # a connection each (pool_size=None) many find "too many clients" and fail closed; sharing 4, every
    # acquire waits its turn and succeeds.
    held, errors = _burst(small_server, pool_size=4)
    assert errors == []
    assert held == 60


def test_without_the_pool_the_same_burst_fails_closed(small_server: str) -> None:
    # The control: the failure the pool removes is real on this server (and still fails closed).
    held, errors = _burst(small_server, pool_size=None)
    assert errors, "the burst did not exceed the server's connections: the test above proves nothing"
    assert all("too many clients" in e or "unreachable" in e for e in errors)
    assert held + len(errors) == 60


def test_a_forked_child_neither_uses_nor_closes_the_parents_pooled_connections(
    pg_dsn: str, schema: str, app_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing

    monkeypatch.setattr(pool_module, "LINGER", 60.0)  # the parent's idle connection stays for the test
    (store,) = _stores(pg_dsn, schema, app_name, 1, size=2)
    assert store.acquire("parent", "o", TTL) is not None
    assert _pool_of(store).open == 1  # idle in the pool as the child is forked

    def child(queue: multiprocessing.Queue) -> None:
        import gc

        lease = store.acquire("child", "o", TTL)
        gc.collect()  # the parent's pool is dropped here: its connections must not be closed by it
        queue.put((lease is not None, _pool_of(store).connects))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    ok, child_connects = queue.get(timeout=30)
    proc.join(30)
    assert ok and child_connects == 1, "the child opened a connection of its own"
    conn, new = _pool_of(store).get(lambda: pytest.fail("the parent's idle connection is gone"), 1.0)
    try:
        assert not new
        with conn.cursor() as cur:
            cur.execute("SELECT 1")  # the server session was not terminated by the child
            assert cur.fetchone() == (1,)
    finally:
        _pool_of(store).put(conn)
