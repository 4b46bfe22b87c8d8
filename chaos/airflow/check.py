"""The checker of the Airflow-level fault run: the history of ``chaos.airflow.run`` against the claims.

- ``overlap``: two bodies of one key whose publishes were both accepted ran at once by the database
  clock (a body's protected part runs from its start to its publish's commit). A zombie (frozen, cut
  off, or failed over to a retry) may overlap its successor only if its publish was then refused;
- ``slot-twice``: one slot of one resource published more than once;
- ``token-order``: accepted publishes of one (resource, key) not in strictly increasing token order;
- ``undocumented-state``: a leased task instance ended in a state the docs do not list (success,
  skipped with the lease's reason, failed with LeaseLost / StaleFencingToken / DuplicatePublish /
  LeaseStoreUnavailable / TaskTerminated or after the nemesis killed or froze its process: the body's, or
  any task process of a whole worker it hit), or never finished;
- ``no-recovery``: after the faults stopped, a DAG did not publish again within TTL + one schedule
  interval (+ the body's work time and ``START_SLACK`` for Airflow to start the task; + the profile's
  ``orphan_reset`` when the scheduler was restarted: the time Airflow takes to reset the task instances
  a dead scheduler left ``running``; + ``queued_reset`` when a Celery worker was killed: the time it
  takes to requeue a task the worker had received but not started; see docs/reliability.md).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

#: Seconds for Airflow to start a task (scheduler loop, executor, supervisor, task process, parse).
START_SLACK = 10.0
#: Failure reasons a task log can show that the docs list for a leased task. ``TaskTerminated``: Airflow
#: told the task to stop (SIGTERM: its heartbeat timed out, or its state was changed under it), and it
#: stopped and gave its lease back (docs/airflow.md).
DOCUMENTED_ERRORS = ("LeaseLost", "StaleFencingToken", "DuplicatePublish", "LeaseStoreUnavailable", "TaskTerminated")
#: A body's recorded outcome -> the documented failure it is (any other error is not documented).
DOCUMENTED_OUTCOMES = {"lost": "LeaseLost", "refused:stale": "StaleFencingToken", "refused:duplicate": "DuplicatePublish",
                       "store-unavailable": "LeaseStoreUnavailable", "error:TaskTerminated": "TaskTerminated"}
FINAL = {"success", "skipped", "failed", "upstream_failed"}


def _ts(value: Any) -> datetime | None:
    return None if value is None else datetime.fromisoformat(str(value))


def _evidence(ti: dict[str, Any], bodies: dict[tuple[str, str, int], list[dict[str, Any]]]) -> str:
    """What the history holds about a task instance's tries, to read a failure nobody explained."""
    tries = "; ".join(f"try {t.get('try_number')} {t.get('state')} pid {t.get('pid')}" for t in ti.get("tries") or [])
    events = "; ".join(f"{e.get('event')} (try {e.get('try_number')}) {e.get('extra') or ''}".strip()
                       for e in ti.get("events") or [])
    ran = bodies.get((ti["dag_run_id"], ti["task_id"], ti["map_index"]), [])
    lines = [line.strip() for line in (ti.get("log_tail") or "").splitlines() if line.strip()][-4:]
    return (f"tries [{tries or 'unknown'}]; bodies {[(b['try_number'], b['outcome']) for b in ran]};"
            f" events [{events or 'none'}]; last log lines {[line[:240] for line in lines]}")


@dataclass
class Report:
    variant: str
    executor: str = "local"
    operations: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    violations: dict[str, list[str]] = field(default_factory=dict)
    states: Counter[str] = field(default_factory=Counter)
    recovery: dict[str, float | None] = field(default_factory=dict)
    fault_recovery: dict[str, list[float]] = field(default_factory=dict)
    zombie_overlaps: int = 0
    bound: float = 0.0

    def violate(self, kind: str, text: str) -> None:
        self.violations.setdefault(kind, []).append(text)

    @property
    def status(self) -> int:
        return 1 if self.violations else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant, "executor": self.executor, "operations": dict(self.operations), "faults": dict(self.faults),
            "violations": {k: len(v) for k, v in self.violations.items()},
            "violation_examples": {k: v[:5] for k, v in self.violations.items()},
            "states": dict(self.states), "recovery": self.recovery, "recovery_bound": self.bound,
            "fault_recovery": {k: _stats(v) for k, v in self.fault_recovery.items()},
            "zombie_overlaps": self.zombie_overlaps,
        }

    def format(self) -> str:
        d = self.to_dict()
        lines = [f"airflow chaos: variant={self.variant} executor={self.executor}",
                 "operations: " + ", ".join(f"{k}={v}" for k, v in sorted(d["operations"].items())),
                 "faults: " + (", ".join(f"{k}={v}" for k, v in sorted(d["faults"].items())) or "none"),
                 "task states: " + ", ".join(f"{k}={v}" for k, v in sorted(d["states"].items())),
                 f"zombie overlaps (refused or never published): {self.zombie_overlaps}",
                 f"recovery after the faults (s, largest bound {self.bound:.0f}): "
                 + ", ".join(f"{k}={'none' if v is None else f'{v:.1f}'}" for k, v in sorted(self.recovery.items()))]
        for kind, stats in sorted(d["fault_recovery"].items()):
            lines.append(f"  next accepted publish after {kind} ends (s): {stats}")
        if self.violations:
            lines.append("VIOLATIONS: " + ", ".join(f"{k}={len(v)}" for k, v in sorted(self.violations.items())))
            for kind, texts in sorted(self.violations.items()):
                lines.extend(f"  {kind}: {text}" for text in texts[:5])
        else:
            lines.append("violations: none")
        return "\n".join(lines)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"n": len(values), "median": round(statistics.median(values), 1), "max": round(max(values), 1)}


def check(history: dict[str, Any]) -> Report:
    report = Report(history["variant"], history.get("executor", "local"))
    profile = history["profile"]
    bodies = {b["id"]: b for b in history["bodies"]}
    target = history["target"]
    accepted: dict[int, dict[str, Any]] = {}
    for row in target:
        accepted.setdefault(row["body"], row)
    report.operations.update({"bodies": len(bodies), "publishes_accepted": len(target),
                              "task_instances": len(history["task_instances"])})
    report.operations.update(f"body:{b['outcome'] or 'no-end'}" for b in bodies.values())
    report.faults.update(f["kind"] for f in history["faults"])

    # overlap: by key, the protected parts [start, publish commit] of accepted bodies
    by_key: dict[str, list[tuple[datetime, datetime, dict[str, Any]]]] = defaultdict(list)
    for body_id, row in accepted.items():
        b = bodies[body_id]
        by_key[b["key"]].append((_ts(b["started_at"]), _ts(row["at"]), b))  # type: ignore[arg-type]
    for key, spans in by_key.items():
        spans.sort(key=lambda s: s[0])
        for i, (_start, end, b) in enumerate(spans):
            for other_start, _, other in spans[i + 1:]:
                if other_start >= end:
                    break
                report.violate("overlap", f"key {key}: body {b['id']} ({b['run_id']}/{b['task_id']} try {b['try_number']},"
                               f" token {b['token']}) published at {end} after body {other['id']} ({other['run_id']}/"
                               f"{other['task_id']} try {other['try_number']}, token {other['token']}) began at {other_start}")
    # zombie overlaps: any body overlapping an accepted one of its key without having published itself
    for key, spans in by_key.items():
        for b in bodies.values():
            if b["key"] != key or b["id"] in accepted:
                continue
            start, end = _ts(b["started_at"]), _ts(b["ended_at"])
            if any(start < s_end and (end is None or s_start < end) for s_start, s_end, _ in spans):  # type: ignore[operator]
                report.zombie_overlaps += 1

    # every slot at most once
    slots = Counter((row["resource"], row["slot"]) for row in target)
    for (resource, slot), n in slots.items():
        if n > 1:
            report.violate("slot-twice", f"{resource} slot {slot} published {n} times")
    # accepted publishes in token order per (resource, key)
    last: dict[tuple[str, str], int] = {}
    for row in target:
        pair = (row["resource"], row["key"])
        token = row["token"]
        if token is None:  # published with no lease at all (the lease-off variant): overlap and slot catch it
            continue
        if pair in last and token <= last[pair]:
            report.violate("token-order", f"{pair}: token {token} accepted after {last[pair]} (target row {row['id']})")
        last[pair] = max(token, last.get(pair, token))

    # every leased task instance in a documented state
    # (a whole Celery worker's fault hits every task it ran: "tis")
    touched = {(ti["run_id"], ti["task_id"], ti["map_index"]): f["kind"]
               for f in history["faults"] for ti in ([f["ti"]] if "ti" in f else []) + f.get("tis", [])}
    # A fault on a whole worker hit every task process in it, also one that had not started its body yet
    # (acquiring, skipping, getting ready): matched by the try's process id, which Airflow records.
    # (A try that started after the fault is not the process it hit, whatever its pid.)
    hit_pids = {pid: f for f in history["faults"] if "ti" in f for pid in f.get("pids", [])}
    for ti in history["task_instances"]:
        ident = (ti["dag_run_id"], ti["task_id"], ti["map_index"])
        for attempt in ti.get("tries") or []:
            fault = hit_pids.get(attempt.get("pid"))
            started = _ts(attempt.get("start_date"))
            if ident not in touched and fault is not None and started is not None and started <= _ts(fault["at"]):
                touched[ident] = fault["kind"]
    # the bodies each task instance ran (one per try that reached its body)
    ran: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for b in bodies.values():
        ran[(b["run_id"], b["task_id"], b["map_index"])].append(b)
    for ti in history["task_instances"]:
        ident = (ti["dag_run_id"], ti["task_id"], ti["map_index"])
        name = f"{ti['dag_id']}/{ti['dag_run_id']}/{ti['task_id']}" + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else "")
        state = ti["state"]
        if state not in FINAL:
            report.states[f"{state}"] += 1
            report.violate("undocumented-state", f"{name} still {state} after the drain")
            continue
        if state == "skipped":
            reason = ti.get("skip_reason") or ""
            if history["variant"] != "lease-off" and "is held by" not in str(reason):
                report.violate("undocumented-state", f"{name} skipped without the lease's reason ({reason!r})")
            report.states["skipped:held"] += 1
        elif state == "failed":
            outcomes = [b["outcome"] for b in ran.get(ident, []) if b["outcome"] in DOCUMENTED_OUTCOMES]
            in_log = [e for e in DOCUMENTED_ERRORS if e in (ti.get("log_tail") or "")]
            if ident in touched:
                report.states[f"failed:{touched[ident]}"] += 1
            elif in_log:
                report.states[f"failed:{in_log[0]}"] += 1
            elif outcomes:
                report.states[f"failed:{outcomes[-1]}"] += 1
            else:
                report.states["failed:unexplained"] += 1
                report.violate("undocumented-state", f"{name} failed with no documented reason: {_evidence(ti, ran)}")
        else:
            report.states[state] += 1

    # recovery after the faults
    p = profile
    intervals = p.get("intervals") or {}
    restarted = any(f["kind"] == "scheduler-restart" for f in history["faults"])
    killed_worker = any(f["kind"] == "kill-worker" for f in history["faults"])
    slack = (START_SLACK + (float(p.get("orphan_reset", 0)) if restarted else 0.0)
             + (float(p.get("queued_reset", 0)) if killed_worker else 0.0))
    report.bound = p["ttl"] + max(intervals.values(), default=p["every"]) + p["work"] + slack
    ended = _ts(history["marks"].get("faults_ended"))
    if ended is not None:
        for dag_id in sorted({b["dag_id"] for b in bodies.values()}):
            bound = p["ttl"] + intervals.get(dag_id, p["every"]) + p["work"] + slack
            after = [_ts(row["at"]) for row in target if bodies[row["body"]]["dag_id"] == dag_id and _ts(row["at"]) > ended]  # type: ignore[operator]
            first = min(after, default=None)  # type: ignore[type-var]
            report.recovery[dag_id] = None if first is None else (first - ended).total_seconds()
            if first is None or report.recovery[dag_id] > bound:  # type: ignore[operator]
                report.violate("no-recovery", f"{dag_id}: no accepted publish within {bound:.0f}s of the faults' end"
                               f" ({report.recovery[dag_id]})")
    commits = sorted(_ts(row["at"]) for row in target)  # type: ignore[type-var]
    for f in history["faults"]:
        end = _ts(f.get("ended") or f["at"])
        nxt = next((c for c in commits if c > end), None)  # type: ignore[operator]
        if nxt is not None:
            report.fault_recovery.setdefault(f["kind"], []).append((nxt - end).total_seconds())  # type: ignore[operator]
    return report


def check_file(path: Path) -> Report:
    return check(json.loads(path.read_text()))
