"""What a task does when another run holds its lease: the overlap policies, one row each.

A policy says whether the task first waits for the lease to free (deferred, freeing its worker slot), how
many runs may wait for one key at once, whether it takes the lease over from an older run, and what it
does when it still cannot have it: report the outcome and skip, or report it and fail. A new policy is a
new row here; the lease arguments accept exactly the rows' names.

``replace`` (Kubernetes' ``Replace``, Temporal's ``TERMINATE_OTHER``): the newer run takes the lease over
from the holder, with a larger token, in one statement (:meth:`LeaseStore.try_replace
<airflow_lease_provider.core.LeaseStore.try_replace>`). The rule that keeps it from ping-ponging: a run
takes over only from a holder of a strictly older run (its DAG run's ``run_after`` is earlier), so an older
run (a replaced run tried again, a cleared task) never takes the lease back from a newer one: it is
skipped, naming the newer holder. The replaced holder's keeper finds out at its next renewal, its body is
interrupted as for a lost lease, and the task ends *skipped* (not failed, so never retried into the lease),
naming the run that replaced it.

``buffer_one`` (Temporal's ``BUFFER_ONE``): ``wait`` with one waiting place per key. The first run that
finds the lease held takes the place and waits (deferred); a run that finds the place taken is skipped,
naming the run that waits. ``wait`` with ``max_waiting=N`` is the same with N places (without it, every
run waits: Temporal's ``BUFFER_ALL``). A place is a row in the store with its own TTL
(:data:`WAITER_TTL`), renewed by the waiting task's trigger, given back when the task gets the lease,
gives up or is killed; a dead waiter's place lapses by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from airflow_lease_provider.runtime.outcomes import Outcome

#: How long a waiting place lives without being claimed again (the trigger claims it every poll, and
#: once more, for this long, when it fires): long enough for a resumed task to be queued, started and
#: acquire; short enough that a dead waiter (a killed triggerer, a deleted task) frees its place soon.
WAITER_TTL = timedelta(seconds=90)


@dataclass(frozen=True)
class OverlapPolicy:
    """:ivar waits: defer until the lease frees (at most ``lease_wait_timeout``) before giving up.
    :ivar outcome: what giving up is: ``SKIPPED_OVERLAP`` (the task is skipped, with the reason in XCom) or
        ``OVERLAP_FAILED`` (the task fails with :class:`~airflow_lease_provider.core.LeaseHeld`).
    :ivar says: how the log line of giving up starts.
    :ivar replaces: take the lease over from a holder of an older run (``try_replace``).
    :ivar max_waiting: at most this many runs wait for one key (None: the task's ``max_waiting``, and
        without one every run waits)."""

    waits: bool
    outcome: Outcome
    says: str
    replaces: bool = False
    max_waiting: int | None = None


OVERLAP_POLICIES: dict[str, OverlapPolicy] = {
    "skip": OverlapPolicy(waits=False, outcome=Outcome.SKIPPED_OVERLAP, says="skipping"),
    "wait": OverlapPolicy(waits=True, outcome=Outcome.SKIPPED_OVERLAP, says="skipping"),
    "fail": OverlapPolicy(waits=False, outcome=Outcome.OVERLAP_FAILED, says="failing (on_overlap=fail)"),
    "replace": OverlapPolicy(waits=False, outcome=Outcome.SKIPPED_OVERLAP, says="skipping", replaces=True),
    "buffer_one": OverlapPolicy(waits=True, outcome=Outcome.SKIPPED_OVERLAP, says="skipping", max_waiting=1),
}
