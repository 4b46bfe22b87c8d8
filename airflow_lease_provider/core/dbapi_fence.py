"""The fence in any SQL database reached through a DB-API 2 connection (PEP 249).

An implementation of :class:`~airflow_lease_provider.core.fencing.Fence`. The fence rule is
:func:`~airflow_lease_provider.core.fencing.decide`'s (docs/core.md, "Fences"; the parity test checks these
statements against it): per (resource, lease key), a strictly larger token is accepted, an equal one only from the
same owner of the same lease store (the same grant publishing again); an idempotency key is used once per
resource; a refused publish writes nothing. Here it is written once, in statements of standard SQL that
every dialect below runs as they are:

1. open a writing transaction (the only per-dialect step: SQLite's ``BEGIN IMMEDIATE`` takes the
   database's write lock at once; PostgreSQL's first ``UPDATE`` locks the fence row);
2. claim the idempotency key: ``INSERT ... ON CONFLICT DO NOTHING`` (no row inserted: ``duplicate``);
2a. with a count epoch (``count_epoch=``, ``base_key=``: docs/core.md, "The fence"), the count epoch of the
   base key: its row made if missing (``INSERT ... ON CONFLICT DO NOTHING``), raised to the publish's
   (``UPDATE ... WHERE count_epoch < :count_epoch``: only a later holding period's first publish writes),
   then read (PostgreSQL: ``FOR SHARE``, so a raise waits for the publishes deciding and they for it); a
   token at or below it is ``count_epoch``;
3. make sure the key's fence row exists (``INSERT ... ON CONFLICT DO NOTHING`` of a token-0 row);
4. the fence itself, one conditional ``UPDATE ... WHERE token < :token OR (same grant)``: one row
   changed is ``accepted``, none is ``stale``. No read-then-write window: the database evaluates the
   condition on the row it locks (PostgreSQL re-checks it on the newest version after waiting);
5. the caller's writes, in the same transaction, then one commit: the fence advance and the write
   commit together, or neither does (a refusal rolls everything back).

A dialect this module does not know is refused (:class:`UnsupportedDialect`), never run on a guess: a
database whose ``UPDATE ... SET`` reads the values it just assigned (MySQL) or that has no
``ON CONFLICT`` would silently break the rule.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Unpack

from airflow_lease_provider.core import fencing
from airflow_lease_provider.core.errors import InvalidArgument, LeaseStoreUnavailable, StaleFencingToken
from airflow_lease_provider.core.events import EventLedger
from airflow_lease_provider.core.fencing import Fence, FenceDecision, Publish
from airflow_lease_provider.core.identity import RunRef

log = logging.getLogger(__name__)

#: The fence's tables in the target database (beside the caller's own; a schema may be given).
FENCE_TABLE = "lease_fence"
PUBLISH_TABLE = "lease_fence_publish"
#: Per (resource, lease key): the largest count epoch the key's holders told the fence (version 15).
COUNT_EPOCH_TABLE = "lease_fence_count_epoch"


class UnsupportedDialect(InvalidArgument):
    """The target database's dialect is not one the DB-API fence is known to be safe on."""


@dataclass(frozen=True)
class SqlDialect:
    """What differs between the databases the fence runs on: how a writing transaction opens, the
    column types of its tables, and the driver's parameter style. The fence's statements are shared."""

    name: str
    #: Run first in every fence transaction (None: the driver opens the transaction itself).
    begin: str | None
    #: Column types: text, the token (64-bit), a timestamp.
    text: str
    bigint: str
    timestamp: str
    #: ``named`` (``:name``, sqlite3) or ``pyformat`` (``%(name)s``, psycopg2).
    paramstyle: str
    #: What a read of the count epoch adds to lock its row until the transaction ends (PostgreSQL's
    #: ``FOR SHARE``); empty where the writing transaction holds the whole database (SQLite's ``BEGIN
    #: IMMEDIATE``).
    share_lock: str = ""


#: The dialects the fence is known to work on (tests/core/test_fence_dbapi.py runs every statement on each).
DIALECTS: dict[str, SqlDialect] = {
    "sqlite": SqlDialect("sqlite", "BEGIN IMMEDIATE", "TEXT", "INTEGER", "TIMESTAMP", "named", ""),
    "postgres": SqlDialect("postgres", None, "text", "bigint", "timestamptz", "pyformat", " FOR SHARE"),
}

_DIALECT_ALIASES = {"sqlite3": "sqlite", "postgresql": "postgres", "psycopg2": "postgres"}


def sql_dialect(name: str) -> SqlDialect:
    """The statement set of dialect ``name``; :class:`UnsupportedDialect` for any other."""
    key = _DIALECT_ALIASES.get(str(name).lower(), str(name).lower())
    try:
        return DIALECTS[key]
    except KeyError:
        raise UnsupportedDialect(
            "dialect", name,
            f"the SQL fence is known to work on {', '.join(sorted(DIALECTS))} only (docs/airflow.md, "
            "\"Where the fence is kept\"); fence this target at the lease store instead (lease.fence(...) "
            "and carry the token in the write)",
        ) from None


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def _quoted(parameter: str, name: str) -> str:
    """A validated name, double-quoted (standard SQL, as both dialects quote identifiers)."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise InvalidArgument(parameter, name, "must be a plain SQL name (letters, digits, _; up to 63)")
    return f'"{name}"'


# The fence's statements, shared by every dialect: {fence}, {publish} and the column types are filled in
# from validated names (_quoted) and the dialect's constants; every value is a parameter (:name).
_CREATE = (
    """CREATE TABLE IF NOT EXISTS {fence} (
        resource     {text}      NOT NULL,
        lease_key    {text}      NOT NULL,
        token        {bigint}    NOT NULL CHECK (token >= 0),
        owner        {text},
        store_id     {text},
        accepted_at  {timestamp} NOT NULL,
        PRIMARY KEY (resource, lease_key)
    )""",
    """CREATE TABLE IF NOT EXISTS {publish} (
        resource         {text}      NOT NULL,
        idempotency_key  {text}      NOT NULL,
        token            {bigint}    NOT NULL,
        owner            {text},
        published_at     {timestamp} NOT NULL,
        PRIMARY KEY (resource, idempotency_key)
    )""",
    """CREATE TABLE IF NOT EXISTS {count_epoch} (
        resource     {text}      NOT NULL,
        lease_key    {text}      NOT NULL,
        count_epoch  {bigint}    NOT NULL,
        accepted_at  {timestamp} NOT NULL,
        PRIMARY KEY (resource, lease_key)
    )""",
)
_CLAIM = """INSERT INTO {publish} (resource, idempotency_key, token, owner, published_at)
    VALUES (:resource, :idempotency_key, :token, :owner, CURRENT_TIMESTAMP)
    ON CONFLICT (resource, idempotency_key) DO NOTHING"""
_EPOCH_ROW = """INSERT INTO {count_epoch} (resource, lease_key, count_epoch, accepted_at)
    VALUES (:resource, :base_key, :count_epoch, CURRENT_TIMESTAMP)
    ON CONFLICT (resource, lease_key) DO NOTHING"""
_EPOCH_RAISE = """UPDATE {count_epoch} SET count_epoch = :count_epoch, accepted_at = CURRENT_TIMESTAMP
    WHERE resource = :resource AND lease_key = :base_key AND count_epoch < :count_epoch"""
_EPOCH_READ = """SELECT count_epoch FROM {count_epoch} WHERE resource = :resource AND lease_key = :base_key{share_lock}"""
_ROW = """INSERT INTO {fence} (resource, lease_key, token, owner, store_id, accepted_at)
    VALUES (:resource, :key, 0, NULL, NULL, CURRENT_TIMESTAMP)
    ON CONFLICT (resource, lease_key) DO NOTHING"""
# Every SET expression reads the row's values before the update (standard SQL; MySQL is not, and is refused).
_ADVANCE = """UPDATE {fence}
    SET token = :token, owner = :owner, accepted_at = CURRENT_TIMESTAMP,
        store_id = CASE WHEN token < :token THEN :store_id ELSE COALESCE(store_id, :store_id) END
    WHERE resource = :resource AND lease_key = :key
      AND (token < :token
           OR (token = :token AND owner = :owner
               AND (store_id IS NULL OR :store_id IS NULL OR store_id = :store_id)))"""
_CURRENT = """SELECT token, store_id FROM {fence} WHERE resource = :resource AND lease_key = :key AND token > 0"""
_TOKENS = """SELECT lease_key, token FROM {fence} WHERE resource = :resource AND token > 0"""
_PUBLISHED = """SELECT 1 FROM {publish} WHERE resource = :resource AND idempotency_key = :idempotency_key"""
_RELEASE = """DELETE FROM {publish}
    WHERE resource = :resource AND idempotency_key = :idempotency_key AND token = :token
      AND (owner = :owner OR (owner IS NULL AND :owner IS NULL))"""

_PARAM = re.compile(r":([a-z_]+)")


class DbApiFence(Fence):
    """A fence kept in tables of any supported SQL database, reached through DB-API connections.

    :param connect: makes a new DB-API connection to the target (a hook's ``get_conn``); each fence
        operation uses one and closes it.
    :param dialect: the target's dialect name (``sqlite``, ``postgres``; see :data:`DIALECTS`).
    :param where: how messages name the target (never with a password).
    :param schema: the schema (SQLite: the attached database) of the fence's tables; default the
        connection's own.
    :param ledger: the lease store's event ledger, where refusals are recorded (best effort).
    :param record_events: False: refusals are only logged.
    :param secrets: strings to blank out of a driver's message before it is raised (the password).
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        *,
        dialect: str,
        where: str,
        schema: str | None = None,
        ledger: EventLedger | None = None,
        record_events: bool = True,
        secrets: Sequence[str] = (),
    ) -> None:
        if not callable(connect):
            raise InvalidArgument("connect", connect, "must be a callable that returns a DB-API connection")
        self.dialect = sql_dialect(dialect)
        self.where = where
        prefix = "" if schema is None else _quoted("schema", schema) + "."
        self._schema = schema
        self._names = {
            "fence": prefix + _quoted("table", FENCE_TABLE), "publish": prefix + _quoted("table", PUBLISH_TABLE),
            "count_epoch": prefix + _quoted("table", COUNT_EPOCH_TABLE),
            "text": self.dialect.text, "bigint": self.dialect.bigint, "timestamp": self.dialect.timestamp,
            "share_lock": self.dialect.share_lock,
        }
        self._connect = connect
        self.ledger = ledger
        self.record_events = record_events
        self._secrets = tuple(s for s in secrets if s)
        self._schema_ready = False

    # -- statements --------------------------------------------------------------------------------

    def _sql(self, template: str) -> str:
        text = template.format(**self._names)
        if self.dialect.paramstyle == "pyformat":
            return _PARAM.sub(r"%(\1)s", text)
        return text

    def _run(self, cur: Any, template: str, params: dict[str, Any] | None = None) -> int:
        cur.execute(self._sql(template), params or {})
        return int(cur.rowcount)

    def _unavailable(self, exc: BaseException, doing: str) -> LeaseStoreUnavailable:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        for secret in self._secrets:
            detail = detail.replace(secret, "***")
        return LeaseStoreUnavailable(
            f"fence target {self.where}: could not {doing} ({type(exc).__name__}: {detail}); nothing was "
            "published (the fence fails closed)"
        )

    @contextmanager
    def _connection(self, doing: str) -> Iterator[Any]:
        try:
            conn = self._connect()
        except Exception as exc:
            raise self._unavailable(exc, f"connect to {doing}") from None
        try:
            if self.dialect.begin is None and getattr(conn, "autocommit", False) is True:
                # The driver opens the transaction itself (psycopg2), unless the connection was handed out in
                # autocommit mode: then the fence advance and each statement would commit on their own.
                try:
                    conn.autocommit = False
                except Exception as exc:
                    raise self._unavailable(exc, f"leave autocommit mode to {doing}") from None
            elif self.dialect.begin is not None and getattr(conn, "autocommit", None) is False:
                # sqlite3 on Python 3.12+ with autocommit=False keeps a transaction open at all times, so the
                # fence's own BEGIN IMMEDIATE would fail: switched to explicit transactions (commits nothing).
                try:
                    conn.autocommit = True
                except Exception as exc:
                    raise self._unavailable(exc, f"open a transaction to {doing}") from None
            yield conn
        finally:
            try:
                conn.close()
            except Exception:  # the connection is dropped either way
                log.debug("fence target %s: closing the connection failed", self.where, exc_info=True)

    def ensure_schema(self) -> None:
        """Create the fence's two tables if they are not there (each statement idempotent)."""
        with self._connection("create the fence tables") as conn:
            try:
                cur = conn.cursor()
                private = self.dialect.name == "sqlite" and self._sqlite_private(cur)
            except Exception as exc:
                _rollback(conn)
                raise self._unavailable(exc, "read the target's databases") from None
            if private:
                raise InvalidArgument(
                    "connect", self.where,
                    "opens an in-memory or temporary SQLite database: every connection gets one of its own, "
                    "gone when it closes, so no fence can be kept there; point the connection at a file",
                )
            try:
                for statement in _CREATE:
                    cur.execute(self._sql(statement))
                _commit(conn)
            except Exception as exc:
                _rollback(conn)
                raise self._unavailable(exc, "create the fence tables") from None
        self._schema_ready = True

    def _sqlite_private(self, cur: Any) -> bool:
        """Whether the fence's SQLite database (``schema``'s, else ``main``) has no file: ``:memory:`` or a
        temporary database, private to each connection."""
        name = self._schema or "main"
        cur.execute("PRAGMA database_list")
        return any(str(row[1]) == name and not row[2] for row in cur.fetchall())

    def _ready(self) -> None:
        if not self._schema_ready:
            self.ensure_schema()

    # -- the rule ----------------------------------------------------------------------------------

    def _decide(self, cur: Any, params: dict[str, Any]) -> FenceDecision:
        """Steps 1-4 of the module's docstring on an open connection's cursor: the decision; the fence
        row (and the idempotency claim) are locked until the transaction ends."""
        if self.dialect.begin is not None:
            cur.execute(self.dialect.begin)
        outcome = "accepted"
        floor: int | None = None
        if params["idempotency_key"] is not None and self._run(cur, _CLAIM, params) == 0:
            outcome = "duplicate"
        if outcome == "accepted" and params["count_epoch"] is not None:
            self._run(cur, _EPOCH_ROW, params)
            self._run(cur, _EPOCH_RAISE, params)
            self._run(cur, _EPOCH_READ, params)
            floor = int(cur.fetchone()[0])
            if params["token"] <= floor:
                outcome = "count_epoch"
        if outcome == "accepted":
            self._run(cur, _ROW, params)
            if self._run(cur, _ADVANCE, params) != 1:
                outcome = "stale"
        self._run(cur, _CURRENT, params)
        row = cur.fetchone()
        current, store = (None, None) if row is None else (int(row[0]), None if row[1] is None else str(row[1]))
        return FenceDecision(
            params["resource"], params["token"], outcome, current, params["idempotency_key"], params["key"],
            params["store_id"], store, floor if outcome == "count_epoch" else None,
        )

    @contextmanager
    def transaction(
        self, resource: str, token: int, **publish: Unpack[Publish]
    ) -> Iterator[Any]:
        """Advance the fence and write in one transaction of the target: exactly once.

        Yields a DB-API cursor after the fence accepted ``token``; what is written through it commits with
        the fence advance, or not at all. Raises :class:`StaleFencingToken` (``DuplicatePublish`` for a used
        ``idempotency_key``) with nothing written; an error of your own SQL reaches you as the driver's
        exception, after the rollback; an unreachable or failing target is :class:`LeaseStoreUnavailable`.
        """
        params = fencing.checked_publish(resource, token, publish)
        self._ready()
        rejected: FenceDecision | None = None
        with self._connection("publish") as conn:
            try:
                cur = conn.cursor()
                decision = self._decide(cur, params)
            except Exception as exc:
                _rollback(conn)
                raise self._unavailable(exc, "advance the fence") from None
            if decision.accepted:
                try:
                    yield cur
                except BaseException:
                    _rollback(conn)
                    raise
                try:
                    _commit(conn)
                except Exception as exc:
                    _rollback(conn)
                    raise self._unavailable(exc, "commit the publish") from None
            else:
                _rollback(conn)
                rejected = decision
        if rejected is not None:
            self._reported(params, rejected, publish.get("run"))
            rejected.raise_if_rejected()

    def advance(
        self, resource: str, token: int, **publish: Unpack[Publish]
    ) -> FenceDecision:
        """Advance the fence of ``resource`` for lease ``key`` to ``token`` (committed at once) and return the
        decision, refusals included (see :meth:`FenceStore.advance
        <airflow_lease_provider.core.fence.FenceStore.advance>`, the same rule). Not retried."""
        params = fencing.checked_publish(resource, token, publish)
        self._ready()
        with self._connection("advance the fence") as conn:
            try:
                decision = self._decide(conn.cursor(), params)
                if decision.accepted:
                    _commit(conn)
                else:
                    _rollback(conn)
            except Exception as exc:
                _rollback(conn)
                raise self._unavailable(exc, "advance the fence") from None
        if decision.accepted and params["idempotency_key"] is not None:

            def release() -> bool:
                return self._give_back(params)

            decision = replace(decision, _release=release)
        return self._reported(params, decision, publish.get("run"))

    def current(self, resource: str, *, key: str) -> int | None:
        """The largest token of lease ``key`` accepted at ``resource`` (or ``None``)."""
        rows = self._read(_CURRENT, fencing.publish_params(resource, key, 1, None, None, None))
        return None if not rows else int(rows[0][0])

    def tokens(self, resource: str) -> dict[str, int]:
        """Every lease key's largest accepted token at ``resource``."""
        return {str(k): int(t) for k, t in self._read(_TOKENS, fencing.publish_params(resource, "-", 1, None, None, None))}

    def published(self, resource: str, idempotency_key: str) -> bool:
        """Whether ``idempotency_key`` is claimed at ``resource`` (published, or its side effect in flight)."""
        return bool(self._read(_PUBLISHED, fencing.publish_params(resource, "-", 1, None, idempotency_key, None)))

    def _read(self, template: str, params: dict[str, Any]) -> list[Any]:
        self._ready()
        with self._connection("read the fence") as conn:
            try:
                cur = conn.cursor()
                self._run(cur, template, params)
                rows = list(cur.fetchall())
                _rollback(conn)
            except Exception as exc:
                raise self._unavailable(exc, "read the fence") from None
        return rows

    def _give_back(self, params: dict[str, Any]) -> bool:
        try:
            with self._connection("give back the idempotency claim") as conn:
                cur = conn.cursor()
                if self.dialect.begin is not None:
                    cur.execute(self.dialect.begin)
                given_back = self._run(cur, _RELEASE, params) > 0
                _commit(conn)
        except Exception as exc:
            log.warning(
                "fence %r: could not give back the claim of idempotency key %r (%s); it stays claimed",
                params["resource"], params["idempotency_key"], type(exc).__name__,
            )
            return False
        return given_back

    def _reported(self, params: dict[str, Any], decision: FenceDecision, run: RunRef | None) -> FenceDecision:
        if not decision.accepted:
            fencing.record_rejection(
                decision, owner=params["owner"], run=run, fence_at=self.where,
                ledger=self.ledger if self.record_events else None,
            )
        return decision


def _commit(conn: Any) -> None:
    """Commit; also a transaction ``commit()`` leaves open: sqlite3 on Python 3.12+ with ``autocommit=True``
    does nothing on ``commit()``, and the fence's ``BEGIN IMMEDIATE`` would be rolled back at close."""
    conn.commit()
    if getattr(conn, "in_transaction", False) is True:
        conn.cursor().execute("COMMIT")


def _rollback(conn: Any) -> None:
    try:
        conn.rollback()
        if getattr(conn, "in_transaction", False) is True:  # as in _commit: rollback() did nothing
            conn.cursor().execute("ROLLBACK")
    except Exception:  # a dead connection rolled back by itself
        log.debug("rollback on a fence connection failed", exc_info=True)


__all__ = ["DIALECTS", "DbApiFence", "SqlDialect", "StaleFencingToken", "UnsupportedDialect", "sql_dialect"]
