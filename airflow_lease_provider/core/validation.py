"""Validation at the boundary. Every rejection names the parameter and the value; nothing is written first."""

from __future__ import annotations

import re
import unicodedata
from datetime import timedelta

from airflow_lease_provider.core.errors import InvalidArgument

#: Keys, resources and idempotency keys are stored up to this many characters...
MAX_NAME_LENGTH = 512
#: ...and this many bytes of UTF-8 (a PostgreSQL btree entry holds at most ~2.7 kB, and the fence's
#: primary key holds a resource and a lease key together, the publish index a resource and an
#: idempotency key).
MAX_NAME_BYTES = 1024
#: Owners are stored verbatim up to this many characters and bytes: an Airflow task instance's owner
#: ``dag_id/run_id/task_id[map_index]`` is up to 3 x 250 + 2 + 12 = 764 characters (Airflow's ids are up
#: to 250 characters each), of up to 4 bytes each. No index holds a whole owner; the ledger's DAG index
#: holds its part before the first ``/``, which is held to :data:`MAX_NAME_BYTES`.
MAX_OWNER_LENGTH = 1024
MAX_OWNER_BYTES = 4 * MAX_OWNER_LENGTH
#: The shortest lease we grant. Shorter ones cannot be renewed in time over a network.
MIN_TTL = timedelta(seconds=1)
#: The longest lease we grant. Longer ones mean a crash blocks the job for more than a week.
MAX_TTL = timedelta(days=7)
#: Upper bound of a fencing token (PostgreSQL bigint).
MAX_TOKEN = 2**63 - 1
#: Schema names: a plain lower-case SQL identifier, so it never needs quoting in a psql session.
_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


#: Unicode categories refused in a name: controls, format characters (zero-width spaces and joiners,
#: bidirectional overrides and isolates, the BOM), surrogates, line and paragraph separators. They are
#: invisible or change how the text around them is shown, so two names that look the same would be
#: two leases.
REFUSED_CATEGORIES = {
    "Cc": "a control character",
    "Cf": "a format character (invisible, or it reorders the text around it)",
    "Cs": "a surrogate",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def _text(parameter: str, value: object, max_length: int, max_bytes: int) -> str:
    """A non-empty str without NUL, of valid Unicode, within ``max_length`` characters and ``max_bytes``."""
    if not isinstance(value, str):
        raise InvalidArgument(parameter, value, f"must be a str, not {type(value).__name__}")
    if not value.strip():
        raise InvalidArgument(parameter, value, "must be a non-empty string")
    if len(value) > max_length:
        raise InvalidArgument(parameter, value, f"is {len(value)} characters long; the limit is {max_length}")
    if "\x00" in value:
        raise InvalidArgument(parameter, value, "must not contain NUL characters (PostgreSQL text cannot store them)")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(parameter, value, "must be valid Unicode (it contains a lone surrogate)") from None
    if size > max_bytes:
        raise InvalidArgument(parameter, value, f"is {size} bytes as UTF-8; the limit is {max_bytes}")
    return value


def lookup_name(parameter: str, value: object) -> str:
    """A key (or resource) to look up or act on as stored: NFC-normalised, as :func:`name` stores it.

    It does not refuse the characters :func:`name` refuses, so rows written before names were checked
    for them (version 0.x, see docs/deploy.md) can still be read, released and force-released.
    """
    return unicodedata.normalize("NFC", _text(parameter, value, MAX_NAME_LENGTH, MAX_NAME_BYTES))


def name(parameter: str, value: object) -> str:
    """A key, resource or idempotency key, normalised to NFC (the value to use from then on).

    One name is one text: the NFD and NFC forms of ``é`` are the same name (normalised), and a name
    with an invisible or reordering character (categories :data:`REFUSED_CATEGORIES`: a zero-width
    space, a bidirectional override, a control character) or with whitespace at either end is refused,
    so a name that looks like another is never a second lease beside it. At most
    :data:`MAX_NAME_LENGTH` characters and :data:`MAX_NAME_BYTES` bytes of UTF-8, after normalising.
    """
    text = _text(parameter, value, MAX_NAME_LENGTH * 4, MAX_NAME_BYTES * 4)
    if text != text.strip():
        raise InvalidArgument(
            parameter, value,
            "must not begin or end with whitespace (it would be a different name from the one without)",
        )
    for position, char in enumerate(text):
        what = REFUSED_CATEGORIES.get(unicodedata.category(char))
        if what is not None:
            label = unicodedata.name(char, "")
            raise InvalidArgument(
                parameter, value,
                f"contains U+{ord(char):04X}{' ' + label if label else ''} at position {position}, {what}: "
                "such characters are refused, so that a name never looks like another one",
            )
    return _text(parameter, unicodedata.normalize("NFC", text), MAX_NAME_LENGTH, MAX_NAME_BYTES)


def owner(parameter: str, value: object) -> str:
    """A lease owner (or who force-released a lease): stored verbatim, never normalised (two owners are
    two holders), up to :data:`MAX_OWNER_LENGTH` characters and :data:`MAX_OWNER_BYTES` bytes."""
    text = _text(parameter, value, MAX_OWNER_LENGTH, MAX_OWNER_BYTES)
    head = text.split("/", 1)[0]
    if "/" in text and len(head.encode("utf-8")) > MAX_NAME_BYTES:
        raise InvalidArgument(
            parameter, value,
            f"its part before the first '/' (the DAG id, indexed in the ledger) is more than {MAX_NAME_BYTES} bytes",
        )
    return text


def identifier(parameter: str, value: object) -> str:
    """An Airflow id (DAG, run or task id): verbatim, at most :data:`MAX_NAME_LENGTH` characters and
    :data:`MAX_NAME_BYTES` bytes (Airflow allows 250 characters)."""
    return _text(parameter, value, MAX_NAME_LENGTH, MAX_NAME_BYTES)


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


#: The part of a slot's row key after its semaphore's key: ``#`` and the slot, 2 or more (types.slot_key).
_SLOT_SUFFIX = re.compile(r"#(?:[2-9]|[1-9][0-9]+)")


def count_epoch(key: str, token: int, epoch: object, base_key: object) -> tuple[int | None, str | None]:
    """The count epoch a publish of lease row ``key`` with ``token`` names, and the lease key it is of
    (docs/core.md, "The fence"): ``epoch`` is the grant's (:attr:`Lease.count_epoch`), ``base_key`` the lease
    key whose slot ``key`` is (:attr:`Lease.lease_key`; default ``key`` itself). Every fence keeps per
    (resource, base key) the largest count epoch it accepted and refuses a token at or below it. ``(None,
    None)``: the publish names none, and no count epoch is checked (the rule before version 15, kept for a
    core caller that passes none)."""
    if epoch is None:
        if base_key is not None:
            raise InvalidArgument("base_key", base_key, "is given only with count_epoch (the lease's count_epoch and lease_key)")
        return None, None
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < token:
        raise InvalidArgument(
            "count_epoch", epoch,
            f"must be an integer from 0 to below the token ({token}): the lease's count_epoch, below every token "
            "of its grant's holding period",
        )
    base = key if base_key is None else lookup_name("base_key", base_key)
    if base != key and not (key.startswith(base) and _SLOT_SUFFIX.fullmatch(key[len(base):])):
        raise InvalidArgument(
            "base_key", base_key,
            f"must be the lease key whose slot {key!r} is (the lease's lease_key): {key!r} itself, or it without "
            "its '#<slot>'",
        )
    return epoch, base
