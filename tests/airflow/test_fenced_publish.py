"""Fenced publishing through the operators, run the way the task runner runs them (issue 23, items 4, 5, 8, 9).

A run lease's tasks all carry the run's token, and one leased task may publish more than once:
each of those publishes is accepted. An external publish whose side effect fails gives its idempotency
claim back. A fence kept in another database records its refusals in the lease store's ledger (read back
with the console script) and creates only the fence there. A lease store that was recreated is named as
such by the fence, and ``airflow-lease failover --above`` gives it the floor.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from airflow.sdk import DAG, task

from airflow_lease_provider.core import DuplicatePublish, EventKind, FenceStore, LeaseStore, StaleFencingToken
from airflow_lease_provider.core.schema import drop_schema
from airflow_lease_provider.operators import AcquireRunLeaseOperator, FencedSQLOperator
from tests.airflow.harness import VENV_BIN
from tests.airflow.test_semantics import RUN, TaskInstance, leased, run_task
from tests.pg import drop_schema as drop_pg_schema
from tests.pg import execute, new_schema_name, q

TTL = timedelta(seconds=60)


@pytest.fixture
def lease_env(monkeypatch: pytest.MonkeyPatch, pg_dsn: str, schema: str) -> None:
    """The lease store of the task process: the test's own schema."""
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", pg_dsn)
    monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", schema)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")


def _rejections(store: LeaseStore) -> list[Any]:
    return store.events.query(kind=EventKind.FENCE_REJECTED)


@pytest.fixture
def target(monkeypatch: pytest.MonkeyPatch, pg_dsn: str) -> Iterator[str]:
    """Connection ``target_db``: the same server, another schema (a write target with no lease store)."""
    name = new_schema_name()
    sep = "&" if "?" in pg_dsn else "?"
    monkeypatch.setenv("AIRFLOW_CONN_TARGET_DB", f"{pg_dsn}{sep}lease_schema={name}")
    yield name
    drop_pg_schema(pg_dsn, name)


def _tables(dsn: str, schema: str) -> list[str]:
    rows = execute(dsn, "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (schema,))
    return [r[0] for r in rows]


def airflow_lease(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The console script, as a person runs it, against this test's store."""
    command = [str(VENV_BIN / "airflow-lease"), "--dsn", dsn, "--schema", schema, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


# -- item 4 -----------------------------------------------------------------------------------------------


def test_every_task_of_a_run_scoped_lease_publishes_to_one_resource(
    lease_env, store: LeaseStore, pg_dsn: str, schema: str
) -> None:
    """Two FencedSQLOperators and two mapped instances of a third, all under the run's one lease: every
    publish is accepted, and the ledger records no rejection (before: the second got StaleFencingToken
    'already accepted token 1', and a stale rejection was recorded for the valid holder)."""
    run_task(
        AcquireRunLeaseOperator(task_id="acquire_run_lease", lease_ttl=TTL),
        TaskInstance("etl", RUN, "acquire_run_lease"),
    )
    token = store.holder("etl").token
    store.ensure_schema()
    execute(pg_dsn, q("CREATE TABLE {schema}.sales (who text, token bigint)", schema))

    def publish(task_id: str, who: str) -> FencedSQLOperator:
        return FencedSQLOperator(
            task_id=task_id,
            resource="warehouse.sales",
            sql="INSERT INTO {table} VALUES (%(who)s, %(fencing_token)s)",
            identifiers={"table": [schema, "sales"]},
            parameters={"who": who},
        )

    assert run_task(publish("publish_a", "a"), TaskInstance("etl", RUN, "publish_a")) == token
    assert run_task(publish("publish_b", "b"), TaskInstance("etl", RUN, "publish_b")) == token
    for index in (0, 1):
        op = publish("publish_mapped", f"m{index}")
        assert run_task(op, TaskInstance("etl", RUN, "publish_mapped", map_index=index)) == token
    rows = execute(pg_dsn, q("SELECT who, token FROM {schema}.sales ORDER BY who", schema))
    assert [tuple(r) for r in rows] == [("a", token), ("b", token), ("m0", token), ("m1", token)]
    assert _rejections(store) == []
    # Another run's holder with an older token is still refused.
    execute(pg_dsn, q("UPDATE {schema}.fence SET token = token + 1", schema))
    with pytest.raises(StaleFencingToken):
        run_task(publish("publish_c", "c"), TaskInstance("etl", RUN, "publish_c"))
    assert [e.token for e in _rejections(store)] == [token]


def test_one_leased_task_fences_one_resource_twice(lease_env, store: LeaseStore) -> None:
    def body(lease=None):
        decisions = [lease.fence("site.files"), lease.fence("site.files")]
        for _ in range(2):
            with lease.fenced_transaction("site.table") as cur:
                cur.execute("SELECT 1")
        return [d.accepted for d in decisions]

    assert run_task(leased("load", body), TaskInstance("etl", RUN, "load")) == [True, True]
    assert _rejections(store) == []


# -- item 5 -----------------------------------------------------------------------------------------------


@pytest.fixture
def dag() -> Iterator[DAG]:
    with DAG("site", schedule=None, start_date=datetime(2026, 1, 1)) as d:
        yield d


def test_an_external_publish_that_failed_is_published_by_its_retry(lease_env, store: LeaseStore, dag) -> None:
    """``@task.fenced_publish(target="external", idempotency_key=...)``: the push fails (try 1), the retry
    publishes the slot (before: every retry got DuplicatePublish until someone deleted the claim)."""
    pushed: list[int] = []

    @task.fenced_publish(resource="git:site", target="external", idempotency_key="slot-2026-11-29")
    def push(fence=None):
        if not pushed:
            pushed.append(0)
            raise ConnectionError("git push: the remote hung up")
        pushed.append(fence.token)
        return fence.token

    operator = push().operator
    run_task(
        AcquireRunLeaseOperator(task_id="acquire_run_lease", lease_ttl=TTL),
        TaskInstance("site", RUN, "acquire_run_lease"),
    )
    token = store.holder("site").token
    with pytest.raises(ConnectionError):
        run_task(operator, TaskInstance("site", RUN, "push"))
    assert run_task(operator, TaskInstance("site", RUN, "push", try_number=2)) == token
    assert pushed == [0, token]
    # Published once: a cleared re-run of the slot is refused as a duplicate, and nothing is pushed.
    with pytest.raises(DuplicatePublish):
        run_task(operator, TaskInstance("site", RUN, "push", try_number=3))
    assert pushed == [0, token]


def test_lease_fence_as_a_context_manager_gives_the_claim_back_on_failure(
    lease_env, store: LeaseStore
) -> None:
    attempts: list[str] = []

    def body(lease=None):
        with pytest.raises(TimeoutError):
            with lease.fence("api.push", idempotency_key="slot-1"):
                attempts.append("failed")
                raise TimeoutError("the API did not answer")
        with lease.fence("api.push", idempotency_key="slot-1"):
            attempts.append("pushed")
        with pytest.raises(DuplicatePublish):
            lease.fence("api.push", idempotency_key="slot-1")

    run_task(leased("push", body), TaskInstance("api", RUN, "push"))
    assert attempts == ["failed", "pushed"]


# -- item 8 -----------------------------------------------------------------------------------------------


def test_a_fence_in_another_database_records_its_refusals_in_the_lease_store(
    lease_env, store: LeaseStore, target: str, pg_dsn: str, schema: str
) -> None:
    """The fence lives in ``target_db`` (a database where an older version made the whole schema, and
    another deployment's holder published a larger token): its refusal reaches the lease store's ledger
    (before: 0 fence_rejected events there), and ``airflow-lease events`` shows it."""
    newer = FenceStore(pg_dsn, schema=target)
    assert newer.accept("warehouse.sales", 99, key="etl-load", owner="etl/other-deployment")
    newer.close()

    def body(lease=None):
        with lease.fenced_transaction("warehouse.sales", conn_id="target_db") as cur:
            cur.execute("SELECT 1")

    with pytest.raises(StaleFencingToken):
        run_task(leased("load", body, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    events = _rejections(store)
    assert [(e.key, e.owner, e.detail["lease_key"], e.detail["current_token"]) for e in events] == [
        ("warehouse.sales", f"etl/{RUN}/load", "etl-load", 99)
    ]
    assert events[0].run is not None and events[0].run.task_id == "load"
    result = airflow_lease(pg_dsn, schema, "--json", "events", "--kind", "fence_rejected")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    shown = shown["events"] if isinstance(shown, dict) else shown
    assert [(e["key"], e["token"], e["detail"]["current_token"]) for e in shown] == [
        ("warehouse.sales", 1, 99)
    ]
    # The target's schema is left as it was: nothing of it dropped.
    assert {"lease", "event", "fence", "fence_publish"} <= set(_tables(pg_dsn, target))


def test_publishing_into_another_database_creates_only_the_fence_there(
    lease_env, store: LeaseStore, target: str, pg_dsn: str
) -> None:
    """Before: the provider created its whole lease schema (lease, event, lease_epoch ...) in the target."""

    def body(lease=None):
        lease.fence("warehouse.files", conn_id="target_db")
        with lease.fenced_transaction("warehouse.sales", conn_id="target_db") as cur:
            cur.execute("SELECT 1")
        return lease.token

    token = run_task(leased("load", body, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    assert _tables(pg_dsn, target) == ["fence", "fence_count_epoch", "fence_publish", "fence_schema_version"]
    rows = execute(pg_dsn, q("SELECT resource, token FROM {schema}.fence ORDER BY resource", target))
    assert [tuple(r) for r in rows] == [("warehouse.files", token), ("warehouse.sales", token)]


# -- item 9 -----------------------------------------------------------------------------------------------


def test_a_recreated_lease_store_is_named_and_the_cli_gives_it_the_floor(
    lease_env, store: LeaseStore, target: str, pg_dsn: str, schema: str
) -> None:
    def body(lease=None):
        with lease.fenced_transaction("warehouse.sales", conn_id="target_db") as cur:
            cur.execute("SELECT 1")
        return lease.token

    for n in range(3):
        assert (
            run_task(leased("load", body, lease_key="etl-load"), TaskInstance("etl", f"run-{n}", "load"))
            == n + 1
        )
    store.close()
    drop_schema(store.db)  # the lease store's schema is lost and made again: tokens restart at 1
    with pytest.raises(StaleFencingToken) as refused:
        run_task(leased("load", body, lease_key="etl-load"), TaskInstance("etl", "run-3", "load"))
    message = str(refused.value)
    assert "another lease store" in message and "airflow-lease failover --above 3" in message, message
    result = airflow_lease(pg_dsn, schema, "failover", "--above", "3", "--reason", "lease store recreated")
    assert result.returncode == 0, result.stderr
    assert run_task(leased("load", body, lease_key="etl-load"), TaskInstance("etl", "run-4", "load")) > 3


# -- item 4 through `airflow dags test` ----------------------------------------------------------------


@pytest.mark.airflow
def test_fenced_sql_operators_of_one_run_lease_in_a_dag_all_publish(
    airflow_home, store: LeaseStore, pg_dsn: str, schema: str
) -> None:
    """DAG ``fenced_twice`` (tests/airflow/dags/fenced_e2e.py): two FencedSQLOperators and two mapped
    instances of a third publish to one resource under the run's lease; all succeed."""
    home = airflow_home("fenced")
    result = home.dags_test("fenced_twice")
    states = {(t, m): s for (t, m), s in home.task_states().items()}
    assert states == {
        ("acquire_run_lease", -1): "success",
        ("first", -1): "success",
        ("second", -1): "success",
        ("mapped", 0): "success",
        ("mapped", 1): "success",
        ("release_run_lease", -1): "success",
    }, result.stdout[-3000:] + result.stderr[-3000:]
    token = store.events.query(key="fenced-run", kind="acquired")[0].token
    rows = execute(pg_dsn, q("SELECT who, token FROM {schema}.fenced_rows ORDER BY who", schema))
    assert [tuple(r) for r in rows] == [
        ("first", token),
        ("mapped-0", token),
        ("mapped-1", token),
        ("second", token),
    ]
    assert _rejections(store) == []
