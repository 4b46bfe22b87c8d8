"""``LeaseFreeTrigger``: fires when a lease is free, so a waiting task gives up its worker slot meanwhile.

It only says "free": the resumed task must acquire the lease itself and may lose the race to another
waiter, in which case it waits again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class LeaseFreeTrigger(BaseTrigger):
    """Polls the lease store until ``key`` is free or ``deadline`` (ISO 8601) passes.

    :param key: the lease key.
    :param conn_id: the lease store's connection (None: ``[lease] conn_id``).
    :param schema: the store's schema.
    :param poll_interval: seconds between checks.
    :param deadline: when to stop waiting and report ``timeout``.
    """

    def __init__(
        self, *, key: str, conn_id: str | None, schema: str, poll_interval: float, deadline: str
    ) -> None:
        super().__init__()
        self.key = key
        self.conn_id = conn_id
        self.schema = schema
        self.poll_interval = float(poll_interval)
        self.deadline = deadline

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "key": self.key,
                "conn_id": self.conn_id,
                "schema": self.schema,
                "poll_interval": self.poll_interval,
                "deadline": self.deadline,
            },
        )

    def _holder(self, store: Any) -> Any:
        return store.holder(self.key)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow_lease_provider.core import LeaseError, LeaseStore
        from airflow_lease_provider.hooks.lease import _idle, location_async

        location = await location_async(self.conn_id, self.schema)
        # Like the hooks' stores: no connection held between polls (a triggerer may wait on many).
        store = LeaseStore(location.dsn, schema=location.schema, record_events=False, idle_close=_idle())
        end = datetime.fromisoformat(self.deadline)
        try:
            while True:
                try:
                    # psycopg2 blocks: keep it off the triggerer's event loop.
                    holder = await asyncio.to_thread(self._holder, store)
                except LeaseError as exc:
                    self.log.warning("lease %r: store error while waiting: %s", self.key, exc)
                    holder = "unknown"
                if holder is None:
                    yield TriggerEvent({"status": "free", "key": self.key})
                    return
                if datetime.now(timezone.utc) >= end:
                    yield TriggerEvent({"status": "timeout", "key": self.key})
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            await asyncio.to_thread(store.close)
