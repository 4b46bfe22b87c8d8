"""One skipped-slots record per gap per DAG, enforced by the database, and the metric counted once.

Issue 10 item 11: three leased tasks with different keys in the first run after a gap wrote three
events and counted 12 for 4 skipped slots; six parallel instances with one key wrote two events. Here
the record function is called the way ``TaskLease.record_catchup`` calls it
(``record_skipped_catchup(context, ledger=store.events, key=key, logger=...)``), each caller with a
store of its own (as each task has), from threads and from separate processes started together, on
the real PostgreSQL.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg2
import pytest
from psycopg2.extras import Json

from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.schema import ensure_schema
from airflow_lease_provider.runtime.catchup import record_skipped_catchup
from airflow_lease_provider.timetables.catchup_record import METRIC
from tests.forked import processes
from tests.pg import execute, q
from tests.timetables.test_catchup_record import AFTER_GAP, BEFORE_GAP, context

# AFTER_GAP follows BEFORE_GAP after 7 skipped hourly slots (test_catchup_record).
SKIPPED = 7


@pytest.fixture
def metric_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """Every increment of the task-side Stats, from any thread."""
    from airflow.sdk.observability.stats import Stats

    calls: list[tuple[str, int | None]] = []
    lock = threading.Lock()

    def incr(stat: str, count: int | None = None, rate: Any = None, *, tags: dict | None = None) -> None:
        with lock:
            calls.append((stat, count))

    monkeypatch.setattr(Stats, "incr", incr)
    return calls


def _catchup_events(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    return execute(
        dsn, q("SELECT key, detail FROM {schema}.event WHERE kind = 'skipped_catchup' ORDER BY id", schema)
    )


def _call_together(callers: int, target: Any) -> list[Any]:
    barrier = threading.Barrier(callers)
    results: list[Any] = [None] * callers
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = target(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return results


@pytest.mark.parametrize(
    ("callers", "keys"),
    [
        pytest.param(3, ["articles.fetch", "articles.render", "articles.publish"], id="3-tasks-3-keys"),
        pytest.param(6, ["articles.publish"] * 6, id="6-instances-1-key"),
        pytest.param(12, [f"articles.task{i % 4}" for i in range(12)], id="12-callers-4-keys"),
    ],
)
def test_parallel_callers_of_one_run_write_one_record_and_count_each_slot_once(
    pg_dsn: str, schema: str, metric_calls: list, callers: int, keys: list[str]
) -> None:
    LeaseStore(pg_dsn, schema=schema).ensure_schema()  # as a deployment has it before its tasks run

    def call(i: int) -> Any:
        with LeaseStore(pg_dsn, schema=schema) as store:
            return record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP), ledger=store.events, key=keys[i])

    results = _call_together(callers, call)

    # Every caller learns what was skipped ...
    assert all(r is not None and r.count == SKIPPED for r in results), results
    # ... the database holds one record for the gap, written by exactly one of them ...
    events = _catchup_events(pg_dsn, schema)
    assert len(events) == 1, events
    key, detail = events[0]
    assert key in keys and detail["run_id"] == AFTER_GAP.run_id and detail["count"] == SKIPPED
    # ... and the metric counted each skipped slot once.
    counted = [count for stat, count in metric_calls if stat == METRIC]
    assert counted == [SKIPPED], metric_calls


def test_a_retry_and_a_later_task_of_the_run_find_the_record(
    pg_dsn: str, schema: str, metric_calls: list
) -> None:
    with LeaseStore(pg_dsn, schema=schema) as store:
        record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP), ledger=store.events, key="a")
        record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP, try_number=2), ledger=store.events, key="a")
        record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP), ledger=store.events, key="b")
    assert len(_catchup_events(pg_dsn, schema)) == 1
    assert [c for s, c in metric_calls if s == METRIC] == [SKIPPED]


def test_the_record_names_its_run_and_the_writing_task_in_the_run_columns(pg_dsn: str, schema: str) -> None:
    ctx = context(AFTER_GAP, BEFORE_GAP)
    ctx["ti"].task_id, ctx["ti"].map_index = "publish", 2
    with LeaseStore(pg_dsn, schema=schema) as store:
        assert record_skipped_catchup(ctx, ledger=store.events) is not None
        (event,) = store.run_events("articles", AFTER_GAP.run_id)
    assert event.kind == "skipped_catchup" and event.owner == f"articles/{AFTER_GAP.run_id}"
    assert event.run is not None and (event.run.task_id, event.run.map_index) == ("publish", 2)


def test_the_database_refuses_a_second_record_of_a_gap(pg_dsn: str, schema: str) -> None:
    """The rule lives in the database, keyed by the event's run columns (migration 0016): even a plain INSERT
    of a second record for the run fails, whatever task writes it and whatever its detail says."""
    LeaseStore(pg_dsn, schema=schema).ensure_schema()
    detail = Json({"count": 3})
    insert = q(
        "INSERT INTO {schema}.event (kind, key, detail, dag_id, run_id, task_id, map_index)"
        " VALUES ('skipped_catchup', %s, %s, %s, %s, %s, %s)",
        schema,
    )
    execute(pg_dsn, insert, ("k1", detail, "articles", "r1", None, None))
    with pytest.raises(psycopg2.errors.UniqueViolation):
        execute(pg_dsn, insert, ("k2", Json({"dag_id": "other", "run_id": "x"}), "articles", "r1", "publish", -1))
    # Another run's gap, and events of other kinds of the same run, are not affected.
    execute(pg_dsn, insert, ("k1", detail, "articles", "r2", None, None))
    other = q(
        "INSERT INTO {schema}.event (kind, key, detail, dag_id, run_id) VALUES ('acquired', %s, %s, %s, %s)", schema
    )
    execute(pg_dsn, other, ("k1", detail, "articles", "r1"))
    execute(pg_dsn, other, ("k1", detail, "articles", "r1"))


def test_migration_keeps_the_oldest_of_records_written_twice(pg_dsn: str, schema: str) -> None:
    """A store at version 3 that already holds duplicates (the old behaviour) migrates to one record."""
    from airflow_lease_provider.core.db import Database
    from airflow_lease_provider.core.schema import migrations

    db = Database(pg_dsn, schema=schema)
    with db.transaction() as cur:
        cur.execute(q("CREATE SCHEMA {schema}; SET LOCAL search_path TO {schema}", schema))
        cur.execute(
            "CREATE TABLE schema_version (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        for migration in migrations():
            if migration.version >= 4:
                break
            cur.execute(migration.sql)
            cur.execute("INSERT INTO schema_version VALUES (%s, %s)", (migration.version, migration.name))
        for key in ("first", "second", "third"):
            cur.execute(
                "INSERT INTO event (kind, key, detail) VALUES ('skipped_catchup', %s, %s)",
                (key, Json({"dag_id": "d", "run_id": "r", "count": 4})),
            )
        cur.execute(
            "INSERT INTO event (kind, key, detail) VALUES ('skipped_catchup', 'other', %s)",
            (Json({"dag_id": "d", "run_id": "r2", "count": 2}),),
        )
    assert ensure_schema(db) >= 4
    db.close()
    assert [(k, d["run_id"]) for k, d in _catchup_events(pg_dsn, schema)] == [("first", "r"), ("other", "r2")]


def test_migration_16_keys_the_records_by_their_run_columns_and_keeps_every_run(pg_dsn: str, schema: str) -> None:
    """A store at version 15 with the records earlier versions could hold, upgraded: each run keeps one
    record of each kind, a record that named its run only in its detail gets the run columns (and stays
    under the rule), a record of no run is kept as it is, and every other event is untouched."""
    from airflow_lease_provider.core.db import Database
    from airflow_lease_provider.core.schema import ensure_schema
    from tests.pg import store_at_version

    store_at_version(pg_dsn, schema, 15)
    insert = q(
        "INSERT INTO {schema}.event (kind, key, detail, dag_id, run_id, task_id, map_index)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
        schema,
    )

    def add(kind: str, key: str, detail: dict, dag_id: str | None, run_id: str | None, task_id: str | None = None) -> int:
        return int(execute(pg_dsn, insert, (kind, key, Json(detail), dag_id, run_id, task_id, -1 if task_id else None))[0][0])

    written = add("skipped_catchup", "job", {"dag_id": "d", "run_id": "r1", "count": 4}, "d", "r1", "publish")
    coalesced = add("coalesced", "job", {"dag_id": "d", "run_id": "r1", "count": 9}, "d", "r1")
    by_detail = add("skipped_catchup", "plain", {"dag_id": "d", "run_id": "r2", "count": 2}, None, None)
    # Through the plain event API with a run its detail does not name: the old index saw two runs.
    first = add("skipped_catchup", "api", {"dag_id": "x", "run_id": "other", "count": 1}, "d", "r3")
    second = add("skipped_catchup", "api", {"count": 1}, "d", "r3")
    no_run = add("skipped_catchup", "script", {"count": 5}, None, None)
    acquired = add("acquired", "job", {"dag_id": "d", "run_id": "r1"}, "d", "r1", "publish")
    db = Database(pg_dsn, schema=schema)
    try:
        assert ensure_schema(db) >= 16
    finally:
        db.close()
    rows = execute(pg_dsn, q("SELECT id, kind, dag_id, run_id FROM {schema}.event ORDER BY id", schema))
    assert rows == [
        (written, "skipped_catchup", "d", "r1"),
        (coalesced, "coalesced", "d", "r1"),
        (by_detail, "skipped_catchup", "d", "r2"),
        (first, "skipped_catchup", "d", "r3"),
        (no_run, "skipped_catchup", None, None),
        (acquired, "acquired", "d", "r1"),
    ], (second, rows)
    # The filled-in record is under the rule now: a second record of that run is refused.
    with pytest.raises(psycopg2.errors.UniqueViolation):
        add("skipped_catchup", "task", {"count": 2}, "d", "r2", "publish")


def test_the_ledger_method_takes_only_catch_up_kinds_and_a_run(store: LeaseStore) -> None:
    from airflow_lease_provider.core import InvalidArgument, RunRef

    run = RunRef("d", "r")
    with pytest.raises(InvalidArgument, match="kind"):
        store.events.record_catchup("acquired", "k", run=run, detail={})
    with pytest.raises(InvalidArgument, match="run"):
        store.events.record_catchup("skipped_catchup", "k", run=None, detail={})  # type: ignore[arg-type]
    assert store.events.record_catchup("skipped_catchup", "k", run=run, detail={"count": 1}) is True
    assert store.events.record_catchup("skipped_catchup", "k2", run=RunRef("d", "r", 0, task_id="t"), detail={}) is False
    assert store.events.record_catchup("coalesced", "k", run=run, detail={"count": 2}) is True
    (event,) = store.events.query(kind="skipped_catchup")
    assert (event.key, event.owner, event.detail) == ("k", "d/r", {"count": 1})


def test_the_ledger_method_checks_the_schema_once_not_per_record(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store checks its schema on its first use; a catch-up record is one statement after that (before
    issue 40 item 4 every record ran ``ensure_schema`` first: a version query per record)."""
    from airflow_lease_provider.core import RunRef

    store.ensure_schema()
    sent: list[str] = []
    real = store.db.run
    monkeypatch.setattr(store.db, "run", lambda name, *a, **kw: sent.append(name) or real(name, *a, **kw))
    for i in range(3):
        store.events.record_catchup("skipped_catchup", "k", run=RunRef("d", f"r{i}"), detail={"count": 1})
    assert [name for name in sent if name != "prune_events"] == ["record_skipped_catchup"] * 3


def _record_in_a_process(dsn: str, schema: str, key: str, start: Any, out: Any) -> None:
    """A task process's record of the gap, its Stats counted in this process."""
    from airflow.sdk.observability.stats import Stats

    counted: list[list[Any]] = []
    Stats.incr = lambda stat, count=None, rate=None, *, tags=None: counted.append([stat, count])  # type: ignore[method-assign]
    ctx = context(AFTER_GAP, BEFORE_GAP)
    with LeaseStore(dsn, schema=schema) as store:
        store.ensure_schema()
        start.wait(timeout=120)  # all processes are released together
        skipped = record_skipped_catchup(ctx, ledger=store.events, key=key)
    out.put({"count": skipped.count, "metrics": counted})


def test_parallel_processes_write_one_record(pg_dsn: str, schema: str) -> None:
    """Separate processes (as separate task processes on separate workers are), released together."""
    LeaseStore(pg_dsn, schema=schema).ensure_schema()
    # Forked from a server that imported this module (and Airflow) once: tests/forked.py.
    with processes(__name__) as ctx:
        start, out = ctx.Barrier(6), ctx.Queue()
        procs = [
            ctx.Process(target=_record_in_a_process, args=(pg_dsn, schema, f"articles.task{i % 3}", start, out))
            for i in range(6)
        ]
        for proc in procs:
            proc.start()
        try:
            outputs = [out.get(timeout=180) for _ in procs]
            for proc in procs:
                proc.join(timeout=60)
                assert proc.exitcode == 0
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    assert [o["count"] for o in outputs] == [SKIPPED] * 6
    counted = [count for o in outputs for stat, count in o["metrics"] if stat == METRIC]
    assert counted == [SKIPPED], outputs
    assert len(_catchup_events(pg_dsn, schema)) == 1


def test_an_unreachable_store_neither_fails_the_task_nor_counts(metric_calls: list, caplog: Any) -> None:
    """The record cannot be written: the task goes on; the metric is left to a task or try that can write."""
    import logging

    store = LeaseStore("postgresql://postgres@127.0.0.1:1/none", schema="lease_down")
    try:
        with caplog.at_level(logging.WARNING):
            skipped = record_skipped_catchup(context(AFTER_GAP, BEFORE_GAP), ledger=store.events, key="k")
    finally:
        store.close()
    assert skipped is not None and skipped.count == SKIPPED
    assert [c for s, c in metric_calls if s == METRIC] == []
    assert any("could not record" in r.getMessage() for r in caplog.records), caplog.records
