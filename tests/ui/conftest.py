from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from airflow_lease_provider.core import EventKind, FenceStore, Lease, LeaseStore
from airflow_lease_provider.identity import RunRef
from tests.airflow.warm import WarmServer
from tests.pg import drop_schema, new_schema_name
from tests.ui.server import DAG_ID, LEASE_KEY, AirflowServer, make_server

#: Seeded through the core beside the real DAG runs, so every part of the page has something to show.
API_KEY = "api-key"  # force-released by the API tests
BROWSER_KEY = "browser-key"  # force-released through the page's confirmation dialog
SCRIPT_KEY = "script-key"  # held by a script: no DAG, so only admins see it


@dataclass
class World:
    """A running api-server whose lease store holds a real overlap skip, and the runs involved."""

    server: AirflowServer
    store: LeaseStore
    holder_run: str  # the run that crashed holding the lease
    skipped_run: str  # the run that found it held and was skipped


def _seed(store: LeaseStore) -> None:
    """What the other event kinds look like, written the way the provider writes them."""
    for key, ttl, holds in (
        (API_KEY, timedelta(minutes=5), [40, 75, 90]),
        (BROWSER_KEY, timedelta(hours=3), [300, 420, 610]),
    ):
        for seconds in holds:
            store.events.record(
                EventKind.RELEASED,
                key,
                owner=f"{DAG_ID}/scheduled__2026-11-28T00:00:00+00:00/publish",
                token=1,
                detail={"held_seconds": seconds},
                run=RunRef(DAG_ID, "scheduled__2026-11-28T00:00:00+00:00", task_id="publish"),
            )
        holder = RunRef(DAG_ID, "scheduled__2026-11-29T00:00:00+00:00", task_id="publish")
        assert store.acquire(key, holder.owner(), ttl, run=holder) is not None
    assert store.acquire(SCRIPT_KEY, "nightly-script", timedelta(minutes=5)) is not None
    store.events.record(
        EventKind.SKIPPED_CATCHUP,
        LEASE_KEY,
        owner=f"{DAG_ID}/scheduled__2026-11-29T06:00:00+00:00",
        detail={
            "count": 14,
            "first_start": "2026-11-28T08:00:00+00:00",
            "first_end": "2026-11-28T09:00:00+00:00",
            "last_start": "2026-11-29T04:00:00+00:00",
            "last_end": "2026-11-29T05:00:00+00:00",
            "dag_id": DAG_ID,
            "run_id": "scheduled__2026-11-29T06:00:00+00:00",
            "max_backfill": 1,
        },
        run=RunRef(DAG_ID, "scheduled__2026-11-29T06:00:00+00:00"),
    )


#: on_overlap="replace" and "wait" with max_waiting=1 (issue 26), seeded through the core as the operators write them.
REPLACE_KEY = "replace-ui-key"
BUFFER_KEY = "buffer-ui-key"


def policy_run(n: int) -> RunRef:
    return RunRef(DAG_ID, f"manual__2026-12-0{n}T00:00:00+00:00", task_id="publish")


def seed_policies(store: LeaseStore) -> None:
    """Once per world: run 1 replaced by run 2 on REPLACE_KEY; on BUFFER_KEY run 3 holds, run 4 waits
    (its place claimed) and run 5 was skipped naming it. Idempotent (the UI test files share the world)."""
    from datetime import datetime, timezone

    if store.holder(REPLACE_KEY) is not None:
        return
    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
    for n in (1, 2):
        taken = store.try_replace(REPLACE_KEY, policy_run(n).owner(), timedelta(minutes=30),
                                  run_after=t0 + timedelta(days=n), run=policy_run(n))
        assert taken.lease is not None
    holder = store.acquire(BUFFER_KEY, policy_run(3).owner(), timedelta(minutes=30), run=policy_run(3))
    assert holder is not None
    claim = store.wait_claim(BUFFER_KEY, policy_run(4).owner(), timedelta(hours=1), run=policy_run(4))
    assert claim.claimed
    store.events.record(
        EventKind.WAITING, BUFFER_KEY, owner=policy_run(4).owner(), run=policy_run(4),
        detail={"holder_owner": holder.owner, "holder_token": holder.token, "until": "2026-12-04T01:00:00+00:00",
                "policy": "wait", "max_waiting": 1, "place": 1},
    )
    store.events.record(
        EventKind.SKIPPED_BUFFER_FULL, BUFFER_KEY, owner=policy_run(5).owner(), run=policy_run(5),
        detail={"reason": f"lease {BUFFER_KEY!r} is held by {holder.owner!r}, and {policy_run(4).owner()!r} "
                          "already waits for it (on_overlap='wait', 1 waiting place)",
                "holder_owner": holder.owner, "holder_token": holder.token, "max_waiting": 1,
                "policy": "wait", "waiters": [w.to_dict() for w in claim.waiters]},
    )


def _zombie_publish(store: LeaseStore, holder: Lease) -> None:
    """The crashed holder wakes up after a newer token reached the fence: its publish is rejected.

    Written as the holder's task would (``LeaseContext.fence`` passes the task instance as ``run``).
    """
    fences = FenceStore(store.db.dsn, schema=store.schema)
    try:
        assert fences.accept("blog", holder.token + 1, key=holder.key, run=RunRef.parse(holder.owner))
        assert not fences.accept(
            "blog", holder.token, key=holder.key, owner=holder.owner, run=RunRef.parse(holder.owner)
        )
    finally:
        fences.close()


@pytest.fixture(scope="session")
def world(pg_dsn: str, airflow_template: Path, warm_airflow: WarmServer | None) -> Iterator[World]:
    schema = new_schema_name()
    server = make_server(pg_dsn, schema, airflow_template, warm=warm_airflow)
    store = LeaseStore(pg_dsn, schema=schema)
    try:
        store.ensure_schema()
        _seed(store)
        # The server boots (tens of seconds) while the DAG runs go; they share only the SQLite file.
        server.start()
        # The DAG runs get the connection from the environment, as workers usually do.
        dag_env = {"AIRFLOW_CONN_LEASE_DEFAULT": pg_dsn}
        crashed = server.airflow(
            "dags",
            "test",
            DAG_ID,
            "2026-11-01T00:00:00+00:00",
            check=False,
            extra_env={**dag_env, "LEASE_UI_CRASH": "1"},
        )
        holder = store.holder(LEASE_KEY)
        assert holder is not None, (
            f"the crashing run left no lease ({crashed.returncode}):\n{crashed.stdout[-3000:]}"
        )
        server.airflow("dags", "test", DAG_ID, "2026-11-02T00:00:00+00:00", extra_env=dag_env)
        (skip,) = store.events.query(key=LEASE_KEY, kind=EventKind.SKIPPED_OVERLAP)
        assert skip.detail["holder_owner"] == holder.owner
        _zombie_publish(store, holder)
        server.wait_healthy()
        # The owner is dag_id/run_id/task_id: the run is its middle part.
        ref = RunRef.parse(holder.owner)
        assert ref is not None, holder.owner
        yield World(server, store, ref.run_id, skip.detail["run_id"])
    finally:
        server.cleanup()
        store.close()
        drop_schema(pg_dsn, schema)
