"""Hooks: the lease and fence stores behind Airflow connections."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_lease_provider.hooks.lease import FenceHook, LeaseConnectionMissing, LeaseHook

if TYPE_CHECKING:
    from airflow_lease_provider.hooks.dbapi_fence import DbApiFenceHook

__all__ = ["DbApiFenceHook", "FenceHook", "LeaseConnectionMissing", "LeaseHook"]


def __getattr__(name: str) -> Any:
    # Imported when first asked for: a leased task's process (one per task under an executor) reaches the
    # hooks for LeaseHook only and does not pay for the DB-API fence (about 1.4 ms of imports).
    if name == "DbApiFenceHook":
        from airflow_lease_provider.hooks.dbapi_fence import DbApiFenceHook

        return DbApiFenceHook
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
