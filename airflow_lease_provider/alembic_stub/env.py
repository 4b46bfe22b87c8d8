"""Never run. Airflow's ``RunDBManager.validate`` opens ``<migration_dir>/env.py`` of every external DB manager
before ``airflow db migrate``; the lease store's manager (:mod:`airflow_lease_provider.db_manager`) migrates
the store with the store's own SQL migrations (``core/sql/migrations``), not with Alembic, and points its
``migration_dir`` here so that the check finds a file to read."""
