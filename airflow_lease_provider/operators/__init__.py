"""Operators: any operator under a lease, run leases, fenced publishing."""

from __future__ import annotations

from airflow_lease_provider.operators.fenced import FencedSQLOperator
from airflow_lease_provider.operators.leased import LeasedOperator
from airflow_lease_provider.operators.run_lease import (
    AcquireRunLeaseOperator,
    ReleaseRunLeaseOperator,
    run_lease,
)

__all__ = [
    "AcquireRunLeaseOperator",
    "FencedSQLOperator",
    "LeasedOperator",
    "ReleaseRunLeaseOperator",
    "run_lease",
]
