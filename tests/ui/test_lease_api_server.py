"""The lease API (docs/api.md) on a real ``airflow api-server`` (the UI tier's server): mounted under the
plugin's prefix, its own credentials (not the UI login), and one grant's whole life over HTTP."""

from __future__ import annotations

import secrets

import httpx
import pytest

from tests.ui.conftest import World

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

SECRET = secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def api(world: World) -> World:
    # In the metadata database, as a platform team defines it (the api-server reads it there by itself).
    world.server.airflow("connections", "add", "lease_api", "--conn-type", "http", f"--conn-password={SECRET}")
    return world


def post(world: World, path: str, credential: str | None, body: dict[str, object]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {credential}"} if credential is not None else {}
    return httpx.post(f"{world.server.url}/lease/v1/{path}", json=body, headers=headers, timeout=60)


def test_a_grant_over_http_on_a_real_api_server(api: World) -> None:
    body = {"key": "api-server-key", "owner": "edge-worker-task", "ttl_seconds": 60}
    assert post(api, "acquire", None, body).status_code == 401
    # The UI login is not the acquire secret.
    assert post(api, "acquire", api.server.token("admin"), body).status_code == 403
    assert api.store.holder("api-server-key") is None
    acquired = post(api, "acquire", SECRET, body)
    assert acquired.status_code == 200, acquired.text
    capability = acquired.json()["capability"]
    ref = {k: acquired.json()["lease"][k] for k in ("key", "owner", "token")}
    held = api.store.holder("api-server-key")
    assert held is not None and (held.owner, held.token) == (ref["owner"], ref["token"])
    assert post(api, "acquire", SECRET, {**body, "owner": "another"}).status_code == 409
    assert post(api, "renew", capability, ref).status_code == 200
    assert post(api, "renew", SECRET, ref).status_code == 403  # the acquire secret is no capability
    assert post(api, "check", capability, ref).json()["held"] is True
    fenced = post(api, "fence", capability, {**ref, "resource": "edge-target"})
    assert fenced.status_code == 200 and fenced.json()["accepted"] is True
    assert post(api, "release", capability, ref).json()["released"] is True
    assert api.store.holder("api-server-key") is None
    log = api.server.log_tail()
    assert SECRET not in log and capability not in log


def test_a_leased_task_on_the_api_path(api: World) -> None:
    """``[lease] access = api``: the task takes, renews and releases its lease through the api-server (the
    row's capability digest says the grant was made there), with its own connection to the store unused."""
    from pathlib import Path

    from psycopg2 import sql

    from airflow_lease_provider.core import EventKind
    from tests.pg import execute

    dags = Path(__file__).with_name("api_dags")
    env = {"AIRFLOW__LEASE__ACCESS": "api", "AIRFLOW__LEASE__API_URL": api.server.url,
           "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    run = api.server.airflow("dags", "test", "lease_api_path", "2026-12-01T00:00:00+00:00", extra_env=env)
    assert api.store.holder("api-path") is None, run.stdout[-3000:]
    row = execute(api.store.db.dsn, sql.SQL(
        "SELECT owner, api_capability IS NOT NULL, renewed_at - acquired_at, released_at IS NOT NULL "
        "FROM {}.lease WHERE key = 'api-path'").format(sql.Identifier(api.store.schema)))
    assert row, run.stdout[-3000:]
    owner, over_api, renewed_after, released = row[0]
    assert owner.startswith("lease_api_path/") and over_api and released
    assert renewed_after.total_seconds() >= 2  # renewed over HTTP while the body ran
    kinds = {e.kind for e in api.store.events.query(key="api-path")}
    assert {EventKind.ACQUIRED, EventKind.RELEASED} <= kinds


def test_a_leased_task_on_the_api_path_is_skipped_while_another_holds_the_key(api: World) -> None:
    """The overlap policy over HTTP: the key held (here by a direct holder), the API path's run is skipped,
    naming the holder, and takes nothing."""
    from datetime import timedelta
    from pathlib import Path

    from airflow_lease_provider.core import EventKind

    holder = api.store.acquire("api-path", "someone-else", timedelta(minutes=2))
    assert holder is not None
    try:
        dags = Path(__file__).with_name("api_dags")
        env = {"AIRFLOW__LEASE__ACCESS": "api", "AIRFLOW__LEASE__API_URL": api.server.url,
               "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
        run = api.server.airflow("dags", "test", "lease_api_path", "2026-12-02T00:00:00+00:00", extra_env=env)
        assert "someone-else" in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]
        now = api.store.holder("api-path")
        assert now is not None and (now.owner, now.token) == ("someone-else", holder.token)
        # The skip is in the ledger once, with the run columns, as on the direct path (the Leases page and
        # `airflow-lease events` read it there).
        skips = [e for e in api.store.events.query(key="api-path")
                 if e.kind == EventKind.SKIPPED_OVERLAP and e.detail.get("holder_token") == holder.token]
        assert len(skips) == 1, (skips, (run.stdout + run.stderr)[-3000:])
        skip = skips[0]
        assert skip.run is not None and (skip.run.dag_id, skip.run.task_id) == ("lease_api_path", "work")
        assert skip.run.run_id.startswith("manual__") and skip.owner == skip.run.owner()
        assert skip.detail["holder_owner"] == "someone-else" and skip.detail["policy"] == "skip"
    finally:
        api.store.release(holder)


def test_auto_takes_the_api_path_where_no_lease_connection_is_defined(api: World) -> None:
    """``[lease] access = auto`` (the default) on a worker with no lease connection and no embedded store (an
    Edge worker's situation): the lease goes through the api-server, because ``lease_api`` is defined."""
    from pathlib import Path

    from psycopg2 import sql

    from tests.pg import execute

    query = sql.SQL(
        "SELECT token, api_capability IS NOT NULL, released_at IS NOT NULL FROM {}.lease WHERE key = 'api-path'"
    ).format(sql.Identifier(api.store.schema))
    before = execute(api.store.db.dsn, query)
    dags = Path(__file__).with_name("api_dags")
    env = {"AIRFLOW__LEASE__CONN_ID": "lease_not_on_this_worker", "AIRFLOW__LEASE__EMBEDDED": "false",
           "AIRFLOW__LEASE__API_URL": api.server.url, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    run = api.server.airflow("dags", "test", "lease_api_path", "2026-12-03T00:00:00+00:00", extra_env=env)
    row = execute(api.store.db.dsn, query)
    output = (run.stdout + run.stderr)[-3000:]
    assert row and (not before or row[0][0] > before[0][0]), (before, row, output)  # this run's grant
    assert row[0][1] and row[0][2], (row, output)  # made through the API, and released
