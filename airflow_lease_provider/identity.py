"""Who holds a lease: the run identity behind an owner string, and the default lease key.

The owner an Airflow task instance becomes, and the key it defaults to. The type that formats and parses
them, :class:`RunRef`, lives in the Airflow-free core (:mod:`airflow_lease_provider.core.identity`) and is
re-exported here: the operators write owners with it and pass it to the store calls that write ledger
events (their run columns), the UI and CLI read owners back with it. The functions at the end read the
running task's identity from its Airflow context (``context["ti"]``): its owner, metric tags and event
detail. Nothing here imports Airflow.

======================================  =================================================  ===================
lease                                   owner                                              default key
======================================  =================================================  ===================
task-scoped (``LeasedOperator``,        ``dag_id/run_id/task_id``                          ``dag_id.task_id``
``@task.leased``)
a mapped instance of one                ``dag_id/run_id/task_id[map_index]``               ``dag_id.task_id[map_index]``
run-scoped (``run_lease()``,            ``dag_id/run_id``                                  ``dag_id``
``lease_scope="run"``)
======================================  =================================================  ===================

There is no try number in the owner: a retry (or a clear) of the same task instance is the same owner,
so it re-enters its own lease at once with a larger token, which fences out its earlier try. Two
different tasks are two owners, so with one key they exclude each other.

Airflow's dag ids and task ids never contain ``/`` (and default run ids neither), so the parts split
back unambiguously. Owners written before the task id was part of them (``dag_id/run_id/3`` for map
index 3) still parse, as a run with that map index.
"""

from __future__ import annotations

from typing import Any

from airflow_lease_provider.core.identity import RunRef

__all__ = ["RunRef", "event_detail", "run_ref", "task_ref", "task_tags"]


def task_ref(context: Any) -> RunRef:
    """The task instance running (its owner is ``dag_id/run_id/task_id[map_index]``)."""
    return RunRef.of_task(context["ti"])


def run_ref(context: Any) -> RunRef:
    """The DAG run of the running task (the owner of a run-scoped lease: ``dag_id/run_id``)."""
    return RunRef.of_run(context["ti"])


def task_tags(context: Any, key: str) -> dict[str, str]:
    ti = context["ti"]
    return {"dag_id": ti.dag_id, "task_id": ti.task_id, "lease_key": key}


def event_detail(context: Any, **extra: Any) -> dict[str, Any]:
    """Who an event is about: the task instance (and its try), plus ``extra``."""
    ti = context["ti"]
    return {**task_ref(context).detail(), "try_number": getattr(ti, "try_number", None), **extra}
