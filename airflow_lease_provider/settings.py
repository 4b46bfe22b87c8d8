"""The ``[lease]`` configuration section, read through Airflow's config with documented defaults.

Read lazily (never at import time): Airflow may still be configuring itself when this is imported.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow_lease_provider import version_compat
from airflow_lease_provider.core.keeper import DEFAULT_RENEW_FRACTION
from airflow_lease_provider.get_provider_info import OPTIONS

#: Each option's fallback when Airflow's config has none: the default the provider declares.
DEFAULTS = {name: option["default"] for name, option in OPTIONS.items()}

# Executors whose tasks all run on the scheduler's host: the embedded store protects them fully.
SINGLE_HOST_EXECUTORS = {"LocalExecutor", "SequentialExecutor", "DebugExecutor"}


def _get(option: str, section: str = "lease") -> str:
    value = version_compat.conf.get(section, option, fallback=DEFAULTS.get(option, ""))
    return str(value).strip()


def conn_id() -> str:
    return _get("conn_id") or DEFAULTS["conn_id"]


def schema() -> str:
    return _get("schema") or DEFAULTS["schema"]


#: The smallest ``[lease] renew_fraction``: 100 renewals per TTL. A smaller one (1e-300, say) made the
#: renewal interval 0 (an error naming ``renew_every``, an option nobody set) or a busy loop on the store.
MIN_RENEW_FRACTION = 0.01


def renew_fraction() -> float:
    """``[lease] renew_fraction``. Its declared default, ``0.3333``, is the core keeper's 1/3 written in four
    digits: left at it, the fraction is exactly the keeper's, so a leased task renews as a bare keeper does."""
    raw = _get("renew_fraction")
    if raw == DEFAULTS["renew_fraction"]:
        return DEFAULT_RENEW_FRACTION
    problem = f"[lease] renew_fraction={raw!r}: must be a number from {MIN_RENEW_FRACTION} to below 1"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(problem) from None
    if not MIN_RENEW_FRACTION <= value < 1:  # nan and inf fail it too
        raise ValueError(problem)
    return value


#: The longest ``[lease] event_retention_days``: 100 years. Far more overflowed ``timedelta`` (an
#: OverflowError naming no option), or put the prune's cutoff before PostgreSQL's earliest timestamp
#: (a "timestamp out of range" warning at every prune, and nothing ever pruned).
MAX_RETENTION_DAYS = 36500


def event_retention() -> timedelta:
    raw = _get("event_retention_days")
    problem = f"[lease] event_retention_days={raw!r}: must be a whole number of days from 1 to {MAX_RETENTION_DAYS}"
    try:
        days = int(raw)
    except ValueError:
        raise ValueError(problem) from None
    if not 1 <= days <= MAX_RETENTION_DAYS:
        raise ValueError(problem)
    return timedelta(days=days)


def clock_skew_warning() -> timedelta:
    raw = _get("clock_skew_warning_seconds")
    problem = f"[lease] clock_skew_warning_seconds={raw!r}: must be a number of seconds, 0 or more (e.g. 2)"
    try:
        seconds = float(raw)
        # inf or 1e20 overflowed timedelta (an OverflowError naming no option, in every leased task);
        # a negative limit warned at every acquire.
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(problem)
        return timedelta(seconds=seconds)
    except (ValueError, OverflowError):
        raise ValueError(problem) from None


def airflow_home() -> Path:
    return Path(os.environ.get("AIRFLOW_HOME") or Path.home() / "airflow")


def embedded_dir() -> Path:
    configured = _get("embedded_dir")
    return Path(configured) if configured else airflow_home() / "lease-postgres"


def executors() -> list[str]:
    raw = _get("executor", section="core") or "LocalExecutor"
    # "LocalExecutor", "LocalExecutor,CeleryExecutor", or "my_alias:path.to.Executor".
    return [part.split(":")[-1].strip().rsplit(".", 1)[-1] for part in raw.split(",") if part.strip()]


def single_host() -> bool:
    """Whether every configured executor runs tasks on this host only."""
    return all(name in SINGLE_HOST_EXECUTORS for name in executors())


def embedded() -> str:
    """``[lease] embedded``: ``auto`` (the default), ``true`` or ``false``."""
    raw = (_get("embedded") or DEFAULTS["embedded"]).lower()
    if raw in ("true", "1", "yes", "on"):
        return "true"
    if raw in ("false", "0", "no", "off"):
        return "false"
    if raw != "auto":
        raise ValueError(f"[lease] embedded={raw!r}: must be auto, true or false")
    return raw


#: Where an Airflow component records, at its start, whether its metadata database is SQLite, for the
#: processes it starts (set by :func:`record_metadata_database`, read by :func:`metadata_database`).
METADATA_RECORD_ENV = "_AIRFLOW_LEASE_METADATA_DATABASE"


def _metadata_kind() -> str | None:
    """``sqlite`` or ``other``: Airflow's metadata database (``[database] sql_alchemy_conn``) as this process's
    configuration gives it; ``None`` where Airflow hides it from this process (``HIDDEN_METADATA`` in
    :mod:`airflow_lease_provider.version_compat`). Only the kind leaves: the URL may carry the password."""
    value = _get("sql_alchemy_conn", section="database")
    if value.startswith(version_compat.HIDDEN_METADATA):
        return None
    return "sqlite" if value.partition(":")[0].partition("+")[0].lower() == "sqlite" else "other"


def record_metadata_database() -> None:
    """Record in this process's environment whether Airflow's metadata database is SQLite.

    Called by the plugin's listener when an Airflow component starts (``on_starting``: the scheduler,
    the triggerer and the dag-processor, before they start any executor, trigger runner or parser).
    Every process they start inherits the environment (fork or exec alike), so the task processes of a
    ``LocalExecutor``, where Airflow hides ``[database] sql_alchemy_conn``, learn the fact from the
    component that started them: never stale (a restarted component records its own configuration over
    what it inherited) and no secret (``sqlite`` or ``other``, never the URL). Where Airflow hides the
    URL from this process (the task runner's own ``on_starting``), what the component recorded stays.
    """
    known = _metadata_kind()
    if known is not None:
        os.environ[METADATA_RECORD_ENV] = known


def metadata_database() -> str:
    """``sqlite``, ``other``, or ``unknown``: what this process may know of Airflow's metadata database.

    Read from the configuration where this process may read it (a scheduler, an api-server, the CLI,
    ``airflow dags test``); in a process where Airflow hides it (a task process), as the component that
    started it recorded it (:func:`record_metadata_database`); ``unknown`` where none did.
    """
    known = _metadata_kind()
    if known is not None:
        return known
    recorded = os.environ.get(METADATA_RECORD_ENV, "")
    return recorded if recorded in ("sqlite", "other") else "unknown"


def libpq_dsn(url: Any) -> str | None:
    """A ``postgresql://`` URI for libpq from a SQLAlchemy URL (or its string), password included; None when
    the URL is not PostgreSQL's. Never logged: it carries the password."""
    from sqlalchemy.engine import (
        make_url,  # only where the metadata database is read: the api-server, the CLI
    )

    parsed = make_url(url) if isinstance(url, str) else url
    if parsed.get_backend_name() != "postgresql":
        return None
    return str(parsed.set(drivername="postgresql").render_as_string(hide_password=False))


def metadata_dsn() -> str | None:
    """Airflow's metadata database as a libpq URI when it is PostgreSQL (``[database] sql_alchemy_conn`` as
    Airflow resolves it, ``_cmd`` and ``_secret`` included); None when it is not, or hidden from this process
    (a task process). Issue 41: the api-server's lease store there (docs/api.md)."""
    value = _get("sql_alchemy_conn", section="database")
    if not value or value.startswith(version_compat.HIDDEN_METADATA):
        return None
    try:
        return libpq_dsn(value)
    except Exception:  # an unparsable URL is Airflow's to report; no store there
        return None


ACCESS_CHOICES = ("auto", "direct", "api")


def access() -> str:
    """``[lease] access``: ``auto``, ``direct`` or ``api`` (docs/api.md); anything else is refused."""
    value = _get("access").lower() or "auto"
    if value not in ACCESS_CHOICES:
        raise ValueError(f"[lease] access = {value!r}: expected one of {', '.join(ACCESS_CHOICES)}")
    return value


def api_server_url() -> str:
    """The api-server's base URL as a task reaches it: ``[workers] execution_api_server_url`` (``[core]``'s
    before Airflow 3.1) without its ``/execution/`` path, else ``[api] base_url``, else Airflow's default;
    ``[lease] api_url`` before all of them."""
    if _get("api_url"):
        return _get("api_url").rstrip("/")
    for section in ("workers", "core"):
        url = _get("execution_api_server_url", section=section)
        if url:
            url = url.rstrip("/")
            return url[: -len("/execution")] if url.endswith("/execution") else url
    return _get("base_url", section="api").rstrip("/") or "http://localhost:8080"


def api_pool_size() -> int:
    """``[lease] api_pool_size``: the lease API's connections to the store (a whole number of at least 1)."""
    raw = _get("api_pool_size") or DEFAULTS["api_pool_size"]
    if not raw.isascii() or not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"[lease] api_pool_size = {raw!r}: must be a whole number of at least 1")
    return int(raw)


def metadata_on_sqlite() -> bool:
    """Whether Airflow's metadata database is known to be SQLite: a file on one host, so no second host
    can exist. Unknown is not SQLite (the safe answer: no embedded store)."""
    return metadata_database() == "sqlite"


def embedded_allowed() -> bool:
    """Whether a missing lease connection may fall back to the embedded store on this host.

    Only where no second host can exist (every executor local, metadata on SQLite: ``airflow
    standalone`` as installed) or where ``[lease] embedded = true`` turns it on by name. A local executor
    on a shared metadata database is not enough: HA schedulers, or a triggerer in a pod of its own,
    would each start an embedded store of their own and hand out the same lease twice.
    """
    choice = embedded()
    if choice != "auto":
        return choice == "true"
    return single_host() and metadata_on_sqlite()


def _boolean(option: str) -> bool:
    raw = (_get(option) or DEFAULTS[option]).lower()
    if raw in ("true", "1", "yes", "on"):
        return True
    if raw in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"[lease] {option}={raw!r}: must be true or false")


def hold_connection() -> bool:
    """``[lease] hold_connection``: keep one store connection open per running task (default: no)."""
    return _boolean("hold_connection")


def prepare_statements() -> bool:
    """``[lease] prepare_statements``: prepare the store's hot statements on a connection used more than
    once (default: yes)."""
    return _boolean("prepare_statements")


def push_lease_xcom() -> bool:
    """``[lease] push_lease_xcom``: push each leased task's lease to XCom under ``lease`` (default: no)."""
    return _boolean("push_lease_xcom")
