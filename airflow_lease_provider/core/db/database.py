"""A store's connection: opened lazily, shared under a lock, every statement bounded and sent as its
named query (plain, or prepared from its second use).

Everything that talks to PostgreSQL goes through :class:`Database`. Settings travel with each statement
as ``SET LOCAL``, so it works behind pgbouncer in transaction pooling mode. The one thing it leaves in a
server session is a prepared statement per hot query (``-- name: x [prepared]``), named by a hash of its
text: a connection that sends the same statement a second time prepares it, and a server session
without it (a pooler's other session, a ``DISCARD ALL``) is told so before anything runs, so the call
prepares it there and goes on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.db import pool as _pool
from airflow_lease_provider.core.db.dsn import describe_dsn
from airflow_lease_provider.core.db.sqltext import (
    PREPARE_AFTER,
    Statement,
    named_queries,
    prepared_queries,
    stale_plan,
    with_schema,
)
from airflow_lease_provider.core.db.translate import MISSING_STORE_OBJECT, translate
from airflow_lease_provider.core.db.watchdog import watchdog
from airflow_lease_provider.core.errors import (
    InvalidArgument,
    LeaseError,
    LeaseStoreUnavailable,
    OutcomeUnknown,
)

log = logging.getLogger("airflow_lease_provider.core.db")

#: A row of a named query: its columns by name.
Row = dict[str, Any]

DEFAULT_SCHEMA = "airflow_lease"
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=5)
DEFAULT_STATEMENT_TIMEOUT = timedelta(seconds=5)


class _StoreLock:
    """The store's re-entrant lock. With ``idle_close == 0`` the connection is closed as the outermost
    holder lets go, i.e. as soon as an operation (a statement, a transaction) is done.

    Made anew in a forked child (:func:`_after_fork_in_child`) unless the forking thread itself holds it:
    a lock another thread held at ``fork()`` (a keeper's renewal in flight) would stay held in the child
    for ever, since that thread does not exist there, and the child's first store call would wait on it.
    """

    def __init__(self, db: Database) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # only the holding thread changes it
        self._owner: int | None = None  # the holding thread's ident, while _depth > 0
        self._db = weakref.ref(db)
        _store_locks.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        acquired = self._lock.acquire(blocking, timeout)
        if acquired:
            self._depth += 1
            self._owner = threading.get_ident()
        return acquired

    def _reset_in_child(self) -> None:
        # In the child the forking thread keeps its ident, so a lock it held itself is still its own (its
        # with-block lets go of it); one any other thread held has no holder left.
        if self._depth and self._owner == threading.get_ident():
            return
        self._lock = threading.RLock()
        self._depth = 0
        self._owner = None

    def release(self) -> None:
        try:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
            db = self._db()
            if self._depth == 0 and db is not None and db.idle_close == timedelta(0) and db._conn is not None:
                db._drop(reuse=True)
        finally:
            self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


#: Every store lock of this process, made anew in a forked child.
_store_locks: weakref.WeakSet[_StoreLock] = weakref.WeakSet()


class Database:
    """A lazily opened autocommit connection shared by one store's callers, guarded by a lock.

    :param dsn: libpq connection string or ``postgresql://`` URI.
    :param schema: the PostgreSQL schema holding the store's tables.
    :param connect_timeout: how long to wait for a connection before failing closed.
    :param statement_timeout: how long one statement may run before failing closed.
    :param idle_close: close the connection once it has been idle this long (``timedelta(0)``: as soon as
        an operation is done), and open a new one for the next operation.
        ``None`` (the default) keeps one connection open for the store's life: cheaper per operation,
        but a thousand idle stores then hold a thousand server connections.
    :param prepare: send the hot queries (``[prepared]`` in ``sql/queries.sql``) as prepared statements
        from their second use on a connection: the server then parses and plans each once per session
        instead of on every call. ``False`` sends plain text only (for a pooler that pins a client to a
        server session when it sees a ``PREPARE``, such as Amazon RDS Proxy).
    :param pool_size: ``None`` (the default): this store's own connection. A number: take the
        connection from this process's pool for the same server and settings, at most that many
        connections shared by all its stores (the first store's figure holds), and give it back (instead
        of closing it) where it would be closed; see :mod:`airflow_lease_provider.core.db.pool`.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT,
        statement_timeout: timedelta = DEFAULT_STATEMENT_TIMEOUT,
        application_name: str = "airflow-lease",
        idle_close: timedelta | None = None,
        prepare: bool = True,
        pool_size: int | None = None,
    ) -> None:
        self.dsn = validation.dsn(dsn)
        self.schema = validation.schema(schema)
        self.connect_timeout = validation.positive_timedelta("connect_timeout", connect_timeout)
        self.statement_timeout = validation.positive_timedelta("statement_timeout", statement_timeout)
        self.application_name = application_name
        if idle_close is not None and (not isinstance(idle_close, timedelta) or idle_close < timedelta(0)):
            raise validation.InvalidArgument("idle_close", idle_close, "must be None or a timedelta >= 0")
        self.idle_close = idle_close
        if not isinstance(prepare, bool):
            raise validation.InvalidArgument("prepare", prepare, "must be True or False")
        self.prepare = prepare
        if pool_size is not None and (not isinstance(pool_size, int) or isinstance(pool_size, bool) or pool_size < 1):
            raise validation.InvalidArgument("pool_size", pool_size, "must be None or a whole number of at least 1")
        self.pool_size = pool_size
        self._from_pool = False  # the open connection was used before (by any store of the pool)
        self.where = describe_dsn(dsn)
        self._lock = _StoreLock(self)
        self._conn: Any = None
        self._pid = 0
        self._compiled: dict[str, str] = {}
        self._prefixes: dict[tuple[bool | None, timedelta], str] = {}
        # What is sent per (name, durable, statement_timeout), with the query text it was built from (the
        # bench swaps _compiled entries for its before arms; a swapped entry rebuilds its statement).
        self._statements: dict[tuple[str, bool | None, timedelta], Statement] = {}
        # Of the connection now open: how often each prepared query's plain text was sent on it, and the
        # statements it is known to hold (a pooler's other server session may not: see _send).
        self._uses: dict[str, int] = {}
        self._prepared_on: set[str] = set()
        # (monotonic deadline, socket fd) of the statement in flight, for the watchdog.
        self._inflight: tuple[float, int] | None = None
        self._watched = False
        # Set by the watchdog when it cut a statement off: the server hangs, so do not reconnect now.
        self._cut_off = False
        # Monotonic time the connection was last seen in use (for idle_close).
        self._last_used = 0.0
        # Connections opened so far (benchmarks report connects per second).
        self.connects = 0
        # Of a database shared by the stores of one process (shared_database): the schema was found current
        # by one of them, so the others skip the check; and what brings it back when a statement says the
        # schema, a table or a function is missing (the store was dropped, maybe made again: see run()).
        self.schema_current = False
        self.on_missing_schema: Callable[[], object] | None = None
        # Bumped each time on_missing_schema ran: what a store read of the old store (its id) is stale.
        self.schema_generation = 0

    # -- connections -------------------------------------------------------------------------------

    def _connect(self) -> Any:
        error: LeaseError | None
        try:
            conn = psycopg2.connect(self.dsn, **self._connect_options())
        except psycopg2.Error as exc:
            error = translate(exc, self.where)
        else:
            error = None
        if error is not None:
            # Raised here, out of the except block: not even as __context__ does the driver's exception,
            # which quotes the connection string it could not read, come along.
            raise error
        conn.autocommit = True
        return conn

    def _connect_options(self) -> dict[str, Any]:
        """The store's connection settings, except those the connection string sets itself.

        ``connect_timeout``, ``application_name`` and ``keepalives*`` given in the DSN (or a connection's
        extras) are honoured, not overridden; values that would defeat failing closed are refused.
        """
        options: dict[str, Any] = {
            "connect_timeout": max(1, round(self.connect_timeout.total_seconds())),
            "application_name": self.application_name,
            # Dead peers are noticed in seconds rather than the kernel's two hours.
            "keepalives": 1,
            "keepalives_idle": 10,
            "keepalives_interval": 5,
            "keepalives_count": 3,
        }
        try:
            given = psycopg2.extensions.parse_dsn(self.dsn)
        except psycopg2.Error:
            return options  # connect() says what is wrong with it, redacted
        for name in list(options):
            if name not in given:
                continue
            value = given[name]
            if name != "application_name":
                minimum = 0 if name == "keepalives" else 1
                # ASCII digits: '²'.isdigit() is true and int('²') a ValueError naming nothing.
                if not re.fullmatch(r"\s*[0-9]+\s*", value) or int(value) < minimum:
                    raise InvalidArgument(
                        name, value, f"in the connection string must be a whole number of at least {minimum}"
                        + (" (0 would wait forever: the store fails closed instead)" if name == "connect_timeout" else "")
                    )
            del options[name]
        return options

    def _connection(self) -> Any:
        # A connection inherited through fork() belongs to the parent: never use it from the child.
        if self._conn is not None and (self._conn.closed or self._pid != os.getpid()):
            self._drop()
        elif self._conn is not None and self._conn.autocommit and _has_unread(self._conn):
            # An idle connection the server wrote to unasked was ended by it (a terminated backend, a
            # restart: its FATAL message or EOF is waiting): replace it before anything is sent on it.
            log.info("lease store connection to %s was closed by the server while idle; reconnecting", self.where)
            self._drop()
        if self._conn is None:
            if self.pool_size is None:
                self._conn, new = self._connect(), True
            else:
                self._conn, new = self._shared_pool().get(self._connect, self.connect_timeout.total_seconds())
            self._from_pool = not new
            self._pid = os.getpid()
            self.connects += 1 if new else 0
            # Nothing is known of a pooled connection's session: prepared statements are found by name (_send).
            self._uses = {}
            self._prepared_on = set()
        self._last_used = time.monotonic()
        return self._conn

    def _shared_pool(self) -> _pool.ConnectionPool:
        key = (self.dsn, tuple(sorted(self._connect_options().items())))
        assert self.pool_size is not None
        return _pool.shared(key, self.pool_size, self.where)

    def _close_if_idle(self, now: float) -> None:
        """Close the connection if idle for ``idle_close`` (called by the watchdog thread)."""
        assert self.idle_close is not None
        if not self._lock.acquire(blocking=False):
            self._last_used = now  # an operation is running on it
            return
        try:
            if (
                self._conn is not None
                and self._pid == os.getpid()
                and now - self._last_used >= self.idle_close.total_seconds()
            ):
                self._drop(reuse=True)
        finally:
            self._lock.release()

    def _drop(self, reuse: bool = False) -> None:
        """Close the connection; with a pool, give it back instead when ``reuse`` (an operation ended
        normally), or free its place in the pool."""
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid() and self.pool_size is not None:
            if reuse:
                self._shared_pool().put(conn)
            else:
                self._shared_pool().discard(conn)
        elif conn is not None and self._pid == os.getpid():
            try:
                conn.close()
            except psycopg2.Error:
                pass
        elif conn is not None:
            # The parent's connection (a forked child): closing it could send the server a Terminate for the
            # parent's session. Keep it referenced and untouched, as the pool does (pool._inherited).
            _inherited.append(conn)

    def close(self) -> None:
        with self._lock:
            self._drop()

    # -- queries -----------------------------------------------------------------------------------

    def query_text(self, name: str, conn: Any) -> str:
        """The named query with the schema filled in as a quoted identifier."""
        text = self._compiled.get(name)
        if text is None:
            text = self._compiled[name] = with_schema(named_queries()[name], self.schema, conn)
        return text

    def _statement(self, name: str, durable: bool | None, conn: Any) -> Statement:
        """What is sent for the named query, built once per (name, durability, timeout)."""
        cache_key = (name, durable, self.statement_timeout)
        statement = self._statements.get(cache_key)
        if statement is None or self._compiled.get(name) is not statement.source:
            source = self.query_text(name, conn)
            statement = self._statements[cache_key] = Statement(
                self._prefix(durable), source, prepared=name in prepared_queries()
            )
        return statement

    @property
    def _watch_seconds(self) -> float:
        # A little after the server's own statement_timeout: the watchdog's cut-off.
        return self.statement_timeout.total_seconds() + 1.0

    def _prefix(self, durable: bool | None) -> str:
        # Built once per (durable, statement_timeout): it is sent with every statement.
        cache_key = (durable, self.statement_timeout)
        prefix = self._prefixes.get(cache_key)
        if prefix is None:
            prefix = self._prefixes[cache_key] = self._build_prefix(durable)
        return prefix

    def _build_prefix(self, durable: bool | None) -> str:
        # SET LOCAL travels with the statement (one round trip, one implicit transaction) instead of
        # living in the session, which a transaction-pooling pgbouncer would not keep.
        ms = max(1, round(self.statement_timeout.total_seconds() * 1000))
        prefix = f"SET LOCAL statement_timeout = {ms}; "
        # Every statement of the store is written for READ COMMITTED: a conditional UPDATE that waited on
        # a row lock re-checks its WHERE on the new row version instead of failing with a serialization
        # error, as it would under a role's or database's default_transaction_isolation = 'repeatable read'.
        # Set per transaction, before its first snapshot, so no session state is needed.
        prefix += "SET LOCAL transaction_isolation = 'read committed'; "
        if durable:
            # An acknowledged token must never be handed out again after a crash (decision 4).
            prefix += "SET LOCAL synchronous_commit = on; "
        elif durable is None:
            # Best-effort writes (the ledger) need not wait for the disk: losing the last events in a
            # server crash is acceptable, waiting on a second fsync per lease operation is not.
            prefix += "SET LOCAL synchronous_commit = off; "
        return prefix

    @staticmethod
    def statement_timeout_sql(timeout: timedelta | None) -> str:
        """``SET LOCAL statement_timeout`` for the rest of a transaction: ``timeout``, or with ``None`` the
        server's own setting (its default for this role and database), which the store's limit replaced."""
        if timeout is None:
            return "SET LOCAL statement_timeout TO DEFAULT"
        return f"SET LOCAL statement_timeout = {max(1, round(timeout.total_seconds() * 1000))}"

    def run(
        self,
        name: str,
        params: Mapping[str, Any],
        *,
        durable: bool | None = False,
        retry: bool = True,
    ) -> list[Row]:
        """Run one named query and return its rows, each a dict by column name (read them by name: every
        column a query returns has a name of its own, see ``sql/queries.sql``).

        :param durable: ``True``: the statement writes lease or fence state that must survive a crash;
            ``None``: a best-effort write that need not wait for the disk; ``False``: a read.
        :param retry: the statement may be sent again when a reused connection turns out to be dead after
            it was sent. Only for statements whose repetition is harmless whether or not the first send was
            applied: reads, and the writes docs/core.md lists ("Statements sent again after a lost
            connection") with why. A write sent with ``retry=False`` whose connection is lost (or cut off
            by the watchdog) before its answer raises :class:`OutcomeUnknown`: it may have been applied.
        """
        write = durable is not False
        with self._lock:
            for attempt in (1, 2):
                fresh = self._conn is None
                conn = self._connection()
                fresh = fresh and not self._from_pool  # a pooled connection may have died idle: resend once
                try:
                    return self._send(name, params, durable, conn)
                except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
                    # InterfaceError: psycopg2 refused to send on a connection it knows closed: nothing left.
                    sent = not isinstance(exc, psycopg2.InterfaceError)
                    dead = conn.closed != 0 or not sent
                    if dead:
                        self._drop()
                    if self._cut_off:
                        self._cut_off = False
                        message = (
                            f"lease store at {self.where} did not answer within the statement timeout "
                            f"({self.statement_timeout.total_seconds():g} s)"
                        )
                        if write:
                            raise OutcomeUnknown(f"{message}; {name} was sent and may or may not have been applied"
                                                 ) from exc
                        raise LeaseStoreUnavailable(message) from exc
                    if dead and attempt == 1 and ((retry and not fresh) or not sent):
                        log.info("lease store connection to %s was lost; reconnecting once", self.where)
                        continue
                    error = translate(exc, self.where)
                    if dead and sent and write:
                        unknown = OutcomeUnknown(
                            f"{error}; the connection was lost after {name} was sent, before its answer: it may "
                            "or may not have been applied"
                        )
                        raise unknown from error.__cause__
                    raise error from error.__cause__
                except psycopg2.Error as exc:
                    error = translate(exc, self.where)
                    if attempt == 1 and conn.autocommit and self._schema_gone(exc):
                        # The statement failed before it could change anything (its implicit transaction is
                        # rolled back): the full schema check made the store again (or failed closed); send
                        # the statement once more on it.
                        continue
                    raise error from error.__cause__
            raise AssertionError("unreachable")  # pragma: no cover

    def _schema_gone(self, exc: psycopg2.Error) -> bool:
        """A statement said the store's schema, a table or a function is missing. On a database shared
        across tasks whose check was skipped (``schema_current``), forget that check and run the full one
        (``on_missing_schema``) before the statement is sent again; whether it should be."""
        if getattr(exc, "pgcode", None) not in MISSING_STORE_OBJECT or not self.schema_current:
            return False
        self.schema_current = False
        if self.on_missing_schema is None:
            return False
        log.warning("lease store at %s schema %s: its tables are gone; checking the schema again", self.where,
                    self.schema)
        self.schema_generation += 1
        self.on_missing_schema()
        self.schema_current = True
        return True

    def run_in(self, cur: Any, name: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        """Run one named query on ``cur`` (inside :meth:`transaction`, or a caller's own transaction on this
        database) and return its rows by column name; a driver error is translated, as :meth:`run` does."""
        try:
            cur.execute(self.query_text(name, cur.connection), params)
            return _rows(cur)
        except psycopg2.Error as exc:
            error = translate(exc, self.where)
            raise error from error.__cause__

    def _execute(self, conn: Any, text: str, params: Mapping[str, Any]) -> list[Row]:
        # Not _guarded(): this is every call's path, and a generator-based context manager cost a few
        # microseconds of it.
        self._arm(conn)
        try:
            with conn.cursor() as cur:
                cur.execute(text, params)
                return _rows(cur)
        finally:
            self._inflight = None

    def _send(
        self, name: str, params: Mapping[str, Any], durable: bool | None, conn: Any
    ) -> list[Row]:
        """One named query on ``conn``: as its prepared statement where it has one, else as plain text."""
        # Inside a caller's transaction (FenceStore.transaction) an error would abort the caller's work,
        # so there the plain text only: the retries below rely on each try being its own transaction.
        statement = self._statement(name, durable, conn)
        prepared = statement.prepared
        if prepared is None or not self.prepare or not conn.autocommit:
            return self._execute(conn, statement.plain, params)
        if prepared.name not in self._prepared_on:
            uses = self._uses.get(prepared.name, 0) + 1
            if uses < PREPARE_AFTER:
                self._uses[prepared.name] = uses
                return self._execute(conn, statement.plain, params)
        text = prepared.execute if prepared.name in self._prepared_on else prepared.prepare
        # Each error below is raised before the statement runs (and aborts the implicit transaction the
        # SET LOCALs are in), so sending again cannot run it twice. A pooler may route each try to
        # another server session: after a few, the plain text, which every session can run.
        for _ in range(4):
            try:
                rows = self._execute(conn, text, params)
            except psycopg2.errors.InvalidSqlStatementName:
                log.debug("lease store: %s is not prepared in this server session; preparing it", name)
                self._prepared_on.discard(prepared.name)
                text = prepared.prepare
            except psycopg2.errors.DuplicatePreparedStatement:  # same name, so the same text
                log.debug("lease store: %s is already prepared in this server session; executing it", name)
                text = prepared.execute
            except psycopg2.errors.FeatureNotSupported as exc:
                if not stale_plan(exc):
                    raise
                log.debug("lease store: %s returns other columns since a migration; preparing it again", name)
                self._prepared_on.discard(prepared.name)
                text = prepared.replace
            else:
                self._prepared_on.add(prepared.name)
                return rows
        log.info("lease store: prepared statement %s kept moving between server sessions; sent as text", name)
        self._prepared_on.discard(prepared.name)
        return self._execute(conn, statement.plain, params)

    @contextmanager
    def _guarded(self, conn: Any) -> Iterator[None]:
        """Cut the connection off if the server has not answered a little after statement_timeout."""
        self._arm(conn)
        try:
            yield
        finally:
            self._inflight = None

    def _arm(self, conn: Any) -> None:
        """Publish the statement about to be sent to the watchdog (cleared with ``_inflight = None``)."""
        if not self._watched or watchdog._pid != os.getpid():
            watchdog.watch(self)
            self._watched = True
        self._cut_off = False
        self._inflight = (time.monotonic() + self._watch_seconds, conn.fileno())

    def _begin(self) -> Any:
        """A connection with a transaction begun; reconnects once if a reused connection died idle.

        Retrying is safe here: nothing of the transaction has reached the server yet.
        """
        for attempt in (1, 2):
            fresh = self._conn is None
            conn = self._connection()
            fresh = fresh and not self._from_pool
            conn.autocommit = False
            try:
                with self._guarded(conn), conn.cursor() as cur:
                    cur.execute(self._prefix(durable=True))
                return conn
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
                self._drop()
                if not fresh and attempt == 1 and not self._cut_off:
                    log.info("lease store connection to %s was lost; reconnecting once", self.where)
                    continue
                error = translate(exc, self.where)
                raise error from error.__cause__
        raise AssertionError("unreachable")  # pragma: no cover

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A cursor inside one transaction on the shared connection; commits on success.

        Each statement through the cursor is bounded by ``statement_timeout`` on the server; the commit
        is bounded by the watchdog.
        """
        with self._lock:
            conn = self._begin()
            committing = False
            try:
                with conn.cursor() as cur:
                    yield cur
                committing = True
                with self._guarded(conn):
                    conn.commit()
            except BaseException as exc:
                # The commit was sent and its answer never came (the connection died, or the watchdog cut it
                # off): the transaction may have committed. Before the commit, a lost connection rolls it back.
                # (An InterfaceError is psycopg2 refusing to send on a closed connection: no commit went out.)
                lost_commit = (
                    committing and isinstance(exc, psycopg2.OperationalError) and (conn.closed != 0 or self._cut_off)
                )
                self._cut_off = False
                try:
                    conn.rollback()
                except psycopg2.Error:
                    self._drop()
                if _names_missing_store_object(exc):
                    self.schema_current = False  # the next store of this process checks it again
                if lost_commit:
                    assert isinstance(exc, psycopg2.Error)
                    error = translate(exc, self.where)
                    unknown = OutcomeUnknown(
                        f"{error}; the connection was lost after the commit was sent, before its answer: the "
                        "transaction may or may not have committed"
                    )
                    raise unknown from error.__cause__
                if isinstance(exc, psycopg2.Error):
                    error = translate(exc, self.where)
                    raise error from error.__cause__
                raise
            finally:
                if self._conn is not None and not self._conn.closed:
                    self._conn.autocommit = True


def _rows(cur: Any) -> list[Row]:
    """The rows of the statement ``cur`` ran last, each a dict by column name (none for a statement
    that returns no rows)."""
    if cur.description is None:
        return []
    names = [column.name for column in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def _names_missing_store_object(exc: BaseException) -> bool:
    """A driver error (or a store error translated from one) saying a table, function or schema is missing."""
    # A translated error's cause is the driver's error, or a redacted copy of it (DriverError) with its pgcode.
    return any(getattr(error, "pgcode", None) in MISSING_STORE_OBJECT for error in (exc, exc.__cause__))


def _has_unread(conn: Any) -> bool:
    """Whether the server sent something on an idle connection (no statement in flight): a FATAL message
    before it closed the session, or end of file. One ``select`` with no wait, no round trip."""
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError, psycopg2.Error):
        return True
    return bool(readable)


#: Connections inherited through fork(), kept referenced so garbage collection in the child never closes
#: them (closing sends the server a Terminate for the parent's session).
_inherited: list[Any] = []

_shared_lock = threading.Lock()
_shared: dict[tuple[Any, ...], Database] = {}
_shared_pid = os.getpid()


def _after_fork_in_child() -> None:
    """Locks held at ``fork()`` by threads the child does not have are never released there: make them
    anew (the store locks, and the one of the shared databases). What they guarded is handled by the pid
    checks: the parent's connections are set aside unused (``_inherited``), the shared databases dropped."""
    global _shared_lock
    _shared_lock = threading.Lock()
    for lock in list(_store_locks):
        lock._reset_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def shared_database(
    dsn: str,
    *,
    schema: str = DEFAULT_SCHEMA,
    idle_close: timedelta,
    connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT,
    statement_timeout: timedelta = DEFAULT_STATEMENT_TIMEOUT,
    application_name: str = "airflow-lease",
    prepare: bool = True,
) -> Database:
    """This process's :class:`Database` for these settings, shared by the stores that ask for it: the
    leased tasks that one process runs one after the other (``dag.test()``) reuse its connection instead of
    each connecting, and the schema is checked once (see :meth:`Database.run` for a store dropped meanwhile).

    ``idle_close`` must be positive: the connection closes itself once idle that long (the watchdog), so a
    process holds no server connection once its tasks are done or between two renewals (callers keep it
    at most half the renewal interval). Keyed by a hash of the DSN (credentials included), the schema and
    every connection setting, so two stores share only what they would have opened alike. A forked child
    never uses its parent's: it starts with none (and leaves the parent's connections untouched).
    """
    if not isinstance(idle_close, timedelta) or idle_close <= timedelta(0):
        raise InvalidArgument("idle_close", idle_close, "must be a positive timedelta for a shared database")
    global _shared_pid
    key = (
        hashlib.sha256(dsn.encode()).hexdigest(), schema, idle_close, connect_timeout, statement_timeout,
        application_name, prepare,
    )
    with _shared_lock:
        if _shared_pid != os.getpid():  # a forked child: the parent's databases and connections are not ours
            _inherited.extend(db._conn for db in _shared.values() if db._conn is not None)
            _shared.clear()
            _shared_pid = os.getpid()
        db = _shared.get(key)
        if db is None:
            db = _shared[key] = Database(
                dsn, schema=schema, idle_close=idle_close, connect_timeout=connect_timeout,
                statement_timeout=statement_timeout, application_name=application_name, prepare=prepare,
            )
        return db
