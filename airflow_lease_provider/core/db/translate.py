"""The translation of driver errors into the library's own: the single place where this happens."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2
import psycopg2.errors

from airflow_lease_provider.core.db.dsn import redact
from airflow_lease_provider.core.errors import InvalidArgument, LeaseError, LeaseStoreUnavailable


class LeaseStoreError(LeaseError):
    """The store answered with an error that is not about reaching it (a bug or a broken schema)."""



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



#: SQLSTATEs of "there is no such store here" (undefined_table, invalid_schema_name).
MISSING_OBJECT = frozenset({"42P01", "3F000"})
#: What a statement of the store raises when the store was dropped under it: no such table, function or
#: schema (undefined_table, undefined_function, invalid_schema_name).
MISSING_STORE_OBJECT = frozenset({"42P01", "42883", "3F000"})


def names_missing_object(error: BaseException) -> bool:
    """Whether a translated error's cause says the table or the schema does not exist."""
    cause = error.__cause__
    return isinstance(cause, DriverError) and cause.pgcode in MISSING_OBJECT


class CallerError(Exception):
    """Carries an error of the caller's own SQL (inside a store's transaction) past the store's error
    translation, so the caller gets the driver's exception itself (:func:`callers_statements`)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@contextmanager
def callers_statements(cur: Any) -> Iterator[None]:
    """Around the caller's own statements on ``cur``: a driver error there is raised as :class:`CallerError`
    (the caller's, unchanged), unless the connection died under it (then it is the store's, translated)."""
    try:
        yield
    except psycopg2.Error as exc:
        if cur.connection.closed:
            raise
        raise CallerError(exc) from exc
