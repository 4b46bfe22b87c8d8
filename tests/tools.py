"""The system tools a few tests need, each from a Debian package that ``.ci/run`` installs.

A test says what it needs with a mark, ``@pytest.mark.needs("pgbouncer")`` (or a module's ``pytestmark``);
tests/conftest.py looks before the test's setup. When the tool is absent the test is skipped with a reason
naming the package to install, so ``scripts/test`` on a machine with nothing but Python is green; under
``CI=true`` (``.ci/run`` installs every one of them first) the absence is a failure instead, so CI never
passes by skipping. A fixture that needs one calls :func:`require` itself.

``LEASE_TEST_WITHOUT=pgbouncer,redis`` makes tools absent for a run: a laptop's view of the suite on a
machine that has them.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

WITHOUT_ENV = "LEASE_TEST_WITHOUT"

#: Where Debian puts libfaketime (``faketime``, which pulls in ``libfaketime``).
_FAKETIME_GLOBS = ("*/faketime/libfaketime.so.1", "faketime/libfaketime.so.1")
#: The German messages and locale of the translated-server test (tests/reliability/test_translated_server.py).
GERMAN_SOURCES = Path("/usr/share/i18n/locales/de_DE")
GERMAN_MESSAGES = Path("/usr/share/locale/de/LC_MESSAGES")


def _which(name: str) -> str | None:
    """``name`` on PATH, or where Debian installs daemons (not on a non-root user's PATH)."""
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name) if os.access(p, os.X_OK)), None
    )


def libfaketime() -> Path | None:
    return next((p for pattern in _FAKETIME_GLOBS for p in Path("/usr/lib").glob(pattern)), None)


def chromium() -> str | None:
    """The Chromium the browser tier drives (``LEASE_TEST_CHROMIUM``, else Debian's)."""
    if configured := os.environ.get("LEASE_TEST_CHROMIUM"):
        return configured if Path(configured).exists() else None
    return shutil.which("chromium") or next((p for p in ("/usr/bin/chromium",) if Path(p).exists()), None)


def machine_pg_bin() -> Path | None:
    """The machine's PostgreSQL programs (Debian's ``postgresql``), the newest major version."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]), reverse=True)
    return found[0].parent if found else None


def _redis() -> bool:
    """Redis answers at 127.0.0.1:6379, or ``redis-server`` is there to start it (demo.deployment.ensure_redis)."""
    if _which("redis-server"):
        return True
    import socket

    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", 6379)) == 0


def _german_postgres() -> bool:
    pg_bin = machine_pg_bin()
    return (
        pg_bin is not None and shutil.which("localedef") is not None and GERMAN_SOURCES.exists()
        and any(GERMAN_MESSAGES.glob("postgres-*.mo"))
    )


def _netns() -> bool:
    """``ip netns`` and ``unshare`` as root: the Edge tier's worker in namespaces of its own (tests/apipath)."""
    return os.geteuid() == 0 and _which("ip") is not None and shutil.which("unshare") is not None


@dataclass(frozen=True)
class Tool:
    name: str
    #: The Debian packages that provide it.
    packages: str
    #: What a test uses it for (part of the reason).
    purpose: str
    present: Callable[[], bool]


TOOLS = {
    tool.name: tool
    for tool in (
        Tool("pgbouncer", "pgbouncer", "transaction pooling in front of the test server",
             lambda: _which("pgbouncer") is not None),
        Tool("faketime", "faketime", "a client process whose clock is skewed",
             lambda: libfaketime() is not None and shutil.which("faketime") is not None),
        Tool("chromium", "chromium", "the UI's pages driven in a headless browser by Playwright",
             lambda: chromium() is not None),
        Tool("redis", "redis-server", "the CeleryExecutor's broker at 127.0.0.1:6379", _redis),
        Tool("socat", "socat", "the Edge worker's one route to the api-server, out of its network namespace",
             lambda: shutil.which("socat") is not None),
        Tool("netns", "iproute2", "a network namespace for the Edge worker (root, ip netns, unshare)", _netns),
        Tool("german-postgres", "postgresql locales",
             "a PostgreSQL server answering in German: the machine's initdb with its German messages, "
             "the de_DE locale source, localedef", _german_postgres),
    )
}


def required() -> bool:
    """Whether an absent tool fails the test (``CI=true``: ``.ci/run`` installed them all)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _without() -> set[str]:
    return {name.strip() for name in os.environ.get(WITHOUT_ENV, "").split(",") if name.strip()}


@functools.cache
def _present(name: str) -> bool:
    return TOOLS[name].present()


def missing(name: str) -> str | None:
    """Why ``name`` cannot be used here (naming the package to install), or None when it can."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}: one of {', '.join(sorted(TOOLS))}")
    tool = TOOLS[name]
    if name not in _without() and _present(name):
        return None
    hidden = f" ({WITHOUT_ENV} names it)" if name in _without() else ""
    return f"{tool.name} is not installed{hidden}: apt-get install {tool.packages}; for {tool.purpose}"


def require(name: str) -> None:
    """Skip the calling test when ``name`` is absent, or fail it under ``CI=true``."""
    reason = missing(name)
    if reason is None:
        return
    if required():
        pytest.fail(f"{reason}; CI=true, where .ci/run installs it, so its absence is a failure", pytrace=False)
    pytest.skip(reason)
