"""The run identity of a lease owner, and of a ledger event: one type that formats and parses it.

:class:`RunRef` names a DAG run, or one task instance of it. The Airflow layer builds one from the
running task instance (:meth:`RunRef.of_task`), writes its :meth:`~RunRef.owner` as the lease owner
and passes the ref itself (``run=``) to the store calls that write ledger events, which store it in the
event's typed columns ``dag_id``, ``run_id``, ``task_id``, ``map_index`` (:meth:`~RunRef.columns`,
migration 0007). A core API user who passes nothing gets NULL columns: the core never guesses a run
from an owner string. :meth:`RunRef.parse` reads an owner back (for the UI's links and old events);
owner formats and default keys are tabulated in :mod:`airflow_lease_provider.identity`.

Nothing here imports Airflow: a task instance is anything with ``dag_id``, ``run_id``, ``task_id`` and
``map_index``.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import InvalidArgument

# ASCII digits only: ``\d`` and ``str.isdigit`` also take other scripts' digits and ``'²'``, which ``int``
# refuses (a ValueError for every reader of that lease), and owners are written with ASCII digits.
_MAP_INDEX = re.compile(r"[0-9]+")
_TASK_PART = re.compile(r"(?P<task_id>[^/\[\]]+?)(?:\[(?P<map_index>[0-9]+)\])?")


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
        """The lease key when none is given; a different key for every run or task instance of every DAG.

        ======================================  ====================  ===========================
        DAG id                                  run                   task instance
        ======================================  ====================  ===========================
        without a ``.`` (``etl``)               ``etl``               ``etl.daily.load[3]``
        with a ``.`` (``etl.daily``)            ``etl.daily/``        ``etl.daily/load[3]``
        ======================================  ====================  ===========================

        Airflow's DAG and task ids are letters, digits, ``_``, ``-`` and ``.``, so ``/``, ``[`` and ``~``
        never occur in them. A key without ``/`` has a DAG id without ``.``: its first ``.`` (if any)
        ends the DAG id, so ``etl`` task ``daily.load`` (a task group's) and ``etl.daily`` task ``load``
        differ (``etl.daily.load`` and ``etl.daily/load``), and the run key of ``etl.load``
        (``etl.load/``) is not the task key of ``etl`` task ``load``. A key with ``/`` splits at it.
        Keys of DAG ids without a ``.`` are the ones versions before 0.x gave.

        A key that would not be a valid name as it stands (longer than 512 characters or 1024 bytes,
        e.g. a 240-character DAG id and task id, or changed by NFC normalisation) is instead its
        readable start, ``~`` and the SHA-256 of the identity: :func:`hashed_key`.
        """
        head = self.dag_id + ("/" if "." in self.dag_id else "")
        if self.task_id is None:
            readable = head
        else:
            readable = head + ("" if head.endswith("/") else ".") + self._task_part
        if _usable(readable):
            return readable
        return hashed_key(self, readable)

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
        if _MAP_INDEX.fullmatch(task):  # written before owners carried the task id: dag_id/run_id/map_index
            return cls(dag_id, run_id, int(task))
        match = _TASK_PART.fullmatch(task)
        if match is None:
            return None
        index = match.group("map_index")
        return cls(dag_id, run_id, -1 if index is None else int(index), task_id=match.group("task_id"))

    def columns(self) -> dict[str, Any]:
        """The event table's run columns (``dag_id``, ``run_id``, ``task_id``, ``map_index``).

        ``map_index`` is NULL for a run (no task and no map index), else as Airflow numbers it (-1: not mapped).
        """
        map_index = None if self.task_id is None and self.map_index < 0 else self.map_index
        return {"dag_id": self.dag_id, "run_id": self.run_id, "task_id": self.task_id, "map_index": map_index}

    @classmethod
    def from_columns(cls, row: Mapping[str, Any]) -> RunRef | None:
        """The ref an event row's run columns hold; None when they are NULL (no run recorded)."""
        if row.get("dag_id") is None or row.get("run_id") is None:
            return None
        map_index = row.get("map_index")
        return cls(
            str(row["dag_id"]), str(row["run_id"]), -1 if map_index is None else int(map_index),
            task_id=None if row.get("task_id") is None else str(row["task_id"]),
        )


def _usable(key: str) -> bool:
    """Whether ``key`` is a valid name stored exactly as it is (the store normalises names to NFC)."""
    try:
        return validation.name("key", key) == key
    except InvalidArgument:
        return False


#: How much of the readable key a hashed default key keeps in front of its digest.
HASHED_PREFIX = 200


def hashed_key(ref: RunRef, readable: str) -> str:
    """The default key of ``ref`` when its readable form cannot be a key: ``<start>~<sha256>``.

    The digest is of the identity itself (scope, DAG id, task id, map index, as JSON), so two refs get
    two keys (up to a SHA-256 collision); ``~`` never occurs in a readable default key. The start is
    the readable key's first letters, digits and ``. _ - / [ ]`` (at most :data:`HASHED_PREFIX`), for
    people; it is at most 200 x 4 + 65 bytes, within the limits.
    """
    identity = ["task" if ref.task_id is not None else "run", ref.dag_id, ref.task_id, ref.map_index]
    digest = hashlib.sha256(json.dumps(identity, ensure_ascii=True).encode("ascii")).hexdigest()
    start = "".join(c for c in unicodedata.normalize("NFC", readable) if c.isalnum() or c in "._-/[]")
    key = f"{start[:HASHED_PREFIX]}~{digest}"
    if not _usable(key):  # a start NFC would still change (rare): keep its ASCII only
        key = f"{''.join(c for c in start if c.isascii())[:HASHED_PREFIX]}~{digest}"
    return key


#: What :meth:`RunRef.columns` gives for an event about no run (a core API user's).
NO_RUN: dict[str, Any] = {"dag_id": None, "run_id": None, "task_id": None, "map_index": None}


def run_columns(run: RunRef | None) -> dict[str, Any]:
    """The event table's run columns for ``run`` (all NULL for None); rejects anything but a RunRef."""
    if run is None:
        return dict(NO_RUN)
    if not isinstance(run, RunRef):
        raise InvalidArgument("run", run, f"must be a RunRef or None, not {type(run).__name__}")
    validation.identifier("run.dag_id", run.dag_id)
    validation.identifier("run.run_id", run.run_id)
    if run.task_id is not None:
        validation.identifier("run.task_id", run.task_id)
    if isinstance(run.map_index, bool) or not isinstance(run.map_index, int) or not -1 <= run.map_index < 2**31:
        raise InvalidArgument("run.map_index", run.map_index, "must be an integer from -1 to 2**31-1")
    return run.columns()
