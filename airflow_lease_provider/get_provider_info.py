"""Provider metadata read by Airflow's ProvidersManager (entry point ``apache_airflow_provider``).

The one table of the provider's configuration facts: the ``[lease]`` options with their defaults
(:data:`OPTIONS`, which :mod:`airflow_lease_provider.settings` reads its fallbacks from) and the
connection form (:data:`CONNECTION_FIELDS`, :data:`CONNECTION_FORM`, which ``LeaseHook`` returns too).
Where a default is the core's own (the schema, the renewal fraction, the event retention), the table
states the core's value and ``tests/airflow/test_configuration.py`` holds the two equal: importing the
core here would load psycopg2 and the whole store into every process that lists providers.

Keep it import-light: Airflow calls it while it is still configuring itself. It imports nothing but the
package's version (tests/test_layout.py checks that neither Airflow nor the core is loaded).
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from airflow_lease_provider import __version__

#: The core's defaults, as the table states them (equal to ``core.db.DEFAULT_SCHEMA``,
#: ``core.keeper.DEFAULT_RENEW_FRACTION`` and ``core.events.DEFAULT_RETENTION``: tested).
DEFAULT_SCHEMA = "airflow_lease"
DEFAULT_RENEW_FRACTION = "0.3333"
DEFAULT_RETENTION_DAYS = "30"

#: The lease store's connection: its default id, its type and the name the connection form shows.
DEFAULT_CONN_ID = "lease_default"
CONN_TYPE = "lease"
HOOK_NAME = "Lease store (PostgreSQL)"

#: The ``[lease]`` options as Airflow's provider config declares them (every value a string).
OPTIONS: dict[str, dict[str, str]] = {
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
        "default": DEFAULT_CONN_ID,
    },
    "schema": {
        "description": "PostgreSQL schema of the lease, fence and event tables.",
        "version_added": "0.1.0",
        "type": "string",
        "example": "airflow_lease",
        "default": DEFAULT_SCHEMA,
    },
    "renew_fraction": {
        "description": (
            "Renew a lease every TTL x this fraction while its task runs. 1/3 leaves room "
            "for two missed renewals before the lease lapses."
        ),
        "version_added": "0.1.0",
        "type": "float",
        "example": "0.25",
        "default": DEFAULT_RENEW_FRACTION,
    },
    "event_retention_days": {
        "description": "How many days the event ledger keeps events.",
        "version_added": "0.1.0",
        "type": "integer",
        "example": "90",
        "default": DEFAULT_RETENTION_DAYS,
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
    "access": {
        "description": (
            "How a task reaches its lease: direct (its own connection to the lease store), api "
            "(over HTTP through the api-server's lease API, docs/api.md), or auto: direct when the "
            "lease connection is defined and its server answers from the task's host, else api."
        ),
        "version_added": "0.2.0",
        "type": "string",
        "example": "api",
        "default": "auto",
    },
    "api_url": {
        "description": (
            "The api-server's base URL as tasks reach it, for the lease API path; empty: "
            "[workers] execution_api_server_url without its /execution/ path, else [api] base_url."
        ),
        "version_added": "0.2.0",
        "type": "string",
        "example": "https://airflow.example.com",
        "default": "",
    },
    "api_pool_size": {
        "description": (
            "The api-server's lease API: at most this many connections to the lease store, shared by its "
            "request threads (each request takes one for its one statement and gives it back)."
        ),
        "version_added": "0.2.0",
        "type": "integer",
        "example": "16",
        "default": "8",
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
    "prepare_statements": {
        "description": (
            "Send the store's hot statements (acquire, renew, release, the holder read, "
            "the fence advance) as prepared statements on a connection that sends them "
            "more than once (with hold_connection, a task's renewals). It works behind "
            "pgbouncer's transaction pooling: a server session without the statement "
            "gets it prepared on the spot. Set False behind a pooler that pins a "
            "client to one server session when it sees PREPARE (Amazon RDS Proxy)."
        ),
        "version_added": "0.1.0",
        "type": "boolean",
        "example": "False",
        "default": "True",
    },
    "push_lease_xcom": {
        "description": (
            "Push each leased task's lease (key, token, owner, expiry) to XCom under the key "
            "'lease' before its body runs, for downstream tasks that xcom_pull(key='lease'). False "
            "(the default) skips that XCom write, the largest step a leased task adds (about 10 ms "
            "in the benchmark): the body has its lease in its context, fenced publishing finds the "
            "run's lease in the store, and nothing in the provider reads that XCom. True pushes it."
        ),
        "version_added": "0.1.0",
        "type": "boolean",
        "example": "True",
        "default": "False",
    },
}

#: Extra fields of the connection form (Airflow 3's ``conn-fields``).
CONNECTION_FIELDS: dict[str, dict[str, Any]] = {
    "lease_schema": {
        "label": "Lease schema",
        "schema": {"type": ["string", "null"], "default": DEFAULT_SCHEMA},
        "description": "PostgreSQL schema holding the lease tables (default [lease] schema).",
    },
}

#: The standard fields of the connection form, as ``BaseHook.get_ui_field_behaviour`` returns them.
CONNECTION_FORM: dict[str, Any] = {
    "hidden_fields": [],
    "relabeling": {"schema": "Database"},
    "placeholders": {"host": "localhost", "port": "5432", "schema": "airflow", "login": "airflow"},
}


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
                "hook-name": HOOK_NAME,
                "connection-type": CONN_TYPE,
                "conn-fields": deepcopy(CONNECTION_FIELDS),
                "ui-field-behaviour": {key.replace("_", "-"): deepcopy(value) for key, value in CONNECTION_FORM.items()},
            }
        ],
        "task-decorators": [
            {"name": "leased", "class-name": "airflow_lease_provider.decorators.leased.leased_task"},
            {
                "name": "fenced_publish",
                "class-name": "airflow_lease_provider.decorators.fenced.fenced_publish_task",
            },
        ],
        # The lease store in the metadata database, by `airflow db migrate` (Airflow 3.2+ reads this list;
        # docs/api.md, decision 1).
        "db-managers": ["airflow_lease_provider.db_manager.LeaseDBManager"],
        "config": {
            "lease": {
                "description": "Options of airflow-lease-provider: where leases live and how they renew.",
                "options": deepcopy(OPTIONS),
            }
        },
    }
