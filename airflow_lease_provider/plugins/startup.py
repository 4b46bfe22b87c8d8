"""The plugin's listener: what an Airflow component records at its start for the processes it starts.

Airflow calls ``on_starting`` in every component that runs a job (scheduler, triggerer, dag-processor),
before it starts an executor, a trigger runner or a DAG file processor, and again in each task process
(``TaskRunnerMarker``). Recording happens only where the configuration may be read
(:func:`airflow_lease_provider.settings.record_metadata_database`), so a task process keeps what its
component recorded.
"""

from __future__ import annotations

from typing import Any

from airflow_lease_provider import settings
from airflow_lease_provider.version_compat import hookimpl


@hookimpl
def on_starting(component: Any) -> None:
    """Record whether the metadata database is SQLite, for the embedded-store decision of task processes."""
    settings.record_metadata_database()
