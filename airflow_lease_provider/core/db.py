"""The one storage boundary: connections, named queries, and the translation of driver errors.

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
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, unquote

import psycopg2
import psycopg2.errors
import psycopg2.extensions
import psycopg2.extras
from psycopg2 import sql

from airflow_lease_provider.core import pool as _pool
from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import InvalidArgument, LeaseError, LeaseStoreUnavailable

log = logging.getLogger(__name__)

DEFAULT_SCHEMA = "airflow_lease"
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=5)
DEFAULT_STATEMENT_TIMEOUT = timedelta(seconds=5)

_NAME_RE = re.compile(r"^-- name: (\w+)( \[prepared\])?\s*$", re.MULTILINE)
_PARAM_RE = re.compile(r"%\((\w+)\)s")
#: A connection sends a [prepared] query this many times as plain text before it prepares it: a
#: connection used for one operation (the Airflow hooks' default) never pays for a PREPARE.
PREPARE_AFTER = 2


class _Watchdog:
    """One daemon thread per process that cuts off statements the server never answers.

    ``statement_timeout`` is enforced by the server; a server that is frozen, or a pooler that holds the
    query while its own server is down, leaves the client waiting in ``recv()`` for as long as that
    lasts. Each :class:`Database` publishes its one in-flight statement as ``(deadline, fd)`` (a plain
    attribute write, nothing on the hot path takes a lock); four times a second this thread looks, and
    past a deadline shuts that socket down, so the blocked call fails at once and the caller fails closed.

    On the same tick it closes the connection of a store opened with a positive ``idle_close`` that
    nobody has used for that long (``idle_close == 0`` closes it as each operation ends), so an idle
    lease (between two renewals) holds no server connection.
    """

    TICK = 0.25

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: weakref.WeakSet[Database] = weakref.WeakSet()
        self._pid = 0
        self._thread: threading.Thread | None = None

    def watch(self, db: Database) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: it needs a thread of its own
                self._pid = os.getpid()
                self._watched = weakref.WeakSet()
                self._thread = None
            if self._thread is None or not self._thread.is_alive():
                # Also after a death the tick's guard did not prevent (it cannot be left without a watchdog).
                self._thread = threading.Thread(target=self._run, name="lease-store-watchdog", daemon=True)
                self._thread.start()
            self._watched.add(db)

    def _run(self) -> None:
        while True:
            _pause(self.TICK)
            try:
                self.tick(time.monotonic())
            except Exception:  # one store's failure must not take the bound away from every other store
                log.exception("lease store watchdog: a tick failed; the next one runs as usual")

    def tick(self, now: float) -> None:
        with self._lock:
            watched = list(self._watched)
        for db in watched:
            inflight = db._inflight
            if inflight is not None and inflight[0] <= now:
                db._inflight = None
                db._cut_off = True
                _shutdown(inflight[1])
            elif db.idle_close and db._conn is not None:
                try:
                    db._close_if_idle(now)
                except Exception:
                    log.exception("lease store watchdog: closing an idle connection to %s failed", db.where)
        _pool.reap_all(now)  # pooled connections unused for LINGER s (core/pool.py)


def _pause(seconds: float) -> None:
    """``time.sleep`` that cannot end the watchdog: under a faked clock (libfaketime) ``clock_nanosleep``
    can fail with ``EINVAL``; ``select`` takes a relative timeout instead."""
    try:
        time.sleep(seconds)
    except OSError:
        select.select([], [], [], seconds)


def _shutdown(fd: int) -> None:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return  # already closed: nothing is blocked on it
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


_watchdog = _Watchdog()


class _StoreLock:
    """The store's re-entrant lock. With ``idle_close == 0`` the connection is closed as the outermost
    holder lets go, i.e. as soon as an operation (a statement, a transaction) is done."""

    def __init__(self, db: Database) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # only the holding thread changes it
        self._db = weakref.ref(db)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        acquired = self._lock.acquire(blocking, timeout)
        if acquired:
            self._depth += 1
        return acquired

    def release(self) -> None:
        try:
            self._depth -= 1
            db = self._db()
            if self._depth == 0 and db is not None and db.idle_close == timedelta(0) and db._conn is not None:
                db._drop(reuse=True)
        finally:
            self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeaseStoreError(LeaseError):
    """The store answered with an error that is not about reaching it (a bug or a broken schema)."""


@cache
def _parsed_queries() -> tuple[dict[str, str], frozenset[str]]:
    text = resources.files("airflow_lease_provider.core.sql").joinpath("queries.sql").read_text()
    parts = _NAME_RE.split(text)
    # parts = [preamble, name1, flag1, body1, name2, flag2, body2, ...]; a flag is " [prepared]" or None
    queries: dict[str, str] = {}
    prepared: set[str] = set()
    for i in range(1, len(parts), 3):
        queries[parts[i]] = parts[i + 2].strip()
        if parts[i + 1]:
            prepared.add(parts[i])
    return queries, frozenset(prepared)


def named_queries() -> dict[str, str]:
    """The ``-- name: x`` blocks of ``sql/queries.sql``, read once."""
    return _parsed_queries()[0]


def prepared_queries() -> frozenset[str]:
    """The names of the queries marked ``[prepared]``: one statement each, planned the same whatever
    its values (a function call or a primary-key lookup), sent many times on one connection."""
    return _parsed_queries()[1]


def _sql_body(text: str) -> str:
    """A query without its comment lines and trailing semicolon (what a PREPARE wraps)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    return "\n".join(lines).strip().rstrip(";").rstrip()


def _stale_plan(exc: psycopg2.Error) -> bool:
    """"cached plan must not change result type": raised where PostgreSQL revalidates a prepared plan,
    before it runs. Told by where it comes from, not by its message (which the server's lc_messages
    translates)."""
    return exc.pgcode == "0A000" and getattr(exc.diag, "source_function", None) == "RevalidateCachedQuery"


class _Prepared:
    """The three texts of one prepared query: EXECUTE it, PREPARE then EXECUTE it, and replace a stale one.

    Each carries the same SET LOCAL prefix and the query's values as ``%(name)s`` parameters (so the
    driver quotes them exactly as for the plain text); in the PREPARE they are ``$1``, ``$2``, ...
    """

    __slots__ = ("name", "execute", "prepare", "replace")

    def __init__(self, prefix: str, source: str) -> None:
        body = _sql_body(source)
        order: list[str] = []

        def positional(match: re.Match[str]) -> str:
            if match.group(1) not in order:
                order.append(match.group(1))
            return f"${order.index(match.group(1)) + 1}"

        body = _PARAM_RE.sub(positional, body)
        # The name says which text it stands for: the same name is the same statement on any session.
        self.name = "airflow_lease_" + hashlib.sha256(body.encode()).hexdigest()[:32]
        args = "(" + ", ".join(f"%({n})s" for n in order) + ")" if order else ""
        execute = f"EXECUTE {self.name}{args}"
        prepare = f"PREPARE {self.name} AS {body}; {execute}"
        self.execute = prefix + execute
        self.prepare = prefix + prepare
        # After a migration changed what the statement returns, the old plan cannot be reused.
        self.replace = prefix + f"DEALLOCATE {self.name}; {prepare}"


class _Statement:
    """One named query as sent: the prefix and the query as plain text, and for a ``[prepared]`` query its
    prepared texts; ``source`` is the query text it was built from."""

    __slots__ = ("source", "plain", "prepared")

    def __init__(self, prefix: str, source: str, *, prepared: bool) -> None:
        self.source = source
        self.plain = prefix + source
        self.prepared = _Prepared(prefix, source) if prepared else None


#: A URI connection string (libpq accepts both schemes).
_URI_RE = re.compile(r"^\s*postgres(?:ql)?://", re.IGNORECASE)
#: What libpq may split an unencoded password at, and then echo a part of in its error message.
_SPLIT_RE = re.compile(r"[/@:?#&=%\s]+")
#: A URI whose scheme is mistyped (``postgresql//``, ``postgresql:/``, ``postgres:``): libpq reads it as
#: keyword/value pairs and quotes all of it back ('missing "=" after "postgresql//user:pw@..."').
_URI_LIKE_RE = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*(?::/{0,3}|/{1,3})", re.IGNORECASE)
_PASSWORD_KEYWORD_RE = re.compile(r"(?:^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'?|\S+)", re.IGNORECASE)
_PASSWORD_QUERY_RE = re.compile(r"[?&]password=([^&]*)", re.IGNORECASE)
#: Passwords of every connection string this process has described or opened: removed from every
#: message :func:`translate` builds, whichever connection the error came from.
_known_secrets: set[str] = set()
_secrets_lock = threading.Lock()
REDACTED = "***"


def _secrets_of(dsn: str) -> tuple[set[str], set[str]]:
    """(whole passwords, fragments) a connection string may carry, under every reading of it.

    A password with an unencoded ``/ @ : ?`` is read differently by libpq (part of it becomes the
    host, the port or the database), so every candidate is collected: the parsed password, the URI's
    userinfo after the user, a ``password=`` query parameter or keyword, each raw and percent-decoded;
    and their pieces between those characters, which libpq may quote in an error message.
    """
    whole: set[str] = set()
    try:
        parsed = psycopg2.extensions.parse_dsn(dsn).get("password")
        readable = True
    except psycopg2.Error:
        parsed, readable = None, False
    if parsed:
        whole.add(parsed)
    # A URI, or what libpq could not read and looks like one with its scheme mistyped: the password is
    # what stands between the user's ':' and the last '@', whatever libpq made of it.
    uri = _URI_RE if _URI_RE.match(dsn) else _URI_LIKE_RE if not readable and _URI_LIKE_RE.match(dsn) else None
    if uri is not None:
        rest = uri.sub("", dsn, count=1)
        if "@" in rest:
            userinfo = rest.rsplit("@", 1)[0]
            if ":" in userinfo:
                whole.add(userinfo.split(":", 1)[1])
        whole.update(m for m in _PASSWORD_QUERY_RE.findall(rest))
    for match in _PASSWORD_KEYWORD_RE.finditer(dsn):
        value = match.group(1)
        whole.add(value)
        if value.startswith("'"):
            whole.add(value.strip("'").replace("\\'", "'").replace("\\\\", "\\"))
    whole |= {unquote(w) for w in whole}
    whole.discard("")
    fragments = {part for w in whole for part in _SPLIT_RE.split(w) if part} - whole
    return whole, fragments


def remember_secrets(dsn: str) -> None:
    """Redact this connection string's password from every message translated from now on."""
    whole, fragments = _secrets_of(dsn)
    with _secrets_lock:
        _known_secrets.update(whole)
        _known_secrets.update("\x00" + f for f in fragments)  # a NUL marks a fragment: see redact()


def redact(text: str, dsn: str | None = None) -> str:
    """``text`` with every known password (and ``dsn``'s) replaced by ``***``.

    Whole passwords go wherever they appear; a fragment of one (a piece between ``/ @ : ?``, which
    libpq may echo after mis-reading an unencoded password) only where it stands as a word of its own.
    """
    with _secrets_lock:
        known = set(_known_secrets)
    whole = {s for s in known if not s.startswith("\x00")}
    fragments = {s[1:] for s in known if s.startswith("\x00")}
    if dsn is not None:
        more_whole, more_fragments = _secrets_of(dsn)
        whole |= more_whole
        fragments |= more_fragments
    for secret in sorted(whole, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    for fragment in sorted(fragments, key=len, reverse=True):
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(fragment)}(?![A-Za-z0-9])", REDACTED, text)
    return text


def _describe_uri(dsn: str) -> str:
    rest = _URI_RE.sub("", dsn.strip(), count=1)
    user = ""
    if "@" in rest:
        # The last @ ends the userinfo: a password with an unencoded @ or / stays on the left of it.
        userinfo, rest = rest.rsplit("@", 1)
        user = unquote(userinfo.split(":", 1)[0])
    hostport, _, path = rest.partition("/")
    dbname, _, query = path.partition("?")
    if "?" in hostport:
        hostport, _, query = hostport.partition("?")
    host, port = hostport, ""
    if hostport.startswith("["):  # [IPv6]:port
        host, _, tail = hostport.partition("]")
        host += "]"
        port = tail.removeprefix(":")
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    params = dict(parse_qsl(query, keep_blank_values=True))
    host = params.get("host") or unquote(host)
    port = params.get("port") or port
    dbname = params.get("dbname") or unquote(dbname)
    user = params.get("user") or user
    return f"{user or '?'}@{host or 'local socket'}:{port or '5432'}/{dbname or '?'}"


def describe_dsn(dsn: str) -> str:
    """Where a DSN points, without its password: safe for logs and error messages.

    A URI is read here, not by libpq: libpq mis-reads a password with an unencoded ``/`` (part of it
    becomes the host or the database), so the userinfo ends at the *last* ``@``; and whatever is
    printed has every reading of the password removed.
    """
    remember_secrets(dsn)
    if _URI_RE.match(dsn):
        return redact(_describe_uri(dsn), dsn)
    try:
        info = psycopg2.extensions.parse_dsn(dsn)
    except psycopg2.ProgrammingError:
        return "<unparsable connection string>"
    host = info.get("host") or "local socket"
    port = info.get("port") or "5432"
    return redact(f"{info.get('user') or '?'}@{host}:{port}/{info.get('dbname') or '?'}", dsn)


# SQLSTATE classes that mean "the store cannot serve us now": connection exceptions, insufficient
# resources (too many connections, disk full), operator intervention (shutdown, cancel, timeouts).
_UNAVAILABLE_CLASSES = ("08", "53", "57")
#: libpq's words for a connection string it cannot read (raised before any network contact).
_BAD_DSN = ("invalid dsn", "for connection option", "invalid connection option", "invalid URI")
_DSN_ADVICE = "percent-encode / @ : ? # and % in a URI's user or password (e.g. / as %2F)"


class DriverError(Exception):
    """What the driver raised, redacted: the cause (``__cause__``) of the error :func:`translate` makes.

    The driver's own exception is not chained: its message echoes the connection string it could not
    read (``invalid dsn: missing "=" after "postgresql//user:pw@..."``), and a task's logged traceback
    prints the whole cause chain. This keeps its class, SQLSTATE and every line of its message, redacted.

    :ivar driver_type: the driver exception's class (e.g. ``psycopg2.errors.UndefinedTable``).
    :ivar pgcode: its SQLSTATE, or None (an error raised before any server answered).
    """

    def __init__(self, message: str, driver_type: type[BaseException], pgcode: str | None) -> None:
        super().__init__(message)
        self.driver_type = driver_type
        self.pgcode = pgcode


def _driver_error(exc: BaseException) -> DriverError:
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    code = getattr(exc, "pgcode", None)
    message = f"{kind}{f' (SQLSTATE {code})' if code else ''}: {redact(str(exc).strip())}"
    return DriverError(message, type(exc), code)


def translate(exc: BaseException, where: str) -> LeaseError:
    """Turn a driver error into the library's own. The single place where this happens.

    Every message is redacted here: no password (nor a piece of one) of any connection string this
    process knows reaches an exception, a log line, the CLI or the UI. The error's ``__cause__`` is a
    redacted :class:`DriverError`: raise it with ``raise error from error.__cause__``, or outside the
    ``except`` block, never ``from exc`` (the driver's exception would carry its message into tracebacks).
    """
    error = _translate(exc, where)
    error.__cause__ = _driver_error(exc)
    error.__suppress_context__ = True
    return error


def _translate(exc: BaseException, where: str) -> LeaseError:
    text = redact(_first_line(exc))
    if isinstance(exc, psycopg2.errors.QueryCanceled):
        return LeaseStoreUnavailable(f"lease store at {where} did not answer in time: {text}")
    code = getattr(exc, "pgcode", None)
    if code is None and isinstance(exc, psycopg2.Error) and any(w in str(exc) for w in _BAD_DSN):
        return InvalidArgument("dsn", "<hidden>", f"the connection string does not parse: {text} ({_DSN_ADVICE})")
    if isinstance(exc, psycopg2.InterfaceError) or (
        isinstance(exc, psycopg2.OperationalError) and (code is None or code[:2] in _UNAVAILABLE_CLASSES)
    ):
        return LeaseStoreUnavailable(f"lease store at {where} is unreachable: {text}")
    return LeaseStoreError(f"lease store at {where} failed: {text}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
        of closing it) where it would be closed; see :mod:`airflow_lease_provider.core.pool`.
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
        self._statements: dict[tuple[str, bool | None, timedelta], _Statement] = {}
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

    def close(self) -> None:
        with self._lock:
            self._drop()

    # -- queries -----------------------------------------------------------------------------------

    def query_text(self, name: str, conn: Any) -> str:
        """The named query with the schema filled in as a quoted identifier."""
        text = self._compiled.get(name)
        if text is None:
            composed = sql.SQL(named_queries()[name]).format(schema=sql.Identifier(self.schema))
            text = self._compiled[name] = composed.as_string(conn)
        return text

    def _statement(self, name: str, durable: bool | None, conn: Any) -> _Statement:
        """What is sent for the named query, built once per (name, durability, timeout)."""
        cache_key = (name, durable, self.statement_timeout)
        statement = self._statements.get(cache_key)
        if statement is None or self._compiled.get(name) is not statement.source:
            source = self.query_text(name, conn)
            statement = self._statements[cache_key] = _Statement(
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

    def records(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Run one named read and return its rows as dicts by column name (read them by name, not position)."""
        return self.run(name, params, _cursor_factory=psycopg2.extras.RealDictCursor)  # type: ignore[return-value]

    def run(
        self,
        name: str,
        params: Mapping[str, Any],
        *,
        durable: bool | None = False,
        retry: bool = True,
        _cursor_factory: Any = None,
    ) -> list[tuple[Any, ...]]:
        """Run one named query and return its rows.

        :param durable: ``True``: the statement writes lease or fence state that must survive a crash;
            ``None``: a best-effort write that need not wait for the disk; ``False``: a read.
        :param retry: the statement may be sent again when a reused connection turns out to be dead.
            Only for statements whose repetition is harmless (a repeated acquire by the same owner just
            burns a token; a repeated fence advance would reject its own first success, so never that).
        """
        with self._lock:
            for attempt in (1, 2):
                fresh = self._conn is None
                conn = self._connection()
                fresh = fresh and not self._from_pool  # a pooled connection may have died idle: resend once
                try:
                    return self._send(name, params, durable, conn, _cursor_factory)
                except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
                    dead = conn.closed != 0 or isinstance(exc, psycopg2.InterfaceError)
                    if dead:
                        self._drop()
                    if self._cut_off:
                        self._cut_off = False
                        raise LeaseStoreUnavailable(
                            f"lease store at {self.where} did not answer within the statement timeout "
                            f"({self.statement_timeout.total_seconds():g} s)"
                        ) from exc
                    if dead and retry and not fresh and attempt == 1:
                        log.info("lease store connection to %s was lost; reconnecting once", self.where)
                        continue
                    error = translate(exc, self.where)
                    raise error from error.__cause__
                except psycopg2.Error as exc:
                    error = translate(exc, self.where)
                    raise error from error.__cause__
            raise AssertionError("unreachable")  # pragma: no cover

    def _execute(self, conn: Any, text: str, params: Mapping[str, Any], cursor_factory: Any) -> list[tuple[Any, ...]]:
        # Not _guarded(): this is every call's path, and a generator-based context manager cost a few
        # microseconds of it.
        self._arm(conn)
        try:
            with conn.cursor(cursor_factory=cursor_factory) as cur:
                cur.execute(text, params)
                return cur.fetchall() if cur.description is not None else []
        finally:
            self._inflight = None

    def _send(
        self, name: str, params: Mapping[str, Any], durable: bool | None, conn: Any, cursor_factory: Any
    ) -> list[tuple[Any, ...]]:
        """One named query on ``conn``: as its prepared statement where it has one, else as plain text."""
        # Inside a caller's transaction (FenceStore.transaction) an error would abort the caller's work,
        # so there the plain text only: the retries below rely on each try being its own transaction.
        statement = self._statement(name, durable, conn)
        prepared = statement.prepared
        if prepared is None or not self.prepare or not conn.autocommit:
            return self._execute(conn, statement.plain, params, cursor_factory)
        if prepared.name not in self._prepared_on:
            uses = self._uses.get(prepared.name, 0) + 1
            if uses < PREPARE_AFTER:
                self._uses[prepared.name] = uses
                return self._execute(conn, statement.plain, params, cursor_factory)
        text = prepared.execute if prepared.name in self._prepared_on else prepared.prepare
        # Each error below is raised before the statement runs (and aborts the implicit transaction the
        # SET LOCALs are in), so sending again cannot run it twice. A pooler may route each try to
        # another server session: after a few, the plain text, which every session can run.
        for _ in range(4):
            try:
                rows = self._execute(conn, text, params, cursor_factory)
            except psycopg2.errors.InvalidSqlStatementName:
                log.debug("lease store: %s is not prepared in this server session; preparing it", name)
                self._prepared_on.discard(prepared.name)
                text = prepared.prepare
            except psycopg2.errors.DuplicatePreparedStatement:  # same name, so the same text
                log.debug("lease store: %s is already prepared in this server session; executing it", name)
                text = prepared.execute
            except psycopg2.errors.FeatureNotSupported as exc:
                if not _stale_plan(exc):
                    raise
                log.debug("lease store: %s returns other columns since a migration; preparing it again", name)
                self._prepared_on.discard(prepared.name)
                text = prepared.replace
            else:
                self._prepared_on.add(prepared.name)
                return rows
        log.info("lease store: prepared statement %s kept moving between server sessions; sent as text", name)
        self._prepared_on.discard(prepared.name)
        return self._execute(conn, statement.plain, params, cursor_factory)

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
        if not self._watched or _watchdog._pid != os.getpid():
            _watchdog.watch(self)
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
            try:
                with conn.cursor() as cur:
                    yield cur
                with self._guarded(conn):
                    conn.commit()
            except BaseException as exc:
                try:
                    conn.rollback()
                except psycopg2.Error:
                    self._drop()
                if isinstance(exc, psycopg2.Error):
                    error = translate(exc, self.where)
                    raise error from error.__cause__
                raise
            finally:
                if self._conn is not None and not self._conn.closed:
                    self._conn.autocommit = True
