"""Who holds a lease, and what a loss or a failure leaves behind: the operators run against a real PostgreSQL.

Each test runs the operators the way the task runner does (``execute(context)``) with a task instance
that names its DAG run, task and map index; the lease store, its locks and fences are the real ones.
The Airflow processes themselves are exercised in test_scheduler_e2e.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowSkipException, TaskDeferred

from airflow_lease_provider import metrics
from airflow_lease_provider.core import EventKind, InvalidArgument, LeaseHeld, LeaseLost, LeaseStore
from airflow_lease_provider.identity import RunRef
from airflow_lease_provider.operators import AcquireRunLeaseOperator, LeasedOperator, ReleaseRunLeaseOperator
from airflow_lease_provider.reading import parse_owner
from tests.pg import execute, q

LeasedPython = LeasedOperator.wrap(PythonOperator)
TTL = timedelta(seconds=30)
RUN = "manual__2026-12-01T10:00:00+00:00"


@dataclass
class TaskInstance:
    """What the operators read from the running task instance, and its XCom pushes."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    try_number: int = 1
    refuse_xcom: bool = False
    xcoms: dict[str, Any] = field(default_factory=dict)

    def xcom_push(self, key: str, value: Any) -> None:
        if self.refuse_xcom:
            raise RuntimeError("the API server refused the XCom push (413 Request Entity Too Large)")
        self.xcoms[key] = value


def run_task(op: Any, ti: TaskInstance) -> Any:
    """Execute ``op`` as the task instance ``ti``."""
    return op.execute({"ti": ti, "task_instance": ti, "run_id": ti.run_id, "params": {}})


@pytest.fixture
def lease_env(monkeypatch: pytest.MonkeyPatch, pg_dsn: str, schema: str) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", pg_dsn)
    monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", schema)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every metric the provider emits, counted by name."""
    seen: dict[str, int] = {}

    class Stats:
        @staticmethod
        def incr(name: str, count: int = 1, tags: Any = None) -> None:
            seen[name] = seen.get(name, 0) + count

        @staticmethod
        def timing(name: str, elapsed: Any, tags: Any = None) -> None:
            pass

    monkeypatch.setattr(metrics, "_stats", lambda: Stats)
    return seen


def leased(task_id: str, body: Callable[..., Any], **kwargs: Any) -> Any:
    kwargs.setdefault("lease_ttl", TTL)
    return LeasedPython(task_id=task_id, python_callable=body, **kwargs)


# -- identity ----------------------------------------------------------------------------------------


def test_owner_and_default_key_format_and_parse_back() -> None:
    task_ref = RunRef("etl", RUN, 3, task_id="load")
    assert task_ref.owner() == f"etl/{RUN}/load[3]" and task_ref.default_key() == "etl.load[3]"
    assert RunRef("etl", RUN, task_id="load").owner() == f"etl/{RUN}/load"
    assert RunRef("etl", RUN, task_id="load").default_key() == "etl.load"
    assert task_ref.run.owner() == f"etl/{RUN}" and task_ref.run.default_key() == "etl"
    for ref in (task_ref, task_ref.run, RunRef("etl", RUN, task_id="group.load")):
        assert RunRef.parse(ref.owner()) == ref
        assert parse_owner(ref.owner()) == ref  # the UI reads owners back the same way
    assert RunRef.parse("etl/run/3") == RunRef("etl", "run", 3)  # an owner written before task ids
    assert RunRef.parse("a script") is None and RunRef.parse("a/b/c/d") is None and RunRef.parse("") is None


def test_two_tasks_of_one_run_with_one_key_exclude_each_other(lease_env, store: LeaseStore, counted) -> None:
    seen: dict[str, Any] = {}
    second = leased("second", lambda: seen.setdefault("second ran", True), lease_key="shared")

    def first_body(lease=None):
        seen["first token"] = lease.token
        with pytest.raises(AirflowSkipException) as skipped:
            run_task(second, TaskInstance("etl", RUN, "second"))
        seen["reason"] = str(skipped.value)
        seen["holder"] = store.holder("shared")
        lease.check()  # the first still holds its lease, with the same token
        return "first done"

    first = leased("first", first_body, lease_key="shared")
    assert run_task(first, TaskInstance("etl", RUN, "first")) == "first done"
    assert "second ran" not in seen, "the second task ran while the first held the key"
    assert seen["holder"].owner == f"etl/{RUN}/first" and seen["holder"].token == seen["first token"]
    assert f"etl/{RUN}/first" in seen["reason"] and f"etl/{RUN}/second" in seen["reason"]
    assert store.holder("shared") is None  # released by the first on success
    assert store.events.query(key="shared", kind=EventKind.LOST) == []
    assert counted.get("lease.lost", 0) == 0 and counted["scheduled.skipped_overlap"] == 1


@pytest.mark.parametrize(
    ("policy", "raised", "kind", "metric"),
    [
        ("fail", LeaseHeld, EventKind.OVERLAP_FAILED, "lease.overlap_failed"),
        ("wait", TaskDeferred, EventKind.WAITING, None),
    ],
)
def test_the_second_task_with_one_key_fails_or_waits_per_its_policy(
    lease_env, store: LeaseStore, counted, policy: str, raised: type, kind: EventKind, metric: str | None
) -> None:
    second = leased("second", lambda: None, lease_key="shared", on_overlap=policy)

    def first_body(lease=None):
        with pytest.raises(raised):
            run_task(second, TaskInstance("etl", RUN, "second"))
        lease.check()  # the first keeps its lease
        return lease.token

    token = run_task(leased("first", first_body, lease_key="shared"), TaskInstance("etl", RUN, "first"))
    events = store.events.query(key="shared", kind=kind)
    assert [(e.owner, e.detail["holder_owner"], e.detail["holder_token"]) for e in events] == [
        (f"etl/{RUN}/second", f"etl/{RUN}/first", token)
    ]
    assert store.events.query(key="shared", kind=EventKind.LOST) == []
    if metric is not None:
        assert counted[metric] == 1


def test_default_key_is_per_task_and_a_task_never_overlaps_itself_across_runs(lease_env, store) -> None:
    seen: dict[str, Any] = {}
    other = leased("transform", lambda lease=None: seen.setdefault("transform key", lease.key))
    later_run = leased("load", lambda: seen.setdefault("later run ran", True))

    def body(lease=None):
        seen["load key"] = lease.key
        run_task(other, TaskInstance("etl", RUN, "transform"))  # another task of the run: its own key
        with pytest.raises(AirflowSkipException):
            run_task(later_run, TaskInstance("etl", "manual__later", "load"))  # the same task, the next run

    run_task(leased("load", body), TaskInstance("etl", RUN, "load"))
    assert seen == {"load key": "etl.load", "transform key": "etl.transform"}


def test_mapped_instances_have_a_lease_each(lease_env, store) -> None:
    seen: list[tuple[str, str]] = []
    inner = leased("shard", lambda lease=None: seen.append((lease.key, lease.owner)))

    def holding_zero(lease=None):
        seen.append((lease.key, lease.owner))
        run_task(inner, TaskInstance("etl", RUN, "shard", map_index=1))  # not blocked by instance 0
        with pytest.raises(AirflowSkipException):  # instance 0 of the next run is skipped
            run_task(inner, TaskInstance("etl", "manual__next", "shard", map_index=0))

    run_task(leased("shard", holding_zero), TaskInstance("etl", RUN, "shard", map_index=0))
    assert seen == [("etl.shard[0]", f"etl/{RUN}/shard[0]"), ("etl.shard[1]", f"etl/{RUN}/shard[1]")]


def test_mapped_instances_with_one_key_exclude_each_other(lease_env, store: LeaseStore) -> None:
    ran = []
    inner = leased("shard", lambda: ran.append(1), lease_key="one-shard-at-a-time")

    def holding_zero(lease=None):
        with pytest.raises(AirflowSkipException):
            run_task(inner, TaskInstance("etl", RUN, "shard", map_index=1))
        lease.check()  # instance 0 keeps its lease
        ran.append(0)

    run_task(leased("shard", holding_zero, lease_key="one-shard-at-a-time"), TaskInstance("etl", RUN, "shard", map_index=0))
    assert ran == [0]


def test_a_retry_re_enters_with_a_larger_token_and_fences_out_its_earlier_try(
    lease_env, store: LeaseStore, counted, pg_dsn, schema
) -> None:
    def publish(lease) -> None:
        with lease.fenced_transaction("etl.target") as cur:
            cur.execute(q("CREATE TABLE IF NOT EXISTS {schema}.fenced_target (token bigint)", schema))
            cur.execute(q("INSERT INTO {schema}.fenced_target VALUES (%s)", schema), (lease.token,))

    retry = leased("load", lambda lease=None: (publish(lease), lease.token)[1], lease_key="etl-load")
    seen: dict[str, Any] = {}

    def first_try(lease=None):
        seen["try 1"] = lease.token
        # Try 1 hangs; Airflow marks it failed and starts try 2 of the same task instance.
        seen["try 2"] = run_task(retry, TaskInstance("etl", RUN, "load", try_number=2))
        publish(lease)  # try 1 wakes up and tries to publish

    with pytest.raises(LeaseLost):
        run_task(leased("load", first_try, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    assert seen["try 2"] > seen["try 1"]
    assert [r[0] for r in execute(pg_dsn, q("SELECT token FROM {schema}.fenced_target", schema))] == [seen["try 2"]]
    # One loss: one event (with try 1's token and who it was), one metric.
    lost = store.events.query(key="etl-load", kind=EventKind.LOST)
    assert [e.token for e in lost] == [seen["try 1"]], lost
    assert lost[0].detail["task_id"] == "load" and lost[0].detail["try_number"] == 1
    assert counted["lease.lost"] == 1


def test_run_scoped_tasks_share_the_run_lease(lease_env, store: LeaseStore) -> None:
    acquire = AcquireRunLeaseOperator(task_id="acquire_run_lease", lease_ttl=TTL)
    run_task(acquire, TaskInstance("etl", RUN, "acquire_run_lease"))
    holder = store.holder("etl")  # the run's default key: the DAG id
    assert holder is not None and holder.owner == f"etl/{RUN}"
    seen = []
    for task_id, map_index in (("extract", -1), ("load", 0), ("load", 1)):
        op = LeasedPython(task_id=task_id, python_callable=lambda lease=None: seen.append(lease.token), lease_scope="run")
        run_task(op, TaskInstance("etl", RUN, task_id, map_index=map_index))
    assert seen == [holder.token] * 3
    assert store.holder("etl").owner == f"etl/{RUN}"  # joining never releases it
    assert run_task(ReleaseRunLeaseOperator(task_id="release_run_lease"), TaskInstance("etl", RUN, "release_run_lease"))
    assert store.holder("etl") is None


# -- the fence's store --------------------------------------------------------------------------------


def test_a_fence_uses_the_lease_s_own_store_unless_told_otherwise(
    lease_env, monkeypatch, pg_dsn: str, schema: str, dag
) -> None:
    # The task's lease lives in its own connection; [lease] conn_id points at another schema.
    sep = "&" if "?" in pg_dsn else "?"
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_LEASES", f"{pg_dsn}{sep}lease_schema={schema}")
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", f"{pg_dsn}{sep}lease_schema={schema}_other")
    monkeypatch.setenv("AIRFLOW__LEASE__SCHEMA", f"{schema}_other")
    try:
        def body(lease=None):
            lease.fence("etl.files")
            with lease.fenced_transaction("etl.table") as cur:
                cur.execute("SELECT 1")
            return lease.token

        token = run_task(leased("load", body, lease_conn_id="team_leases"), TaskInstance("etl", RUN, "load"))
        rows = execute(pg_dsn, q("SELECT resource, token FROM {schema}.fence ORDER BY resource", schema))
        assert [tuple(r) for r in rows] == [("etl.files", token), ("etl.table", token)]
        other = execute(
            pg_dsn, "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (f"{schema}_other",)
        )
        assert other[0][0] == 0, "the fence was written to the [lease] conn_id store"
    finally:
        execute(pg_dsn, q("DROP SCHEMA IF EXISTS {schema} CASCADE", f"{schema}_other"))


# -- failures between the acquire and the keeper --------------------------------------------------------


def test_a_refused_xcom_push_after_the_acquire_releases_the_lease(lease_env, monkeypatch, store: LeaseStore) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__PUSH_LEASE_XCOM", "true")
    ran = []
    op = leased("load", lambda: ran.append(True), lease_key="etl-load")
    with pytest.raises(RuntimeError, match="refused the XCom push"):
        run_task(op, TaskInstance("etl", RUN, "load", refuse_xcom=True))
    assert ran == []
    assert store.holder("etl-load") is None, "the lease stayed held after the task failed"
    # The next run gets in at once instead of being skipped for the whole TTL.
    run_task(op, TaskInstance("etl", "manual__next", "load"))
    assert ran == [True]


def test_a_lease_that_ran_out_before_the_body_started_never_runs_the_body(
    lease_env, monkeypatch, store: LeaseStore, counted
) -> None:
    """A slow step between the acquire and the keeper's start (here an XCom push that takes longer than the
    TTL) must not let the body run under a lease another run may already hold."""
    import time as _time

    monkeypatch.setenv("AIRFLOW__LEASE__PUSH_LEASE_XCOM", "true")

    ran = []

    class SlowXcom(TaskInstance):
        def xcom_push(self, key: str, value: Any) -> None:
            if key == "lease":
                _time.sleep(2.2)  # the 2 s lease is gone before the keeper starts
            super().xcom_push(key, value)

    op = leased("load", lambda: ran.append(True), lease_key="etl-load", lease_ttl=timedelta(seconds=2))
    with pytest.raises(LeaseLost):
        run_task(op, SlowXcom("etl", RUN, "load"))
    assert ran == [], "the body ran after its lease had run out"
    assert counted.get("lease.lost") == 1
    assert len(store.events.query(key="etl-load", kind=EventKind.LOST)) == 1


def test_bad_configuration_read_after_the_acquire_releases_the_lease(
    lease_env, monkeypatch, store: LeaseStore, dag
) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__RENEW_FRACTION", "3")  # read when the keeper is built
    with pytest.raises(ValueError, match="renew_fraction"):
        run_task(leased("load", lambda: None, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    assert store.holder("etl-load") is None


@pytest.mark.parametrize("value", ["inf", "1e20", "-5", "nan", "abc"])
def test_a_bad_clock_skew_warning_names_the_option_and_releases_the_lease(
    lease_env, monkeypatch, store: LeaseStore, dag, value: str
) -> None:
    """Read after the acquire: inf and 1e20 were an OverflowError naming no option; -5 was accepted (and
    warned at every acquire)."""
    monkeypatch.setenv("AIRFLOW__LEASE__CLOCK_SKEW_WARNING_SECONDS", value)
    with pytest.raises(ValueError, match=r"\[lease\] clock_skew_warning_seconds=.*0 or more"):
        run_task(leased("load", lambda: None, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    assert store.holder("etl-load") is None


@pytest.mark.parametrize("value", ["1e-300", "0.001", "0", "1", "nan", "inf", "abc"])
def test_a_bad_renew_fraction_names_the_option_and_releases_the_lease(
    lease_env, monkeypatch, store: LeaseStore, dag, value: str
) -> None:
    """1e-300 made the renewal interval 0: an InvalidArgument naming ``renew_every``, which nobody set."""
    monkeypatch.setenv("AIRFLOW__LEASE__RENEW_FRACTION", value)
    with pytest.raises(ValueError, match=r"\[lease\] renew_fraction=.*from 0.01 to below 1"):
        run_task(leased("load", lambda: None, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    assert store.holder("etl-load") is None


@pytest.mark.parametrize("value", ["1000000000", "999999999", "36501", "0", "-3", "abc", "1e3", "²"])
def test_a_bad_event_retention_names_the_option_and_takes_no_lease(
    lease_env, monkeypatch, store: LeaseStore, dag, value: str
) -> None:
    """Read when the task's store is built: 1000000000 was an OverflowError naming no option, and 999999999
    or 36501 were accepted (the prune's cutoff then fell before PostgreSQL's earliest timestamp)."""
    monkeypatch.setenv("AIRFLOW__LEASE__EVENT_RETENTION_DAYS", value)
    with pytest.raises(ValueError, match=r"\[lease\] event_retention_days=.*from 1 to 36500"):
        run_task(leased("load", lambda: None, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    assert store.holder("etl-load") is None


def test_the_longest_event_retention_is_taken(lease_env, monkeypatch, store: LeaseStore, dag) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__EVENT_RETENTION_DAYS", "36500")
    run_task(leased("load", lambda: None, lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    (released,) = store.events.query(key="etl-load", kind=EventKind.RELEASED)
    assert released.owner.startswith("etl/")
    from airflow_lease_provider import settings

    longest = LeaseStore(store.db.dsn, schema=store.schema, event_retention=settings.event_retention())
    try:
        assert longest.events.prune() == 1  # the cutoff is a timestamp PostgreSQL can compute
    finally:
        longest.close()


def test_a_run_lease_whose_acquire_task_fails_before_it_is_done_is_released(
    lease_env, monkeypatch, store: LeaseStore
) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__PUSH_LEASE_XCOM", "true")
    acquire = AcquireRunLeaseOperator(task_id="acquire_run_lease", lease_ttl=TTL)
    with pytest.raises(RuntimeError):
        run_task(acquire, TaskInstance("etl", RUN, "acquire_run_lease", refuse_xcom=True))
    assert store.holder("etl") is None


# -- parse-time checks of mapped tasks ---------------------------------------------------------------


@pytest.fixture
def dag() -> Iterator[DAG]:
    with DAG("etl", schedule=None, start_date=datetime(2026, 1, 1)) as d:
        yield d


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"lease_ttl": timedelta(seconds=-5)}, "lease_ttl="),
        ({"lease_ttl": TTL, "on_overlap": "queue"}, "on_overlap='queue'"),
        ({"lease_ttl": TTL, "lease_renew_every": TTL}, "lease_renew_every="),
    ],
)
def test_partial_expand_runs_the_parse_time_checks(dag, arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidArgument, match=named.replace("(", r"\(")):
        LeasedPython.partial(task_id="mapped", python_callable=print, **arguments).expand(op_args=[[1], [2]])

    def body(x):
        return x

    with pytest.raises(InvalidArgument, match=named.replace("(", r"\(")):
        task.leased(**arguments)(body).partial().expand(x=[1, 2])


def test_partial_reads_lease_arguments_from_default_args_like_the_constructor() -> None:
    with DAG("defaults", schedule=None, start_date=datetime(2026, 1, 1), default_args={"lease_ttl": TTL}):
        LeasedPython.partial(task_id="mapped", python_callable=print).expand(op_args=[[1]])  # a TTL is set
    bad = {"lease_ttl": timedelta(seconds=-1)}
    with DAG("bad_defaults", schedule=None, start_date=datetime(2026, 1, 1), default_args=bad):
        with pytest.raises(InvalidArgument, match="lease_ttl="):
            LeasedPython.partial(task_id="mapped", python_callable=print).expand(op_args=[[1]])


def test_a_partial_refused_at_parse_time_leaves_no_never_mapped_warning(dag) -> None:
    """The refusal is the DAG's import error, alone: no "Task ... was never mapped!" warning from a partial left
    behind (it was silenced through Airflow's private ``_expand_called`` until issue 40; now the arguments are
    checked before the partial is made)."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InvalidArgument, match="on_overlap='queue'"):
            LeasedPython.partial(task_id="refused", python_callable=print, lease_ttl=TTL, on_overlap="queue")
        gc.collect()
    assert [str(w.message) for w in caught if "never mapped" in str(w.message)] == []


def test_partial_reads_the_task_group_s_default_args_like_the_constructor() -> None:
    """``.partial()`` checks with the default_args the mapped task gets: its DAG's, its task group's and its own
    (before issue 40 it left out the task group's, which Airflow merges and the constructor and ``@task.leased``
    read: a bad policy there was found only when the first instance ran)."""
    from airflow.sdk import TaskGroup

    with DAG("group_partial", schedule=None, start_date=datetime(2026, 1, 1)):
        with TaskGroup("g", default_args={"lease_ttl": TTL, "on_overlap": "queue"}):
            with pytest.raises(InvalidArgument, match="on_overlap='queue'"):
                LeasedPython(task_id="made", python_callable=print)
            with pytest.raises(InvalidArgument, match="on_overlap='queue'"):
                LeasedPython.partial(task_id="mapped", python_callable=print).expand(op_args=[[1]])
        with TaskGroup("ok", default_args={"lease_ttl": TTL}):
            LeasedPython.partial(task_id="mapped", python_callable=print).expand(op_args=[[1]])


def test_task_leased_reads_the_dags_and_task_groups_default_args_like_the_constructor() -> None:
    """A DAG-wide ``default_args={"lease_ttl": ...}`` (or ``execution_timeout``) is the TTL of ``@task.leased()``
    too, mapped or not, as it is for ``LeasedOperator.wrap(X)`` (a user's DAG was refused with "lease_ttl=None:
    is required" although its default_args set it)."""
    from airflow.sdk import TaskGroup

    def body(x=None):
        return x

    with DAG("dag_defaults", schedule=None, start_date=datetime(2026, 1, 1), default_args={"lease_ttl": TTL}):
        assert task.leased()(body)().operator.lease_ttl == TTL
        task.leased()(body).expand(x=[1, 2])  # parsed: the instances get the DAG's TTL when they run
    with DAG("timeout_defaults", schedule=None, start_date=datetime(2026, 1, 1),
             default_args={"execution_timeout": timedelta(minutes=10)}):
        assert task.leased()(body)().operator.lease_ttl == timedelta(minutes=15)
        task.leased(task_id="mapped")(body).expand(x=[1])
    with DAG("group_defaults", schedule=None, start_date=datetime(2026, 1, 1)):
        with TaskGroup("g", default_args={"lease_ttl": TTL}):
            assert task.leased()(body)().operator.lease_ttl == TTL
    # Still refused at parse time: no TTL anywhere, or a bad one from default_args.
    with DAG("no_ttl", schedule=None, start_date=datetime(2026, 1, 1)):
        with pytest.raises(InvalidArgument, match="lease_ttl=None: is required"):
            task.leased()(body)
    with DAG("bad_ttl", schedule=None, start_date=datetime(2026, 1, 1),
             default_args={"lease_ttl": timedelta(seconds=-1)}):
        with pytest.raises(InvalidArgument, match="lease_ttl="):
            task.leased()(body)
    # Applied outside a DAG, the DAG's defaults are known only when the task is made.
    outside = task.leased()(body)
    with DAG("later", schedule=None, start_date=datetime(2026, 1, 1), default_args={"lease_ttl": TTL}):
        assert outside().operator.lease_ttl == TTL
    with DAG("later_without", schedule=None, start_date=datetime(2026, 1, 1)):
        with pytest.raises(InvalidArgument, match="lease_ttl=None: is required"):
            outside()


def test_a_leased_sensor_in_reschedule_mode_is_refused_when_the_dag_is_parsed() -> None:
    """``mode="reschedule"`` gives the lease back at every reschedule (nothing is left to renew it): on a real
    scheduler two overlapping runs' leased sensors each took the lease for their poke in turn (tokens
    alternating between the two runs) and neither was skipped. Refused at parse time, naming the fix."""
    from airflow.providers.standard.sensors.python import PythonSensor

    LeasedSensor = LeasedOperator.wrap(PythonSensor)
    with DAG("sensors", schedule=None, start_date=datetime(2026, 1, 1)):
        with pytest.raises(InvalidArgument, match=r"mode='reschedule': .*use mode='poke'"):
            LeasedSensor(task_id="wait_file", python_callable=lambda: True, mode="reschedule", lease_ttl=TTL)
        with pytest.raises(InvalidArgument, match=r"mode='reschedule'"):
            LeasedSensor.partial(task_id="mapped", mode="reschedule", lease_ttl=TTL).expand(
                python_callable=[lambda: True]
            )
        assert LeasedSensor(task_id="poking", python_callable=lambda: True, lease_ttl=TTL).mode == "poke"
    with DAG("sensor_defaults", schedule=None, start_date=datetime(2026, 1, 1),
             default_args={"mode": "reschedule", "lease_ttl": TTL}):
        with pytest.raises(InvalidArgument, match=r"mode='reschedule'"):
            LeasedSensor(task_id="wait_file", python_callable=lambda: True)


def test_override_of_a_task_leased_function_is_checked_when_the_dag_is_parsed_mapped_too() -> None:
    """``f.override(lease_ttl=..., on_overlap=...)`` (TaskFlow's way to reuse a function) then ``.expand()``
    parsed without a word and failed each instance when it ran; the checks now run at ``expand()`` too,
    with the DAG's ``default_args`` (also for a function decorated outside the DAG)."""

    def body(x=None):
        return x

    with DAG("overrides", schedule=None, start_date=datetime(2026, 1, 1)):
        f = task.leased(lease_ttl=TTL)(body)
        with pytest.raises(InvalidArgument, match=r"lease_ttl=datetime.timedelta\(0\)"):
            f.override(task_id="a", lease_ttl=timedelta(0)).expand(x=[1])
        with pytest.raises(InvalidArgument, match="on_overlap='nope'"):
            f.override(task_id="b", on_overlap="nope").expand(x=[1])
        with pytest.raises(InvalidArgument, match=r"lease_renew_every="):
            f.override(task_id="c", lease_renew_every=TTL).expand_kwargs([{"x": 1}])
        f.override(task_id="d", lease_key="shared").expand(x=[1, 2])  # a good override still maps
    outside = task.leased()(body)
    with DAG("no_ttl_anywhere", schedule=None, start_date=datetime(2026, 1, 1)):
        with pytest.raises(InvalidArgument, match="lease_ttl=None: is required"):
            outside.expand(x=[1])
    with DAG("ttl_from_dag", schedule=None, start_date=datetime(2026, 1, 1), default_args={"lease_ttl": TTL}):
        outside.expand(x=[1])


def test_the_lease_a_task_sees_is_the_one_last_renewed(lease_env, store: LeaseStore) -> None:
    """``lease.lease`` is documented as "the lease as last renewed"; a body running past a few renewals (TTL 3 s,
    one every second) read the expiry it was acquired with, 12 s stale on a real deployment."""
    import time

    from airflow_lease_provider.runtime import current_lease

    def body() -> dict[str, Any]:
        ctx = current_lease()
        first = ctx.lease
        while ctx.keeper.renewals < 2:
            time.sleep(0.1)
        return {"first": first.expires_at, "now": ctx.lease.expires_at, "renewals": ctx.keeper.renewals,
                "token": ctx.lease.token, "first_token": first.token}

    seen = run_task(leased("renewed", body, lease_ttl=timedelta(seconds=3)), TaskInstance("etl", RUN, "renewed"))
    assert seen["renewals"] >= 2 and seen["now"] > seen["first"], seen
    assert seen["token"] == seen["first_token"]


def test_a_leased_task_renews_at_the_core_keepers_interval_by_default(lease_env, monkeypatch, store) -> None:
    """The renew interval was computed twice: TTL x 0.3333 by the operator (the declared default) and TTL/3 by
    the core keeper. Left at its default, ``[lease] renew_fraction`` is the keeper's own 1/3, exactly."""
    from airflow_lease_provider.core import LeaseKeeper
    from airflow_lease_provider.runtime import current_lease

    monkeypatch.delenv("AIRFLOW__LEASE__RENEW_FRACTION", raising=False)

    def body() -> Any:
        ctx = current_lease()
        return ctx.keeper.renew_every, LeaseKeeper(store, ctx.lease).renew_every

    task_interval, keeper_interval = run_task(leased("renews", body), TaskInstance("etl", RUN, "renews"))
    assert task_interval == keeper_interval == TTL / 3


# -- what one execute costs (issue 28 item 1) ---------------------------------------------------------


def test_the_leased_tasks_of_one_process_share_one_store_connection(lease_env, pg_dsn: str, store: LeaseStore) -> None:
    """The acquire and release of a short task, and the next leased task of the same process (``dag.test()``
    runs them all in one), share one connection and one schema check; it closes itself once idle for its
    grace (one connect per execute before, three before that)."""
    import time

    from airflow_lease_provider.runtime import current_lease

    def body() -> Any:
        db = current_lease().store.db
        return db, db.connects, db._conn.get_backend_pid()

    db, connects, backend = run_task(leased("short", body), TaskInstance("etl", RUN, "short"))
    assert connects >= 1
    again, connects_again, backend_again = run_task(leased("next", body), TaskInstance("etl", RUN, "next"))
    assert again is db and connects_again == connects, f"{connects_again - connects} more connects for the next task"
    assert backend_again == backend
    assert store.holder("etl.short") is None and store.holder("etl.next") is None  # released, durably
    deadline = time.monotonic() + 3
    while db._conn is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert db._conn is None, "the shared connection stayed open once the process was idle"
    while execute(pg_dsn, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (backend,)):
        assert time.monotonic() < deadline + 2, "its server backend stayed connected"
        time.sleep(0.05)


def _in_a_task_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``in_task_process()`` reads: the task runner's supervisor channel (set in every task process)."""
    import airflow.sdk.execution_time.task_runner as task_runner

    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", object(), raising=False)


def _render(op: Any, ti: TaskInstance) -> Any:
    context = {"ti": ti, "task_instance": ti, "run_id": ti.run_id, "params": {}}
    op.render_template_fields(context)
    return context


def test_in_a_task_process_the_store_connects_and_checks_its_schema_while_templates_render(
    lease_env, monkeypatch, pg_dsn: str, schema: str
) -> None:
    """Under an executor each task is a fresh process: its connect and schema check were a third of what a
    leased task added (issue 28). They start when the templates are rendered, in the background, so they
    overlap Airflow's own steps before execute; the execute then connects no more and checks nothing again,
    and the acquire and release are its own, durable, as before."""
    from airflow_lease_provider.hooks import LeaseHook
    from airflow_lease_provider.runtime import current_lease
    from airflow_lease_provider.runtime.store import CONTEXT_KEY, connection_grace

    _in_a_task_process(monkeypatch)
    op = leased("early", lambda: (current_lease().store, current_lease().token), lease_key="etl-early")
    ti = TaskInstance("etl", RUN, "early")
    context = _render(op, ti)  # Airflow hands the same context to the rendering and to the execute
    prepared = context.get(CONTEXT_KEY)
    assert prepared is not None and prepared.thread is not None, "rendering the templates started nothing"
    prepared.thread.join(10)
    copy.deepcopy(op)  # Airflow and listeners may copy the task between rendering and execute
    db = LeaseHook().get_task_store(connection_grace(op.lease_ttl, op.lease_renew_every)).db
    assert db._conn is not None and db.schema_current, "the store was not connected and checked before execute"
    assert execute(pg_dsn, "SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)), "no schema yet"
    connects = db.connects
    assert LeaseStore(pg_dsn, schema=schema).holder("etl-early") is None  # nothing is taken before execute
    used, token = op.execute(context)
    assert CONTEXT_KEY not in context  # the execute took it
    assert used is prepared.store and used.db is db and db.connects == connects, "the execute connected again"
    checker = LeaseStore(pg_dsn, schema=schema)
    assert token == 1 and checker.holder("etl-early") is None  # acquired and released by the execute
    assert [e.token for e in checker.events.query(key="etl-early", kind=EventKind.RELEASED)] == [1]
    # The next leased task of this process (dag.test()) finds the database checked: no thread, one lookup.
    again = leased("again", lambda: current_lease().token, lease_key="etl-early")
    again_context = _render(again, TaskInstance("etl", RUN, "again"))
    assert again_context[CONTEXT_KEY].thread is None
    assert again.execute(again_context) == 2 and db.connects == connects
    assert checker.holder("etl-early") is None
    checker.close()


def test_a_store_prepared_for_another_task_object_is_never_handed_to_this_one(lease_env, monkeypatch) -> None:
    """What the rendering prepared is found in the context, with the task object it was made for: one made for
    another object (here put in this task's context) is not this task's store, and is taken out all the same."""
    import weakref

    from airflow_lease_provider.runtime import store

    _in_a_task_process(monkeypatch)
    other = leased("other", lambda: None, lease_key="etl-other", lease_conn_id="some_other_store")
    this = leased("this", lambda: None, lease_key="etl-this")
    sentinel = object()
    context = {store.CONTEXT_KEY: store.Prepared(weakref.ref(other), sentinel, None)}  # type: ignore[arg-type]
    assert store.take(this, context) is None
    assert store.CONTEXT_KEY not in context


def test_a_store_that_cannot_be_prepared_fails_the_execute_closed(lease_env, monkeypatch) -> None:
    """What fails while the templates render (here: nothing listens where the connection points) fails
    nothing then; the execute tries again and fails closed, before the body."""
    from airflow_lease_provider.core import LeaseStoreUnavailable

    _in_a_task_process(monkeypatch)
    monkeypatch.setenv("AIRFLOW_CONN_LEASE_DEFAULT", "postgresql://postgres@127.0.0.1:1/test")
    ran: list[bool] = []
    op = leased("down", lambda: ran.append(True), lease_key="etl-down")
    ti = TaskInstance("etl", RUN, "down")
    context = _render(op, ti)
    with pytest.raises(LeaseStoreUnavailable):
        op.execute(context)
    assert ran == []


def test_sigterm_while_the_store_is_looked_up_at_render_time_takes_no_lease(lease_env, monkeypatch, store) -> None:
    """The lookup moved from the execute's first step (where a SIGTERM is noted) to the rendering: a SIGTERM
    during it is noted as well, and the execute stops before the acquire (the task runner's own handler, which
    runs ``on_kill`` and lets the task go on, still runs)."""
    import os
    import signal

    from airflow_lease_provider.hooks import LeaseHook
    from airflow_lease_provider.runtime.signals import TaskTerminated

    _in_a_task_process(monkeypatch)
    get_task_store = LeaseHook.get_task_store

    def terminated_while_looking_up(self: Any, idle_close: timedelta) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        return get_task_store(self, idle_close)

    monkeypatch.setattr(LeaseHook, "get_task_store", terminated_while_looking_up)
    killed: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: killed.append(signum))  # the task runner's
    ran: list[bool] = []
    try:
        op = leased("termed", lambda: ran.append(True), lease_key="etl-termed")
        ti = TaskInstance("etl", RUN, "termed")
        context = _render(op, ti)
        with pytest.raises(TaskTerminated):
            op.execute(context)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert killed == [signal.SIGTERM] and ran == []
    assert store.lease("etl-termed") is None, "the lease was taken after SIGTERM"


def test_outside_a_task_process_rendering_opens_no_store_connection(lease_env) -> None:
    from airflow_lease_provider.runtime.store import CONTEXT_KEY

    op = leased("cli", lambda: None)
    assert CONTEXT_KEY not in _render(op, TaskInstance("etl", RUN, "cli"))


def test_the_lease_xcom_is_not_pushed_by_default_and_push_lease_xcom_true_pushes_it(
    lease_env, monkeypatch, store: LeaseStore
) -> None:
    """``[lease] push_lease_xcom`` is off by default (it saves the XCom write, the largest per-task step in the
    bench): the body still gets its lease in the context, and it is acquired, held and released durably as
    before; ``true`` pushes the lease under ``lease`` for downstream tasks (the skip reason is pushed either way)."""
    from airflow_lease_provider.runtime import current_lease

    monkeypatch.delenv("AIRFLOW__LEASE__PUSH_LEASE_XCOM", raising=False)
    quiet = TaskInstance("etl", RUN, "load")
    token = run_task(leased("load", lambda: current_lease().token, lease_key="etl-load"), quiet)
    assert token == 1 and "lease" not in quiet.xcoms, quiet.xcoms
    run_lease = TaskInstance("etl", RUN, "acquire_run_lease")  # the run lease's acquire task: the same
    run_task(AcquireRunLeaseOperator(task_id="acquire_run_lease", lease_ttl=TTL), run_lease)
    assert "lease" not in run_lease.xcoms and store.holder("etl") is not None

    monkeypatch.setenv("AIRFLOW__LEASE__PUSH_LEASE_XCOM", "true")
    pushed = TaskInstance("etl", "manual__next", "load")
    run_task(leased("load", lambda: None, lease_key="etl-load"), pushed)
    assert pushed.xcoms["lease"]["key"] == "etl-load" and pushed.xcoms["lease"]["token"] == 2
    assert store.holder("etl-load") is None
    assert sorted(e.token for e in store.events.query(key="etl-load", kind=EventKind.RELEASED)) == [1, 2]
    pushed_run = TaskInstance("etl_b", RUN, "acquire_run_lease")  # another DAG: "etl" is held by its run
    run_task(AcquireRunLeaseOperator(task_id="acquire_run_lease", lease_ttl=TTL), pushed_run)
    assert pushed_run.xcoms["lease"]["key"] == "etl_b"


def test_a_bad_push_lease_xcom_names_the_option_and_releases_the_lease(lease_env, monkeypatch, store) -> None:
    monkeypatch.setenv("AIRFLOW__LEASE__PUSH_LEASE_XCOM", "sometimes")
    ran = []
    with pytest.raises(ValueError, match=r"\[lease\] push_lease_xcom='sometimes'"):
        run_task(leased("load", lambda: ran.append(True), lease_key="etl-load"), TaskInstance("etl", RUN, "load"))
    assert ran == [] and store.holder("etl-load") is None


def test_a_long_body_holds_no_store_connection_between_renewals(lease_env, store: LeaseStore) -> None:
    """The shared connection's idle grace is at most half the renewal interval: a lease between two
    renewals holds no server connection ([lease] hold_connection unset)."""
    import time

    from airflow_lease_provider.runtime import current_lease

    def body() -> Any:
        db = current_lease().store.db
        assert db.idle_close is not None and db.idle_close <= timedelta(seconds=1) / 2
        deadline = time.monotonic() + 5
        while db._conn is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        return db._conn is None

    # TTL 3 s: renewals every 1 s, so the grace is 0.5 s.
    assert run_task(leased("long", body, lease_ttl=timedelta(seconds=3)), TaskInstance("etl", RUN, "long"))
