"""The timeline's read model as pure functions: holdings from ledger events, the trend and its skip share."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from itertools import count
from typing import Any

import pytest

from airflow_lease_provider.core import Event, InvalidArgument, Lease
from airflow_lease_provider.core.history import TrendRow
from airflow_lease_provider.plugins.timeline import derive_holdings, parse_range, summarize_trend

T0 = datetime(2026, 11, 30, 3, 0, tzinfo=timezone.utc)
NOW = T0 + timedelta(hours=6)
SINCE = NOW - timedelta(hours=24)
A = "daily/scheduled__2026-11-30T03:00:00+00:00/publish"
B = "daily/scheduled__2026-11-30T04:00:00+00:00/publish"
_ids = count(1)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def ev(kind: str, minutes: float, owner: str | None, token: int | None, **detail: Any) -> Event:
    return Event(next(_ids), at(minutes), kind, "daily.publish", owner, token, detail)


def acquired(minutes: float, owner: str, token: int, ttl_minutes: float = 10) -> Event:
    return ev("acquired", minutes, owner, token, ttl_seconds=ttl_minutes * 60,
              expires_at=at(minutes + ttl_minutes).isoformat())


def lease_row(token: int, owner: str, acquired_min: float, expires_min: float, released_min: float | None = None) -> Lease:
    return Lease(
        key="daily.publish", owner=owner, token=token, ttl=timedelta(minutes=10),
        acquired_at=at(acquired_min), renewed_at=at(acquired_min), expires_at=at(expires_min),
        released_at=at(released_min) if released_min is not None else None, observed_at=NOW,
    )


def outcomes(events: list[Event], **kw: Any) -> list[tuple[int, str, datetime, datetime]]:
    found = derive_holdings(events, since=kw.pop("since", SINCE), now=kw.pop("now", NOW), **kw)
    return [(h.token, h.outcome, h.start, h.end) for h in found]


def test_a_released_holding() -> None:
    assert outcomes([acquired(0, A, 1), ev("released", 4, A, 1, held_seconds=240)]) == [
        (1, "released", at(0), at(4))
    ]


def test_reentry_by_the_same_owner_with_a_larger_token() -> None:
    # The first try froze holding token 1; its retry (same owner: same task instance) re-entered with 2.
    events = [acquired(0, A, 1), acquired(3, A, 2), ev("released", 5, A, 2)]
    assert outcomes(events) == [(1, "reentered", at(0), at(3)), (2, "released", at(3), at(5))]


def test_a_lost_lease_recorded_after_the_next_holder_took_it() -> None:
    # A stalled past its TTL; B took the key at 12; A's keeper recorded the loss only at 14.
    events = [acquired(0, A, 1), acquired(12, B, 2), ev("lost", 14, A, 1, reason="expired"), ev("released", 20, B, 2)]
    assert outcomes(events) == [(1, "lost", at(0), at(12)), (2, "released", at(12), at(20))]


def test_a_replaced_holding_ends_at_the_takeover_not_at_the_keepers_later_loss() -> None:
    # on_overlap="replace": B took the key over at 5 (its 'replaced' event is about A's token 1); A's keeper
    # recorded its loss only at 7, when its renewal was refused.
    events = [acquired(0, A, 1), acquired(5, B, 2), ev("replaced", 5, A, 1, by_owner=B, by_token=2),
              ev("lost", 7, A, 1, reason="renewal refused"), ev("released", 9, B, 2)]
    assert outcomes(events) == [(1, "replaced", at(0), at(5)), (2, "released", at(5), at(9))]


def test_no_end_event_and_another_owner_next_is_an_expiry_at_the_known_expiry() -> None:
    (first, second) = derive_holdings(
        [acquired(0, A, 1, ttl_minutes=10), acquired(45, B, 2), ev("released", 50, B, 2)], since=SINCE, now=NOW
    )
    assert (first.outcome, first.end, first.end_estimated, first.latest_end) == ("expired", at(10), True, at(45))
    assert second.outcome == "released"


def test_a_late_renewal_pushes_the_known_expiry() -> None:
    events = [acquired(0, A, 1, ttl_minutes=10), ev("renewed_late", 8, A, 1, seconds_left=2), acquired(45, B, 2)]
    (first, _second) = derive_holdings(events, since=SINCE, now=NOW)
    assert (first.outcome, first.end) == ("expired", at(18))


def test_force_released_while_held_and_after_it_lapsed() -> None:
    events = [
        acquired(0, A, 1), ev("force_released", 3, A, 1, was_held=True, new_token=2, by="admin"),
        acquired(60, B, 3, ttl_minutes=5),
        ev("force_released", 90, B, 3, was_held=False, new_token=4, by="admin"),
    ]
    assert outcomes(events) == [(1, "force_released", at(0), at(3)), (3, "expired", at(60), at(65))]


def test_the_lease_row_decides_for_its_own_token() -> None:
    held = lease_row(2, B, 300, 400)
    assert outcomes([acquired(0, A, 1), ev("released", 5, A, 1), acquired(300, B, 2)], lease=held) == [
        (1, "released", at(0), at(5)), (2, "held", at(300), NOW)
    ]
    lapsed = lease_row(2, B, 300, 340)
    assert outcomes([acquired(300, B, 2, ttl_minutes=10)], lease=lapsed) == [(2, "expired", at(300), at(340))]
    released = lease_row(2, B, 300, 340, released_min=320)
    assert outcomes([acquired(300, B, 2)], lease=released) == [(2, "released", at(300), at(320))]


def test_still_valid_by_the_ledger_without_a_lease_row_is_held() -> None:
    assert outcomes([acquired(355, A, 7, ttl_minutes=30)]) == [(7, "held", at(355), NOW)]


def test_events_beyond_the_range() -> None:
    # Acquired before the range (the read adds the open holding's acquisition): kept whole.
    before = acquired(-30 * 60, A, 1, ttl_minutes=24 * 60 + 120)
    (h,) = derive_holdings([before, ev("released", 60, A, 1)], since=SINCE, now=NOW)
    assert (h.start, h.end, h.start_known) == (before.at, at(60), True)
    # Its acquisition not in the ledger at all (pruned): it starts, as far as is known, at the range start.
    (h,) = derive_holdings([ev("released", 60, A, 1)], since=SINCE, now=NOW)
    assert (h.start, h.end, h.outcome, h.start_known) == (SINCE, at(60), "released", False)


def test_order_and_duplicates_do_not_matter() -> None:
    events = [acquired(0, A, 1), ev("released", 4, A, 1), acquired(10, B, 2), ev("released", 15, B, 2)]
    expected = outcomes(events)
    assert outcomes([*reversed(events), *events]) == expected
    assert [t for t, *_ in expected] == [1, 2]


def test_markers_and_tokenless_events_make_no_holding() -> None:
    events = [ev("skipped_overlap", 3, B, None, holder_owner=A), ev("fence_rejected", 4, A, 1, lease_key="daily.publish")]
    assert outcomes(events) == []


def test_trend_and_skip_share() -> None:
    day = datetime(2026, 11, 30)
    rows = [
        TrendRow(None, "acquired", 50, 48, 0),
        TrendRow(None, "skipped_overlap", 1, 1, 0),
        TrendRow(None, "overlap_failed", 1, 1, 0),
        TrendRow(None, "skipped_catchup", 2, 2, 17),
        TrendRow(day, "acquired", 50, 48, 0),
        TrendRow(day, "skipped_overlap", 1, 1, 0),
        TrendRow(day, "overlap_failed", 1, 1, 0),
        TrendRow(day, "skipped_catchup", 2, 2, 17),
    ]
    until = datetime(2026, 12, 1, 12, tzinfo=timezone.utc)
    trend = summarize_trend(rows, since=until - timedelta(days=7), until=until, unit="day")
    assert trend["totals"]["attempts"] == 50  # 48 runs (retries re-entering are not runs) + 1 + 1
    assert trend["skip_share"] == 0.02
    assert trend["totals"]["catchup_slots"] == 17 and trend["totals"]["catchup_gaps"] == 2
    assert len(trend["buckets"]) == 8  # Nov 24 .. Dec 1, every day present, empty ones as zeros
    (nov30,) = [b for b in trend["buckets"] if b["start"].startswith("2026-11-30")]
    assert (nov30["runs"], nov30["skipped_overlap"]) == (48, 1)
    assert sum(b["runs"] for b in trend["buckets"]) == 48
    assert summarize_trend([], since=until - timedelta(hours=24), until=until, unit="hour")["skip_share"] is None


def test_range_names() -> None:
    assert parse_range(None)[0] == "7d" and parse_range("24h")[2] == "hour"
    with pytest.raises(InvalidArgument, match="range"):
        parse_range("1y")


def test_a_semaphores_holding_says_its_slot() -> None:
    """lease_slots=N (issue 26 items 3, 5): the acquisition's detail names the slot; the bar says it."""
    slotted = ev("acquired", 0, A, 7, ttl_seconds=600, expires_at=at(10).isoformat(), slot=2, slots=3,
                 lease_key="daily")
    (h,) = derive_holdings([slotted, ev("released", 4, A, 7)], since=SINCE, now=NOW)
    assert (h.slot, h.slots) == (2, 3) and h.to_dict()["slot"] == 2 and h.to_dict()["slots"] == 3
    (plain,) = derive_holdings([acquired(0, B, 1), ev("released", 4, B, 1)], since=SINCE, now=NOW)
    assert (plain.slot, plain.slots) == (1, 1)
