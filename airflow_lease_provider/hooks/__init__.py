"""Hooks: the lease and fence stores behind Airflow connections."""

from __future__ import annotations

from airflow_lease_provider.hooks.dbapi_fence import DbApiFenceHook
from airflow_lease_provider.hooks.lease import FenceHook, LeaseConnectionMissing, LeaseHook

__all__ = ["DbApiFenceHook", "FenceHook", "LeaseConnectionMissing", "LeaseHook"]
