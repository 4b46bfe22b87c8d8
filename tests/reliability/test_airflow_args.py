"""Property tests over the Airflow-facing arguments: operators, decorators, the timetable.

A bad argument must fail when the DAG file is parsed, as :class:`InvalidArgument` naming the parameter,
and what parsing accepts must be accepted when the task runs: a non-templated key, resource or
idempotency key that passes here must be a valid name for the store too. Nothing here touches a store
(the connection id points nowhere; parsing must not connect).
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("airflow.sdk")

from airflow.providers.standard.operators.bash import BashOperator  # noqa: E402

from airflow_lease_provider.core import InvalidArgument  # noqa: E402
from airflow_lease_provider.decorators.fenced import fenced_publish_task  # noqa: E402
from airflow_lease_provider.decorators.leased import leased_task  # noqa: E402
from airflow_lease_provider.operators import (  # noqa: E402
    FencedSQLOperator,
    LeasedOperator,
    ReleaseRunLeaseOperator,
    run_lease,
)
from airflow_lease_provider.timetables import CappedCatchupTimetable  # noqa: E402
from tests.reliability.strategies import durations, junk, names  # noqa: E402

ARGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LeasedBash = LeasedOperator.wrap(BashOperator)
NOWHERE = "lease_store_that_does_not_exist"

policies = st.one_of(st.sampled_from(["skip", "wait", "fail", "Skip", "", "retry"]), junk)
scopes = st.one_of(st.sampled_from(["task", "run", "dag", ""]), junk)
keys = st.one_of(names, st.sampled_from(["{{ dag.dag_id }}", "shard-{{ ti.map_index }}", "{% if x %}a{% endif %}"]))
optional_durations = st.one_of(st.none(), durations)


def templated(value: object) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def valid_name(value: object) -> bool:
    """Whether the documented name rule (characters, UTF-8 bytes, NUL, valid Unicode) accepts it."""
    from airflow_lease_provider.core import validation

    try:
        validation.name("name", value)
    except InvalidArgument:
        return False
    return True


def refused(exc: InvalidArgument, *parameters: str) -> None:
    assert exc.parameter in parameters, exc
    assert str(exc).startswith(f"{exc.parameter}="), exc


def accepted_names(**values: object) -> None:
    """What parsing accepted must not be refused by the store when the task runs."""
    for parameter, value in values.items():
        if value is not None and not templated(value):
            assert valid_name(value), f"{parameter}={value!r} passed parsing but the store will refuse it"


LEASE_PARAMETERS = (
    "lease_key", "lease_ttl", "lease_renew_every", "on_overlap", "lease_wait_timeout", "lease_poll_interval",
    "lease_scope",
)


@ARGS
@given(
    lease_key=keys, lease_ttl=optional_durations, lease_renew_every=optional_durations, on_overlap=policies,
    lease_wait_timeout=optional_durations, lease_poll_interval=optional_durations, lease_scope=scopes,
    execution_timeout=st.one_of(st.none(), st.timedeltas(min_value=datetime.timedelta(seconds=1))),
)
@example(lease_key="job", lease_ttl=None, lease_renew_every=None, on_overlap="skip", lease_wait_timeout=None,
         lease_poll_interval=None, lease_scope="task", execution_timeout=datetime.timedelta.max)
def test_leased_operator_arguments(
    lease_key: Any, lease_ttl: Any, lease_renew_every: Any, on_overlap: Any, lease_wait_timeout: Any,
    lease_poll_interval: Any, lease_scope: Any, execution_timeout: Any,
) -> None:
    try:
        op = LeasedBash(
            task_id="t", bash_command="true", lease_key=lease_key, lease_ttl=lease_ttl,
            lease_renew_every=lease_renew_every, on_overlap=on_overlap, lease_wait_timeout=lease_wait_timeout,
            lease_poll_interval=lease_poll_interval, lease_scope=lease_scope, lease_conn_id=NOWHERE,
            execution_timeout=execution_timeout,
        )
    except InvalidArgument as exc:
        refused(exc, *LEASE_PARAMETERS, "execution_timeout")
        return
    accepted_names(lease_key=lease_key)
    assert on_overlap in ("skip", "wait", "fail") and lease_scope in ("task", "run")
    if op.lease_ttl is not None:
        assert datetime.timedelta(seconds=1) <= op.lease_ttl <= datetime.timedelta(days=7)


@ARGS
@given(lease_key=keys, lease_ttl=optional_durations, on_overlap=policies, lease_scope=scopes)
def test_leased_task_decorator_arguments(lease_key: Any, lease_ttl: Any, on_overlap: Any, lease_scope: Any) -> None:
    def body() -> None:
        return None

    try:
        leased_task(body, lease_key=lease_key, lease_ttl=lease_ttl, on_overlap=on_overlap, lease_scope=lease_scope,
                    lease_conn_id=NOWHERE)
    except InvalidArgument as exc:
        refused(exc, *LEASE_PARAMETERS)
        return
    accepted_names(lease_key=lease_key)


@ARGS
@given(resource=keys, target=st.one_of(st.sampled_from(["postgres", "external", "s3"]), junk),
       idempotency_key=st.one_of(st.none(), keys), lease_key=keys)
@example(resource="x" * 513, target="postgres", idempotency_key=None, lease_key="job")
@example(resource="blog", target="postgres", idempotency_key="slot\x00", lease_key="job")
def test_fenced_publish_decorator_arguments(resource: Any, target: Any, idempotency_key: Any, lease_key: Any) -> None:
    try:
        fenced_publish_task(resource=resource, target=target, idempotency_key=idempotency_key, lease_key=lease_key)
    except InvalidArgument as exc:
        refused(exc, "resource", "target", "idempotency_key", "lease_key")
        return
    accepted_names(resource=resource, idempotency_key=idempotency_key, lease_key=lease_key)


@ARGS
@given(
    resource=keys,
    sql=st.one_of(st.sampled_from(["INSERT INTO t VALUES (1)", ["SELECT 1", "SELECT 2"], "", [], [""], " "]), junk),
    idempotency_key=st.one_of(st.none(), keys),
    lease_key=keys,
)
@example(resource="x" * 513, sql="SELECT 1", idempotency_key=None, lease_key="job")
@example(resource="blog", sql="SELECT 1", idempotency_key=None, lease_key="a\x00b")
def test_fenced_sql_operator_arguments(resource: Any, sql: Any, idempotency_key: Any, lease_key: Any) -> None:
    try:
        FencedSQLOperator(
            task_id="publish", resource=resource, sql=sql, idempotency_key=idempotency_key, lease_key=lease_key,
            lease_conn_id=NOWHERE,
        )
    except InvalidArgument as exc:
        refused(exc, "resource", "sql", "idempotency_key", "lease_key")
        return
    accepted_names(resource=resource, idempotency_key=idempotency_key, lease_key=lease_key)


@ARGS
@given(lease_key=keys, lease_ttl=durations, on_overlap=policies)
def test_run_lease_arguments(lease_key: Any, lease_ttl: Any, on_overlap: Any) -> None:
    try:
        run_lease(lease_key=lease_key, lease_ttl=lease_ttl, on_overlap=on_overlap, lease_conn_id=NOWHERE)
    except InvalidArgument as exc:
        refused(exc, *LEASE_PARAMETERS)
        return
    accepted_names(lease_key=lease_key)
    try:
        ReleaseRunLeaseOperator(task_id="release", lease_key=lease_key, lease_conn_id=NOWHERE)
    except InvalidArgument as exc:
        pytest.fail(f"ReleaseRunLeaseOperator refused a key run_lease accepted: {exc}")


crons = st.builds(
    " ".join,
    st.lists(st.one_of(st.sampled_from(["*", "*/5", "0", "1-5", "MON", "61", "-1", "L", "?", "x"]),
                       st.integers(0, 70).map(str)), min_size=3, max_size=7),
)


@ARGS
@given(
    schedule=st.one_of(crons, st.sampled_from(["@hourly", "@daily", "@weekly", "@once", "@continuous"]),
                       st.timedeltas(min_value=datetime.timedelta(days=-1), max_value=datetime.timedelta(days=400)),
                       junk),
    max_backfill=st.one_of(st.integers(-2, 10_002), junk),
    catchup_window=st.one_of(st.none(), durations),
    timezone=st.one_of(st.sampled_from(["UTC", "Europe/Paris", "America/New_York", "Mars/Olympus", ""]), junk),
    data_interval=st.one_of(st.booleans(), junk),
)
@example(schedule="@hourly", max_backfill=1, catchup_window=None, timezone=10**12, data_interval=True)
def test_timetable_arguments_and_serialization(
    schedule: Any, max_backfill: Any, catchup_window: Any, timezone: Any, data_interval: Any
) -> None:
    try:
        timetable = CappedCatchupTimetable(
            schedule, max_backfill=max_backfill, catchup_window=catchup_window, timezone=timezone,
            data_interval=data_interval,
        )
    except InvalidArgument as exc:
        refused(exc, "schedule", "max_backfill", "catchup_window", "timezone", "data_interval")
        return
    # What the scheduler stores it must be able to load back, unchanged.
    again = CappedCatchupTimetable.deserialize(timetable.serialize())
    assert again.serialize() == timetable.serialize()
    assert again.summary == timetable.summary


def test_a_renew_every_the_keeper_could_never_use_fails_at_parse_time() -> None:
    """The keeper gives up at TTL minus its safety margin (TTL/10, at most 5 s) without a renewal: an
    interval that long always loses the lease, so the DAG file is refused, naming the parameter, the TTL
    and the margin (the same rule as LeaseKeeper's, core.validation.renew_every)."""
    with pytest.raises(InvalidArgument) as info:
        LeasedBash(task_id="t", bash_command="true", lease_ttl=datetime.timedelta(minutes=80),
                   lease_renew_every=datetime.timedelta(minutes=79, seconds=56), lease_conn_id=NOWHERE)
    assert info.value.parameter == "lease_renew_every"
    assert "1:20:00" in str(info.value) and "0:00:05" in str(info.value)
    op = LeasedBash(task_id="t", bash_command="true", lease_ttl=datetime.timedelta(minutes=80),
                    lease_renew_every=datetime.timedelta(minutes=70), lease_conn_id=NOWHERE)
    assert op.lease_renew_every == datetime.timedelta(minutes=70)
