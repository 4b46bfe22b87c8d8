"""The run columns of the event ledger (migration 0007): what writes them, what reads them, old rows."""

from __future__ import annotations

import json
from datetime import timedelta

import psycopg2
import pytest

from airflow_lease_provider.core import EventKind, FenceStore, InvalidArgument, LeaseStore, StaleFencingToken
from airflow_lease_provider.core import schema as core_schema
from airflow_lease_provider.core.db import Database
from airflow_lease_provider.core.history import LeaseHistory
from airflow_lease_provider.core.identity import RunRef
from tests.pg import execute, q, store_at_version

TASK = RunRef("etl", "manual__2026-12-01T10:00:00+00:00", 2, task_id="load")
OTHER = RunRef("etl", "manual__2026-12-02T10:00:00+00:00", task_id="load")


def _columns(pg_dsn: str, schema: str) -> dict[str, list[tuple[object, ...]]]:
    """Every event's run columns, by kind, oldest first."""
    rows = execute(pg_dsn, q("SELECT kind, dag_id, run_id, task_id, map_index FROM {schema}.event ORDER BY id", schema))
    by_kind: dict[str, list[tuple[object, ...]]] = {}
    for kind, *columns in rows:
        by_kind.setdefault(str(kind), []).append(tuple(columns))
    return by_kind


def test_every_event_the_store_keeper_and_fence_write_carries_the_run_passed(
    store: LeaseStore, fences: FenceStore, pg_dsn: str, schema: str
) -> None:
    columns = (TASK.dag_id, TASK.run_id, "load", 2)
    ttl = timedelta(seconds=3)
    lease = store.acquire("job", TASK.owner(), ttl, run=TASK)
    assert lease is not None
    assert store.release(lease, run=TASK)

    lease = store.acquire("job", TASK.owner(), ttl, run=TASK)
    assert lease is not None
    keeper = store.keep(lease, renew_every=timedelta(seconds=0.5), run=TASK)
    store.force_release("job", by="test", expected_token=lease.token, run=TASK)
    assert keeper.wait_lost(timeout=10)  # the renewal after the force-release is refused
    keeper.stop()  # waits for the keeper's own "lost" event

    assert fences.accept("blog", 10, key="job", run=TASK)
    with pytest.raises(StaleFencingToken):
        fences.guard("blog", 9, key="job", owner=TASK.owner(), run=TASK)

    found = _columns(pg_dsn, schema)
    for kind in (EventKind.ACQUIRED, EventKind.RELEASED, EventKind.FORCE_RELEASED, EventKind.LOST,
                 EventKind.FENCE_REJECTED):
        assert found[kind.value] and set(found[kind.value]) == {columns}, (kind, found)


def test_a_run_scoped_ref_has_no_task_and_a_null_map_index(store: LeaseStore, pg_dsn: str, schema: str) -> None:
    run = TASK.run
    assert store.acquire("nightly", run.owner(), timedelta(seconds=30), run=run) is not None
    assert _columns(pg_dsn, schema)["acquired"] == [(run.dag_id, run.run_id, None, None)]
    (event,) = store.run_events(run.dag_id, run.run_id)
    assert event.run == run and event.to_dict()["map_index"] is None


def test_a_core_user_passing_no_run_gets_null_columns_and_no_guess_from_the_owner(
    store: LeaseStore, pg_dsn: str, schema: str
) -> None:
    # An owner that looks like a run's: the core does not parse it into a run.
    lease = store.acquire("job", TASK.owner(), timedelta(seconds=30))
    assert lease is not None
    store.events.record(EventKind.WAITING, "job", owner=TASK.owner(), detail={"dag_id": "etl", "run_id": TASK.run_id})
    assert set(_columns(pg_dsn, schema)["acquired"] + _columns(pg_dsn, schema)["waiting"]) == {(None, None, None, None)}
    assert store.run_events(TASK.dag_id, TASK.run_id) == []
    assert all(e.run is None for e in store.events.query(key="job"))


def test_the_events_of_a_run_are_selected_by_its_columns_and_read_by_name(store: LeaseStore) -> None:
    for ref in (TASK, OTHER, TASK.run):
        store.events.record(EventKind.SKIPPED_OVERLAP, "job", owner=ref.owner(), run=ref, detail={"n": 1})
    store.events.record(EventKind.SKIPPED_OVERLAP, "job", owner="a script")
    found = store.run_events(TASK.dag_id, TASK.run_id)
    assert [e.run for e in found] == [TASK.run, TASK]  # newest first, the other run's and the script's left out
    assert found[1].owner == TASK.owner() and found[1].detail == {"n": 1}
    page = store.event_page(key="job")
    assert [e.run for e in page] == [None, TASK.run, OTHER, TASK]
    assert page[1].to_dict() | {"at": None, "id": None} == {
        "id": None, "at": None, "kind": "skipped_overlap", "key": "job", "owner": TASK.run.owner(), "token": None,
        "detail": {"n": 1}, "dag_id": "etl", "run_id": TASK.run_id, "task_id": None, "map_index": None,
    }


def test_the_run_query_reads_the_run_index(store: LeaseStore, pg_dsn: str, schema: str) -> None:
    store.events.record(EventKind.WAITING, "job", owner=TASK.owner(), run=TASK)
    text = store.db.query_text("run_events", psycopg2.connect(pg_dsn))
    params = {"dag_id": "etl", "run_id": TASK.run_id, "since": None, "until": None, "limit": 10}
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SET LOCAL enable_seqscan = off")
            cur.execute("EXPLAIN " + text, params)
            plan = "\n".join(row[0] for row in cur.fetchall())
    finally:
        conn.close()
    assert "event_run_at_idx" in plan, plan


@pytest.mark.parametrize(
    "run",
    ["etl/run/load", RunRef("", "r"), RunRef("d", "r\x00"), RunRef("d", "r", -2, task_id="t"),
     RunRef("d", "r", task_id="")],
)
def test_a_bad_run_is_refused_and_nothing_written(store: LeaseStore, run: object) -> None:
    with pytest.raises(InvalidArgument, match="run"):
        store.events.record(EventKind.WAITING, "job", run=run)  # type: ignore[arg-type]
    assert store.events.query() == []


def test_holds_answers_for_the_owner_and_token_and_says_who_holds_instead(store: LeaseStore) -> None:
    assert store.holds("job", TASK.owner()).lease is None
    assert store.holds("job", TASK.owner()).who() == "nobody holds it"
    lease = store.acquire("job", TASK.owner(), timedelta(seconds=30))
    assert lease is not None
    mine = store.holds("job", TASK.owner()).lease
    assert mine is not None and (mine.owner, mine.token) == (lease.owner, lease.token)
    assert store.holds("job", TASK.owner(), token=lease.token).held
    assert not store.holds("job", TASK.owner(), token=lease.token + 1).held  # same owner, a later token
    other = store.holds("job", OTHER.owner())
    assert not other.held and other.lease is None and other.holder is not None and other.who().startswith(f"held by {TASK.owner()!r}")
    with pytest.raises(InvalidArgument, match="owner"):
        store.holds("job", "")


def test_migration_7_fills_in_the_events_written_before_it(
    pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    every = core_schema.migrations()
    assert every[6].version == 7
    store_at_version(pg_dsn, schema, 6)
    old = [
        # (kind, owner, detail) as version 6 wrote them
        ("acquired", "etl/r1/load[3]", {}),
        ("released", "etl/r1/load", {}),
        ("acquired", "etl/r1", {}),
        ("lost", "etl/r1/3", {}),  # an owner from before owners named the task
        ("skipped_overlap", "etl/r1/load", {"dag_id": "etl", "run_id": "r1", "task_id": "load", "map_index": 4}),
        ("skipped_catchup", "etl/r2", {"dag_id": "etl", "run_id": "r2", "count": 3}),
        ("acquired", "a script", {}),
        ("acquired", "a/b/c/d", {}),
        ("waiting", "x", {"dag_id": 7, "run_id": "r"}),  # a core user's detail: not a run's
        ("waiting", "x", {"dag_id": "d", "run_id": "r", "map_index": "zero"}),
    ]
    for kind, owner, detail in old:
        execute(
            pg_dsn, q("INSERT INTO {schema}.event (kind, key, owner, detail) VALUES (%s, 'job', %s, %s)", schema),
            (kind, owner, json.dumps(detail)),
        )
    monkeypatch.setattr(core_schema, "migrations", lambda: every[:7])
    assert core_schema.ensure_schema(Database(pg_dsn, schema=schema)) == 7
    rows = execute(pg_dsn, q("SELECT dag_id, run_id, task_id, map_index FROM {schema}.event ORDER BY id", schema))
    assert rows == [
        ("etl", "r1", "load", 3),
        ("etl", "r1", "load", -1),
        ("etl", "r1", None, None),
        ("etl", "r1", None, 3),
        ("etl", "r1", "load", 4),
        ("etl", "r2", None, None),
        (None, None, None, None),
        (None, None, None, None),
        (None, None, None, None),
        ("d", "r", None, None),
    ]
    # What the migration filled in is what RunRef.parse makes of the same owners.
    store = LeaseStore(pg_dsn, schema=schema)
    try:
        assert [e.run for e in reversed(store.run_events("etl", "r1"))] == [
            RunRef.parse("etl/r1/load[3]"), RunRef.parse("etl/r1/load"), RunRef.parse("etl/r1"),
            RunRef.parse("etl/r1/3"), RunRef("etl", "r1", 4, task_id="load"),
        ]
    finally:
        store.close()


def test_a_lease_names_its_holders_run_and_the_dag_scoping_reads_it_not_the_owner(store: LeaseStore) -> None:
    """The run the acquire passed is the lease's DAG (migration 0011), whatever its owner string says: the
    status pages, the DAG tab, the counts and the ledger's pages scope by the run columns."""
    run = RunRef("real", "r1", task_id="t")
    assert store.acquire("k1", "decoy/r1/t", timedelta(seconds=30), run=run) is not None
    assert store.acquire("k2", "real/r1/t", timedelta(seconds=30)) is not None  # a core user's: no run
    lease = store.lease("k1")
    assert lease is not None and lease.run == run
    assert [x.key for x in store.leases(dag_ids={"real"})] == ["k1"]
    assert store.leases(dag_ids={"decoy"}) == []
    assert [x.key for x in store.leases()] == ["k1", "k2"]
    assert [x.key for x in LeaseHistory(store).dag_leases("real")] == ["k1"]
    assert LeaseHistory(store).dag_leases("decoy") == []
    assert [(e.kind, e.key) for e in store.event_page(dag_ids={"real"})] == [("acquired", "k1")]
    assert store.event_page(dag_ids={"decoy"}) == []
    assert [(c.key, c.kind) for c in store.event_counts(dag_ids={"real"})] == [("k1", "acquired")]
    assert store.event_counts(dag_ids={"decoy"}) == []
    # A grant to another run moves the lease to that run's DAG.
    holder = store.acquire("k1", "decoy/r1/t", timedelta(seconds=30), run=RunRef("other", "r2", task_id="t"))
    assert holder is not None
    assert store.leases(dag_ids={"real"}) == [] and [x.key for x in store.leases(dag_ids={"other"})] == ["k1"]


def test_migration_11_fills_in_the_lease_run_columns_once_from_the_owners(pg_dsn: str, schema: str) -> None:
    """A store at version 10: its leases' run columns come from their owners (the one place an owner is
    read for a run), and the events version 7 left without a run get the DAG the reads gave them."""
    store_at_version(pg_dsn, schema, 10)
    owners = ["etl/r1/load[3]", "etl/r1", "etl/r1/3", "a script", "a/b/c/d", "b/r2/load"]
    for n, owner in enumerate(owners):
        execute(pg_dsn, q(
            "INSERT INTO {schema}.lease (key, owner, token, ttl, acquired_at, renewed_at, expires_at)"
            " VALUES (%s, %s, 1, '1 minute', now(), now(), now() + interval '1 minute')", schema), (f"k{n}", owner))
    insert = q("INSERT INTO {schema}.event (kind, key, owner, detail) VALUES ('waiting', 'job', %s, %s)", schema)
    execute(pg_dsn, insert, ("a/b/c/d", "{}"))
    execute(pg_dsn, insert, ("x", json.dumps({"dag_id": "d"})))
    execute(pg_dsn, insert, ("a script", "{}"))
    store = LeaseStore(pg_dsn, schema=schema)
    try:
        assert store.ensure_schema() == core_schema.latest_version()
        rows = execute(pg_dsn, q("SELECT key, dag_id, run_id, task_id, map_index FROM {schema}.lease ORDER BY key", schema))
        assert rows == [
            ("k0", "etl", "r1", "load", 3),
            ("k1", "etl", "r1", None, None),
            ("k2", "etl", "r1", None, 3),
            ("k3", None, None, None, None),
            ("k4", "a", "b", None, None),
            ("k5", "b", "r2", "load", -1),
        ]
        events = execute(pg_dsn, q("SELECT owner, dag_id, run_id FROM {schema}.event ORDER BY id", schema))
        assert events == [("a/b/c/d", "a", "b"), ("x", "d", ""), ("a script", None, None)]
        assert [x.key for x in store.leases(dag_ids={"etl"})] == ["k0", "k1", "k2"]
        assert [x.key for x in store.leases(dag_ids={"a", "b"})] == ["k4", "k5"]
        assert [e.owner for e in store.event_page(dag_ids={"a", "d"})] == ["x", "a/b/c/d"]
        # Filled once: a lease granted from now on takes the run its acquire names, or none.
        assert store.acquire("k1", "etl/r1", timedelta(seconds=30)) is not None  # its holder again, naming no run
        assert execute(pg_dsn, q("SELECT dag_id FROM {schema}.lease WHERE key = 'k1'", schema)) == [(None,)]
    finally:
        store.close()


def test_no_current_query_reads_a_run_out_of_an_owner() -> None:
    """The DAG of a row is its run columns: no query, and nothing in the current schema, splits or matches
    an owner string (only migration 0011 did, once, to fill in the old rows)."""
    from airflow_lease_provider.core.db import named_queries

    texts = {f"query {name}": text for name, text in named_queries().items()}
    texts["schema.sql"] = core_schema.current_schema_sql()
    texts["fence_schema.sql"] = core_schema.fence_schema_sql()
    for where, text in texts.items():
        code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
        for parse in ("split_part(", "strpos(", "starts_with(", "regexp_", "position(", " like ", "~"):
            assert parse not in code.lower(), (where, parse)
