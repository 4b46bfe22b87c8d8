"""Timetables: :class:`CappedCatchupTimetable` caps catch-up after downtime to the newest slots.

Register nothing here: the ``lease`` plugin (``airflow.plugins`` entry point) lists the timetable so the
scheduler, dag-processor and api-server can deserialize DAGs that use it. Everything here is pure (no
database, no writes): the scheduler records what a run skipped or coalesced (the plugin's listener).
"""

from __future__ import annotations

from airflow_lease_provider.timetables.capped_catchup import (
    CappedCatchupTimetable,
    SkippedSlots,
    skipped_slots,
    slot_idempotency_key,
)
from airflow_lease_provider.timetables.catchup_record import (
    CatchUp,
    catchup_of_run,
    coalesced_catchup_slots,
    skipped_catchup_slots,
)

__all__ = [
    "CappedCatchupTimetable",
    "CatchUp",
    "SkippedSlots",
    "catchup_of_run",
    "coalesced_catchup_slots",
    "skipped_catchup_slots",
    "skipped_slots",
    "slot_idempotency_key",
]
