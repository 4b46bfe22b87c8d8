"""The fence on any DB-API connection (core/dbapi_fence.py), on real SQLite files and real PostgreSQL.

Every test runs on both dialects with the same statements; the concurrency tests use real connections
in threads (SQLite: one database file; PostgreSQL: one table). That the rule is the one of every fence
(``core.fencing.decide``) is tests/core/test_fence_parity.py's.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import (
    DuplicatePublish,
    EventKind,
    InvalidArgument,
    LeaseStore,
    LeaseStoreUnavailable,
    StaleFencingToken,
)
from airflow_lease_provider.core.dbapi_fence import DbApiFence, UnsupportedDialect
from tests.pg import execute

# The caller's own table in the target ({table}: Target.sql fills in a fixed quoted name).
CREATE = "CREATE TABLE {table} (slot TEXT, token BIGINT)"
INSERT = "INSERT INTO {table} (slot, token) VALUES ({slot}, {token})"
SELECT_ROWS = "SELECT slot, token FROM {table}"
SELECT_SLOTS = "SELECT slot FROM {table}"
SELECT_TOKENS = "SELECT token FROM {table}"
STORE_A = str(uuid.UUID(int=1))
STORE_B = str(uuid.UUID(int=2))


class Target:
    """A fence target: a DbApiFence, and how to read the caller's table back."""

    def __init__(self, name: str, connect: Callable[[], Any], schema: str | None) -> None:
        self.name = name
        self.connect = connect
        self.schema = schema

    def fence(self, **kwargs: Any) -> DbApiFence:
        return DbApiFence(self.connect, dialect=self.name, where=f"test {self.name}", schema=self.schema, **kwargs)

    def sql(self, template: str) -> str:
        """A test statement with the caller's table (a fixed, quoted name) and the driver's placeholders."""
        table = '"articles"' if self.schema is None else '"' + self.schema + '"."articles"'
        marks = {"slot": ":slot", "token": ":token"} if self.name == "sqlite" else {"slot": "%(slot)s", "token": "%(token)s"}
        return template.format(table=table, **marks)

    def run(self, statement: str) -> list[tuple[Any, ...]]:
        conn = self.connect()
        try:
            cur = conn.cursor()
            cur.execute(statement)
            rows = cur.fetchall() if cur.description else []
            conn.commit()
            return rows
        finally:
            conn.close()



@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    if request.param == "sqlite":
        path = tmp_path / "target.db"
        t = Target("sqlite", lambda: sqlite3.connect(path, timeout=30), None)
    else:
        pg_dsn = request.getfixturevalue("pg_dsn")
        schema = request.getfixturevalue("schema")
        execute(pg_dsn, sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        t = Target("postgres", lambda: psycopg2.connect(pg_dsn), schema)
    t.run(t.sql(CREATE))
    yield t


def test_the_rule_larger_accepted_same_grant_again_equal_or_smaller_refused(target: Target) -> None:
    fence = target.fence()
    assert fence.current("blog", key="job") is None
    assert fence.advance("blog", 5, key="job", owner="run-a", store_id=STORE_A).accepted
    assert fence.advance("blog", 5, key="job", owner="run-a", store_id=STORE_A).accepted  # the same grant again
    assert fence.advance("blog", 5, key="job", owner="run-b", store_id=STORE_A).outcome == "stale"
    assert fence.advance("blog", 5, key="job", owner=None).outcome == "stale"  # no owner: never the same grant
    refused = fence.advance("blog", 4, key="job", owner="run-z")
    assert refused.outcome == "stale" and refused.current_token == 5
    other = fence.advance("blog", 5, key="job", owner="run-a", store_id=STORE_B)
    assert other.reason == "other_store" and other.current_store == STORE_A
    assert fence.advance("blog", 2, key="other-job").accepted  # tokens of another key are not compared
    assert fence.advance("blog", 6, key="job").accepted
    assert fence.current("blog", key="job") == 6
    assert fence.tokens("blog") == {"job": 6, "other-job": 2}


def test_a_stale_transaction_writes_nothing_and_an_accepted_one_commits_with_the_fence(target: Target) -> None:
    ledger_store_events: list[Any] = []

    class Ledger:
        def record(self, kind: Any, key: str, **kwargs: Any) -> bool:
            ledger_store_events.append((kind, key, kwargs))
            return True

    fence = target.fence(ledger=Ledger())  # type: ignore[arg-type]
    insert = target.sql(INSERT)
    with fence.transaction("blog", 7, key="job", owner="run-b") as cur:
        cur.execute(insert, {"slot": "a", "token": 7})
    with pytest.raises(StaleFencingToken) as info, fence.transaction("blog", 6, key="job", owner="run-a") as cur:
        cur.execute(insert, {"slot": "zombie", "token": 6})
    assert info.value.current == 7 and info.value.token == 6
    assert target.run(target.sql(SELECT_ROWS)) == [("a", 7)]
    ((kind, key, recorded),) = ledger_store_events
    assert kind == EventKind.FENCE_REJECTED and key == "blog" and recorded["token"] == 6
    assert recorded["owner"] == "run-a" and recorded["detail"]["current_token"] == 7


def test_an_error_in_the_callers_sql_rolls_the_fence_back(target: Target) -> None:
    fence = target.fence()
    error = sqlite3.Error if target.name == "sqlite" else psycopg2.Error
    with pytest.raises(error), fence.transaction("blog", 3, key="job") as cur:
        cur.execute("SELECT * FROM no_such_table")
    assert fence.current("blog", key="job") is None  # the fence did not advance
    with pytest.raises(ZeroDivisionError), fence.transaction("blog", 3, key="job"):
        raise ZeroDivisionError
    assert fence.current("blog", key="job") is None


def test_a_connection_in_autocommit_mode_still_writes_in_one_transaction(target: Target) -> None:
    """A driver connection made in autocommit mode (psycopg2 ``autocommit = True``; a hook may hand one
    out) would commit the fence advance and each statement on its own: a failing write would leave the
    fence advanced and half the rows in. The fence turns autocommit off on its own connection first."""

    def autocommit() -> Any:
        conn = target.connect()
        if target.name == "postgres":
            conn.autocommit = True
        else:
            conn.isolation_level = None  # sqlite3's autocommit
        return conn

    fence = DbApiFence(autocommit, dialect=target.name, where="test autocommit", schema=target.schema)
    insert = target.sql(INSERT)
    with pytest.raises(ZeroDivisionError), fence.transaction("blog", 4, key="job", idempotency_key="once") as cur:
        cur.execute(insert, {"slot": "half", "token": 4})
        raise ZeroDivisionError
    assert fence.current("blog", key="job") is None  # the fence did not advance
    assert target.run(target.sql(SELECT_ROWS)) == []  # and nothing was written
    with fence.transaction("blog", 4, key="job", idempotency_key="once") as cur:  # the key was not used up
        cur.execute(insert, {"slot": "whole", "token": 4})
    assert target.run(target.sql(SELECT_ROWS)) == [("whole", 4)] and fence.current("blog", key="job") == 4


class _Sqlite312:
    """A sqlite3 connection as Python 3.12+ hands it out with ``autocommit=True`` or ``False`` (PEP 249
    transaction control; the venv's Python has only the legacy one), reproduced on a real connection:

    * ``True``: no implicit transaction, and ``commit()`` / ``rollback()`` do nothing (an explicit
      ``BEGIN`` stays open until committed in SQL, and is rolled back when the connection closes);
    * ``False``: a transaction is always open (``BEGIN`` again fails), ``commit()`` opens the next one;
      set to ``True``, it commits the open one and switches.
    Checked against the real 3.12.1 and 3.13.0 modules: a ``BEGIN IMMEDIATE`` ... ``commit()`` on an
    ``autocommit=True`` connection keeps nothing; ``BEGIN IMMEDIATE`` on an ``autocommit=False`` one
    raises "cannot start a transaction within a transaction"."""

    def __init__(self, path: Path, autocommit: bool) -> None:
        self._conn = sqlite3.connect(path, timeout=30, isolation_level=None)
        self._autocommit = autocommit
        if not autocommit:
            self._conn.execute("BEGIN")

    @property
    def autocommit(self) -> bool:
        return self._autocommit

    @autocommit.setter
    def autocommit(self, value: bool) -> None:
        if value and not self._autocommit and self._conn.in_transaction:
            self._conn.execute("COMMIT")
        self._autocommit = value

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction

    def cursor(self) -> sqlite3.Cursor:
        return self._conn.cursor()

    def commit(self) -> None:
        if not self._autocommit:
            self._conn.execute("COMMIT")
            self._conn.execute("BEGIN")

    def rollback(self) -> None:
        if not self._autocommit:
            self._conn.execute("ROLLBACK")
            self._conn.execute("BEGIN")

    def close(self) -> None:
        self._conn.close()  # an open transaction is rolled back


@pytest.mark.parametrize("autocommit", [True, False])
def test_a_python_312_sqlite_connection_in_either_autocommit_mode_commits_and_rolls_back(
    tmp_path: Path, autocommit: bool
) -> None:
    path = tmp_path / "t.db"
    fence = DbApiFence(lambda: _Sqlite312(path, autocommit), dialect="sqlite", where="sqlite 't'")
    with fence.transaction("blog", 3, key="job") as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS rows (v)")
        cur.execute("INSERT INTO rows VALUES (1)")
    with pytest.raises(ZeroDivisionError), fence.transaction("blog", 4, key="job") as cur:
        cur.execute("INSERT INTO rows VALUES (2)")
        raise ZeroDivisionError
    assert fence.advance("blog", 5, key="job").accepted and fence.current("blog", key="job") == 5
    check = sqlite3.connect(path)
    assert check.execute("SELECT v FROM rows").fetchall() == [(1,)]
    check.close()


def test_the_idempotency_key_is_used_once_and_a_refusal_does_not_use_it(target: Target) -> None:
    fence = target.fence()
    assert fence.advance("billing", 5, key="job", idempotency_key="2026-11-29").accepted
    with pytest.raises(DuplicatePublish), fence.transaction("billing", 9, key="job", idempotency_key="2026-11-29"):
        pass
    assert fence.current("billing", key="job") == 5  # a duplicate does not move the fence
    assert fence.advance("billing", 4, key="job", idempotency_key="2026-11-30").outcome == "stale"
    assert fence.advance("billing", 6, key="job", idempotency_key="2026-11-30").accepted  # the key was not used up
    # guard's decision gives the claim back when the side effect fails
    with pytest.raises(RuntimeError), fence.guard("billing", 7, key="job", owner="o", idempotency_key="2026-12-01"):
        raise RuntimeError("push failed")
    assert fence.advance("billing", 7, key="job", owner="o", idempotency_key="2026-12-01").accepted


def test_concurrent_writers_one_winner(target: Target) -> None:
    """Eight writers with the same token (different owners) race to publish the same slot's row: exactly
    one commits its row, the others are refused, and the fence holds the winner's token."""
    fence = target.fence()
    fence.ensure_schema()
    insert = target.sql(INSERT)
    start = threading.Barrier(8)
    results: dict[str, str] = {}

    def writer(owner: str) -> None:
        start.wait()
        try:
            with fence.transaction("race", 10, key="job", owner=owner) as cur:
                cur.execute(insert, {"slot": owner, "token": 10})
            results[owner] = "won"
        except StaleFencingToken:
            results[owner] = "refused"
        except Exception as exc:  # reported below, so a failure shows what happened
            results[owner] = repr(exc)

    threads = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results.values()) == ["refused"] * 7 + ["won"], results
    (winner,) = [o for o, r in results.items() if r == "won"]
    assert target.run(target.sql(SELECT_SLOTS)) == [(winner,)]
    assert fence.current("race", key="job") == 10


def test_concurrent_larger_tokens_leave_the_largest(target: Target) -> None:
    """Writers with tokens 1..8 at once: whatever the order, the fence ends at 8, each commit's row
    carries a token larger than every row committed before it, and token 8's row is there."""
    fence = target.fence()
    fence.ensure_schema()
    insert = target.sql(INSERT)
    start = threading.Barrier(8)
    order: list[int] = []
    lock = threading.Lock()

    def writer(token: int) -> None:
        start.wait()
        try:
            with fence.transaction("ladder", token, key="job", owner=f"o{token}") as cur:
                cur.execute(insert, {"slot": str(token), "token": token})
                with lock:  # still inside the transaction: the fence row is locked, so commits are in this order
                    order.append(token)
        except StaleFencingToken:
            pass

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert fence.current("ladder", key="job") == 8
    assert order == sorted(order) and order[-1] == 8
    assert sorted(int(r[0]) for r in target.run(target.sql(SELECT_TOKENS))) == order


def test_unreachable_target_fails_closed_without_the_password(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "target.db"
    fence = DbApiFence(lambda: sqlite3.connect(missing), dialect="sqlite", where="sqlite 'gone'")
    with pytest.raises(LeaseStoreUnavailable, match="fails closed"), fence.transaction("r", 1, key="k"):
        pytest.fail("the block ran")
    secret = "s3cr3t-pw"

    def connect() -> Any:
        return psycopg2.connect(f"postgresql://u:{secret}@127.0.0.1:1/db?connect_timeout=2")

    pg = DbApiFence(connect, dialect="postgresql", where="postgres 'down'", secrets=[secret])
    with pytest.raises(LeaseStoreUnavailable) as info:
        pg.advance("r", 1, key="k")
    assert secret not in str(info.value) and "postgres 'down'" in str(info.value)


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    def connect() -> sqlite3.Connection:
        return sqlite3.connect(tmp_path / "t.db")

    with pytest.raises(UnsupportedDialect, match="'mysql'.*postgres, sqlite"):
        DbApiFence(connect, dialect="mysql", where="x")
    with pytest.raises(InvalidArgument, match="schema"):
        DbApiFence(connect, dialect="sqlite", where="x", schema='main"; DROP TABLE x; --')
    with pytest.raises(InvalidArgument, match="connect"):
        DbApiFence("sqlite:///x", dialect="sqlite", where="x")  # type: ignore[arg-type]
    fence = DbApiFence(connect, dialect="sqlite", where="x")
    for kwargs, name in [
        ({"resource": "", "token": 1, "key": "k"}, "resource"),
        ({"resource": "r", "token": 0, "key": "k"}, "token"),
        ({"resource": "r", "token": True, "key": "k"}, "token"),
        ({"resource": "r", "token": 1, "key": ""}, "key"),
        ({"resource": "r", "token": 1, "key": "k", "store_id": "not-a-uuid"}, "store_id"),
        ({"resource": "r", "token": 1, "key": "k", "idempotency_key": ""}, "idempotency_key"),
    ]:
        with pytest.raises(InvalidArgument, match=name):
            fence.advance(**kwargs)
    assert not (tmp_path / "t.db").exists() or fence.current("r", key="k") is None


@pytest.mark.parametrize("database", [":memory:", ""])
def test_an_in_memory_or_temporary_sqlite_target_is_refused_by_name(database: str) -> None:
    """Each connection to ``:memory:`` (or ``""``, a temporary file) is a database of its own, gone when it
    closes: the fence could never be kept there. Refused with an error naming the target and why, not a
    driver's "no such table" on the first publish."""
    fence = DbApiFence(lambda: sqlite3.connect(database), dialect="sqlite", where="sqlite connection 'mem'")
    with pytest.raises(InvalidArgument) as refused:
        fence.advance("r", 1, key="k")
    assert "sqlite connection 'mem'" in str(refused.value) and "in-memory" in str(refused.value), refused.value


def test_a_refusal_is_recorded_in_a_real_lease_store_ledger(tmp_path: Path, store: LeaseStore) -> None:
    fence = DbApiFence(lambda: sqlite3.connect(tmp_path / "t.db"), dialect="sqlite", where="sqlite 't'",
                       ledger=store.events)
    fence.advance("blog", 3, key="job", owner="new")
    with pytest.raises(StaleFencingToken):
        fence.guard("blog", 2, key="job", owner="zombie")
    (event,) = store.events.query(key="blog", kind=EventKind.FENCE_REJECTED)
    assert event.owner == "zombie" and event.token == 2 and event.detail["fence_at"] == "sqlite 't'"


def test_a_ledger_that_cannot_be_written_does_not_hide_the_refusal(tmp_path: Path) -> None:
    """Recording is best effort: with the lease store down, the refusal is still StaleFencingToken."""
    down = LeaseStore("postgresql://nobody@127.0.0.1:1/none?connect_timeout=1")
    try:
        fence = DbApiFence(lambda: sqlite3.connect(tmp_path / "t.db"), dialect="sqlite", where="sqlite 't'",
                           ledger=down.events)
        fence.advance("blog", 3, key="job", owner="new")
        with pytest.raises(StaleFencingToken) as info:
            fence.guard("blog", 2, key="job", owner="zombie")
        assert info.value.current == 3 and fence.current("blog", key="job") == 3
    finally:
        down.close()


def _publish_in_a_process(path: str, owner: str, start: Any, results: Any) -> None:
    fence = DbApiFence(lambda: sqlite3.connect(path, timeout=30), dialect="sqlite", where="sqlite file")
    start.wait()
    try:
        with fence.transaction("race", 10, key="job", owner=owner) as cur:
            cur.execute('INSERT INTO "articles" (slot, token) VALUES (:slot, :token)', {"slot": owner, "token": 10})
        results.put((owner, "won"))
    except StaleFencingToken:
        results.put((owner, "refused"))
    except Exception as exc:
        results.put((owner, repr(exc)))


def test_concurrent_processes_on_one_sqlite_file_one_winner(tmp_path: Path) -> None:
    """Six processes (as six task processes on one host would) race on one SQLite file: one row, one winner."""
    import multiprocessing as mp

    path = str(tmp_path / "target.db")
    conn = sqlite3.connect(path)
    conn.execute('CREATE TABLE "articles" (slot TEXT, token BIGINT)')
    conn.commit()
    conn.close()
    DbApiFence(lambda: sqlite3.connect(path), dialect="sqlite", where="x").ensure_schema()
    ctx = mp.get_context("fork")
    start, results = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_publish_in_a_process, args=(path, f"p{i}", start, results)) for i in range(6)]
    for p in procs:
        p.start()
    outcome = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert sorted(outcome.values()) == ["refused"] * 5 + ["won"], outcome
    (winner,) = [o for o, r in outcome.items() if r == "won"]
    conn = sqlite3.connect(path)
    assert conn.execute('SELECT slot FROM "articles"').fetchall() == [(winner,)]
    conn.close()
