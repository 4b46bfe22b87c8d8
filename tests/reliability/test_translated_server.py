"""A server whose messages are not in English: nothing of the store may depend on a message's words.

initdb takes ``lc_messages`` from the machine's locale, so a server set up on a German machine answers in
German. Found by an attacker's review: the prepared-statement path told a stale plan ("cached plan must not
change result type") by its English text, so on such a server every acquire failed after a migration. Here a
private PostgreSQL (Debian's binaries, with their German messages; ``LEASE_PG_BIN`` names others) runs with ``lc_messages = 'de_DE.UTF-8'``,
the locale generated for it alone (``localedef`` into a directory passed as ``LOCPATH``; the machine's locales
are not touched).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from demo.deployment import free_port
from tests.core.test_prepared import stale_plan_after_a_migration
from tests.pg import new_schema_name
from tests.reliability.pgbouncer import _unprivileged
from tests.tools import machine_pg_bin

GERMAN = "de_DE.UTF-8"
LOCALEDEF = shutil.which("localedef")
#: The embedded PostgreSQL's programs carry no translations: the machine's (Debian's) do.
PG_BIN = Path(os.environ["LEASE_PG_BIN"]) if os.environ.get("LEASE_PG_BIN") else machine_pg_bin() or Path("/nonexistent")

pytestmark = pytest.mark.needs("german-postgres")


@pytest.fixture(scope="module")
def german_dsn() -> Iterator[str]:
    user = os.environ.get("USER", "") if os.geteuid() != 0 else _unprivileged()
    root = Path(tempfile.mkdtemp(prefix="lease-de-", dir="/tmp"))
    root.chmod(0o755)
    locpath = root / "locale"
    locpath.mkdir()
    made = subprocess.run([str(LOCALEDEF), "-i", "de_DE", "-f", "UTF-8", str(locpath / GERMAN)],
                          capture_output=True, text=True, timeout=120, check=False)
    # localedef exits 1 for warnings it still wrote the locale through; what counts is the locale.
    assert (locpath / GERMAN / "LC_MESSAGES").exists(), made.stdout + made.stderr
    for path in [locpath, *locpath.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    if os.geteuid() == 0:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    data, port = root / "data", free_port()
    kwargs: dict[str, Any] = {"user": user} if os.geteuid() == 0 else {}
    env = dict(os.environ, LOCPATH=str(locpath))

    def pg(tool: str, *args: str) -> None:
        subprocess.run([str(PG_BIN / tool), *args], check=True, capture_output=True, timeout=120, cwd=root,
                       env=env, **kwargs)

    pg("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-N", "-E", "UTF8", "--locale=C")
    with (data / "postgresql.auto.conf").open("a", encoding="utf-8") as conf:
        conf.write(f"port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{root}'\n"
                   f"lc_messages = '{GERMAN}'\nfsync = off\nmax_connections = 20\nshared_buffers = '16MB'\n")
    pg("pg_ctl", "-D", str(data), "-l", str(root / "server.log"), "-w", "start")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def test_the_server_answers_in_german(german_dsn: str) -> None:
    """Otherwise the next test would pass for the wrong reason."""
    conn = psycopg2.connect(german_dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur, pytest.raises(psycopg2.errors.DivisionByZero) as raised:
            cur.execute("SELECT 1 / 0")
    finally:
        conn.close()
    assert "Division durch Null" in str(raised.value), str(raised.value)


def test_a_stale_plan_after_a_migration_is_recovered_on_a_german_server(
    german_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    stale_plan_after_a_migration(german_dsn, new_schema_name(), caplog)
