"""What every route of the plugin's FastAPI app depends on: the store, the user's scope, the page.

Shared by the Leases routes (:mod:`airflow_lease_provider.plugins.api`) and the timeline's
(:mod:`airflow_lease_provider.plugins.timeline_api`), so that neither imports the other's helpers.
"""

from __future__ import annotations

import html
import threading
from importlib import resources
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse

from airflow_lease_provider import version_compat
from airflow_lease_provider.core import LeaseStore
from airflow_lease_provider.core.db import redact
from airflow_lease_provider.hooks import LeaseHook
from airflow_lease_provider.plugins import authz
from airflow_lease_provider.plugins.authz import Scope
from airflow_lease_provider.version_compat import GetUserDep

URL_PREFIX = "/lease"

# -- the store --------------------------------------------------------------------------------------

_store_lock = threading.Lock()
_store: LeaseStore | None = None
_store_info: dict[str, Any] = {}
#: How the store's messages name it (user@host:port/dbname): kept out of every response.
_store_where: list[str] = []


def get_store() -> LeaseStore:
    """The lease store, resolved once per api-server process like the hooks resolve it."""
    global _store
    with _store_lock:
        if _store is None:
            # Read-only: the page never creates a store where its connection points (a typo in it says
            # "no lease store there"); the tasks create it.
            # Where the api-server keeps it: the lease connection, else the metadata database (PostgreSQL),
            # else the embedded store (hooks/lease.py, api_server_location).
            hook = LeaseHook.for_api_server()
            location = hook.location
            store = hook.get_store()
            # Only what a viewer may know: never the host, user or password of the store.
            _store_info.update(schema=location.schema, embedded=location.embedded)
            _store_where[:] = sorted({location.where, store.db.where}, key=len, reverse=True)
            _store = store
        return _store


StoreDep = Annotated[LeaseStore, Depends(get_store)]


def store_info() -> dict[str, Any]:
    """What a viewer may know of the store (its schema, whether it is the embedded one)."""
    return dict(_store_info)


def public_message(exc: BaseException) -> str:
    """An error's message as every user may read it: no password, nor the store's user and host.

    The page hides where the store is from viewers, so its errors do too (for everyone: the api-server
    log has the full message). Passwords are already redacted by the core's ``translate``.
    """
    message = redact(str(exc))
    for where in _store_where:
        message = message.replace(where, "the configured database")
    return message


# -- the user ---------------------------------------------------------------------------------------


def user_name(user: Any) -> str:
    return str(user.get_name() or user.get_id())


def auth_manager() -> Any:
    return version_compat.get_auth_manager()  # imported on first use: the api-server's app is built by then


def get_scope(user: GetUserDep) -> Scope:
    """What this user may see: every lease (admins) or those of the DAGs they may read."""
    return authz.scope(auth_manager(), user)


ScopeDep = Annotated[Scope, Depends(get_scope)]


# -- the page ---------------------------------------------------------------------------------------


def ui_base(request: Request) -> str:
    """The Airflow UI's base path (``/`` or ``[api] base_url``'s path), from where this app is mounted."""
    root = str(request.scope.get("root_path") or "")
    return root.removesuffix(URL_PREFIX).rstrip("/") + "/"


def page(request: Request, name: str) -> HTMLResponse:
    """One of the plugin's HTML pages, with the UI's and the plugin's base paths filled in."""
    text = resources.files("airflow_lease_provider.plugins").joinpath("static", name).read_text()
    plugin_base = str(request.scope.get("root_path") or "").rstrip("/") + "/"
    text = text.replace("{{AIRFLOW_BASE}}", html.escape(ui_base(request), quote=True))
    text = text.replace("{{PLUGIN_BASE}}", html.escape(plugin_base, quote=True))
    # Airflow frames the page; no one else may (and the page never caches stale lease state).
    headers = {"Cache-Control": "no-store", "Content-Security-Policy": "frame-ancestors 'self'"}
    return HTMLResponse(text, headers=headers)
