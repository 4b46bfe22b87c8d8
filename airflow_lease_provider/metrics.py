"""Metrics through Airflow's task-side Stats. Skips have their own counters and never count as failures.

=================================  ==================================================================================
``scheduled.skipped_overlap``      a leased task was skipped because another run held the lease
``scheduled.skipped_catchup``      catch-up slots skipped after downtime (by the count skipped)
``scheduled.coalesced``            catch-up slots coalesced into one run after downtime (by the count)
``scheduled.skipped_replaced``     ``replace``: the task was skipped because a newer run took its lease over
                                   (counted by the replaced task when it finds out)
``scheduled.skipped_buffer_full``  ``wait`` with ``max_waiting``: skipped, every waiting place taken
``lease.acquired``                 a lease was acquired
``lease.slot_acquired``            ``lease_slots=N``: a slot of a semaphore was acquired (tags ``slot`` and ``slots`` too)
``lease.replaced``                 ``replace``: the task took its lease over from an older run (once per takeover)
``lease.waiting``                  a task deferred to wait for its lease (once per wait, not per resume)
``lease.overlap_failed``           ``on_overlap="fail"``: the task failed because the lease was held
``lease.lost``                     a held lease was lost (renewal refused or too late); the task fails
``lease.fence_rejected``           a publish was refused by the fence (stale token or used idempotency key)
``lease.held``                     timer: how long a task held its lease, in milliseconds
=================================  ==================================================================================

All carry tags ``dag_id``, ``task_id`` and ``lease_key`` where known (statsd without tag support
ignores them).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from airflow_lease_provider import version_compat

log = logging.getLogger(__name__)


def _stats() -> Any:
    return version_compat.Stats  # imported on first use


def incr(name: str, tags: dict[str, str] | None = None, count: int = 1) -> None:
    try:
        _stats().incr(name, count=count, tags=tags or {})
    except Exception:  # metrics must never change the outcome of a task
        log.debug("could not emit metric %s", name, exc_info=True)


def timing(name: str, elapsed: timedelta, tags: dict[str, str] | None = None) -> None:
    try:
        _stats().timing(name, elapsed, tags=tags or {})
    except Exception:  # metrics must never change the outcome of a task
        log.debug("could not emit metric %s", name, exc_info=True)
