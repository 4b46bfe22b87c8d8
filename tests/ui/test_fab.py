"""The Leases page under the FAB auth manager, with DAG-level access (issue 11 item 9).

A real ``airflow api-server`` with ``FabAuthManager``; FAB users whose roles read every DAG, some DAGs,
or none; the lease admin permission (``can_delete`` on ``Leases``) granted through FAB's security
manager. Leases and events of two DAGs and of a script (no DAG) are seeded through the core.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from airflow_lease_provider.core import EventKind, LeaseStore, RunRef
from tests.airflow.warm import WarmServer
from tests.pg import drop_schema, new_schema_name
from tests.ui.server import DAG_ID, OTHER_DAG_ID, AirflowServer, make_fab_server

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

DEMO_KEY = "fab-demo"  # held by a run of lease_ui_demo
OTHER_KEY = "fab-other"  # held by a run of lease_ui_other
SCRIPT_KEY = "fab-script"  # held by a script: no DAG
DEMO_RUN = "manual__2026-12-01T10:00:00+00:00"
OTHER_RUN = "manual__2026-12-01T11:00:00+00:00"


@dataclass
class Fab:
    server: AirflowServer
    store: LeaseStore


@pytest.fixture(scope="module")
def fab(pg_dsn: str, airflow_template: Path, warm_airflow: WarmServer | None) -> Iterator[Fab]:
    schema = new_schema_name()
    server = make_fab_server(pg_dsn, schema, airflow_template, warm=warm_airflow)
    store = LeaseStore(pg_dsn, schema=schema)
    try:
        store.ensure_schema()
        ttl = timedelta(minutes=30)
        for key, owner in (
            (DEMO_KEY, f"{DAG_ID}/{DEMO_RUN}/publish"),
            (OTHER_KEY, f"{OTHER_DAG_ID}/{OTHER_RUN}/work"),
            (SCRIPT_KEY, "nightly-script"),
        ):
            # as the operator writes it: the task instance as the run (a script passes none)
            assert store.acquire(key, owner, ttl, run=RunRef.parse(owner)) is not None
        store.events.record(
            EventKind.SKIPPED_OVERLAP,
            OTHER_KEY,
            owner=f"{OTHER_DAG_ID}/manual__2026-12-01T11:05:00+00:00/work",
            detail={"dag_id": OTHER_DAG_ID, "run_id": "manual__2026-12-01T11:05:00+00:00", "task_id": "work",
                    "map_index": -1, "reason": "held", "holder_owner": f"{OTHER_DAG_ID}/{OTHER_RUN}/work"},
            # as the operator writes it: the skipped task instance in the run columns
            run=RunRef(OTHER_DAG_ID, "manual__2026-12-01T11:05:00+00:00", task_id="work"),
        )
        for key, owner in ((DEMO_KEY, f"{DAG_ID}/r0/publish"), (OTHER_KEY, f"{OTHER_DAG_ID}/r0/work")):
            store.events.record(EventKind.RELEASED, key, owner=owner, token=1, detail={"held_seconds": 60},
                                run=RunRef.parse(owner))
        server.start()
        server.wait_healthy()
        yield Fab(server, store)
    finally:
        server.cleanup()
        store.close()
        drop_schema(pg_dsn, schema)


def _keys(fab: Fab, user: str) -> set[str]:
    response = fab.server.request("GET", "/lease/api/leases", user)
    assert response.status_code == 200, response.text
    return {row["key"] for row in response.json()["leases"]}


def _event_dags(fab: Fab, user: str) -> set[str | None]:
    events = fab.server.request("GET", "/lease/api/events", user).json()["events"]
    return {(e["run"] or {}).get("dag_id") for e in events}


def test_the_page_and_the_task_tab_work(fab: Fab) -> None:
    page = fab.server.request("GET", "/lease/ui/", "viewer")
    assert page.status_code == 200 and "<h1>Leases</h1>" in page.text
    tab = fab.server.request("GET", "/lease/ui/task", "viewer")
    assert tab.status_code == 200
    ti = fab.server.request(
        "GET", "/lease/api/task-instance", "viewer",
        params={"dag_id": OTHER_DAG_ID, "run_id": "manual__2026-12-01T11:05:00+00:00", "task_id": "work"},
    )
    assert ti.status_code == 200, ti.text
    assert ti.json()["skip_reason"] == "held"
    assert fab.server.request("GET", "/lease/api/me", "admin").json()["can_force_release"] is True
    assert fab.server.request("GET", "/lease/api/me", "viewer").json()["can_force_release"] is False


def test_each_user_sees_the_leases_and_events_of_the_dags_they_may_read(fab: Fab) -> None:
    assert _keys(fab, "admin") == {DEMO_KEY, OTHER_KEY, SCRIPT_KEY}  # admins: keys with no DAG too
    assert _keys(fab, "viewer") == {DEMO_KEY, OTHER_KEY}
    assert _keys(fab, "demo_reader") == {DEMO_KEY}

    assert _event_dags(fab, "admin") == {DAG_ID, OTHER_DAG_ID, None}
    assert _event_dags(fab, "demo_reader") == {DAG_ID}
    counts = fab.server.request("GET", "/lease/api/counts", "demo_reader").json()["counts"]
    assert {c["key"] for c in counts} == {DEMO_KEY}
    advice = fab.server.request("GET", "/lease/api/ttl-advice", "demo_reader").json()["advice"]
    assert {a["key"] for a in advice} == {DEMO_KEY}

    assert fab.server.request("GET", "/lease/api/lease", "demo_reader", params={"key": OTHER_KEY}).status_code == 404
    assert fab.server.request("GET", "/lease/api/lease", "viewer", params={"key": SCRIPT_KEY}).status_code == 404
    one = fab.server.request("GET", "/lease/api/lease", "demo_reader", params={"key": DEMO_KEY})
    assert one.status_code == 200 and one.json()["lease"]["holder_run"]["dag_id"] == DAG_ID
    hidden = fab.server.request(
        "GET", "/lease/api/task-instance", "demo_reader",
        params={"dag_id": OTHER_DAG_ID, "run_id": OTHER_RUN, "task_id": "work"},
    )
    assert hidden.status_code == 403


@pytest.mark.parametrize("user", ["viewer", "op", "demo_reader"])
def test_force_release_is_refused_to_non_admins_before_the_body_is_read(fab: Fab, user: str) -> None:
    before = fab.store.lease(DEMO_KEY)
    assert before is not None
    for body in ('{"key": "' + DEMO_KEY + '", "confirm": "' + DEMO_KEY + '"}', "{not json", '{"key": 3}'):
        response = fab.server.request(
            "POST", "/lease/api/force-release", user, content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 403, (body, response.text)
    after = fab.store.lease(DEMO_KEY)
    assert after is not None and after.token == before.token and after.held


def test_force_release_needs_edit_rights_on_the_dag(fab: Fab) -> None:
    """lease_keeper is a lease admin who may edit lease_ui_other but only read lease_ui_demo."""
    server, store = fab.server, fab.store
    demo = store.lease(DEMO_KEY)
    assert demo is not None
    refused = server.request("POST", "/lease/api/force-release", "lease_keeper", json={"key": DEMO_KEY, "confirm": DEMO_KEY})
    assert refused.status_code == 403 and "edit rights" in refused.json()["detail"]
    still = store.lease(DEMO_KEY)
    assert still is not None and still.held and still.token == demo.token

    other = store.lease(OTHER_KEY)
    assert other is not None
    done = server.request(
        "POST", "/lease/api/force-release", "lease_keeper",
        json={"key": OTHER_KEY, "confirm": OTHER_KEY, "expected_token": other.token, "reason": "fab test"},
    )
    assert done.status_code == 200, done.text
    assert done.json()["new_token"] == other.token + 1 and done.json()["by"] == "lease_keeper"
    released = store.lease(OTHER_KEY)
    assert released is not None and not released.held


def test_admin_force_releases_any_lease(fab: Fab) -> None:
    server, store = fab.server, fab.store
    for key in (DEMO_KEY, SCRIPT_KEY):
        lease = store.lease(key)
        assert lease is not None and lease.held
        stale = server.request(
            "POST", "/lease/api/force-release", "admin",
            json={"key": key, "confirm": key, "expected_token": lease.token + 5},
        )
        assert stale.status_code == 409
        done = server.request("POST", "/lease/api/force-release", "admin", json={"key": key, "confirm": key})
        assert done.status_code == 200, done.text
        after = store.lease(key)
        assert after is not None and not after.held and after.token == lease.token + 1
        (event,) = store.events.query(key=key, kind=EventKind.FORCE_RELEASED)
        assert event.detail["by"] == "admin"


def test_timeline_and_dag_tab_are_scoped_by_dag(fab: Fab) -> None:
    """The DAG tab needs read access to its DAG; a key's timeline shows only the DAGs the user may read."""
    assert fab.server.request("GET", "/lease/api/dag", "demo_reader", params={"dag_id": OTHER_DAG_ID}).status_code == 403
    mine = fab.server.request("GET", "/lease/api/dag", "demo_reader", params={"dag_id": DAG_ID})
    assert mine.status_code == 200, mine.text
    assert [k["key"] for k in mine.json()["keys"]] == [DEMO_KEY]
    # (Earlier tests may have force-released it: held or not, its row is the demo run's.)
    assert mine.json()["keys"][0]["timeline"]["lease"]["holder_run"]["dag_id"] == DAG_ID
    hidden = fab.server.request("GET", "/lease/api/timeline", "demo_reader", params={"key": OTHER_KEY}).json()
    assert hidden["lease"] is None and hidden["holdings"] == [] and hidden["markers"] == []
    seen = fab.server.request("GET", "/lease/api/timeline", "admin", params={"key": OTHER_KEY}).json()
    assert seen["lease"]["holder_run"]["dag_id"] == OTHER_DAG_ID
    assert [m["kind"] for m in seen["markers"]] == ["skipped_overlap"]
    assert seen["trend"]["totals"]["skipped_overlap"] == 1
