"""The plugin's FastAPI app, mounted by Airflow's api-server at ``/lease``: the Leases page and its JSON.

Every route needs a logged-in Airflow user: Airflow leaves plugin routes open, so the app carries
Airflow's own ``requires_authenticated()`` as an app-wide dependency (the page, its assets and the JSON
alike). What each user sees, and who may force-release, is :mod:`airflow_lease_provider.plugins.authz`.

Routes are plain ``def`` (FastAPI runs them in its thread pool) or hand their blocking calls to it, so
the store never stalls the api-server's event loop. Endpoints are documented in docs/ui.md.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime, timedelta
from importlib import resources
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_lease_provider import reading, version_compat
from airflow_lease_provider.core import (
    InvalidArgument,
    LeaseError,
    LeaseStore,
    LeaseStoreUnavailable,
    validation,
)
from airflow_lease_provider.core.db import redact
from airflow_lease_provider.core.lease import LeaseChanged
from airflow_lease_provider.core.schema import SchemaMissing
from airflow_lease_provider.plugins import authz, deps, lease_api, timeline_api
from airflow_lease_provider.plugins.authz import may_force_release
from airflow_lease_provider.plugins.deps import ScopeDep, StoreDep
from airflow_lease_provider.ttl_advice import ttl_advice
from airflow_lease_provider.version_compat import GetUserDep, SessionDep, requires_authenticated

log = logging.getLogger(__name__)

#: Assets the page loads, served by an authenticated route like everything else.
_ASSETS = {
    "lease.css": "text/css; charset=utf-8",
    "common.js": "text/javascript; charset=utf-8",
    "leases.js": "text/javascript; charset=utf-8",
    "task.js": "text/javascript; charset=utf-8",
    "timeline.js": "text/javascript; charset=utf-8",
    "dag.js": "text/javascript; charset=utf-8",
}
MAX_EVENTS = 1000
#: The longest page of leases (``limit``); the default page is shorter, the page asks for more.
MAX_LEASES = reading.MAX_PAGE


# -- errors -----------------------------------------------------------------------------------------


def _lease_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, InvalidArgument | reading.BadCursor):
        code = status.HTTP_400_BAD_REQUEST
    elif isinstance(exc, LeaseStoreUnavailable | SchemaMissing):
        code = status.HTTP_503_SERVICE_UNAVAILABLE
        log.warning("lease plugin: %s", redact(str(exc)))
    else:
        code = status.HTTP_500_INTERNAL_SERVER_ERROR
        log.warning("lease plugin: %s", redact(str(exc)))
    return JSONResponse({"detail": deps.public_message(exc)}, status_code=code)


def _http_error(request: Request, exc: Exception) -> Response:
    """401 for the JSON; a browser opening the page itself is sent to Airflow's login instead."""
    assert isinstance(exc, StarletteHTTPException)
    wants_page = request.url.path.rstrip("/").endswith(("/ui", "/ui/task", "/ui/dag"))
    if exc.status_code == status.HTTP_401_UNAUTHORIZED and wants_page and request.method == "GET":
        base = deps.ui_base(request)
        try:
            login = deps.auth_manager().get_url_login(next_url=f"{base}plugin/leases")
        except Exception:  # no login page to offer: fall back to the plain 401
            login = None
        if login:
            return RedirectResponse(login, status_code=status.HTTP_303_SEE_OTHER)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


# -- the page ---------------------------------------------------------------------------------------


def leases_page(request: Request) -> HTMLResponse:
    return deps.page(request, "leases.html")


def task_page(request: Request) -> HTMLResponse:
    return deps.page(request, "task.html")


def asset(name: str) -> Response:
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such asset")
    body = resources.files("airflow_lease_provider.plugins").joinpath("static", name).read_bytes()
    return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})


# -- JSON -------------------------------------------------------------------------------------------


def me(user: GetUserDep) -> dict[str, Any]:
    return {"user": deps.user_name(user), "can_force_release": may_force_release(deps.auth_manager(), user)}


def get_leases(
    store: StoreDep,
    scope: ScopeDep,
    held_only: bool = False,
    limit: Annotated[int, Query(ge=1, le=MAX_LEASES)] = 100,
    cursor: str | None = None,
) -> dict[str, Any]:
    page = reading.leases(store, held_only=held_only, limit=limit, cursor=cursor or None, dag_ids=scope.dag_ids)
    return {**page, "store": deps.store_info()}


def get_lease(
    store: StoreDep, scope: ScopeDep, key: Annotated[str, Query(min_length=1, max_length=512)]
) -> dict[str, Any]:
    row = reading.lease(store, key, dag_ids=scope.dag_ids)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no lease {key!r} in the store")
    return {"lease": row, "store": deps.store_info()}


def get_events(
    store: StoreDep,
    scope: ScopeDep,
    key: str | None = None,
    kind: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_EVENTS)] = 100,
    cursor: str | None = None,
) -> dict[str, Any]:
    return reading.events(
        store, key=key or None, kind=kind or None, since=since, until=until, limit=limit,
        cursor=cursor or None, dag_ids=scope.dag_ids,
    )


def get_counts(store: StoreDep, scope: ScopeDep) -> dict[str, Any]:
    return reading.counts(store, dag_ids=scope.dag_ids)


def get_ttl_advice(
    store: StoreDep,
    scope: ScopeDep,
    days: Annotated[float, Query(gt=0, le=3650)] = 30,
    key: str | None = None,
) -> dict[str, Any]:
    return ttl_advice(store, window=timedelta(days=days), key=key or None, dag_ids=scope.dag_ids)


def run_window(session: Any, dag_id: str, run_id: str) -> tuple[datetime | None, datetime | None]:
    """When the DAG run was alive, by Airflow's metadata, with a margin; (None, None) if unknown."""
    from sqlalchemy import select

    DagRun = version_compat.DagRun  # noqa: N806 - the model's own name
    run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    if run is None:
        return None, None
    starts = [t for t in (run.queued_at, run.start_date, run.run_after) if t is not None]
    margin = timedelta(minutes=5)  # events are stamped by the store's clock, Airflow's by its own
    since = min(starts) - margin if starts else None
    until = run.end_date + margin if run.end_date is not None else None
    return since, until


def get_task_instance(
    store: StoreDep,
    session: SessionDep,
    user: GetUserDep,
    scope: ScopeDep,
    dag_id: str,
    run_id: str,
    task_id: str,
    map_index: str | None = None,
) -> dict[str, Any]:
    if not scope.admin and not authz.may_read_dag(deps.auth_manager(), user, dag_id):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"you may not read DAG {dag_id!r}")
    # The UI substitutes {MAP_INDEX} only for mapped instances; anything else means "not mapped".
    # ASCII digits only ("²".isdigit() is true and int("²") a ValueError: a 500).
    index = int(map_index) if map_index and re.fullmatch(r"-?[0-9]+", map_index) else -1
    since, until = run_window(session, dag_id, run_id)
    return reading.task_instance_events(store, dag_id, run_id, task_id, index, since=since, until=until)


class ForceReleaseBody(BaseModel):
    key: str = Field(min_length=1, max_length=512)
    #: The page sends the key typed by the user: a second, deliberate statement of what to free.
    confirm: str
    #: The core's limit (a longer reason was a 400 from the store, after the lease had been read).
    reason: str = Field(default="", max_length=validation.MAX_NAME_LENGTH)
    #: The token the user saw; when the lease changed since, nothing is released (409). Out of the
    #: range of tokens it is malformed (422), not "changed since you looked".
    expected_token: int | None = Field(default=None, ge=1, le=validation.MAX_TOKEN)


async def force_release(request: Request, user: GetUserDep, store: StoreDep) -> dict[str, Any]:
    """Admins only, checked before the body is even read (a non-admin's malformed body gets 403)."""
    auth_manager = deps.auth_manager()
    if not await run_in_threadpool(may_force_release, auth_manager, user):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "force-release is for admins only")
    # A JSON body forces a CORS preflight on cross-site requests, on top of the SameSite cookie.
    if not request.headers.get("content-type", "").startswith("application/json"):
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, "send JSON")
    try:
        body = ForceReleaseBody.model_validate_json(await request.body())
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, errors) from None
    if body.confirm != body.key:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "confirm must repeat the key exactly")
    return await run_in_threadpool(_force_release, auth_manager, user, store, body)


def _force_release(auth_manager: Any, user: Any, store: LeaseStore, body: ForceReleaseBody) -> dict[str, Any]:
    current = store.lease(body.key)
    if current is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no lease {body.key!r} in the store")
    dag_id = reading.lease_dag(current)
    if dag_id is not None and not authz.may_edit_dag(auth_manager, user, dag_id):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"force-release needs edit rights on DAG {dag_id!r}, whose run holds it"
        )
    # The lease whose DAG was checked is the one released: compared and released in one statement.
    expected = body.expected_token if body.expected_token is not None else current.token
    by = deps.user_name(user)
    try:
        if expected != current.token:
            raise LeaseChanged(body.key, expected, current)
        done = store.force_release_with_token(
            body.key, by=by, reason=body.reason or "force-released from the Airflow UI", expected_token=expected,
            run=current.run,
        )
    except LeaseChanged as exc:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"lease {body.key!r} changed since you looked (token is now {exc.current.token}); "
            "reload and check again",
        ) from None
    if done is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no lease {body.key!r} in the store")
    previous, new_token = done
    log.warning("lease %r force-released by %s from the Airflow UI", body.key, by)
    return {
        "key": body.key,
        "by": by,
        "previous": reading.lease_row(previous),
        "new_token": new_token,
    }


# -- the app ----------------------------------------------------------------------------------------


def create_app() -> FastAPI:
    app = FastAPI(
        title="Leases",
        # Every route, the page included: Airflow does not authenticate plugin routes by itself.
        dependencies=[Depends(requires_authenticated())],
        # No open /docs or /openapi.json: the endpoints are documented in docs/ui.md.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_exception_handler(LeaseError, _lease_error)
    app.add_exception_handler(reading.BadCursor, _lease_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/ui", leases_page, methods=["GET"], response_class=HTMLResponse)
    app.add_api_route("/ui/", leases_page, methods=["GET"], response_class=HTMLResponse)
    app.add_api_route("/ui/task", task_page, methods=["GET"], response_class=HTMLResponse)
    app.add_api_route("/static/{name}", asset, methods=["GET"])
    app.add_api_route("/api/me", me, methods=["GET"])
    app.add_api_route("/api/leases", get_leases, methods=["GET"])
    app.add_api_route("/api/lease", get_lease, methods=["GET"])
    app.add_api_route("/api/events", get_events, methods=["GET"])
    app.add_api_route("/api/counts", get_counts, methods=["GET"])
    app.add_api_route("/api/ttl-advice", get_ttl_advice, methods=["GET"])
    app.add_api_route("/api/task-instance", get_task_instance, methods=["GET"])
    app.add_api_route("/api/force-release", force_release, methods=["POST"])
    app.include_router(timeline_api.router)
    # The lease API (docs/api.md): an app of its own, so the UI login above does not apply to it; it takes
    # the acquire secret and the per-grant capability instead.
    app.mount("/v1", lease_api.create_api())
    return app
