"""The lease arguments of operators and decorators, checked when the DAG is parsed.

An error names the parameter (:class:`~airflow_lease_provider.core.InvalidArgument`), so a bad TTL or
policy is a DAG import error that says what to fix, for ``LeasedOperator``, ``.partial()``,
``@task.leased``, the run-lease tasks and fenced publishing alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from airflow_lease_provider.core import InvalidArgument, validation

OVERLAP_POLICIES = ("skip", "wait", "fail")
LEASE_SCOPES = ("task", "run")


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


def validate_lease_args(
    *,
    lease_key: object,
    lease_ttl: object,
    lease_renew_every: object,
    on_overlap: object,
    lease_wait_timeout: object,
    lease_scope: object,
    lease_poll_interval: object = None,
    execution_timeout: object = None,
    ttl_required: bool = True,
) -> timedelta | None:
    """Check lease arguments when the DAG is parsed; returns the TTL. Errors name the parameter.

    ``lease_key=None`` is the default key (see :mod:`airflow_lease_provider.identity`).
    """
    check_name("lease_key", lease_key, optional=True)
    if on_overlap not in OVERLAP_POLICIES:
        raise InvalidArgument("on_overlap", on_overlap, f"must be one of {', '.join(OVERLAP_POLICIES)}")
    if lease_scope not in LEASE_SCOPES:
        raise InvalidArgument("lease_scope", lease_scope, f"must be one of {', '.join(LEASE_SCOPES)}")
    if lease_wait_timeout is not None:
        validation.positive_timedelta("lease_wait_timeout", lease_wait_timeout)
    if lease_poll_interval is not None:
        validation.positive_timedelta("lease_poll_interval", lease_poll_interval)
    if lease_ttl is None and lease_scope == "run":
        # A run-scoped task renews the run's lease, whose TTL is only known when the task runs (it is
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
        if isinstance(execution_timeout, timedelta):
            try:
                lease_ttl = execution_timeout * 1.5
            except OverflowError:
                raise InvalidArgument(
                    "lease_ttl", None, f"cannot be derived from execution_timeout={execution_timeout!r}: set it"
                ) from None
        elif not ttl_required:
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


def check_sensor_mode(mode: object) -> None:
    """A leased sensor must poke in one process: in ``reschedule`` mode nothing holds or renews the lease
    between pokes, so another run's sensor takes it in between and the two overlap."""
    if mode == "reschedule":
        raise InvalidArgument(
            "mode", mode,
            "a leased sensor gives its lease back at every reschedule (no process is left to renew it), so "
            "another run's sensor gets in between and the two overlap: use mode='poke' (the default)",
        )


#: The lease arguments of LeasedOperator and @task.leased, with their defaults.
LEASE_ARGUMENTS: dict[str, Any] = {
    "lease_key": None, "lease_ttl": None, "lease_renew_every": None, "on_overlap": "skip",
    "lease_wait_timeout": None, "lease_poll_interval": None, "lease_conn_id": None, "lease_scope": "task",
}


def validate_lease_kwargs(
    kwargs: Mapping[str, Any], defaults: Mapping[str, Any] | None = None, *, ttl_may_be_mapped: bool = False
) -> None:
    """:func:`validate_lease_args` over the keyword arguments of a task (``partial()``, ``@task.leased``).

    ``defaults``: the DAG's and task's ``default_args``, which fill what ``kwargs`` leaves out, as they
    do for the task itself. ``ttl_may_be_mapped``: a missing TTL is not an error yet (``partial()``).
    """
    relevant = (*LEASE_ARGUMENTS, "execution_timeout")
    merged = {
        **LEASE_ARGUMENTS, "execution_timeout": None,
        **{k: v for k, v in (defaults or {}).items() if k in relevant}, **kwargs,
    }
    validate_lease_args(
        lease_key=merged["lease_key"], lease_ttl=merged["lease_ttl"],
        lease_renew_every=merged["lease_renew_every"], on_overlap=merged["on_overlap"],
        lease_wait_timeout=merged["lease_wait_timeout"], lease_scope=merged["lease_scope"],
        lease_poll_interval=merged["lease_poll_interval"], execution_timeout=merged["execution_timeout"],
        ttl_required=not ttl_may_be_mapped,
    )
