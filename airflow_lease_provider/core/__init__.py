"""The Airflow-free core: the lease and fence store on PostgreSQL, its SQL and its exceptions.

Nothing here imports Airflow, so it can be used, tested and benchmarked alone::

    from airflow_lease_provider.core import LeaseStore, FenceStore

    leases = LeaseStore(dsn)
    lease = leases.acquire("daily-article", owner="run-42", ttl=timedelta(minutes=80))
"""

from __future__ import annotations

from airflow_lease_provider.core.db import DEFAULT_SCHEMA, LeaseStoreError
from airflow_lease_provider.core.errors import (
    DuplicatePublish,
    InvalidArgument,
    LeaseError,
    LeaseHeld,
    LeaseLost,
    LeaseStoreUnavailable,
    OutcomeUnknown,
    SchemaError,
    StaleFencingToken,
)
from airflow_lease_provider.core.events import Event, EventCount, EventKind, EventLedger
from airflow_lease_provider.core.fence import FenceStore
from airflow_lease_provider.core.fencing import Fence, FenceDecision, FenceView
from airflow_lease_provider.core.identity import RunRef
from airflow_lease_provider.core.keeper import LeaseKeeper
from airflow_lease_provider.core.lease import LeaseStore, SlotCountMismatch
from airflow_lease_provider.core.types import (
    Acquisition,
    Holding,
    Lease,
    TokenEpoch,
    TokenHolder,
    WaitClaim,
    Waiter,
)

__all__ = [
    "DEFAULT_SCHEMA",
    "Acquisition",
    "DuplicatePublish",
    "Event",
    "EventCount",
    "EventKind",
    "EventLedger",
    "Fence",
    "FenceDecision",
    "FenceStore",
    "FenceView",
    "Holding",
    "InvalidArgument",
    "Lease",
    "LeaseError",
    "LeaseHeld",
    "LeaseKeeper",
    "LeaseLost",
    "LeaseStore",
    "LeaseStoreError",
    "LeaseStoreUnavailable",
    "OutcomeUnknown",
    "SlotCountMismatch",
    "RunRef",
    "SchemaError",
    "StaleFencingToken",
    "TokenEpoch",
    "TokenHolder",
    "WaitClaim",
    "Waiter",
]
