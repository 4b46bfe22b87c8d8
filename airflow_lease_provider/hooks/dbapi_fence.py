"""``DbApiFenceHook``: the SQL fence in the target database of any connection whose hook is a ``DbApiHook``.

``lease.fenced_transaction(resource, conn_id=...)``, ``lease.fence(resource, conn_id=...)`` and
``FencedSQLOperator(fence_conn_id=...)`` keep the fence in the database of that connection, so the fence
advance and your write are one transaction there:

- a PostgreSQL connection (conn type ``postgres``, or this provider's ``lease``) gets the store's own fence
  (:class:`~airflow_lease_provider.core.fence.FenceStore`, its in-database ``fence_advance``; in the lease
  store's own database it also refuses a token below the key's newest grant);
- any other connection whose Airflow hook is a common.sql ``DbApiHook`` gets
  :class:`~airflow_lease_provider.core.dbapi_fence.DbApiFence` (the same rule in standard SQL, tables
  ``lease_fence`` and ``lease_fence_publish`` in that database), if its dialect is one the fence is known
  to work on (``sqlite``; see ``DIALECTS``). Any other is refused with an error naming the connection.

Needs the common.sql provider (the ``sql`` extra) and the provider of the connection's type
(``apache-airflow-providers-sqlite`` for SQLite).
"""

from __future__ import annotations

from typing import Any

from airflow_lease_provider.core import InvalidArgument, LeaseStore
from airflow_lease_provider.core.dbapi_fence import DIALECTS, DbApiFence, UnsupportedDialect, sql_dialect
from airflow_lease_provider.hooks.lease import FenceHook, _get_connection, _unreadable
from airflow_lease_provider.version_compat import AirflowNotFoundException

#: Connection types that get the PostgreSQL store's own fence (FenceHook).
POSTGRES_CONN_TYPES = frozenset({"postgres", "postgresql", "lease"})
ROLE = "fence connection (the database the fence is kept in)"


class DbApiFenceHook:
    """The fence kept in the database of ``fence_conn_id``, a connection whose hook is a ``DbApiHook``.

    :param fence_conn_id: the target's connection.
    :param lease_store: the lease store whose tokens are published: its ledger records refusals.
    :param schema: the schema (SQLite: attached database) of the fence's tables; default the connection's
        ``lease_schema`` extra, else the connection's own default.
    """

    def __init__(
        self, fence_conn_id: str, *, lease_store: LeaseStore | None = None, schema: str | None = None,
        connection: Any = None,
    ) -> None:
        self.fence_conn_id = fence_conn_id
        self.lease_store = lease_store
        self.schema = schema
        self._connection = connection
        self._fence: DbApiFence | None = None

    def _conn(self) -> Any:
        if self._connection is None:
            self._connection = connection(self.fence_conn_id)
        return self._connection

    def get_hook(self) -> Any:
        """The connection's own DbApiHook (e.g. ``SqliteHook``)."""
        try:
            from airflow.providers.common.sql.hooks.sql import DbApiHook
        except ImportError:  # pragma: no cover - depends on what is installed
            raise ImportError(
                "the SQL fence on a non-PostgreSQL connection needs the common.sql provider: "
                "pip install 'airflow-lease-provider[sql]'"
            ) from None
        conn = self._conn()
        try:
            hook = conn.get_hook()
        except Exception as exc:
            raise InvalidArgument(
                "fence_conn_id", self.fence_conn_id,
                f"is a connection of type {conn.conn_type!r} whose hook could not be made "
                f"({type(exc).__name__}): is the provider for {conn.conn_type!r} installed?",
            ) from None
        if not isinstance(hook, DbApiHook):
            raise InvalidArgument(
                "fence_conn_id", self.fence_conn_id,
                f"is a connection of type {conn.conn_type!r} whose hook ({type(hook).__name__}) is not a "
                "DbApiHook: the SQL fence needs a SQL database connection",
            )
        return hook

    def get_store(self) -> DbApiFence:
        """The fence (made once per hook)."""
        if self._fence is None:
            conn = self._conn()
            try:
                dialect = sql_dialect(conn.conn_type)
            except UnsupportedDialect:
                raise UnsupportedDialect(
                    "fence_conn_id", self.fence_conn_id,
                    f"is a connection of type {conn.conn_type!r}: the SQL fence is known to work on "
                    f"{', '.join(sorted(DIALECTS))} only (docs/airflow.md, \"Where the fence is kept\"). "
                    "Fence this write at the lease store instead (lease.fence(resource) before it, carrying "
                    "lease.token)",
                ) from None
            hook = self.get_hook()
            extras = dict(conn.extra_dejson or {})
            lease = self.lease_store
            self._fence = DbApiFence(
                hook.get_conn,
                dialect=dialect.name,
                where=f"{conn.conn_type} connection {self.fence_conn_id!r}",
                schema=self.schema or extras.get("lease_schema") or None,
                ledger=lease.events if lease is not None else None,
                record_events=lease.record_events if lease is not None else True,
                secrets=[conn.password] if conn.password else [],
            )
        return self._fence


def connection(conn_id: str) -> Any:
    """The Airflow connection ``conn_id`` (a missing one is an error naming it)."""
    try:
        return _get_connection(conn_id)
    except AirflowNotFoundException:
        raise InvalidArgument(
            "fence_conn_id", conn_id, f"is not defined: define connection {conn_id!r} (AIRFLOW_CONN_"
            f"{conn_id.upper()}, or in the UI) for the database the fence is kept in",
        ) from None
    except Exception as exc:
        raise _unreadable(conn_id, exc, ROLE) from None


def fence_store(conn_id: str | None, *, default_conn_id: str | None, lease_store: LeaseStore) -> Any:
    """The fence for a publish to the database of ``conn_id`` (``None``: the lease store's own,
    ``default_conn_id``): the PostgreSQL store's fence for a PostgreSQL connection, a :class:`DbApiFence`
    for another DbApiHook connection."""
    if conn_id is None or conn_id == default_conn_id:
        return FenceHook(default_conn_id, lease_store=lease_store).get_store()
    try:
        conn = _get_connection(conn_id)
    except AirflowNotFoundException:
        conn = None  # FenceHook names the missing connection (and knows the embedded store)
    except Exception as exc:
        raise _unreadable(conn_id, exc, ROLE) from None
    if conn is None or str(conn.conn_type or "postgres").lower() in POSTGRES_CONN_TYPES:
        return FenceHook(conn_id, lease_store=lease_store).get_store()
    return DbApiFenceHook(conn_id, lease_store=lease_store, connection=conn).get_store()
