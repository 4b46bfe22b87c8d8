"""``S3FenceHook`` and ``lease.fenced_put``: the object-store fence through an Airflow AWS connection.

The connection is an ``AIRFLOW_CONN_...`` variable (JSON, ``endpoint_url`` in its extra) read by the Amazon
provider's ``S3Hook``, in this process; the store is a real moto_server process; the lease store is the
test PostgreSQL.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from airflow_lease_provider.core import DuplicatePublish, EventKind, LeaseLost, LeaseStore, StaleFencingToken
from airflow_lease_provider.fences.s3 import ObjectFence, ObjectPublish
from airflow_lease_provider.hooks.s3_fence import S3FenceHook
from airflow_lease_provider.runtime import LeaseContext
from tests.s3 import ACCESS_KEY, REGION, SECRET_KEY, MotoServer

CONN_ID = "s3_fence_test"
KEY = "reports/2026-12-02.csv"
TTL = timedelta(minutes=5)


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture
def aws_conn(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{CONN_ID.upper()}",
        json.dumps({
            "conn_type": "aws",
            "login": ACCESS_KEY,
            "password": SECRET_KEY,
            "extra": {"endpoint_url": moto.url, "region_name": REGION},
        }),
    )
    return CONN_ID


def test_the_hook_writes_through_the_connection_s_endpoint_and_refuses_a_stale_token(
    moto: MotoServer, aws_conn: str
) -> None:
    bucket = moto.bucket()
    hook = S3FenceHook(aws_conn_id=aws_conn)
    assert hook.get_conn().meta.endpoint_url == moto.url  # S3Hook read endpoint_url from the extra
    published = hook.put(bucket, KEY, b"a,b\n2,3\n", token=2, lease_key="report", owner="run-2")
    assert isinstance(published, ObjectPublish)
    with pytest.raises(StaleFencingToken) as refused:
        hook.put(bucket, KEY, b"zombie", token=1, lease_key="report", owner="run-1")
    assert refused.value.current == 2
    seen = hook.read(bucket, KEY)
    assert seen is not None and seen.body == b"a,b\n2,3\n" and seen.token == 2
    # What a reader without this package sees: the plain object, and its token in the metadata.
    raw = moto.client().get_object(Bucket=bucket, Key=KEY)
    assert raw["Body"].read() == b"a,b\n2,3\n" and raw["Metadata"]["lease-token"] == "2"


def test_the_hook_refuses_a_frozen_writer_at_the_store(moto: MotoServer, aws_conn: str) -> None:
    """The zombie's hook read the fence and froze with its conditional PUT signed; a newer holder wrote; the
    store answers the zombie's PUT with 412 and the object keeps the newer bytes."""
    bucket = moto.bucket()
    S3FenceHook(aws_conn_id=aws_conn).put(bucket, KEY, b"v1", token=1, lease_key="report", owner="run-1")
    zombie = S3FenceHook(aws_conn_id=aws_conn)
    client = zombie.get_fence().client
    frozen, resume = threading.Event(), threading.Event()
    statuses: list[int] = []

    def hold(request: Any, **_: Any) -> None:
        if request.url.split("?")[0].endswith(KEY):
            frozen.set()
            assert resume.wait(20)

    client.meta.events.register("before-send.s3.PutObject", hold)
    client.meta.events.register(
        "after-call.s3.PutObject", lambda http_response, **_: statuses.append(http_response.status_code)
    )
    errors: list[Exception] = []
    thread = threading.Thread(
        target=lambda: _catch(errors, zombie.put, bucket, KEY, b"zombie", token=2, lease_key="report", owner="z")
    )
    thread.start()
    assert frozen.wait(20)
    S3FenceHook(aws_conn_id=aws_conn).put(bucket, KEY, b"v3", token=3, lease_key="report", owner="run-3")
    resume.set()
    thread.join(20)
    assert len(errors) == 1 and isinstance(errors[0], StaleFencingToken) and errors[0].current == 3
    assert statuses == [412]
    assert moto.client().get_object(Bucket=bucket, Key=KEY)["Body"].read() == b"v3"


def _catch(errors: list[Exception], fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        errors.append(exc)


@pytest.fixture
def leases(pg_dsn: str, schema: str) -> Iterator[LeaseStore]:
    store = LeaseStore(pg_dsn, schema=schema)
    yield store
    store.close()


def test_fenced_put_publishes_with_the_lease_s_token_once_per_slot(
    moto: MotoServer, aws_conn: str, leases: LeaseStore
) -> None:
    bucket = moto.bucket()
    lease = leases.acquire("report-job", "dag/run-1/publish", TTL)
    assert lease is not None
    ctx = LeaseContext(lease=lease, store=leases)
    published = ctx.fenced_put(bucket, KEY, "x\n1\n", aws_conn_id=aws_conn, idempotency_key="2026-12-02")
    assert published.token == lease.token and published.lease_key == "report-job"
    seen = ObjectFence(moto.client()).read(bucket, KEY)
    assert seen is not None and (seen.token, seen.owner, seen.lease_key) == (lease.token, lease.owner, "report-job")
    assert seen.fence["report-job"].store_id == leases.store_id
    ctx.fenced_put(bucket, KEY, "x\n2\n", aws_conn_id=aws_conn)  # the same grant publishes again
    with pytest.raises(DuplicatePublish):
        ctx.fenced_put(bucket, KEY, "x\n3\n", aws_conn_id=aws_conn, idempotency_key="2026-12-02")
    assert moto.client().get_object(Bucket=bucket, Key=KEY)["Body"].read() == b"x\n2\n"


def test_fenced_put_of_a_superseded_holder_is_refused_and_recorded(
    moto: MotoServer, aws_conn: str, leases: LeaseStore
) -> None:
    """The old holder's lease was force-released and granted again; the new holder published. The old
    holder's early check refuses it (LeaseLost); writing past that check, the store refuses it, and the
    refusal is in the lease store's ledger."""
    bucket = moto.bucket()
    old = leases.acquire("report-job", "dag/run-1/publish", TTL)
    assert old is not None
    leases.force_release("report-job", by="test", reason="takeover")
    new = leases.acquire("report-job", "dag/run-2/publish", TTL)
    assert new is not None and new.token > old.token
    LeaseContext(lease=new, store=leases).fenced_put(bucket, KEY, b"new", aws_conn_id=aws_conn)
    stale = LeaseContext(lease=old, store=leases)
    with pytest.raises(LeaseLost):
        stale.fenced_put(bucket, KEY, b"old", aws_conn_id=aws_conn)
    stale.check = lambda: old  # type: ignore[method-assign]  # a zombie past its check (frozen after it)
    with pytest.raises(StaleFencingToken) as refused:
        stale.fenced_put(bucket, KEY, b"old", aws_conn_id=aws_conn)
    assert refused.value.current == new.token
    assert moto.client().get_object(Bucket=bucket, Key=KEY)["Body"].read() == b"new"
    rejected = leases.events.query(key=f"s3://{bucket}/{KEY}", kind=EventKind.FENCE_REJECTED)
    assert len(rejected) == 1 and rejected[0].token == old.token, rejected
    assert rejected[0].detail["current_token"] == new.token and rejected[0].detail["fence_at"] == "object store"
