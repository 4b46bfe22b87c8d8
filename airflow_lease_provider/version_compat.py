"""Every contact with Airflow beyond its public interface, and every difference between Airflow versions.

Supported: Apache Airflow 3.1, 3.2 and 3.3. Modelled on the official providers' ``version_compat.py``:
the version flags and the conditional imports live here, and every other module of this package
imports such names from here (``tests/test_layout.py`` fails if one doesn't). Outside this module the
package uses only Airflow's public interface: ``airflow.sdk``, the timetable, trigger and plugin base
classes (``airflow.timetables.base``, ``airflow.triggers.base``, ``airflow.plugins_manager``) and
provider packages.

Where ``apache-airflow-providers-common-compat`` already knows where a name lives on each version, it is
asked (exceptions, ``Stats``, ``conf``, the decorator base classes); where Airflow has a public API, it is
used (``airflow.sdk.timezone``, pendulum). The rest are Airflow internals this package needs, each with
the reason next to it.

Names are resolved on first use (PEP 562 ``__getattr__``), so importing this module stays cheap: the
API-server names (``SessionDep``, ``get_auth_manager``, ...) are only imported where the plugin's app
is built, and the scheduler-side names only where a timetable or a task needs them.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from airflow import __version__ as AIRFLOW_VERSION  # noqa: N812 - the official providers' spelling
from packaging.version import Version

from airflow_lease_provider import check_airflow_version

check_airflow_version(AIRFLOW_VERSION)


def get_base_airflow_version_tuple() -> tuple[int, int, int]:
    version = Version(AIRFLOW_VERSION)
    return version.major, version.minor, version.micro


AIRFLOW_V_3_1_PLUS: bool = get_base_airflow_version_tuple() >= (3, 1, 0)
AIRFLOW_V_3_2_PLUS: bool = get_base_airflow_version_tuple() >= (3, 2, 0)
AIRFLOW_V_3_3_PLUS: bool = get_base_airflow_version_tuple() >= (3, 3, 0)

if TYPE_CHECKING:
    # For type checkers only; at run time each name comes from _LOCATIONS below.

    from airflow.api_fastapi.app import get_auth_manager as get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import (
        SimpleAuthManager as SimpleAuthManager,
    )
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import (
        SimpleAuthManagerRole as SimpleAuthManagerRole,
    )
    from airflow.api_fastapi.common.db.common import SessionDep as SessionDep
    from airflow.api_fastapi.core_api.security import GetUserDep as GetUserDep
    from airflow.api_fastapi.core_api.security import requires_authenticated as requires_authenticated
    from airflow.listeners import hookimpl as hookimpl
    from airflow.models.connection import Connection as Connection
    from airflow.models.dag import DagModel as DagModel
    from airflow.models.dagrun import DagRun as DagRun
    from airflow.models.serialized_dag import SerializedDagModel as SerializedDagModel
    from airflow.sdk.bases.decorator import DecoratedOperator as DecoratedOperator
    from airflow.sdk.bases.decorator import TaskDecorator as TaskDecorator
    from airflow.sdk.bases.decorator import _TaskDecorator as TaskDecoratorBase  # noqa: F401
    from airflow.sdk.bases.decorator import task_decorator_factory as task_decorator_factory
    from airflow.sdk.bases.operator import get_merged_defaults as get_merged_defaults
    from airflow.sdk.configuration import conf as conf
    from airflow.sdk.definitions._internal.contextmanager import DagContext as DagContext
    from airflow.sdk.definitions._internal.contextmanager import TaskGroupContext as TaskGroupContext
    from airflow.sdk.exceptions import AirflowNotFoundException as AirflowNotFoundException
    from airflow.sdk.exceptions import AirflowSkipException as AirflowSkipException
    from airflow.sdk.exceptions import TaskDeferred as TaskDeferred
    from airflow.sdk.observability.stats import Stats as Stats
    from airflow.timetables._cron import CronMixin as CronMixin
    from airflow.timetables.base import TimeRestriction
    from airflow.utils.dates import cron_presets as cron_presets

_COMMON_COMPAT = "airflow.providers.common.compat.sdk"

#: name -> where it lives, as (module, attribute) candidates tried in order; the first module that
#: imports and has the attribute wins. The module is imported on first use of the name.
_LOCATIONS: dict[str, tuple[tuple[str, str], ...]] = {
    # Moved between versions (airflow.exceptions on 3.1, airflow.sdk.exceptions from 3.2; Stats from
    # airflow.stats to airflow.sdk.observability.stats in 3.2; conf to airflow.sdk.configuration in 3.2).
    # common-compat resolves each on the running version (so metrics are emitted on every one); the
    # explicit fallbacks serve a common-compat older than 1.12, which Airflow 3.1's constraints may pin.
    "AirflowSkipException": (
        (_COMMON_COMPAT, "AirflowSkipException"),
        ("airflow.sdk.exceptions", "AirflowSkipException"),
        ("airflow.exceptions", "AirflowSkipException"),
    ),
    "AirflowNotFoundException": (
        (_COMMON_COMPAT, "AirflowNotFoundException"),
        ("airflow.sdk.exceptions", "AirflowNotFoundException"),
        ("airflow.exceptions", "AirflowNotFoundException"),
    ),
    "TaskDeferred": (
        (_COMMON_COMPAT, "TaskDeferred"),
        ("airflow.sdk.exceptions", "TaskDeferred"),
        ("airflow.exceptions", "TaskDeferred"),
    ),
    "Stats": (
        (_COMMON_COMPAT, "Stats"),
        ("airflow.sdk.observability.stats", "Stats"),
        ("airflow.stats", "Stats"),
    ),
    "conf": (
        (_COMMON_COMPAT, "conf"),
        ("airflow.sdk.configuration", "conf"),
        ("airflow.configuration", "conf"),
    ),
    "DecoratedOperator": ((_COMMON_COMPAT, "DecoratedOperator"), ("airflow.sdk.bases.decorator", "DecoratedOperator")),
    "TaskDecorator": ((_COMMON_COMPAT, "TaskDecorator"), ("airflow.sdk.bases.decorator", "TaskDecorator")),
    "task_decorator_factory": (
        (_COMMON_COMPAT, "task_decorator_factory"),
        ("airflow.sdk.bases.decorator", "task_decorator_factory"),
    ),
    # Internal: the class of what task_decorator_factory returns (its _expand() maps a TaskFlow function);
    # @task.leased checks its lease arguments there, when .override(...).expand(...) is parsed.
    "TaskDecoratorBase": (("airflow.sdk.bases.decorator", "_TaskDecorator"),),
    # Internal, the same on 3.1-3.3: how a task gets its DAG's and task group's default_args (the DAG and
    # task group whose ``with`` block is open, and the merge), for the parse-time check of @task.leased's
    # lease arguments (runtime/arguments.py), which sees the arguments before any task is made.
    "get_merged_defaults": (("airflow.sdk.bases.operator", "get_merged_defaults"),),
    "DagContext": (("airflow.sdk.definitions._internal.contextmanager", "DagContext"),),
    "TaskGroupContext": (("airflow.sdk.definitions._internal.contextmanager", "TaskGroupContext"),),
    # Private: the core cron timetables' mixin. The capped catch-up grid takes its preset expansion and
    # its UI description from it (its slots are its own: docs/timetable.md, "Daylight saving").
    "CronMixin": (("airflow.timetables._cron", "CronMixin"),),
    # Internal: the presets (@daily, ...) Airflow's cron timetables accept, to accept the same ones.
    "cron_presets": (("airflow.utils.dates", "cron_presets"),),
    # The core Connection model: outside a task (api-server, CLI) the SDK's lookup reads only env vars
    # and secrets backends; this one also reads the metadata database (connections made in the UI).
    "Connection": (("airflow.models.connection", "Connection"),),
    # Metadata-database models: the run a Leases page row links to, the DAG a timetable serves.
    "DagRun": (("airflow.models.dagrun", "DagRun"),),
    "DagModel": (("airflow.models.dag", "DagModel"),),
    # The serialized DAG the scheduler reads before it asks a timetable for the run after a stored one.
    "SerializedDagModel": (("airflow.models.serialized_dag", "SerializedDagModel"),),
    # The API server's FastAPI dependencies, for the plugin's routes (authentication, a DB session).
    "SessionDep": (("airflow.api_fastapi.common.db.common", "SessionDep"),),
    "GetUserDep": (("airflow.api_fastapi.core_api.security", "GetUserDep"),),
    "requires_authenticated": (("airflow.api_fastapi.core_api.security", "requires_authenticated"),),
    "get_auth_manager": (("airflow.api_fastapi.app", "get_auth_manager"),),
    # The simple auth manager answers custom-view questions as reads; the admin check needs its type.
    "SimpleAuthManager": (("airflow.api_fastapi.auth.managers.simple.simple_auth_manager", "SimpleAuthManager"),),
    # The auth managers' resource descriptions (is_authorized_dag(details=DagDetails(id=...))).
    "DagDetails": (("airflow.api_fastapi.auth.managers.models.resource_details", "DagDetails"),),
    # [core] hostname_callable as Airflow resolves it (recorded with each lease a worker acquires).
    "get_hostname": (("airflow.sdk.api.client", "get_hostname"), ("airflow.utils.net", "get_hostname")),
    # The listener marker (airflow.listeners on 3.1, the Task SDK's shared listeners from 3.2): the
    # plugin's listener records, when an Airflow component starts, what its task processes may not read.
    "hookimpl": ((_COMMON_COMPAT, "hookimpl"), ("airflow.listeners", "hookimpl")),
    "SimpleAuthManagerRole": (
        ("airflow.api_fastapi.auth.managers.simple.simple_auth_manager", "SimpleAuthManagerRole"),
    ),
}

# The task runner's module; it holds SUPERVISOR_COMMS only in a process that runs a task.
_TASK_RUNNER = "airflow.sdk.execution_time.task_runner"


def __getattr__(name: str) -> Any:
    try:
        candidates = _LOCATIONS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    failures = []
    for module, attribute in candidates:
        try:
            value = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            failures.append(f"{module}.{attribute}: {exc}")
            continue
        globals()[name] = value  # resolved once
        return value
    raise ImportError(
        f"{name} is not where this package looks for it on Apache Airflow {AIRFLOW_VERSION}: "
        + "; ".join(failures)
    )


def in_task_process() -> bool:
    """Whether this process runs a task (the SDK then reaches connections through the supervisor).

    Read through ``sys.modules``: asking must not import the task runner into a process that has none.
    """
    runner = sys.modules.get(_TASK_RUNNER)
    return getattr(runner, "SUPERVISOR_COMMS", None) is not None


def scheduler_session(orm_object: Any) -> Any:
    """The SQLAlchemy session that loaded ``orm_object`` (the scheduler's, inside its transaction), or None
    (detached, or not an ORM object). Airflow hands a timetable its ``DagModel`` row, not the session."""
    if not hasattr(orm_object, "_sa_instance_state"):
        return None  # not an ORM object (a plain object in a test)
    from sqlalchemy.orm import object_session

    return object_session(orm_object)


def time_restriction_of(serialized_dag: Any) -> TimeRestriction | None:
    """A deserialized DAG's time restriction (``SerializedDAG._time_restriction``: private on 3.1-3.3, no
    public equivalent); None on an Airflow without it, which leaves the cap as if no end_date were set
    instead of failing the scheduler's loop."""
    restriction: TimeRestriction | None = getattr(serialized_dag, "_time_restriction", None)
    return restriction


#: What Airflow's supervisor writes over ``[database] sql_alchemy_conn`` in the processes it forks to run
#: user code (``block_orm_access`` in ``airflow/sdk/execution_time/supervisor.py``, 3.1 to 3.3: task
#: processes, the triggerer's trigger runner, DAG file processors): they may not reach the metadata
#: database, so they cannot read where it is either.
HIDDEN_METADATA = "airflow-db-not-allowed:"


__all__ = [
    "AIRFLOW_VERSION",
    "AIRFLOW_V_3_1_PLUS",
    "AIRFLOW_V_3_2_PLUS",
    "AIRFLOW_V_3_3_PLUS",
    "get_base_airflow_version_tuple",
    "in_task_process",
    "HIDDEN_METADATA",
    "scheduler_session",
    "time_restriction_of",
    *_LOCATIONS,
]
