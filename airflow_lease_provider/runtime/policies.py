"""What a task does when another run holds its lease: the overlap policies, one row each.

A policy says whether the task first waits for the lease to free (deferred, freeing its worker slot) and
what it does when it still cannot have it: report the outcome and skip, or report it and fail. A new policy
(``replace``, ``buffer_one``) is a new row here; the lease arguments accept exactly the rows' names.
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_lease_provider.runtime.outcomes import Outcome


@dataclass(frozen=True)
class OverlapPolicy:
    """:ivar waits: defer until the lease frees (at most ``lease_wait_timeout``) before giving up.
    :ivar outcome: what giving up is: ``SKIPPED_OVERLAP`` (the task is skipped, with the reason in XCom) or
        ``OVERLAP_FAILED`` (the task fails with :class:`~airflow_lease_provider.core.LeaseHeld`).
    :ivar says: how the log line of giving up starts."""

    waits: bool
    outcome: Outcome
    says: str


OVERLAP_POLICIES: dict[str, OverlapPolicy] = {
    "skip": OverlapPolicy(waits=False, outcome=Outcome.SKIPPED_OVERLAP, says="skipping"),
    "wait": OverlapPolicy(waits=True, outcome=Outcome.SKIPPED_OVERLAP, says="skipping"),
    "fail": OverlapPolicy(waits=False, outcome=Outcome.OVERLAP_FAILED, says="failing (on_overlap=fail)"),
}
