"""The warm Airflow the ``airflow_home`` tier runs its commands in (tests/airflow/warm.py): each command is a
process of its own with the caller's environment, exit status and output, and one that runs past its
time is ended with what it started."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.airflow.harness import DAGS, base_env
from tests.airflow.warm import WarmServer

pytestmark = pytest.mark.airflow


@pytest.fixture
def warm(warm_airflow: WarmServer | None) -> WarmServer:
    if warm_airflow is None:
        pytest.skip("LEASE_TEST_WARM_AIRFLOW=0: no warm server in this run")
    return warm_airflow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_command_runs_in_a_process_of_its_own_with_the_callers_environment(
    warm: WarmServer, airflow_template: Path, tmp_path: Path
) -> None:
    env = {**base_env(tmp_path, DAGS), "AIRFLOW__CORE__DEFAULT_TIMEZONE": "Asia/Kathmandu",
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_template / 'airflow.db'}"}
    result = warm.cli(env, ["config", "get-value", "core", "default_timezone"], tmp_path / "get", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "Asia/Kathmandu"
    # Another caller's setting is not left behind: each child starts from the server, not from the last one.
    result = warm.cli({**env, "AIRFLOW__CORE__DEFAULT_TIMEZONE": "utc"}, ["config", "get-value", "core",
                      "default_timezone"], tmp_path / "again", timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "utc"
    # A command that fails gives its exit status and its error, as the console script would.
    failed = warm.cli(env, ["dags", "test", "no_such_dag"], tmp_path / "failed", timeout=120)
    assert failed.returncode != 0
    assert "no_such_dag" in failed.stdout + failed.stderr


def test_a_command_past_its_time_is_ended_with_its_process_group(warm: WarmServer, tmp_path: Path) -> None:
    seen: list[int] = []
    never = tmp_path / "never"  # a gate of tests/airflow/cli_batch.py that never opens
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run(base_env(tmp_path, DAGS), [{"wait_for": str(never)}, ["version"]], tmp_path / "out",
                 tmp_path / "err", timeout=3, on_pid=seen.append)
    assert time.monotonic() - started < 30
    (pid,) = seen
    end = time.monotonic() + 10
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.1)
    assert not alive(pid), f"the timed-out child {pid} still runs"
