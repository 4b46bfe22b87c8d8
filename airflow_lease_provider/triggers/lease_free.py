"""``LeaseFreeTrigger``: fires when a lease is free, so a waiting task gives up its worker slot meanwhile.

It only says "free": the resumed task must acquire the lease itself and may lose the race to another
waiter, in which case it waits again.

It never says "free" before ``not_before``, which the operator sets a few seconds after the deferral
(:data:`RESUME_SETTLE`). Airflow 3.1-3.3's scheduler fails a deferred task whose trigger fired so soon
that the task was queued again before the scheduler had read the executor's report of the deferring
process's exit ("finished with state success, but the task instance's state attribute is queued":
apache/airflow issues 67287 and 72716; only the ``scheduled`` case is guarded, since 3.2.2). A lease
released within a second or two of the deferral hit it: the waiting task failed instead of running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

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
    ) -> None:
        super().__init__()
        self.key = key
        self.conn_id = conn_id
        self.schema = schema
        self.poll_interval = float(poll_interval)
        self.deadline = deadline
        self.not_before = not_before

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
            },
        )

    def _holder(self, store: Any) -> Any:
        return store.holder(self.key)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow_lease_provider import settings
        from airflow_lease_provider.core import LeaseError, LeaseStore
        from airflow_lease_provider.hooks.lease import _idle, location_async

        location = await location_async(self.conn_id, self.schema)
        # Like the hooks' stores: no connection held between polls (a triggerer may wait on many).
        store = LeaseStore(
            location.dsn,
            schema=location.schema,
            record_events=False,
            idle_close=_idle(),
            prepare=settings.prepare_statements(),
        )
        end = datetime.fromisoformat(self.deadline)
        try:
            if self.not_before is not None:
                now = datetime.now(timezone.utc)
                settle = (min(datetime.fromisoformat(self.not_before), end) - now).total_seconds()
                if settle > 0:
                    await asyncio.sleep(settle)
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
