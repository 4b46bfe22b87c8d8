"""The ``lease`` Airflow plugin, registered through the ``airflow.plugins`` entry point.

Airflow loads it in the scheduler, the dag-processor, the api-server and workers, so keep the import
light: only what the registered components themselves need. The UI's FastAPI app is built on its first
request (:class:`LazyApp`), so no process but the api-server pays for importing FastAPI and the routes.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from airflow.plugins_manager import AirflowPlugin

from airflow_lease_provider.plugins import catchup_listener, startup
from airflow_lease_provider.timetables.capped_catchup import CappedCatchupTimetable
from airflow_lease_provider.version_compat import conf

URL_PREFIX = "/lease"


class LazyApp:
    """An ASGI app that creates the plugin's FastAPI app when the api-server first calls it."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            # Imported here: only the api-server serves it, so no other process imports FastAPI and the routes.
            from airflow_lease_provider.plugins.api import create_app

            self._app = create_app()
        await self._app(scope, receive, send)


def _href(path: str) -> str:
    # Airflow puts an external view's href into an iframe as is, so it must carry [api] base_url's path.
    base = urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")
    return f"{base}{URL_PREFIX}{path}"


class LeasePlugin(AirflowPlugin):
    """Registers the provider's timetables and its UI: the Leases page, a DAG's Leases tab, a task instance's Lease tab."""

    name = "lease"
    # Airflow deserializes a custom timetable only if a plugin lists its class.
    timetables = [CappedCatchupTimetable]
    # Records at each component's start what its task processes may not read (plugins/startup.py); and in
    # the scheduler, as each run starts, what its capped catch-up skipped or coalesced (catchup_listener.py).
    listeners = [startup, catchup_listener]
    fastapi_apps = [{"app": LazyApp(), "url_prefix": URL_PREFIX, "name": "Leases"}]
    external_views = [
        {
            "name": "Leases",
            "href": _href("/ui/"),
            "destination": "nav",
            "category": "browse",
            "url_route": "leases",
        },
        {
            # A tab on every task instance; the UI fills in the placeholders.
            "name": "Lease",
            "href": _href("/ui/task?dag_id={DAG_ID}&run_id={RUN_ID}&task_id={TASK_ID}&map_index={MAP_INDEX}"),
            "destination": "task_instance",
            "url_route": "lease",
        },
        {
            # A tab on every DAG's page (Airflow 3.1+): its keys, their timelines and trends, the holders.
            "name": "Leases",
            "href": _href("/ui/dag?dag_id={DAG_ID}"),
            "destination": "dag",
            "url_route": "dag-leases",
        },
    ]
