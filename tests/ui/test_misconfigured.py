"""The Leases page when its connection points where there is no lease store (issue 11 items 7 and 8).

A real api-server whose lease connection is a reachable PostgreSQL (trust auth: the password, with
``/ @ : ?`` in it, is sent and ignored) but whose schema holds no store, as after a typo. Every GET
answers 503 "no lease store", the page creates nothing there, and no response names the store's user,
host or password.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg2.extensions
import pytest

from tests.airflow.warm import WarmServer
from tests.pg import drop_schema, execute, new_schema_name
from tests.ui.server import DAG_ID, AirflowServer, _prepare

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900)]

PASSWORD = "Qz7x/Wk3p@Rm9v:Ty4u?Hb2n"
ROUTES = [
    "/lease/api/leases",
    "/lease/api/lease?key=k",
    "/lease/api/events",
    "/lease/api/counts",
    "/lease/api/ttl-advice",
    f"/lease/api/task-instance?dag_id={DAG_ID}&run_id=r&task_id=publish",
]


@pytest.fixture(scope="module")
def typo(
    pg_dsn: str, airflow_template: Path, warm_airflow: WarmServer | None
) -> Iterator[tuple[AirflowServer, str, dict[str, str]]]:
    info = psycopg2.extensions.parse_dsn(pg_dsn)
    schema = new_schema_name()  # never created by anyone
    auth = f"{info.get('user', 'postgres')}:{quote(PASSWORD, safe='')}@"
    host, port, dbname = info.get("host", "127.0.0.1"), info.get("port", "5432"), info.get("dbname", "postgres")
    if host.startswith("/"):  # the embedded server's socket directory goes in the query, not the netloc
        uri = f"postgresql://{auth}/{dbname}?host={quote(host, safe='')}&port={port}"
    else:
        uri = f"postgresql://{auth}{host}:{port}/{dbname}"
    server = _prepare(pg_dsn, schema, conn_uri=uri, template=airflow_template, warm=warm_airflow)
    try:
        server.start()
        server.wait_healthy()
        yield server, schema, info
    finally:
        server.cleanup()
        drop_schema(pg_dsn, schema)


@pytest.mark.parametrize("user", ["viewer", "admin"])
def test_no_store_there_is_503_and_nothing_is_created(
    pg_dsn: str, typo: tuple[AirflowServer, str, dict[str, str]], user: str
) -> None:
    server, schema, info = typo
    for route in ROUTES:
        response = server.request("GET", route, user)
        assert response.status_code == 503, (route, response.text)
        detail = response.json()["detail"]
        assert "no lease store in schema" in detail and schema in detail
        text = response.text
        assert PASSWORD not in text and quote(PASSWORD, safe="") not in text
        for piece in ("Qz7x", "Wk3p", "Rm9v", "Ty4u", "Hb2n"):
            assert piece not in text
        # The page hides where the store is; so do its errors.
        assert f"{info.get('user', 'postgres')}@" not in text and info.get("host", "127.0.0.1") not in text
    forced = server.request("POST", "/lease/api/force-release", "admin", json={"key": "k", "confirm": "k"})
    assert forced.status_code == 503
    assert not execute(pg_dsn, "SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))


@pytest.mark.parametrize("user", ["viewer", "user", "op"])
def test_a_non_admin_force_release_is_403_before_the_store_is_touched(
    typo: tuple[AirflowServer, str, dict[str, str]], user: str
) -> None:
    """The admin check comes first: a non-admin is refused without the store being resolved (it was a
    503 "no lease store" from the store dependency, telling a non-admin about the store)."""
    server, _schema, _info = typo
    response = server.request("POST", "/lease/api/force-release", user, json={"key": "k", "confirm": "k"})
    assert response.status_code == 403, response.text
    assert "store" not in response.json()["detail"]
