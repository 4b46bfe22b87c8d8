"""A leased task body that forks (``multiprocessing`` with fork, Linux's default) while its keeper renews.

Run as the task runner runs the operator (``execute(context)``, tests/airflow/test_semantics.py), against a
real PostgreSQL. The keeper's renewal is held in flight by a row lock another session takes, so the fork
happens while the renewal holds the task's store lock (issue 38, defect 8: the child hung on its first
``lease.check()``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from airflow_lease_provider.core import LeaseStore
from tests.airflow.test_semantics import TaskInstance, lease_env, leased, run_task  # noqa: F401 (a fixture)
from tests.core.test_fork import in_forked_child, row_locked, wait_for_renewal_blocked

RUN = "manual__2026-12-01T10:00:00+00:00"


@pytest.mark.usefixtures("lease_env")
def test_a_forked_child_of_a_leased_body_checks_and_fences_while_the_keeper_renews(
    store: LeaseStore, pg_dsn: str, schema: str
) -> None:
    seen: dict[str, Any] = {}

    def body(lease=None):
        with row_locked(pg_dsn, schema, lease.key):
            wait_for_renewal_blocked(pg_dsn, schema)

            def child(results: Any) -> None:
                checked = lease.check()
                decision = lease.fence("reports.out")
                results.put((checked.token, decision.outcome))

            seen["child"] = in_forked_child(child)
        lease.check()  # the parent's keeper renewed once the row was free again
        return lease.token

    op = leased("fork", body, lease_key="forking", lease_ttl=timedelta(seconds=20),
                lease_renew_every=timedelta(seconds=0.2))
    token = run_task(op, TaskInstance("etl", RUN, "fork"))
    assert seen["child"] == (token, "accepted")
    assert store.holder("forking") is None  # released by the parent after the body
