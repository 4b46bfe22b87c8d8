"""A warm Airflow for the tiers that run ``airflow`` CLI commands (``airflow dags test`` above all): one
server process per test run that has imported Airflow once, and forks a child for each batch of commands
a test runs. The xdist workers share it (tests/conftest.py, ``warm_airflow``).

Most of an ``airflow dags test`` process's CPU is Airflow starting, not the run: importing it (~2,300
modules), building the CLI parser and, on a run's first request, the in-process execution API (its
routes and models). Measured on this machine: a one-task ``airflow dags test`` is ~11 CPU s as a process
of its own, ~5-6 as a child here. The server does the start once; each child starts from it, already
imported, and runs the commands as the ``airflow`` console script would (:mod:`tests.airflow.cli_batch`),
in a process of its own (its own pid, process group, environment, stdout and stderr, exit status).

A child installs the request's environment before it runs anything: Airflow reads ``AIRFLOW__*`` options
and ``AIRFLOW_CONN_*`` connections when they are used; what it read at import is read again for the
request: the configuration of the request's ``AIRFLOW_HOME`` (its ``airflow.cfg``, written there by the
first command as the console script does: :func:`_use_home`) and the values ``settings`` copies (the
metadata database's URL, the DAGs folder), with a new ORM engine. The logging set up at import stays the
server's. Each test's home names its own metadata database
(``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``), so tests share nothing but the server. The server imports no
provider and sends no metric, so the lease provider's settings, its store and the statsd client are made
in the child from the test's environment.

The server forks a reporter per connection, which forks the child and waits for it, so the children of
several test processes run side by side. It stops when the test run that started it is gone.

Protocol, one request per connection on a Unix socket: the client sends one JSON line ``{"env": {...},
"items": [...], "out": PATH, "err": PATH}`` (``items`` as :mod:`tests.airflow.cli_batch` takes them);
the server answers ``{"pid": N}`` when the child has started and ``{"status": S, "cpu": C}`` when it has
ended (S as a shell gives it: the exit status, or 128 + the signal that ended it; C the CPU seconds of the
child and of what it reaped, which the test process counts as its own: tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).parents[2]


def _preload() -> None:
    """What every ``airflow dags test`` imports before its first task runs, none of it reading a test's
    setting: the CLI, the DAG command, the task runner and supervisor, the in-process execution API."""
    import airflow.cli.commands.dag_command  # noqa: F401
    import airflow.dag_processing.dagbag  # noqa: F401
    import airflow.sdk.execution_time.supervisor  # noqa: F401
    import airflow.sdk.execution_time.task_runner  # noqa: F401
    from airflow import settings
    from airflow.api_fastapi.execution_api.app import InProcessExecutionAPI
    from airflow.cli import cli_parser

    cli_parser.get_parser()
    _ = InProcessExecutionAPI().app  # the first build of the app is most of its cost; a child's builds reuse it
    settings.dispose_orm()  # no connection to the metadata database crosses a fork


def _use_home(home: str) -> None:
    """Take ``home``'s configuration, as an ``airflow`` process started there does: the defaults expanded
    for it (its log folder), its ``airflow.cfg`` when it has one, and where the first command writes one
    when it has not (``write_default_airflow_configuration_if_needed``, with a new Fernet key).

    The server read its own home's configuration when it imported Airflow. A child that kept it encrypted
    a connection's password and extra with a key no other process of the test's home had: the UI tier's
    api-server, started in that home, could not decrypt the ``lease_default`` its warm ``connections add``
    wrote, and Airflow reports a connection it cannot decrypt as not defined (it fell back to an empty
    embedded store and answered 503). A URI without password or extra encrypts nothing, which is why the
    machine's PostgreSQL (``postgresql://postgres@127.0.0.1:5432/test``) hid it and the embedded
    server's (a socket directory in the extra) did not.
    """
    from airflow import configuration, settings
    from airflow.models import crypto

    configuration.AIRFLOW_HOME = settings.AIRFLOW_HOME = home
    configuration.AIRFLOW_CONFIG = configuration.get_airflow_config(home)
    conf = configuration.conf
    # In place, as Airflow's own __setstate__ does: every module holds this object, not the name.
    conf.__init__()  # type: ignore[misc]
    configuration.load_standard_airflow_configuration(conf)
    conf.validate()
    crypto.get_fernet.cache_clear()  # built from the server's key if anything asked for it there


def _child(request: dict) -> None:
    """In the forked child: become the request's process and run its commands; never returns."""
    status = 1
    try:
        os.setpgid(0, 0)  # a group of its own: the client ends it and whatever it started together
        targets = {path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                   for path in (request["out"], request["err"])}  # one file for both if they are one path
        os.dup2(targets[request["out"]], 1)
        os.dup2(targets[request["err"]], 2)
        for target in targets.values():
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        _use_home(os.environ["AIRFLOW_HOME"])
        from airflow import settings

        settings.configure_vars()  # the metadata database's URL and the DAGs folder, from this environment
        settings.configure_orm()
        from tests.airflow import cli_batch

        cli_batch.main(request["items"])
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: S110 - nothing left to report it to
                pass
        os._exit(status)


def _status(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _answer(conn: socket.socket) -> None:
    """In a forked reporter: read the request, fork its child, say its pid, wait for it, say how it ended."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it; this process waits for its child
    with conn, conn.makefile("rwb") as stream:
        line = stream.readline()
        if not line:
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(request)
        try:
            stream.write(json.dumps({"pid": pid}).encode() + b"\n")
            stream.flush()
        except OSError:
            pass  # the client is gone; the child still runs to its end and is reaped below
        _, wait_status, usage = os.wait4(pid, 0)
        cpu = usage.ru_utime + usage.ru_stime  # its own and that of what it started and reaped
        try:
            stream.write(json.dumps({"status": _status(wait_status), "cpu": cpu}).encode() + b"\n")
            stream.flush()
        except OSError:
            pass  # the client is gone (it timed out and ended the child)


def serve(path: str, owner: int) -> None:
    """Answer requests on the Unix socket ``path`` until the process ``owner`` (the test run) is gone."""
    _preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the reporters are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(16)
    server.settimeout(5.0)
    os.rename(path + ".tmp", path)  # the socket appears once the server answers on it
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                return  # the test run ended without stopping this server
            continue
        conn.setblocking(True)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            server.close()
            try:
                _answer(conn)
            finally:
                os._exit(0)
        conn.close()


# -- the client (the test process) ------------------------------------------------------------------------

#: CPU seconds of the children this test process had the server run: tests/conftest.py counts them as the
#: test's own (a child is the server's, not this process's, so ``RUSAGE_CHILDREN`` misses it).
CHILD_CPU = [0.0]
START_TIMEOUT = 180.0


class WarmServer:
    """A running server: start one with :meth:`start`, or reach one another process started (:meth:`at`)."""

    def __init__(self, socket_path: Path, pid: int) -> None:
        self.socket_path, self.pid = socket_path, pid

    @classmethod
    def start(cls, root: Path, env: dict[str, str]) -> WarmServer:
        """Start a server in ``root`` with ``env`` (its AIRFLOW_HOME is every child's) and wait until it
        answers; it stops with :meth:`stop`, or by itself once this run's controller is gone."""
        path = root / "warm.sock"
        owner = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
        with open(root / "warm-server.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.airflow.warm", str(path), str(owner)],
                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        end = time.monotonic() + START_TIMEOUT
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > end:
                proc.kill()
                raise AssertionError(
                    f"the warm Airflow server did not start:\n{(root / 'warm-server.log').read_text()[-4000:]}"
                )
            time.sleep(0.1)
        return cls(path, proc.pid)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def run(self, env: dict[str, str], items: list, out: Path, err: Path, timeout: float,
            on_pid: Callable[[int], None] | None = None) -> int:
        """Run ``items`` (:mod:`tests.airflow.cli_batch`'s) in a child with ``env``, its stdout and stderr
        in ``out`` and ``err``; its exit status. Past ``timeout`` the child's process group is killed and
        :class:`subprocess.TimeoutExpired` raised, as :func:`subprocess.run` does."""
        request = {"env": env, "items": items, "out": str(out), "err": str(err)}
        end = time.monotonic() + timeout
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.socket_path))
            stream = conn.makefile("rwb")
            stream.write(json.dumps(request).encode() + b"\n")
            stream.flush()
            pid: int | None = None
            try:
                conn.settimeout(30.0)
                pid = json.loads(stream.readline())["pid"]
                if on_pid is not None:
                    on_pid(pid)
                conn.settimeout(max(0.1, end - time.monotonic()))
                answer = json.loads(stream.readline())
            except TimeoutError as exc:
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(["airflow", *map(str, items)], timeout) from exc
            except (ValueError, KeyError) as exc:  # no answer: the server or its reporter died
                raise AssertionError(f"the warm Airflow server gave no answer for {items}") from exc
        CHILD_CPU[0] += answer["cpu"]
        return int(answer["status"])

    def cli(self, env: dict[str, str], args: list[str], stem: Path, timeout: float) -> subprocess.CompletedProcess:
        """``airflow ARGS`` in a child with ``env``, as :func:`subprocess.run` with ``capture_output`` gives
        it (its output kept in ``stem``.out and ``stem``.err)."""
        from tests.airflow.cli_batch import parts

        out, err = stem.with_name(stem.name + ".out"), stem.with_name(stem.name + ".err")
        status = self.run(env, [args], out, err, timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        found_out, found_err = parts(stdout), parts(stderr)
        if 0 in found_out and 0 in found_err:
            return subprocess.CompletedProcess(["airflow", *args], found_out[0][0], found_out[0][1], found_err[0][1])
        return subprocess.CompletedProcess(["airflow", *args], status or 1, stdout, stderr)  # it died mid-command


class WarmRun:
    """:meth:`WarmServer.run` in the background, with what the tests use of a :class:`subprocess.Popen`
    (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``)."""

    def __init__(self, server: WarmServer, env: dict[str, str], items: list, out: Path, err: Path,
                 timeout: float = 1800.0) -> None:
        self.args = ["airflow", *map(str, items)]
        self.pid: int | None = None
        self.returncode: int | None = None
        self._error: BaseException | None = None
        self._started = threading.Event()

        def run() -> None:
            try:
                self.returncode = server.run(env, items, out, err, timeout, on_pid=self._on_pid)
            except BaseException as exc:  # noqa: BLE001 - given to whoever waits
                self._error, self.returncode = exc, -1
            finally:
                self._started.set()

        self._thread = threading.Thread(target=run, name=f"warm-run-{items}", daemon=True)
        self._thread.start()
        self._started.wait(60.0)  # the child runs (or the request failed) before this returns

    def _on_pid(self, pid: int) -> None:
        self.pid = pid
        self._started.set()

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        if self._error is not None:
            raise self._error
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.pid is not None and self._thread.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
