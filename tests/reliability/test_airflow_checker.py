"""The Airflow-level fault run's checker on small hand-made histories: each claim can fail."""

from __future__ import annotations

from typing import Any

from chaos.airflow.check import check


def at(seconds: float) -> str:
    return f"2026-12-01T12:00:{seconds:06.3f}+00:00"


def body(id_: int, start: float, end: float | None, outcome: str | None, *, token: int | None = 1, key: str = "k",
         run: str = "r1", task: str = "t", try_: int = 1, dag: str = "chaos_pair") -> dict[str, Any]:
    return {"id": id_, "dag_id": dag, "run_id": run, "task_id": task, "map_index": -1, "try_number": try_,
            "key": key, "resource": "res", "slot": f"res@{run}", "token": token, "pid": 1000 + id_,
            "started_at": at(start), "ended_at": None if end is None else at(end), "outcome": outcome}


def published(id_: int, b: dict[str, Any], seconds: float) -> dict[str, Any]:
    return {"id": id_, "body": b["id"], "resource": b["resource"], "key": b["key"], "slot": b["slot"],
            "token": b["token"], "at": at(seconds)}


def history(bodies: list[dict[str, Any]], target: list[dict[str, Any]], tis: list[dict[str, Any]] | None = None,
            faults: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"variant": "correct", "profile": {"ttl": 8, "every": 15, "work": 4, "intervals": {"chaos_pair": 15}},
            "marks": {"faults_ended": at(1)}, "bodies": bodies, "target": target,
            "task_instances": tis or [], "faults": faults or []}


def ti(state: str, run: str = "r1", task: str = "t", **extra: Any) -> dict[str, Any]:
    return {"dag_id": "chaos_pair", "dag_run_id": run, "task_id": task, "map_index": -1, "state": state,
            "try_number": 1, **extra}


def test_a_zombie_overlapping_its_successor_is_fine_when_its_publish_was_refused() -> None:
    zombie, successor = body(1, 2, 30, "refused:stale", token=1), body(2, 12, 20, "accepted", token=2, run="r2")
    report = check(history([zombie, successor], [published(1, successor, 19)]))
    assert report.violations == {} and report.zombie_overlaps == 1


def test_two_accepted_publishes_of_overlapping_bodies_of_one_key_are_a_violation() -> None:
    a, b = body(1, 2, 10, "accepted", token=1), body(2, 5, 12, "accepted", token=2, run="r2")
    report = check(history([a, b], [published(1, a, 9), published(2, b, 11)]))
    assert set(report.violations) == {"overlap"}


def test_a_slot_published_twice_and_tokens_going_back_are_violations() -> None:
    a, b = body(1, 2, 4, "accepted", token=5), body(2, 6, 8, "accepted", token=3)
    report = check(history([a, b], [published(1, a, 3), published(2, b, 7)]))
    assert set(report.violations) == {"slot-twice", "token-order"}


def test_a_task_failed_for_no_documented_reason_or_skipped_without_one_is_a_violation() -> None:
    a = body(1, 2, 4, "accepted")
    tis = [ti("success"), ti("failed", task="u", log_tail="ValueError: boom"), ti("skipped", task="v", skip_reason=None),
           ti("failed", task="w", log_tail="airflow_lease_provider.core.errors.LeaseLost: lease 'k' lost"),
           ti("running", task="x")]
    report = check(history([a], [published(1, a, 3)], tis))
    texts = report.violations["undocumented-state"]
    assert len(texts) == 3 and any("/u" in t for t in texts) and any("/v" in t for t in texts)
    assert any("still running" in t for t in texts)
    assert report.states["failed:LeaseLost"] == 1


def test_no_publish_after_the_faults_within_the_bound_is_a_violation() -> None:
    late = body(1, 40, 50, "accepted")
    report = check(history([late], [published(1, late, 59)]))
    assert set(report.violations) == {"no-recovery"}
    soon = body(1, 5, 12, "accepted")
    assert check(history([soon], [published(1, soon, 11)])).violations == {}
