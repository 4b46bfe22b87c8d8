"""The documented door of :func:`current_lease` (``from airflow_lease_provider.context import current_lease``).

What a leased task's code sees lives in :mod:`airflow_lease_provider.runtime.context`; this module only
keeps the import path the docs have always given.
"""

from __future__ import annotations

from airflow_lease_provider.runtime.context import LeaseContext, current_lease

__all__ = ["LeaseContext", "current_lease"]
