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

import configparser
import importlib
import sys
from pathlib import Path
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
    import datetime

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
    from airflow.models.connection import Connection as Connection
    from airflow.models.dag import DagModel as DagModel
    from airflow.models.dagrun import DagRun as DagRun
    from airflow.sdk.bases.decorator import DecoratedOperator as DecoratedOperator
    from airflow.sdk.bases.decorator import TaskDecorator as TaskDecorator
    from airflow.sdk.bases.decorator import _TaskDecorator as TaskDecoratorBase  # noqa: F401
    from airflow.sdk.bases.decorator import task_decorator_factory as task_decorator_factory
    from airflow.sdk.configuration import conf as conf
    from airflow.sdk.exceptions import AirflowNotFoundException as AirflowNotFoundException
    from airflow.sdk.exceptions import AirflowSkipException as AirflowSkipException
    from airflow.sdk.exceptions import TaskDeferred as TaskDeferred
    from airflow.sdk.observability.stats import Stats as Stats
    from airflow.sdk.timezone import convert_to_utc as convert_to_utc
    from airflow.sdk.timezone import make_naive as make_naive
    from airflow.timetables._cron import CronMixin as CronMixin
    from airflow.timetables.base import TimeRestriction
    from airflow.utils.dates import cron_presets as cron_presets
    from pendulum.tz.timezone import FixedTimezone, Timezone

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
    # Public since 3.0.
    "convert_to_utc": (("airflow.sdk.timezone", "convert_to_utc"),),
    "make_naive": (("airflow.sdk.timezone", "make_naive"),),
    # Private: the core cron timetables' stepping (with their daylight-saving fixes). The capped
    # catch-up grid reuses it so that its slots are exactly Airflow's; no public equivalent exists.
    "CronMixin": (("airflow.timetables._cron", "CronMixin"),),
    # Internal: the presets (@daily, ...) Airflow's cron timetables accept, to accept the same ones.
    "cron_presets": (("airflow.utils.dates", "cron_presets"),),
    # The core Connection model: outside a task (api-server, CLI) the SDK's lookup reads only env vars
    # and secrets backends; this one also reads the metadata database (connections made in the UI).
    "Connection": (("airflow.models.connection", "Connection"),),
    # Metadata-database models: the run a Leases page row links to, the DAG a timetable serves.
    "DagRun": (("airflow.models.dagrun", "DagRun"),),
    "DagModel": (("airflow.models.dag", "DagModel"),),
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


def make_aware(value: datetime.datetime, timezone: Timezone | FixedTimezone) -> datetime.datetime:
    """A naive wall-clock time in ``timezone``, made aware as Airflow's cron timetables do.

    Airflow's own ``make_aware`` (not public) takes the later of two ambiguous wall-clock times (fold=1)
    and lets the pendulum zone convert it; pendulum's ``Timezone.convert`` is the public API it calls.
    """
    if value.tzinfo is not None and value.utcoffset() is not None:
        raise ValueError(f"make_aware expects a naive datetime, got {value}")
    return timezone.convert(value.replace(fold=1))


def default_args_here(
    dag: Any = None, task_group: Any = None, task_default_args: Any = None
) -> dict[str, Any] | None:
    """The ``default_args`` a task made here gets: its DAG's, its task group's, then its own, merged.

    ``dag`` and ``task_group`` are the ones given to the task, else the DAG and task group whose ``with``
    block is open (Airflow's own ``DagContext`` and ``TaskGroupContext``, internal, the same on 3.1-3.3).
    ``None`` when no DAG is known yet (a decorator applied outside a DAG): the task's defaults are then
    not known until it is created.
    """
    from airflow.sdk.bases.operator import get_merged_defaults
    from airflow.sdk.definitions._internal.contextmanager import DagContext, TaskGroupContext

    dag = dag or DagContext.get_current()
    if dag is None:
        return None
    task_group = task_group or TaskGroupContext.get_current(dag)
    merged, _ = get_merged_defaults(dag=dag, task_group=task_group, task_params=None,
                                    task_default_args=task_default_args)
    return dict(merged)


def in_task_process() -> bool:
    """Whether this process runs a task (the SDK then reaches connections through the supervisor).

    Read through ``sys.modules``: asking must not import the task runner into a process that has none.
    """
    runner = sys.modules.get(_TASK_RUNNER)
    return getattr(runner, "SUPERVISOR_COMMS", None) is not None


def _scheduler_session(dag_model: Any) -> Any:
    """The session that loaded ``dag_model`` (the scheduler's, inside its transaction), or None."""
    if not hasattr(dag_model, "_sa_instance_state"):
        return None  # not an ORM object (a plain object in a test)
    from sqlalchemy.orm import object_session

    return object_session(dag_model)


def dag_time_restriction(dag_model: Any) -> TimeRestriction | None:
    """The time restriction of ``dag_model``'s DAG (``start_date``, ``end_date``, ``catchup``), or None.

    ``Timetable.next_run_info_from_dag_model`` (3.2+) receives only the ``dag`` row, which has no
    ``end_date`` or ``catchup``. The scheduler deserializes the DAG from ``serialized_dag`` right before it
    calls that method; this reads it the same way (``SerializedDagModel.get``) and returns the restriction
    Airflow's own ``next_dagrun_info`` applies (``SerializedDAG._time_restriction``: private, no public
    equivalent). None when ``dag_model`` is not attached to a session (the ``airflow dags next-execution``
    CLI closes its session first) or the DAG is not serialized.
    """
    session = _scheduler_session(dag_model)
    if session is None:
        return None
    from airflow.models.serialized_dag import SerializedDagModel

    serialized = SerializedDagModel.get(dag_id=dag_model.dag_id, session=session)
    if serialized is None:
        return None
    # Private on 3.2 and 3.3: a later Airflow without it leaves the cap as before (no end_date known)
    # instead of failing the scheduler's loop.
    restriction: TimeRestriction | None = getattr(serialized.dag, "_time_restriction", None)
    return restriction


def taken_logical_dates(dag_model: Any, since: datetime.datetime) -> set[datetime.datetime] | None:
    """Logical dates from ``since`` on that runs of ``dag_model``'s DAG already have, or None if unknown.

    The scheduler checks only the stored next run for an existing run, then creates whatever
    ``next_run_info_from_dag_model`` returns; a logical date already taken (a manual run with a logical
    date, a backfill) fails that insert on ``dag_run_dag_id_logical_date_key`` and leaves the scheduler's
    session unusable. Read through the scheduler's session; None when ``dag_model`` has none.
    """
    session = _scheduler_session(dag_model)
    if session is None:
        return None
    from airflow.models.dagrun import DagRun
    from sqlalchemy import select

    taken = session.scalars(
        select(DagRun.logical_date).where(DagRun.dag_id == dag_model.dag_id, DagRun.logical_date >= since)
    ).all()
    return {value for value in taken if value is not None}


#: What Airflow's supervisor writes over ``[database] sql_alchemy_conn`` in a task process
#: (``block_orm_access`` in ``airflow/sdk/execution_time/supervisor.py``, 3.0 to 3.3): tasks may not
#: reach the metadata database, so they cannot read where it is either.
_BLOCKED_METADATA = "airflow-db-not-allowed:"
_METADATA_ENV = "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"


def metadata_database_url() -> str:
    """``[database] sql_alchemy_conn`` as the deployment configured it, also inside a task process.

    In a task process Airflow has replaced it (environment and config) after the fork; the value the
    deployment set is then read from the environment this process was started with (``/proc/self/environ``:
    what the scheduler or worker was run with, a fork changes no exec environment) or, where that does not
    set it, from the config file, as Airflow itself would have. ``""`` when it cannot be known (no
    ``/proc``, or a ``_cmd``/``_secret`` source): callers must then assume a metadata database that is not
    SQLite, the safe answer.
    """
    value = str(__getattr__("conf").get("database", "sql_alchemy_conn", fallback="")).strip()
    if not value.startswith(_BLOCKED_METADATA):
        return value
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return ""
    started_with = dict(
        item.split("=", 1) for item in raw.decode("utf-8", "replace").split("\0") if "=" in item
    )
    if _METADATA_ENV in started_with:
        return started_with[_METADATA_ENV].strip()
    if any(f"{_METADATA_ENV}_{kind}" in started_with for kind in ("CMD", "SECRET")):
        return ""
    home = started_with.get("AIRFLOW_HOME") or str(Path.home() / "airflow")
    config_file = started_with.get("AIRFLOW_CONFIG") or str(Path(home) / "airflow.cfg")
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(config_file, encoding="utf-8")
    except (OSError, configparser.Error):
        return ""
    if parser.has_option("database", "sql_alchemy_conn_cmd") or parser.has_option("database", "sql_alchemy_conn_secret"):
        return ""
    if parser.has_option("database", "sql_alchemy_conn"):
        return parser.get("database", "sql_alchemy_conn").strip()
    return f"sqlite:///{home}/airflow.db"  # Airflow's default ([database] sql_alchemy_conn in its config.yml)


__all__ = [
    "AIRFLOW_VERSION",
    "AIRFLOW_V_3_1_PLUS",
    "AIRFLOW_V_3_2_PLUS",
    "AIRFLOW_V_3_3_PLUS",
    "default_args_here",
    "get_base_airflow_version_tuple",
    "in_task_process",
    "make_aware",
    "metadata_database_url",
    "dag_time_restriction",
    "taken_logical_dates",
    *_LOCATIONS,
]
