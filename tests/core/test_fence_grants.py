"""The fence and the grant a token belongs to (issue 23, items 4, 5, 8, 9 and the force-release note).

- The holder of a grant may publish again with its token (an equal token from the same owner of the same
  lease store); any other holder's equal or older token is still refused.
- An external publish's idempotency claim is given back when its side effect fails.
- A fence kept in a database without a lease store creates only the fence there.
- A fence tells a token from a recreated lease store, and the store can be told the floor.
- A fence kept in the issuing lease store refuses a token below the key's newest grant.
"""

from __future__ import annotations

from datetime import timedelta

import psycopg2
import pytest
from psycopg2 import sql

from airflow_lease_provider.core import (
    DuplicatePublish,
    EventKind,
    FenceStore,
    InvalidArgument,
    LeaseStore,
    SchemaError,
    StaleFencingToken,
)
from airflow_lease_provider.core.schema import (
    FENCE_ONLY_VERSION,
    SchemaMissing,
    drop_schema,
    fence_migrations,
    fence_schema_sql,
    latest_version,
)
from tests.pg import drop_schema as drop_pg_schema
from tests.pg import execute, new_schema_name, q, store_at_version

TTL = timedelta(minutes=5)


@pytest.fixture
def target(pg_dsn: str) -> FenceStore:
    """A fence kept in a schema of its own: a write target without a lease store."""
    name = new_schema_name()
    fences = FenceStore(pg_dsn, schema=name, fence_only=True)
    yield fences
    fences.close()
    drop_pg_schema(pg_dsn, name)


def _tables(dsn: str, schema: str) -> list[str]:
    rows = execute(dsn, "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (schema,))
    return [r[0] for r in rows]


# -- item 4: the holder of a grant publishes again -----------------------------------------------------


def test_the_holder_of_a_grant_publishes_again_and_every_other_token_is_refused(
    store: LeaseStore, fences: FenceStore
) -> None:
    lease = store.acquire("billing", "etl/run-1", TTL)
    assert lease is not None
    me = {"key": lease.key, "owner": lease.owner, "store_id": store.store_id}
    for _ in range(3):  # a second FencedSQLOperator, a mapped instance, a second fence() of one task
        assert fences.advance("warehouse", lease.token, **me).accepted
    with fences.transaction("warehouse", lease.token, **me) as cur:
        cur.execute("SELECT 1")
    assert fences.current("warehouse", key="billing") == lease.token
    # The same token from another owner, from no owner, or from another store: not this grant.
    assert fences.advance("warehouse", lease.token, key="billing", owner="etl/run-0").outcome == "stale"
    assert fences.advance("warehouse", lease.token, key="billing").outcome == "stale"
    other_store = "00000000-0000-4000-8000-000000000000"
    assert fences.advance(
        "warehouse", lease.token, key="billing", owner=lease.owner, store_id=other_store
    ).outcome == ("stale")
    # A retry of the same owner is a new grant: its larger token wins, and the earlier try is refused.
    retry = store.acquire("billing", "etl/run-1", TTL)
    assert retry is not None and retry.token > lease.token
    assert fences.advance("warehouse", retry.token, **me).accepted
    with pytest.raises(StaleFencingToken) as refused:
        fences.guard("warehouse", lease.token, **me)
    assert refused.value.current == retry.token
    rejected = fences.events.query(kind=EventKind.FENCE_REJECTED)
    assert sorted(e.owner or "" for e in rejected) == ["", "etl/run-0", "etl/run-1", "etl/run-1"]
    assert all(e.token == lease.token for e in rejected), "a valid publish was recorded as a rejection"


def test_an_idempotency_key_still_publishes_once_for_the_same_holder(fences: FenceStore) -> None:
    assert fences.accept("billing", 4, key="close", owner="etl/run-1", idempotency_key="2026-11-29")
    assert fences.accept("billing", 4, key="close", owner="etl/run-1", idempotency_key="2026-11-30")
    with pytest.raises(DuplicatePublish):
        fences.guard("billing", 4, key="close", owner="etl/run-1", idempotency_key="2026-11-29")


def test_a_bad_store_id_is_refused_naming_the_parameter(fences: FenceStore) -> None:
    for bad in ("not-a-uuid", 5, ""):
        with pytest.raises(InvalidArgument) as info:
            fences.advance("blog", 1, key="job", store_id=bad)  # type: ignore[arg-type]
        assert info.value.parameter == "store_id"
    assert fences.current("blog", key="job") is None


# -- item 5: an external publish whose side effect fails gives its claim back ---------------------------


def test_a_failed_side_effect_gives_the_idempotency_claim_back(fences: FenceStore) -> None:
    publish = {"key": "site", "owner": "site/run-1", "idempotency_key": "slot-7"}
    with pytest.raises(ConnectionError):
        with fences.guard("git:site", 3, **publish):
            raise ConnectionError("git push: the remote hung up")
    # The retry (the same grant, or a later one) publishes the slot; a success keeps the claim.
    with fences.guard("git:site", 3, **publish) as decision:
        assert decision.accepted
    with pytest.raises(DuplicatePublish):
        fences.guard("git:site", 4, key="site", owner="site/run-2", idempotency_key="slot-7")
    rows = execute(fences.db.dsn, q("SELECT token, owner FROM {schema}.fence_publish", fences.schema))
    assert [tuple(r) for r in rows] == [(3, "site/run-1")]


def test_giving_a_claim_back_never_frees_another_publishes_claim(fences: FenceStore) -> None:
    first = fences.guard("git:site", 3, key="site", owner="site/run-1", idempotency_key="slot-8")
    # Someone deletes the claim by hand and a later holder publishes the slot meanwhile.
    execute(fences.db.dsn, q("DELETE FROM {schema}.fence_publish", fences.schema))
    assert fences.accept("git:site", 4, key="site", owner="site/run-2", idempotency_key="slot-8")
    assert first.release() is False
    with pytest.raises(DuplicatePublish):
        fences.guard("git:site", 5, key="site", owner="site/run-3", idempotency_key="slot-8")



@pytest.mark.parametrize("where", ["store", "fence_only"])
def test_a_claim_is_given_back_only_by_a_grant_of_its_own_lease_key(
    fences: FenceStore, target: FenceStore, where: str
) -> None:
    """Issue 41's attack, at the store: a grant of another lease key with the claim's owner name and token
    (owners are free text; every key's tokens start at the same floor) names the claim in a give-back (the
    call POST /lease/v1/fence/give_back makes): the claim stays, and the slot is still refused to every later
    publish. The grant that made the claim gives it back."""
    fence = fences if where == "store" else target
    claim = {"resource": "exports", "idempotency_key": "2026-12-07", "token": 3, "owner": "victim-task"}
    assert fence.accept("exports", 3, key="victim-key", owner="victim-task", idempotency_key="2026-12-07")
    assert fence._give_back({**claim, "key": "attacker-key"}) is False
    assert fence.published("exports", "2026-12-07")
    rows = execute(fence.db.dsn, q("SELECT key, token, owner FROM {schema}.fence_publish", fence.schema))
    assert [tuple(r) for r in rows] == [("victim-key", 3, "victim-task")]
    with pytest.raises(DuplicatePublish):
        fence.guard("exports", 3, key="attacker-key", owner="victim-task", idempotency_key="2026-12-07")
    assert fence._give_back({**claim, "key": "victim-key"}) is True
    assert not fence.published("exports", "2026-12-07")


# -- item 8: a write target gets only the fence ---------------------------------------------------------


def test_a_fence_only_target_holds_the_fence_and_nothing_else(target: FenceStore, pg_dsn: str) -> None:
    assert target.accept("warehouse", 2, key="etl", owner="etl/run")
    assert _tables(pg_dsn, target.schema) == ["fence", "fence_count_epoch", "fence_publish", "fence_schema_version"]
    with target.transaction("warehouse", 2, key="etl", owner="etl/run", idempotency_key="s") as cur:
        cur.execute("SELECT 1")
    assert target.advance("warehouse", 1, key="etl").outcome == "stale"
    assert target.tokens("warehouse") == {"etl": 2}
    # A lease store pointed at it is refused with a clear error, and nothing is changed there.
    with pytest.raises(SchemaError, match="holds only fences"):
        LeaseStore(pg_dsn, schema=target.schema).ensure_schema()
    with pytest.raises(SchemaMissing, match="holds only fences"):
        LeaseStore(pg_dsn, schema=target.schema, read_only=True).leases()
    assert _tables(pg_dsn, target.schema) == ["fence", "fence_count_epoch", "fence_publish", "fence_schema_version"]


def test_a_target_that_already_has_the_whole_schema_keeps_it(store: LeaseStore, pg_dsn: str) -> None:
    """A target database where an older version created the whole store: used and migrated, nothing dropped."""
    store.ensure_schema()
    before = _tables(pg_dsn, store.schema)
    fences = FenceStore(pg_dsn, schema=store.schema, fence_only=True)
    try:
        assert fences.accept("warehouse", 1, key="etl", owner="o")
    finally:
        fences.close()
    assert _tables(pg_dsn, store.schema) == before and "lease" in before and "event" in before


def test_the_fence_only_layout_has_the_stores_fence_tables(
    target: FenceStore, store: LeaseStore, pg_dsn: str
) -> None:
    target.ensure_schema()
    store.ensure_schema()
    columns = (
        "SELECT table_name, column_name, data_type, is_nullable, column_default, ordinal_position"
        " FROM information_schema.columns WHERE table_schema = %s AND table_name IN ('fence', 'fence_count_epoch', 'fence_publish')"
        " ORDER BY 1, 6"
    )
    functions = (
        "SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid) FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s AND p.proname LIKE 'fence%%'"
        " AND p.pronargs <> 5 ORDER BY 1, 2, 3"
    )
    assert execute(pg_dsn, columns, (target.schema,)) == execute(pg_dsn, columns, (store.schema,))
    assert execute(pg_dsn, functions, (target.schema,)) == execute(pg_dsn, functions, (store.schema,))
    # fence_token is the same code in both files (fence_advance differs by the newest-grant check only).
    body = (
        "SELECT p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s AND p.proname = 'fence_token'"
    )
    (own,), = execute(pg_dsn, body, (target.schema,))
    (full,), = execute(pg_dsn, body, (store.schema,))
    assert str(own).replace(target.schema, "{schema}") == str(full).replace(store.schema, "{schema}")


def test_rejections_of_a_fence_kept_elsewhere_go_to_the_lease_stores_ledger(
    store: LeaseStore, pg_dsn: str
) -> None:
    name = new_schema_name()
    fences = FenceStore(pg_dsn, schema=name, fence_only=True, ledger=store.events)
    try:
        assert fences.accept("warehouse", 5, key="etl", owner="etl/run-5")
        with pytest.raises(StaleFencingToken):
            fences.guard("warehouse", 4, key="etl", owner="etl/run-4")
        events = store.events.query(kind=EventKind.FENCE_REJECTED)
        assert [(e.key, e.token, e.owner, e.detail["current_token"]) for e in events] == [
            ("warehouse", 4, "etl/run-4", 5)
        ]
        assert name in events[0].detail["fence_at"]
    finally:
        fences.close()
        drop_pg_schema(pg_dsn, name)


# -- item 9: a recreated lease store ----------------------------------------------------------------------


def test_a_recreated_store_is_named_by_the_fence_and_told_its_floor(
    store: LeaseStore, target: FenceStore, pg_dsn: str
) -> None:
    for _ in range(3):
        lease = store.acquire("billing", "etl/run", TTL)
        assert lease is not None
        assert target.accept(
            "warehouse", lease.token, key="billing", owner=lease.owner, store_id=store.store_id
        )
    old_id = store.store_id
    store.close()
    drop_schema(store.db)  # the lease store is recreated: its tokens start at 1 again
    recreated = LeaseStore(pg_dsn, schema=store.schema)
    try:
        new = recreated.acquire("billing", "etl/run-2", TTL)
        assert new is not None and new.token == 1 and recreated.store_id != old_id
        with pytest.raises(StaleFencingToken) as refused:
            target.guard("warehouse", new.token, key="billing", owner=new.owner, store_id=recreated.store_id)
        assert refused.value.reason == "other_store"
        message = str(refused.value)
        assert "another lease store" in message and "airflow-lease failover --above 3" in message
        # The documented step: every token from now on is above the fence's.
        epoch = recreated.bump_epoch("store recreated", above=3)
        assert epoch.floor > 3
        assert recreated.release(new)
        again = recreated.acquire("billing", "etl/run-2", TTL)
        assert again is not None and again.token > 3
        assert target.accept(
            "warehouse", again.token, key="billing", owner=again.owner, store_id=recreated.store_id
        )
        with pytest.raises(InvalidArgument) as bad:
            recreated.bump_epoch("x", above=0)
        assert bad.value.parameter == "above"
    finally:
        recreated.close()


# -- the note: a fence kept in the issuing store refuses a token below the key's newest grant ------------


def test_after_a_force_release_the_old_holder_is_refused_by_a_fence_in_its_own_store(
    store: LeaseStore, fences: FenceStore
) -> None:
    old = store.acquire("forced-job", "dag/run-1/publish", TTL)
    assert old is not None
    assert fences.accept("blog", old.token, key=old.key, owner=old.owner, store_id=store.store_id)
    assert store.force_release("forced-job", by="admin") is not None
    # No later token has published to "blog" (nor anywhere): the old token is refused all the same.
    with pytest.raises(StaleFencingToken) as refused:
        fences.guard("feed", old.token, key=old.key, owner=old.owner, store_id=store.store_id)
    assert refused.value.reason == "superseded" and refused.value.newest == old.token + 1
    assert "granted again since" in str(refused.value)
    with pytest.raises(StaleFencingToken):
        with fences.transaction("blog", old.token, key=old.key, owner=old.owner, store_id=store.store_id):
            pass
    assert fences.current("feed", key=old.key) is None
    # Without the store's id the fence cannot know the token came from this store: it compares tokens only.
    assert fences.accept("feed", old.token, key=old.key, owner=old.owner)
    # The holder of the newest grant is accepted.
    new = store.acquire("forced-job", "dag/run-2/publish", TTL)
    assert new is not None
    assert fences.accept("blog", new.token, key=new.key, owner=new.owner, store_id=store.store_id)


def test_a_fence_elsewhere_never_compares_with_a_lease_table_that_is_not_the_issuers(
    store: LeaseStore, pg_dsn: str
) -> None:
    """Another store's lease table with the same key (a second deployment) never refuses a valid holder."""
    lease = store.acquire("etl", "etl/run", TTL)
    assert lease is not None
    other = LeaseStore(pg_dsn, schema=new_schema_name())
    try:
        for _ in range(5):
            assert other.acquire("etl", "someone", TTL) is not None
        fences = FenceStore(pg_dsn, schema=other.schema)
        assert fences.accept("warehouse", lease.token, key="etl", owner=lease.owner, store_id=store.store_id)
        fences.close()
    finally:
        other.close()
        drop_pg_schema(pg_dsn, other.schema)


def test_version_9s_fence_call_still_works_after_the_upgrade(store: LeaseStore, pg_dsn: str) -> None:
    store.ensure_schema()
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(
                q(
                    "SELECT outcome, current_token FROM {schema}.fence_advance('r', 'k', 3, 'o', NULL)",
                    store.schema,
                )
            )
            assert cur.fetchone() == ("accepted", 3)
            cur.execute(
                q(
                    "SELECT outcome, current_token FROM {schema}.fence_advance('r', 'k', 2, 'o', NULL)",
                    store.schema,
                )
            )
            assert cur.fetchone() == ("stale", 3)
    finally:
        conn.close()


def test_a_store_of_version_19_upgrades_and_its_keyless_claims_are_never_given_back(pg_dsn: str) -> None:
    """migrations/0020: a claim written before it names no lease key. Which grant made it cannot be told, so
    no give-back frees it, not even one naming the key that did (fail closed: the slot stays published until
    the row is deleted by hand); a claim written after it is given back by its own grant only."""
    name = new_schema_name()
    try:
        store_at_version(pg_dsn, name, 19)
        execute(pg_dsn, q("SELECT * FROM {schema}.fence_advance('exports', 'victim-key', 3, 'victim-task', 'old',"
                          " NULL::uuid, NULL::text, NULL::bigint)", name))
        fences = FenceStore(pg_dsn, schema=name)
        try:
            assert fences.ensure_schema() == latest_version() >= 20
            old = {"resource": "exports", "idempotency_key": "old", "token": 3, "owner": "victim-task"}
            assert fences._give_back({**old, "key": "attacker-key"}) is False
            assert fences._give_back({**old, "key": "victim-key"}) is False
            assert fences.published("exports", "old")
            with pytest.raises(DuplicatePublish):
                fences.guard("exports", 4, key="victim-key", owner="victim-task", idempotency_key="old")
            assert fences.accept("exports", 5, key="victim-key", owner="victim-task", idempotency_key="new")
            new = {"resource": "exports", "idempotency_key": "new", "token": 5, "owner": "victim-task"}
            assert fences._give_back({**new, "key": "attacker-key"}) is False
            assert fences._give_back({**new, "key": "victim-key"}) is True
        finally:
            fences.close()
        rows = execute(pg_dsn, q("SELECT idempotency_key, key, token FROM {schema}.fence_publish", name))
        assert [tuple(r) for r in rows] == [("old", None, 3)]
    finally:
        drop_pg_schema(pg_dsn, name)


def test_a_fence_only_target_of_version_15_upgrades_and_its_keyless_claims_are_never_given_back(
    pg_dsn: str,
) -> None:
    name = new_schema_name()
    try:
        execute(pg_dsn, sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        execute(pg_dsn, q(fence_schema_sql(), name))
        execute(pg_dsn, q("INSERT INTO {schema}.fence_schema_version (version, name) VALUES (10, 'fence_only')", name))
        for migration in fence_migrations():
            if migration.version <= 15:
                execute(pg_dsn, q(migration.sql, name))
                execute(pg_dsn, q("INSERT INTO {schema}.fence_schema_version (version, name) VALUES (%s, %s)", name),
                        (migration.version, migration.name))
        execute(pg_dsn, q("SELECT * FROM {schema}.fence_advance('exports', 'victim-key', 3, 'victim-task', 'old',"
                          " NULL::uuid, NULL::text, NULL::bigint)", name))
        fences = FenceStore(pg_dsn, schema=name, fence_only=True)
        try:
            assert fences.ensure_schema() == FENCE_ONLY_VERSION == 20
            old = {"resource": "exports", "idempotency_key": "old", "token": 3, "owner": "victim-task"}
            assert fences._give_back({**old, "key": "victim-key"}) is False
            assert fences.published("exports", "old")
            assert fences.accept("exports", 5, key="victim-key", owner="victim-task", idempotency_key="new")
            new = {"resource": "exports", "idempotency_key": "new", "token": 5, "owner": "victim-task"}
            assert fences._give_back({**new, "key": "attacker-key"}) is False
            assert fences._give_back({**new, "key": "victim-key"}) is True
        finally:
            fences.close()
        versions = execute(pg_dsn, q("SELECT version FROM {schema}.fence_schema_version ORDER BY 1", name))
        assert versions == [(10,), (15,), (20,)]
    finally:
        drop_pg_schema(pg_dsn, name)
