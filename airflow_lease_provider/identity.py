"""Who holds a lease: the run identity behind an owner string, and the default lease key.

The owner an Airflow task instance becomes, and the key it defaults to. The type that formats and parses
them, :class:`RunRef`, lives in the Airflow-free core (:mod:`airflow_lease_provider.core.identity`) and is
re-exported here: the task lease (:class:`airflow_lease_provider.runtime.TaskLease`) builds it once from
the running task instance and passes it to the store calls that write ledger events (their run columns);
the UI and CLI read owners back with it. Nothing here imports Airflow.

======================================  =================================================  ===================
lease                                   owner                                              default key
======================================  =================================================  ===================
task-scoped (``LeasedOperator``,        ``dag_id/run_id/task_id``                          ``dag_id.task_id``
``@task.leased``)
a mapped instance of one                ``dag_id/run_id/task_id[map_index]``               ``dag_id.task_id[map_index]``
run lease (``run_lease()``,            ``dag_id/run_id``                                  ``dag_id``
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

from airflow_lease_provider.core.identity import RunRef

__all__ = ["RunRef"]
