"""The worker's clock against the database's: a warning for people, never an input to a decision."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow_lease_provider import settings
from airflow_lease_provider.core import Lease


def warn_on_clock_skew(lease: Lease, received_at: datetime, logger: Any) -> None:
    """Warn when this worker's clock is off from the database's. No decision depends on it."""
    skew = received_at - lease.observed_at
    limit = settings.clock_skew_warning()
    if abs(skew) > limit:
        logger.warning(
            "lease: this worker's clock differs from the database's by %.1f s (limit %.1f s). "
            "Leases are judged by the database clock only, so nothing is wrong with them, but this "
            "host's logs and timestamps are off.",
            skew.total_seconds(), limit.total_seconds(),
        )
