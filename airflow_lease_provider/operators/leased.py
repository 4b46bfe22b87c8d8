"""``LeasedOperator``: run any operator under a lease, without writing a subclass.

::

    from airflow.providers.standard.operators.bash import BashOperator
    from airflow_lease_provider.operators import LeasedOperator

    LeasedBash = LeasedOperator.wrap(BashOperator)        # a class: LeasedBashOperator
    sync = LeasedBash(
        task_id="sync",
        bash_command="./sync.sh",
        lease_key="sync-{{ params.region }}",              # templated; default: "<dag_id>.<task_id>"
        lease_ttl=timedelta(minutes=30),                    # 1.5-2x the worst normal run time
        on_overlap="skip",                                  # or "wait" (deferred) or "fail"
    )

``wrap`` builds a subclass whose ``execute`` takes the lease, runs the wrapped operator's own
``execute`` while a keeper renews the lease every TTL/3, and releases it afterwards (on success and on
failure). Everything else (template fields, ``on_kill``, ``.partial().expand()``) is the wrapped
operator's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

from airflow.sdk import BaseOperator, BaseSensorOperator

from airflow_lease_provider import metrics, settings
from airflow_lease_provider.arguments import check_sensor_mode, validate_lease_args, validate_lease_kwargs
from airflow_lease_provider.clock import warn_on_clock_skew
from airflow_lease_provider.context import XCOM_LEASE, XCOM_SKIP_REASON, LeaseContext, activated
from airflow_lease_provider.core import (
    InvalidArgument,
    Lease,
    LeaseError,
    LeaseHeld,
    LeaseKeeper,
    LeaseLost,
    LeaseStore,
    validation,
)
from airflow_lease_provider.identity import RunRef, event_detail, run_ref, task_ref, task_tags
from airflow_lease_provider.interrupt import Terminate, interrupt_on_loss, stop_on_terminate
from airflow_lease_provider.operators.wrap import init_parameters, leased_subclass
from airflow_lease_provider.outcomes import Outcome, report
from airflow_lease_provider.version_compat import AirflowSkipException, TaskDeferred

log = logging.getLogger(__name__)


class LeasedOperator(BaseOperator):
    """Runs the wrapped operator's ``execute`` under a lease. Use :meth:`wrap` to get a class.

    :param lease_key: the lease's key (templated). Default: ``<dag_id>.<task_id>`` (plus ``[map_index]``
        for a mapped instance), so a task never overlaps itself across runs; give two tasks one key to
        make them exclude each other. A run-scoped task's default is the DAG id, the run lease's key.
    :param lease_ttl: how long the lease lives without renewal. Rule: 1.5-2x the worst normal run time.
        Defaults to 1.5x ``execution_timeout`` when that is set; otherwise required.
    :param lease_renew_every: renewal interval (default TTL x ``[lease] renew_fraction``, i.e. TTL/3).
    :param on_overlap: what to do when another run holds the lease: ``skip`` (default; the task is
        skipped with the reason, and so are its downstream tasks), ``wait`` (defer until it frees,
        freeing the worker slot; skip after ``lease_wait_timeout``), or ``fail``.
    :param lease_wait_timeout: how long ``wait`` waits in total (default: the TTL).
    :param lease_poll_interval: how often the deferred wait checks the lease (default TTL/20, 1-60 s).
    :param lease_conn_id: the lease store's connection (default ``[lease] conn_id``).
    :param lease_scope: ``task`` (default): this task acquires and releases its own lease. ``run``: the
        task joins the run-scoped lease acquired by :class:`AcquireRunLeaseOperator` and renews it while
        it runs, without releasing it.
    """

    template_fields: Sequence[str] = ("lease_key",)

    def __init__(
        self,
        *,
        lease_key: str | None = None,
        lease_ttl: timedelta | None = None,
        lease_renew_every: timedelta | None = None,
        on_overlap: str = "skip",
        lease_wait_timeout: timedelta | None = None,
        lease_poll_interval: timedelta | None = None,
        lease_conn_id: str | None = None,
        lease_scope: str = "task",
        **kwargs: Any,
    ) -> None:
        if "deferrable" in init_parameters(type(self)):
            # A deferred task has no process to renew its lease; run the wrapped operator in-process.
            kwargs.setdefault("deferrable", False)
        super().__init__(**kwargs)
        if isinstance(self, BaseSensorOperator):
            check_sensor_mode(self.mode)
        self.lease_ttl = validate_lease_args(
            lease_key=lease_key, lease_ttl=lease_ttl, lease_renew_every=lease_renew_every,
            on_overlap=on_overlap, lease_wait_timeout=lease_wait_timeout, lease_scope=lease_scope,
            lease_poll_interval=lease_poll_interval, execution_timeout=self.execution_timeout,
        )
        self.lease_key = lease_key
        self.lease_renew_every = lease_renew_every
        self.on_overlap = on_overlap
        self.lease_wait_timeout = lease_wait_timeout
        self.lease_poll_interval = lease_poll_interval
        self.lease_conn_id = lease_conn_id
        self.lease_scope = lease_scope

    @classmethod
    def partial(cls, **kwargs: Any) -> Any:
        """``.partial(...)`` checks the lease arguments when the DAG is parsed, as the constructor does.

        (Airflow builds a mapped task without calling the constructor until the task runs.)
        """
        task_defaults = kwargs.get("default_args") or {}
        partial = super().partial(**kwargs)  # BaseOperator's partial (a descriptor)
        dag = partial.kwargs.get("dag")
        defaults = {**(getattr(dag, "default_args", None) or {}), **task_defaults}
        try:
            # A TTL left out here may still come from expand(); it is then checked when each instance runs.
            validate_lease_kwargs(kwargs, defaults, ttl_may_be_mapped=True)
            if issubclass(cls, BaseSensorOperator):
                check_sensor_mode({**defaults, **kwargs}.get("mode"))
        except InvalidArgument:
            partial._expand_called = True  # no "was never mapped" warning on top of the real error
            raise
        return partial

    @classmethod
    def wrap(cls, operator_class: type[BaseOperator]) -> type[LeasedOperator]:
        """A subclass of ``operator_class`` that runs under a lease (the same class for the same input)."""
        if isinstance(operator_class, type) and issubclass(operator_class, LeasedOperator):
            return operator_class
        return leased_subclass(cls, operator_class)

    # -- the lease around execute -----------------------------------------------------------------

    #: Whether this task's lease belongs to the DAG run (owner ``dag_id/run_id``) or to the task instance.
    _run_owned: ClassVar[bool] = False

    def _identity(self, context: Any) -> RunRef:
        return run_ref(context) if self._run_owned or self.lease_scope == "run" else task_ref(context)

    def _renew_every(self, lease: Lease) -> timedelta:
        return self.lease_renew_every or lease.ttl * settings.renew_fraction()

    def _ttl(self) -> timedelta:
        if self.lease_ttl is None:
            raise InvalidArgument("lease_ttl", None, "is required to acquire a lease")
        return self.lease_ttl

    def _store(self) -> LeaseStore:
        from airflow_lease_provider.hooks import LeaseHook

        return LeaseHook(self.lease_conn_id).get_store()

    def _key(self, context: Any) -> str:
        if self.lease_key is None:
            return self._identity(context).default_key()
        return validation.name("lease_key", self.lease_key)

    def execute(self, context: Any) -> Any:
        # From the first step: a SIGTERM while the task looks up its store, records a catch-up, acquires or
        # gets ready is noted, and the task stops before the body (giving back a lease it took).
        with stop_on_terminate() as terminate:
            key = self._key(context)
            store = self._store()
            self._record_catchup(context, store, key)
            if self.lease_scope == "run":
                return self._run_joined(context, store, key, terminate)
            owner = self._identity(context).owner()
            terminate.check()  # told to stop already: never take the lease
            outcome = store.try_acquire(key, owner, self._ttl(), run=task_ref(context))
            if outcome.lease is None:
                return self._on_held(context, store, key, owner, outcome.holder, waited=None)
            return self._run_holding(context, store, outcome.lease, release=True, terminate=terminate)

    def _record_catchup(self, context: Any, store: LeaseStore, key: str) -> None:
        """The first run after a gap in a capped catch-up schedule records the skipped slots, once."""
        from airflow_lease_provider.timetables.catchup_record import record_skipped_catchup

        try:
            # Recorded under the DAG id unless a key was given (a default key names one task, not the job).
            job = None if self.lease_key is None else key
            record_skipped_catchup(context, ledger=store.events, key=job, logger=self.log)
        except Exception:  # informational only: it must never fail or skip the task
            self.log.warning("catch-up: could not record skipped slots", exc_info=True)

    def execute_after_wait(self, context: Any, event: dict[str, Any] | None = None, deadline: str = "") -> Any:
        """Resumed after the deferred wait: take the lease if it is free now, or wait again."""
        with stop_on_terminate() as terminate:
            key = self._key(context)
            store = self._store()
            owner = self._identity(context).owner()
            terminate.check()
            outcome = store.try_acquire(key, owner, self._ttl(), run=task_ref(context))
            if outcome.lease is not None:
                return self._run_holding(context, store, outcome.lease, release=True, terminate=terminate)
        return self._on_held(context, store, key, owner, outcome.holder, waited=deadline)

    def _on_held(
        self, context: Any, store: LeaseStore, key: str, owner: str, holder: Lease | None, waited: str | None
    ) -> Any:
        tags = task_tags(context, key)
        who = holder.describe() if holder else "held by another run (it was released just now)"
        holder_host = store.holder_host(holder) if holder else None
        if holder_host:
            who += f" on host {holder_host}"
        if self.on_overlap == "wait":
            now = datetime.now(timezone.utc)
            end = datetime.fromisoformat(waited) if waited else now + (self.lease_wait_timeout or self._ttl())
            if now < end:
                self._defer_until_free(context, store, key, owner, holder, end, first=waited is None)
        reason = f"lease {key!r} is {who}; this run ({owner}) is skipped so the two never overlap"
        if waited:
            reason = f"waited until {waited} and lease {key!r} is still {who}; this run ({owner}) is skipped"
        detail = event_detail(
            context,
            reason=reason,
            holder_owner=holder.owner if holder else None,
            holder_token=holder.token if holder else None,
            holder_expires_at=holder.expires_at.isoformat() if holder else None,
            holder_host=holder_host,
            policy=self.on_overlap,
        )
        if self.on_overlap == "fail":
            report(
                Outcome.OVERLAP_FAILED, store=store, key=key, owner=owner, detail=detail, tags=tags,
                logger=self.log, message=f"failing (on_overlap=fail): {reason}", run=task_ref(context),
            )
            raise LeaseHeld(key, holder, reason)
        report(
            Outcome.SKIPPED_OVERLAP, store=store, key=key, owner=owner, detail=detail, tags=tags,
            logger=self.log, message=f"skipping: {reason}", run=task_ref(context),
        )
        context["ti"].xcom_push(key=XCOM_SKIP_REASON, value=detail)
        raise AirflowSkipException(reason)

    def _defer_until_free(
        self, context: Any, store: LeaseStore, key: str, owner: str, holder: Lease | None, end: datetime,
        *, first: bool,
    ) -> None:
        from airflow_lease_provider.triggers.lease_free import RESUME_SETTLE, LeaseFreeTrigger

        message = (
            f"{key!r} is {holder.describe() if holder else 'held'}; deferring until it frees "
            f"(at most until {end.isoformat()})"
        )
        if first:
            report(
                Outcome.WAITING, store=store, key=key, owner=owner, tags=task_tags(context, key),
                logger=self.log, message=message, run=task_ref(context),
                detail=event_detail(
                    context, holder_owner=holder.owner if holder else None,
                    holder_token=holder.token if holder else None, until=end.isoformat(),
                ),
            )
        else:
            self.log.info("lease: %s", message)
        poll = self.lease_poll_interval or min(max(self._ttl() / 20, timedelta(seconds=1)), timedelta(seconds=60))
        self.defer(
            trigger=LeaseFreeTrigger(
                key=key, conn_id=self.lease_conn_id, schema=store.schema,
                poll_interval=poll.total_seconds(), deadline=end.isoformat(),
                not_before=(datetime.now(timezone.utc) + RESUME_SETTLE).isoformat(),
            ),
            method_name="execute_after_wait",
            kwargs={"deadline": end.isoformat()},
        )

    def _run_joined(self, context: Any, store: LeaseStore, key: str, terminate: Terminate) -> Any:
        """Run-scoped: renew the run's lease while this task runs; never acquire or release it."""
        owner = run_ref(context).owner()
        holding = store.holds(key, owner)
        if holding.lease is None:
            who = holding.who()
            lost = LeaseLost(
                key,
                holding.holder.token if holding.holder else 0,
                f"this run ({owner}) does not hold it: {who} (a run-scoped task must run downstream of the "
                "run's acquire task, and while the run lease is still valid)",
            )
            report(
                Outcome.LOST, store=store, key=key, owner=owner, tags=task_tags(context, key), logger=self.log,
                detail=event_detail(context, reason=f"run lease gone: {who}"), message=f"{lost}; the task fails",
                run=task_ref(context),
            )
            raise lost
        return self._run_holding(context, store, holding.lease, release=False, terminate=terminate)

    def _run_holding(
        self, context: Any, store: LeaseStore, lease: Lease, *, release: bool, terminate: Terminate
    ) -> Any:
        """Run the wrapped operator under ``lease``; with ``release``, this task acquired it and frees it.

        From the acquire on, every way out releases the lease or hands it to the keeper: a failure while
        getting ready (the XCom push, the configuration, the keeper's construction or start) or a SIGTERM
        before the body starts (``terminate``, installed before the acquire) releases it at once, so the
        next run is not skipped for a whole TTL.
        """
        key = lease.key
        tags = task_tags(context, key)
        run = task_ref(context)
        keeper: LeaseKeeper | None = None
        try:
            warn_on_clock_skew(lease, datetime.now(timezone.utc), self.log)
            if release:
                report(
                    Outcome.ACQUIRED, store=store, key=key, owner=lease.owner, tags=tags, logger=self.log,
                    message=f"acquired {key!r} with token {lease.token} (owner {lease.owner}, TTL {lease.ttl})",
                )
            context["ti"].xcom_push(key=XCOM_LEASE, value=lease.to_dict())
            keeper = LeaseKeeper(store, lease, renew_every=self._renew_every(lease), run=run)
            ctx = LeaseContext(
                lease=lease, store=store, keeper=keeper, tags=tags, conn_id=self.lease_conn_id,
                detail=event_detail(context), run=run,
            )
            context[XCOM_LEASE] = ctx
            started = time.monotonic()
            keeper.start()
            terminate.check()  # told to stop while it acquired or got ready: do not start the body
        except BaseException:
            self._give_back(store, lease, keeper, release=release, run=run)
            raise
        released = False
        try:
            with activated(ctx), interrupt_on_loss(keeper), terminate.armed():
                # A loss declared before the interrupt was in place (the lease ran out while the task got
                # ready: a slow XCom push, a join with little time left) sent no signal: look once more.
                keeper.check()
                try:
                    result = super().execute(context)
                except TaskDeferred:
                    raise LeaseError(
                        f"{type(self).__name__} cannot hold a lease while the wrapped operator is deferred "
                        "(nothing would renew it): run it with deferrable=False"
                    ) from None
            keeper.check()
        except LeaseLost as lost:
            ctx.report_loss(lost, self.log)  # once, however many times the loss was seen
            try:
                self.on_kill()  # stop what the wrapped operator started (a subprocess, a pod, ...)
            except Exception:
                self.log.exception("on_kill after the lease was lost failed")
            raise
        except BaseException:
            released = self._stop_keeper(keeper, release=release)
            raise
        else:
            released = self._stop_keeper(keeper, release=release)
        finally:
            keeper.stop()
            metrics.timing("lease.held", timedelta(seconds=time.monotonic() - started), tags)
            if release and released:
                report(
                    Outcome.RELEASED, store=store, key=key, owner=lease.owner, tags=tags, logger=self.log,
                    message=f"{key!r} token {lease.token} released",
                )
            elif release:
                self.log.info("lease: %r token %s not released", key, lease.token)
        return result

    def _stop_keeper(self, keeper: LeaseKeeper, *, release: bool) -> bool:
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

    def _give_back(
        self, store: LeaseStore, lease: Lease, keeper: LeaseKeeper | None, *, release: bool, run: RunRef | None = None
    ) -> None:
        """Getting ready to run failed: stop the keeper and, if this task acquired the lease, free it."""
        try:
            if keeper is not None:
                keeper.stop()
            if release:
                freed = store.release(keeper.lease if keeper is not None else lease, run=run)
                self.log.warning(
                    "lease: %r token %s %s: the task failed before it started", lease.key, lease.token,
                    "released" if freed else "was no longer ours to release",
                )
        except Exception:  # the task's own error is the one to report; the lease then expires with its TTL
            self.log.exception("lease: could not release %r token %s", lease.key, lease.token)

