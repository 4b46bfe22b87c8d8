"""The one door to Airflow beyond its public interface (Airflow 3.1 to 3.3): version flags, moved names, internals.

As in the official providers' ``version_compat.py``: other modules import from here what is not ``airflow.sdk``,
a documented base class or a provider package, and use no private Airflow name (``tests/test_layout.py``).
The API server's and the ORM's names are imported on first use (PEP 562): a task process never loads them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from airflow import __version__ as AIRFLOW_VERSION  # noqa: N812 - the official providers' spelling
from packaging.version import Version

from airflow_lease_provider import check_airflow_version

check_airflow_version(AIRFLOW_VERSION)
AIRFLOW_V_3_2_PLUS: bool = Version(AIRFLOW_VERSION).release[:2] >= (3, 2)

if AIRFLOW_V_3_2_PLUS:  # moved into the Task SDK in 3.2
    from airflow.sdk.exceptions import AirflowNotFoundException, AirflowSkipException, TaskDeferred
else:
    from airflow.exceptions import AirflowNotFoundException, AirflowSkipException, TaskDeferred  # type: ignore[no-redef]

if TYPE_CHECKING:  # the names of _LAZY are typed Any (module __getattr__)
    from airflow.timetables.base import TimeRestriction

_DECORATOR, _SIMPLE_AUTH = "airflow.sdk.bases.decorator", "airflow.api_fastapi.auth.managers.simple.simple_auth_manager"
#: name -> its module, imported on first use.
_LAZY: dict[str, str] = {
    # Moved into the Task SDK in 3.2 (task code's Stats and conf are the SDK's there).
    "conf": "airflow.sdk.configuration" if AIRFLOW_V_3_2_PLUS else "airflow.configuration",
    "Stats": "airflow.sdk.observability.stats" if AIRFLOW_V_3_2_PLUS else "airflow.stats",
    # The TaskFlow decorator's parts, where the Task SDK keeps them on 3.1 to 3.3.
    "DecoratedOperator": _DECORATOR, "TaskDecorator": _DECORATOR, "task_decorator_factory": _DECORATOR,
    "hookimpl": "airflow.listeners",  # the listener marker (an alias of the SDK's shared one from 3.2)
    "cron_presets": "airflow.utils.dates",  # the presets (@daily, ...) Airflow's cron timetables accept
    "get_hostname": "airflow.sdk.api.client",  # [core] hostname_callable as Airflow resolves it
    # Outside a task the SDK reads connections from env vars and secrets only; this also reads the database.
    "Connection": "airflow.models.connection",
    # The scheduler's and the UI's metadata models: a DAG's runs, its row, its serialized form.
    "DagRun": "airflow.models.dagrun", "DagModel": "airflow.models.dag",
    "SerializedDagModel": "airflow.models.serialized_dag",
    # The API server's dependencies for the plugin's routes: authentication, a session, authorization.
    "SessionDep": "airflow.api_fastapi.common.db.common", "get_auth_manager": "airflow.api_fastapi.app",
    "GetUserDep": "airflow.api_fastapi.core_api.security",
    "requires_authenticated": "airflow.api_fastapi.core_api.security",
    "DagDetails": "airflow.api_fastapi.auth.managers.models.resource_details",
    "SimpleAuthManager": _SIMPLE_AUTH, "SimpleAuthManagerRole": _SIMPLE_AUTH, "BaseDBManager": "airflow.utils.db_manager",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)  # resolved once
    return value


#: What Airflow's supervisor writes over ``[database] sql_alchemy_conn`` in the processes it forks to run user
#: code (``block_orm_access``, 3.1 to 3.3): they may not reach the metadata database, nor read where it is.
HIDDEN_METADATA = "airflow-db-not-allowed:"


def in_task_process() -> bool:
    """Whether this process runs a task (the task runner's supervisor channel is set), read through
    ``sys.modules``: asking must not import the task runner into a process that has none."""
    return getattr(sys.modules.get("airflow.sdk.execution_time.task_runner"), "SUPERVISOR_COMMS", None) is not None


def scheduler_session(orm_object: Any) -> Any:
    """The SQLAlchemy session that loaded ``orm_object`` (the scheduler's, inside its transaction), or None
    (detached, or not an ORM object). Airflow hands a timetable its ``DagModel`` row, not the session."""
    if not hasattr(orm_object, "_sa_instance_state"):
        return None  # not an ORM object (a plain object in a test)
    from sqlalchemy.orm import object_session

    return object_session(orm_object)


def time_restriction_of(serialized_dag: Any) -> TimeRestriction | None:
    """A deserialized DAG's time restriction, or None (the cap then acts as if no end_date were set). Private
    (``SerializedDAG._time_restriction``, 3.1 to 3.3): no public equivalent."""
    return getattr(serialized_dag, "_time_restriction", None)


def task_default_args(dag: Any, task_group: Any, default_args: Any) -> dict[str, Any] | None:
    """The ``default_args`` a task made now gets (its DAG's, task group's, own), None while no DAG is known, for
    a check made before any task exists (``@task.leased(...)``, ``.partial()``). Internal (``_internal``'s
    ``DagContext``, ``get_merged_defaults``; 3.1 to 3.3): no public API gives the open ``with`` block's DAG."""
    from airflow.sdk.bases.operator import get_merged_defaults
    from airflow.sdk.definitions._internal.contextmanager import DagContext, TaskGroupContext

    dag = dag or DagContext.get_current()
    if dag is None:
        return None
    task_group = task_group or TaskGroupContext.get_current(dag)
    merged, _ = get_merged_defaults(dag=dag, task_group=task_group, task_params=None, task_default_args=default_args)
    return dict(merged)


def mapping_checked(check: Callable[[dict[str, Any]], None]) -> type:
    """``task_decorator_factory``'s class, calling ``check(kwargs)`` as the function is mapped (``.expand()``,
    ``.expand_kwargs()``, after ``.partial()``, ``.override()``). Private (``_TaskDecorator._expand``, 3.1 to 3.3):
    a mapped task is not constructed at parse time, and no public hook shows its operator the arguments."""
    from airflow.sdk.bases.decorator import _TaskDecorator

    class MappingChecked(_TaskDecorator):
        def _expand(self, expand_input: Any, *, strict: bool) -> Any:
            check(self.kwargs)
            return super()._expand(expand_input, strict=strict)

    return MappingChecked


__all__ = ["AIRFLOW_VERSION", "AIRFLOW_V_3_2_PLUS", "AirflowNotFoundException", "AirflowSkipException", "TaskDeferred",
           "HIDDEN_METADATA", "in_task_process", "mapping_checked", "scheduler_session", "task_default_args",
           "time_restriction_of", *_LAZY]
