"""``@task.leased``: a TaskFlow function run under a lease.

::

    @task.leased(lease_ttl=timedelta(minutes=80))            # key: "<dag_id>.generate"; overlap: skip
    def generate(lease=None):                                 # the LeaseContext, if you ask for it
        article = write_article()
        with lease.fenced_transaction("blog") as cur:          # exactly once into PostgreSQL
            cur.execute("INSERT INTO articles (body, token) VALUES (%s, %s)", (article, lease.token))

Mapped tasks work as usual (``.expand``); the owner and the default key then include the map index
(``<dag_id>.<task_id>[<map_index>]``), so each instance has its own lease; give one ``lease_key`` to make
the instances exclude each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import attr
from airflow.providers.standard.operators.python import PythonOperator

from airflow_lease_provider.decorators._python import PythonDecorated, template_fields
from airflow_lease_provider.operators.leased import LeasedOperator
from airflow_lease_provider.runtime.arguments import check_lease_arguments
from airflow_lease_provider.version_compat import TaskDecorator, mapping_checked, task_default_args

LeasedPythonOperator = LeasedOperator.wrap(PythonOperator)


class _LeasedDecoratedOperator(PythonDecorated, LeasedPythonOperator):  # type: ignore[misc,valid-type]
    """A TaskFlow function run by a leased PythonOperator."""

    template_fields: Sequence[str] = template_fields(LeasedPythonOperator)
    custom_operator_name = "@task.leased"


def _check(kwargs: dict[str, Any], *, ttl_required: bool) -> None:
    """The lease arguments of a task to be made from ``kwargs``, with the ``default_args`` it will get.

    Where no DAG is known yet (a decorator applied outside a DAG) a missing TTL is not an error here
    unless ``ttl_required``: the task's creation or mapping checks it once its DAG is known.
    """
    defaults = task_default_args(kwargs.get("dag"), kwargs.get("task_group"), kwargs.get("default_args"))
    check_lease_arguments(kwargs, defaults if defaults is not None else kwargs.get("default_args"),
                          ttl_may_be_mapped=defaults is None and not ttl_required,
                          outlets_known=ttl_required)


def _check_mapped(kwargs: dict[str, Any]) -> None:
    _check(kwargs, ttl_required=True)


#: What ``@task.leased`` returns: Airflow's TaskFlow decorator, whose mapping checks the lease arguments. A task
#: made by calling the function is checked by its operator's constructor; a mapped one is never constructed
#: while the DAG is parsed, so ``.expand()`` (also after ``f.override(lease_ttl=...)`` and ``.partial()``, which
#: make new decorators of this class) checks it (``version_compat.mapping_checked``: Airflow has no public hook).
_LeasedTaskDecorator = mapping_checked(_check_mapped)


def leased_task(
    python_callable: Callable | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """Wrap a function into a task that runs under a lease. Takes LeasedOperator's ``lease_*`` arguments.

    The arguments are checked here, when the DAG file is parsed, so a bad TTL or policy is reported
    as a DAG import error naming the parameter, mapped tasks included. What the task leaves out comes
    from ``default_args`` as it does for the task itself: the task's own, its task group's and its DAG's
    (a DAG-wide ``lease_ttl`` or ``execution_timeout`` is a TTL). Applied outside a DAG, the decorator
    cannot know the DAG's defaults yet: a missing TTL is then left to the task's creation (when the
    function is called in the DAG) or to its mapping (``.expand()``), which check again with the DAG's
    defaults, as they do for ``.override(...)``.

    Built as ``task_decorator_factory`` builds Airflow's own decorators (the standard provider's
    ``@task``), with this package's decorated operator, and with the decorator class whose mapping checks.
    """
    _check(kwargs, ttl_required=False)
    outputs = cast("bool", attr.NOTHING) if multiple_outputs is None else multiple_outputs

    def decorate(function: Callable) -> Any:
        if not callable(function):
            raise TypeError("No positional arguments allowed while using @task, use named arguments instead")
        return _LeasedTaskDecorator(
            function=function, multiple_outputs=outputs, operator_class=_LeasedDecoratedOperator, kwargs=kwargs,
        )

    if python_callable is not None:
        return cast("TaskDecorator", decorate(python_callable))
    return cast("TaskDecorator", decorate)
