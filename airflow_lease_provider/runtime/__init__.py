"""The runtime of a leased task: one :class:`TaskLease` per execute, and what the task's code sees.

- :mod:`.task_lease`: :class:`TaskLease`, built once from the task and its context; the lease's life:
  acquire, join, keep, report, release.
- :mod:`.policies`: the overlap policies, one strategy class each (skip, wait, fail, replace):
  what the task does when another run holds its lease.
- :mod:`.store`: the task's store, prepared while its templates render and handed to its execute.
- :mod:`.arguments`: the one parse-time check of the lease (and fenced publish) arguments.
- :mod:`.outcomes`: the one path every outcome is reported through (event, metric, log line).
- :mod:`.context`: :class:`LeaseContext` and :func:`current_lease`: the lease as the task's code sees it,
  with its fences.
- :mod:`.signals`: SIGTERM and a lost lease stop the task's body at once.
"""

from __future__ import annotations

from airflow_lease_provider.runtime.context import XCOM_LEASE, XCOM_SKIP_REASON, LeaseContext, current_lease
from airflow_lease_provider.runtime.signals import TaskTerminated
from airflow_lease_provider.runtime.task_lease import TaskLease

__all__ = ["XCOM_LEASE", "XCOM_SKIP_REASON", "LeaseContext", "TaskLease", "TaskTerminated", "current_lease"]

