"""Validation at the boundary. Every rejection names the parameter and the value; nothing is written first."""

from __future__ import annotations

import re
from datetime import timedelta

from airflow_lease_provider.core.errors import InvalidArgument

#: Keys, owners, resources and idempotency keys are stored verbatim up to this many characters...
MAX_NAME_LENGTH = 512
#: ...and this many bytes of UTF-8 (a PostgreSQL btree entry holds at most ~2.7 kB, and the publish
#: index holds a resource and an idempotency key together).
MAX_NAME_BYTES = 1024
#: The shortest lease we grant. Shorter ones cannot be renewed in time over a network.
MIN_TTL = timedelta(seconds=1)
#: The longest lease we grant. Longer ones mean a crash blocks the job for more than a week.
MAX_TTL = timedelta(days=7)
#: Upper bound of a fencing token (PostgreSQL bigint).
MAX_TOKEN = 2**63 - 1
#: Schema names: a plain lower-case SQL identifier, so it never needs quoting in a psql session.
_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def name(parameter: str, value: object) -> str:
    """A key, owner, resource or idempotency key: a non-empty string up to :data:`MAX_NAME_LENGTH`."""
    if not isinstance(value, str):
        raise InvalidArgument(parameter, value, f"must be a str, not {type(value).__name__}")
    if not value.strip():
        raise InvalidArgument(parameter, value, "must be a non-empty string")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidArgument(parameter, value, f"is {len(value)} characters long; the limit is {MAX_NAME_LENGTH}")
    if "\x00" in value:
        raise InvalidArgument(parameter, value, "must not contain NUL characters (PostgreSQL text cannot store them)")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(parameter, value, "must be valid Unicode (it contains a lone surrogate)") from None
    if size > MAX_NAME_BYTES:
        raise InvalidArgument(parameter, value, f"is {size} bytes as UTF-8; the limit is {MAX_NAME_BYTES}")
    return value


def ttl(parameter: str, value: object) -> timedelta:
    """A lease TTL: a ``timedelta`` between :data:`MIN_TTL` and :data:`MAX_TTL`."""
    if not isinstance(value, timedelta):
        raise InvalidArgument(parameter, value, f"must be a datetime.timedelta, not {type(value).__name__}")
    if value <= timedelta(0):
        raise InvalidArgument(parameter, value, "must be positive")
    if value < MIN_TTL:
        raise InvalidArgument(parameter, value, f"must be at least {MIN_TTL.total_seconds():g} s")
    if value > MAX_TTL:
        raise InvalidArgument(parameter, value, f"must be at most {MAX_TTL.days} days")
    return value


def positive_timedelta(parameter: str, value: object) -> timedelta:
    if not isinstance(value, timedelta):
        raise InvalidArgument(parameter, value, f"must be a datetime.timedelta, not {type(value).__name__}")
    if value <= timedelta(0):
        raise InvalidArgument(parameter, value, "must be positive")
    return value


#: The keeper declares a lease lost this long before it would expire: TTL/10, at most this much.
MAX_DEFAULT_SAFETY_MARGIN = timedelta(seconds=5)


def default_safety_margin(lease_ttl: timedelta) -> timedelta:
    """The keeper's default safety margin for a lease of ``lease_ttl``: TTL/10, at most 5 s."""
    return min(lease_ttl / 10, MAX_DEFAULT_SAFETY_MARGIN)


def safety_margin(value: object, lease_ttl: timedelta, parameter: str = "safety_margin") -> timedelta:
    """The keeper's safety margin: ``None`` for the default, else a timedelta from 0 to below the TTL."""
    if value is None:
        return default_safety_margin(lease_ttl)
    if not isinstance(value, timedelta) or value < timedelta(0) or value >= lease_ttl:
        raise InvalidArgument(parameter, value, f"must be a datetime.timedelta >= 0 and shorter than the TTL ({lease_ttl})")
    return value


def renew_every(
    value: object,
    lease_ttl: timedelta,
    parameter: str = "renew_every",
    margin: timedelta | None = None,
) -> timedelta:
    """The renewal interval: positive and shorter than the TTL minus the keeper's safety margin.

    The keeper declares the lease lost at TTL minus the margin after the last successful renewal was
    sent; a renewal due at or after that moment always comes too late, so such an interval is refused.
    ``margin`` defaults to :func:`default_safety_margin` of ``lease_ttl`` (what the keeper uses).
    """
    interval = positive_timedelta(parameter, value)
    margin = default_safety_margin(lease_ttl) if margin is None else margin
    if interval >= lease_ttl - margin:
        raise InvalidArgument(
            parameter, value,
            f"must be shorter than the TTL ({lease_ttl}) minus the keeper's safety margin ({margin}): "
            f"the keeper declares the lease lost at {lease_ttl - margin} without a renewal, so a renewal "
            "that late always loses it",
        )
    return interval


def token(parameter: str, value: object) -> int:
    """A fencing token: a positive integer that fits a PostgreSQL bigint."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(parameter, value, f"must be an int, not {type(value).__name__}")
    if value <= 0:
        raise InvalidArgument(parameter, value, "must be a positive integer")
    if value > MAX_TOKEN:
        raise InvalidArgument(parameter, value, "is larger than a PostgreSQL bigint")
    return value


def schema(value: object, parameter: str = "schema") -> str:
    if not isinstance(value, str) or not _SCHEMA_RE.match(value):
        raise InvalidArgument(
            parameter, value, "must be a lower-case identifier: a letter or _, then letters, digits or _ (max 63)"
        )
    if value.startswith("pg_"):
        raise InvalidArgument(parameter, value, "names starting with pg_ are reserved by PostgreSQL")
    return value


def dsn(value: object, parameter: str = "dsn") -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(parameter, "<hidden>", "must be a non-empty libpq connection string or URI")
    return value
