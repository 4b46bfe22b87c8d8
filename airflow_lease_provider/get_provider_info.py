"""Provider metadata read by Airflow's ProvidersManager (entry point ``apache_airflow_provider``).

Keep it import-light: Airflow calls it while it is still configuring itself.
"""

from __future__ import annotations

from typing import Any

from airflow_lease_provider import __version__


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-lease-provider",
        "name": "Lease",
        "description": (
            "Leases with fencing tokens around tasks, capped catch-up, and skips that are visible and "
            "counted apart from failures."
        ),
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Lease",
                "external-doc-url": "https://pypi.org/project/airflow-lease-provider/",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "Lease",
                "python-modules": [
                    "airflow_lease_provider.operators.leased",
                    "airflow_lease_provider.operators.fenced",
                ],
            }
        ],
        "hooks": [
            {
                "integration-name": "Lease",
                "python-modules": ["airflow_lease_provider.hooks.lease"],
            }
        ],
        "triggers": [
            {
                "integration-name": "Lease",
                "python-modules": ["airflow_lease_provider.triggers.lease_free"],
            }
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_lease_provider.hooks.lease.LeaseHook",
                "hook-name": "Lease store (PostgreSQL)",
                "connection-type": "lease",
                "conn-fields": {
                    "lease_schema": {
                        "label": "Lease schema",
                        "schema": {"type": ["string", "null"], "default": "airflow_lease"},
                        "description": "PostgreSQL schema holding the lease tables (default [lease] schema).",
                    },
                },
                "ui-field-behaviour": {
                    "hidden-fields": [],
                    "relabeling": {"schema": "Database"},
                    "placeholders": {"host": "localhost", "port": "5432", "schema": "airflow"},
                },
            }
        ],
        "task-decorators": [
            {"name": "leased", "class-name": "airflow_lease_provider.decorators.leased.leased_task"},
            {
                "name": "fenced_publish",
                "class-name": "airflow_lease_provider.decorators.fenced.fenced_publish_task",
            },
        ],
        "config": {
            "lease": {
                "description": "Options of airflow-lease-provider: where leases live and how they renew.",
                "options": {
                    "conn_id": {
                        "description": (
                            "Airflow connection of the lease store: a PostgreSQL connection (conn type "
                            "postgres, e.g. AIRFLOW_CONN_LEASE_DEFAULT='postgresql://user:pw@host:5432/db'). "
                            "When it is not defined, a leased task fails with an error naming it, except "
                            "where [lease] embedded allows the embedded PostgreSQL under AIRFLOW_HOME."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "my_postgres",
                        "default": "lease_default",
                    },
                    "schema": {
                        "description": "PostgreSQL schema of the lease, fence and event tables.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "airflow_lease",
                        "default": "airflow_lease",
                    },
                    "renew_fraction": {
                        "description": (
                            "Renew a lease every TTL x this fraction while its task runs. 1/3 leaves room "
                            "for two missed renewals before the lease lapses."
                        ),
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": "0.25",
                        "default": "0.3333",
                    },
                    "event_retention_days": {
                        "description": "How many days the event ledger keeps events.",
                        "version_added": "0.1.0",
                        "type": "integer",
                        "example": "90",
                        "default": "30",
                    },
                    "clock_skew_warning_seconds": {
                        "description": (
                            "Warn at acquire when the worker's clock differs from the database's by more "
                            "than this. No decision depends on the worker's clock; the warning is for people."
                        ),
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": "5",
                        "default": "2",
                    },
                    "embedded_dir": {
                        "description": (
                            "Data directory of the embedded PostgreSQL used when no lease connection is "
                            "defined on a single-host Airflow. Default: AIRFLOW_HOME/lease-postgres."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "/var/lib/airflow/lease-postgres",
                        "default": "",
                    },
                    "embedded": {
                        "description": (
                            "Whether a missing lease connection falls back to the embedded PostgreSQL, "
                            "which protects one host only. auto: only where no second host can exist "
                            "(every executor local and the metadata database on SQLite, as airflow "
                            "standalone has it); true: always (you promise Airflow runs on one host); "
                            "false: never."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "true",
                        "default": "auto",
                    },
                    "hold_connection": {
                        "description": (
                            "Keep one open store connection per running leased task. False (the "
                            "default): the connection is closed as soon as it is idle and opened again "
                            "for the next renewal, so a thousand running leases do not need a thousand "
                            "server connections. True saves a connect per renewal (behind pgbouncer, "
                            "where client connections are cheap)."
                        ),
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "True",
                        "default": "False",
                    },
                },
            }
        },
    }
