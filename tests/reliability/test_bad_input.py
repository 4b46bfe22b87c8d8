"""Oversized and malformed values: refused up front, with a message that names the parameter, the
value and the limit, and nothing written. (The property tests cover the space; these pin the limits.)"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from airflow_lease_provider.core import FenceStore, InvalidArgument, LeaseStore
from airflow_lease_provider.core.events import MAX_DETAIL_BYTES
from airflow_lease_provider.core.validation import MAX_NAME_LENGTH, MAX_OWNER_LENGTH, MAX_TOKEN
from tests.reliability.dbstate import Rows

TTL = timedelta(seconds=60)
LONG = "x" * (MAX_NAME_LENGTH + 1)
LONG_OWNER = "x" * (MAX_OWNER_LENGTH + 1)  # owners hold an Airflow identity of up to 764 characters

CALLS: dict[str, Callable[[LeaseStore, FenceStore], Any]] = {
    "key": lambda s, f: s.acquire(LONG, owner="o", ttl=TTL),
    "owner": lambda s, f: s.acquire("job", owner=LONG_OWNER, ttl=TTL),
    "resource": lambda s, f: f.accept(LONG, 1, key="job"),
    "idempotency_key": lambda s, f: f.accept("blog", 1, key="job", idempotency_key=LONG),
    "by": lambda s, f: s.force_release("job", by=LONG_OWNER),
    "token": lambda s, f: f.accept("blog", MAX_TOKEN + 1, key="job"),
    "ttl": lambda s, f: s.acquire("job", owner="o", ttl=timedelta(days=7, seconds=1)),
    "detail": lambda s, f: s.events.record("acquired", "job", detail={"text": "x" * MAX_DETAIL_BYTES}),
}
MESSAGES = {
    "key": f"is {MAX_NAME_LENGTH + 1} characters long; the limit is {MAX_NAME_LENGTH}",
    "owner": f"is {MAX_OWNER_LENGTH + 1} characters long; the limit is {MAX_OWNER_LENGTH}",
    "resource": f"is {MAX_NAME_LENGTH + 1} characters long; the limit is {MAX_NAME_LENGTH}",
    "idempotency_key": f"is {MAX_NAME_LENGTH + 1} characters long; the limit is {MAX_NAME_LENGTH}",
    "by": f"is {MAX_OWNER_LENGTH + 1} characters long; the limit is {MAX_OWNER_LENGTH}",
    "token": "larger than a PostgreSQL bigint",
    "ttl": "must be at most 7 days",
    "detail": f"larger than {MAX_DETAIL_BYTES} bytes",
}


@pytest.mark.parametrize("parameter", list(CALLS))
def test_oversized_values_are_refused_with_a_clear_message_and_nothing_written(
    store: LeaseStore, fences: FenceStore, rows: Rows, parameter: str
) -> None:
    store.ensure_schema()
    held = store.acquire("job", owner="holder", ttl=TTL)
    fences.accept("blog", 1, key="job")
    before = rows()
    with pytest.raises(InvalidArgument) as info:
        CALLS[parameter](store, fences)
    message = str(info.value)
    assert info.value.parameter == parameter
    assert message.startswith(f"{parameter}=") and MESSAGES[parameter] in message
    assert len(message) < 200, "the value is shortened in the message, not dumped whole"
    assert rows() == before
    assert store.holder("job").token == held.token


@pytest.mark.parametrize("value", ["a\ud800b", "\udfff", "ok-until-here\udc80"])
def test_lone_surrogates_are_refused_as_invalid_arguments(
    store: LeaseStore, fences: FenceStore, rows: Rows, value: str
) -> None:
    """A Python str can hold lone surrogates (from os.fsdecode, JSON "\\ud800" escapes); UTF-8 cannot.

    Today they reach the driver and come out as UnicodeEncodeError, an exception the API does not document.
    """
    store.ensure_schema()
    before = rows()
    for call in (
        lambda: store.acquire(value, owner="o", ttl=TTL),
        lambda: store.acquire("job", owner=value, ttl=TTL),
        lambda: fences.accept(value, 1, key="job"),
        lambda: fences.accept("blog", 1, key="job", idempotency_key=value),
    ):
        with pytest.raises(InvalidArgument):
            call()
    assert rows() == before


def test_names_within_the_documented_limit_are_stored_or_refused_up_front(
    store: LeaseStore, fences: FenceStore, rows: Rows
) -> None:
    """512 characters is the documented limit, but 512 CJK characters are 1,536 bytes, and a resource plus
    an idempotency key that long overflow the fence_publish index (2,704 bytes). Today that surfaces as
    LeaseStoreUnavailable ("unreachable: index row size ... exceeds btree"), which callers retry as an outage."""
    rng = random.Random(512)
    cjk = ["".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(MAX_NAME_LENGTH)) for _ in range(2)]
    store.ensure_schema()
    for call in (
        lambda: store.acquire(cjk[0], owner=cjk[1], ttl=TTL),
        lambda: fences.accept(cjk[0], 1, key="job", owner=cjk[1], idempotency_key=cjk[1]),
        lambda: store.events.record("acquired", cjk[0], owner=cjk[1]),
    ):
        before = rows()
        try:
            call()
        except InvalidArgument as exc:
            assert exc.parameter in ("key", "owner", "resource", "idempotency_key")
            assert rows() == before


def test_force_release_with_an_unstorable_reason_changes_nothing(store: LeaseStore, rows: Rows) -> None:
    """The reason goes into the event detail, whose size is checked only after the lease was freed and its
    token bumped: the caller gets InvalidArgument for an action that already happened."""
    held = store.acquire("job", owner="run-1", ttl=TTL)
    assert held is not None
    before = rows()
    with pytest.raises(InvalidArgument):
        store.force_release("job", by="admin", reason="r" * (MAX_DETAIL_BYTES + 1))
    assert rows() == before, "force_release wrote, then raised"
    assert store.holder("job") is not None and store.holder("job").token == held.token
