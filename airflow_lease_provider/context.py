"""The import path of :func:`current_lease` and :class:`LeaseContext` before 0.x's runtime package.

DAGs written against it keep working: the names are :mod:`airflow_lease_provider.runtime`'s own
objects. New code imports them from there (docs/airflow.md).
"""

from __future__ import annotations

from airflow_lease_provider.runtime.context import XCOM_LEASE, XCOM_SKIP_REASON, LeaseContext, current_lease

__all__ = ["XCOM_LEASE", "XCOM_SKIP_REASON", "LeaseContext", "current_lease"]
