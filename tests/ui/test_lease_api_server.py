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
    world.server.airflow("connections", "add", "lease_api", "--conn-type", "http", "--conn-password", SECRET)
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
