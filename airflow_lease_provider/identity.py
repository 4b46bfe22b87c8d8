"""Who holds a lease: the run identity behind an owner string, and the default lease key.

The one place where an Airflow task instance becomes a lease owner and an owner string becomes a run
again (the operators write it, the UI and CLI read it back). The functions at the end read the running
task's identity from its Airflow context (``context["ti"]``): its owner, metric tags and event detail.
Nothing here imports Airflow.

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

import re
from dataclasses import dataclass, field
from typing import Any

_TASK_PART = re.compile(r"(?P<task_id>[^/\[\]]+?)(?:\[(?P<map_index>\d+)\])?")


@dataclass(frozen=True)
class RunRef:
    """A DAG run, or one task instance of it (``task_id`` set; ``map_index`` >= 0 when mapped)."""

    dag_id: str
    run_id: str
    map_index: int = -1
    task_id: str | None = field(default=None, kw_only=True)

    @classmethod
    def of_task(cls, ti: Any) -> RunRef:
        """The task instance ``ti`` (anything with ``dag_id``, ``run_id``, ``task_id``, ``map_index``)."""
        map_index = getattr(ti, "map_index", -1)
        return cls(str(ti.dag_id), str(ti.run_id), -1 if map_index is None else int(map_index), task_id=str(ti.task_id))

    @classmethod
    def of_run(cls, ti: Any) -> RunRef:
        """The DAG run the task instance ``ti`` belongs to."""
        return cls(str(ti.dag_id), str(ti.run_id))

    @property
    def run(self) -> RunRef:
        """The DAG run alone (no task, no map index)."""
        return RunRef(self.dag_id, self.run_id)

    @property
    def _task_part(self) -> str:
        if self.task_id is None:
            raise ValueError(f"{self!r} names a run, not a task")
        return self.task_id + (f"[{self.map_index}]" if self.map_index >= 0 else "")

    def owner(self) -> str:
        """The lease owner: ``dag_id/run_id`` for a run, ``dag_id/run_id/task_id[map_index]`` for a task."""
        if self.task_id is None:
            return f"{self.dag_id}/{self.run_id}"
        return f"{self.dag_id}/{self.run_id}/{self._task_part}"

    def default_key(self) -> str:
        """The lease key when none is given: ``dag_id`` for a run, ``dag_id.task_id[map_index]`` for a task."""
        if self.task_id is None:
            return self.dag_id
        return f"{self.dag_id}.{self._task_part}"

    def detail(self) -> dict[str, Any]:
        """The identity as ledger event detail (``dag_id``, ``run_id``, ``task_id``, ``map_index``)."""
        return {"dag_id": self.dag_id, "run_id": self.run_id, "task_id": self.task_id, "map_index": self.map_index}

    @classmethod
    def parse(cls, owner: str | None) -> RunRef | None:
        """The run (and task) an owner string names; None for any other owner (e.g. a script's)."""
        if not owner:
            return None
        parts = owner.split("/")
        if len(parts) == 2 and all(parts):
            return cls(parts[0], parts[1])
        if len(parts) != 3 or not all(parts):
            return None
        dag_id, run_id, task = parts
        if task.isdigit():  # written before owners carried the task id: dag_id/run_id/map_index
            return cls(dag_id, run_id, int(task))
        match = _TASK_PART.fullmatch(task)
        if match is None:
            return None
        index = match.group("map_index")
        return cls(dag_id, run_id, -1 if index is None else int(index), task_id=match.group("task_id"))


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
