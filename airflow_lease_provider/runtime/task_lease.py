"""One task lease per execute: everything a leased task does with its lease, from one object.

:class:`TaskLease` is built once, when a task starts executing, from the task and its Airflow context: the
run identity (the task instance, and the owner: the task instance's, or the DAG run's for a run-scoped
lease), the key, the store and its connection, and the metric tags. It owns the acquire, the overlap
policies (:mod:`.policies`), joining a run lease, keeping (the core's :class:`LeaseKeeper`), reporting
every outcome (:func:`.outcomes.report`, the one path), fencing (through the :class:`LeaseContext` it
hands the task) and the release. The operators and decorators only say when to call it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, NoReturn

from airflow_lease_provider import metrics, settings
from airflow_lease_provider.core import (
    Acquisition,
    InvalidArgument,
    Lease,
    LeaseError,
    LeaseHeld,
    LeaseKeeper,
    LeaseLost,
    LeaseStore,
    RunRef,
    TokenHolder,
    WaitClaim,
    validation,
)
from airflow_lease_provider.runtime.catchup import record_skipped_catchup
from airflow_lease_provider.runtime.context import (
    XCOM_LEASE,
    XCOM_SKIP_REASON,
    LeaseContext,
    activated,
    active,
)
from airflow_lease_provider.runtime.outcomes import Outcome, report
from airflow_lease_provider.runtime.policies import OVERLAP_POLICIES, WAITER_TTL, OverlapPolicy
from airflow_lease_provider.runtime.signals import Terminate, interrupt_on_loss, stop_on_terminate

#: How long a task's store connection may stay open once idle, at most: the acquire, a short task's release
#: and the next leased task this process runs (``dag.test()`` runs them all in one) share one connection
#: (``LeaseHook.get_task_store``: this process's shared database). Never more than half the renewal
#: interval, so a lease between two renewals still holds no server connection (``[lease] hold_connection``
#: unset), and a process whose tasks are done holds none after it. The watchdog that closes it ticks every
#: 0.25 s.
CONNECTION_GRACE = timedelta(seconds=1)

log = logging.getLogger(__name__)


@dataclass
class TaskLease:
    """The lease of one task instance's execute.

    :ivar task: the operator (its lease arguments, its log, ``defer`` and ``on_kill``).
    :ivar ti: the task instance.
    :ivar run: the task instance as a :class:`RunRef`: the run columns of every event it causes.
    :ivar owner: the lease's owner: the task instance's, or the DAG run's (``run_scoped``).
    :ivar key: the lease key (the task's ``lease_key``, rendered, or the owner's default key).
    :ivar key_given: the task named its key (a default key names one task, not the job).
    :ivar store: the lease store of the task's connection (``conn_id``).
    :ivar tags: the metric tags of its outcomes.
    :ivar assets: with ``lease_on="outlets"``, the asset of each key, in the order they are taken (sorted
        keys); ``key`` is then the first. Empty for a task with one key.
    :ivar partition_key: the run's partition key (Airflow 3.2+ partitioned runs), or None.
    :ivar outlets: the task's asset outlets, whose events get the lease in their ``extra``.
    """

    task: Any
    ti: Any
    run: RunRef
    owner: str
    key: str
    key_given: bool
    store: LeaseStore
    conn_id: str | None
    tags: dict[str, str]
    assets: dict[str, Any] = field(default_factory=dict)
    partition_key: str | None = None
    outlets: list[Any] = field(default_factory=list)
    others: list[Lease] = field(default_factory=list)
    #: The DAG run's ``run_after`` (its order among the runs: ``on_overlap="replace"``), None if unknown.
    run_after: datetime | None = None

    @classmethod
    def of(
        cls, task: Any, context: Any, *, lease_key: str | None, conn_id: str | None, run_scoped: bool,
        outlets: Any = None, store: LeaseStore | None = None,
    ) -> TaskLease:
        """The task's lease, from its context: the owner is the DAG run's with ``run_scoped``; with
        ``outlets`` (``lease_on="outlets"``) one lease per asset outlet (:mod:`airflow_lease_provider.assets`).
        ``store``: the task's store made when its templates were rendered (:func:`prepare_store`), else made here."""
        from airflow_lease_provider import assets
        from airflow_lease_provider.hooks import LeaseHook

        ti = context["ti"]
        run = RunRef.of_task(ti)
        holder = RunRef.of_run(ti) if run_scoped else run
        partition_key = context.get("partition_key") if hasattr(context, "get") else None
        by_asset: dict[str, Any] = {}
        if outlets is not None:
            assets.check_outlets(outlets)
            by_asset = assets.outlet_keys(outlets, partition_key)
            key = next(iter(by_asset))
        else:
            # A templated key is known only now (rendered); the store would refuse a bad one too.
            key = holder.default_key() if lease_key is None else validation.name("lease_key", lease_key)
        if store is None:
            grace = connection_grace(getattr(task, "lease_ttl", None), getattr(task, "lease_renew_every", None))
            store = LeaseHook(conn_id).get_task_store(grace)
        tags = {"dag_id": ti.dag_id, "task_id": ti.task_id, "lease_key": key}
        dag_run = context.get("dag_run") if hasattr(context, "get") else None
        run_after = getattr(dag_run, "run_after", None)
        return cls(
            task, ti, run, holder.owner(), key, lease_key is not None or bool(by_asset), store, conn_id, tags,
            assets=by_asset, partition_key=partition_key,
            outlets=assets.outlet_assets(getattr(task, "outlets", None)), run_after=run_after,
        )

    # -- what the task's outcomes say --------------------------------------------------------------

    @property
    def log(self) -> Any:
        return self.task.log

    def detail(self, **extra: Any) -> dict[str, Any]:
        """Who an event is about: the task instance (and its try), plus ``extra``."""
        return {**self.run.detail(), "try_number": getattr(self.ti, "try_number", None), **extra}

    def report(
        self, outcome: Outcome, message: str, *, owner: str | None = None, key: str | None = None, **kwargs: Any
    ) -> None:
        """Report ``outcome`` of this task's lease (the one path: :func:`.outcomes.report`)."""
        kwargs.setdefault("logger", self.log)
        report(outcome, store=self.store, key=key or self.key, owner=owner or self.owner, tags=self.tags,
               message=message, **kwargs)

    def context(self, lease: Lease, keeper: LeaseKeeper | None) -> LeaseContext:
        """What the task's code sees (``current_lease()``, the ``lease`` argument): the lease and its fences."""
        return LeaseContext(
            lease=lease, store=self.store, keeper=keeper, tags=self.tags, conn_id=self.conn_id,
            detail=self.detail(), run=self.run, partition_key=self.partition_key,
        )

    def record_catchup(self, context: Any) -> None:
        """The first run after a gap in a capped catch-up schedule records the skipped slots, once."""
        try:
            # Recorded under the DAG id unless a key was given (a default key names one task, not the job).
            job = self.key if self.key_given else None
            record_skipped_catchup(context, ledger=self.store.events, key=job, logger=self.log)
        except Exception:  # informational only: it must never fail or skip the task
            self.log.warning("catch-up: could not record skipped slots", exc_info=True)

    # -- taking the lease ----------------------------------------------------------------------------

    def ttl(self) -> timedelta:
        ttl: timedelta | None = self.task.lease_ttl
        if ttl is None:
            raise InvalidArgument("lease_ttl", None, "is required to acquire a lease")
        return ttl

    def renew_every(self, lease: Lease) -> timedelta:
        """How often the keeper renews ``lease``: the task's ``lease_renew_every``, else TTL x ``[lease]
        renew_fraction`` (the core keeper's fraction unless configured)."""
        every: timedelta | None = self.task.lease_renew_every
        return every or lease.ttl * settings.renew_fraction()

    def acquire(self, terminate: Terminate, *, waited: str | None = None) -> Lease:
        """Take the lease; when another run holds it, the task's overlap policy decides (it does not return).

        With several keys (``lease_on="outlets"``) every one is taken in sorted order; when one is held,
        those taken are released first (all or nothing: nobody waits while holding, so nothing deadlocks).
        The first key's lease is returned; the others are :attr:`others`. With ``on_overlap="replace"`` a
        lease held by an older run is taken over (:meth:`LeaseStore.try_replace`). A task resumed after
        waiting with a waiting place (``waited``) gives its place back once it has the lease.
        """
        terminate.check()  # told to stop already: never take the lease
        policy = self.policy
        taken: list[Lease] = []
        for key in self.assets or (self.key,):
            # With a replace_grace, the first attempt never takes over: an older holder gets the grace first.
            grace: timedelta | None = getattr(self.task, "replace_grace", None) if policy.replaces else None
            takeover = grace is None or waited is not None
            queued = self.queued_behind(key, policy) if waited is None else None
            if queued is not None:
                # Runs wait for the key (it may be free: released before the waiting run was resumed, which
                # takes seconds): they go first. This run queues behind them, or is skipped when every place
                # is taken, instead of taking the lease ahead of them.
                outcome = queued
            elif policy.replaces:
                outcome = self.store.try_replace(key, self.owner, self.ttl(), run_after=self.order(), run=self.run,
                                                 takeover=takeover)
            else:
                outcome = self.store.try_acquire(key, self.owner, self.ttl(), run=self.run, slots=self.slots)
            if outcome.lease is None and grace is not None and not takeover and outcome.holder_older:
                now = datetime.now(timezone.utc)
                self.defer_until_free(outcome.holder, now + grace, first=True, key=key)
            if outcome.lease is None:
                for lease in reversed(taken):
                    try:
                        self.store.release(lease, run=self.run)
                    except Exception:  # it expires with its TTL; the overlap policy still decides
                        self.log.exception("lease: could not give back %r token %s", lease.key, lease.token)
                self.overlap(outcome.holder, waited=waited, key=key, holders=outcome.holders)
            assert outcome.lease is not None
            if outcome.replaced is not None:
                replaced = outcome.replaced
                self.report(
                    Outcome.REPLACED,
                    f"took {key!r} over from {replaced.describe()}, an older run, with token {outcome.lease.token}: "
                    "its keeper finds out at its next renewal and its fenced writes are refused from now on",
                    key=key, token=outcome.lease.token,
                )
            if outcome.lease.slots > 1:  # a semaphore's slot (lease_slots): which one, of how many
                metrics.incr("lease.slot_acquired", {**self.tags, "slot": str(outcome.lease.slot),
                                                     "slots": str(outcome.lease.slots)})
            taken.append(outcome.lease)
            if waited and self.max_waiting(policy) is not None:
                self.give_up_place(key)
        self.others = taken[1:]
        return taken[0]

    @property
    def slots(self) -> int:
        """The key's slot count (``lease_slots``: a semaphore of N holders; 1: a single holder)."""
        return getattr(self.task, "lease_slots", None) or 1

    @property
    def policy(self) -> OverlapPolicy:
        return OVERLAP_POLICIES[getattr(self.task, "on_overlap", "skip")]

    def order(self) -> datetime:
        """This run's order among the runs (``replace``): its DAG run's ``run_after``."""
        if self.run_after is None:
            raise LeaseError(
                f"on_overlap='replace' needs the DAG run's run_after (its order among the runs), and the task "
                f"context of {self.owner} has none"
            )
        return self.run_after

    def max_waiting(self, policy: OverlapPolicy) -> int | None:
        """How many runs may wait for the key at once (None: any number)."""
        if not policy.waits:
            return None
        return policy.max_waiting or getattr(self.task, "max_waiting", None)

    def queued_behind(self, key: str, policy: OverlapPolicy) -> Acquisition | None:
        """With waiting places (``buffer_one``, ``wait`` with ``max_waiting``): when another run has a live
        place for ``key``, the refusal to act on (the key's holder, None when it is free); None when nobody
        else waits or this owner holds the key (its own retry re-enters). One more read before a first
        acquire, for these policies only; a second when someone waits."""
        if self.max_waiting(policy) is None:
            return None
        if not any(w.owner != self.owner for w in self.store.waiters([key])):
            return None
        holder = self.store.holder(key)
        if holder is not None and holder.owner == self.owner:
            return None
        return Acquisition(None, holder)

    def give_up_place(self, key: str) -> None:
        """Give this run's waiting place back (it got the lease or gave up); it lapses by itself if this fails."""
        try:
            self.store.wait_release(key, self.owner)
        except Exception:
            self.log.warning("lease: could not give back the waiting place for %r; it lapses by itself", key,
                             exc_info=True)

    def overlap(
        self, holder: Lease | None, *, waited: str | None, key: str | None = None, holders: tuple[Lease, ...] = ()
    ) -> NoReturn:
        """Another run holds the lease (``key``, default :attr:`key`): wait (deferred), skip or fail, per
        ``on_overlap``. A semaphore's (``lease_slots``) refusal names every holder (``holders``, by slot)."""
        from airflow_lease_provider.version_compat import AirflowSkipException

        key = key or self.key
        policy = self.policy
        who = holder.describe() if holder else "held by another run (it was released just now)"
        if len(holders) > 1:
            who = f"held in all {self.slots} slots: " + "; ".join(
                f"slot {h.slot} by {h.owner!r} (token {h.token})" for h in holders
            )
        holder_host = self.store.holder_host(holder) if holder else None
        if holder_host:
            who += f" on host {holder_host}"
        places = self.max_waiting(policy)
        if policy.waits:
            now = datetime.now(timezone.utc)
            end = datetime.fromisoformat(waited) if waited else now + (self.task.lease_wait_timeout or self.ttl())
            if now < end:
                claim = None
                if places is not None:
                    claim = self.store.wait_claim(key, self.owner, WAITER_TTL, max_waiting=places, run=self.run)
                    if not claim.claimed:
                        self.buffer_full(holder, claim, key=key, who=who, places=places)
                self.defer_until_free(holder, end, first=waited is None, key=key, claim=claim)
            if places is not None:
                self.give_up_place(key)  # waited long enough: the place is free for the next run
        reason = f"lease {key!r} is {who}; this run ({self.owner}) is skipped so the two never overlap"
        if policy.replaces:
            reason = (
                f"lease {key!r} is {who}, a run not older than this one ({self.owner}, run_after "
                f"{self.run_after.isoformat() if self.run_after else 'unknown'}): an older run never replaces a "
                "newer one; this run is skipped"
            )
        if waited:
            reason = f"waited until {waited} and lease {key!r} is still {who}; this run ({self.owner}) is skipped"
        detail = self.detail(
            reason=reason,
            holder_owner=holder.owner if holder else None,
            holder_token=holder.token if holder else None,
            holder_expires_at=holder.expires_at.isoformat() if holder else None,
            holder_host=holder_host,
            policy=self.task.on_overlap,
            **({"slots": self.slots, "holders": [
                {"slot": h.slot, "owner": h.owner, "token": h.token, "expires_at": h.expires_at.isoformat()}
                for h in holders
            ]} if self.slots > 1 else {}),
        )
        self.report(policy.outcome, f"{policy.says}: {reason}", detail=detail, run=self.run, key=key)
        if policy.outcome is Outcome.OVERLAP_FAILED:
            raise LeaseHeld(key, holder, reason)
        self.ti.xcom_push(key=XCOM_SKIP_REASON, value=detail)
        raise AirflowSkipException(reason)

    def buffer_full(self, holder: Lease | None, claim: WaitClaim, *, key: str, who: str, places: int) -> NoReturn:
        """Every waiting place of ``key`` is taken: skip, naming the runs that wait."""
        from airflow_lease_provider.version_compat import AirflowSkipException

        waiting = claim.others
        names = ", ".join(repr(w.owner) for w in waiting) or "another run"
        reason = (
            f"lease {key!r} is {who}, and {names} already {'waits' if len(waiting) == 1 else 'wait'} for it "
            f"(on_overlap={self.task.on_overlap!r}, {places} waiting place{'s' if places != 1 else ''}); "
            f"this run ({self.owner}) is skipped"
        )
        detail = self.detail(
            reason=reason,
            holder_owner=holder.owner if holder else None,
            holder_token=holder.token if holder else None,
            waiters=[w.to_dict() for w in waiting],
            max_waiting=places,
            policy=self.task.on_overlap,
        )
        self.report(Outcome.SKIPPED_BUFFER_FULL, f"skipping: {reason}", detail=detail, run=self.run, key=key)
        self.ti.xcom_push(key=XCOM_SKIP_REASON, value=detail)
        raise AirflowSkipException(reason)

    def defer_until_free(
        self, holder: Lease | None, end: datetime, *, first: bool, key: str | None = None,
        claim: WaitClaim | None = None,
    ) -> None:
        """Defer the task until the lease (``key``) frees (or ``end``); it resumes in ``execute_after_wait``.
        With a waiting place (``claim``), the trigger keeps it claimed while the task is deferred."""
        from airflow_lease_provider.triggers.lease_free import RESUME_SETTLE, LeaseFreeTrigger

        key = key or self.key
        message = (
            f"{key!r} is {holder.describe() if holder else 'held'}; deferring until it frees "
            f"(at most until {end.isoformat()})"
        )
        waiter: dict[str, Any] | None = None
        place: dict[str, Any] = {}
        if claim is not None:
            position = next((i for i, w in enumerate(claim.waiters, 1) if w.owner == self.owner), None)
            place = {"policy": self.task.on_overlap, "max_waiting": self.max_waiting(self.policy),
                     "place": position}
            message += f", in waiting place {position} of {place['max_waiting']}"
            waiter = {"owner": self.owner, "ttl_seconds": WAITER_TTL.total_seconds(),
                      "max_waiting": place["max_waiting"], **self.run.columns()}
        if first:
            self.report(
                Outcome.WAITING, message, run=self.run, key=key,
                detail=self.detail(
                    holder_owner=holder.owner if holder else None,
                    holder_token=holder.token if holder else None, until=end.isoformat(), **place,
                ),
            )
        else:
            self.log.info("lease: %s", message)
        poll = self.task.lease_poll_interval or min(max(self.ttl() / 20, timedelta(seconds=1)), timedelta(seconds=60))
        self.task.defer(
            trigger=LeaseFreeTrigger(
                key=key, conn_id=self.conn_id, schema=self.store.schema,
                poll_interval=poll.total_seconds(), deadline=end.isoformat(),
                not_before=(datetime.now(timezone.utc) + RESUME_SETTLE).isoformat(), waiter=waiter,
                slots=self.slots,
            ),
            method_name="execute_after_wait",
            kwargs={"deadline": end.isoformat()},
        )

    def run_lease(self, *, publishing: bool = False) -> Lease:
        """This DAG run's lease, which the run holds: or the task fails with :class:`LeaseLost` (reported).

        For a run-scoped task (it renews the run's lease) and for a publish under a run lease
        (``publishing``: nothing is published)."""
        holding = self.store.holds(self.key, self.owner)
        if holding.lease is not None:
            return holding.lease
        who = holding.who()
        token = holding.holder.token if holding.holder else 0
        if publishing:
            reason = f"this run ({self.owner}) does not hold lease {self.key!r} ({who}); nothing is published"
            lost = LeaseLost(self.key, token, reason)
            detail, message = self.detail(reason=reason, stage="publish"), str(lost)
        else:
            lost = LeaseLost(
                self.key, token,
                f"this run ({self.owner}) does not hold it: {who} (a run-scoped task must run downstream of the "
                "run's acquire task, and while the run lease is still valid)",
            )
            detail, message = self.detail(reason=f"run lease gone: {who}"), f"{lost}; the task fails"
        self.report(Outcome.LOST, message, detail=detail, run=self.run)
        raise lost

    # -- holding it ----------------------------------------------------------------------------------

    def hold(self, lease: Lease, body: Callable[[], Any], context: Any, *, release: bool, terminate: Terminate) -> Any:
        """Run ``body`` under ``lease``, kept by a keeper; with ``release``, this task acquired it and frees it.

        From the acquire on, every way out releases the lease or hands it to the keeper: a failure while
        getting ready (the XCom push, the configuration, the keeper's construction or start) or a SIGTERM
        before the body starts (``terminate``, installed before the acquire) releases it at once, so the
        next run is not skipped for a whole TTL.
        """
        from airflow_lease_provider.version_compat import TaskDeferred

        # With lease_on="outlets": every lease taken (sorted keys), each with its keeper and context.
        leases = [lease, *self.others] if release else [lease]
        keepers: list[LeaseKeeper] = []
        try:
            for held in leases:
                self.warn_on_clock_skew(held)
                if release:
                    self.report(
                        Outcome.ACQUIRED,
                        f"acquired {held.lease_key!r}{' ' + held.slot_label if held.slots > 1 else ''} with token "
                        f"{held.token} (owner {held.owner}, TTL {held.ttl})",
                        owner=held.owner, key=held.key,
                    )
            if settings.push_lease_xcom():  # opt-in ([lease] push_lease_xcom = true): for downstream xcom_pull
                self.ti.xcom_push(key=XCOM_LEASE, value=lease.to_dict())
            for held in leases:
                keepers.append(LeaseKeeper(self.store, held, renew_every=self.renew_every(held), run=self.run))
            contexts = {held.key: self.context(held, k) for held, k in zip(leases, keepers, strict=True)}
            ctx = contexts[lease.key]
            ctx.leases = contexts
            for other in contexts.values():
                other.leases = contexts
            context[XCOM_LEASE] = ctx
            started = time.monotonic()
            for k in keepers:
                k.start()
            terminate.check()  # told to stop while it acquired or got ready: do not start the body
        except BaseException:
            for i, held in enumerate(leases):
                self.give_back(held, keepers[i] if i < len(keepers) else None, release=release)
            raise
        released: dict[str, bool] = {}
        try:
            with activated(ctx), interrupt_on_loss(*keepers), terminate.armed():
                # A loss declared before the interrupt was in place (the lease ran out while the task got
                # ready: a slow XCom push, a join with little time left) sent no signal: look once more.
                for k in keepers:
                    k.check()
                try:
                    result = body()
                except TaskDeferred:
                    raise LeaseError(
                        f"{type(self.task).__name__} cannot hold a lease while the wrapped operator is deferred "
                        "(nothing would renew it): run it with deferrable=False"
                    ) from None
            for k in keepers:
                k.check()
            self.stamp_outlet_events(context, contexts)  # still held: the events carry live tokens
        except LeaseLost as lost:
            replaced = self.replaced_by(lost, keepers)
            if replaced is not None:  # on_overlap="replace": a newer run took it over; not a failure
                try:
                    self.task.on_kill()
                except Exception:
                    self.log.exception("on_kill after the lease was replaced failed")
                self.skip_replaced(lost, replaced)
            contexts.get(lost.key, ctx).report_loss(lost, self.log)  # once, however many times it was seen
            if len(keepers) > 1:  # the leases still ours are freed at once (all or nothing)
                for k in keepers:
                    if k.lease.key != lost.key:
                        released[k.lease.key] = self.stop_keeper(k, release=release)
            try:
                self.task.on_kill()  # stop what the wrapped operator started (a subprocess, a pod, ...)
            except Exception:
                self.log.exception("on_kill after the lease was lost failed")
            raise
        except BaseException:
            for k in keepers:
                released[k.lease.key] = self.stop_keeper(k, release=release)
            raise
        else:
            for k in keepers:
                released[k.lease.key] = self.stop_keeper(k, release=release)
        finally:
            for k in keepers:
                k.stop()
            metrics.timing("lease.held", timedelta(seconds=time.monotonic() - started), self.tags)
            for held in leases:
                if release and released.get(held.key):
                    self.report(Outcome.RELEASED, f"{held.key!r} token {held.token} released", owner=held.owner,
                                key=held.key)
                elif release:
                    self.log.info("lease: %r token %s not released", held.key, held.token)
            if not self.store.shared:
                self.store.close()  # [lease] hold_connection: the task's own connection
            # A shared one (get_task_store) closes itself once idle for its grace, unless the next leased
            # task of this process uses it first.
        return result

    def replaced_by(self, lost: LeaseLost, keepers: list[LeaseKeeper]) -> TokenHolder | None:
        """With ``on_overlap="replace"``: the run that took the lost lease over, or None (it was lost)."""
        if not self.policy.replaces:
            return None
        lease = next((k.lease for k in keepers if k.lease.key == lost.key), None)
        if lease is None:
            return None
        try:
            return self.store.replaced_by(lease)
        except Exception:  # the store cannot say: the loss is reported as a loss (the task fails)
            self.log.warning("lease: could not read whether %r was replaced", lost.key, exc_info=True)
            return None

    def skip_replaced(self, lost: LeaseLost, by: TokenHolder) -> NoReturn:
        """This task's lease was taken over by a newer run: the task ends skipped (not failed, so it is not
        retried into the lease), naming that run."""
        from airflow_lease_provider.version_compat import AirflowSkipException

        reason = (
            f"lease {lost.key!r} (token {lost.token}) was taken over by the newer run {by.owner!r} with token "
            f"{by.token} (on_overlap='replace'); this run ({self.owner}) stopped and is skipped"
        )
        detail = self.detail(
            reason=reason, replaced_by_owner=by.owner, replaced_by_token=by.token, token=lost.token,
            replaced_by_run_id=by.run.run_id if by.run else None, policy=self.task.on_overlap,
        )
        self.report(Outcome.SKIPPED_REPLACED, reason, detail=detail, run=self.run, key=lost.key, token=lost.token)
        try:
            self.ti.xcom_push(key=XCOM_SKIP_REASON, value=detail)
        except Exception:  # the reason is in the log and the ledger: the skip stands
            self.log.warning("lease: could not push the skip reason", exc_info=True)
        raise AirflowSkipException(reason) from lost

    def stamp_outlet_events(self, context: Any, contexts: dict[str, LeaseContext]) -> None:
        """Put the lease into the ``extra`` of the task's asset events: each asset its own lease's when
        keyed by outlets, else the task's one lease (:mod:`airflow_lease_provider.assets`)."""
        from airflow_lease_provider import assets

        by_uri = {asset.uri: key for key, asset in self.assets.items()}
        for asset in self.outlets:
            held = contexts.get(by_uri.get(asset.uri, self.key)) or contexts[self.key]
            try:
                assets.stamp(context, asset, held.lease, store_id=self.store.store_id,
                             partition_key=self.partition_key)
            except Exception:  # informational: an event without the token must not fail a finished task
                self.log.warning("lease: could not put the lease on the event of %s", asset, exc_info=True)

    def keep_for_run(self, lease: Lease, terminate: Terminate) -> dict[str, Any]:
        """The run lease's acquire task: leave ``lease`` held for the run (its later tasks join it); but if
        this task fails (or is told to stop) before it is done, free it."""
        try:
            self.warn_on_clock_skew(lease)
            self.report(
                Outcome.ACQUIRED,
                f"run {lease.owner} acquired {lease.key!r} with token {lease.token} until {lease.expires_at.isoformat()}",
                owner=lease.owner,
            )
            if settings.push_lease_xcom():
                self.ti.xcom_push(key=XCOM_LEASE, value=lease.to_dict())
            terminate.check()
        except BaseException:
            self.give_back(lease, None, release=True)
            raise
        return lease.to_dict()

    def release_run_lease(self) -> bool:
        """The run lease's release task: free the run's lease if the run still holds it."""
        holding = self.store.holds(self.key, self.owner)
        if holding.lease is None:
            self.log.warning(
                "lease: run %s does not hold %r any more (%s); nothing to release",
                self.owner, self.key, holding.holder.describe() if holding.holder else "it is free",
            )
            return False
        released = self.store.release(holding.lease, run=self.run)
        self.log.info("lease: run %s released %r token %s", self.owner, self.key, holding.lease.token)
        return released

    def stop_keeper(self, keeper: LeaseKeeper, *, release: bool) -> bool:
        """After the body: stop renewing and, with ``release``, free the lease; whether it was freed.

        A release that fails (the store unreachable, the row locked past the statement timeout) is logged
        and the lease left to expire with its TTL: the body's result, or the body's own exception, is what
        the task reports. Failing a task whose body succeeded would make Airflow retry it and run the body
        again; an error raised here would replace the body's.
        """
        try:
            return keeper.stop(release=release)
        except Exception:
            lease = keeper.lease
            self.log.exception(
                "lease: could not release %r token %s; it is left to expire with its TTL (at %s at the latest)",
                lease.key, lease.token, lease.expires_at.isoformat(),
            )
            return False

    def give_back(self, lease: Lease, keeper: LeaseKeeper | None, *, release: bool) -> None:
        """Getting ready to run failed: stop the keeper and, if this task acquired the lease, free it."""
        try:
            if keeper is not None:
                keeper.stop()
            if release:
                freed = self.store.release(keeper.lease if keeper is not None else lease, run=self.run)
                self.log.warning(
                    "lease: %r token %s %s: the task failed before it started", lease.key, lease.token,
                    "released" if freed else "was no longer ours to release",
                )
        except Exception:  # the task's own error is the one to report; the lease then expires with its TTL
            self.log.exception("lease: could not release %r token %s", lease.key, lease.token)

    def warn_on_clock_skew(self, lease: Lease) -> None:
        warn_on_clock_skew(lease, datetime.now(timezone.utc), self.log)


def connection_grace(ttl: timedelta | None, renew_every: timedelta | None) -> timedelta:
    """How long a task's store connection stays open once idle: :data:`CONNECTION_GRACE`, at most half the
    renewal interval (a lease between two renewals holds no server connection)."""
    grace = CONNECTION_GRACE
    if isinstance(ttl, timedelta) and ttl > timedelta(0):
        every = renew_every if isinstance(renew_every, timedelta) and renew_every > timedelta(0) else None
        every = every or ttl * settings.renew_fraction()
        grace = min(grace, every / 2)
    return max(grace, timedelta(milliseconds=1))


@dataclass
class _Prepared:
    #: The task object it was made for: an ``id()`` is reused once its object is gone, and a store made for
    #: another task (another connection) must never be handed to this one.
    task: weakref.ref[Any]
    store: LeaseStore | None
    thread: threading.Thread | None
    #: SIGTERM came while the store was looked up (as it is noted from the execute's first step on).
    terminated: bool = False


#: What :func:`prepare_store` made for a task (by the task object's id) until its execute takes it
#: (:func:`await_store`). Not on the operator: a thread cannot be deep-copied, and Airflow and listeners may
#: copy the task between its rendering and its execute.
_preparing: dict[int, _Prepared] = {}


def prepare_store(task: Any) -> None:
    """In a task process, start getting the task's store ready in the background: its connection opened and
    its schema checked, while Airflow finishes getting the task ready (it sends the rendered fields to the API
    server, runs its listeners); the execute then finds both done. Called when the task's templates are
    rendered: a task process starts with no server connection, and the connect and the check were a third of
    what a leased task adds under an executor (issue 28).

    Nothing is taken here, and nothing is decided: the acquire, its durable commit and every outcome stay in
    the execute, which takes this store (:func:`await_store`, one connection lookup per task), waits for the
    thread, and does again, failing closed, whatever failed here. No thread where this process's database
    for the store is checked already (``dag.test()``'s next tasks). Nothing is made outside a task process,
    with ``[lease] hold_connection`` (the task's store is a connection of its own), or when the connection
    cannot be read (the execute reads it again and says why).
    """
    from airflow_lease_provider.version_compat import in_task_process

    if not in_task_process():
        return
    store: LeaseStore | None = None
    # The lookup (an API call for a connection Airflow keeps) was under the execute's SIGTERM note: so it is here.
    with stop_on_terminate() as noted:
        try:
            if not settings.hold_connection():
                from airflow_lease_provider.hooks import LeaseHook

                grace = connection_grace(getattr(task, "lease_ttl", None), getattr(task, "lease_renew_every", None))
                store = LeaseHook(getattr(task, "lease_conn_id", None)).get_task_store(grace)
        except Exception:  # the execute reads it again and reports what is wrong
            log.debug("lease: the store could not be prepared before execute", exc_info=True)
    thread = None
    if store is not None and not noted.requested and not store.db.schema_current:
        thread = threading.Thread(target=_ready, args=(store,), name="lease-store-prepare", daemon=True)
        thread.start()
    for stale in [k for k, p in _preparing.items() if p.task() is None]:  # made for tasks since dropped
        del _preparing[stale]
    if store is not None or noted.requested:
        _preparing[id(task)] = _Prepared(weakref.ref(task), store, thread, noted.requested)


def _ready(store: LeaseStore) -> None:
    try:
        store._ready()  # the shared database's connection, and its schema check (remembered by that database)
    except Exception:  # the execute's own check does it again, and fails closed
        log.debug("lease: the store could not be prepared before execute", exc_info=True)


def await_store(task: Any, terminate: Terminate | None = None) -> LeaseStore | None:
    """The store :func:`prepare_store` made for ``task`` (None: none), once its thread is done, or has taken
    as long as its connect and two statements may (each bounded by the store): the execute goes on either way.
    A SIGTERM noted while it was looked up is noted in ``terminate``: the task then takes no lease."""
    prepared = _preparing.pop(id(task), None)
    if prepared is None or prepared.task() is not task:  # none, or made for an object gone since
        return None
    if prepared.terminated and terminate is not None:
        terminate.requested = True
    thread = prepared.thread
    if thread is not None and thread is not threading.current_thread():
        from airflow_lease_provider.core.db import DEFAULT_CONNECT_TIMEOUT, DEFAULT_STATEMENT_TIMEOUT

        thread.join(timeout=(DEFAULT_CONNECT_TIMEOUT + 2 * DEFAULT_STATEMENT_TIMEOUT).total_seconds() + 2)
    return prepared.store


def warn_on_clock_skew(lease: Lease, received_at: datetime, logger: Any) -> None:
    """Warn when this worker's clock is off from the database's. No decision depends on it: a warning for
    people (this host's logs and timestamps are off), never an input to a decision."""
    skew = received_at - lease.observed_at
    limit = settings.clock_skew_warning()
    if abs(skew) > limit:
        logger.warning(
            "lease: this worker's clock differs from the database's by %.1f s (limit %.1f s). "
            "Leases are judged by the database clock only, so nothing is wrong with them, but this "
            "host's logs and timestamps are off.",
            skew.total_seconds(), limit.total_seconds(),
        )


def publishing_lease(task: Any, context: Any, *, lease_key: str | None, conn_id: str | None) -> LeaseContext:
    """The lease to publish under: the running leased task's, or the DAG run's run-scoped lease."""
    running = active()
    if running is not None:
        return running
    lease = TaskLease.of(task, context, lease_key=lease_key, conn_id=conn_id, run_scoped=True)
    return lease.context(lease.run_lease(publishing=True), keeper=None)
