"""The history file: one JSON object per line.

Record types (``"type"``):

``meta``
    the run: profile, variant, TTL, keys, workers, the key of each resource.
``worker_start``
    a worker came up: pid, its faketime offset, and ``client_minus_db_s``, its own clock minus the
    database clock (about +-600 for a skewed worker).
``op``
    one operation by a worker: ``op`` is ``acquire``, ``replace``, ``renew``, ``release``, ``publish`` or
    ``lost``; ``outcome`` is what it saw (``ok``, ``held``, ``refused``, ``mismatch`` for an acquire refused
    because the key is held with another slot count, ``accepted``, ``stale``, ``superseded``, ``duplicate``,
    ``unknown`` when the store failed and the effect is not known, ``error`` for anything unexpected).
    A semaphore key's acquire records the count it asked for (``asked``), and its grant the slot and count
    (``slot``, ``slots``) and the key acquired (``lease_key``; ``key`` is the slot's row); a replace its
    ``run_after`` and the holder it took over (``replaced_owner``, ``replaced_token``).
    A waiting place's ``wait_claim`` (outcome ``claimed``, ``full``, ``other`` over HTTP when the owner's place
    was taken with another place id, ``unknown``) records ``max_waiting``, ``ttl``, the live waiters the
    answer listed (``waiters``: owner, since, expires_at) and the owner's own place (``since``,
    ``expires_at``); ``wait_release`` (``ok``, ``refused``, ``unknown``) whether its capability was forged
    (``forged``). ``after_forged``/``reclaim`` mark the claim right after a forged give-back and the claim
    under a new place id after a give-back.
    Database times (``acquired_at``, ``renewed_at``, ``expires_at``, ``observed_at``, a publish's ``at``,
    a release's ``released_at`` taken from the committed row) are ISO strings from ``clock_timestamp()``;
    an operation the database never answered has none. ``t0``/``t1`` are the host's monotonic clock (the
    same for every process, and not faked by libfaketime) around the call.
``fault``
    a fault: ``kind`` is ``sigstop``, ``sigcont``, ``terminate``, ``kill9``, ``stmt_timeout``,
    ``force_release`` (the admin's, of ``key`` with ``token``) or ``clock_skew``; ``t``/``t1`` monotonic,
    ``db_time`` where the database could be asked.
``heal`` / ``crash_all``
    the faults stopped / every worker was killed at once (``db_time``).
``worker_exit``
    a worker that had died by itself before the final crash (an exception the core let through).
``probe``
    after ``crash_all``: the first acquisition of each key by a fresh client, and its publish.
``probe_waiters``
    after ``crash_all``: the live waiting places a fresh client lists (``waiters``: key, owner, since,
    expires_at), between two readings of the database clock (``db_before``, ``db_after``).
``audit_lease`` / ``audit_fence`` / ``target`` / ``final_lease``
    ground truth read from the database at the end: every committed change of a lease row (with its slot
    count, slot, ``slot_of``, ``run_after``, ``replaced_token`` and, in ``extra``, every other column) and
    of a fence row (recorded by triggers in the same transaction), every row the publishes wrote (with
    ``committed_at``, its transaction's commit time).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import IO, Any


def _default(value: object) -> object:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    return str(value)


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, default=_default, ensure_ascii=False)


class Recorder:
    """Appends records to a JSON-lines file, flushed line by line (a worker may be killed at any time).

    Thread-safe: a worker's keeper thread records its renewals through the same recorder.
    """

    def __init__(self, path: Path, **base: object) -> None:
        self.path = path
        self.base = base
        self._lock = threading.Lock()
        self._file: IO[str] = path.open("a", encoding="utf-8", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        line = dumps({**self.base, **record})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def op(self, op: str, *, t0: float, **fields: Any) -> None:
        self.write({"type": "op", "op": op, "t0": t0, "t1": time.monotonic(), **fields})

    def fault(self, kind: str, **fields: Any) -> None:
        self.write({"type": "fault", "kind": kind, "t": time.monotonic(), **fields})

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a history file. A last line cut short by a kill is skipped, nothing else."""
    with path.open(encoding="utf-8") as file:
        lines = file.read().split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            if number >= len(lines) - 1:
                continue  # the line a SIGKILL interrupted
            raise


def with_release_times(records: list[dict[str, Any]], audit: list[dict[str, Any]]) -> None:
    """Give each acknowledged release its database time, from the committed row (``release()`` returns a
    bool only). The checker does not rely on it; it is there for people reading the history."""
    released = {
        (row["key"], row["token"], row["owner"]): row["released_at"]
        for row in audit if row.get("type") == "audit_lease" and row.get("released_at") is not None
    }
    for record in records:
        if record.get("op") == "release" and record.get("outcome") == "ok":
            at = released.get((record["key"], record["token"], record["owner"]))
            if at is not None:
                record["released_at"] = at


def merge(parts: list[Path], target: Path, tail: list[dict[str, Any]]) -> int:
    """Write ``target``: the records of ``parts`` in monotonic-time order, then ``tail``. Returns the count."""
    records = [r for part in parts for r in read(part)]
    with_release_times(records, tail)
    meta = [r for r in records if r.get("type") == "meta"]
    rest = [r for r in records if r.get("type") != "meta"]
    rest.sort(key=lambda r: r.get("t0", r.get("t", 0.0)))
    with target.open("w", encoding="utf-8") as file:
        for record in [*meta, *rest, *tail]:
            file.write(dumps(record) + "\n")
    return len(meta) + len(rest) + len(tail)
