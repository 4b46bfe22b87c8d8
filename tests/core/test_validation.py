"""Bad input is refused at the boundary with the parameter and the value named, and nothing written."""

from __future__ import annotations

import unicodedata
from datetime import timedelta

import pytest

from airflow_lease_provider.core import FenceStore, InvalidArgument, LeaseStore
from airflow_lease_provider.core.validation import MAX_NAME_LENGTH
from tests.pg import execute, q

TTL = timedelta(seconds=30)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"key": ""}, "key"),
        ({"key": "   "}, "key"),
        ({"key": None}, "key"),
        ({"key": 42}, "key"),
        ({"key": "x" * (MAX_NAME_LENGTH + 1)}, "key"),
        ({"key": "a\x00b"}, "key"),
        ({"owner": ""}, "owner"),
        ({"owner": 7}, "owner"),
        ({"ttl": timedelta(seconds=-5)}, "ttl"),
        ({"ttl": timedelta(0)}, "ttl"),
        ({"ttl": timedelta(milliseconds=500)}, "ttl"),
        ({"ttl": timedelta(days=8)}, "ttl"),
        ({"ttl": 30}, "ttl"),
    ],
)
def test_acquire_rejects_bad_arguments(store: LeaseStore, kwargs: dict, parameter: str) -> None:
    args = {"key": "job", "owner": "a", "ttl": TTL, **kwargs}
    with pytest.raises(InvalidArgument) as info:
        store.acquire(**args)
    assert info.value.parameter == parameter
    assert str(info.value).startswith(f"{parameter}=")
    assert isinstance(info.value, ValueError)
    assert store.leases() == []


@pytest.mark.parametrize("token", [0, -1, True, 1.5, "3", 2**63])
def test_fence_rejects_bad_tokens(fences: FenceStore, token: object) -> None:
    with pytest.raises(InvalidArgument) as info:
        fences.accept("blog", token, key="job")  # type: ignore[arg-type]
    assert info.value.parameter == "token"
    assert fences.current("blog", key="job") is None


@pytest.mark.parametrize("schema", ["", "Bad", "1abc", "a-b", "a;drop", "pg_x", "x" * 64, None])
def test_schema_names_are_validated(schema: object, pg_dsn: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        LeaseStore(pg_dsn, schema=schema)  # type: ignore[arg-type]
    assert info.value.parameter == "schema"


def test_dsn_is_required_and_never_echoed() -> None:
    with pytest.raises(InvalidArgument) as info:
        LeaseStore("")
    assert info.value.parameter == "dsn"


INJECTIONS = [
    "x'); DROP TABLE lease; --",
    "'; DELETE FROM fence; --",
    '" OR 1=1 --',
    "$$; DROP SCHEMA public CASCADE; $$",
    "\\'; SELECT pg_sleep(10); --",
    "%(key)s",
    "%s%s%s",
    "{schema}",
    "ключ-日本語-🔒",
]


@pytest.mark.parametrize("value", INJECTIONS)
def test_hostile_strings_are_stored_verbatim(store: LeaseStore, fences: FenceStore, value: str) -> None:
    lease = store.acquire(value, owner=value, ttl=TTL)
    assert lease is not None and lease.key == value and lease.owner == value
    holder = store.holder(value)
    assert holder is not None and holder.key == value and holder.owner == value
    assert fences.accept(value, lease.token, key=value, owner=value, idempotency_key=value)
    assert fences.current(value, key=value) == lease.token
    assert fences.tokens(value) == {value: lease.token}
    assert not fences.accept(value, lease.token + 1, key=value, idempotency_key=value)
    assert store.release(lease)
    assert [lease.key for lease in store.leases()] == [value]


def test_renew_every_and_keeper_margin_validated(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=TTL)
    assert lease is not None
    with pytest.raises(InvalidArgument, match="renew_every"):
        store.keep(lease, renew_every=timedelta(seconds=31))
    with pytest.raises(InvalidArgument, match="renew_every"):
        store.keep(lease, renew_every=5)  # type: ignore[arg-type]


# -- one text, one name: normalised to NFC; invisible, reordering and edge-whitespace variants refused ----

HELD = "café-load"  # NFC: 'é' is U+00E9
NFD = unicodedata.normalize("NFD", HELD)  # 'e' + U+0301 COMBINING ACUTE ACCENT
LOOKALIKES = [
    (HELD + " ", "whitespace"),
    (" " + HELD, "whitespace"),
    (HELD + "\u00a0", "whitespace"),  # a no-break space at the end
    ("caf\u200bé-load", "U+200B ZERO WIDTH SPACE at position 3"),
    (HELD + "\u202e", "U+202E RIGHT-TO-LEFT OVERRIDE at position 9"),
    ("\u2066" + HELD + "\u2069", "U+2066 LEFT-TO-RIGHT ISOLATE at position 0"),
    ("café\u200d-load", "U+200D ZERO WIDTH JOINER"),
    ("\ufeff" + HELD, "U+FEFF ZERO WIDTH NO-BREAK SPACE"),
    ("café\x1b[2J-load", "U+001B at position 4, a control character"),
    ("café\u2028-load", "U+2028 LINE SEPARATOR"),
]


def test_a_key_s_nfd_form_is_the_same_lease_as_its_nfc_form(store: LeaseStore) -> None:
    assert NFD != HELD
    held = store.acquire(HELD, owner="a", ttl=TTL)
    assert held is not None
    assert store.acquire(NFD, owner="b", ttl=TTL) is None  # held: the NFD key is the same lease
    holding = store.try_acquire(NFD, owner="b", ttl=TTL)
    assert holding.lease is None and holding.holder is not None and holding.holder.owner == "a"
    assert store.holder(NFD).token == held.token and store.holder(NFD).key == HELD
    assert store.lease(NFD) is not None and store.lease(NFD).key == HELD
    assert [lease.key for lease in store.leases()] == [HELD]
    store.release(held)
    mine = store.acquire(NFD, owner="b", ttl=TTL)
    assert mine is not None and mine.key == HELD  # stored (and returned) in NFC


@pytest.mark.parametrize(("variant", "problem"), LOOKALIKES)
def test_a_key_that_only_looks_like_a_held_one_is_refused_naming_the_character(
    store: LeaseStore, variant: str, problem: str
) -> None:
    assert store.acquire(HELD, owner="a", ttl=TTL) is not None
    with pytest.raises(InvalidArgument) as info:
        store.acquire(variant, owner="b", ttl=TTL)
    assert info.value.parameter == "key"
    assert problem in str(info.value)
    invisible = [c for c in variant if unicodedata.category(c) in ("Cc", "Cf", "Zl")]
    assert not any(c in str(info.value) for c in invisible)  # the value is shown escaped (its repr)
    assert [lease.key for lease in store.leases()] == [HELD]  # nothing written: one lease, the held one


@pytest.mark.parametrize(("variant", "problem"), LOOKALIKES[2:5])
def test_fence_resources_and_idempotency_keys_are_checked_and_normalised_like_keys(
    fences: FenceStore, variant: str, problem: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        fences.accept(variant, 1, key="job")
    assert info.value.parameter == "resource" and problem in str(info.value)
    with pytest.raises(InvalidArgument) as info:
        fences.accept("blog", 1, key="job", idempotency_key=variant)
    assert info.value.parameter == "idempotency_key" and problem in str(info.value)
    assert fences.current("blog", key="job") is None  # nothing written
    assert fences.accept(NFD, 1, key="job", idempotency_key=NFD)
    assert fences.tokens(HELD) == {"job": 1}
    assert not fences.accept(HELD, 2, key="job", idempotency_key=HELD)  # the same idempotency key


def test_a_key_written_before_the_check_can_still_be_read_and_force_released(
    store: LeaseStore, pg_dsn: str, schema: str
) -> None:
    """A row from an older version whose key has a bidi override: readable and removable, never re-acquired."""
    old = "nightly\u202eclose"
    assert store.acquire("job", owner="a", ttl=TTL) is not None  # the schema exists
    execute(
        pg_dsn,
        q("INSERT INTO {schema}.lease (key, owner, token, ttl, acquired_at, renewed_at, expires_at) "
          "VALUES (%s, 'old', 1, '1 hour', now(), now(), now() + '1 hour')", schema),
        (old,),
    )
    assert store.holder(old) is not None and store.lease(old).owner == "old"
    with pytest.raises(InvalidArgument):
        store.acquire(old, owner="new", ttl=TTL)
    previous = store.force_release(old, by="admin", reason="cleanup")
    assert previous is not None and previous.owner == "old"
    assert store.holder(old) is None
    assert [e.key for e in store.events.query(key=old, kind="force_released")] == [old]
