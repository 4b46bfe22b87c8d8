"""TTL advice: compare a key's configured TTL with 1.5-2x the worst hold the ledger observed.

Domain logic shared by the Leases page, its JSON endpoint and ``airflow-lease ttl-advice`` (documented in
docs/ui.md). Nothing here imports Airflow.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from datetime import timedelta
from typing import Any

from airflow_lease_provider.core import EventKind, LeaseStore
from airflow_lease_provider.core.events import DEFAULT_RETENTION, HoldStats
from airflow_lease_provider.reading import all_leases, format_duration, lease_dag, seconds_of

# TTL advice (DESIGN: TTL = 1.5 to 2x the worst normal run time).
ADVICE_LOW = 1.5
ADVICE_HIGH = 2.0
#: Above this multiple of the worst hold the TTL only delays recovery after a crash...
FAR_TOO_LONG = 4.0
#: ...unless the extra wait is this short, which nobody would notice.
NEGLIGIBLE_EXTRA = timedelta(minutes=1)
#: Fewer holds than this make the worst one a weak estimate; the advice says so.
FEW_HOLDS = 5
#: The smallest TTL advised: renewals run every TTL/3 and one may take the store's 5 s timeouts, so a
#: shorter TTL can lapse on a single slow round trip.
MIN_TTL = timedelta(seconds=30)


def advise(ttl: timedelta | None, stats: HoldStats | None, *, lost: int = 0, late: int = 0) -> dict[str, Any]:
    """Compare a configured TTL with 1.5-2x the worst observed hold.

    Verdicts: ``too_short`` (a normal run can outlive its lease when renewals stall: a zombie window),
    ``too_long`` (a crashed holder blocks the job for far longer than needed), ``ok``, ``no_data``.
    """
    advice: dict[str, Any] = {
        "ttl_seconds": seconds_of(ttl) if ttl is not None else None,
        "holds": stats.holds if stats else 0,
        "worst_hold_seconds": round(stats.worst_seconds, 3) if stats else None,
        "p95_hold_seconds": round(stats.p95_seconds, 3) if stats else None,
        "recommended_min_seconds": None,
        "recommended_max_seconds": None,
        "lost_7d": lost,
        "renewed_late_7d": late,
    }
    if stats is None or stats.holds == 0:
        return {
            **advice,
            "verdict": "no_data",
            "message": "no completed holds recorded yet: the advice needs released leases in the ledger",
        }
    worst = stats.worst_seconds
    floor = MIN_TTL.total_seconds()
    low = max(math.ceil(worst * ADVICE_LOW), floor)
    high = max(math.ceil(worst * ADVICE_HIGH), floor)
    advice.update(recommended_min_seconds=low, recommended_max_seconds=high)
    span = format_duration(low) if low == high else f"{format_duration(low)}-{format_duration(high)}"
    rule = f"1.5-2x the worst hold of {format_duration(worst)}"
    rule += f" is {span}" if low > floor else f", at least {format_duration(floor)}, is {span}"
    few = (
        f" (only {stats.holds} hold(s) observed: treat as a first estimate)"
        if stats.holds < FEW_HOLDS
        else ""
    )
    if ttl is None:
        return {**advice, "verdict": "no_data", "message": f"no TTL known for this key; {rule}{few}"}
    seconds = ttl.total_seconds()
    if seconds < low:
        if seconds < worst * ADVICE_LOW:
            severity = (
                "shorter than the worst hold itself" if seconds < worst else "less than 1.5x the worst hold"
            )
            why = "if renewals stall, a normal run outlives its lease and another run can take it (a zombie window)"
        else:
            severity = f"under the {format_duration(floor)} minimum"
            why = "renewals every TTL/3 must fit the store's 5 s timeouts, or one slow round trip loses the lease"
        return {
            **advice,
            "verdict": "too_short",
            "message": f"TTL {format_duration(seconds)} is {severity}: {why}; {rule}{few}",
        }
    extra = timedelta(seconds=seconds - high)
    if seconds > max(worst * FAR_TOO_LONG, high * 2) and extra > NEGLIGIBLE_EXTRA:
        return {
            **advice,
            "verdict": "too_long",
            "message": (
                f"TTL {format_duration(seconds)} is far above the advised range: after a crash the "
                f"job stays blocked up to {format_duration(extra.total_seconds())} longer than needed; {rule}{few}"
            ),
        }
    fits = "fits" if seconds <= high else "is above the advised range, but a crash costs little extra wait"
    return {**advice, "verdict": "ok", "message": f"TTL {format_duration(seconds)} {fits}: {rule}{few}"}


def ttl_advice(
    store: LeaseStore,
    *,
    window: timedelta = DEFAULT_RETENTION,
    key: str | None = None,
    dag_ids: Collection[str] | None = None,
) -> dict[str, Any]:
    """TTL advice for every key with a lease or with holds in the ledger (of ``dag_ids`` if given)."""
    stats = {s.key: s for s in store.hold_stats(window, dag_ids=dag_ids)}
    if key is not None:
        found = store.lease(key)
        current = [found] if found is not None and (dag_ids is None or lease_dag(found) in dag_ids) else []
    else:
        current = list(all_leases(store, dag_ids))
    ttls = {lease.key: lease.ttl for lease in current}
    troubles = {(c.key, c.kind): c.last_7d for c in store.event_counts(dag_ids=dag_ids)}
    keys: Iterable[str] = sorted(set(stats) | set(ttls))
    rows = []
    for k in keys:
        if key is not None and k != key:
            continue
        rows.append(
            {
                "key": k,
                **advise(
                    ttls.get(k),
                    stats.get(k),
                    lost=troubles.get((k, EventKind.LOST.value), 0),
                    late=troubles.get((k, EventKind.RENEWED_LATE.value), 0),
                ),
            }
        )
    return {"window_seconds": seconds_of(window), "low": ADVICE_LOW, "high": ADVICE_HIGH, "advice": rows}
