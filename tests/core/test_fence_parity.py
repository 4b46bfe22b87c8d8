"""One rule, three fences (issue 40 item 2): every fence decides as ``core.fencing.decide``, the reference.

Hypothesis draws what a fence holds for one (resource, lease key) (the largest accepted token with its owner
and lease store, the count epoch its holders told it, whether the idempotency key is claimed already) and a
publish (token, owner, store, idempotency key, count epoch). Each fence is given that state in its own
storage, written as its own publishes leave it, then asked to publish: the PostgreSQL store's fence
(``fence_advance``, plpgsql), the DB-API fence on a real SQLite file (its standard SQL), and the object
store's fence against the moto server process (its metadata and conditional PUT). Each must decide what
:func:`decide` decides: the outcome, the reason, the token it reports as current and the epoch or grant it
names. The pure rule's own cases are at the end.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg2 import sql

from airflow_lease_provider.core import DuplicatePublish, FenceStore, StaleFencingToken
from airflow_lease_provider.core.dbapi_fence import COUNT_EPOCH_TABLE, FENCE_TABLE, PUBLISH_TABLE, DbApiFence
from airflow_lease_provider.core.fencing import FenceDecision, FenceEntry, FenceState, decide
from tests.pg import drop_schema, new_schema_name

STORES = (None, str(uuid.UUID(int=1)), str(uuid.UUID(int=2)))
OWNERS = (None, "etl/run-a", "etl/run-b")
KEY = "job"
IDEM = "slot-1"

#: What a fence's storage holds: ``(entry, count epoch, claimed)``.
State = tuple[FenceEntry | None, int | None, bool]
#: A publish: ``(token, owner, store, idempotency key, count epoch)``.
Grant = tuple[int, str | None, str | None, str | None, int | None]
#: What a fence decided, as compared: ``(outcome, reason, current token, newest)``.
Seen = tuple[str, str, int | None, int | None]

entries = st.none() | st.builds(
    FenceEntry, st.integers(1, 6), st.sampled_from(OWNERS), st.sampled_from(STORES)
)
states = st.tuples(entries, st.none() | st.integers(0, 5), st.booleans())
grants = st.integers(1, 7).flatmap(
    lambda token: st.tuples(
        st.just(token), st.sampled_from(OWNERS), st.sampled_from(STORES), st.sampled_from((None, IDEM)),
        st.none() | st.integers(0, token - 1),
    )
)


def _seen(decision: FenceDecision) -> Seen:
    return decision.outcome, decision.reason, decision.current_token, decision.newest_grant


def _expected(resource: str, state: State, grant: Grant) -> Seen:
    entry, epoch, claimed = state
    token, owner, store, idem, count_epoch = grant
    return _seen(decide(
        FenceState(entry, epoch, claimed), resource=resource, key=KEY, token=token, owner=owner, store_id=store,
        idempotency_key=idem, count_epoch=count_epoch,
    ))


class SqlTarget:
    """A fence in SQL tables: how to write a state into them, and the fence that decides on them."""

    def __init__(self, fence: Any, connect: Callable[[], Any], tables: dict[str, Any], mark: str) -> None:
        self.fence = fence
        self.connect = connect
        self.tables = tables
        self.mark = mark

    def seed(self, resource: str, state: State) -> None:
        entry, epoch, claimed = state
        t, m = self.tables, self.mark
        conn = self.connect()
        try:
            cur = conn.cursor()
            if entry is not None:
                cur.execute(
                    t["fence"] + f" VALUES ({m}, {m}, {m}, {m}, {m}, CURRENT_TIMESTAMP)",
                    (resource, KEY, entry.token, entry.owner, entry.store_id),
                )
            if epoch is not None:
                cur.execute(t["count_epoch"] + f" VALUES ({m}, {m}, {m}, CURRENT_TIMESTAMP)", (resource, KEY, epoch))
            if claimed:
                cur.execute(t["publish"] + f" VALUES ({m}, {m}, 1, 'someone', CURRENT_TIMESTAMP)", (resource, IDEM))
            conn.commit()
        finally:
            conn.close()

    def publish(self, resource: str, grant: Grant) -> Seen:
        token, owner, store, idem, count_epoch = grant
        return _seen(self.fence.advance(
            resource, token, key=KEY, owner=owner, store_id=store, idempotency_key=idem, count_epoch=count_epoch,
            base_key=KEY if count_epoch is not None else None,
        ))


@pytest.fixture(scope="module")
def postgres(pg_dsn: str) -> Iterator[SqlTarget]:
    schema = new_schema_name()
    fence = FenceStore(pg_dsn, schema=schema, fence_only=True, record_events=False)
    fence.ensure_schema()
    conn = psycopg2.connect(pg_dsn)
    try:

        def insert(table: str, columns: str) -> str:
            return sql.SQL("INSERT INTO {}.{} (" + columns + ")").format(
                sql.Identifier(schema), sql.Identifier(table)
            ).as_string(conn)

        tables = {
            "fence": insert("fence", "resource, key, token, owner, store_id, accepted_at"),
            "count_epoch": insert("fence_count_epoch", "resource, key, count_epoch, accepted_at"),
            "publish": insert("fence_publish", "resource, idempotency_key, token, owner, published_at"),
        }
    finally:
        conn.close()
    yield SqlTarget(fence, lambda: psycopg2.connect(pg_dsn), tables, "%s")
    fence.close()
    drop_schema(pg_dsn, schema)


@pytest.fixture(scope="module")
def sqlite_file(tmp_path_factory: pytest.TempPathFactory) -> SqlTarget:
    path: Path = tmp_path_factory.mktemp("parity") / "target.db"

    def connect() -> sqlite3.Connection:
        return sqlite3.connect(path, timeout=30)

    fence = DbApiFence(connect, dialect="sqlite", where="parity sqlite", record_events=False)
    fence.ensure_schema()
    tables = {
        "fence": f'INSERT INTO "{FENCE_TABLE}" (resource, lease_key, token, owner, store_id, accepted_at)',
        "count_epoch": f'INSERT INTO "{COUNT_EPOCH_TABLE}" (resource, lease_key, count_epoch, accepted_at)',
        "publish": f'INSERT INTO "{PUBLISH_TABLE}" (resource, idempotency_key, token, owner, published_at)',
    }
    return SqlTarget(fence, connect, tables, "?")


class ObjectTarget:
    """The object store's fence: a state is an object whose metadata holds it (as the fence's own writes
    leave it) and, claimed, the idempotency key's marker object."""

    def __init__(self, moto: Any) -> None:
        from airflow_lease_provider.fences.s3 import FENCE_METADATA, ObjectFence

        self.client = moto.client()
        self.bucket = moto.bucket()
        self.fence = ObjectFence(self.client)
        self.metadata = FENCE_METADATA

    def seed(self, resource: str, state: State) -> None:
        entry, epoch, claimed = state
        name = resource.rsplit("/", 1)[1]
        if entry is not None or epoch is not None:
            keys = {} if entry is None else {KEY: {"t": entry.token, "o": entry.owner, "s": entry.store_id}}
            keys = {k: {f: v for f, v in item.items() if v is not None} for k, item in keys.items()}
            fence = {"v": 1, "k": keys, "l": KEY, "w": "seed", **({"e": {KEY: epoch}} if epoch is not None else {})}
            self.client.put_object(
                Bucket=self.bucket, Key=name, Body=b"seed", Metadata={self.metadata: json.dumps(fence)}
            )
        if claimed:
            record = json.dumps({"write": "someone else's"}).encode()
            self.client.put_object(Bucket=self.bucket, Key=self.fence.marker_key(name, IDEM), Body=record)

    def publish(self, resource: str, grant: Grant) -> Seen:
        token, owner, store, idem, count_epoch = grant
        name = resource.rsplit("/", 1)[1]
        try:
            self.fence.put(
                self.bucket, name, f"token {token}", token=token, lease_key=KEY, owner=owner, store_id=store,
                idempotency_key=idem, count_epoch=count_epoch,
            )
        except DuplicatePublish as exc:
            return "duplicate", "duplicate", exc.current, None
        except StaleFencingToken as exc:
            return _object_refusal(exc)
        return "accepted", "accepted", self.fence.current(resource, key=KEY), None


def _object_refusal(exc: StaleFencingToken) -> Seen:
    """A refusal raised by the object fence, as a decision: ``raise_if_rejected`` reports, for a count epoch
    named by another store's holders, the larger of the fence's token and the epoch as current."""
    if exc.reason == "other_store" and exc.newest is not None:
        return "count_epoch", "other_store", exc.current, exc.newest
    outcome = "stale" if exc.reason == "other_store" else exc.reason
    return outcome, exc.reason, exc.current, exc.newest


def _as_raised(seen: Seen) -> Seen:
    """What :meth:`FenceDecision.raise_if_rejected` would carry for ``seen``: the current token of a count
    epoch refusal from another store is the larger of the two."""
    outcome, reason, current, newest = seen
    if outcome == "count_epoch" and reason == "other_store" and newest is not None:
        return outcome, reason, max(current or 0, newest), newest
    return seen


@pytest.fixture(scope="module")
def object_store() -> Iterator[ObjectTarget]:
    pytest.importorskip("botocore")
    from tests.s3 import MotoServer

    with MotoServer() as server:
        yield ObjectTarget(server)


@pytest.fixture(params=["postgres", "sqlite", "s3"])
def target(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue({"postgres": "postgres", "sqlite": "sqlite_file", "s3": "object_store"}[request.param])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states, grant=grants)
def test_every_fence_decides_as_the_rule(target: Any, state: State, grant: Grant) -> None:
    resource = f"s3://{target.bucket}/{uuid.uuid4().hex}" if isinstance(target, ObjectTarget) else uuid.uuid4().hex
    target.seed(resource, state)
    expected = _expected(resource, state, grant)
    if isinstance(target, ObjectTarget):
        expected = _as_raised(expected)  # it raises its refusals
    assert target.publish(resource, grant) == expected, (state, grant)


# -- the rule itself ------------------------------------------------------------------------------------------

A, B = STORES[1], STORES[2]


@pytest.mark.parametrize(
    ("state", "publish", "outcome", "reason"),
    [
        (FenceState(), {"token": 1}, "accepted", "accepted"),
        (FenceState(FenceEntry(5)), {"token": 6}, "accepted", "accepted"),
        (FenceState(FenceEntry(5)), {"token": 5}, "stale", "stale"),  # no owner: never the same grant
        (FenceState(FenceEntry(5, "o")), {"token": 5, "owner": "o"}, "accepted", "accepted"),
        (FenceState(FenceEntry(5, "o", A)), {"token": 5, "owner": "o", "store_id": B}, "stale", "other_store"),
        (FenceState(FenceEntry(5, "o", A)), {"token": 5, "owner": "o"}, "accepted", "accepted"),
        (FenceState(FenceEntry(5, "o")), {"token": 4, "owner": "o"}, "stale", "stale"),
        (FenceState(FenceEntry(5), claimed=True), {"token": 9, "idempotency_key": "k"}, "duplicate", "duplicate"),
        (FenceState(FenceEntry(5), claimed=True), {"token": 9}, "accepted", "accepted"),  # no key: no claim
        (FenceState(count_epoch=6), {"token": 6, "count_epoch": 2}, "count_epoch", "count_epoch"),
        (FenceState(count_epoch=6), {"token": 6}, "accepted", "accepted"),  # names none: not checked
        (FenceState(FenceEntry(3), newest_grant=4), {"token": 3}, "superseded", "superseded"),
        (FenceState(store_count_epoch=4), {"token": 4}, "count_epoch", "count_epoch"),
        (FenceState(floor=FenceEntry(7)), {"token": 7}, "stale", "stale"),
        (FenceState(floor=FenceEntry(7)), {"token": 8}, "accepted", "accepted"),
    ],
)
def test_the_rule(state: FenceState, publish: dict[str, Any], outcome: str, reason: str) -> None:
    decision = decide(state, resource="r", key=KEY, **publish)
    assert (decision.outcome, decision.reason) == (outcome, reason)
    assert decision.current_token == (publish["token"] if decision.accepted else (
        None if (state.entry or state.floor) is None else (state.entry or state.floor).token  # type: ignore[union-attr]
    ))


def test_an_accepted_publish_keeps_the_store_it_knows() -> None:
    from airflow_lease_provider.core.fencing import advanced

    assert advanced(None, 3, "o", A) == FenceEntry(3, "o", A)
    assert advanced(FenceEntry(3, "o", A), 4, "p", B) == FenceEntry(4, "p", B)
    assert advanced(FenceEntry(3, "o", A), 3, "o", None) == FenceEntry(3, "o", A)
    assert advanced(FenceEntry(3, "o", None), 3, "o", B) == FenceEntry(3, "o", B)
