"""The TaskFlow side of this package's decorators, as the standard provider's ``@task`` has it.

A decorated operator is :class:`PythonDecorated` (Airflow's ``DecoratedOperator``, handing the function and
its arguments to the operator it runs on) plus the operator that runs the function: a leased
``PythonOperator`` for ``@task.leased``, a ``PythonOperator`` behind the fence for ``@task.fenced_publish``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from airflow_lease_provider.version_compat import DecoratedOperator


def template_fields(*classes: type, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The template fields of a decorated operator: its bases', in order, once each, then ``extra``."""
    return tuple(dict.fromkeys((*DecoratedOperator.template_fields, *(f for c in classes for f in c.template_fields), *extra)))  # type: ignore[attr-defined]


class PythonDecorated(DecoratedOperator):
    """Airflow's ``DecoratedOperator``, handing the function to the ``PythonOperator`` it is combined with."""

    def __init__(self, *, python_callable: Callable, op_args: Any, op_kwargs: Any, **kwargs: Any) -> None:
        kwargs_to_upstream = {"python_callable": python_callable, "op_args": op_args, "op_kwargs": op_kwargs}
        super().__init__(
            kwargs_to_upstream=kwargs_to_upstream,
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            **kwargs,
        )
