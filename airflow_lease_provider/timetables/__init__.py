"""Timetables: :class:`CappedCatchupTimetable` caps catch-up after downtime to the newest slots.

Register nothing here: the ``lease`` plugin (``airflow.plugins`` entry point) lists the timetable so the
scheduler, dag-processor and api-server can deserialize DAGs that use it.
"""

from __future__ import annotations

from airflow_lease_provider.timetables.capped_catchup import (
    CappedCatchupTimetable,
    SkippedSlots,
    skipped_slots,
    slot_idempotency_key,
)
from airflow_lease_provider.timetables.catchup_record import (
    coalesced_catchup_slots,
    record_skipped_catchup,
    skipped_catchup_slots,
)

__all__ = [
    "CappedCatchupTimetable",
    "SkippedSlots",
    "coalesced_catchup_slots",
    "record_skipped_catchup",
    "skipped_catchup_slots",
    "skipped_slots",
    "slot_idempotency_key",
]
