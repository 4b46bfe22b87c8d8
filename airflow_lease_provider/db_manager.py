"""The lease store in Airflow's metadata database, created and upgraded by ``airflow db migrate`` (issue 41).

Airflow runs every external DB manager from ``airflow db migrate`` (``RunDBManager``): those of the providers'
``db-managers`` lists (Airflow 3.2+; this provider's ``get_provider_info`` names :class:`LeaseDBManager`) and
those of ``[database] external_db_managers``. Where the metadata database is PostgreSQL, the manager creates or
migrates the lease store in its own schema there (``[lease] schema``, default ``airflow_lease``) with the
store's own migrations, under their advisory lock (:func:`~airflow_lease_provider.core.schema.ensure_schema`):
no Alembic chain, so there is one migration scheme, whichever way a store is created. On SQLite or MySQL it
logs one line and does nothing (the lease store needs PostgreSQL; ``airflow standalone`` keeps the embedded
store). docs/api.md, decision 1.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy import MetaData

from airflow_lease_provider import settings, version_compat
from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.db import Database
from airflow_lease_provider.core.schema import installed_version, latest_version
from airflow_lease_provider.settings import libpq_dsn, metadata_dsn

__all__ = ["MANAGER", "LeaseDBManager", "libpq_dsn", "metadata_dsn", "migrate"]

log = logging.getLogger(__name__)

#: The dotted name Airflow is given (``db-managers``, or ``[database] external_db_managers``).
MANAGER = "airflow_lease_provider.db_manager.LeaseDBManager"


def migrate(dsn: str, schema: str | None = None) -> int:
    """Create or migrate the lease store in ``schema`` (default ``[lease] schema``) of ``dsn``; its version."""
    store = LeaseStore(dsn, schema=schema or settings.schema(), record_events=False)
    try:
        return store.ensure_schema()
    finally:
        store.close()


class LeaseDBManager(version_compat.BaseDBManager):
    """``airflow db migrate``'s door to the lease store (see the module's docstring)."""

    #: No SQLAlchemy tables: the store's tables are its own SQL's (Airflow checks none clash with its own).
    metadata = MetaData()
    #: Never created (no Alembic chain); Airflow requires the name and that it is not ``alembic_version``.
    version_table_name = "airflow_lease_alembic_unused"
    migration_dir = str(Path(__file__).parent / "alembic_stub")
    alembic_file = ""
    #: ``airflow db reset`` leaves the lease store alone: its tokens must never go back.
    supports_table_dropping = False

    def _dsn(self) -> str | None:
        bind = self.session.get_bind()
        return libpq_dsn(bind.url)

    def _migrate(self) -> None:
        dsn = self._dsn()
        schema = settings.schema()
        if dsn is None:
            log.info(
                "lease store: Airflow's metadata database is %s, not PostgreSQL: no lease store created there "
                "(define a lease_default connection to a PostgreSQL, or use the embedded store of airflow standalone)",
                self.session.get_bind().dialect.name,
            )
            return
        version = migrate(dsn, schema)
        log.info("lease store: schema %r of the metadata database is at version %d", schema, version)

    def initdb(self, use_migration_files: bool = False) -> None:
        self._migrate()

    def upgradedb(
        self, to_revision: Any = None, from_revision: Any = None, show_sql_only: bool = False,
        use_migration_files: bool = False,
    ) -> None:
        if show_sql_only:
            log.info("lease store: no offline SQL (the store migrates itself: core/sql/migrations)")
            return
        self._migrate()

    def check_migration(self) -> bool:
        """Whether the store is current (``airflow db check-migrations``); true where there is none to keep."""
        dsn = self._dsn()
        if dsn is None:
            return True
        db = Database(dsn, schema=settings.schema())
        try:
            return installed_version(db) == latest_version()
        finally:
            db.close()

    def get_current_revision(self) -> None:
        return None

    def drop_tables(self, connection: Any) -> None:
        return None
