"""``POST /lease/api/force-release`` when the store's answer to the release is lost (issue 38, defect 6).

A real ``airflow api-server`` whose lease connection goes through a proxy (tests/lost_reply.py) that lets
the force-release commit and then cuts the connection before the answer. The admin must be told what
happened (200, the new token), not "changed since you looked" (409) or "store unavailable" (503) for a
release that took place, and the token must be bumped once.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from airflow_lease_provider.core import EventKind, LeaseStore
from airflow_lease_provider.identity import RunRef
from tests.airflow.warm import WarmServer
from tests.lost_reply import LostReplyProxy
from tests.pg import drop_schema, new_schema_name
from tests.ui.server import DAG_ID, AirflowServer, _prepare

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "lost-reply-key"


@pytest.fixture(scope="module")
def through_proxy(
    pg_dsn: str, airflow_template: Path, warm_airflow: WarmServer | None
) -> Iterator[tuple[AirflowServer, LostReplyProxy, LeaseStore]]:
    schema = new_schema_name()
    proxy = LostReplyProxy.for_dsn(pg_dsn)
    store = LeaseStore(pg_dsn, schema=schema)
    server = _prepare(pg_dsn, schema, conn_uri=proxy.uri(pg_dsn), template=airflow_template, warm=warm_airflow)
    try:
        store.ensure_schema()
        server.start()
        server.wait_healthy()
        yield server, proxy, store
    finally:
        server.cleanup()
        store.close()
        proxy.close()
        drop_schema(pg_dsn, schema)


def test_a_force_release_whose_answer_is_lost_answers_what_happened(
    through_proxy: tuple[AirflowServer, LostReplyProxy, LeaseStore],
) -> None:
    server, proxy, store = through_proxy
    holder = RunRef(DAG_ID, "scheduled__2026-12-01T00:00:00+00:00", task_id="publish")
    lease = store.acquire(KEY, holder.owner(), timedelta(minutes=10), run=holder)
    assert lease is not None
    proxy.lose_reply(after=b"AS new_token")
    response = server.request(
        "POST", "/lease/api/force-release", "admin",
        json={"key": KEY, "confirm": KEY, "expected_token": lease.token, "reason": "host lost"},
    )
    assert proxy.lost.is_set(), "the proxy lost no answer: the test tested nothing"
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["new_token"] == lease.token + 1
    assert body["previous"]["owner"] == holder.owner() and body["previous"]["token"] == lease.token
    row = store.lease(KEY)
    assert row is not None and row.token == lease.token + 1 and not row.held  # released, bumped once
    (event,) = store.events.query(key=KEY, kind=EventKind.FORCE_RELEASED)
    assert event.detail["by"] == "admin" and event.detail["reason"] == "host lost"
