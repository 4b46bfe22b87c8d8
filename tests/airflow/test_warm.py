"""The warm Airflow the ``airflow_home`` tier runs its commands in (tests/airflow/warm.py): each command is a
process of its own with the caller's environment, exit status and output, and one that runs past its
time is ended with what it started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.airflow.harness import DAGS, VENV_BIN, base_env
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


def test_a_secret_a_command_writes_is_read_by_the_homes_other_processes(
    warm: WarmServer, airflow_template: Path, tmp_path: Path
) -> None:
    """A command runs with its home's configuration (its airflow.cfg, written there if missing), as the
    console script does: a connection's password and extra, encrypted with that home's Fernet key, are
    read by a process started there later (the UI tier's api-server). A child that kept the server's
    configuration encrypted them with another key, and Airflow reported the connection missing."""
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(airflow_template / "airflow.db", home / "airflow.db")
    env = {**base_env(home, DAGS), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}"}
    uri = "postgresql://someone:pw-in-the-store@/leases?host=%2Ftmp%2Fsome-socket-dir"
    added = warm.cli(env, ["connections", "add", "lease_default", "--conn-uri", uri], tmp_path / "add", timeout=120)
    assert added.returncode == 0, added.stdout[-3000:] + added.stderr[-3000:]

    def read(result: subprocess.CompletedProcess) -> dict:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        (conn,) = json.loads(result.stdout[result.stdout.index("["):])
        return conn

    cold = subprocess.run([str(VENV_BIN / "airflow"), "connections", "get", "lease_default", "-o", "json"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    warm_again = warm.cli(env, ["connections", "get", "lease_default", "-o", "json"], tmp_path / "get",
                          timeout=120)
    for conn in (read(cold), read(warm_again)):
        assert conn["password"] == "pw-in-the-store"
        assert conn["extra_dejson"] == {"host": "/tmp/some-socket-dir"}
    assert (home / "airflow.cfg").exists(), "the command did not write its home's configuration"
