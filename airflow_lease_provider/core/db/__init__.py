"""The core's database layer: the one package that imports the driver (psycopg2).

=================  ===========================================================================================
module             owns
=================  ===========================================================================================
``database``       :class:`Database`: a store's connection (lazily opened, shared under a lock, closed when
                   idle), its named statements as sent (``SET LOCAL`` prefix, prepared from the second use),
                   transactions, and rows by column name (:meth:`Database.records`, :meth:`Database.record`)
``sqltext``        the SQL files' text: the named queries of ``sql/queries.sql``, the ``{schema}`` placeholder
                   (:func:`with_schema`), the prepared-statement texts
``translate``      driver errors into the library's own (:func:`translate`), the caller's own SQL inside a
                   store's transaction (:func:`callers_statements`)
``dsn``            connection strings: where one points without its password, redaction of every password
``watchdog``       the thread that cuts off statements the server never answers and closes idle connections
=================  ===========================================================================================
"""

from __future__ import annotations

from airflow_lease_provider.core.db.database import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_SCHEMA,
    DEFAULT_STATEMENT_TIMEOUT,
    Database,
    Row,
    shared_database,
)
from airflow_lease_provider.core.db.dsn import REDACTED, describe_dsn, make_dsn, redact, remember_secrets
from airflow_lease_provider.core.db.sqltext import (
    PREPARE_AFTER,
    named_queries,
    prepared_queries,
    with_identifiers,
    with_names_for,
    with_schema,
)
from airflow_lease_provider.core.db.translate import (
    CallerError,
    DriverError,
    LeaseStoreError,
    callers_statements,
    names_missing_object,
    translate,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_SCHEMA",
    "DEFAULT_STATEMENT_TIMEOUT",
    "PREPARE_AFTER",
    "REDACTED",
    "CallerError",
    "Database",
    "DriverError",
    "LeaseStoreError",
    "Row",
    "callers_statements",
    "describe_dsn",
    "make_dsn",
    "named_queries",
    "names_missing_object",
    "prepared_queries",
    "redact",
    "remember_secrets",
    "shared_database",
    "translate",
    "with_identifiers",
    "with_names_for",
    "with_schema",
]
