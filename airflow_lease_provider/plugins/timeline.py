"""The lease timeline and the trends, as plain dicts for the page, the DAG tab and the JSON.

A **holding** is one token of one key from its acquisition to its end. The ledger records acquisitions
(``acquired``) and ends (``released``, ``lost``, ``force_released``) but not expiry, which happens by the
clock: :func:`derive_holdings` works the holdings out of those events (a pure function, unit-tested).
Markers are the events that are not holdings: overlap skips, failures and waits, catch-up skips (with
their slot count) and fence rejections.

Nothing here imports Airflow; the reads are :class:`~airflow_lease_provider.core.history.LeaseHistory`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_lease_provider import reading
from airflow_lease_provider.core import Event, EventKind, InvalidArgument, Lease, LeaseStore
from airflow_lease_provider.core.history import LeaseHistory, TrendRow
from airflow_lease_provider.core.types import slot_key

#: The ranges the page offers, and the trend's bucket for each.
RANGES: dict[str, tuple[timedelta, str]] = {
    "24h": (timedelta(hours=24), "hour"),
    "7d": (timedelta(days=7), "day"),
    "30d": (timedelta(days=30), "day"),
}
#: How a holding ended. ``held``: it has not (yet); ``reentered``: the same owner (a retry of the same
#: task instance) took the lease again with a larger token while it was held, fencing out the earlier try.
OUTCOMES = ("held", "released", "expired", "lost", "force_released", "reentered", "replaced")
#: Events drawn as markers.
MARKER_KINDS = (
    EventKind.SKIPPED_OVERLAP.value,
    EventKind.OVERLAP_FAILED.value,
    EventKind.WAITING.value,
    EventKind.SKIPPED_BUFFER_FULL.value,
    EventKind.SKIPPED_CATCHUP.value,
    EventKind.COALESCED.value,
    EventKind.FENCE_REJECTED.value,
)
_ENDS = {
    EventKind.RELEASED.value: "released",
    EventKind.LOST.value: "lost",
    EventKind.FORCE_RELEASED.value: "force_released",
    # on_overlap="replace": a newer run took the lease over (the event carries the replaced token).
    EventKind.REPLACED.value: "replaced",
}
#: The most events one timeline reads (the newest); a busier key's timeline says it is cut.
MAX_EVENTS = 20_000
#: The most keys the DAG tab draws.
MAX_DAG_KEYS = 20


def parse_range(value: str | None) -> tuple[str, timedelta, str]:
    """``24h``/``7d``/``30d`` (default ``7d``) -> (name, length, trend unit)."""
    name = value or "7d"
    if name not in RANGES:
        raise InvalidArgument("range", value, f"must be one of {', '.join(RANGES)}")
    length, unit = RANGES[name]
    return name, length, unit


# -- holdings ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holding:
    """One token of one key, from its acquisition to its end (see :data:`OUTCOMES`)."""

    key: str
    owner: str | None
    token: int
    start: datetime
    end: datetime
    outcome: str
    #: False when the acquisition is not in the ledger (older than its retention): ``start`` is then the
    #: first thing known of the holding.
    start_known: bool = True
    #: True when no event or lease row says when it ended: it expired at ``end`` (its known expiry) or
    #: later, renewed without a record, but no later than ``latest_end`` (when another run took the key).
    end_estimated: bool = False
    latest_end: datetime | None = None
    acquired_id: int | None = None
    end_id: int | None = None
    #: A semaphore's slot (lease_slots=N, from the acquisition's detail): slot ``slot`` of ``slots``; 1 of 1
    #: for a single-holder lease. The timeline of a slot is its row's key (``key#i`` for i > 1).
    slot: int = 1
    slots: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "owner": self.owner,
            "token": self.token,
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "outcome": self.outcome,
            "start_known": self.start_known,
            "end_estimated": self.end_estimated,
            "latest_end": self.latest_end.isoformat() if self.latest_end else None,
            "held_seconds": round((self.end - self.start).total_seconds(), 3),
            "acquired_id": self.acquired_id,
            "end_id": self.end_id,
            "run": reading.run_link(reading.parse_owner(self.owner)),
            "slot": self.slot,
            "slots": self.slots,
        }


def _slot_of(acquired: Event | None) -> tuple[int, int]:
    """(slot, slots) of a holding from its acquisition's detail (a semaphore's); (1, 1) otherwise."""
    detail = acquired.detail if acquired is not None else {}
    slot, slots = detail.get("slot"), detail.get("slots")
    if isinstance(slot, int) and isinstance(slots, int) and 1 <= slot <= slots:
        return slot, slots
    return 1, 1


def _aware(value: Any) -> datetime | None:
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _known_expiry(acquired: Event | None, start: datetime, later: Iterable[Event]) -> datetime | None:
    """The latest moment the ledger proves the holding valid: its first expiry, pushed on by each late
    renewal recorded (a renewal at ``at`` extends it to ``at + ttl``). None without a TTL."""
    expiry: datetime | None = None
    ttl: timedelta | None = None
    if acquired is not None:
        expiry = _aware(acquired.detail.get("expires_at"))
        seconds = acquired.detail.get("ttl_seconds")
        if isinstance(seconds, int | float) and not isinstance(seconds, bool):
            ttl = timedelta(seconds=float(seconds))
            expiry = expiry or start + ttl
    if ttl is not None:
        for event in later:
            if event.kind == EventKind.RENEWED_LATE.value:
                expiry = max(expiry or event.at, event.at + ttl)
    return expiry


def derive_holdings(
    events: Iterable[Event],
    *,
    since: datetime,
    now: datetime,
    lease: Lease | None = None,
) -> list[Holding]:
    """The holdings of one key, in token order, from its ledger events (any order, duplicates allowed).

    - A holding starts at its ``acquired`` event (tokens only grow, so token order is time order); a
      token seen only in end events started before ``since`` (its acquisition is not among ``events``).
    - It ends at its first end event: ``released``, ``lost``, ``force_released`` (a force-release of a
      lease that had already lapsed, ``was_held`` false, means it expired). An end recorded after the
      next holding began (a keeper noticing its loss late) is moved back to that start.
    - With no end event: ``lease`` (the key's row) decides for its own token (released, still held,
      or expired at its ``expires_at``). Otherwise the next acquisition by the same owner is a
      re-entry (``reentered``: a retry of the same task instance took over with a larger token); by
      another owner, or none before ``now``, the lease expired: at its known expiry (estimated).
    """
    by_id: dict[int, Event] = {e.id: e for e in events}
    ordered = sorted(by_id.values(), key=lambda e: (e.at, e.id))
    acquired: dict[int, Event] = {}
    related: dict[int, list[Event]] = {}
    key = ordered[0].key if ordered else (lease.key if lease else "")
    for event in ordered:
        if event.token is None:
            continue
        if event.kind == EventKind.ACQUIRED.value:
            acquired.setdefault(event.token, event)
            key = event.key
            related.setdefault(event.token, [])
        elif event.kind in _ENDS or event.kind == EventKind.RENEWED_LATE.value:
            related.setdefault(event.token, []).append(event)
    tokens = sorted(t for t in related if t in acquired or any(e.kind in _ENDS for e in related[t]))
    holdings: list[Holding] = []
    for index, token in enumerate(tokens):
        first = acquired.get(token)
        later = related[token]
        start = first.at if first is not None else min([since, *(e.at for e in later)])
        owner = first.owner if first is not None else next((e.owner for e in later if e.owner), None)
        following = next((acquired[t] for t in tokens[index + 1:] if t in acquired), None)
        next_start = following.at if following is not None else None
        ends = [e for e in later if e.kind in _ENDS and e.at >= start]
        expiry = _known_expiry(first, start, later)
        slot, slots = _slot_of(first)
        base = Holding(key, owner, token, start, start, "held", start_known=first is not None,
                       acquired_id=first.id if first is not None else None, slot=slot, slots=slots)
        if ends:
            end_event = ends[0]
            end, outcome = end_event.at, _ENDS[end_event.kind]
            estimated = False
            if outcome == "force_released" and end_event.detail.get("was_held") is False:
                outcome, estimated = "expired", True
                end = min(expiry, end) if expiry is not None else end
            if next_start is not None and end > next_start:
                end = next_start
            holdings.append(replace(base, end=end, outcome=outcome, end_estimated=estimated,
                                    end_id=end_event.id))
            continue
        if lease is not None and lease.token == token:
            if lease.released_at is not None:
                holdings.append(replace(base, end=lease.released_at, outcome="released"))
            elif lease.expires_at > now:
                holdings.append(replace(base, end=now, outcome="held"))
            else:
                holdings.append(replace(base, end=lease.expires_at, outcome="expired"))
            continue
        if following is not None and next_start is not None and following.owner == owner:
            holdings.append(replace(base, end=max(start, next_start), outcome="reentered"))
            continue
        limit = next_start if next_start is not None else now
        if expiry is not None and expiry > limit and next_start is None:
            # Not expired yet by what the ledger shows, and no lease row says otherwise.
            holdings.append(replace(base, end=now, outcome="held"))
            continue
        end = min(expiry, limit) if expiry is not None else limit
        holdings.append(replace(base, end=max(start, end), outcome="expired", end_estimated=True,
                                latest_end=next_start))
    return holdings


# -- markers ----------------------------------------------------------------------------------------


def marker(event: Event) -> dict[str, Any]:
    """A marker: the event's row (run, task, summary) and, for catch-up skips and coalesced catch-up, the
    slot count (and for the latter the run's whole data interval, ``coalesced_start``/``coalesced_end``)."""
    row = reading.event_row(event)
    count = event.detail.get("count")
    row["slots"] = int(count) if isinstance(count, int) and not isinstance(count, bool) else None
    if event.kind == EventKind.COALESCED.value:
        row["coalesced_start"] = event.detail.get("coalesced_start")
        row["coalesced_end"] = event.detail.get("coalesced_end")
    return row


# -- reads ------------------------------------------------------------------------------------------


def _in_scope(event: Event, dag_ids: Collection[str] | None) -> bool:
    return dag_ids is None or reading.event_dag(event) in dag_ids


def key_timeline(
    store: LeaseStore,
    key: str,
    *,
    range_name: str | None = None,
    dag_ids: Collection[str] | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The timeline of one key over a range ending now (database clock): holdings and markers."""
    name, length, _unit = parse_range(range_name)
    history = LeaseHistory(store)
    now = now or history.now()
    since, until = now - length, now
    events = history.key_events(key, since, now + timedelta(seconds=1), dag_ids=dag_ids, limit=MAX_EVENTS)
    truncated = len(events) == MAX_EVENTS
    covers_from = events[-1].at if truncated else since
    before = [e for e in history.open_holding(key, covers_from) if _in_scope(e, dag_ids)]
    row = store.lease(key)
    if row is not None and dag_ids is not None and reading.lease_dag(row) not in dag_ids:
        row = None
    holdings = [
        h for h in derive_holdings([*before, *events], since=covers_from, now=now, lease=row)
        if h.end >= since and h.start <= until
    ]
    markers = [marker(e) for e in reversed(events) if e.kind in MARKER_KINDS]
    # A semaphore (lease_slots=N): the holdings of its other slots, each slot row's own (key#i), one lane each.
    for slot in range(2, (row.slots if row is not None else 1) + 1):
        slot_events = history.key_events(slot_key(key, slot), since, now + timedelta(seconds=1), dag_ids=dag_ids,
                                         limit=MAX_EVENTS)
        slot_row = store.lease(slot_key(key, slot))
        if slot_row is not None and dag_ids is not None and reading.lease_dag(slot_row) not in dag_ids:
            slot_row = None
        slot_before = [e for e in history.open_holding(slot_key(key, slot), since) if _in_scope(e, dag_ids)]
        holdings += [
            h for h in derive_holdings([*slot_before, *slot_events], since=since, now=now, lease=slot_row)
            if h.end >= since and h.start <= until
        ]
        markers += [marker(e) for e in reversed(slot_events) if e.kind in MARKER_KINDS]
        events = [*events, *slot_events]
        before = [*before, *slot_before]
    # The DAGs of the holdings (each from its acquisition, or the lease row) and of the events.
    dags = {reading.event_dag(e) for e in [*before, *events]} | {reading.lease_dag(row) if row is not None else None}
    dags.discard(None)
    shown = {m["id"] for m in markers}
    catchup = [
        marker(e) for e in reversed(history.catchup_events({d for d in dags if d}, since, now, coalesced=True))
        if e.id not in shown and _in_scope(e, dag_ids)
    ]
    markers = sorted([*markers, *catchup], key=lambda m: (m["at"], m["id"]))
    return {
        "key": key,
        "range": name,
        "since": since.isoformat(),
        "until": until.isoformat(),
        "observed_at": now.isoformat(),
        "truncated": truncated,
        "covers_from": covers_from.isoformat(),
        "lease": reading.lease_row(row) if row is not None else None,
        "holdings": [h.to_dict() for h in holdings],
        "markers": markers,
    }


def _buckets(since: datetime, until: datetime, unit: str) -> list[datetime]:
    start = since.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)
    step = timedelta(hours=1)
    if unit == "day":
        start = start.replace(hour=0)
        step = timedelta(days=1)
    found = []
    while start < until:
        found.append(start)
        start += step
    return found


def summarize_trend(
    rows: Iterable[TrendRow],
    *,
    since: datetime,
    until: datetime,
    unit: str,
    catchup: Iterable[Event] | None = None,
) -> dict[str, Any]:
    """Per bucket and in total: runs (distinct owners that acquired), overlap skips and failures,
    catch-up slots skipped and gaps, lost leases, force-releases; and the skip share, skipped / attempts,
    where an attempt is a run that took the lease, was skipped or failed for overlap.

    :param catchup: the catch-up records to count instead of the rows' (a key's trend counts those of
        its DAGs, which are recorded under the DAG id).
    """
    empty = {"runs": 0, "skipped_overlap": 0, "overlap_failed": 0, "catchup_slots": 0, "catchup_gaps": 0,
             "lost": 0, "force_released": 0}
    buckets = {b: dict(empty) for b in _buckets(since, until, unit)}
    total = dict(empty)

    def bucket_of(moment: datetime) -> dict[str, int]:
        moment = moment.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)
        if unit == "day":
            moment = moment.replace(hour=0)
        return buckets.setdefault(moment, dict(empty))

    for row in rows:
        if row.kind == EventKind.SKIPPED_CATCHUP.value and catchup is not None:
            continue
        target = total if row.bucket is None else bucket_of(row.bucket.replace(tzinfo=timezone.utc))
        if row.kind == EventKind.ACQUIRED.value:
            target["runs"] += row.owners
        elif row.kind == EventKind.SKIPPED_CATCHUP.value:
            target["catchup_slots"] += row.slots
            target["catchup_gaps"] += row.events
        elif row.kind in target:
            target[row.kind] += row.events
    for event in catchup or ():
        count = event.detail.get("count")
        slots = count if isinstance(count, int) and not isinstance(count, bool) else 0
        for target in (total, bucket_of(event.at)):
            target["catchup_slots"] += slots
            target["catchup_gaps"] += 1
    attempts = total["runs"] + total["skipped_overlap"] + total["overlap_failed"]
    return {
        "since": since.isoformat(),
        "until": until.isoformat(),
        "unit": unit,
        "buckets": [{"start": b.isoformat(), **counts} for b, counts in sorted(buckets.items())],
        "totals": {**total, "attempts": attempts},
        "skip_share": round(total["skipped_overlap"] / attempts, 4) if attempts else None,
    }


def gaps(events: Iterable[Event]) -> list[dict[str, Any]]:
    """Catch-up gaps, newest first: the run after the gap, how many slots were skipped, from when to when."""
    found = []
    for event in events:
        d = event.detail
        count = d.get("count")
        found.append({
            "id": event.id,
            "at": event.at.isoformat(),
            "key": event.key,
            "slots": int(count) if isinstance(count, int) and not isinstance(count, bool) else None,
            "first_start": d.get("first_start"),
            "last_end": d.get("last_end") or d.get("last_start"),
            "run": reading.run_link(reading.event_run(event)),
            "summary": reading.summarize(event),
        })
    return found


def key_trend(
    store: LeaseStore,
    key: str,
    *,
    range_name: str | None = None,
    dag_ids: Collection[str] | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Runs vs skips of one key per hour (24 h) or day, the skip share, and the catch-up gaps: those
    recorded under the key, and those of the DAG whose run holds (or last held) it."""
    name, length, unit = parse_range(range_name)
    history = LeaseHistory(store)
    now = now or history.now()
    since, until = now - length, now + timedelta(seconds=1)
    rows = history.key_trend(key, since, until, unit=unit, dag_ids=dag_ids)
    row = store.lease(key)
    dags = {d for d in [reading.lease_dag(row) if row is not None else None] if d}
    if dag_ids is not None:
        dags &= set(dag_ids)
    own = store.event_page(
        key=key, kind=EventKind.SKIPPED_CATCHUP, since=since, until=until, dag_ids=dag_ids, limit=1000
    )
    catchup = {e.id: e for e in history.catchup_events(dags, since, until)}
    catchup.update({e.id: e for e in own})
    found = sorted(catchup.values(), key=lambda e: (e.at, e.id), reverse=True)
    summary = summarize_trend(rows, since=since, until=now, unit=unit, catchup=found)
    return {"key": key, "range": name, **summary, "catchup_gaps": gaps(found)}


def dag_trend(store: LeaseStore, dag_id: str, *, range_name: str | None = None, now: datetime | None = None) -> dict[str, Any]:
    """:func:`key_trend` for every key of one DAG's runs."""
    name, length, unit = parse_range(range_name)
    history = LeaseHistory(store)
    now = now or history.now()
    since = now - length
    rows = history.dag_trend(dag_id, since, now + timedelta(seconds=1), unit=unit)
    summary = summarize_trend(rows, since=since, until=now, unit=unit)
    return {"dag_id": dag_id, "range": name, **summary,
            "catchup_gaps": gaps(history.catchup_events({dag_id}, since, now))}


def dag_view(
    store: LeaseStore,
    dag_id: str,
    *,
    range_name: str | None = None,
    dag_ids: Collection[str] | None = None,
) -> dict[str, Any]:
    """A DAG's tab: its trend, and per key its runs used (held leases first, then the most recently
    used), the current holder, the timeline and the trend. Other DAGs' runs on a shared key show only
    when the user may read those DAGs (``dag_ids``)."""
    name, length, _unit = parse_range(range_name)
    history = LeaseHistory(store)
    now = history.now()
    since = now - length
    used = history.dag_keys(dag_id, since, now + timedelta(seconds=1), limit=MAX_DAG_KEYS * 5)
    rows = {lease.key: lease for lease in history.dag_leases(dag_id)}
    held = sorted(k for k, lease in rows.items() if lease.held)
    order = [*held, *(u.key for u in used if u.key not in held)]
    order += sorted(k for k in rows if k not in order)
    keys = []
    for key in order[:MAX_DAG_KEYS]:
        keys.append({
            "key": key,
            "timeline": key_timeline(store, key, range_name=name, dag_ids=dag_ids, now=now),
            "trend": key_trend(store, key, range_name=name, dag_ids=dag_ids, now=now),
        })
    return {
        "dag_id": dag_id,
        "range": name,
        "observed_at": now.isoformat(),
        "trend": dag_trend(store, dag_id, range_name=name, now=now),
        "keys": keys,
        "more_keys": max(0, len(order) - MAX_DAG_KEYS),
    }
