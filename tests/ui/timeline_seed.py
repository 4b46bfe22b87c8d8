"""A week of one key's history, written through the core API and then moved back in time.

Every event is written the way the provider writes it (``LeaseStore.acquire/release/force_release``,
``FenceStore.accept``, the ledger for skips, losses and catch-up records, with the operators' detail);
only its ``at`` is then moved back by SQL, so a few seconds of test become days of history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from psycopg2 import sql

from airflow_lease_provider.core import EventKind, FenceStore, LeaseStore
from airflow_lease_provider.core.identity import RunRef
from tests.pg import execute
from tests.ui.server import DAG_ID

KEY = "timeline-demo"
RESOURCE = "warehouse.daily"


def owner(hours_ago: int) -> str:
    return f"{DAG_ID}/{run_id(hours_ago)}/publish"


def run_id(hours_ago: int) -> str:
    return f"scheduled__2026-11-{30 - hours_ago // 24:02d}T{23 - hours_ago % 24:02d}:00:00+00:00"


@dataclass
class Seeded:
    key: str
    #: token -> expected outcome
    outcomes: dict[int, str] = field(default_factory=dict)
    catchup_slots: int = 0


class _Clock:
    """Moves each new event (those after the watermark) to a moment ``hours`` before now."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self.mark = self._max_id()

    def _max_id(self) -> int:
        query = sql.SQL("SELECT coalesce(max(id), 0) FROM {}.event").format(sql.Identifier(self.store.schema))
        value = execute(self.store.db.dsn, query)[0][0]
        assert isinstance(value, int)
        return value

    def at(self, hours: float) -> None:
        query = sql.SQL(
            "UPDATE {}.event SET at = clock_timestamp() - %s,"
            " detail = CASE WHEN kind = 'acquired' THEN detail || jsonb_build_object('expires_at',"
            " clock_timestamp() - %s + make_interval(secs => (detail->>'ttl_seconds')::float8)) ELSE detail END"
            " WHERE id > %s"
        ).format(sql.Identifier(self.store.schema))
        ago = timedelta(hours=hours)
        execute(self.store.db.dsn, query, (ago, ago, self.mark))
        self.mark = self._max_id()

    def lease_at(self, hours: float) -> None:
        """Move the key's lease row back too (acquired, renewed and expiry), as if acquired then."""
        query = sql.SQL(
            "UPDATE {}.lease SET acquired_at = acquired_at - %s, renewed_at = renewed_at - %s,"
            " expires_at = expires_at - %s WHERE key = %s"
        ).format(sql.Identifier(self.store.schema))
        ago = timedelta(hours=hours)
        execute(self.store.db.dsn, query, (ago, ago, ago, KEY))


def seed(store: LeaseStore) -> Seeded:
    """Holdings that ended every way (released, re-entered, force-released, lost, expired), overlap skips,
    a catch-up gap of 6 slots and a fence rejection, over the last three days; each call names its run
    (``run=``) as the operators and the timetable do."""
    clock = _Clock(store)
    fences = FenceStore(store.db.dsn, schema=store.schema)
    seeded = Seeded(KEY)
    ttl = timedelta(minutes=30)

    def skip(hours: float, skipped: int, holder: str, token: int) -> None:
        store.events.record(
            EventKind.SKIPPED_OVERLAP, KEY, owner=owner(skipped), run=RunRef.parse(owner(skipped)),
            detail={"dag_id": DAG_ID, "run_id": run_id(skipped), "task_id": "publish", "map_index": -1,
                    "reason": f"lease {KEY!r} is held by {holder} with token {token}; this run is skipped",
                    "holder_owner": holder, "holder_token": token, "policy": "skip"},
        )
        clock.at(hours)

    try:
        # 70 h ago: a run held it for 50 minutes and released it.
        lease = store.acquire(KEY, owner(70), ttl, run=RunRef.parse(owner(70)))
        assert lease is not None
        clock.at(70)
        assert store.release(lease, run=RunRef.parse(lease.owner))
        clock.at(69.2)
        seeded.outcomes[lease.token] = "released"
        # 50 h ago: a long run; the next hour's run was skipped, then it released.
        lease = store.acquire(KEY, owner(50), ttl, run=RunRef.parse(owner(50)))
        assert lease is not None
        clock.at(50)
        skip(49, 49, lease.owner, lease.token)
        assert store.release(lease, run=RunRef.parse(lease.owner))
        clock.at(48.5)
        seeded.outcomes[lease.token] = "released"
        # 30 h ago: a frozen try; its retry (same task instance) re-entered with a larger token.
        first = store.acquire(KEY, owner(30), ttl, run=RunRef.parse(owner(30)))
        assert first is not None
        clock.at(30)
        retry = store.acquire(KEY, owner(30), ttl, run=RunRef.parse(owner(30)))
        assert retry is not None and retry.token == first.token + 1
        clock.at(29)
        assert store.release(retry, run=RunRef.parse(retry.owner))
        clock.at(28.4)
        seeded.outcomes[first.token] = "reentered"
        seeded.outcomes[retry.token] = "released"
        # 20 h ago: an admin force-released a stuck holder (the token goes up by one).
        stuck = store.acquire(KEY, owner(20), ttl, run=RunRef.parse(owner(20)))
        assert stuck is not None
        clock.at(20)
        skip(19.5, 19, stuck.owner, stuck.token)
        assert store.force_release(KEY, by="admin", reason="worker host lost", run=RunRef.parse(stuck.owner)) is not None
        clock.at(19)
        seeded.outcomes[stuck.token] = "force_released"
        # 12 h ago: the first run after a gap; catch-up skipped 6 older slots.
        store.events.record(
            EventKind.SKIPPED_CATCHUP, KEY, owner=f"{DAG_ID}/{run_id(12)}", run=RunRef(DAG_ID, run_id(12)),
            detail={"dag_id": DAG_ID, "run_id": run_id(12), "count": 6, "max_backfill": 1,
                    "first_start": "2026-11-29T05:00:00+00:00", "first_end": "2026-11-29T06:00:00+00:00",
                    "last_start": "2026-11-29T10:00:00+00:00", "last_end": "2026-11-29T11:00:00+00:00"},
        )
        clock.at(12)
        # 10 h ago: a run lost its lease (its renewals stalled); a zombie write was fenced out.
        lost = store.acquire(KEY, owner(10), ttl, run=RunRef.parse(owner(10)))
        assert lost is not None
        clock.at(10)
        clock.lease_at(10)
        store.events.record(EventKind.LOST, KEY, owner=lost.owner, token=lost.token, run=RunRef.parse(lost.owner),
                            detail={"reason": "renewal failed: the lease expired"})
        clock.at(9.4)
        seeded.outcomes[lost.token] = "lost"
        # 5 h ago: a run crashed holding it; its lease ran out 30 minutes later and the next run took it.
        crashed = store.acquire(KEY, owner(5), ttl, run=RunRef.parse(owner(5)))
        assert crashed is not None
        clock.at(5)
        clock.lease_at(5)
        nxt = store.acquire(KEY, owner(2), ttl, run=RunRef.parse(owner(2)))
        assert nxt is not None
        clock.at(2)
        assert fences.accept(RESOURCE, nxt.token, key=KEY, owner=nxt.owner, run=RunRef.parse(nxt.owner))
        assert not fences.accept(RESOURCE, lost.token, key=KEY, owner=lost.owner, run=RunRef.parse(lost.owner))
        clock.at(1.5)
        assert store.release(nxt, run=RunRef.parse(nxt.owner))
        clock.at(1)
        seeded.outcomes[crashed.token] = "expired"
        seeded.outcomes[nxt.token] = "released"
        seeded.catchup_slots = 6
    finally:
        fences.close()
    return seeded
