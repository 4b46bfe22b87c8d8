"""The fence at an S3-compatible object store (issue 27, item 3), against a real S3 API server process.

The store itself refuses a stale write: every write is a PutObject conditional on the ETag read
(``If-Match``; ``If-None-Match: *`` for the first), with the fence in the object's metadata. A writer is
held between its read and its send with botocore's own ``before-send`` event (the request is already
signed with its condition): that is where a zombie freezes, and nothing about the store is simulated.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError

from airflow_lease_provider.core import DuplicatePublish, InvalidArgument, LeaseLost, StaleFencingToken
from airflow_lease_provider.fences.s3 import (
    FENCE_METADATA,
    ObjectFence,
    ObjectPublish,
    ObjectStoreError,
    ObjectStoreUnavailable,
)
from tests.s3 import ACCESS_KEY, SECRET_KEY, MotoServer, free_port

KEY = "articles/2026-12-02.json"
LEASE = "daily-article"
STORE = str(uuid.uuid4())


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture
def bucket(moto: MotoServer) -> str:
    return moto.bucket()


def _body(fence: ObjectFence, bucket: str) -> bytes:
    got = fence.read(bucket, KEY)
    assert got is not None and got.body is not None
    return got.body


def _hold_puts(client: Any, before_send: Callable[[], None], *, key: str = KEY) -> list[int]:
    """Run ``before_send`` before each PutObject of ``key`` leaves this client (after it was signed with
    its If-Match / If-None-Match); returns the HTTP statuses the store answered, in order."""
    statuses: list[int] = []

    def hold(request: Any, **_: Any) -> None:
        if request.url.split("?")[0].endswith("/" + key):
            before_send()

    def answered(http_response: Any, model: Any, **_: Any) -> None:
        statuses.append(int(http_response.status_code))

    client.meta.events.register("before-send.s3.PutObject", hold)
    client.meta.events.register("after-call.s3.PutObject", answered)
    return statuses


def test_the_server_refuses_a_stale_etag(moto: MotoServer, bucket: str) -> None:
    """The premise: this moto_server answers a conditional PutObject that does not hold with 412."""
    client = moto.client()
    first = client.put_object(Bucket=bucket, Key=KEY, Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError) as exists:
        client.put_object(Bucket=bucket, Key=KEY, Body=b"2", IfNoneMatch="*")
    assert exists.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    client.put_object(Bucket=bucket, Key=KEY, Body=b"3", IfMatch=first["ETag"])
    with pytest.raises(ClientError) as moved:
        client.put_object(Bucket=bucket, Key=KEY, Body=b"4", IfMatch=first["ETag"])
    assert moved.value.response["Error"]["Code"] == "PreconditionFailed"
    assert client.get_object(Bucket=bucket, Key=KEY)["Body"].read() == b"3"


def test_a_larger_token_is_accepted_and_an_older_one_refused_with_the_object_unchanged(
    moto: MotoServer, bucket: str
) -> None:
    fence = ObjectFence(moto.client())
    first = fence.put(bucket, KEY, b"v5", token=5, lease_key=LEASE, owner="run-5", store_id=STORE)
    assert isinstance(first, ObjectPublish) and first.attempts == 1
    fence.put(bucket, KEY, b"v6", token=6, lease_key=LEASE, owner="run-6", store_id=STORE)
    with pytest.raises(StaleFencingToken) as refused:
        fence.put(bucket, KEY, b"zombie", token=5, lease_key=LEASE, owner="run-5", store_id=STORE)
    assert refused.value.current == 6 and refused.value.token == 5 and refused.value.reason == "stale"
    assert "already accepted token 6" in str(refused.value)
    seen = fence.read(bucket, KEY)
    assert seen is not None
    assert (seen.body, seen.token, seen.owner, seen.lease_key) == (b"v6", 6, "run-6", LEASE)
    assert fence.current(f"s3://{bucket}/{KEY}", key=LEASE) == 6


def test_a_frozen_writer_is_refused_by_the_store_itself_and_the_object_keeps_the_newer_content(
    moto: MotoServer, bucket: str
) -> None:
    """The zombie read the fence (token 4: its 5 is larger) and froze with its conditional PUT signed; the
    holder of 6 published; the zombie's PUT reaches the store, which answers 412; it reads again and
    raises StaleFencingToken. The object keeps 6's bytes."""
    setup = ObjectFence(moto.client())
    setup.put(bucket, KEY, b"v4", token=4, lease_key=LEASE, owner="run-4", store_id=STORE)
    zombie_client = moto.client()
    frozen, resume = threading.Event(), threading.Event()

    def freeze() -> None:
        frozen.set()
        assert resume.wait(20)

    statuses = _hold_puts(zombie_client, freeze)
    outcome: dict[str, Any] = {}

    def zombie() -> None:
        try:
            outcome["published"] = ObjectFence(zombie_client).put(
                bucket, KEY, b"zombie", token=5, lease_key=LEASE, owner="run-5", store_id=STORE
            )
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=zombie)
    thread.start()
    assert frozen.wait(20)
    ObjectFence(moto.client()).put(bucket, KEY, b"v6", token=6, lease_key=LEASE, owner="run-6", store_id=STORE)
    resume.set()
    thread.join(20)
    assert "published" not in outcome, outcome
    refused = outcome["error"]
    assert isinstance(refused, StaleFencingToken) and (refused.token, refused.current) == (5, 6)
    assert statuses == [412]  # the store refused the zombie's one write
    assert _body(setup, bucket) == b"v6"


def test_a_frozen_first_write_is_refused_when_the_newer_one_created_the_object(
    moto: MotoServer, bucket: str
) -> None:
    """No object yet: the zombie's PUT carries If-None-Match: *; the newer holder created it meanwhile."""
    zombie_client = moto.client()
    frozen, resume = threading.Event(), threading.Event()
    statuses = _hold_puts(zombie_client, lambda: (frozen.set(), resume.wait(20)) and None)
    errors: list[Exception] = []

    def zombie() -> None:
        try:
            ObjectFence(zombie_client).put(bucket, KEY, b"zombie", token=1, lease_key=LEASE, owner="run-1")
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=zombie)
    thread.start()
    assert frozen.wait(20)
    ObjectFence(moto.client()).put(bucket, KEY, b"v2", token=2, lease_key=LEASE, owner="run-2")
    resume.set()
    thread.join(20)
    assert len(errors) == 1 and isinstance(errors[0], StaleFencingToken), errors
    assert statuses == [412]
    assert _body(ObjectFence(moto.client()), bucket) == b"v2"


def test_two_writers_race_one_wins_and_the_other_gets_stale_fencing_token(moto: MotoServer, bucket: str) -> None:
    """Two writers of token 7 of two owners (a holder and a zombie that believes it holds the grant), both
    past their read with conditional PUTs on the same ETag, sent at once: the store lets exactly one
    through; the other gets 412, reads the winner's equal token of another owner and is refused."""
    ObjectFence(moto.client()).put(bucket, KEY, b"v6", token=6, lease_key=LEASE, owner="run-6")
    barrier = threading.Barrier(2, timeout=20)
    results: dict[str, Any] = {}
    all_statuses: dict[str, list[int]] = {}

    def writer(owner: str) -> None:
        client = moto.client()
        sent = [False]

        def wait_for_the_other() -> None:
            if not sent[0]:  # only the first send of each writer is held
                sent[0] = True
                barrier.wait()

        all_statuses[owner] = _hold_puts(client, wait_for_the_other)
        try:
            results[owner] = ObjectFence(client).put(
                bucket, KEY, owner.encode(), token=7, lease_key=LEASE, owner=owner
            )
        except Exception as exc:
            results[owner] = exc

    threads = [threading.Thread(target=writer, args=(name,)) for name in ("holder", "zombie")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [o for o, r in results.items() if isinstance(r, ObjectPublish)]
    losers = [o for o, r in results.items() if isinstance(r, StaleFencingToken)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert sorted(s[0] for s in all_statuses.values()) == [200, 412]
    assert all_statuses[losers[0]] == [412]  # refused after the 412, never sent again
    assert results[losers[0]].current == 7
    assert _body(ObjectFence(moto.client()), bucket) == winners[0].encode()


def test_many_writers_race_and_the_object_s_history_never_goes_back_to_a_smaller_token(
    moto: MotoServer,
) -> None:
    """Eight writers of tokens 1..8, all past their read of the empty bucket, sent at once: exactly one
    first-round PUT succeeds; every writer either published or was refused by a larger token; in the
    versioned bucket the versions' tokens only ever increase, and the last is 8's."""
    bucket = moto.bucket(versioned=True)
    n = 8
    barrier = threading.Barrier(n, timeout=20)
    first_round: list[int] = []
    lock = threading.Lock()
    results: dict[int, Any] = {}

    def writer(token: int) -> None:
        client = moto.client()
        sent = [False]

        def hold() -> None:
            if not sent[0]:
                sent[0] = True
                barrier.wait()

        statuses = _hold_puts(client, hold)
        try:
            results[token] = ObjectFence(client, max_attempts=20).put(
                bucket, KEY, f"v{token}".encode(), token=token, lease_key=LEASE, owner=f"run-{token}"
            )
        except Exception as exc:
            results[token] = exc
        with lock:
            first_round.append(statuses[0])

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(1, n + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(first_round) == [200] + [412] * (n - 1)
    assert isinstance(results[n], ObjectPublish)
    for token, result in results.items():
        if not isinstance(result, ObjectPublish):
            assert isinstance(result, StaleFencingToken), result
            assert result.current is not None and result.current > token
    client = moto.client()
    versions = client.list_object_versions(Bucket=bucket, Prefix=KEY)["Versions"]
    # Listed newest first (LastModified has whole seconds only, too coarse to order them).
    assert versions[0]["IsLatest"]
    tokens = [
        int(client.head_object(Bucket=bucket, Key=KEY, VersionId=v["VersionId"])["Metadata"]["lease-token"])
        for v in reversed(versions)
    ]
    assert tokens == sorted(set(tokens)) and tokens[-1] == n, tokens
    assert len(tokens) == sum(isinstance(r, ObjectPublish) for r in results.values())


def test_the_same_grant_publishes_again_and_no_other_equal_token_does(moto: MotoServer, bucket: str) -> None:
    fence = ObjectFence(moto.client())
    me = {"token": 9, "lease_key": LEASE, "owner": "dag/run-9/publish", "store_id": STORE}
    fence.put(bucket, KEY, b"part 1", **me)
    again = fence.put(bucket, KEY, b"part 2", **me)  # a second publish of one task, a mapped instance
    assert again.attempts == 1 and _body(fence, bucket) == b"part 2"
    with pytest.raises(StaleFencingToken) as other_owner:
        fence.put(bucket, KEY, b"x", token=9, lease_key=LEASE, owner="dag/run-8/publish", store_id=STORE)
    assert other_owner.value.reason == "stale"
    with pytest.raises(StaleFencingToken):
        fence.put(bucket, KEY, b"x", token=9, lease_key=LEASE, store_id=STORE)  # no owner: not the grant
    with pytest.raises(StaleFencingToken) as recreated:
        fence.put(bucket, KEY, b"x", token=9, lease_key=LEASE, owner="dag/run-9/publish", store_id=str(uuid.uuid4()))
    assert recreated.value.reason == "other_store" and "failover --above 9" in str(recreated.value)
    assert _body(fence, bucket) == b"part 2"


def test_an_idempotency_key_publishes_once_per_slot(moto: MotoServer, bucket: str) -> None:
    fence = ObjectFence(moto.client())
    fence.put(bucket, KEY, b"slot 1", token=3, lease_key=LEASE, owner="run-3", idempotency_key="2026-12-02")
    assert fence.published(f"s3://{bucket}/{KEY}", "2026-12-02")
    for token, owner in ((3, "run-3"), (4, "run-4")):  # the same grant again, and a later run
        with pytest.raises(DuplicatePublish) as dup:
            fence.put(bucket, KEY, b"again", token=token, lease_key=LEASE, owner=owner, idempotency_key="2026-12-02")
        assert dup.value.idempotency_key == "2026-12-02" and dup.value.current == 3
    assert _body(fence, bucket) == b"slot 1"
    assert fence.current(f"s3://{bucket}/{KEY}", key=LEASE) == 3
    fence.put(bucket, KEY, b"slot 2", token=4, lease_key=LEASE, owner="run-4", idempotency_key="2026-12-03")
    assert _body(fence, bucket) == b"slot 2"


def test_a_refused_write_gives_its_idempotency_claim_back(moto: MotoServer, bucket: str) -> None:
    fence = ObjectFence(moto.client())
    fence.put(bucket, KEY, b"v8", token=8, lease_key=LEASE, owner="run-8")
    with pytest.raises(StaleFencingToken):
        fence.put(bucket, KEY, b"zombie", token=7, lease_key=LEASE, owner="run-7", idempotency_key="slot-a")
    assert not fence.published(f"s3://{bucket}/{KEY}", "slot-a")
    fence.put(bucket, KEY, b"slot a", token=8, lease_key=LEASE, owner="run-8", idempotency_key="slot-a")
    assert _body(fence, bucket) == b"slot a" and fence.published(f"s3://{bucket}/{KEY}", "slot-a")


def test_two_writers_of_one_slot_race_and_one_publishes(moto: MotoServer, bucket: str) -> None:
    barrier = threading.Barrier(2, timeout=20)
    results: list[Any] = []

    def writer(token: int) -> None:
        client = moto.client()
        marker = ObjectFence(client).marker_key(KEY, "slot-r")
        sent = [False]

        def hold() -> None:
            if not sent[0]:
                sent[0] = True
                barrier.wait()

        _hold_puts(client, hold, key=marker)
        try:
            results.append(ObjectFence(client).put(
                bucket, KEY, f"v{token}".encode(), token=token, lease_key=LEASE, owner=f"r{token}",
                idempotency_key="slot-r",
            ))
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(type(r).__name__ for r in results) == ["DuplicatePublish", "ObjectPublish"], results


def test_lease_keys_have_fences_of_their_own_on_one_object(moto: MotoServer, bucket: str) -> None:
    """Tokens are compared per lease key: another key's small token is not refused, and a zombie of the
    first key is still refused after the other key wrote."""
    fence = ObjectFence(moto.client())
    fence.put(bucket, KEY, b"a10", token=10, lease_key="job-a", owner="a")
    fence.put(bucket, KEY, b"b2", token=2, lease_key="job-b", owner="b")
    with pytest.raises(StaleFencingToken):
        fence.put(bucket, KEY, b"a9", token=9, lease_key="job-a", owner="a9")
    seen = fence.read(bucket, KEY)
    assert seen is not None and seen.body == b"b2" and (seen.lease_key, seen.token) == ("job-b", 2)
    assert {k: e.token for k, e in seen.fence.items()} == {"job-a": 10, "job-b": 2}


def test_an_unreachable_store_fails_closed_without_secrets(caplog: pytest.LogCaptureFixture) -> None:
    import boto3
    from botocore.config import Config

    port = free_port()  # nothing listens there
    client = boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=1),
    )
    caplog.set_level(logging.DEBUG, logger="airflow_lease_provider")
    with pytest.raises(ObjectStoreUnavailable) as down:
        ObjectFence(client).put(
            "fence-bucket", KEY, b"x", token=1, lease_key=LEASE, owner="run-1", idempotency_key="slot"
        )
    message = str(down.value)
    assert f"127.0.0.1:{port}" in message and "s3://fence-bucket/" in message and "nothing was accepted" in message
    for secret in (ACCESS_KEY, SECRET_KEY):
        assert secret not in message and secret not in caplog.text


def test_a_store_that_stops_mid_way_fails_closed() -> None:
    server = MotoServer()
    try:
        bucket = server.bucket()
        fence = ObjectFence(server.client(connect_timeout=1, read_timeout=2))
        fence.put(bucket, KEY, b"v1", token=1, lease_key=LEASE, owner="run-1")
    finally:
        server.stop()
    with pytest.raises(ObjectStoreUnavailable):
        fence.put(bucket, KEY, b"v2", token=2, lease_key=LEASE, owner="run-2")


def test_a_store_error_names_the_code_and_no_secret(moto: MotoServer) -> None:
    with pytest.raises(ObjectStoreError) as missing:
        ObjectFence(moto.client()).put("fence-no-such-bucket", KEY, b"x", token=1, lease_key=LEASE)
    assert missing.value.code == "NoSuchBucket" and missing.value.status == 404
    assert SECRET_KEY not in str(missing.value) and ACCESS_KEY not in str(missing.value)


def test_arguments_are_checked_before_anything_is_sent(moto: MotoServer, bucket: str) -> None:
    fence = ObjectFence(moto.client())
    with pytest.raises(InvalidArgument, match="token"):
        fence.put(bucket, KEY, b"x", token=0, lease_key=LEASE)
    with pytest.raises(InvalidArgument, match="lease-"):
        fence.put(bucket, KEY, b"x", token=1, lease_key=LEASE, metadata={"lease-token": "99"})
    with pytest.raises(InvalidArgument, match="IfMatch"):
        fence.put(bucket, KEY, b"x", token=1, lease_key=LEASE, extra_args={"IfMatch": "*"})
    with pytest.raises(InvalidArgument, match="store_id"):
        fence.put(bucket, KEY, b"x", token=1, lease_key=LEASE, store_id="not-a-uuid")
    assert fence.read(bucket, KEY) is None


def test_user_metadata_and_content_type_are_kept_beside_the_fence(moto: MotoServer, bucket: str) -> None:
    fence = ObjectFence(moto.client())
    fence.put(
        bucket, KEY, '{"a": 1}', token=1, lease_key=LEASE, owner="run-1", metadata={"slot": "2026-12-02"},
        content_type="application/json",
    )
    head = moto.client().head_object(Bucket=bucket, Key=KEY)
    assert head["ContentType"] == "application/json"
    assert head["Metadata"]["slot"] == "2026-12-02" and head["Metadata"]["lease-token"] == "1"
    assert FENCE_METADATA in head["Metadata"]


_FROZEN_WRITER = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
from airflow_lease_provider.core import StaleFencingToken
from airflow_lease_provider.fences.s3 import ObjectFence
from tests.s3 import MotoServer
url, bucket, key = sys.argv[1:4]
server = MotoServer.__new__(MotoServer)
server.url = url
client = server.client()

def freeze(request, **_):
    print("frozen", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped with its conditional PUT signed, before sending it

client.meta.events.register("before-send.s3.PutObject", freeze)
try:
    ObjectFence(client).put(bucket, key, b"zombie", token=5, lease_key="daily-article", owner="run-5")
except StaleFencingToken as refused:
    print("refused", refused.token, refused.current, flush=True)
    sys.exit(3)
print("published", flush=True)
"""


def test_a_sigstopped_writer_process_is_refused_by_the_store_when_it_resumes(moto: MotoServer, bucket: str) -> None:
    """A writer process stopped (SIGSTOP) between reading the fence and sending its PUT; a newer holder
    publishes; the writer is resumed (SIGCONT): the store refuses its write and the object keeps 6's bytes."""
    import signal
    import subprocess
    import sys

    from tests.s3 import ROOT

    ObjectFence(moto.client()).put(bucket, KEY, b"v4", token=4, lease_key=LEASE, owner="run-4")
    writer = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_WRITER, moto.url, bucket, KEY],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "frozen"
        ObjectFence(moto.client()).put(bucket, KEY, b"v6", token=6, lease_key=LEASE, owner="run-6")
        writer.send_signal(signal.SIGCONT)
        out, err = writer.communicate(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == 3, (out, err[-2000:])
    assert out.split() == ["refused", "5", "6"]
    assert _body(ObjectFence(moto.client()), bucket) == b"v6"


def _resend_first_success(client: Any, key: str) -> list[int]:
    """Make botocore send a PutObject of ``key`` again after its first success (as after a reply lost on
    the way back): the resend carries the same condition, which the write itself has just made false."""
    resent: list[int] = []

    def needs_retry(response: Any, request_dict: Any, attempts: int, **_: Any) -> int | None:
        if response is None or resent or not request_dict["url"].split("?")[0].endswith("/" + key):
            return None
        if response[0].status_code == 200:
            resent.append(attempts)
            return 0  # retry at once
        return None

    client.meta.events.register_first("needs-retry.s3.PutObject", needs_retry)
    return resent


def test_a_write_sent_again_after_a_lost_reply_is_known_as_its_own(moto: MotoServer, bucket: str) -> None:
    """The resend gets 412 (the first send landed); the fence reads its own write id there and reports
    success, not a refusal (without an owner an equal token would otherwise be refused as stale)."""
    client = moto.client()
    resent = _resend_first_success(client, KEY)
    published = ObjectFence(client).put(bucket, KEY, b"once", token=2, lease_key=LEASE)
    assert resent == [1]
    assert isinstance(published, ObjectPublish) and published.attempts == 2
    assert _body(ObjectFence(moto.client()), bucket) == b"once"


def test_a_claim_sent_again_after_a_lost_reply_is_known_as_its_own(moto: MotoServer, bucket: str) -> None:
    client = moto.client()
    fence = ObjectFence(client)
    resent = _resend_first_success(client, fence.marker_key(KEY, "slot-l"))
    fence.put(bucket, KEY, b"slot l", token=2, lease_key=LEASE, owner="run-2", idempotency_key="slot-l")
    assert resent == [1]
    assert _body(fence, bucket) == b"slot l" and fence.published(f"s3://{bucket}/{KEY}", "slot-l")


def test_a_fence_too_large_for_s3_metadata_is_refused_before_sending(moto: MotoServer, bucket: str) -> None:
    fence = ObjectFence(moto.client())
    fence.put(bucket, KEY, b"v", token=1, lease_key="k" * 400, owner="o" * 400)
    with pytest.raises(InvalidArgument, match="2048"):
        fence.put(bucket, KEY, b"too much", token=1, lease_key="j" * 400, owner="p" * 800)
    assert _body(fence, bucket) == b"v"


def test_writing_the_bytes_already_there_warns_that_the_etag_does_not_move(
    moto: MotoServer, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The limit of an ETag compare-and-swap (docs/core.md, "Limits"): S3's ETag is the MD5 of the bytes,
    so the same bytes again leave it as it was. The write is accepted, the token advances, and it says so."""
    fence = ObjectFence(moto.client())
    first = fence.put(bucket, KEY, b"same", token=1, lease_key=LEASE, owner="run-1")
    caplog.set_level(logging.WARNING, logger="airflow_lease_provider")
    again = fence.put(bucket, KEY, b"same", token=2, lease_key=LEASE, owner="run-2")
    assert again.etag == first.etag and fence.current(f"s3://{bucket}/{KEY}", key=LEASE) == 2
    assert "writes the very bytes already there" in caplog.text
    caplog.clear()
    fence.put(bucket, KEY, b"other", token=3, lease_key=LEASE, owner="run-3")
    assert "very bytes" not in caplog.text


def _interrupt_when_answered(client: Any, key: str, interruption: BaseException, *, operation: str = "PutObject") -> None:
    """Raise ``interruption`` in this (the task's main) thread the moment the store's success answer to
    ``operation`` on ``key`` comes back: what a signal handler's ``LeaseLost`` or ``TaskTerminated`` does
    when it lands just after the store applied the write."""
    sent: list[str] = []

    def note(request: Any, **_: Any) -> None:
        sent.append(request.url.split("?")[0])

    def interrupt(http_response: Any, **_: Any) -> None:
        if sent and sent[-1].endswith("/" + key) and http_response.status_code == 200:
            raise interruption

    client.meta.events.register(f"before-send.s3.{operation}", note)
    client.meta.events.register(f"after-call.s3.{operation}", interrupt)


INTERRUPTIONS = [
    pytest.param(LeaseLost(LEASE, 5, "renewal refused"), id="LeaseLost"),  # an Exception
    pytest.param(KeyboardInterrupt(), id="KeyboardInterrupt"),  # a BaseException
]


@pytest.mark.parametrize("interruption", INTERRUPTIONS)
def test_an_interruption_after_the_store_applied_the_write_keeps_the_claim(
    moto: MotoServer, bucket: str, interruption: BaseException
) -> None:
    """Issue 38, defect 7: the claim was given back on any exception but a read timeout or a dropped
    connection, so the retry published the same slot a second time."""
    client = moto.client()
    _interrupt_when_answered(client, KEY, interruption)
    with pytest.raises(type(interruption)):
        ObjectFence(client).put(bucket, KEY, b"first try", token=5, lease_key=LEASE, owner="run-5",
                                idempotency_key="slot-t")
    reader = ObjectFence(moto.client())
    got = reader.read(bucket, KEY)
    assert got is not None and (got.body, got.token) == (b"first try", 5)  # the store applied it
    assert reader.published(f"s3://{bucket}/{KEY}", "slot-t"), "the claim of a write that landed was given back"
    with pytest.raises(DuplicatePublish):  # the task's retry, with its new token: the slot is published once
        reader.put(bucket, KEY, b"second try", token=6, lease_key=LEASE, owner="run-5", idempotency_key="slot-t")
    assert _body(reader, bucket) == b"first try"


@pytest.mark.parametrize("interruption", INTERRUPTIONS)
def test_an_interruption_before_the_write_was_sent_gives_the_claim_back(
    moto: MotoServer, bucket: str, interruption: BaseException
) -> None:
    """Interrupted while reading the fence (before any write of the object was sent): certainly not written,
    so the slot is free for the retry."""
    ObjectFence(moto.client()).put(bucket, KEY, b"v1", token=1, lease_key=LEASE, owner="run-1")
    client = moto.client()
    _interrupt_when_answered(client, KEY, interruption, operation="HeadObject")
    with pytest.raises(type(interruption)):
        ObjectFence(client).put(bucket, KEY, b"slot u", token=2, lease_key=LEASE, owner="run-2", idempotency_key="slot-u")
    reader = ObjectFence(moto.client())
    assert _body(reader, bucket) == b"v1" and not reader.published(f"s3://{bucket}/{KEY}", "slot-u")
    reader.put(bucket, KEY, b"slot u", token=3, lease_key=LEASE, owner="run-3", idempotency_key="slot-u")
    assert _body(reader, bucket) == b"slot u"


def test_a_write_the_store_refused_gives_the_claim_back(moto: MotoServer, bucket: str) -> None:
    """The store answered the PUT itself with a refusal (400, an argument it does not accept): nothing was
    written, so the claim goes back."""
    fence = ObjectFence(moto.client())
    with pytest.raises(ObjectStoreError) as refused:
        fence.put(bucket, KEY, b"x", token=1, lease_key=LEASE, owner="run-1", idempotency_key="slot-r",
                  extra_args={"StorageClass": "NO_SUCH_CLASS"})
    assert refused.value.status is not None and 400 <= refused.value.status < 500
    assert fence.read(bucket, KEY) is None and not fence.published(f"s3://{bucket}/{KEY}", "slot-r")


def test_a_zombie_of_a_dropped_slot_is_refused_once_a_holder_of_the_new_count_wrote(
    moto: MotoServer, bucket: str
) -> None:
    """The count epoch at the object store (issue 38, defect 3): slots 1 and 2 of ``sem`` (one holding
    period, count epoch 0) both write; the count goes 2 -> 1 (a new period, epoch 7, above every token of the
    old one); the new holder writes; the zombie of slot 2, whose fence key ``sem#2`` nobody writes again, is
    refused by the object itself. Its key's entry is kept in the object's fence metadata."""
    fence = ObjectFence(moto.client())
    slot1 = {"token": 5, "lease_key": "sem", "owner": "run-1", "count_epoch": 0, "base_key": "sem"}
    slot2 = {"token": 3, "lease_key": "sem#2", "owner": "run-2", "count_epoch": 0, "base_key": "sem"}
    fence.put(bucket, KEY, b"slot 2", store_id=STORE, **slot2)  # two valid holders, in either order
    fence.put(bucket, KEY, b"slot 1", store_id=STORE, **slot1)
    fence.put(bucket, KEY, b"slot 2 again", store_id=STORE, **slot2)
    fence.put(bucket, KEY, b"new count", token=9, lease_key="sem", owner="run-3", store_id=STORE, count_epoch=7,
              base_key="sem")
    with pytest.raises(StaleFencingToken) as refused:
        fence.put(bucket, KEY, b"zombie", store_id=STORE, **slot2)
    assert refused.value.reason == "count_epoch" and refused.value.newest == 7 and refused.value.current == 3
    assert _body(fence, bucket) == b"new count"
    head = moto.client().head_object(Bucket=bucket, Key=KEY)
    assert '"e":{"sem":7}' in head["Metadata"][FENCE_METADATA]
    # A write that names no count epoch is decided by its key's tokens alone, as before version 15.
    fence.put(bucket, KEY, b"unnamed", token=4, lease_key="sem#2", owner="run-4", store_id=STORE)
    with pytest.raises(InvalidArgument, match="^count_epoch="):
        fence.put(bucket, KEY, b"x", token=9, lease_key="sem", count_epoch=9)
    with pytest.raises(InvalidArgument, match="^base_key="):
        fence.put(bucket, KEY, b"x", token=9, lease_key="sem#2", count_epoch=1, base_key="other")
