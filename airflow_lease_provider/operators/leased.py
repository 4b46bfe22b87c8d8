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

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

from airflow.sdk import BaseOperator, BaseSensorOperator

from airflow_lease_provider.operators.wrap import init_parameters, leased_subclass
from airflow_lease_provider.runtime.arguments import check_lease_arguments
from airflow_lease_provider.runtime.signals import Terminate, stop_on_terminate
from airflow_lease_provider.runtime.task_lease import TaskLease
from airflow_lease_provider.version_compat import task_default_args


class LeasedOperator(BaseOperator):
    """Runs the wrapped operator's ``execute`` under a lease. Use :meth:`wrap` to get a class.

    :param lease_key: the lease's key (templated). Default: ``<dag_id>.<task_id>`` (plus ``[map_index]``
        for a mapped instance), so a task never overlaps itself across runs; give two tasks one key to
        make them exclude each other. A run-lease task's default is the DAG id, the run lease's key.
    :param lease_ttl: how long the lease lives without renewal. Rule: 1.5-2x the worst normal run time.
        Defaults to 1.5x ``execution_timeout`` when that is set; otherwise required.
    :param lease_renew_every: renewal interval (default TTL x ``[lease] renew_fraction``, i.e. TTL/3).
    :param on_overlap: what to do when another run holds the lease: ``skip`` (default; the task is
        skipped with the reason, and so are its downstream tasks), ``wait`` (defer until it frees,
        freeing the worker slot; skip after ``lease_wait_timeout``), ``fail``, ``replace`` (take the
        lease over from an older run, whose task is then skipped; an older run never replaces a newer
        one).
        See :mod:`airflow_lease_provider.runtime.policies`.
    :param max_waiting: with ``wait``: at most this many runs wait for the key at once; the others are
        skipped, naming the waiters (default: no limit). ``max_waiting=1`` is Temporal's ``BUFFER_ONE``.
    :param replace_grace: with ``replace``: how long the older holder gets to finish before the takeover (the
        task defers meanwhile, and takes the lease as usual if it frees); default: take over at once.
    :param lease_slots: a semaphore: at most this many runs hold the key at once (default 1), each in its own
        slot with its own token (fenced per slot: ``lease.key`` is the slot's key); the next run follows
        ``on_overlap`` (not ``replace``). See docs/airflow.md, "Semaphores".
    :param lease_wait_timeout: how long ``wait`` waits in total (default: the TTL).
    :param lease_poll_interval: how often the deferred wait checks the lease (default TTL/20, 1-60 s).
    :param lease_conn_id: the lease store's connection (default ``[lease] conn_id``).
    :param lease_on: ``key`` (default): the lease is ``lease_key``. ``outlets``: one lease per asset outlet
        of the task, keyed by the asset (and the run's partition), taken in sorted order, all or nothing
        (:mod:`airflow_lease_provider.assets`); the task must have asset outlets and no ``lease_key``.
    :param lease_scope: ``task`` (default): this task acquires and releases its own lease. ``run``: the
        task joins the run lease acquired by :class:`AcquireRunLeaseOperator` and renews it while
        it runs, without releasing it.
    """

    template_fields: Sequence[str] = ("lease_key",)
    lease_key: str | None
    lease_ttl: timedelta | None
    lease_renew_every: timedelta | None
    on_overlap: str
    lease_wait_timeout: timedelta | None
    lease_poll_interval: timedelta | None
    lease_conn_id: str | None
    lease_scope: str
    lease_on: str
    max_waiting: int | None
    replace_grace: timedelta | None
    lease_slots: int | None

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
        lease_on: str = "key",
        max_waiting: int | None = None,
        replace_grace: timedelta | None = None,
        lease_slots: int | None = None,
        **kwargs: Any,
    ) -> None:
        if "deferrable" in init_parameters(type(self)):
            # A deferred task has no process to renew its lease; run the wrapped operator in-process.
            kwargs.setdefault("deferrable", False)
        super().__init__(**kwargs)
        arguments = {
            "lease_key": lease_key, "lease_ttl": lease_ttl, "lease_renew_every": lease_renew_every,
            "on_overlap": on_overlap, "lease_wait_timeout": lease_wait_timeout,
            "lease_poll_interval": lease_poll_interval, "lease_conn_id": lease_conn_id, "lease_scope": lease_scope,
            "lease_on": lease_on, "max_waiting": max_waiting, "replace_grace": replace_grace,
            "lease_slots": lease_slots,
        }
        related = {
            "execution_timeout": self.execution_timeout, "mode": getattr(self, "mode", None), "outlets": self.outlets,
        }
        # The TTL as the task holds it: derived from execution_timeout when not given.
        arguments["lease_ttl"] = check_lease_arguments(
            {**arguments, **related}, sensor=isinstance(self, BaseSensorOperator)
        )
        for name, value in arguments.items():
            setattr(self, name, value)

    @classmethod
    def partial(cls, **kwargs: Any) -> Any:
        """``.partial(...)`` checks the lease arguments when the DAG is parsed, as the constructor does, with
        the ``default_args`` the task gets (its DAG's, its task group's, its own).

        (Airflow builds a mapped task without calling the constructor until the task runs.) Checked before
        the partial is made: a refused one leaves no partial behind to warn that it "was never mapped".
        """
        defaults = task_default_args(kwargs.get("dag"), kwargs.get("task_group"), kwargs.get("default_args"))
        # A TTL left out here may still come from expand(); it is then checked when each instance runs.
        check_lease_arguments(
            kwargs, defaults if defaults is not None else kwargs.get("default_args"),
            sensor=issubclass(cls, BaseSensorOperator), ttl_may_be_mapped=True,
        )
        return super().partial(**kwargs)  # BaseOperator's partial (a descriptor)

    @classmethod
    def wrap(cls, operator_class: type[BaseOperator]) -> type[LeasedOperator]:
        """A subclass of ``operator_class`` that runs under a lease (the same class for the same input)."""
        if isinstance(operator_class, type) and issubclass(operator_class, LeasedOperator):
            return operator_class
        return leased_subclass(cls, operator_class)

    # -- the lease around execute: one TaskLease per execute (airflow_lease_provider.runtime) ---------------

    #: The run lease's acquire task: its lease belongs to the DAG run and is left held after the task.
    _keeps_for_run: ClassVar[bool] = False

    def render_template_fields(self, context: Any, jinja_env: Any = None) -> None:
        """Render the templates; in a task process, also start opening the lease store's connection and
        checking its schema while Airflow finishes getting the task ready (:meth:`TaskLease.prepare`)."""
        super().render_template_fields(context, jinja_env)
        TaskLease.prepare(self, context)

    def execute(self, context: Any) -> Any:
        # From the first step: a SIGTERM while the task looks up its store, records a catch-up, acquires or
        # gets ready is noted, and the task stops before the body (giving back a lease it took).
        with stop_on_terminate() as terminate:
            lease: TaskLease = self._task_lease(context, terminate)
            return lease.execute(lambda: super(LeasedOperator, self).execute(context), context, terminate)

    def execute_after_wait(
        self, context: Any, event: dict[str, Any] | None = None, deadline: str = "", place: str | None = None
    ) -> Any:
        """Resumed after the deferred wait: take the lease if it is free now, or wait again. ``place``: the id
        of the waiting place the deferral took through the lease API (the API path), kept or given back now."""
        with stop_on_terminate() as terminate:
            lease: TaskLease = self._task_lease(context, terminate)
            if place and hasattr(lease.store, "adopt_place"):
                lease.store.adopt_place(lease.owner, place)
            return lease.execute(
                lambda: super(LeasedOperator, self).execute(context), context, terminate, waited=deadline
            )

    def _task_lease(self, context: Any, terminate: Terminate) -> TaskLease:
        role = "join" if self.lease_scope == "run" else "keep" if self._keeps_for_run else "task"
        return TaskLease.of(
            self, context, lease_key=self.lease_key, conn_id=self.lease_conn_id, run_scoped=role != "task",
            outlets=self.outlets if getattr(self, "lease_on", "key") == "outlets" else None, role=role,
            terminate=terminate,
        )
