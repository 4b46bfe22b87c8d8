"""The ``lease`` Airflow plugin, registered through the ``airflow.plugins`` entry point.

Airflow loads it in the scheduler, the dag-processor, the api-server and workers, so keep the import
light: only what the registered components themselves need.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from airflow_lease_provider.timetables.capped_catchup import CappedCatchupTimetable


class LeasePlugin(AirflowPlugin):
    """Registers the provider's timetables (and, later, its UI)."""

    name = "lease"
    # Airflow deserializes a custom timetable only if a plugin lists its class.
    timetables = [CappedCatchupTimetable]
