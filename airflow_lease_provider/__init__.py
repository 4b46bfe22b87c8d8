"""Leases with fencing tokens, capped catch-up and visible skips for Apache Airflow 3.

The package is layered: :mod:`airflow_lease_provider.core` knows nothing of Airflow (the lease and fence
store, its SQL, its exceptions); the Airflow-facing parts (hooks, operators, decorators, triggers,
timetables, plugins) sit on top of it. Importing this package imports neither.
"""

from __future__ import annotations

__version__ = "0.1.0"
