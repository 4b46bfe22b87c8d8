"""The library's own exceptions. Driver errors are translated into these in one place (``core.db``)."""

from __future__ import annotations


class LeaseError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidArgument(LeaseError, ValueError):
    """A bad argument: names the parameter and the value, and nothing was written."""

    def __init__(self, parameter: str, value: object, problem: str) -> None:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{parameter}={shown}: {problem}")
        self.parameter = parameter
        self.value = value
        self.problem = problem


class LeaseStoreUnavailable(LeaseError):
    """The store could not be reached or did not answer in time. Callers fail closed on it."""


class LeaseLost(LeaseError):
    """The lease this code relied on is gone: a renewal was refused, or the TTL passed without one."""

    def __init__(self, key: str, token: int, reason: str) -> None:
        super().__init__(f"lease {key!r} (token {token}) lost: {reason}")
        self.key = key
        self.token = token
        self.reason = reason


class LeaseHeld(LeaseError):
    """Raised by callers that asked to fail, not skip, when the lease is held by someone else."""

    def __init__(self, key: str, holder: object, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.holder = holder


class StaleFencingToken(LeaseError):
    """The write target refused this writer's token: it is out of date.

    :ivar reason: ``stale`` (the fence accepted a larger token, or an equal one of another holder),
        ``superseded`` (the lease has been granted past this token: the fence is kept in the lease store
        that issued it), ``count_epoch`` (the token is at or below the count epoch of a later holding period
        of its lease key: a holder of an earlier period, such as a zombie of a slot dropped when the slot
        count was lowered), ``other_store`` (the fence's token came from another lease store: the store
        appears to have been recreated) or ``duplicate``.
    :ivar newest: the key's newest grant, when the fence could see it (``superseded``), or the count epoch
        the token is at or below (``count_epoch``).
    """

    def __init__(
        self,
        resource: str,
        token: int,
        current: int | None,
        reason: str = "stale",
        *,
        newest: int | None = None,
        key: str | None = None,
    ) -> None:
        of_key = f" of lease key {key!r}" if key is not None else ""
        if reason == "duplicate":
            message = f"fence {resource!r}: this publish (token {token}) was already done once"
        elif reason == "superseded":
            message = (
                f"fence {resource!r} rejected token {token}{of_key}: the lease has been granted again since "
                f"(token {newest}), so this holder no longer holds it"
            )
        elif reason == "count_epoch":
            message = (
                f"fence {resource!r} rejected token {token}{of_key}: its lease key has been granted since in a "
                f"later holding period, every token of which is above {newest} (the key's count epoch: its slot "
                "count changed, or all its holders had ended), so this holder no longer holds it"
            )
        elif reason == "other_store":
            message = (
                f"fence {resource!r} rejected token {token}{of_key}: it has already accepted token {current} "
                "issued by another lease store. If the lease store was recreated (or restored without its "
                f"tokens), raise its token floor above {current}: `airflow-lease failover --above {current} "
                '--reason "store recreated"` (LeaseStore.bump_epoch(reason, above=...)); see docs/deploy.md'
            )
        else:
            message = f"fence {resource!r} rejected token {token}: it has already accepted token {current}"
        super().__init__(message)
        self.resource = resource
        self.token = token
        self.current = current
        self.reason = reason
        self.newest = newest


class DuplicatePublish(StaleFencingToken):
    """The idempotency key of this publish was already used: the slot was published once already."""

    def __init__(self, resource: str, token: int, idempotency_key: str, current: int | None) -> None:
        super().__init__(resource, token, current, reason="duplicate")
        self.idempotency_key = idempotency_key
        self.args = (f"fence {resource!r}: idempotency key {idempotency_key!r} was already published",)


class SchemaError(LeaseError):
    """The store's schema is newer than this library knows, or could not be migrated."""
