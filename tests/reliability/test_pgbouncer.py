"""Everything works behind pgbouncer in transaction pooling mode: the store keeps no session state but its
prepared statements, which any server session may lack (the call then prepares it there).

Debian's ``pgbouncer``, started on a free port in front of the test server (``LEASE_TEST_DSN``'s PostgreSQL
or the embedded one), with a pool of three server sessions so that consecutive transactions of one client
land on different sessions. The outage tests put it in front of a private server they can stop.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import psycopg2
import psycopg2.extensions
import pytest

from airflow_lease_provider.core import (
    DuplicatePublish,
    FenceStore,
    LeaseStore,
    LeaseStoreUnavailable,
    StaleFencingToken,
)
from tests.pg import EmbeddedServer
from tests.reliability.outage import Call, start, stop
from tests.reliability.pgbouncer import PgBouncer

pytestmark = pytest.mark.needs("pgbouncer")

#: What a deployment in front of the lease store should set (docs/reliability.md): a query waiting for a
#: server session fails after a few seconds (at most the store's connect timeout) instead of 120 s, and a
#: server that comes back is retried after 1 s instead of 15 s.
RECOMMENDED = {"query_wait_timeout": "3", "server_login_retry": "1"}


@pytest.fixture
def bouncer(pg_dsn: str) -> Iterator[PgBouncer]:
    pgb = PgBouncer(pg_dsn, RECOMMENDED)
    yield pgb
    pgb.stop()


def test_acquire_renew_release_keeper_and_fence_through_transaction_pooling(bouncer: PgBouncer, schema: str) -> None:
    store = LeaseStore(bouncer.dsn, schema=schema)
    fences = FenceStore(bouncer.dsn, schema=schema)
    assert store.ensure_schema() >= 1  # migrations under a transaction-scoped advisory lock
    lease = store.acquire("job", owner="run-1", ttl=timedelta(seconds=2))
    assert lease is not None
    assert store.acquire("job", owner="run-2", ttl=timedelta(seconds=2)) is None
    with store.keep(lease) as keeper:
        for _ in range(8):  # 4 s of work on a 2 s lease: only renewals keep it
            time.sleep(0.5)
            keeper.check()
            assert store.acquire("job", owner="run-2", ttl=timedelta(seconds=2)) is None
        assert keeper.renewals >= 4 and not keeper.lost
        current = keeper.lease
        assert fences.accept("blog", current.token, key="job", owner="run-1")
        with pytest.raises(StaleFencingToken):
            fences.guard("blog", current.token, key="job")
        with fences.transaction("articles", current.token, key="job", owner="run-1", idempotency_key="slot-1") as cur:
            cur.execute("SELECT 1")
        with pytest.raises(DuplicatePublish):
            with fences.transaction("articles", current.token + 1, key="job", idempotency_key="slot-1"):
                pass
    assert store.holder("job") is None  # released on exit
    nxt = store.acquire("job", owner="run-2", ttl=timedelta(seconds=2))
    assert nxt is not None and nxt.token == lease.token + 1
    assert store.renew(nxt) is not None
    assert store.force_release("job", by="admin").token == nxt.token
    assert store.release(nxt) is False  # its token was bumped
    assert fences.current("articles", key="job") == current.token
    kinds = {e.kind for e in store.events.query(key="job")}
    assert {"acquired", "released", "force_released"} <= kinds
    # The caller's own transaction, through the pooler.
    conn = psycopg2.connect(bouncer.dsn)
    try:
        with conn, conn.cursor() as cur:
            fences.advance_in(cur, "blog", current.token + 5, key="job")
    finally:
        conn.close()
    assert fences.current("blog", key="job") == current.token + 5


def test_no_session_state_is_left_on_pooled_sessions(bouncer: PgBouncer, schema: str) -> None:
    store = LeaseStore(bouncer.dsn, schema=schema, statement_timeout=timedelta(milliseconds=1234))
    fences = FenceStore(bouncer.dsn, schema=schema, statement_timeout=timedelta(milliseconds=1234))
    for i in range(20):
        lease = store.acquire(f"job-{i % 3}", owner=f"run-{i}", ttl=timedelta(seconds=5))
        if lease is not None:
            fences.accept(f"blog-{i % 3}", lease.token, key=lease.key)
            store.release(lease)
    # Every pooled server session, as another client of the pooler sees it.
    conns = [psycopg2.connect(bouncer.dsn) for _ in range(3)]
    try:
        for conn in conns:
            with conn.cursor() as cur:
                cur.execute("SHOW statement_timeout")
                assert cur.fetchone()[0] in ("0", "0ms"), "the store's timeout leaked into a pooled session"
                cur.execute("SHOW search_path")
                assert schema not in cur.fetchone()[0]
                cur.execute("SELECT name FROM pg_prepared_statements")
                names = [row[0] for row in cur.fetchall()]
                assert all(n.startswith("airflow_lease_") for n in names), names  # its statements, nothing else
            conn.rollback()
    finally:
        for conn in conns:
            conn.close()


def _run_all(work: Callable[[int], None], count: int, *, timeout: float) -> None:
    """``work(0)`` ... ``work(count - 1)`` in threads at once, until each is done (or ``timeout`` s each)."""
    threads = [threading.Thread(target=work, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def test_prepared_statements_through_transaction_pooling(
    bouncer: PgBouncer, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Six clients on a pool of three server sessions: a client's consecutive calls land on different
    sessions, which may or may not hold its statements. Every answer is right and each write ran once."""
    caplog.set_level(logging.DEBUG, logger="airflow_lease_provider.core.db")
    LeaseStore(bouncer.dsn, schema=schema).ensure_schema()
    problems: list[str] = []
    everyone = threading.Barrier(6, timeout=30)  # all hold their own key before and while they try others'

    def client(n: int) -> None:
        store = LeaseStore(bouncer.dsn, schema=schema, record_events=n % 2 == 0)
        try:
            lease = store.acquire(f"job-{n}", owner=f"a{n}", ttl=timedelta(seconds=30))
            assert lease is not None
            everyone.wait()
            for i in range(30):
                renewed = store.renew(lease)
                if renewed is None or renewed.token != lease.token:
                    problems.append(f"client {n}: renewal {i} gave {renewed}")
                    return
                lease = renewed
                attempt = store.try_acquire(f"job-{(n + 1) % 6}", owner=f"b{n}", ttl=timedelta(seconds=30))
                if attempt.acquired or attempt.holder is None or attempt.holder.owner != f"a{(n + 1) % 6}":
                    problems.append(f"client {n}: try_acquire of job-{(n + 1) % 6} gave {attempt}")
                held = store.holder(f"job-{n}")
                if held is None or (held.owner, held.token) != (f"a{n}", lease.token):
                    problems.append(f"client {n}: holder read {held}")
            everyone.wait()
            if not store.release(lease):
                problems.append(f"client {n}: release refused")
            again = store.acquire(f"job-{n}", owner=f"c{n}", ttl=timedelta(seconds=30))
            if again is None or again.token != lease.token + 1:  # one token per grant: no acquire ran twice
                problems.append(f"client {n}: the next grant has token {again and again.token}, not {lease.token + 1}")
        except Exception as exc:  # reported below with the rest
            problems.append(f"client {n}: {exc!r}")
        finally:
            store.close()

    _run_all(client, 6, timeout=60)
    assert problems == []
    messages = [r.getMessage() for r in caplog.records if r.name == "airflow_lease_provider.core.db"]
    assert any("is not prepared in this server session" in m for m in messages), "no call met a session without it"


def test_contenders_through_the_pooler_get_one_holder_at_a_time(bouncer: PgBouncer, schema: str) -> None:
    LeaseStore(bouncer.dsn, schema=schema).ensure_schema()
    grants: list[tuple[int, str]] = []
    problems: list[str] = []
    lock = threading.Lock()

    def contend(worker: int) -> None:
        store = LeaseStore(bouncer.dsn, schema=schema, record_events=False)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            lease = store.acquire("hot", owner=f"w{worker}", ttl=timedelta(seconds=5))
            if lease is None:
                time.sleep(0.005)
                continue
            held = store.holder("hot")
            if held is None or held.owner != f"w{worker}":
                problems.append(f"w{worker} holds token {lease.token} but the store says {held}")
            with lock:
                grants.append((lease.token, lease.owner))
            store.release(lease)
        store.close()

    _run_all(contend, 8, timeout=30)
    tokens = [t for t, _ in grants]
    assert problems == []
    assert len(tokens) >= 20 and len(tokens) == len(set(tokens))


# -- the server behind the pooler goes away ---------------------------------------------------------



def test_server_down_behind_the_pooler_fails_closed_and_the_next_acquire_proceeds(
    server: EmbeddedServer, private: str
) -> None:
    pgb = PgBouncer(server.dsn, RECOMMENDED)
    try:
        store = LeaseStore(pgb.dsn, schema=private)
        lease = store.acquire("job", owner="run-1", ttl=timedelta(seconds=30))
        assert lease is not None and store.release(lease)
        stop(server)
        started = time.monotonic()
        with pytest.raises(LeaseStoreUnavailable):
            store.acquire("job", owner="run-2", ttl=timedelta(seconds=30))
        assert time.monotonic() - started < 10
        start(server)
        deadline = time.monotonic() + 10
        nxt = None
        while nxt is None:
            try:
                nxt = store.acquire("job", owner="run-2", ttl=timedelta(seconds=30))
            except LeaseStoreUnavailable:
                assert time.monotonic() < deadline, "the pooler did not reconnect to the server"
                time.sleep(0.2)
        assert nxt.token == lease.token + 1
    finally:
        pgb.stop()


def test_server_down_behind_a_default_pooler_still_fails_closed_within_the_timeouts(
    server: EmbeddedServer, private: str
) -> None:
    """With pgbouncer's defaults a query waits up to query_wait_timeout (120 s) for a server session, and
    the store's statement_timeout (enforced by the server it never reaches) does not help: the client
    needs a deadline of its own for the promise "fails closed within the connect timeout" to hold."""
    pgb = PgBouncer(server.dsn)
    try:
        store = LeaseStore(
            pgb.dsn, schema=private, connect_timeout=timedelta(seconds=2), statement_timeout=timedelta(seconds=2)
        )
        store.ensure_schema()
        stop(server)
        call = Call(lambda: store.acquire("job", owner="run-1", ttl=timedelta(seconds=30)))
        finished = call.wait(7)
    finally:
        pgb.stop()  # closes the client's connection, so a waiting call returns
    call.wait(10)
    assert finished, "acquire was still waiting 7 s after the server behind pgbouncer went down (timeouts 2 s + 2 s)"
    assert isinstance(call.error, LeaseStoreUnavailable)


def test_read_committed_is_pinned_through_transaction_pooling(pg_dsn: str) -> None:
    """A database whose default isolation is REPEATABLE READ, reached through pgbouncer in transaction
    pooling mode: the store's SET LOCAL isolation travels with each statement, so a contended acquire
    still reports the holder instead of failing with a serialization error (issue 10, item 8)."""
    from psycopg2 import sql

    from tests.core.test_isolation import contended
    from tests.pg import execute, q

    name = "lease_rr_" + uuid.uuid4().hex[:8]
    execute(pg_dsn, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        execute(pg_dsn, sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'")
                .format(sql.Identifier(name)))
        direct = psycopg2.extensions.make_dsn(pg_dsn, dbname=name)
        pgb = PgBouncer(direct, RECOMMENDED)
        try:
            store = LeaseStore(pgb.dsn, schema="airflow_lease")
            old = store.acquire("job", owner="run-0", ttl=timedelta(minutes=5))
            assert old is not None and store.release(old)
            take = q(
                "UPDATE {schema}.lease SET owner = 'run-1', token = token + 1, acquired_at = clock_timestamp(), "
                "renewed_at = clock_timestamp(), expires_at = clock_timestamp() + interval '5 minutes', "
                "released_at = NULL WHERE key = %s", "airflow_lease",
            )
            got = contended(direct, take, ("job",), lambda: store.try_acquire("job", "run-2", timedelta(minutes=5)))
            assert got.lease is None and got.holder is not None and got.holder.owner == "run-1"
            # Nothing was left in the pooled sessions: they still run at the database's default.
            conn = psycopg2.connect(pgb.dsn)
            with conn.cursor() as cur:
                cur.execute("SHOW transaction_isolation")
                assert cur.fetchone()[0] == "repeatable read"
            conn.close()
            store.close()
        finally:
            pgb.stop()
    finally:
        execute(pg_dsn, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
