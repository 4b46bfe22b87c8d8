"""What the lease store and the fence store share: a database boundary, a ledger, the schema on first use
(or, read-only, a check that it is there)."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

from airflow_lease_provider.core.db import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_SCHEMA,
    DEFAULT_STATEMENT_TIMEOUT,
    Database,
    shared_database,
)
from airflow_lease_provider.core.errors import InvalidArgument
from airflow_lease_provider.core.events import DEFAULT_RETENTION, EventLedger
from airflow_lease_provider.core.schema import check_schema, ensure_schema


class Store:
    """A store on PostgreSQL that creates or migrates its schema on first use.

    :param dsn: libpq connection string or ``postgresql://`` URI.
    :param schema: the PostgreSQL schema for the store's tables (default ``airflow_lease``).
    :param connect_timeout: an unreachable store fails closed after this long.
    :param statement_timeout: a statement that runs longer fails closed.
    :param record_events: write what happens to the event ledger.
    :param event_retention: how long the ledger keeps events.
    :param read_only: never create the schema: a connection or schema with no store there raises
        :class:`~airflow_lease_provider.core.schema.SchemaMissing` (for status pages and the CLI, where a
        typo must say "no lease store there" rather than create one).
    :param idle_close: close the connection after it has been idle this long (``timedelta(0)``: after each
        operation); ``None`` keeps it open (see :class:`~airflow_lease_provider.core.db.Database`).
    :param prepare: prepare the hot statements on a connection from their second use on (``False``:
        plain text only, for a pooler that pins sessions on ``PREPARE``; see
        :class:`~airflow_lease_provider.core.db.Database`).
    :param pool_size: share at most this many connections among this process's stores of the same server
        (``None``: a connection of its own; see :mod:`airflow_lease_provider.core.db.pool`).
    :param host: the host name recorded with each lease this store acquires (default: this machine's),
        so that a skipped run can say where the holder runs.
    :param shared: use this process's database for the same DSN, schema and settings
        (:func:`~airflow_lease_provider.core.db.shared_database`, which needs a positive ``idle_close``)
        instead of one of its own: the stores of the tasks one process runs reuse its connection while
        it is open, and the schema is checked by the first of them only; a statement that finds the
        store's tables gone makes it check again (and create it) before the statement is sent again.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT,
        statement_timeout: timedelta = DEFAULT_STATEMENT_TIMEOUT,
        record_events: bool = True,
        event_retention: timedelta = DEFAULT_RETENTION,
        read_only: bool = False,
        idle_close: timedelta | None = None,
        host: str | None = None,
        prepare: bool = True,
        pool_size: int | None = None,
        shared: bool = False,
    ) -> None:
        if shared:
            if pool_size is not None or read_only or idle_close is None:
                raise InvalidArgument(
                    "shared", shared, "needs a positive idle_close, no pool_size and a store that is not read-only"
                )
            self.db = shared_database(
                dsn, schema=schema, idle_close=idle_close, connect_timeout=connect_timeout,
                statement_timeout=statement_timeout, prepare=prepare,
            )
            if self.db.on_missing_schema is None:
                db = self.db
                self.db.on_missing_schema = lambda: ensure_schema(db)
        else:
            self.db = Database(
                dsn,
                schema=schema,
                connect_timeout=connect_timeout,
                statement_timeout=statement_timeout,
                idle_close=idle_close,
                prepare=prepare,
                pool_size=pool_size,
            )
        self.shared = shared
        self.events = EventLedger(self.db, retention=event_retention, prepare=self._ready)
        self.record_events = record_events
        self.read_only = read_only
        self.host = host or socket.gethostname()
        if not isinstance(self.host, str) or "\x00" in self.host:
            # Recorded in the same statement as each grant: jsonb cannot store a NUL.
            raise InvalidArgument("host", self.host, "must be a string without NUL characters")
        self._schema_ready = False
        # The lease store's encoded 'acquired' details per (host, TTL) (LeaseStore._acquire_detail).
        self._acquire_details: dict[tuple[str, timedelta], str] = {}

    @property
    def schema(self) -> str:
        return self.db.schema

    def _ready(self) -> Database:
        if not self._schema_ready:
            if self.read_only:
                check_schema(self.db)
            elif not (self.shared and self.db.schema_current):  # a shared database's first store checks it
                ensure_schema(self.db)
                self.db.schema_current = self.shared
            self._schema_ready = True
        return self.db

    def ensure_schema(self) -> int:
        """Create or migrate the schema now rather than on first use; returns its version."""
        version = ensure_schema(self.db)
        self._schema_ready = True
        return version

    def close(self) -> None:
        """Close the connection (a shared database's too: its next user opens another)."""
        self.db.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
