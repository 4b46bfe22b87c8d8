"""The lease arguments of operators and decorators, checked when the DAG is parsed, by one function.

:func:`check_lease_arguments` is the one check of the lease arguments, called once per task at the door it
is parsed through: ``LeasedOperator(...)`` (and so ``@task.leased`` called in a DAG), ``.partial()``,
``@task.leased(...)`` itself and the mapping of a TaskFlow function (``.expand()``). The core checks
again what reaches it (its own guard). :func:`check_publish_arguments` is the same for fenced publishing.
An error names the parameter (:class:`~airflow_lease_provider.core.InvalidArgument`), so a bad TTL or
policy is a DAG import error that says what to fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from airflow_lease_provider.assets import LEASE_ON, LEASE_ON_OUTLETS, check_outlets
from airflow_lease_provider.core import InvalidArgument, validation
from airflow_lease_provider.core.lease import MAX_SLOTS
from airflow_lease_provider.runtime.policies import OVERLAP_POLICIES

LEASE_SCOPES = ("task", "run")
#: What ``FencedSQLOperator(on_duplicate=...)`` accepts.
ON_DUPLICATE = ("fail", "skip")
#: What ``@task.fenced_publish(target=...)`` accepts.
TARGETS = ("postgres", "external")

#: The lease arguments of LeasedOperator and @task.leased, with their defaults.
LEASE_ARGUMENTS: dict[str, Any] = {
    "lease_key": None, "lease_ttl": None, "lease_renew_every": None, "on_overlap": "skip",
    "lease_wait_timeout": None, "lease_poll_interval": None, "lease_conn_id": None, "lease_scope": "task",
    "max_waiting": None, "replace_grace": None, "lease_slots": None,
}
#: The task arguments the lease arguments depend on: a TTL derived from the timeout, a sensor's mode.
_RELATED: dict[str, Any] = {"execution_timeout": None, "mode": None, "outlets": None}


def check_name(parameter: str, value: object, *, optional: bool = False) -> None:
    """A key, resource or idempotency key given to an operator: a template, or a valid name now.

    A template is only known when the task runs (and is checked then); a plain string is checked when
    the DAG is parsed, so what parsing accepts the store accepts too.
    """
    if value is None and optional:
        return
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(parameter, value, "must be a non-empty string (it may be a template)")
    if "{{" not in value and "{%" not in value:
        validation.name(parameter, value)


def check_lease_arguments(
    arguments: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
    *,
    sensor: bool = False,
    ttl_may_be_mapped: bool = False,
    outlets_known: bool = True,
) -> timedelta | None:
    """Check a task's lease arguments when the DAG is parsed; returns the TTL (None: not known yet).

    ``arguments``: the task's keyword arguments (the lease ones, ``execution_timeout`` and a sensor's
    ``mode``); ``defaults``: its ``default_args``, which fill what ``arguments`` leaves out, as they do for
    the task itself. ``sensor``: the task is a sensor (a leased one must poke). ``ttl_may_be_mapped``: a
    missing TTL is not an error yet (``partial()``, a decorator outside a DAG). Errors name the parameter.
    ``lease_key=None`` is the default key (see :mod:`airflow_lease_provider.identity`). ``lease_on="outlets"``
    keys the lease on the task's asset outlets (:mod:`airflow_lease_provider.assets`): the task must have
    one (unless not ``outlets_known``: a decorator whose ``.override`` may still give them), and it then
    takes no ``lease_key`` and is not a run-lease task.
    """
    relevant = {**LEASE_ARGUMENTS, **_RELATED}
    given = {**relevant, **{k: v for k, v in (defaults or {}).items() if k in relevant}, **arguments}
    if sensor:
        check_sensor_mode(given["mode"])
    lease_ttl, lease_renew_every, lease_scope = given["lease_ttl"], given["lease_renew_every"], given["lease_scope"]
    check_name("lease_key", given["lease_key"], optional=True)
    check_lease_on(given, outlets_known=outlets_known)
    if given["on_overlap"] not in tuple(OVERLAP_POLICIES):  # a tuple: any value may be asked (an unhashable one)
        raise InvalidArgument("on_overlap", given["on_overlap"], f"must be one of {', '.join(OVERLAP_POLICIES)}")
    if lease_scope not in LEASE_SCOPES:
        raise InvalidArgument("lease_scope", lease_scope, f"must be one of {', '.join(LEASE_SCOPES)}")
    check_policy(given)
    for optional in ("lease_wait_timeout", "lease_poll_interval"):
        if given[optional] is not None:
            validation.positive_timedelta(optional, given[optional])
    if lease_ttl is None and lease_scope == "run":
        # A run-lease task renews the run's lease, whose TTL is only known when the task runs (it is
        # checked against it then); an interval no TTL could make work is refused now.
        if lease_renew_every is not None:
            interval = validation.positive_timedelta("lease_renew_every", lease_renew_every)
            longest = validation.MAX_TTL - validation.default_safety_margin(validation.MAX_TTL)
            if interval >= longest:
                raise InvalidArgument(
                    "lease_renew_every", lease_renew_every,
                    f"must be shorter than the run lease's TTL minus the keeper's safety margin, and no "
                    f"lease lives longer than {validation.MAX_TTL.days} days: it must be below {longest}",
                )
        return None
    if lease_ttl is None:
        execution_timeout = given["execution_timeout"]
        if isinstance(execution_timeout, timedelta):
            try:
                lease_ttl = execution_timeout * 1.5
            except OverflowError:
                raise InvalidArgument(
                    "lease_ttl", None, f"cannot be derived from execution_timeout={execution_timeout!r}: set it"
                ) from None
        elif ttl_may_be_mapped:
            return None
        else:
            raise InvalidArgument(
                "lease_ttl", lease_ttl,
                "is required: set it to 1.5-2x the worst normal run time (or set execution_timeout)",
            )
    ttl = validation.ttl("lease_ttl", lease_ttl)
    if lease_renew_every is not None:
        validation.renew_every(lease_renew_every, ttl, parameter="lease_renew_every")
    return ttl


def check_policy(given: Mapping[str, Any]) -> None:
    """``on_overlap`` with what it needs: ``max_waiting`` only for ``wait``; ``replace`` only for a task's own
    lease on one key."""
    policy_name, max_waiting = given["on_overlap"], given.get("max_waiting")
    policy = OVERLAP_POLICIES[policy_name]
    if max_waiting is not None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or not 1 <= max_waiting <= 10_000:
            raise InvalidArgument("max_waiting", max_waiting, "must be an integer from 1 to 10000 (or None)")
        if not policy.waits:
            raise InvalidArgument(
                "max_waiting", max_waiting,
                f"applies only to on_overlap='wait' (this task has on_overlap={policy_name!r})",
            )
    if given.get("replace_grace") is not None:
        validation.positive_timedelta("replace_grace", given["replace_grace"])
        if not policy.replaces:
            raise InvalidArgument(
                "replace_grace", given["replace_grace"],
                f"applies only to on_overlap='replace' (this task has on_overlap={policy_name!r})",
            )
    check_slots(given)
    if policy.replaces:
        if given.get("lease_scope", "task") != "task":
            raise InvalidArgument(
                "on_overlap", policy_name, "is for a task's own lease, not with lease_scope='run' (a run-lease "
                "task joins the run's lease: give the policy to the run lease's acquire task)",
            )
        if given.get("lease_on", "key") != "key":
            raise InvalidArgument("on_overlap", policy_name, "needs one lease key: not with lease_on='outlets'")


def check_slots(given: Mapping[str, Any]) -> None:
    """``lease_slots=N``: a semaphore, at most N holders of the key at once (each in its own slot, with its own
    token). The (N+1)-th run follows ``on_overlap``: ``skip``, ``fail``, ``wait`` (until any slot frees; with
    ``max_waiting=1`` one run waits for any slot, the next is skipped). ``replace`` is refused: a takeover of a
    semaphore would have to pick which of the N valid holders to end. A semaphore is a task's own lease on
    one key: not a run lease, not keyed on outlets."""
    slots = given.get("lease_slots")
    if slots is None:
        return
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise InvalidArgument("lease_slots", slots, f"must be an integer from 1 to {MAX_SLOTS} (or None: one holder)")
    if slots == 1:
        return
    policy_name = given["on_overlap"]
    if OVERLAP_POLICIES[policy_name].replaces:
        raise InvalidArgument(
            "on_overlap", policy_name,
            f"is not for a semaphore (lease_slots={slots}): which of the {slots} valid holders would a newer run "
            "replace? Use skip, wait (with max_waiting, or without) or fail",
        )
    if given.get("lease_scope", "task") != "task":
        raise InvalidArgument(
            "lease_slots", slots, "is for a task's own lease, not with lease_scope='run' (a run lease has one holder)"
        )
    if given.get("lease_on", "key") != "key":
        raise InvalidArgument("lease_slots", slots, "needs one lease key: not with lease_on='outlets'")


def check_lease_on(given: Mapping[str, Any], *, outlets_known: bool = True) -> None:
    """``lease_on``: ``"key"`` or ``"outlets"``; the latter needs asset outlets, no key, the task scope."""
    lease_on = given.get("lease_on", "key")
    if lease_on not in LEASE_ON:
        raise InvalidArgument("lease_on", lease_on, f"must be one of {', '.join(LEASE_ON)}")
    if lease_on != LEASE_ON_OUTLETS:
        return
    if given.get("lease_key") is not None:
        raise InvalidArgument(
            "lease_key", given["lease_key"], "cannot be given with lease_on='outlets' (the outlets are the key)"
        )
    if given.get("lease_scope", "task") != "task":
        raise InvalidArgument(
            "lease_scope", given["lease_scope"], "must be 'task' with lease_on='outlets' (a run lease has one key)"
        )
    if outlets_known or given.get("outlets"):
        check_outlets(given.get("outlets"))


def check_sensor_mode(mode: object) -> None:
    """A leased sensor must poke in one process: in ``reschedule`` mode nothing holds or renews the lease
    between pokes, so another run's sensor takes it in between and the two overlap."""
    if mode == "reschedule":
        raise InvalidArgument(
            "mode", mode,
            "a leased sensor gives its lease back at every reschedule (no process is left to renew it), so "
            "another run's sensor gets in between and the two overlap: use mode='poke' (the default)",
        )


def check_publish_arguments(
    *, resource: object, idempotency_key: object, lease_key: object, **others: Any
) -> dict[str, Any]:
    """The arguments of a fenced publish (``FencedSQLOperator``, ``@task.fenced_publish``), checked at parse
    time; returns them all (``others``: ``target``, ``on_duplicate`` and the connections), for the task."""
    on_duplicate, target = others.get("on_duplicate", ON_DUPLICATE[0]), others.get("target", TARGETS[0])
    if on_duplicate not in ON_DUPLICATE:
        raise InvalidArgument("on_duplicate", on_duplicate, f"must be one of {', '.join(ON_DUPLICATE)}")
    if target not in TARGETS:
        raise InvalidArgument("target", target, f"must be one of {', '.join(TARGETS)}")
    check_name("resource", resource)
    check_name("lease_key", lease_key, optional=True)
    check_name("idempotency_key", idempotency_key, optional=True)
    return {"resource": resource, "idempotency_key": idempotency_key, "lease_key": lease_key, **others}
