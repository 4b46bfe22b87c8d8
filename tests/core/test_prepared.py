"""Prepared statements: the hot queries are prepared on a connection from their second use, and every way a
server session can lack the statement (or hold a stale one) still gives the right answer, never runs a
statement twice, and needs no session state the caller must manage. Against real PostgreSQL; the same
through pgbouncer's transaction pooling is in tests/reliability/test_pgbouncer.py."""

from __future__ import annotations

import logging
from datetime import timedelta
from types import SimpleNamespace

import psycopg2
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import FenceStore, LeaseStore
from airflow_lease_provider.core.db import PREPARE_AFTER, named_queries, prepared_queries
from airflow_lease_provider.core.db.sqltext import PreparedTexts, stale_plan
from airflow_lease_provider.core.errors import InvalidArgument
from tests.pg import execute

TTL = timedelta(seconds=30)


def _session_statements(store: LeaseStore | FenceStore) -> set[str]:
    """The names of the prepared statements in the store's own server session."""
    with store.db._conn.cursor() as cur:
        cur.execute("SELECT name FROM pg_prepared_statements")
        return {row[0] for row in cur.fetchall()}


def _name(store: LeaseStore | FenceStore, query: str) -> str:
    """The prepared statement's name: a hash of the query, the same whatever its prefix."""
    prepared = store.db._statement(query, True, store.db._conn).prepared
    assert prepared is not None, f"{query} is not a [prepared] query"
    return prepared.name


def test_the_marked_queries_are_single_statements_with_every_value_a_parameter() -> None:
    queries = named_queries()
    assert {"acquire", "acquire_logged", "renew", "release", "release_logged", "holder", "fence_advance"} <= (
        prepared_queries()
    )
    for name in prepared_queries():
        prepared = PreparedTexts("", queries[name])
        body = prepared.prepare.split(" AS ", 1)[1].rsplit("; EXECUTE", 1)[0]
        assert ";" not in body, f"{name}: a PREPARE holds exactly one statement"
        assert "%(" not in body and "%s" not in body, f"{name}: a value left as text in the prepared statement"
        assert len(prepared.name) <= 63, "PostgreSQL truncates longer names"


def test_a_connection_prepares_on_the_second_use_and_executes_after(store: LeaseStore) -> None:
    assert PREPARE_AFTER == 2
    assert store.acquire("job", "a", TTL) is not None
    acquire = _name(store, "acquire_logged")  # the ledger is on
    assert acquire not in _session_statements(store), "a query used once on a connection is not prepared"
    for n in range(5):
        assert store.acquire("job", f"b{n}", TTL) is None  # held by a: every answer is still right
        holder = store.try_acquire("job", "c", TTL).holder
        assert holder is not None and holder.owner == "a"
    assert acquire in _session_statements(store)
    assert store.db._prepared_on >= {acquire}


def test_a_one_shot_connection_never_prepares(pg_dsn: str, schema: str) -> None:
    store = LeaseStore(pg_dsn, schema=schema, idle_close=timedelta(0))
    try:
        lease = store.acquire("job", "a", TTL)
        assert lease is not None
        for _ in range(4):
            lease = store.renew(lease)
            assert lease is not None
            assert store.db._conn is None and not store.db._prepared_on  # closed after each operation
    finally:
        store.close()


def test_prepare_false_sends_plain_text_only(pg_dsn: str, schema: str) -> None:
    store = LeaseStore(pg_dsn, schema=schema, prepare=False)
    try:
        lease = store.acquire("job", "a", TTL)
        for _ in range(4):
            lease = store.renew(lease)
        assert lease is not None and _session_statements(store) == set()
    finally:
        store.close()
    with pytest.raises(InvalidArgument, match="prepare"):
        LeaseStore(pg_dsn, schema=schema, prepare="yes")  # type: ignore[arg-type]


def _took(caplog: pytest.LogCaptureFixture, words: str) -> bool:
    return any(words in r.getMessage() for r in caplog.records if r.name == "airflow_lease_provider.core.db")


def test_a_session_that_lost_its_statements_prepares_them_again(
    store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="airflow_lease_provider.core.db")
    lease = store.acquire("job", "a", TTL)
    lease = store.renew(lease)
    lease = store.renew(lease)
    assert lease is not None and _name(store, "renew") in _session_statements(store)
    # What a pooler's server_reset_query (DISCARD ALL) or another session does to it.
    with store.db._conn.cursor() as cur:
        cur.execute("DEALLOCATE ALL")
    before = lease.expires_at
    lease = store.renew(lease)
    assert lease is not None and lease.expires_at >= before
    assert _took(caplog, "renew is not prepared in this server session")
    assert _name(store, "renew") in _session_statements(store)
    # The renewal ran once: the token is unchanged and the one row says so.
    rows = execute(store.db.dsn, sql.SQL("SELECT token, renewed_at FROM {}.lease WHERE key = 'job'").format(
        sql.Identifier(store.schema)))
    assert rows[0][0] == lease.token and rows[0][1] == lease.renewed_at


def test_a_statement_the_session_already_has_is_executed_not_prepared_twice(
    store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A pooler's session may hold a statement this client never prepared there (another client did)."""
    caplog.set_level(logging.DEBUG, logger="airflow_lease_provider.core.db")
    store.acquire("job", "a", TTL)
    text = PreparedTexts("", store.db.query_text("holder", store.db._conn))
    with store.db._conn.cursor() as cur:  # as if another client of the pooler had prepared it here
        cur.execute(text.prepare.split("; EXECUTE", 1)[0])
    store.db._uses[text.name] = PREPARE_AFTER  # this client would prepare now
    holder = store.holder("job")
    assert holder is not None and holder.owner == "a"
    assert text.name in store.db._prepared_on
    assert _took(caplog, "holder is already prepared in this server session")


def stale_plan_after_a_migration(dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    """A prepared ``SELECT * FROM f()`` whose function was dropped and created with other columns fails with
    "cached plan must not change result type" before it runs: the call prepares it again and goes on.
    (Also run against a server whose messages are in German: tests/reliability/test_translated_server.py.)"""
    caplog.set_level(logging.DEBUG, logger="airflow_lease_provider.core.db")
    store = LeaseStore(dsn, schema=schema, record_events=False)
    store.acquire("job", "a", TTL)
    store.acquire("job", "b", TTL)
    assert _name(store, "acquire") in _session_statements(store)
    # The function acquire calls (migrations/0011: with the holder's run columns; 0015: and the count epoch,
    # the last column of every row it returns).
    signature = "lease_acquire(text, text, interval, text, text, text, integer)"
    definition = execute(dsn, "SELECT pg_get_functiondef(%s::regprocedure)", (f'"{schema}".{signature}',))[0][0]
    changed = definition.replace("count_epoch bigint)", "count_epoch bigint, extra integer)", 1)
    changed = changed.replace("l.count_epoch;", "l.count_epoch, 0;")
    changed = changed.replace("l.count_epoch\n", "l.count_epoch, 0\n")
    assert changed != definition and changed.count(", 0") == definition.count(", 0") + 5, changed
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("DROP FUNCTION {}.lease_acquire(text, text, interval, text, text, text, integer)")
                        .format(sql.Identifier(schema)))
            cur.execute(changed)
    finally:
        conn.close()
    try:
        for _ in range(2):  # and the connection stays usable after it
            attempt = store.try_acquire("job", "c", TTL)
            assert attempt.holder is not None and attempt.holder.owner == "a"  # the new function's rows
        assert _name(store, "acquire") in _session_statements(store)
        assert _took(caplog, "acquire returns other columns since a migration")
    finally:
        store.close()


def test_a_migration_that_changes_what_a_function_returns_replaces_the_stale_plan(
    pg_dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    stale_plan_after_a_migration(pg_dsn, schema, caplog)


def test_every_prepared_query_works_prepared(store: LeaseStore, fences: FenceStore) -> None:
    """Each [prepared] query through its store's API, enough times to run as a prepared statement."""
    for n in range(PREPARE_AFTER + 2):
        lease = store.acquire(f"k{n % 2}", "owner", TTL)
        assert lease is not None
        assert store.renew(lease) is not None
        assert store.holder(f"k{n % 2}") is not None and store.lease(f"k{n % 2}") is not None
        assert store.release(lease) is True
        assert fences.accept("res", n + 1, key="k") and fences.current("res", key="k") == n + 1
        store.events.record("waiting", f"k{n % 2}", owner="owner")
    unlogged = LeaseStore(store.db.dsn, schema=store.schema, record_events=False)
    try:
        for _ in range(PREPARE_AFTER + 1):
            lease = unlogged.acquire("u", "owner", TTL)
            assert lease is not None and unlogged.release(lease)
        have = _session_statements(unlogged)
        assert {_name(unlogged, "acquire"), _name(unlogged, "release")} <= have
    finally:
        unlogged.close()
    for owner, names in ((store, ("acquire_logged", "release_logged", "holder", "lease_by_key", "record_event")),
                         (fences, ("fence_advance", "fence_current"))):
        have = _session_statements(owner)
        for name in names:
            assert _name(owner, name) in have, f"{name} was never prepared"


def test_inside_a_callers_transaction_a_query_goes_as_text(fences: FenceStore) -> None:
    """In FenceStore.transaction() an error would abort the caller's transaction, so the retries of the
    prepared path (which rely on each try being its own transaction) are not used there: a server session
    without the statement (a pooler's other one; here DEALLOCATE ALL) changes nothing."""
    for _ in range(PREPARE_AFTER + 1):
        assert fences.current("res", key="k") is None
    assert _name(fences, "fence_current") in _session_statements(fences)
    with fences.transaction("res", 10, key="k", owner="me") as cur:
        cur.execute("DEALLOCATE ALL")
        assert fences.current("res", key="k") == 10  # the caller's own transaction sees its advance
        cur.execute("SELECT 1")
    assert fences.current("res", key="k") == 10  # and it committed


def test_a_stale_plan_is_told_by_where_the_server_raised_it_not_by_its_words(pg_dsn: str) -> None:
    """The message is in the server's lc_messages language; the source function is not."""
    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE t (a integer)")
            cur.execute("PREPARE p AS SELECT * FROM t")
            cur.execute("ALTER TABLE t ADD COLUMN b integer")
            with pytest.raises(psycopg2.errors.FeatureNotSupported) as raised:
                cur.execute("EXECUTE p")
    finally:
        conn.close()
    assert stale_plan(raised.value)
    german = SimpleNamespace(pgcode="0A000", diag=SimpleNamespace(source_function="RevalidateCachedQuery"),
                             args=("FEHLER:  gecachter Plan darf den Ergebnistyp nicht ändern",))
    assert stale_plan(german)  # type: ignore[arg-type]
    other = SimpleNamespace(pgcode="0A000", diag=SimpleNamespace(source_function="exec_stmt_raise"))
    assert not stale_plan(other)  # type: ignore[arg-type]  # the same code from a RAISE inside a function
