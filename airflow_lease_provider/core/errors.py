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
    """The write target has already accepted a token at least as large: this writer is out of date."""

    def __init__(self, resource: str, token: int, current: int | None, reason: str = "stale") -> None:
        if reason == "duplicate":
            message = f"fence {resource!r}: this publish (token {token}) was already done once"
        else:
            message = f"fence {resource!r} rejected token {token}: it has already accepted token {current}"
        super().__init__(message)
        self.resource = resource
        self.token = token
        self.current = current
        self.reason = reason


class DuplicatePublish(StaleFencingToken):
    """The idempotency key of this publish was already used: the slot was published once already."""

    def __init__(self, resource: str, token: int, idempotency_key: str, current: int | None) -> None:
        super().__init__(resource, token, current, reason="duplicate")
        self.idempotency_key = idempotency_key
        self.args = (f"fence {resource!r}: idempotency key {idempotency_key!r} was already published",)


class SchemaError(LeaseError):
    """The store's schema is newer than this library knows, or could not be migrated."""
