"""``LeaseFreeTrigger``: fires when a lease is free, so a waiting task gives up its worker slot meanwhile.

It only says "free": the resumed task must acquire the lease itself and may lose the race to another
waiter, in which case it waits again.

It never says "free" before ``not_before``, which the operator sets a few seconds after the deferral
(:data:`RESUME_SETTLE`). Airflow 3.1-3.3's scheduler fails a deferred task whose trigger fired so soon
that the task was queued again before the scheduler had read the executor's report of the deferring
process's exit ("finished with state success, but the task instance's state attribute is queued":
apache/airflow issues 67287 and 72716; only the ``scheduled`` case is guarded, since 3.2.2). A lease
released within a second or two of the deferral hit it: the waiting task failed instead of running.

With a waiting place (``waiter``: ``wait`` with ``max_waiting``) the trigger keeps the
place claimed while it waits (every third of the place's TTL, also while it settles), claims it once more
for a whole TTL when it fires (so the resumed task has that long to start), and gives it back when the task
is killed (``on_kill``: marked failed, cleared, marked success while deferred). When the triggerer dies,
nobody claims it and it lapses. A place lost meanwhile (it lapsed and another run took it) fires
``displaced``: the resumed task then tries to claim again, and is skipped when it cannot.

On the API path (``access="api"``: the task took its lease through the api-server, docs/api.md) the trigger
polls and keeps its place through the lease API too (``HttpLeaseStore``). The acquire secret (the password
of the ``lease_api`` connection) is read here, in the triggerer, through Airflow's connection lookup, and
never put in the trigger's kwargs: those are written to the metadata database. The waiting place's id in
``waiter`` (``place``) carries no right alone: the place's request id is derived from it with that secret.
An api-server that does not answer is a store error: the trigger keeps waiting and never says "free"
(fail closed); without the connection the trigger fails, and so does the task.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import BaseHook
from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_lease_provider import settings
from airflow_lease_provider.core import LeaseError, LeaseStore, LeaseStoreUnavailable, RunRef
from airflow_lease_provider.hooks.lease import _idle, location_async
from airflow_lease_provider.version_compat import AirflowNotFoundException

# How long after a deferral a waiting task may be resumed at the earliest: long enough for the deferring
# process to exit and the scheduler to read its report first (seconds under load on 2 cores, measured),
# short next to the TTLs a wait is for.
RESUME_SETTLE = timedelta(seconds=10)


class LeaseFreeTrigger(BaseTrigger):
    """Polls the lease store until ``key`` is free or ``deadline`` (ISO 8601) passes.

    :param key: the lease key.
    :param conn_id: the lease store's connection (None: ``[lease] conn_id``).
    :param schema: the store's schema.
    :param poll_interval: seconds between checks.
    :param deadline: when to stop waiting and report ``timeout``.
    :param not_before: the earliest moment (ISO 8601) to report ``free``; None (a trigger serialized
        before this parameter existed): at once.
    :param slots: the key's slot count (a semaphore, ``lease_slots``): free means fewer than ``slots``
        holders. 1 (and a trigger serialized before this parameter existed): no holder.
    :param waiter: the waiting place to keep claimed (``owner``, ``ttl_seconds``, ``max_waiting``, the
        run columns, and on the API path the place's id ``place``), or None: no place.
    :param access: ``direct`` (the store of ``conn_id``; a trigger serialized before this parameter existed)
        or ``api``: through the api-server's lease API, with the acquire secret read in the triggerer.
    """

    def __init__(
        self,
        *,
        key: str,
        conn_id: str | None,
        schema: str,
        poll_interval: float,
        deadline: str,
        not_before: str | None = None,
        waiter: dict[str, Any] | None = None,
        slots: int = 1,
        access: str = "direct",
    ) -> None:
        super().__init__()
        if access not in ("direct", "api"):
            raise ValueError(f"access must be 'direct' or 'api', not {access!r}")
        self.access = access
        self.slots = int(slots)
        self.key = key
        self.conn_id = conn_id
        self.schema = schema
        self.poll_interval = float(poll_interval)
        self.deadline = deadline
        self.not_before = not_before
        self.waiter = waiter

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "key": self.key,
                "conn_id": self.conn_id,
                "schema": self.schema,
                "poll_interval": self.poll_interval,
                "deadline": self.deadline,
                "not_before": self.not_before,
                "waiter": self.waiter,
                "slots": self.slots,
                "access": self.access,
            },
        )

    def _holder(self, store: Any) -> Any:
        if self.slots > 1:
            holders = store.slot_holders(self.key)
            return holders[0] if len(holders) >= self.slots else None
        return store.holder(self.key)

    def _claim(self, store: Any, handing_over: bool = False) -> bool:
        """Claim the waiting place again (renewing it); whether it is still this waiter's. ``handing_over``:
        the last claim, before the resumed task starts; on the API path it is for half as long again, so that
        the place cannot be taken over (two thirds of its TTL without a claim, docs/api.md decision 9) before
        its whole TTL, the resumed task's time to start, has passed."""
        waiter = self.waiter or {}
        run = RunRef.from_columns(waiter)
        ttl = timedelta(seconds=float(waiter["ttl_seconds"]))
        claim = store.wait_claim(
            self.key, waiter["owner"], ttl * 1.5 if handing_over and self.access == "api" else ttl,
            max_waiting=int(waiter["max_waiting"]), run=run,
        )
        return bool(claim.claimed)

    def _store(self, location: Any) -> Any:
        # Like the hooks' stores: no connection held between polls (a triggerer may wait on many).
        return LeaseStore(
            location.dsn, schema=location.schema, record_events=False, idle_close=_idle(),
            prepare=settings.prepare_statements(),
        )

    async def _open(self) -> Any:
        """The store to poll: the lease connection's, or on the API path the lease API's."""
        if self.access != "api":
            return self._store(await location_async(self.conn_id, self.schema))
        # Only on the API path: httpx.
        from airflow_lease_provider.client import DEFAULT_TIMEOUT, HttpLeaseStore

        secret = await api_secret_async()
        if not secret:
            raise LeaseStoreUnavailable(
                "the triggerer cannot read the connection 'lease_api' (with a password) to wait for the lease "
                "through the api-server's lease API (docs/api.md)"
            )
        store = HttpLeaseStore(settings.api_server_url(), secret, timeout=DEFAULT_TIMEOUT)
        if self.waiter and self.waiter.get("place"):
            store.adopt_place(str(self.waiter["owner"]), str(self.waiter["place"]))
        return store

    async def on_kill(self) -> None:
        """The deferred task was killed by a user (Airflow 3.3+): give its waiting place back."""
        if not self.waiter:
            return
        store = await self._open()
        try:
            await asyncio.to_thread(store.wait_release, self.key, self.waiter["owner"])
        except Exception:  # it lapses with its TTL
            self.log.warning("lease %r: could not give the waiting place back", self.key, exc_info=True)
        finally:
            await asyncio.to_thread(store.close)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        store = await self._open()
        end = datetime.fromisoformat(self.deadline)
        claim_every = float(self.waiter["ttl_seconds"]) / 3 if self.waiter else 0.0
        claimed_at = float("-inf")

        async def keep_place(force: bool = False) -> bool:
            """Claim the waiting place again when due (``force``: now, the last claim before the resumed task
            starts); False: it is another run's now."""
            nonlocal claimed_at
            if not self.waiter or (not force and time.monotonic() - claimed_at < claim_every):
                return True
            try:
                kept = await asyncio.to_thread(self._claim, store, force)
            except LeaseError as exc:  # kept until its TTL runs out; claimed again at the next poll
                self.log.warning("lease %r: could not claim the waiting place: %s", self.key, exc)
                return True
            claimed_at = time.monotonic()
            return kept

        displaced = {"status": "displaced", "key": self.key}
        try:
            if self.not_before is not None:
                settle_until = min(datetime.fromisoformat(self.not_before), end)
                while (left := (settle_until - datetime.now(timezone.utc)).total_seconds()) > 0:
                    if not await keep_place():
                        yield TriggerEvent(displaced)
                        return
                    await asyncio.sleep(min(left, max(self.poll_interval, 0.1), claim_every or left))
            while True:
                if not await keep_place():
                    yield TriggerEvent(displaced)
                    return
                try:
                    # psycopg2 blocks: keep it off the triggerer's event loop.
                    holder = await asyncio.to_thread(self._holder, store)
                except LeaseError as exc:
                    self.log.warning("lease %r: store error while waiting: %s", self.key, exc)
                    holder = "unknown"
                if holder is None:
                    # The resumed task has a whole place TTL to start and acquire.
                    if not await keep_place(force=True):
                        yield TriggerEvent(displaced)
                        return
                    yield TriggerEvent({"status": "free", "key": self.key})
                    return
                if datetime.now(timezone.utc) >= end:
                    yield TriggerEvent({"status": "timeout", "key": self.key})
                    return
                # With a place, poll at least as often as it must be claimed again (a third of its TTL).
                await asyncio.sleep(min(self.poll_interval, claim_every) if self.waiter else self.poll_interval)
        finally:
            await asyncio.to_thread(store.close)


async def api_secret_async() -> str | None:
    """The lease API's acquire secret as the triggerer reads it (Airflow's async connection lookup, so a
    secrets backend works); None when ``lease_api`` is not defined or has no password."""
    try:
        conn = await BaseHook.aget_connection("lease_api")
    except AirflowNotFoundException:
        return None
    return str(conn.password) if conn.password else None
