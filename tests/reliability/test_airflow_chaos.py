"""The Airflow-level fault run in CI: ``python -m chaos --airflow`` passes, its broken variant fails.

Each run is the command a person runs, in a subprocess: a real api-server, scheduler and dag-processor
on a metadata database of its own (copied from one template migrated here, shared by the two runs), a
store database of its own behind a TCP proxy, the chaos DAGs (``chaos/airflow/dags/chaos_af.py``).

- The correct run is the CI profile on the CeleryExecutor (two Celery workers, Redis broker; without Redis
  it is not started and its test skips, tests/tools.py): a nemesis
  freezes, resumes and kills task processes, supervisors and whole Celery workers, restarts the
  scheduler, terminates the store's sessions and cuts the store off, each kind at least once. (The
  LocalExecutor's fault run is the documented long one, docs/reliability.md; one deployment here is
  what fits the suite's budget.)
- The broken run (no lease, no fence) is on the LocalExecutor: it needs no faults and is short.

The two go side by side.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.airflow.profiles import PROCESS_FAULTS
from demo.deployment import MetadataTemplate
from tests.tools import missing

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.airflow, pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(420)]



def start(out: Path, dsn: str, template: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "chaos", "--airflow", "--dsn", dsn, "--template", template, *args, "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def finish(proc: subprocess.Popen[str], out: Path, timeout: float) -> tuple[int, dict[str, Any], str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the run stops its deployment and drops its databases on SIGTERM
        output, _ = proc.communicate(timeout=90)
        pytest.fail(f"python -m chaos --airflow did not finish within {timeout:.0f}s:\n{output[-6000:]}")
    report_path = out / "report.json"
    assert report_path.exists(), f"no report (exit {proc.returncode}):\n{output[-6000:]}"
    return proc.returncode, json.loads(report_path.read_text()), output


@pytest.fixture(scope="module")
def runs(
    pg_dsn: str, metadata_template: MetadataTemplate, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[int, dict[str, Any], str]]]:
    template = metadata_template
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        outs = {"correct": tmp_path_factory.mktemp("af-correct"), "lease-off": tmp_path_factory.mktemp("af-lease-off")}
        if missing("redis") is None:
            procs["correct"] = start(outs["correct"], pg_dsn, template.name, "--profile", "ci", "--seed", "4",
                                     "--executor", "celery")
        procs["lease-off"] = start(outs["lease-off"], pg_dsn, template.name, "--profile", "smoke",
                                   "--variant", "lease-off", "--seed", "4")
        yield {name: finish(proc, outs[name], timeout=330) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=90)


@pytest.mark.needs("redis")
def test_the_ci_profile_has_zero_violations_under_every_kind_of_fault(runs: dict[str, Any]) -> None:
    code, report, output = runs["correct"]
    assert code == 0, output[-6000:]
    assert report["executor"] == "celery", output[-6000:]
    assert report["violations"] == {}, output[-6000:]
    # The run did work (about 16 bodies, 13 accepted in the ~50 s of calm and faults of the CI profile).
    assert report["operations"]["bodies"] >= 12 and report["operations"]["publishes_accepted"] >= 9, output[-6000:]
    faults = report["faults"]
    for kind in ("scheduler-restart", "terminate", "store-down"):
        assert faults.get(kind, 0) >= 1, f"no {kind} fault:\n{output[-6000:]}"
    assert sum(faults.get(kind, 0) for kind in PROCESS_FAULTS) >= 3, output[-6000:]
    assert faults.get("sigstop-task", 0) + faults.get("sigstop-worker", 0) >= 1, output[-6000:]
    # A whole Celery worker was frozen, and one killed (and started again), with the tasks it ran.
    assert faults.get("sigstop-worker", 0) >= 1 and faults.get("kill-worker", 0) >= 1, output[-6000:]
    # The shared key made one task of each pair skip, with the lease's reason (checked per instance).
    assert report["states"].get("skipped:held", 0) >= 3, output[-6000:]
    # Every DAG published again after the faults, within TTL + its interval (+ work and start-up).
    assert set(report["recovery"]) == {"chaos_pair", "chaos_mapped", "chaos_catchup"}, output[-6000:]
    assert all(v is not None and v <= report["recovery_bound"] for v in report["recovery"].values()), output[-6000:]
    assert "violations: none" in output


def test_the_checker_catches_tasks_that_run_without_the_lease_and_the_fence(runs: dict[str, Any]) -> None:
    code, report, output = runs["lease-off"]
    assert code == 1, output[-6000:]
    # The pair's two tasks share a key: without the lease both run at once and both publish the slot.
    assert report["violations"].get("overlap", 0) >= 1, output[-6000:]
    assert report["violations"].get("slot-twice", 0) >= 1, output[-6000:]
    assert "VIOLATIONS:" in output
