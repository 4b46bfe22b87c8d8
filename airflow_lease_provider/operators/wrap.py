"""The classes ``LeasedOperator.wrap(X)`` builds, and where they live.

``wrap`` builds ``Leased<X>`` once per operator class ``X`` (a subclass of the leased operator and
``X``) and keeps it here; this module is each built class's ``__module__``, and looking the name up on
the module finds it (``airflow_lease_provider.operators.wrap.LeasedBashOperator``), as pickling and
anything that imports an operator class by its dotted name do. Nothing is written into the module's
namespace: the names resolve from the registry.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from airflow.sdk import BaseOperator

_L = TypeVar("_L", bound=type[BaseOperator])

#: operator class -> the leased class built for it
_built: dict[type, type] = {}


def leased_subclass(lease_class: _L, operator_class: Any) -> _L:
    """``Leased<operator_class>``: ``lease_class``'s lease around ``operator_class`` (the same class for the
    same input)."""
    if not (isinstance(operator_class, type) and issubclass(operator_class, BaseOperator)):
        raise TypeError(f"operator_class={operator_class!r}: must be an operator class (a BaseOperator subclass)")
    existing = _built.get(operator_class)
    if existing is not None:
        return existing  # type: ignore[return-value]
    fields = tuple(dict.fromkeys((*operator_class.template_fields, *lease_class.template_fields)))
    leased = type(
        f"Leased{operator_class.__name__}",
        (lease_class, operator_class),
        {
            "template_fields": fields,
            "__module__": __name__,
            "__doc__": f"{operator_class.__name__} run under a lease (see LeasedOperator).",
        },
    )
    _built[operator_class] = leased
    return leased  # type: ignore[return-value]


def __getattr__(name: str) -> type:
    """A class built here, by name (``LeasedBashOperator``), like any operator class in its module."""
    for leased in _built.values():
        if leased.__name__ == name:
            return leased
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def init_parameters(cls: type) -> set[str]:
    """Every keyword the constructors along ``cls``'s MRO take."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names.update(inspect.signature(init).parameters)
    return names
