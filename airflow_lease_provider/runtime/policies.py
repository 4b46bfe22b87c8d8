"""What a task does when another run holds its lease: the overlap policies, one class each.

A policy is a strategy (:class:`OverlapPolicy`). The task lease (:class:`~.task_lease.TaskLease`) owns the
lease's life (acquire, hold, release) and asks its policy four things: how to try for a key
(:meth:`~OverlapPolicy.attempt`), what to do once it has it (:meth:`~OverlapPolicy.taken`), what to do when
another run holds it (:meth:`~OverlapPolicy.refused`: wait deferred, skip or fail; it never returns), and
whether a loss while the body runs was a takeover (:meth:`~OverlapPolicy.lost`). A new policy is a new class
here, registered in :data:`OVERLAP_POLICIES`; the lease arguments accept exactly its names.

``skip`` (the default): the run that finds the lease held is skipped, with the reason (XCom
``lease_skip_reason``, the ledger, the log); ``fail``: it fails with :class:`~airflow_lease_provider.core.LeaseHeld`.

``wait``: the run defers until the lease frees (freeing its worker slot), at most ``lease_wait_timeout``
(default: the TTL), then is skipped. With ``max_waiting=N`` at most N runs wait for a key: the first N that
find the lease held take a waiting place and wait; a run that finds every place taken is skipped, naming
the runs that wait (``max_waiting=1`` is Temporal's ``BUFFER_ONE``; without it every run waits: its
``BUFFER_ALL``). There is no ``buffer_one`` policy: it was ``wait`` with one place and nothing else (it
neither coalesced runs nor dropped the older waiter), so it is that parameter (docs/airflow.md). A place is a row in the store with its own TTL
(:data:`WAITER_TTL`), renewed by the waiting task's trigger, given back when the task gets the lease, gives up
or is killed; a dead waiter's place lapses by itself.

``replace`` (Kubernetes' ``Replace``, Temporal's ``TERMINATE_OTHER``): the newer run takes the lease over
from the holder, with a larger token, in one statement (:meth:`LeaseStore.try_replace
<airflow_lease_provider.core.LeaseStore.try_replace>`). The rule that keeps it from ping-ponging: a run
takes over only from a holder of a strictly older run (its DAG run's ``run_after`` is earlier), so an older
run (a replaced run tried again, a cleared task) never takes the lease back from a newer one: it is
skipped, naming the newer holder. The replaced holder's keeper finds out at its next renewal, its body is
interrupted as for a lost lease, and the task ends *skipped* (not failed, so never retried into the lease),
naming the run that replaced it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar, NoReturn, Protocol

from airflow_lease_provider.core import (
    Acquisition,
    Lease,
    LeaseHeld,
    LeaseKeeper,
    LeaseLost,
    LeaseStore,
    RunRef,
    TokenHolder,
    WaitClaim,
)
from airflow_lease_provider.runtime.context import XCOM_SKIP_REASON
from airflow_lease_provider.runtime.outcomes import Outcome
from airflow_lease_provider.version_compat import AirflowSkipException

#: How long a waiting place lives without being claimed again (the trigger claims it every poll, and
#: once more, for this long, when it fires): long enough for a resumed task to be queued, started and
#: acquire; short enough that a dead waiter (a killed triggerer, a deleted task) frees its place soon.
WAITER_TTL = timedelta(seconds=90)

#: How long after a place may be taken over (its ``takeover_at``, the store's clock) a new try claims it: the
#: task's and the store's clocks differ a little.
TAKEOVER_MARGIN = 0.5


class Contender(Protocol):
    """The task lease as its policy sees it (:class:`~.task_lease.TaskLease`)."""

    task: Any
    ti: Any
    store: LeaseStore
    owner: str
    run: RunRef
    run_after: datetime | None
    conn_id: str | None

    @property
    def slots(self) -> int: ...

    @property
    def log(self) -> Any: ...

    def ttl(self) -> timedelta: ...

    def order(self) -> datetime: ...

    def detail(self, **extra: Any) -> dict[str, Any]: ...

    def report(
        self, outcome: Outcome, message: str, *, owner: str | None = None, key: str | None = None, **kwargs: Any
    ) -> None: ...


@dataclass(frozen=True)
class Held:
    """Who holds a key another run was refused: the holder, a semaphore's every holder, and in words."""

    holder: Lease | None
    holders: tuple[Lease, ...]
    who: str
    host: str | None

    @classmethod
    def of(cls, lease: Contender, refusal: Acquisition) -> Held:
        holder, holders = refusal.holder, refusal.holders
        who = holder.describe() if holder else "held by another run (it was released just now)"
        if len(holders) > 1:
            who = f"held in all {lease.slots} slots: " + "; ".join(
                f"slot {h.slot} by {h.owner!r} (token {h.token})" for h in holders
            )
        host = lease.store.holder_host(holder) if holder else None
        if host:
            who += f" on host {host}"
        return cls(holder, holders, who, host)


class OverlapPolicy:
    """``skip``: the run that finds the lease held is skipped, naming the holder. The base of every policy.

    :cvar waits: defers until the lease frees (at most ``lease_wait_timeout``) before giving up.
    :cvar replaces: takes the lease over from a holder of an older run (``try_replace``).
    :cvar outcome: what giving up is (the ledger event, the metric, the log line's level).
    :cvar says: how the log line of giving up starts.
    """

    name: ClassVar[str] = "skip"
    waits: ClassVar[bool] = False
    replaces: ClassVar[bool] = False
    outcome: ClassVar[Outcome] = Outcome.SKIPPED_OVERLAP
    says: ClassVar[str] = "skipping"

    def attempt(self, lease: Contender, key: str, *, waited: str | None) -> Acquisition:
        """One try for ``key`` (``waited``: the deadline of a wait this run is resumed from)."""
        return lease.store.try_acquire(key, lease.owner, lease.ttl(), run=lease.run, slots=lease.slots)

    def taken(self, lease: Contender, key: str, *, waited: str | None) -> None:
        """``key`` is this run's now."""

    def refused(self, lease: Contender, refusal: Acquisition, *, key: str, waited: str | None) -> NoReturn:
        """Another run holds ``key``: wait (deferred), then skip or fail."""
        held = Held.of(lease, refusal)
        self.wait(lease, held, key=key, waited=waited)
        self.give_up(lease, held, key=key, waited=waited)

    def wait(self, lease: Contender, held: Held, *, key: str, waited: str | None) -> None:
        """Before giving up: nothing here; a waiting policy defers (and comes back resumed, ``waited``)."""

    def reason(self, lease: Contender, held: Held, *, key: str, waited: str | None) -> str:
        if waited:
            return f"waited until {waited} and lease {key!r} is still {held.who}; this run ({lease.owner}) is skipped"
        return f"lease {key!r} is {held.who}; this run ({lease.owner}) is skipped so the two never overlap"

    def give_up(self, lease: Contender, held: Held, *, key: str, waited: str | None) -> NoReturn:
        """Report the overlap (:attr:`outcome`), then end the task (:meth:`end`)."""
        holder, reason = held.holder, self.reason(lease, held, key=key, waited=waited)
        detail = lease.detail(
            reason=reason,
            holder_owner=holder.owner if holder else None,
            holder_token=holder.token if holder else None,
            holder_expires_at=holder.expires_at.isoformat() if holder else None,
            holder_host=held.host,
            policy=self.name,
            **({"slots": lease.slots, "holders": [
                {"slot": h.slot, "owner": h.owner, "token": h.token, "expires_at": h.expires_at.isoformat()}
                for h in held.holders
            ]} if lease.slots > 1 else {}),
        )
        lease.report(self.outcome, f"{self.says}: {reason}", detail=detail, run=lease.run, key=key)
        self.end(lease, held, key=key, reason=reason, detail=detail)

    def end(self, lease: Contender, held: Held, *, key: str, reason: str, detail: dict[str, Any]) -> NoReturn:
        """The task ends skipped, its reason in XCom for whoever looks."""
        lease.ti.xcom_push(key=XCOM_SKIP_REASON, value=detail)
        raise AirflowSkipException(reason)

    def lost(self, lease: Contender, lost: LeaseLost, keepers: Sequence[LeaseKeeper]) -> None:
        """The lease was lost while the body ran: a loss (the task fails), unless the policy says otherwise."""

    def defer(
        self, lease: Contender, holder: Lease | None, end: datetime, *, first: bool, key: str,
        claim: WaitClaim | None = None, places: int | None = None,
    ) -> None:
        """Defer the task until ``key`` frees (or ``end``); it resumes in ``execute_after_wait``. With a waiting
        place (``claim``, one of ``places``), the trigger keeps it claimed while the task is deferred."""
        # Only a task that waits imports the trigger (and airflow.triggers.base): not every DAG parse.
        from airflow_lease_provider.triggers.lease_free import RESUME_SETTLE, LeaseFreeTrigger

        message = (
            f"{key!r} is {holder.describe() if holder else 'held'}; deferring until it frees "
            f"(at most until {end.isoformat()})"
        )
        waiter: dict[str, Any] | None = None
        place: dict[str, Any] = {}
        # On the API path the trigger waits through the api-server too (its secret read in the triggerer).
        via_api = bool(getattr(lease.store, "via_api", False))
        if claim is not None:
            position = next((i for i, w in enumerate(claim.waiters, 1) if w.owner == lease.owner), None)
            place = {"policy": self.name, "max_waiting": places, "place": position}
            message += f", in waiting place {position} of {places}"
            waiter = {"owner": lease.owner, "ttl_seconds": WAITER_TTL.total_seconds(), "max_waiting": places,
                      **lease.run.columns()}
            if via_api:
                waiter["place"] = lease.store.place_id(lease.owner)  # type: ignore[attr-defined]
        if first:
            lease.report(
                Outcome.WAITING, message, run=lease.run, key=key,
                detail=lease.detail(
                    holder_owner=holder.owner if holder else None,
                    holder_token=holder.token if holder else None, until=end.isoformat(), **place,
                ),
            )
        else:
            lease.log.info("lease: %s", message)
        poll = lease.task.lease_poll_interval or min(max(lease.ttl() / 20, timedelta(seconds=1)), timedelta(seconds=60))
        lease.task.defer(
            trigger=LeaseFreeTrigger(
                key=key, conn_id=lease.conn_id, schema=lease.store.schema,
                poll_interval=poll.total_seconds(), deadline=end.isoformat(),
                not_before=(datetime.now(timezone.utc) + RESUME_SETTLE).isoformat(), waiter=waiter,
                slots=lease.slots, **({"access": "api"} if via_api else {}),
            ),
            method_name="execute_after_wait",
            # The resumed task keeps (or gives back) the same place: its id, never a secret (the trigger's).
            kwargs={"deadline": end.isoformat(), **({"place": waiter["place"]} if waiter and via_api else {})},
        )


class Fail(OverlapPolicy):
    """``fail``: the run that finds the lease held fails with :class:`~airflow_lease_provider.core.LeaseHeld`."""

    name = "fail"
    outcome = Outcome.OVERLAP_FAILED
    says = "failing (on_overlap=fail)"

    def end(self, lease: Contender, held: Held, *, key: str, reason: str, detail: dict[str, Any]) -> NoReturn:
        raise LeaseHeld(key, held.holder, reason)


class Wait(OverlapPolicy):
    """``wait``: defer until the lease frees, at most ``lease_wait_timeout``; with ``max_waiting``, at most
    that many runs wait for a key and the next is skipped, naming the runs that wait."""

    name = "wait"
    waits = True

    def places(self, lease: Contender) -> int | None:
        """How many runs may wait for the key at once (None: any number)."""
        return getattr(lease.task, "max_waiting", None)

    def attempt(self, lease: Contender, key: str, *, waited: str | None) -> Acquisition:
        if waited is None and self.places(lease) is not None:
            queued = self.queued_behind(lease, key)
            if queued is not None:
                # Runs wait for the key (it may be free: released before the waiting run was resumed, which
                # takes seconds): they go first. This run queues behind them, or is skipped when every place
                # is taken, instead of taking the lease ahead of them.
                return queued
        return super().attempt(lease, key, waited=waited)

    def taken(self, lease: Contender, key: str, *, waited: str | None) -> None:
        if waited and self.places(lease) is not None:
            self.give_up_place(lease, key)

    def wait(self, lease: Contender, held: Held, *, key: str, waited: str | None) -> None:
        places = self.places(lease)
        now = datetime.now(timezone.utc)
        end = datetime.fromisoformat(waited) if waited else now + (lease.task.lease_wait_timeout or lease.ttl())
        if now < end:
            claim = None
            if places is not None:
                claim = lease.store.wait_claim(key, lease.owner, WAITER_TTL, max_waiting=places, run=lease.run)
                if not claim.claimed and claim.takeover_at is not None:
                    claim = self.take_over_place(lease, claim, key=key, places=places, end=end)
                if not claim.claimed:
                    self.buffer_full(lease, held, claim, key=key, places=places)
            self.defer(lease, held.holder, end, first=waited is None, key=key, claim=claim, places=places)
        if places is not None:
            self.give_up_place(lease, key)  # waited long enough: the place is free for the next run

    def queued_behind(self, lease: Contender, key: str) -> Acquisition | None:
        """When another run has a live place for ``key``: the refusal to act on (the key's holder, None when
        it is free); None when nobody else waits or this owner holds the key (its own retry re-enters). One
        more read before a first acquire, for a policy with waiting places only; a second when someone waits."""
        if not any(w.owner != lease.owner for w in lease.store.waiters([key])):
            return None
        holder = lease.store.holder(key)
        if holder is not None and holder.owner == lease.owner:
            return None
        return Acquisition(None, holder)

    def take_over_place(self, lease: Contender, claim: WaitClaim, *, key: str, places: int, end: datetime) -> WaitClaim:
        """Over the lease API: this owner's place is live under another place id (a previous try's, whose
        trigger died and gave nothing back). Wait until it may be taken over (its keeper missed a whole
        renewal period: at most two thirds of its TTL, docs/api.md decision 9), then claim it again: a live
        keeper renewed it meanwhile, and it stays refused (a few more tries only when the clocks differ)."""
        for _ in range(3):
            if claim.claimed or claim.takeover_at is None:
                break
            pause = (claim.takeover_at - datetime.now(timezone.utc)).total_seconds()
            if claim.takeover_at >= end or pause > WAITER_TTL.total_seconds():
                break
            lease.log.info("lease: this run's waiting place for %r is kept under a previous try's place id; "
                           "claiming it again at %s, when it may be taken over", key, claim.takeover_at.isoformat())
            time.sleep(max(pause, 0.0) + TAKEOVER_MARGIN)
            claim = lease.store.wait_claim(key, lease.owner, WAITER_TTL, max_waiting=places, run=lease.run)
        return claim

    def give_up_place(self, lease: Contender, key: str) -> None:
        """Give this run's waiting place back (it got the lease or gave up); it lapses by itself if this fails."""
        try:
            lease.store.wait_release(key, lease.owner)
        except Exception:
            lease.log.warning("lease: could not give back the waiting place for %r; it lapses by itself", key,
                              exc_info=True)

    def buffer_full(self, lease: Contender, held: Held, claim: WaitClaim, *, key: str, places: int) -> NoReturn:
        """Every waiting place of ``key`` is taken: skip, naming the runs that wait."""
        waiting = claim.others
        names = ", ".join(repr(w.owner) for w in waiting) or "another run"
        reason = (
            f"lease {key!r} is {held.who}, and {names} already {'waits' if len(waiting) == 1 else 'wait'} for it "
            f"(on_overlap={self.name!r}, {places} waiting place{'s' if places != 1 else ''}); "
            f"this run ({lease.owner}) is skipped"
        )
        holder = held.holder
        detail = lease.detail(
            reason=reason,
            holder_owner=holder.owner if holder else None,
            holder_token=holder.token if holder else None,
            waiters=[w.to_dict() for w in waiting],
            max_waiting=places,
            policy=self.name,
        )
        lease.report(Outcome.SKIPPED_BUFFER_FULL, f"skipping: {reason}", detail=detail, run=lease.run, key=key)
        lease.ti.xcom_push(key=XCOM_SKIP_REASON, value=detail)
        raise AirflowSkipException(reason)


class Replace(OverlapPolicy):
    """``replace``: take the lease over from a holder of an older run; an older run is skipped."""

    name = "replace"
    replaces = True

    def attempt(self, lease: Contender, key: str, *, waited: str | None) -> Acquisition:
        # With a replace_grace, the first attempt never takes over: an older holder gets the grace first.
        grace: timedelta | None = getattr(lease.task, "replace_grace", None)
        takeover = grace is None or waited is not None
        outcome = lease.store.try_replace(key, lease.owner, lease.ttl(), run_after=lease.order(), run=lease.run,
                                          takeover=takeover)
        if outcome.lease is None and grace is not None and not takeover and outcome.holder_older:
            self.defer(lease, outcome.holder, datetime.now(timezone.utc) + grace, first=True, key=key)
        if outcome.lease is not None and outcome.replaced is not None:
            lease.report(
                Outcome.REPLACED,
                f"took {key!r} over from {outcome.replaced.describe()}, an older run, with token "
                f"{outcome.lease.token}: its keeper finds out at its next renewal and its fenced writes are "
                "refused from now on",
                key=key, token=outcome.lease.token,
            )
        return outcome

    def reason(self, lease: Contender, held: Held, *, key: str, waited: str | None) -> str:
        if waited:
            return super().reason(lease, held, key=key, waited=waited)
        return (
            f"lease {key!r} is {held.who}, a run not older than this one ({lease.owner}, run_after "
            f"{lease.run_after.isoformat() if lease.run_after else 'unknown'}): an older run never replaces a "
            "newer one; this run is skipped"
        )

    def lost(self, lease: Contender, lost: LeaseLost, keepers: Sequence[LeaseKeeper]) -> None:
        """A newer run took the lease over: the task ends skipped (not failed, so it is not retried into the
        lease), naming that run; a loss the store cannot tie to a takeover stays a loss."""
        replaced = self.replaced_by(lease, lost, keepers)
        if replaced is None:
            return
        try:
            lease.task.on_kill()
        except Exception:
            lease.log.exception("on_kill after the lease was replaced failed")
        self.skip_replaced(lease, lost, replaced)

    def replaced_by(self, lease: Contender, lost: LeaseLost, keepers: Sequence[LeaseKeeper]) -> TokenHolder | None:
        held = next((k.lease for k in keepers if k.lease.key == lost.key), None)
        if held is None:
            return None
        try:
            return lease.store.replaced_by(held)
        except Exception:  # the store cannot say: the loss is reported as a loss (the task fails)
            lease.log.warning("lease: could not read whether %r was replaced", lost.key, exc_info=True)
            return None

    def skip_replaced(self, lease: Contender, lost: LeaseLost, by: TokenHolder) -> NoReturn:
        reason = (
            f"lease {lost.key!r} (token {lost.token}) was taken over by the newer run {by.owner!r} with token "
            f"{by.token} (on_overlap='replace'); this run ({lease.owner}) stopped and is skipped"
        )
        detail = lease.detail(
            reason=reason, replaced_by_owner=by.owner, replaced_by_token=by.token, token=lost.token,
            replaced_by_run_id=by.run.run_id if by.run else None, policy=self.name,
        )
        lease.report(Outcome.SKIPPED_REPLACED, reason, detail=detail, run=lease.run, key=lost.key, token=lost.token)
        try:
            lease.ti.xcom_push(key=XCOM_SKIP_REASON, value=detail)
        except Exception:  # the reason is in the log and the ledger: the skip stands
            lease.log.warning("lease: could not push the skip reason", exc_info=True)
        raise AirflowSkipException(reason) from lost


#: Every policy by its name: what ``on_overlap`` accepts.
OVERLAP_POLICIES: dict[str, OverlapPolicy] = {
    policy.name: policy for policy in (OverlapPolicy(), Wait(), Fail(), Replace())
}


def policy_of(task: Any) -> OverlapPolicy:
    """``task``'s policy (``on_overlap``; a task without one skips)."""
    return OVERLAP_POLICIES[getattr(task, "on_overlap", OverlapPolicy.name)]
