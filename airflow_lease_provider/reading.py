"""The read model: what the Leases page, its JSON endpoints and the ``airflow-lease`` CLI show, as plain dicts.

One read model for all three, so the CLI's ``--json`` and the API return the same shapes (documented in
docs/ui.md). Nothing here imports Airflow (nor the UI package, :mod:`airflow_lease_provider.plugins`): it
reads a :class:`LeaseStore` and links events to DAG runs by their run columns, and owners by the owner
format the operators write (:mod:`airflow_lease_provider.identity`). TTL advice is
:mod:`airflow_lease_provider.ttl_advice`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection, Iterator, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

from airflow_lease_provider.core import Event, EventKind, Lease, LeaseStore
from airflow_lease_provider.identity import RunRef


def parse_owner(owner: str | None) -> RunRef | None:
    """The run (and task) an owner names, as the operators write it; None for any other owner (a script)."""
    return RunRef.parse(owner)


def run_path(dag_id: str, run_id: str) -> str:
    """The DAG run's page in the Airflow UI, relative to the UI's base URL."""
    return f"dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def task_path(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """The task instance's page in the Airflow UI, relative to the UI's base URL."""
    path = f"{run_path(dag_id, run_id)}/tasks/{quote(task_id, safe='')}"
    return f"{path}/mapped/{map_index}" if map_index >= 0 else path


def run_link(ref: RunRef | None) -> dict[str, Any] | None:
    if ref is None:
        return None
    return {
        "dag_id": ref.dag_id,
        "run_id": ref.run_id,
        "map_index": ref.map_index,
        "path": run_path(ref.dag_id, ref.run_id),
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def short_time(value: Any) -> str:
    """An ISO timestamp from an event's detail as ``2026-11-29 22:10:00 UTC``; other values as they are."""
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        return str(value)
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S") + (" UTC" if moment.tzinfo is not None else "")


def seconds_of(value: timedelta) -> float:
    """A duration in seconds, rounded to the millisecond (the JSON's ``*_seconds``)."""
    return round(value.total_seconds(), 3)


# -- current leases ---------------------------------------------------------------------------------


def lease_row(lease: Lease) -> dict[str, Any]:
    """One lease with its holder's DAG run, the time left and the time since the last renewal."""
    held = lease.held
    return {
        "key": lease.key,
        "held": held,
        "owner": lease.owner,
        "holder_run": run_link(parse_owner(lease.owner)),
        "token": lease.token,
        "ttl_seconds": seconds_of(lease.ttl),
        "acquired_at": _iso(lease.acquired_at),
        "renewed_at": _iso(lease.renewed_at),
        "expires_at": _iso(lease.expires_at),
        "released_at": _iso(lease.released_at),
        "observed_at": _iso(lease.observed_at),
        # Both measured against the database clock, so a browser or laptop clock that is off changes nothing.
        "expires_in_seconds": seconds_of(lease.remaining) if held else 0.0,
        "since_renewal_seconds": seconds_of(lease.observed_at - lease.renewed_at) if held else None,
        # A semaphore's slot (lease_slots=N, migrations/0014): the row of slot i > 1 is key#i; lease_key is
        # the semaphore's key. A single-holder lease: slot 1 of 1, slot_label "".
        "lease_key": lease.lease_key,
        "slot": lease.slot,
        "slots": lease.slots,
        "slot_label": lease.slot_label,
    }


#: The longest page the lists return (the JSON's ``limit``, the CLI's page size).
MAX_PAGE = 1000


#: Event ids are a PostgreSQL bigint.
MAX_EVENT_ID = 2**63 - 1


class BadCursor(ValueError):
    """A ``cursor`` that is not a ``next_cursor`` this read model handed out."""


def encode_cursor(value: Any) -> str:
    """An opaque, URL-safe cursor for keyset pagination (the last row of a page)."""
    return base64.urlsafe_b64encode(json.dumps(value, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> Any:
    try:
        return json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, TypeError):
        raise BadCursor("cursor is not one this API handed out: pass next_cursor back unchanged") from None


def leases(
    store: LeaseStore,
    *,
    held_only: bool = False,
    limit: int = MAX_PAGE,
    cursor: str | None = None,
    dag_ids: Collection[str] | None = None,
) -> dict[str, Any]:
    """One page of leases in key order; ``next_cursor`` continues after its last key (``None``: done).

    :param dag_ids: only the leases of these DAGs (see :meth:`LeaseStore.leases`); ``None`` for all.
    """
    after = None
    if cursor:
        after = decode_cursor(cursor)
        if not isinstance(after, str):
            raise BadCursor("cursor is not one this API handed out: pass next_cursor back unchanged")
    found = store.leases(limit, after=after, held_only=held_only, dag_ids=dag_ids)
    rows = [lease_row(lease) for lease in found]
    with_waiters(store, rows)
    observed = max((row["observed_at"] for row in rows), default=None)
    more = len(found) == limit
    return {
        "observed_at": observed,
        "leases": rows,
        "limit": limit,
        "next_cursor": encode_cursor(found[-1].key) if more else None,
    }


def lease(store: LeaseStore, key: str, *, dag_ids: Collection[str] | None = None) -> dict[str, Any] | None:
    """The row of one key (``None`` when unknown, or not of one of ``dag_ids`` when given)."""
    found = store.lease(key)
    if found is None or (dag_ids is not None and lease_dag(found) not in dag_ids):
        return None
    return with_waiters(store, [lease_row(found)])[0]


def slot_rows(store: LeaseStore, key: str, *, dag_ids: Collection[str] | None = None) -> list[dict[str, Any]]:
    """The rows of every slot of ``key`` held now (a semaphore: "slot 2 of 3" each), by slot; one or none for a
    single-holder lease."""
    found = store.slot_holders(key)
    return [lease_row(h) for h in found if dag_ids is None or lease_dag(h) in dag_ids]


def with_waiters(store: LeaseStore, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each lease row with ``waiting``: the runs that hold a waiting place for its key
    (``wait`` with ``max_waiting``), oldest first, each with its run link. One read for the page."""
    by_key: dict[str, list[dict[str, Any]]] = {row["key"]: [] for row in rows}
    if by_key:
        for waiter in store.waiters(list(by_key)):
            by_key[waiter.key].append({**waiter.to_dict(), "run": run_link(parse_owner(waiter.owner))})
    for row in rows:
        row["waiting"] = by_key.get(row["key"], [])
    return rows


def lease_dag(lease: Lease) -> str | None:
    """The DAG a lease belongs to: its holder's run as the acquire named it (the lease's run columns,
    migration 0011); ``None`` for a holder of no run. The owner string is never parsed for it."""
    return lease.run.dag_id if lease.run is not None else None


def event_dag(event: Event) -> str | None:
    """The DAG an event belongs to: its run columns (migrations 0007 and 0011), as the SQL scoping reads
    them; ``None`` for an event of no run."""
    return event.run.dag_id if event.run is not None else None


# -- events -----------------------------------------------------------------------------------------


def _int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def event_run(event: Event) -> RunRef | None:
    """The run (and task instance) an event is about: its run columns; for an event without them (a core
    API user's), the run its detail or its owner names, if any."""
    if event.run is not None:
        return event.run
    detail = event.detail
    if detail.get("dag_id") and detail.get("run_id"):
        task_id = detail.get("task_id")
        return RunRef(
            str(detail["dag_id"]), str(detail["run_id"]), _int(detail.get("map_index")),
            task_id=str(task_id) if task_id else None,
        )
    return parse_owner(event.owner)


def summarize(event: Event) -> str:
    """One sentence for people: what happened and why, from the event's kind and detail."""
    d: Mapping[str, Any] = event.detail
    kind = event.kind
    if kind == EventKind.SKIPPED_OVERLAP:
        holders = [h for h in d.get("holders") or [] if isinstance(h, dict)]
        if holders:  # a semaphore (lease_slots): every slot was held
            each = ", ".join(f"{h.get('owner')} (slot {h.get('slot')}, token {h.get('token')})" for h in holders)
            return f"skipped: all {d.get('slots', len(holders))} slots of the lease were held: {each}"
        holder = d.get("holder_owner") or "another run"
        token = f" with token {d['holder_token']}" if d.get("holder_token") is not None else ""
        until = f" until {short_time(d['holder_expires_at'])}" if d.get("holder_expires_at") else ""
        return f"skipped: the lease was held by {holder}{token}{until}"
    if kind == EventKind.OVERLAP_FAILED:
        return f"failed (on_overlap=fail): the lease was held by {d.get('holder_owner') or 'another run'}"
    if kind == EventKind.WAITING:
        place = (
            f" (waiting place {d.get('place') or '?'} of {d['max_waiting']}, on_overlap={d.get('policy')})"
            if d.get("max_waiting") else ""
        )
        return (
            f"waiting for {d.get('holder_owner') or 'the holder'} to release it, until "
            f"{short_time(d.get('until', '?'))}{place}"
        )
    if kind == EventKind.REPLACED:
        return (
            f"replaced: the newer run {d.get('by_owner') or '?'} took the lease over with token "
            f"{d.get('by_token', '?')} (on_overlap=replace); token {event.token} is fenced out"
        )
    if kind == EventKind.SKIPPED_BUFFER_FULL:
        waiters = ", ".join(str(w.get("owner")) for w in d.get("waiters") or []) or "another run"
        return (
            f"skipped: the lease was held by {d.get('holder_owner') or 'another run'} and {waiters} already "
            f"waited for it ({d.get('max_waiting', '?')} waiting place(s), on_overlap={d.get('policy')})"
        )
    if kind == EventKind.SKIPPED_CATCHUP:
        # The timetable writes first_start..last_end (see SkippedSlots.detail()).
        first, last = d.get("first_start"), d.get("last_end") or d.get("last_start")
        span = f" from {short_time(first)} to {short_time(last)}" if first and last else ""
        cap = f"; max_backfill={d['max_backfill']} newest ran" if d.get("max_backfill") is not None else ""
        return f"catch-up skipped {d.get('count', '?')} older slot(s){span}{cap}"
    if kind == EventKind.COALESCED:
        # The run's whole data interval (CappedCatchupTimetable(coalesce=True); timetables/catchup_record.py's CatchUp).
        start, end = d.get("coalesced_start"), d.get("coalesced_end")
        span = f": its data interval covers {short_time(start)} to {short_time(end)}" if start and end else ""
        return f"catch-up coalesced {d.get('count', '?')} missed slot(s) into this run{span}"
    if kind == EventKind.FENCE_REJECTED:
        outcome = d.get("outcome", "stale")
        what = "a duplicate publish" if outcome == "duplicate" else "a stale token"
        return (
            f"fence {event.key!r} rejected token {event.token} ({what}); "
            f"it had accepted token {d.get('current_token', '?')}"
        )
    if kind == EventKind.LOST:
        return f"lease lost: {d.get('reason', 'no reason recorded')}"
    if kind == EventKind.FORCE_RELEASED:
        reason = f": {d['reason']}" if d.get("reason") else ""
        return f"force-released by {d.get('by', '?')}{reason}; new token {d.get('new_token', '?')}"
    if kind == EventKind.RELEASED:
        held = d.get("held_seconds")
        return (
            f"released after {format_duration(float(held))}" if isinstance(held, int | float) else "released"
        )
    if kind == EventKind.ACQUIRED:
        ttl = d.get("ttl_seconds")
        said = f"acquired for {format_duration(float(ttl))}" if isinstance(ttl, int | float) else "acquired"
        if isinstance(d.get("slots"), int) and d["slots"] > 1:  # a semaphore's slot (lease_slots)
            said += f": slot {d.get('slot')} of {d['slots']} of {d.get('lease_key', event.key)!r}"
        return said
    if kind == EventKind.RENEWED_LATE:
        return f"renewed late: {d.get('seconds_left', '?')} s were left ({d.get('failed_attempts', 0)} failed attempts)"
    return kind


def event_row(event: Event) -> dict[str, Any]:
    """An event with the run and task it is about, the run that blocked it, and a readable summary."""
    ref = event_run(event)
    task = None
    if ref is not None and ref.task_id:
        task = {
            "task_id": ref.task_id,
            "map_index": ref.map_index,
            "path": task_path(ref.dag_id, ref.run_id, ref.task_id, ref.map_index),
        }
    blocker = None
    if event.kind in BLOCKED_KINDS:
        blocker = parse_owner(event.detail.get("holder_owner"))
    elif event.kind == EventKind.REPLACED:  # the run that took the lease over
        blocker = parse_owner(event.detail.get("by_owner"))
    waiting = [parse_owner(w.get("owner")) for w in event.detail.get("waiters") or [] if isinstance(w, dict)]
    return {
        **event.to_dict(),
        "run": run_link(ref),
        "task": task,
        "blocked_by": run_link(blocker),
        # skipped_buffer_full: the runs that had the waiting places.
        "waiting": [run_link(w) for w in waiting if w is not None],
        "summary": summarize(event),
    }


#: The events about a run another run kept out (``holder_owner`` in their detail).
BLOCKED_KINDS = (EventKind.SKIPPED_OVERLAP, EventKind.OVERLAP_FAILED, EventKind.WAITING, EventKind.SKIPPED_BUFFER_FULL)
#: The events that say why a task instance did not run (its Lease tab's explanation).
SKIP_KINDS = (EventKind.SKIPPED_OVERLAP, EventKind.OVERLAP_FAILED, EventKind.SKIPPED_BUFFER_FULL, EventKind.REPLACED)


def events(
    store: LeaseStore,
    *,
    key: str | None = None,
    kind: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 100,
    cursor: str | None = None,
    dag_ids: Collection[str] | None = None,
) -> dict[str, Any]:
    """One page of events, newest first; ``next_cursor`` continues with the older ones (``None``: done)."""
    before = None
    if cursor:
        value = decode_cursor(cursor)
        try:
            before = (datetime.fromisoformat(value[0]), int(value[1]))
        except (TypeError, ValueError, IndexError, KeyError):
            raise BadCursor("cursor is not one this API handed out: pass next_cursor back unchanged") from None
        # An event id is a bigint: one out of its range was a 500 from PostgreSQL ("bigint out of range").
        if before[0].tzinfo is None or not 0 <= before[1] <= MAX_EVENT_ID:
            raise BadCursor("cursor is not one this API handed out: pass next_cursor back unchanged")
    found = store.event_page(
        key=key, kind=kind, since=since, until=until, limit=limit, before=before, dag_ids=dag_ids
    )
    more = len(found) == limit
    return {
        "events": [event_row(e) for e in found],
        "limit": limit,
        "next_cursor": encode_cursor([found[-1].at.isoformat(), found[-1].id]) if more else None,
    }


def _about(event: Event, dag_id: str, run_id: str, task_id: str, map_index: int) -> bool:
    """Whether ``event`` concerns this task instance: its run (columns, see :func:`_event_run`) is this
    run, and it names this task and map index, or none (a run's event, a catch-up record)."""
    ref = event_run(event)
    return (
        ref is not None
        and (ref.dag_id, ref.run_id) == (dag_id, run_id)
        and ref.task_id in (task_id, None)
        and ref.map_index in (map_index, -1)
    )


def task_instance_events(
    store: LeaseStore,
    dag_id: str,
    run_id: str,
    task_id: str,
    map_index: int = -1,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
) -> dict[str, Any]:
    """The events one task instance caused, and why it was skipped if it was.

    The run's events are selected in SQL by their run columns, within the run's time window when Airflow
    knows it; of those, the ones about this task instance.
    """
    found = store.run_events(dag_id, run_id, since=since, until=until)
    rows = [event_row(e) for e in found if _about(e, dag_id, run_id, task_id, map_index)]
    skip = next((r for r in rows if r["kind"] in SKIP_KINDS), None)
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "task_id": task_id,
        "map_index": map_index,
        "skip_reason": (skip["detail"].get("reason") or skip["summary"]) if skip else None,
        "events": rows,
    }


# -- counts -----------------------------------------------------------------------------------------


def counts(store: LeaseStore, *, dag_ids: Collection[str] | None = None) -> dict[str, Any]:
    """Per key: events by kind in the last 24 hours and 7 days (database clock), of ``dag_ids`` if given."""
    by_key: dict[str, dict[str, dict[str, int]]] = {}
    for c in store.event_counts(dag_ids=dag_ids):
        by_key.setdefault(c.key, {})[c.kind] = {"last_24h": c.last_24h, "last_7d": c.last_7d}
    return {
        "kinds": [k.value for k in EventKind],
        "counts": [{"key": key, "kinds": kinds} for key, kinds in sorted(by_key.items())],
    }


def all_leases(store: LeaseStore, dag_ids: Collection[str] | None) -> Iterator[Lease]:
    """Every lease, a page at a time (keyset pagination: no page costs more than the first)."""
    after = None
    while True:
        page = store.leases(MAX_PAGE, after=after, dag_ids=dag_ids)
        yield from page
        if len(page) < MAX_PAGE:
            return
        after = page[-1].key


def format_duration(seconds: float) -> str:
    """``45s``, ``12m30s``, ``3h05m``, ``2d04h``: short and unambiguous."""
    total = int(round(seconds))
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s" if secs else f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m" if minutes else f"{hours}h"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h" if hours else f"{days}d"
