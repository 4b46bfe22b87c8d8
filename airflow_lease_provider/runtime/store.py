"""A leased task's store: looked up, connected and checked while Airflow renders its templates.

Under an executor each task is a fresh process that starts with no server connection; the connect and the
schema check were a third of what a leased task added (issue 28). :func:`prepare` starts them in the
background when the task's templates are rendered, while Airflow finishes getting the task ready (it sends
the rendered fields to the API server, runs its listeners), and leaves what it started in the task's context:
the one dict Airflow hands both to ``render_template_fields`` and to ``execute`` (Airflow 3.1 to 3.3). The
execute's :class:`~.task_lease.TaskLease` takes it from there (:func:`take`) and owns the store from then on.
Nothing is kept beside the task (a thread cannot be deep-copied, and Airflow and listeners may copy the task),
and nothing outlives the context.

Nothing is taken here, and nothing is decided: the acquire, its durable commit and every outcome stay in the
execute, which waits for the thread and does again, failing closed, whatever failed here.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from airflow_lease_provider import settings
from airflow_lease_provider.core import LeaseStore, LeaseStoreUnavailable
from airflow_lease_provider.core.db import DEFAULT_CONNECT_TIMEOUT, DEFAULT_STATEMENT_TIMEOUT
from airflow_lease_provider.core.db.dsn import server_endpoint
from airflow_lease_provider.hooks import LeaseConnectionMissing, LeaseHook
from airflow_lease_provider.hooks.lease import _hostname, get_connection
from airflow_lease_provider.runtime.signals import Terminate, stop_on_terminate
from airflow_lease_provider.version_compat import AirflowNotFoundException, in_task_process

log = logging.getLogger(__name__)

#: How long a task's store connection may stay open once idle, at most: the acquire, a short task's release
#: and the next leased task this process runs (``dag.test()`` runs them all in one) share one connection
#: (``LeaseHook.get_task_store``: this process's shared database). Never more than half the renewal
#: interval, so a lease between two renewals still holds no server connection (``[lease] hold_connection``
#: unset), and a process whose tasks are done holds none after it. The watchdog that closes it ticks every
#: 0.25 s.
CONNECTION_GRACE = timedelta(seconds=1)

#: The context key under which the rendering leaves the :class:`Prepared` store for the execute.
CONTEXT_KEY = "lease_prepared_store"


def connection_grace(ttl: timedelta | None, renew_every: timedelta | None) -> timedelta:
    """How long a task's store connection stays open once idle: :data:`CONNECTION_GRACE`, at most half the
    renewal interval (a lease between two renewals holds no server connection)."""
    grace = CONNECTION_GRACE
    if isinstance(ttl, timedelta) and ttl > timedelta(0):
        every = renew_every if isinstance(renew_every, timedelta) and renew_every > timedelta(0) else None
        every = every or ttl * settings.renew_fraction()
        grace = min(grace, every / 2)
    return max(grace, timedelta(milliseconds=1))


#: The connection whose password is the lease API's acquire secret (plugins/lease_api.py ``API_CONN_ID``).
API_CONN_ID = "lease_api"


class LeaseAPIUnconfigured(LeaseStoreUnavailable):
    """The task is to take its lease through the lease API, and the ``lease_api`` connection is missing, has
    no password, or cannot be read: its message names ``lease_api`` and what to do (never its value)."""


#: What to do about it, in every such message.
_DEFINE = (
    f"define the connection {API_CONN_ID!r} with the lease API's acquire secret as its password, the same "
    f"as on the api-server (e.g. AIRFLOW_CONN_{API_CONN_ID.upper()}='{{\"conn_type\": \"http\", "
    "\"password\": \"...\"}'; docs/api.md, \"Enabling it\")"
)


def api_secret() -> str | None:
    """The lease API's acquire secret (the ``lease_api`` connection's password), None when not defined.

    :raises LeaseAPIUnconfigured: the connection is defined but cannot be read (a secrets backend that
        fails, a URI that does not parse, which Airflow reports as undefined): never mistaken for "not
        defined", and the message names ``lease_api``, not the lease store's connection."""
    try:
        conn = get_connection(API_CONN_ID)
    except AirflowNotFoundException:
        if os.environ.get(f"AIRFLOW_CONN_{API_CONN_ID.upper()}", "").strip():
            raise LeaseAPIUnconfigured(
                f"the connection {API_CONN_ID!r} is set (AIRFLOW_CONN_{API_CONN_ID.upper()}) but Airflow could "
                "not read it: if it is a URI, percent-encode / @ : ? # and % in its password, or give it as JSON "
                "(docs/api.md)"
            ) from None
        return None
    except Exception as exc:
        # Only the error's type: a message about an unparsable URI may quote a piece of the password.
        raise LeaseAPIUnconfigured(
            f"the connection {API_CONN_ID!r} (the lease API's acquire secret) could not be read "
            f"({type(exc).__name__}): check it where it is kept (a secrets backend, the environment, the "
            f"metadata database; `airflow connections get {API_CONN_ID}`)"
        ) from None
    secret = conn.password
    return str(secret) if secret else None


def _no_api_secret() -> LeaseAPIUnconfigured:
    return LeaseAPIUnconfigured(
        f"this task takes its lease through the api-server's lease API ([lease] access = api), and the "
        f"connection {API_CONN_ID!r} is not defined here or has no password: {_DEFINE}"
    )


def api_task_store(task: Any) -> LeaseStore:
    """``[lease] access = api``: the task's leases through the api-server's lease API (docs/api.md), with the
    acquire secret of the ``lease_api`` connection (read through Airflow, as every connection of a task). One
    request may take a tenth of the TTL at most (5 s at most): the keeper retries within the TTL."""
    from airflow_lease_provider.client import DEFAULT_TIMEOUT, HttpLeaseStore  # only on the API path: httpx

    secret = api_secret()
    if not secret:
        raise _no_api_secret()
    ttl = getattr(task, "lease_ttl", None)
    timeout = min(DEFAULT_TIMEOUT, ttl / 10) if isinstance(ttl, timedelta) and ttl > timedelta(0) else DEFAULT_TIMEOUT
    return cast(LeaseStore, HttpLeaseStore(settings.api_server_url(), secret, timeout=timeout, host=_hostname()))


def task_store(task: Any, conn_id: str | None) -> LeaseStore:
    """The store of ``task``'s lease connection: this process's shared one, closed once idle for its grace.

    ``[lease] access = api``: the lease API (:func:`api_task_store`). ``auto`` (the default): the direct
    path, except where it has no store at all: no lease connection is defined (the task names none, and
    ``[lease] conn_id``'s is missing where no embedded store may be used, as on an Edge worker) and the
    lease API is enabled (a ``lease_api`` connection): then the API; without ``lease_api`` the missing
    connection's error stands (docs/api.md). ``auto`` with a lease
    connection whose server does not accept a TCP connection from here within its connect timeout, while
    the lease API is enabled: the API too (logged once per endpoint)."""
    access = settings.access()
    if access == "api":
        return api_task_store(task)
    grace = connection_grace(getattr(task, "lease_ttl", None), getattr(task, "lease_renew_every", None))
    hook = LeaseHook(conn_id)
    try:
        store = hook.get_task_store(grace)
    except LeaseConnectionMissing as missing:
        if access != "auto" or conn_id is not None:
            raise
        if api_secret():
            log.info("lease: no lease connection here; taking the lease through the api-server's lease API")
            return api_task_store(task)
        # Neither path is set up here: say both, the lease API's too (where it is the one meant, as on an
        # Edge worker, the lease store's connection alone would send the operator the wrong way).
        raise LeaseConnectionMissing(
            f"{missing}; or, to take leases through the api-server ([lease] access = auto or api), {_DEFINE}"
        ) from None
    if access == "auto" and not hook.location.embedded and not direct_reachable(store) and api_secret():
        endpoint = server_endpoint(store.db.dsn)
        if endpoint not in _logged_unreachable:
            _logged_unreachable.add(endpoint)
            log.warning(
                "lease: the lease store (%s) does not answer from this host within %gs; taking leases through "
                "the api-server's lease API ([lease] access = auto: docs/api.md)",
                hook.location.where, store.db.connect_timeout.total_seconds(),
            )
        return api_task_store(task)
    return store


#: Endpoints of lease stores found answering from this process (probed once), and those logged unreachable.
_reachable_endpoints: set[tuple[str, int]] = set()
_logged_unreachable: set[tuple[str, int] | None] = set()


def direct_reachable(store: LeaseStore) -> bool:
    """Whether the store's server accepts a TCP connection from here within the store's connect timeout
    (``[lease] access = auto``). Probed once per endpoint and process while it answers; a Unix socket or a
    list of hosts is taken as reachable (the direct path then says what is wrong)."""
    from airflow_lease_provider.client import reachable  # httpx is imported by the API path only

    endpoint = server_endpoint(store.db.dsn)
    if endpoint is None or endpoint in _reachable_endpoints:
        return True
    if reachable(*endpoint, timeout=store.db.connect_timeout.total_seconds()):
        _reachable_endpoints.add(endpoint)
        return True
    return False


@dataclass
class Prepared:
    """What :func:`prepare` started for one task, until its execute :func:`take`\\ s it."""

    #: The task object it was made for: a store made for another task (another connection) is never
    #: handed to this one.
    task: weakref.ref[Any]
    store: LeaseStore | None
    thread: threading.Thread | None
    #: SIGTERM came while the store was looked up (as it is noted from the execute's first step on).
    terminated: bool = False


def prepare(task: Any, context: Any) -> None:
    """In a task process, start getting ``task``'s store ready (connected, its schema checked) in the
    background, and leave it in ``context`` for the execute. No thread where this process's database for the
    store is checked already (``dag.test()``'s next tasks). Nothing is made outside a task process, with
    ``[lease] hold_connection`` (the task's store is a connection of its own), or when the connection cannot
    be read (the execute reads it again and says why)."""
    if not in_task_process() or not isinstance(context, MutableMapping) or settings.access() == "api":
        return
    store: LeaseStore | None = None
    # The lookup (an API call for a connection Airflow keeps) was under the execute's SIGTERM note: so it is here.
    with stop_on_terminate() as noted:
        try:
            if not settings.hold_connection():
                store = task_store(task, getattr(task, "lease_conn_id", None))
        except Exception:  # the execute reads it again and reports what is wrong
            log.debug("lease: the store could not be prepared before execute", exc_info=True)
    thread = None
    if store is not None and not noted.requested and not store.db.schema_current:
        thread = threading.Thread(target=_ready, args=(store,), name="lease-store-prepare", daemon=True)
        thread.start()
    if store is not None or noted.requested:
        context[CONTEXT_KEY] = Prepared(weakref.ref(task), store, thread, noted.requested)


def _ready(store: LeaseStore) -> None:
    try:
        store._ready()  # the shared database's connection, and its schema check (remembered by that database)
    except Exception:  # the execute's own check does it again, and fails closed
        log.debug("lease: the store could not be prepared before execute", exc_info=True)


def take(task: Any, context: Any, terminate: Terminate | None = None) -> LeaseStore | None:
    """The store :func:`prepare` left in ``context`` for ``task`` (None: none), once its thread is done, or has
    taken as long as its connect and two statements may (each bounded by the store): the execute goes on
    either way. A SIGTERM noted while it was looked up is noted in ``terminate``: the task then takes no lease."""
    prepared = context.pop(CONTEXT_KEY, None) if isinstance(context, MutableMapping) else None
    if not isinstance(prepared, Prepared) or prepared.task() is not task:  # none, or made for another object
        return None
    if prepared.terminated and terminate is not None:
        terminate.requested = True
    thread = prepared.thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=(DEFAULT_CONNECT_TIMEOUT + 2 * DEFAULT_STATEMENT_TIMEOUT).total_seconds() + 2)
    return prepared.store
