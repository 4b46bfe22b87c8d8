"""Property tests over the core's public entry points: any argument either works as documented or is
refused with :class:`InvalidArgument` naming the parameter, and a refused call writes nothing.

The database is the real one (``pg_dsn``); ``rows()`` reads every row of the store's tables, so "nothing
written" is checked on the tables themselves, events included.
"""

from __future__ import annotations

import unicodedata
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

from airflow_lease_provider.core import (
    DuplicatePublish,
    EventKind,
    FenceStore,
    InvalidArgument,
    Lease,
    LeaseKeeper,
    LeaseStore,
    StaleFencingToken,
)
from airflow_lease_provider.core.validation import MAX_TOKEN, MAX_TTL, MIN_TTL
from tests.reliability.dbstate import Rows
from tests.reliability.strategies import durations, junk, names, tokens, ttls

# The fixtures are shared by every example on purpose (one schema per test): examples are independent.
PROPERTY = settings(
    max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TTL = timedelta(minutes=5)


def is_name(value: object) -> bool:
    """Whether the documented name rule (characters, UTF-8 bytes, NUL, valid Unicode) accepts it."""
    from airflow_lease_provider.core import validation

    try:
        validation.name("name", value)
    except InvalidArgument:
        return False
    return True


def is_lookup_name(value: object) -> bool:
    """Whether a key to look up as stored is accepted (validation.lookup_name: the name rule without its
    refused characters)."""
    from airflow_lease_provider.core import validation

    try:
        validation.lookup_name("name", value)
    except InvalidArgument:
        return False
    return True


def is_owner(value: object) -> bool:
    """Whether the owner rule accepts it: an owner is stored verbatim (characters, UTF-8 bytes, NUL, valid
    Unicode), without the name rule's refused categories (an owner is never looked up as a lease)."""
    from airflow_lease_provider.core import validation

    try:
        validation.owner("owner", value)
    except InvalidArgument:
        return False
    return True


def is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_TOKEN


def refused(exc: InvalidArgument, *parameters: str) -> None:
    assert exc.parameter in parameters, exc
    assert str(exc).startswith(f"{exc.parameter}="), exc


@PROPERTY
@given(key=names, owner=names, ttl=ttls)
@example(key="0", owner="\x1b", ttl=timedelta(seconds=1))  # an owner is verbatim: a control character is kept
def test_acquire_grants_exactly_what_was_asked_or_refuses_and_writes_nothing(
    store: LeaseStore, rows: Rows, key: Any, owner: Any, ttl: Any
) -> None:
    before = rows()
    try:
        got = store.try_acquire(key, owner, ttl)
    except InvalidArgument as exc:
        refused(exc, "key", "owner", "ttl")
        assert rows() == before
        assert not (is_name(key) and is_owner(owner) and isinstance(ttl, timedelta) and MIN_TTL <= ttl <= MAX_TTL)
        return
    assert is_name(key) and is_owner(owner) and MIN_TTL <= ttl <= MAX_TTL
    lease = got.lease or got.holder
    assert lease is not None and lease.key == key
    if got.lease is not None:
        assert (got.lease.owner, got.lease.ttl) == (owner, ttl)
        # acquired_at and expires_at are two clock_timestamp() calls: about 1 in 10 grants is 1 µs longer.
        assert timedelta(0) <= got.lease.expires_at - got.lease.acquired_at - ttl < timedelta(milliseconds=1)
        held = store.holder(key)
        assert held is not None and held.token == got.lease.token
        assert store.release(got.lease)


@PROPERTY
@given(key=names, owner=names, token=tokens, ttl=ttls)
@example(key="real", owner="real-owner", token={}, ttl=TTL)
@example(key="real", owner="real-owner", token=True, ttl=TTL)
@example(key="real", owner="real-owner", token=2**64, ttl=TTL)
def test_renew_and_release_of_any_lease_object_touch_no_other_lease(
    store: LeaseStore, rows: Rows, key: Any, owner: Any, token: Any, ttl: Any
) -> None:
    """A Lease can come back from XCom or be built by hand: whatever it holds, it frees nobody else's."""
    real = store.holder("real") or store.acquire("real", owner="real-owner", ttl=TTL)
    assert real is not None
    now = datetime.now(timezone.utc)
    forged = Lease(key, owner, token, ttl, now, now, now + TTL, None, now)
    before = rows()
    for call in (store.renew, store.release):
        try:
            result = call(forged)
        except InvalidArgument as exc:
            refused(exc, "key", "owner", "token", "ttl")
            continue
        assert not result, f"{call.__name__} of a forged lease succeeded: {forged}"
    assert rows() == before
    still = store.holder("real")
    assert still is not None and still.token == real.token


@PROPERTY
@given(key=names, by=names, reason=st.one_of(st.text(max_size=40), junk))
@example(key="job", by="admin", reason="a\x00b")
def test_force_release_frees_and_leaves_a_trace_or_refuses_and_writes_nothing(
    store: LeaseStore, rows: Rows, key: Any, by: Any, reason: Any
) -> None:
    if is_name(key):
        store.acquire(key, owner="holder", ttl=TTL)
    before = rows()
    try:
        previous = store.force_release(key, by=by, reason=reason)
    except InvalidArgument as exc:
        refused(exc, "key", "by", "reason")
        assert rows() == before
        return
    if not is_name(key):
        # A name acquire refuses (an invisible character, whitespace at an end) can still be looked up
        # and force-released, for rows older versions wrote: there is none here, so nothing happens.
        assert previous is None and rows() == before
        return
    assert previous is not None and previous.key == unicodedata.normalize("NFC", key)
    # An admin action that leaves no record is worse than one refused: the ledger must have it.
    trace = store.events.query(key=key, kind=EventKind.FORCE_RELEASED, limit=1)
    assert trace and trace[0].detail["by"] == by, f"force_release({key!r}, reason={reason!r}) left no event"


class FenceModel:
    """What the fence must decide: per (resource, lease key) a larger token, or the largest again from the
    owner it was accepted from (the same grant, publishing again); each idempotency key once per resource,
    whatever the lease key."""

    def __init__(self) -> None:
        self.top: dict[tuple[str, str], int] = {}
        self.owner: dict[tuple[str, str], str | None] = {}
        self.used: set[tuple[str, str]] = set()

    def decide(self, resource: str, token: int, idem: str | None, key: str = "job", owner: str | None = None) -> str:
        if idem is not None and (resource, idem) in self.used:
            return "duplicate"
        top = self.top.get((resource, key), 0)
        same_grant = token == top and owner is not None and self.owner.get((resource, key)) == owner
        if token < top or (token == top and not same_grant):
            return "stale"
        self.top[(resource, key)] = token
        self.owner[(resource, key)] = owner
        if idem is not None:
            self.used.add((resource, idem))
        return "accepted"


@PROPERTY
# Found by the search in a full run: a key with a control character (accepted: a lease key is looked up as stored).
@example(calls=[("r1", 1, None, None, None), ("r1", 1, None, None, "\x1b")])
@given(calls=st.lists(
    st.tuples(
        st.one_of(st.sampled_from(["r1", "r2"]), names),
        st.one_of(st.integers(min_value=1, max_value=12), tokens),
        st.one_of(st.none(), names),
        st.one_of(st.none(), st.sampled_from(["slot-1", "slot-2"]), names),
        st.one_of(st.sampled_from(["k1", "k2"]), names),
    ),
    max_size=8,
))
def test_fence_decisions_follow_the_model_and_refusals_write_nothing(
    fences: FenceStore, rows: Rows, calls: list[tuple[Any, Any, Any, Any, Any]]
) -> None:
    model = FenceModel()
    run = uuid.uuid4().hex[:8]  # examples share the schema: each gets resources of its own
    for resource, token, owner, idem, key in calls:
        resource = f"{run}:{resource}" if isinstance(resource, str) and len(resource) < 400 else resource
        before = rows()
        try:
            decision = fences.advance(resource, token, key=key, owner=owner, idempotency_key=idem)
        except InvalidArgument as exc:
            refused(exc, "resource", "key", "token", "owner", "idempotency_key")
            assert rows() == before
            continue
        # The resource is a name (refused characters and all); the key is a lease key looked up as stored
        # (validation.lookup_name, as since 1365729: a lease written before names were checked can still
        # publish), so a key with a control character is accepted here, and never granted by a store.
        assert is_name(resource) and is_lookup_name(key) and is_token(token)
        resource, key = unicodedata.normalize("NFC", resource), unicodedata.normalize("NFC", key)  # as the store keeps them
        assert decision.outcome == model.decide(resource, token, idem, key, owner), (resource, token, idem, key)
        assert fences.current(resource, key=key) == model.top.get((resource, key))


@PROPERTY
@given(renew_every=st.one_of(st.none(), durations), safety_margin=st.one_of(st.none(), durations))
@example(renew_every=None, safety_margin=5)
@example(renew_every=None, safety_margin=False)
def test_keeper_arguments_are_validated(store: LeaseStore, renew_every: Any, safety_margin: Any) -> None:
    lease = store.acquire("kept", owner="keeper", ttl=timedelta(seconds=30))
    assert lease is not None
    try:
        keeper = LeaseKeeper(store, lease, renew_every=renew_every, safety_margin=safety_margin)
    except InvalidArgument as exc:
        refused(exc, "renew_every", "safety_margin")
        return
    assert timedelta(0) < keeper.renew_every < lease.ttl
    assert timedelta(0) <= keeper.safety_margin < lease.ttl


@PROPERTY
@given(
    kind=st.one_of(st.sampled_from(list(EventKind)), st.sampled_from([k.value for k in EventKind]), names),
    key=names,
    owner=st.one_of(st.none(), names),
    token=st.one_of(st.none(), tokens),
    detail=st.one_of(
        st.none(),
        st.dictionaries(st.text(max_size=8), st.one_of(st.text(max_size=16), st.integers(), st.floats(), st.none()),
                        max_size=3),
        junk,
    ),
)
@example(kind="acquired", key="k", owner=None, token=2**64, detail=None)
@example(kind="acquired", key="k", owner=None, token=True, detail=None)
@example(kind="acquired", key="k", owner=None, token=None, detail={"reason": "a\x00b"})
@example(kind="acquired", key="k", owner=None, token=None, detail={"x": float("nan")})
def test_event_record_stores_the_event_or_refuses_it(
    store: LeaseStore, rows: Rows, kind: Any, key: Any, owner: Any, token: Any, detail: Any
) -> None:
    store.ensure_schema()
    before = rows()
    try:
        recorded = store.events.record(kind, key, owner=owner, token=token, detail=detail)
    except InvalidArgument as exc:
        refused(exc, "kind", "key", "owner", "token", "detail")
        assert rows() == before
        return
    # The store is up: False would mean a bad argument was dropped silently instead of refused.
    assert recorded is True, f"record({kind!r}, {key!r}, owner={owner!r}, token={token!r}, detail={detail!r})"


@PROPERTY
@given(
    key=st.one_of(st.none(), names),
    kind=st.one_of(st.none(), st.sampled_from(list(EventKind)), names),
    since=st.one_of(st.none(), st.datetimes(timezones=st.just(timezone.utc)), junk),
    until=st.one_of(st.none(), st.datetimes(timezones=st.just(timezone.utc)), junk),
    limit=st.one_of(st.integers(min_value=-5, max_value=20_000), junk),
)
@example(key=None, kind=None, since="yesterday", until=None, limit=10)
@example(key=None, kind=None, since=None, until=5, limit=10)
def test_event_query_answers_or_refuses(store: LeaseStore, key: Any, kind: Any, since: Any, until: Any, limit: Any) -> None:
    store.ensure_schema()
    try:
        events = store.events.query(key=key, kind=kind, since=since, until=until, limit=limit)
    except InvalidArgument as exc:
        refused(exc, "key", "kind", "since", "until", "limit")
        return
    assert isinstance(events, list)


@PROPERTY
@given(limit=st.one_of(st.integers(min_value=-5, max_value=2**70), junk))
@example(limit=-1)
@example(limit=True)
@example(limit="10")
@example(limit=2**70)
def test_listing_leases_answers_or_refuses(store: LeaseStore, limit: Any) -> None:
    store.ensure_schema()
    try:
        leases = store.leases(limit=limit)
    except InvalidArgument as exc:
        refused(exc, "limit")
        return
    assert isinstance(leases, list)


@PROPERTY
@given(
    schema=st.one_of(st.from_regex(r"\A[a-z_][a-z0-9_]{0,62}\Z"), names),
    connect_timeout=durations, statement_timeout=durations, event_retention=durations,
)
def test_store_settings_are_validated_before_anything_is_created(
    pg_dsn: str, schema: Any, connect_timeout: Any, statement_timeout: Any, event_retention: Any
) -> None:
    for cls in (LeaseStore, FenceStore):
        try:
            store = cls(
                pg_dsn, schema=schema, connect_timeout=connect_timeout, statement_timeout=statement_timeout,
                event_retention=event_retention,
            )
        except InvalidArgument as exc:
            refused(exc, "schema", "connect_timeout", "statement_timeout", "retention")
            continue
        assert isinstance(schema, str) and not schema.startswith("pg_")
        for value in (connect_timeout, statement_timeout, event_retention):
            assert isinstance(value, timedelta) and value > timedelta(0)
        store.close()


# -- a stateful model of the whole store -------------------------------------------------------------


def test_leases_and_fences_follow_a_model_through_random_operations(
    store: LeaseStore, fences: FenceStore, rows: Rows
) -> None:
    """Random sequences of acquire, renew, release, force_release, holder, fence advance and fenced
    transactions (some failing inside), with invalid calls mixed in, against a model of the rules."""

    class Machine(RuleBasedStateMachine):
        leases = Bundle("leases")

        def __init__(self) -> None:
            super().__init__()
            self.run = uuid.uuid4().hex[:8]  # machines share the schema: each gets keys of its own
            self.holders: dict[str, tuple[str, int] | None] = {}
            self.tokens: dict[str, int] = {}
            self.fence = FenceModel()

        def k(self, key: str) -> str:
            return f"{self.run}:{key}"

        @rule(target=leases, key=st.sampled_from("abc"), owner=st.sampled_from(["o1", "o2", "o3"]))
        def acquire(self, key: str, owner: str) -> Lease | None:
            key = self.k(key)
            got = store.try_acquire(key, owner, TTL)
            holder = self.holders.get(key)
            if holder is None or holder[0] == owner:
                assert got.lease is not None and got.lease.token == self.tokens.get(key, 0) + 1
                self.tokens[key] = got.lease.token
                self.holders[key] = (owner, got.lease.token)
                return got.lease
            assert got.lease is None and got.holder is not None
            assert (got.holder.owner, got.holder.token) == holder
            return None

        @rule(lease=leases)
        def renew(self, lease: Lease | None) -> None:
            if lease is not None:
                renewed = store.renew(lease)
                assert (renewed is not None) == (self.holders.get(lease.key) == (lease.owner, lease.token))

        @rule(lease=consumes(leases))
        def release(self, lease: Lease | None) -> None:
            if lease is not None:
                current = self.holders.get(lease.key) == (lease.owner, lease.token)
                assert store.release(lease) is current
                if current:
                    self.holders[lease.key] = None

        @rule(key=st.sampled_from("abc"))
        def force_release(self, key: str) -> None:
            key = self.k(key)
            previous = store.force_release(key, by="model")
            if key not in self.tokens:
                assert previous is None
                return
            assert previous is not None and previous.token == self.tokens[key]
            self.tokens[key] += 1
            self.holders[key] = None

        @rule(key=st.sampled_from("abc"))
        def holder(self, key: str) -> None:
            key = self.k(key)
            current = store.holder(key)
            expected = self.holders.get(key)
            assert (None if current is None else (current.owner, current.token)) == expected

        @rule(resource=st.sampled_from(["x", "y"]), token=st.integers(1, 8), idem=st.sampled_from([None, "s1", "s2"]),
              key=st.sampled_from(["a", "b"]))
        def advance(self, resource: str, token: int, idem: str | None, key: str) -> None:
            resource = self.k(resource)
            decision = fences.advance(resource, token, key=key, idempotency_key=idem)
            assert decision.outcome == self.fence.decide(resource, token, idem, key)

        @rule(resource=st.sampled_from(["x", "y"]), token=st.integers(1, 8), idem=st.sampled_from([None, "s1", "s2"]),
              fail=st.booleans(), key=st.sampled_from(["a", "b"]))
        def transaction(self, resource: str, token: int, idem: str | None, fail: bool, key: str) -> None:
            resource = self.k(resource)
            probe = FenceModel()
            probe.top, probe.used = dict(self.fence.top), set(self.fence.used)
            expected = probe.decide(resource, token, idem, key)
            try:
                with fences.transaction(resource, token, key=key, idempotency_key=idem):
                    if fail:
                        raise RuntimeError("the write failed")
            except DuplicatePublish:
                assert expected == "duplicate"
            except StaleFencingToken:
                assert expected == "stale"
            except RuntimeError:
                assert expected == "accepted" and fail  # rolled back: the model keeps its old state
            else:
                assert expected == "accepted" and not fail
                self.fence = probe

        @rule(bad=st.sampled_from([("key", ""), ("key", "x" * 513), ("owner", "a\x00"), ("ttl", timedelta(0)),
                                   ("ttl", 60), ("token", 0), ("token", MAX_TOKEN + 1), ("resource", None)]))
        def invalid(self, bad: tuple[str, Any]) -> None:
            parameter, value = bad
            before = rows()
            with pytest.raises(InvalidArgument) as info:
                if parameter in ("token", "resource"):
                    args = {"resource": self.k("x"), "token": 1, parameter: value}
                    fences.advance(args["resource"], args["token"], key="a")
                else:
                    args = {"key": self.k("a"), "owner": "o1", "ttl": TTL, parameter: value}
                    store.try_acquire(args["key"], args["owner"], args["ttl"])
            assert info.value.parameter == parameter
            assert rows() == before

        @invariant()
        def fence_matches(self) -> None:
            for (resource, key), top in self.fence.top.items():
                assert fences.current(resource, key=key) == top

    run_state_machine_as_test(
        Machine,
        settings=settings(max_examples=25, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]),
    )
