"""One task lease per execute: the lease's life, from one object.

:class:`TaskLease` is built once, when a task starts executing, from the task and its Airflow context: the
run identity (the task instance, and the owner: the task instance's, or the DAG run's for a run
lease), the key, the store and its connection (prepared while the templates rendered: :mod:`.store`), and
the metric tags. It owns the steps of the leased execute (:meth:`TaskLease.execute`): the acquire, joining a
run lease, keeping (the core's :class:`LeaseKeeper`), reporting every outcome (:func:`.outcomes.report`, the
one path), fencing (through the :class:`LeaseContext` it hands the task) and the release. What to do when
another run holds the lease is its overlap policy's answer (:mod:`.policies`). The operators and decorators
only pass their arguments to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_lease_provider import assets, metrics, settings
from airflow_lease_provider.core import (
    InvalidArgument,
    Lease,
    LeaseError,
    LeaseKeeper,
    LeaseLost,
    LeaseStore,
    RunRef,
    validation,
)
from airflow_lease_provider.runtime import store as task_store
from airflow_lease_provider.runtime.catchup import record_skipped_catchup
from airflow_lease_provider.runtime.context import XCOM_LEASE, LeaseContext, activated, active
from airflow_lease_provider.runtime.outcomes import Outcome, report
from airflow_lease_provider.runtime.policies import OverlapPolicy, policy_of
from airflow_lease_provider.runtime.signals import Terminate, interrupt_on_loss
from airflow_lease_provider.version_compat import TaskDeferred

#: What a task does with its lease (:attr:`TaskLease.role`): ``task``: acquire, hold while the body runs, release;
#: ``join``: renew the DAG run's lease while the body runs (``lease_scope="run"``); ``keep``: acquire it for the run
#: and leave it held (the run lease's acquire task).
ROLES = ("task", "join", "keep")


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
    :ivar role: what the task does with the lease (:data:`ROLES`).
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
    role: str = "task"

    @classmethod
    def of(
        cls, task: Any, context: Any, *, lease_key: str | None, conn_id: str | None, run_scoped: bool,
        outlets: Any = None, role: str = "task", terminate: Terminate | None = None,
    ) -> TaskLease:
        """The task's lease, from its context: the owner is the DAG run's with ``run_scoped``; with
        ``outlets`` (``lease_on="outlets"``) one lease per asset outlet (:mod:`airflow_lease_provider.assets`).
        The store is the one prepared while the templates rendered (:meth:`prepare`), else made here; a
        SIGTERM noted meanwhile is noted in ``terminate``."""
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
        store = task_store.take(task, context, terminate)  # None: nothing was prepared for this task
        store = store if store is not None else task_store.task_store(task, conn_id)
        tags = {"dag_id": ti.dag_id, "task_id": ti.task_id, "lease_key": key}
        dag_run = context.get("dag_run") if hasattr(context, "get") else None
        return cls(
            task, ti, run, holder.owner(), key, lease_key is not None or bool(by_asset), store, conn_id, tags,
            assets=by_asset, partition_key=partition_key, outlets=assets.outlet_assets(getattr(task, "outlets", None)),
            run_after=getattr(dag_run, "run_after", None), role=role,
        )

    @staticmethod
    def prepare(task: Any, context: Any) -> None:
        """When the task's templates are rendered: start getting its store ready (:func:`.store.prepare`)."""
        task_store.prepare(task, context)

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

    # -- the leased execute ---------------------------------------------------------------------------

    def execute(self, body: Callable[[], Any], context: Any, terminate: Terminate, *, waited: str | None = None) -> Any:
        """Run ``body`` (the wrapped operator's execute) as :attr:`role` says. ``waited``: the task resumed
        after a deferred wait (``execute_after_wait``), with the wait's deadline; ``terminate``: SIGTERM is
        noted from the execute's first step (a task told to stop before the body never starts it)."""
        if waited is None:
            self.record_catchup(context)
        if self.role == "join":  # renew the run's lease while this task runs; never release it
            return self.hold(self.run_lease(), body, context, release=False, terminate=terminate)
        lease = self.acquire(terminate, waited=waited)
        if self.role == "keep":
            return self.keep_for_run(lease, terminate)
        return self.hold(lease, body, context, release=True, terminate=terminate)

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

    @property
    def slots(self) -> int:
        """The key's slot count (``lease_slots``: a semaphore of N holders; 1: a single holder)."""
        return getattr(self.task, "lease_slots", None) or 1

    @property
    def policy(self) -> OverlapPolicy:
        return policy_of(self.task)

    def order(self) -> datetime:
        """This run's order among the runs (``replace``): its DAG run's ``run_after``."""
        if self.run_after is None:
            raise LeaseError(
                f"on_overlap='replace' needs the DAG run's run_after (its order among the runs), and the task "
                f"context of {self.owner} has none"
            )
        return self.run_after

    def acquire(self, terminate: Terminate, *, waited: str | None = None) -> Lease:
        """Take the lease; when another run holds it, the task's overlap policy decides (it does not return).

        With several keys (``lease_on="outlets"``) every one is taken in sorted order; when one is held,
        those taken are released first (all or nothing: nobody waits while holding, so nothing deadlocks).
        The first key's lease is returned; the others are :attr:`others`. ``waited``: resumed after a wait.
        """
        terminate.check()  # told to stop already: never take the lease
        policy = self.policy
        taken: list[Lease] = []
        for key in self.assets or (self.key,):
            outcome = policy.attempt(self, key, waited=waited)
            if outcome.lease is None:
                for lease in reversed(taken):
                    try:
                        self.store.release(lease, run=self.run)
                    except Exception:  # it expires with its TTL; the overlap policy still decides
                        self.log.exception("lease: could not give back %r token %s", lease.key, lease.token)
                policy.refused(self, outcome, key=key, waited=waited)
            if outcome.lease.slots > 1:  # a semaphore's slot (lease_slots): which one, of how many
                metrics.incr("lease.slot_acquired", {**self.tags, "slot": str(outcome.lease.slot),
                                                     "slots": str(outcome.lease.slots)})
            taken.append(outcome.lease)
            policy.taken(self, key, waited=waited)
        self.others = taken[1:]
        return taken[0]

    def run_lease(self, *, publishing: bool = False) -> Lease:
        """This DAG run's lease, which the run holds: or the task fails with :class:`LeaseLost` (reported).

        For a run-lease task (it renews the run's lease) and for a publish under a run lease
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
                f"this run ({self.owner}) does not hold it: {who} (a run-lease task must run downstream of the "
                "run's acquire task, and while the run lease is still valid)",
            )
            detail, message = self.detail(reason=f"run lease gone: {who}"), f"{lost}; the task fails"
        self.report(Outcome.LOST, message, detail=detail, run=self.run)
        raise lost

    # -- holding it ----------------------------------------------------------------------------------

    def hold(self, lease: Lease, body: Callable[[], Any], context: Any, *, release: bool, terminate: Terminate) -> Any:
        """Run ``body`` under ``lease``, kept by a keeper; with ``release``, this task acquired it and frees it.

        From the acquire on, every way out releases the lease or hands it to the keeper: a failure while
        getting ready (:meth:`start_keeping`) or a SIGTERM before the body starts (``terminate``, installed
        before the acquire) releases it at once, so the next run is not skipped for a whole TTL. A loss while
        the body runs stops it (its policy may say it was a takeover); after the body every lease this task
        acquired is released, whatever the body did.
        """
        # With lease_on="outlets": every lease taken (sorted keys), each with its keeper and context.
        leases = [lease, *self.others] if release else [lease]
        keepers, contexts = self.start_keeping(leases, context, release=release, terminate=terminate)
        started = time.monotonic()
        released: dict[str, bool] = {}
        try:
            with activated(contexts[lease.key]), interrupt_on_loss(*keepers), terminate.armed():
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
            if self.outlets:  # still held: the events carry live tokens
                self.stamp_outlet_events(context, contexts)
        except LeaseLost as lost:
            self.policy.lost(self, lost, keepers)  # replace: a newer run took it over; the task ends skipped
            contexts.get(lost.key, contexts[lease.key]).report_loss(lost, self.log)  # once, however often seen
            released.update((k.lease.key, self.stop_keeper(k, release=release)) for k in keepers
                            if len(keepers) > 1 and k.lease.key != lost.key)  # the others are freed (all or nothing)
            try:
                self.task.on_kill()  # stop what the wrapped operator started (a subprocess, a pod, ...)
            except Exception:
                self.log.exception("on_kill after the lease was lost failed")
            raise
        except BaseException:
            released.update((k.lease.key, self.stop_keeper(k, release=release)) for k in keepers)
            raise
        else:
            released.update((k.lease.key, self.stop_keeper(k, release=release)) for k in keepers)
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

    def start_keeping(
        self, leases: list[Lease], context: Any, *, release: bool, terminate: Terminate
    ) -> tuple[list[LeaseKeeper], dict[str, LeaseContext]]:
        """Get ready to run the body: report the acquire, push the lease (opt-in), start a keeper per lease and
        put the first lease's context where the task finds it. A failure here, or a SIGTERM noted until now,
        gives every lease back (with ``release``) and raises."""
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
                self.ti.xcom_push(key=XCOM_LEASE, value=leases[0].to_dict())
            for held in leases:
                keepers.append(LeaseKeeper(self.store, held, renew_every=self.renew_every(held), run=self.run))
            contexts = {held.key: self.context(held, k) for held, k in zip(leases, keepers, strict=True)}
            for each in contexts.values():
                each.leases = contexts
            context[XCOM_LEASE] = contexts[leases[0].key]
            for k in keepers:
                k.start()
            terminate.check()  # told to stop while it acquired or got ready: do not start the body
        except BaseException:
            for i, held in enumerate(leases):
                self.give_back(held, keepers[i] if i < len(keepers) else None, release=release)
            raise
        return keepers, contexts

    def stamp_outlet_events(self, context: Any, contexts: dict[str, LeaseContext]) -> None:
        """Put the lease into the ``extra`` of the task's asset events: each asset its own lease's when
        keyed by outlets, else the task's one lease (:mod:`airflow_lease_provider.assets`)."""
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

    # -- giving it back ------------------------------------------------------------------------------

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
    """The lease to publish under: the running leased task's, or the DAG run's run lease."""
    running = active()
    if running is not None:
        return running
    lease = TaskLease.of(task, context, lease_key=lease_key, conn_id=conn_id, run_scoped=True)
    return lease.context(lease.run_lease(publishing=True), keeper=None)
