"""The timeline's routes of the plugin's FastAPI app: a key's timeline and trend, a DAG's tab.

A router (:data:`router`) that :func:`airflow_lease_provider.plugins.api.create_app` includes, so its
routes carry the app-wide ``requires_authenticated()`` like every route. What a user sees is scoped like the rest of the page
(:mod:`airflow_lease_provider.plugins.authz`): a viewer's timeline shows only the events of the DAGs
they may read, and a DAG's tab needs read access to that DAG. Endpoints are documented in docs/ui.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse

from airflow_lease_provider.plugins import authz, deps, timeline
from airflow_lease_provider.plugins.deps import ScopeDep, StoreDep
from airflow_lease_provider.version_compat import GetUserDep

KeyParam = Annotated[str, Query(min_length=1, max_length=512)]
RangeParam = Annotated[str, Query(alias="range", pattern="^(24h|7d|30d)$")]


def get_timeline(store: StoreDep, scope: ScopeDep, key: KeyParam, range_name: RangeParam = "7d") -> dict[str, Any]:
    """One key's holdings and markers over the range, and its trend."""
    data = timeline.key_timeline(store, key, range_name=range_name, dag_ids=scope.dag_ids)
    now = datetime.fromisoformat(data["observed_at"])
    data["trend"] = timeline.key_trend(store, key, range_name=range_name, dag_ids=scope.dag_ids, now=now)
    return data


def get_dag(
    store: StoreDep,
    user: GetUserDep,
    scope: ScopeDep,
    dag_id: Annotated[str, Query(min_length=1, max_length=250)],
    range_name: RangeParam = "7d",
) -> dict[str, Any]:
    """A DAG's tab: its trend, its keys with their holders, timelines and trends."""
    if not scope.admin and not authz.may_read_dag(deps.auth_manager(), user, dag_id):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"you may not read DAG {dag_id!r}")
    data = timeline.dag_view(store, dag_id, range_name=range_name, dag_ids=scope.dag_ids)
    data["me"] = {"user": deps.user_name(user), "can_force_release": scope.admin}
    return data


def dag_page(request: Request) -> HTMLResponse:
    return deps.page(request, "dag.html")


#: Included by :func:`airflow_lease_provider.plugins.api.create_app`, under the app-wide authentication.
router = APIRouter()
router.add_api_route("/ui/dag", dag_page, methods=["GET"], response_class=HTMLResponse)
router.add_api_route("/api/timeline", get_timeline, methods=["GET"])
router.add_api_route("/api/dag", get_dag, methods=["GET"])
