"""The Airflow-level fault run's checker on small hand-made histories: each claim can fail."""

from __future__ import annotations

import random
from typing import Any

from chaos.airflow.check import check
from chaos.airflow.profiles import PROFILES
from chaos.airflow.run import AirflowChaos


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


def test_a_killed_celery_worker_gives_airflow_its_requeue_time_before_a_missing_publish_counts() -> None:
    """A task the killed worker had received but not started stays queued until Airflow's
    ``task_queued_timeout`` requeues it (``queued_reset``): a run held behind it publishes that much later."""
    late = body(1, 40, 57, "accepted")
    run = history([late], [published(1, late, 56)])
    run["profile"]["queued_reset"] = 45
    assert set(check(run).violations) == {"no-recovery"}  # 55 s after the faults: past 37 s
    run["faults"] = [{"kind": "kill-worker", "at": at(0.5), "ended": at(1), "worker": "a",
                      "ti": {"run_id": "r0", "task_id": "t", "map_index": -1}, "tis": []}]
    assert check(run).violations == {}
    run["target"] = []
    assert set(check(run).violations) == {"no-recovery"}  # still a violation when nothing publishes


def test_a_whole_celery_worker_fault_explains_every_task_it_ran_and_only_those() -> None:
    bodies = [body(1, 2, None, None, task="a"), body(2, 2, None, None, task="b"), body(3, 2, None, None, task="c")]
    tis = [ti("failed", task="a"), ti("failed", task="b"), ti("failed", task="c")]
    killed = {"kind": "kill-worker", "at": at(3), "worker": "a",
              "ti": {"run_id": "r1", "task_id": "a", "map_index": -1},
              "tis": [{"run_id": "r1", "task_id": "a", "map_index": -1}, {"run_id": "r1", "task_id": "b", "map_index": -1}]}
    report = check(history(bodies, [], tis, [killed]))
    assert report.states["failed:kill-worker"] == 2
    # c ran on the other worker: its failure is not explained by the fault
    assert [v.partition(":")[0] for v in report.violations["undocumented-state"]
            if "failed with no documented reason" in v] == ["chaos_pair/r1/c failed with no documented reason"]


def test_a_worker_fault_explains_a_task_process_in_it_that_had_not_started_its_body_and_says_why_others_failed() -> None:
    """Killing a whole worker kills every task process in its tree: one still acquiring has no body to find
    it by, only the try's pid that Airflow recorded. Another failure nobody explains is reported with what
    the history holds about it (its tries, Airflow's audit events, the log's last lines)."""
    killed = {"kind": "kill-worker", "at": at(3), "worker": "a", "pids": [500, 501, 502],
              "ti": {"run_id": "r1", "task_id": "a", "map_index": -1},
              "tis": [{"run_id": "r1", "task_id": "a", "map_index": -1}]}
    tis = [ti("failed", task="a"),
           ti("failed", task="pre", tries=[{"try_number": 1, "state": "failed", "pid": 502, "start_date": at(2)}]),
           # the same pid again, in a process started after the fault: not hit by it
           ti("failed", task="later", tries=[{"try_number": 1, "state": "failed", "pid": 501, "start_date": at(5)}]),
           ti("failed", task="other", tries=[{"try_number": 1, "state": "failed", "pid": 900}],
              events=[{"event": "heartbeat timeout", "try_number": 1, "extra": "Task did not emit heartbeat"}],
              log_tail="starting\nKeyError: 'lease'\n")]
    report = check(history([body(1, 2, None, None, task="a")], [], tis, [killed]))
    assert report.states["failed:kill-worker"] == 2
    later, text = report.violations["undocumented-state"]
    assert later.startswith("chaos_pair/r1/later failed with no documented reason")
    assert text.startswith("chaos_pair/r1/other failed with no documented reason: tries [try 1 failed pid 900]")
    assert "heartbeat timeout (try 1) Task did not emit heartbeat" in text and "KeyError" in text


def test_a_body_that_failed_explains_its_task_only_with_a_documented_error() -> None:
    """Told to stop by Airflow (``TaskTerminated``) is documented; any other error from the body is not."""
    bodies = [body(1, 2, 3, "error:TaskTerminated", task="a"), body(2, 2, 3, "error:ValueError", task="b"),
              body(3, 2, 3, "refused:stale", task="c")]
    tis = [ti("failed", task="a"), ti("failed", task="b"), ti("failed", task="c"),
           ti("failed", task="d", log_tail="airflow_lease_provider.interrupt.TaskTerminated: the task process received SIGTERM")]
    report = check(history(bodies, [], tis))
    [text] = report.violations["undocumented-state"]
    assert text.startswith("chaos_pair/r1/b failed with no documented reason") and "(1, 'error:ValueError')" in text
    assert report.states["failed:error:TaskTerminated"] == 1 and report.states["failed:refused:stale"] == 1
    assert report.states["failed:TaskTerminated"] == 1


def test_the_ci_plan_has_every_kind_once_the_scheduler_restart_first_and_its_order_from_the_seed() -> None:
    def plan(seed: int, executor: str) -> list[str]:
        chaos = AirflowChaos.__new__(AirflowChaos)  # no deployment: only the plan
        chaos.profile = PROFILES["ci"].for_executor(executor)
        chaos.random = random.Random(seed)
        return chaos.plan()

    celery, local = plan(4, "celery"), plan(4, "local")
    assert celery[0] == "scheduler-restart" and sorted(celery) == sorted(PROFILES["ci"].schedule)
    assert "kill-worker" in celery and "kill-worker" not in local and local[0] == "scheduler-restart"
    assert plan(4, "celery") == celery and any(plan(seed, "celery") != celery for seed in range(5, 15))
    assert not [k for k, _ in PROFILES["long"].for_executor("local").weights if k == "kill-worker"]
