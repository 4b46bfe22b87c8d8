"""The fence at an S3-compatible object store: the store itself refuses a stale token's write.

A fenced object carries its fence in its own user metadata (``x-amz-meta-lease-fence``: for each lease key
that wrote it, the largest token accepted, its owner and its lease store), and every write is a
compare-and-swap: ``PutObject`` with ``If-Match`` on the ETag this writer read (``If-None-Match: *`` when
there was no object). A writer that read the fence, found its token good and was then overtaken (a zombie
resumed after a newer holder published) sends an ``If-Match`` the store no longer matches: the store
answers 412 PreconditionFailed and keeps the newer content. The writer then reads again: a larger token
of its key is there, so it raises :class:`StaleFencingToken`; where the newer write was the same grant's
(an equal token from the same owner), it tries again. No lease store is asked.

The rule is every fence's, :func:`~airflow_lease_provider.core.fencing.decide` (docs/core.md, "Fences"),
decided here on the fence read from the object, then made to hold by the conditional PUT: per (object, lease
key), a token larger than the largest accepted, or equal to it from the same owner of the same lease store,
is accepted. ``ObjectFence`` is a :class:`~airflow_lease_provider.core.fencing.FenceView` whose resources are
``s3://<bucket>/<object key>``; its publish is the write itself (:meth:`ObjectFence.put`).
An idempotency key is claimed per (object, key) as a marker object written with ``If-None-Match: *``
before the write, and given back when the write is refused or definitely failed. docs/core.md, "Fencing at
the object store", says why the token lives in the object's metadata and what this guarantees.

Nothing here imports Airflow: pass any boto3 S3 client (``boto3.client("s3", endpoint_url=...)``);
``airflow_lease_provider.hooks.s3_fence`` builds one from an Airflow AWS connection.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ReadTimeoutError,
)

from airflow_lease_provider.core import validation
from airflow_lease_provider.core.errors import (
    DuplicatePublish,
    InvalidArgument,
    LeaseError,
    LeaseStoreUnavailable,
)
from airflow_lease_provider.core.fencing import (
    FenceEntry,
    FenceState,
    FenceView,
    advanced,
    decide,
    record_rejection,
    store_id_of,
)

log = logging.getLogger(__name__)

#: The user-metadata field (``x-amz-meta-lease-fence``) that holds an object's fence, as JSON.
FENCE_METADATA = "lease-fence"
#: The token of the write that made this version (a plain integer, for consoles and ``aws s3api head-object``).
TOKEN_METADATA = "lease-token"
#: Where idempotency claims are kept, by default: ``<prefix><object key>/<idempotency key>`` in the same bucket.
DEFAULT_MARKER_PREFIX = ".lease-fence/"
#: S3 limits user metadata (names and values) to 2 KB per object.
MAX_METADATA_BYTES = 2048
#: S3 object keys are at most 1024 bytes of UTF-8.
MAX_OBJECT_KEY_BYTES = 1024
#: Put arguments the fence sets itself.
_RESERVED_ARGS = {"Bucket", "Key", "Body", "Metadata", "IfMatch", "IfNoneMatch"}
#: HTTP statuses of a lost compare-and-swap: 412 PreconditionFailed (the ETag moved, or an object appeared
#: where none was), 409 ConditionalRequestConflict (a concurrent conditional write of the same key won).
_CAS_LOST = {412, 409}


class ObjectStoreUnavailable(LeaseStoreUnavailable):
    """The object store could not be reached or did not answer: nothing was accepted (fail closed).

    A subclass of :class:`LeaseStoreUnavailable`, so code that fails closed on an unreachable store does
    here too. The message names the endpoint's host and the object, never credentials.
    """


class ObjectStoreError(LeaseError):
    """The object store answered with an error other than a lost compare-and-swap (access denied, no such
    bucket, ...): nothing was accepted. ``code`` and ``status`` are the store's error code and HTTP status."""

    def __init__(self, message: str, *, code: str | None, status: int | None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class ObjectFenceContention(LeaseError):
    """The compare-and-swap kept losing to writes of the same grant (or unfenced writes) and gave up.

    Nothing newer refused this token: trying again later may succeed.
    """


@dataclass(frozen=True)
class ObjectPublish:
    """An accepted write: the object's new ETag (and version id, in a versioned bucket).

    :ivar attempts: how many compare-and-swaps it took (more than 1: a concurrent write of the same grant,
        or an unfenced write, moved the ETag in between).
    """

    bucket: str
    key: str
    token: int
    lease_key: str
    etag: str
    version_id: str | None = None
    idempotency_key: str | None = None
    attempts: int = 1

    @property
    def resource(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


@dataclass(frozen=True)
class FencedObject:
    """An object as a reader sees it: its bytes and the fence of the write that made them.

    ``token``, ``lease_key``, ``owner`` are those of the write that made this version (``None``: an object
    written without the fence). ``fence`` has every lease key's largest accepted token.
    """

    bucket: str
    key: str
    body: bytes | None
    etag: str
    token: int | None
    lease_key: str | None
    owner: str | None
    fence: dict[str, FenceEntry] = field(default_factory=dict)
    version_id: str | None = None


@dataclass(frozen=True)
class _State:
    exists: bool
    etag: str | None
    fence: dict[str, FenceEntry]
    writer: str | None  # the write id of the put that made this version
    #: Per lease key, the largest count epoch its holders' writes named (version 15).
    epochs: dict[str, int] = field(default_factory=dict)


def _resource(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def split_resource(resource: str) -> tuple[str, str]:
    """``(bucket, object key)`` of a resource ``s3://<bucket>/<object key>`` (as :attr:`ObjectPublish.resource`
    and every decision of this fence name it)."""
    bucket, sep, key = resource.removeprefix("s3://").partition("/") if isinstance(resource, str) else ("", "", "")
    if not resource.startswith("s3://") or not bucket or not sep or not key:
        raise InvalidArgument("resource", resource, "must name an object: s3://<bucket>/<object key>")
    return bucket, key


def _status(exc: ClientError) -> int | None:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def _code(exc: ClientError) -> str | None:
    code = exc.response.get("Error", {}).get("Code")
    return str(code) if code is not None else None


def parse_fence(metadata: dict[str, str] | None) -> tuple[dict[str, FenceEntry], str | None, str | None]:
    """The fence (per lease key), the lease key of the write that made this version, and its write id,
    from an object's user metadata. An object with no fence, or one that does not parse, has none: it
    was not written through the fence (its write is not refused, and nothing about it is trusted)."""
    raw = (metadata or {}).get(FENCE_METADATA)
    if not raw:
        return {}, None, None
    try:
        data = json.loads(raw)
        keys = {
            str(k): FenceEntry(int(v["t"]), v.get("o"), v.get("s"))
            for k, v in dict(data.get("k", {})).items()
        }
        last = data.get("l")
        writer = data.get("w")
    except (ValueError, TypeError, KeyError, AttributeError):
        log.warning("object fence: metadata %r does not parse; treating the object as unfenced", FENCE_METADATA)
        return {}, None, None
    return keys, (str(last) if last is not None else None), (str(writer) if writer is not None else None)


def parse_count_epochs(metadata: dict[str, str] | None) -> dict[str, int]:
    """Per lease key, the largest count epoch its holders' writes of the object named (docs/core.md, "The
    fence"): a token of that key (any slot) at or below it is refused. Empty for an object without them."""
    raw = (metadata or {}).get(FENCE_METADATA)
    if not raw:
        return {}
    try:
        return {str(k): int(v) for k, v in dict(json.loads(raw).get("e", {})).items()}
    except (ValueError, TypeError, AttributeError):
        log.warning("object fence: the count epochs in metadata %r do not parse; treating them as none", FENCE_METADATA)
        return {}


def _encode_fence(fence: dict[str, FenceEntry], last: str, writer: str, epochs: dict[str, int] | None = None) -> str:
    keys = {}
    for k, entry in sorted(fence.items()):
        item: dict[str, Any] = {"t": entry.token}
        if entry.owner is not None:
            item["o"] = entry.owner
        if entry.store_id is not None:
            item["s"] = entry.store_id
        keys[k] = item
    data: dict[str, Any] = {"v": 1, "k": keys, "l": last, "w": writer}
    if epochs:
        data["e"] = dict(sorted(epochs.items()))
    # ASCII only: metadata travels as HTTP headers.
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


class ObjectFence(FenceView):
    """Fenced writes to an S3-compatible store through one boto3 S3 client.

    :param client: a boto3 S3 client (``boto3.client("s3", ...)``, or ``S3Hook(...).get_conn()``).
    :param marker_prefix: where idempotency claims are kept in each bucket:
        ``<marker_prefix><object key>/<idempotency key>`` (default ``.lease-fence/``).
    :param max_attempts: compare-and-swaps to try while only the same grant (or unfenced writes) keep
        moving the ETag; then :class:`ObjectFenceContention`. A larger token ends it at once instead.
    :param endpoint: how to name the store in errors (default: the client's endpoint host, without any
        user or password in the URL).
    """

    def __init__(
        self,
        client: Any,
        *,
        marker_prefix: str = DEFAULT_MARKER_PREFIX,
        max_attempts: int = 10,
        endpoint: str | None = None,
    ) -> None:
        if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
            raise InvalidArgument("max_attempts", max_attempts, "must be a positive integer")
        if not isinstance(marker_prefix, str) or not marker_prefix:
            raise InvalidArgument("marker_prefix", marker_prefix, "must be a non-empty string (a key prefix)")
        self.client = client
        self.marker_prefix = marker_prefix
        self.max_attempts = max_attempts
        self.endpoint = endpoint or _endpoint_host(client)

    # ---------------------------------------------------------------- errors

    def _where(self, bucket: str, key: str) -> str:
        return f"{_resource(bucket, key)} at {self.endpoint}"

    def _failure(self, exc: Exception, what: str, bucket: str, key: str) -> LeaseError:
        """A store error as this library's, naming only the operation, object, endpoint host and code."""
        if isinstance(exc, ClientError):
            code, status = _code(exc), _status(exc)
            return ObjectStoreError(
                f"object fence: {what} of {self._where(bucket, key)} failed: {code or 'error'} "
                f"(HTTP {status}); nothing was accepted",
                code=code, status=status,
            )
        return ObjectStoreUnavailable(
            f"object fence: {what} of {self._where(bucket, key)} failed: the object store could not be "
            f"reached or did not answer ({type(exc).__name__}); nothing was accepted"
        )

    # ---------------------------------------------------------------- reading

    def _fetch(self, call: Any, bucket: str, key: str, what: str, *, of: str | None = None) -> dict[str, Any] | None:
        """``call(Bucket=bucket, Key=key)`` (a HEAD or GET): its reply, or ``None`` when there is no such object;
        any other error as this library's, naming object ``of`` (default ``key``)."""
        try:
            return dict(call(Bucket=bucket, Key=key))
        except ClientError as exc:
            if _status(exc) == 404 or _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._failure(exc, what, bucket, of or key) from None
        except BotoCoreError as exc:
            raise self._failure(exc, what, bucket, of or key) from None

    def _state(self, bucket: str, key: str) -> _State:
        head = self._fetch(self.client.head_object, bucket, key, "reading the fence")
        if head is None:
            return _State(False, None, {}, None)
        fence, _, writer = parse_fence(head.get("Metadata"))
        return _State(True, head.get("ETag"), fence, writer, parse_count_epochs(head.get("Metadata")))

    def current(self, resource: str, *, key: str) -> int | None:
        """The largest token of lease ``key`` the object ``resource`` (``s3://bucket/object``) has accepted
        (``None``: none, or no object)."""
        key = validation.lookup_name("key", key)
        entry = self._state(*split_resource(resource)).fence.get(key)
        return entry.token if entry is not None else None

    def tokens(self, resource: str) -> dict[str, int]:
        """Every lease key's largest accepted token at the object ``resource`` (``s3://bucket/object``)."""
        return {k: entry.token for k, entry in self._state(*split_resource(resource)).fence.items()}

    def read(self, bucket: str, key: str, *, body: bool = True) -> FencedObject | None:
        """The object and the fence of the write that made it, in one GET (one HEAD with ``body=False``);
        ``None`` when there is no object. A GET returns one whole version: its bytes and its metadata
        were written together."""
        got = self._fetch(self.client.get_object if body else self.client.head_object, bucket, key, "reading")
        if got is None:
            return None
        data: bytes | None = got["Body"].read() if body else None
        fence, last, _ = parse_fence(got.get("Metadata"))
        entry = fence.get(last) if last is not None else None
        return FencedObject(
            bucket, key, data, got.get("ETag", ""), entry.token if entry else None, last,
            entry.owner if entry else None, fence, got.get("VersionId"),
        )

    # ---------------------------------------------------------------- writing

    def put(
        self,
        bucket: str,
        key: str,
        body: bytes | str,
        *,
        token: int,
        lease_key: str,
        owner: str | None = None,
        store_id: str | None = None,
        idempotency_key: str | None = None,
        count_epoch: int | None = None,
        base_key: str | None = None,
        metadata: dict[str, str] | None = None,
        content_type: str | None = None,
        extra_args: dict[str, Any] | None = None,
    ) -> ObjectPublish:
        """Write ``body`` to ``s3://bucket/key`` if the object's fence accepts ``token`` of ``lease_key``.

        The write is one ``PutObject`` conditional on the ETag read just before (``If-None-Match: *`` when
        there was no object), carrying the updated fence in the object's metadata: the object store
        refuses it if anything was written in between. On a lost compare-and-swap it reads again: a larger
        token of ``lease_key`` there (or an equal one of another holder) raises :class:`StaleFencingToken`
        and the object keeps the newer content; otherwise it tries again (up to ``max_attempts``).

        :param owner: the lease's owner: with it the same grant (equal token, same owner, same store) may
            write again; without it an equal token is refused, as in the SQL fence.
        :param store_id: the issuing lease store's id (``LeaseStore.store_id``): a refusal by a token of
            another store says so (``reason="other_store"``).
        :param idempotency_key: claimed for this object before the write (a marker object written with
            ``If-None-Match: *``); a key already claimed raises :class:`DuplicatePublish` whatever the
            token. Given back when the write is refused or definitely failed; kept when the write may have
            happened (the store stopped answering mid-request): at most once.
        :param count_epoch: the grant's count epoch (:attr:`Lease.count_epoch`), with ``base_key`` the lease key
            whose slot ``lease_key`` is (:attr:`Lease.lease_key`; default ``lease_key``): the object keeps per
            base key the largest count epoch written and refuses a token at or below it (``count_epoch``), so a
            zombie of a dropped slot is refused once a holder of the key's later period wrote. ``None``: not
            checked (the rule before version 15).
        :param metadata: your own user metadata (names must not start with ``lease-``).
        :param extra_args: more ``PutObject`` arguments (``ServerSideEncryption``, ``CacheControl``, ...).
        :raises StaleFencingToken: refused; nothing was written. :raises DuplicatePublish: the key was used.
        :raises ObjectStoreUnavailable: the store could not be reached (fail closed).
        :raises ObjectStoreError: the store answered with another error (access denied, no bucket, ...).
        """
        lease_key = validation.name("lease_key", lease_key)
        validation.token("token", token)
        if owner is not None:
            validation.owner("owner", owner)
        store = store_id_of(store_id)
        epoch = validation.count_epoch(lease_key, token, count_epoch, base_key)
        if idempotency_key is not None:
            idempotency_key = validation.name("idempotency_key", idempotency_key)
        data = _body(body)
        args = self._put_args(bucket, key, metadata, content_type, extra_args)
        write_id = uuid.uuid4().hex
        claim = None
        if idempotency_key is not None:
            claim = self._claim(bucket, key, idempotency_key, token, lease_key, owner, write_id)
        sends = _Sends()
        try:
            return self._cas(
                bucket, key, data, args, token, lease_key, owner, store, idempotency_key, write_id, sends,
                epoch,
            )
        except BaseException as exc:
            # The claim goes back only when no write of this call can have landed: none was sent, or the
            # store answered each one with a refusal. Anything else (a read timeout, a dropped connection,
            # a LeaseLost or TaskTerminated raised in this thread by a signal handler while a PUT was in
            # flight or just after the store applied it) leaves the outcome unknown: the claim stays, so
            # the slot is published at most once (docs/core.md, "Fencing at the object store").
            if claim is not None:
                if sends.uncertain:
                    log.warning(
                        "object fence %s: the write may or may not have happened (%s); idempotency key %r "
                        "stays claimed (delete %s to publish the slot again)",
                        _resource(bucket, key), type(exc).__name__, idempotency_key, claim[0],
                    )
                else:
                    self._give_back(bucket, key, claim, idempotency_key)
            if isinstance(exc, ReadTimeoutError | ConnectionClosedError):
                raise self._failure(exc, "the write", bucket, key) from None
            raise

    def _put_args(
        self, bucket: str, key: str, metadata: dict[str, str] | None, content_type: str | None,
        extra_args: dict[str, Any] | None,
    ) -> dict[str, Any]:
        if not isinstance(bucket, str) or not bucket:
            raise InvalidArgument("bucket", bucket, "must be a bucket name")
        if not isinstance(key, str) or not key or len(key.encode("utf-8")) > MAX_OBJECT_KEY_BYTES:
            raise InvalidArgument("key", key, f"must be an object key of 1 to {MAX_OBJECT_KEY_BYTES} bytes")
        args: dict[str, Any] = dict(extra_args or {})
        reserved = sorted(_RESERVED_ARGS & set(args))
        if reserved:
            raise InvalidArgument("extra_args", reserved, "the fence sets these arguments itself")
        own = dict(metadata or {})
        for name in own:
            if str(name).lower().startswith("lease-"):
                raise InvalidArgument("metadata", name, "names starting with 'lease-' are the fence's own")
        args["_user_metadata"] = own
        if content_type is not None:
            args["ContentType"] = content_type
        return args

    def _cas(
        self, bucket: str, key: str, data: bytes, args: dict[str, Any], token: int, lease_key: str,
        owner: str | None, store: str | None, idempotency_key: str | None, write_id: str, sends: _Sends,
        epoch: tuple[int | None, str | None] = (None, None),
    ) -> ObjectPublish:
        put_args = {k: v for k, v in args.items() if k != "_user_metadata"}
        user_metadata: dict[str, str] = args["_user_metadata"]
        resource = _resource(bucket, key)
        for attempt in range(1, self.max_attempts + 1):
            state = self._state(bucket, key)
            if state.writer == write_id:
                # A lost reply: botocore resent a write of ours that had landed, and its resend lost the
                # compare-and-swap to our own first send. The object is ours.
                return ObjectPublish(bucket, key, token, lease_key, state.etag or "", None, idempotency_key, attempt)
            entry = state.fence.get(lease_key)
            count_epoch, base = epoch
            epochs = dict(state.epochs)
            decision = decide(
                FenceState(entry, epochs.get(base) if base is not None else None), resource=resource, key=lease_key,
                token=token, owner=owner, store_id=store, count_epoch=count_epoch,
            )
            if not decision.accepted:
                record_rejection(decision, owner=owner, run=None, fence_at=self.endpoint, ledger=None)
                decision.raise_if_rejected()
            if count_epoch is not None and base is not None:
                epochs[base] = max(epochs.get(base, 0), count_epoch)
            fence = dict(state.fence)
            fence[lease_key] = advanced(entry, token, owner, store)
            meta = {**user_metadata, FENCE_METADATA: _encode_fence(fence, lease_key, write_id, epochs),
                    TOKEN_METADATA: str(token)}
            size = sum(len(k.encode()) + len(str(v).encode()) for k, v in meta.items())
            if size > MAX_METADATA_BYTES:
                raise InvalidArgument(
                    "metadata", size,
                    f"the object's user metadata with its fence would be {size} bytes; S3 allows "
                    f"{MAX_METADATA_BYTES} (fewer lease keys writing one object, or less metadata of your own)",
                )
            if state.exists and attempt == 1 and _same_bytes(data, state.etag):
                log.warning(
                    "object fence %s: token %s writes the very bytes already there, so the object's ETag "
                    "does not change and an older writer that read this version and is still to send could "
                    "overwrite it; put the token in the content to rule that out (docs/core.md, \"Fencing at "
                    "the object store\", Limits)",
                    resource, token,
                )
            condition = {"IfMatch": state.etag} if state.exists else {"IfNoneMatch": "*"}
            landed_before = sends.uncertain
            # From here until the store's answer is read, the write may land: whatever interrupts this
            # thread now (a signal handler's exception included) leaves its outcome unknown.
            sends.uncertain = True
            try:
                reply = self.client.put_object(
                    Bucket=bucket, Key=key, Body=data, Metadata=meta, **condition, **put_args
                )
            except ClientError as exc:
                status = _status(exc)
                if _refused(exc):
                    sends.uncertain = landed_before  # this send was refused: it wrote nothing
                if status in _CAS_LOST or (state.exists and status == 404):
                    # Written (or deleted) since we read it: read again and decide again.
                    log.info(
                        "object fence %s: compare-and-swap lost (HTTP %s, attempt %s); reading again",
                        resource, status, attempt,
                    )
                    time.sleep(random.uniform(0, 0.02 * attempt))
                    continue
                raise self._failure(exc, "the write", bucket, key) from None
            except (ReadTimeoutError, ConnectionClosedError):
                raise
            except BotoCoreError as exc:
                raise self._failure(exc, "the write", bucket, key) from None
            return ObjectPublish(
                bucket, key, token, lease_key, reply.get("ETag", ""), reply.get("VersionId"), idempotency_key,
                attempt,
            )
        raise ObjectFenceContention(
            f"object fence {resource}: {self.max_attempts} compare-and-swaps in a row lost to other writes "
            f"that did not refuse token {token} of lease key {lease_key!r} (the same grant writing "
            "concurrently, or unfenced writers); nothing was written by this call"
        )

    # ---------------------------------------------------------------- idempotency claims

    def marker_key(self, key: str, idempotency_key: str) -> str:
        """The marker object that claims ``idempotency_key`` for object ``key``."""
        return f"{self.marker_prefix}{key}/{idempotency_key}"

    def _claim(
        self, bucket: str, key: str, idempotency_key: str, token: int, lease_key: str, owner: str | None,
        write_id: str,
    ) -> tuple[str, str]:
        marker = self.marker_key(key, idempotency_key)
        if len(marker.encode("utf-8")) > MAX_OBJECT_KEY_BYTES:
            raise InvalidArgument(
                "idempotency_key", idempotency_key,
                f"with the object key and marker prefix it makes a key over {MAX_OBJECT_KEY_BYTES} bytes",
            )
        record = json.dumps(
            {"object": key, "idempotency_key": idempotency_key, "token": token, "lease_key": lease_key,
             "owner": owner, "write": write_id, "claimed_at": time.time()},
            ensure_ascii=True,
        ).encode()
        for attempt in range(1, self.max_attempts + 1):
            try:
                reply = self.client.put_object(
                    Bucket=bucket, Key=marker, Body=record, IfNoneMatch="*", ContentType="application/json"
                )
                return marker, str(reply.get("ETag", ""))
            except ClientError as exc:
                status = _status(exc)
                if status == 409:  # a concurrent claim of the same marker is in flight: it decides
                    time.sleep(random.uniform(0, 0.02 * attempt))
                    continue
                if status == 412:
                    mine = self._claimed_by(bucket, marker, write_id)
                    if mine is not None:  # our own claim, resent after a lost reply
                        return marker, mine
                    current = self._state(bucket, key).fence.get(lease_key)
                    log.warning(
                        "object fence %s: idempotency key %r was already published; token %s refused",
                        _resource(bucket, key), idempotency_key, token,
                    )
                    raise DuplicatePublish(
                        _resource(bucket, key), token, idempotency_key, current.token if current else None
                    ) from None
                raise self._failure(exc, "claiming the idempotency key", bucket, key) from None
            except BotoCoreError as exc:
                raise self._failure(exc, "claiming the idempotency key", bucket, key) from None
        raise ObjectFenceContention(
            f"object fence {_resource(bucket, key)}: the claim of idempotency key {idempotency_key!r} kept "
            "conflicting with concurrent claims; nothing was written by this call"
        )

    def _claimed_by(self, bucket: str, marker: str, write_id: str) -> str | None:
        """The marker's ETag if this very call wrote it, else ``None``."""
        try:
            got = self.client.get_object(Bucket=bucket, Key=marker)
            record = json.loads(got["Body"].read())
        except (ClientError, BotoCoreError, ValueError):
            return None
        return str(got.get("ETag", "")) if isinstance(record, dict) and record.get("write") == write_id else None

    def _give_back(self, bucket: str, key: str, claim: tuple[str, str], idempotency_key: str | None) -> bool:
        """Delete our own claim (conditional on its ETag, so a later claim is never deleted)."""
        marker, etag = claim
        try:
            self.client.delete_object(Bucket=bucket, Key=marker, IfMatch=etag)
        except (ClientError, BotoCoreError) as exc:
            log.warning(
                "object fence %s: could not give back the claim of idempotency key %r (%s); it stays "
                "claimed: the slot counts as published until %s is deleted",
                _resource(bucket, key), idempotency_key, type(exc).__name__, marker,
            )
            return False
        log.info("object fence %s: the write did not happen; idempotency key %r is free again",
                 _resource(bucket, key), idempotency_key)
        return True

    def published(self, resource: str, idempotency_key: str) -> bool:
        """Whether ``idempotency_key`` is claimed for the object ``resource`` (``s3://bucket/object``):
        published, or its write in flight."""
        bucket, key = split_resource(resource)
        idempotency_key = validation.lookup_name("idempotency_key", idempotency_key)
        marker = self.marker_key(key, idempotency_key)
        return self._fetch(self.client.head_object, bucket, marker, "reading the idempotency claim", of=key) is not None


class _Sends:
    """Of one ``put``: whether a write it sent may have landed without its knowing (see ``put``)."""

    __slots__ = ("uncertain",)

    def __init__(self) -> None:
        self.uncertain = False


def _refused(exc: ClientError) -> bool:
    """The store answered this one send with a refusal that wrote nothing: a 4xx status on the first try.

    A 5xx (the store's own failure) is not taken as certain, and after botocore's own retries
    (``RetryAttempts`` > 0) an earlier try whose answer was lost or a 5xx may have landed.
    """
    status = _status(exc)
    retries = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
    return status is not None and 400 <= status < 500 and not retries


def _body(body: object) -> bytes:
    if isinstance(body, str):
        return body.encode("utf-8")
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    raise InvalidArgument(
        "body", type(body).__name__,
        "must be bytes or str (a compare-and-swap that loses is sent again, so the body must be in memory)",
    )


def _same_bytes(data: bytes, etag: str | None) -> bool:
    """Whether ``data`` has the ETag ``etag`` of a single-part upload (the MD5 of the bytes)."""
    return etag is not None and etag.strip('"') == hashlib.md5(data, usedforsecurity=False).hexdigest()


def _endpoint_host(client: Any) -> str:
    """The client's endpoint as scheme://host[:port], without a user, password, path or query."""
    try:
        url = str(client.meta.endpoint_url)
    except AttributeError:
        return "the object store"
    parts = urlsplit(url)
    host = parts.hostname or "the object store"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}" if parts.scheme else host
