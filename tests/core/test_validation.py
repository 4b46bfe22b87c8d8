"""Bad input is refused at the boundary with the parameter and the value named, and nothing written."""

from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_lease_provider.core import FenceStore, InvalidArgument, LeaseStore
from airflow_lease_provider.core.validation import MAX_NAME_LENGTH

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
