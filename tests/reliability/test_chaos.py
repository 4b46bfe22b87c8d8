"""The fault-injection harness in CI: the short profile passes (four of its workers through the lease API,
waiting places taken by all), the broken variants fail.

Each run is ``python -m chaos`` in a subprocess, exactly the command a person runs, on a private
embedded PostgreSQL that the harness starts and kills itself (never ``LEASE_TEST_DSN``'s server).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.checker import FAULT_KINDS, check_records

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.needs("faketime")]  # the skewed-clock workers


def start(out: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "chaos", *args, "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def finish(proc: subprocess.Popen[str], out: Path, timeout: float) -> tuple[int, dict[str, Any], str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the harness cleans up its workers and server on SIGTERM
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"python -m chaos did not finish within {timeout:.0f}s:\n{output[-6000:]}")
    report_path = out / "report.json"
    assert report_path.exists(), f"no report (exit {proc.returncode}):\n{output[-6000:]}"
    return proc.returncode, json.loads(report_path.read_text()), output


def test_short_profile_zero_violations_over_5000_operations_and_every_fault(tmp_path: Path) -> None:
    code, report, output = finish(start(tmp_path, "--profile", "short", "--seed", "6"), tmp_path, timeout=200)
    assert code == 0, output[-6000:]
    assert report["violations"] == {}, output[-6000:]
    assert report["operations"] >= 5000, output[-6000:]
    for kind in FAULT_KINDS:
        assert report["faults"].get(kind, 0) >= 1, f"no {kind} fault:\n{output[-6000:]}"
    assert report["faults"]["sigstop"] >= 3 and report["faults"]["terminate"] >= 5
    assert report["outcomes"].get("publish:stale", 0) >= 1, "the fence never had to refuse anybody"
    # The case that hid the keeper defect: keepers started late, and leases joined with little time left.
    assert report["outcomes"].get("check:held", 0) >= 10 and report["outcomes"].get("join:ok", 0) >= 5, output[-6000:]
    assert report["outcomes"].get("lost:reported", 0) >= 1, output[-6000:]
    # Semaphore keys (issue 38): N slots with the count changing, single holders and replaces on the same
    # keys, acquires refused for another count, force-releases; none of the exclusion properties broken.
    grants = report["figures"]["semaphore keys: committed grants"]
    assert {"slots=2", "slots=3", "one holder", "replace"} <= set(grants), output[-6000:]
    assert report["figures"]["semaphore keys: slot-count changes"] >= 3, output[-6000:]
    assert report["outcomes"].get("acquire:mismatch", 0) >= 1 and report["outcomes"].get("replace:ok", 0) >= 1
    assert report["faults"]["force_release"] >= 3, output[-6000:]
    # HTTP workers (issue 41): through the lease API on a real uvicorn, on the same keys, with its server
    # paused, killed and restarted, and replies lost after the store committed; the acquires whose answer was
    # lost sent again with their request id, and publishes through /fence read from the fence's audit.
    assert report["figures"]["operations through the lease API"] >= 100, output[-6000:]
    assert report["figures"]["publishes through the lease API (committed fence advances)"] >= 5, output[-6000:]
    assert report["faults"]["lost_reply"] >= 1 and report["faults"]["api_kill"] >= 1, output[-6000:]
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").open()]
    http_ops = [r for r in history if r.get("type") == "op" and r.get("http")]
    assert any(r["op"] == "acquire" and r.get("outcome") == "ok" for r in http_ops), output[-6000:]
    assert any(r["op"] == "renew" and r.get("outcome") == "ok" for r in http_ops), output[-6000:]
    assert any(r.get("resent") for r in http_ops), "no acquire was sent again after a lost answer"
    # Waiting places (chaos.waiting), directly and through the lease API under its faults: taken, kept, given
    # back, refused for a full key, left to lapse, given back with a forged capability (refused), claims
    # whose answer never came (judged without being counted as taken), and the waiters listed at the end.
    outcomes, figures = report["outcomes"], report["figures"]
    assert outcomes.get("wait_claim:claimed", 0) >= 50 and outcomes.get("wait_claim:full", 0) >= 5, output[-6000:]
    assert outcomes.get("wait_release:ok", 0) >= 5, output[-6000:]
    assert figures["waiting places: lapsed (left by their waiter, not given back)"] >= 5, output[-6000:]
    assert figures["waiting places: claims through the lease API"] >= 10, output[-6000:]
    assert figures["waiting places: outcomes"].get("wait_release:refused:forged", 0) >= 1, output[-6000:]
    assert figures["waiting places: operations through the lease API with an unknown outcome"] >= 1, output[-6000:]
    assert figures["waiting places: listed by the final probe"] is not None, output[-6000:]
    # The history holds database timestamps for every answered operation.
    first_op = next(
        json.loads(line) for line in (tmp_path / "history.jsonl").open()
        if '"op": "acquire"' in line and '"outcome": "ok"' in line
    )
    assert first_op["acquired_at"] and first_op["expires_at"] and first_op["observed_at"]


#: Each broken variant and its profile.
BROKEN = {"fence-off": "smoke", "client-clock": "smoke", "keeper-from-construction": "smoke-keeper",
          "fence-cross-key": "smoke", "replace-ignores-slots": "smoke-slots", "wait-ignores-max": "smoke-wait"}


@pytest.fixture(scope="module")
def broken_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[int, dict[str, Any], str]]]:
    """Every broken variant on a smoke profile (20 s of faults each), all at once: they wait on their fault
    schedules, not on the CPU (two after two took twice the time for the same runs)."""
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        outs = {variant: tmp_path_factory.mktemp(variant) for variant in BROKEN}
        procs = {v: start(out, "--profile", BROKEN[v], "--variant", v, "--seed", "7") for v, out in outs.items()}
        yield {v: finish(proc, outs[v], timeout=180) for v, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)


def test_checker_catches_the_store_with_its_fence_disabled(broken_runs: dict[str, Any]) -> None:
    code, report, output = broken_runs["fence-off"]
    assert code == 1, output[-4000:]
    # Zombies and late workers published over newer work: the target saw tokens go back.
    assert report["violations"].get("fence-order", 0) >= 1, output[-4000:]
    assert "RESULT: VIOLATIONS" in output


def test_checker_catches_expiry_judged_by_the_client_clock(broken_runs: dict[str, Any]) -> None:
    code, report, output = broken_runs["client-clock"]
    assert code == 1, output[-4000:]
    # Workers 10 minutes ahead took leases that were still valid by the database clock: both the
    # workers' own view and the committed rows show two owners at once.
    assert report["violations"].get("overlap", 0) >= 1, output[-4000:]
    assert report["violations"].get("overlap-db", 0) >= 1, output[-4000:]


def test_checker_catches_a_keeper_that_counts_from_its_own_construction(broken_runs: dict[str, Any]) -> None:
    code, report, output = broken_runs["keeper-from-construction"]
    assert code == 1, output[-4000:]
    # Workers that started their keeper after a pause longer than the TTL were told the lease was
    # still theirs, although by the database clock it had already expired (issue 10, item 2).
    assert report["violations"].get("stale-check", 0) >= 1, output[-4000:]
    assert "keeper started delayed" in output
    assert "RESULT: VIOLATIONS" in output


def test_checker_catches_a_fence_that_compares_tokens_of_different_keys(broken_runs: dict[str, Any]) -> None:
    code, report, output = broken_runs["fence-cross-key"]
    assert code == 1, output[-4000:]
    # Two lease keys publish to each resource: a holder whose key's count is behind was refused.
    assert report["violations"].get("valid-refused", 0) >= 1, output[-4000:]
    assert "RESULT: VIOLATIONS" in output


def test_checker_catches_a_replace_that_ignores_the_slots_of_its_key(broken_runs: dict[str, Any]) -> None:
    code, report, output = broken_runs["replace-ignores-slots"]
    assert code == 1, output[-4000:]
    # A replace took the key's own row while another slot of it was held (issue 38, defect 1): one holder
    # who believes it is alone, beside a semaphore's holder, in what the workers were told and in the rows.
    assert report["violations"].get("exclusion", 0) >= 1, output[-4000:]
    assert report["violations"].get("exclusion-db", 0) >= 1, output[-4000:]
    assert "a single holder beside another holder" in output
    assert "RESULT: VIOLATIONS" in output


def test_checker_catches_a_claim_that_ignores_max_waiting(broken_runs: dict[str, Any]) -> None:
    code, report, output = broken_runs["wait-ignores-max"]
    assert code == 1, output[-4000:]
    # Every claim got a waiting place whatever the key's max_waiting: more live places than the limit, in the
    # claims' answers, in the places' proven lifetimes, and in the final listing.
    assert report["violations"].get("wait-over-max", 0) >= 1, output[-4000:]
    assert "RESULT: VIOLATIONS" in output
    # The places' lifetimes alone show it too: the same history with every answer's listing of waiters removed.
    path = Path(re.search(r"history=(\S+)", output).group(1))  # type: ignore[union-attr]
    records = [json.loads(line) for line in path.open()]
    for record in records:
        record.pop("waiters", None)
    unlisted = check_records(records)
    assert any(v.kind == "wait-over-max" and "proven live" in v.detail for v in unlisted.violations), unlisted.format()
