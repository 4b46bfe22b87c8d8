"""The read model behind the page, the API and the CLI: owner links, summaries, TTL advice."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from airflow_lease_provider import reading as report
from airflow_lease_provider.core import Event
from airflow_lease_provider.core.events import HoldStats
from airflow_lease_provider.identity import RunRef
from airflow_lease_provider.reading import parse_owner
from airflow_lease_provider.ttl_advice import advise

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def stats(worst: float, holds: int = 10) -> HoldStats:
    return HoldStats("k", holds, worst, worst, NOW)


@pytest.mark.parametrize(
    ("owner", "ref"),
    [
        (
            "daily/scheduled__2026-11-29T10:00:00+00:00",
            RunRef("daily", "scheduled__2026-11-29T10:00:00+00:00"),
        ),
        ("daily/manual__x/load", RunRef("daily", "manual__x", task_id="load")),
        ("daily/manual__x/load[3]", RunRef("daily", "manual__x", 3, task_id="load")),
        ("daily/manual__x/3", RunRef("daily", "manual__x", 3)),  # written before owners named the task
        ("run-42", None),
        ("a/b/c[x]", None),
        ("a/b/c/d", None),
        ("etl/manual__2026-12-01T10:00:00+00:00/load[3]", RunRef("etl", "manual__2026-12-01T10:00:00+00:00", 3, task_id="load")),
        ("etl/scheduled__x/load", RunRef("etl", "scheduled__x", task_id="load")),
        ("a/b/c", RunRef("a", "b", task_id="c")),
        ("/run", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_owner(owner: str | None, ref: RunRef | None) -> None:
    assert parse_owner(owner) == ref


def test_links_are_escaped_paths() -> None:
    assert report.run_path("d", "manual__2026-11-29T10:00:00+00:00") == (
        "dags/d/runs/manual__2026-11-29T10%3A00%3A00%2B00%3A00"
    )
    assert report.task_path("d", "r", "t", 2) == "dags/d/runs/r/tasks/t/mapped/2"
    assert report.task_path("d", "r", "t") == "dags/d/runs/r/tasks/t"


@pytest.mark.parametrize(
    ("ttl", "worst", "verdict"),
    [
        (timedelta(minutes=1), 120, "too_short"),  # shorter than the worst hold itself
        (timedelta(minutes=2, seconds=30), 120, "too_short"),  # under 1.5x
        (timedelta(minutes=3), 120, "ok"),  # 1.5x
        (timedelta(minutes=4), 120, "ok"),  # 2x
        (timedelta(minutes=6), 120, "ok"),  # above, but only 2 minutes more wait after a crash
        (timedelta(minutes=20), 120, "too_long"),  # 10x: a crash blocks the job 16 minutes longer
        (timedelta(seconds=10), 2, "too_short"),  # under the 30 s floor for renewals
        (timedelta(seconds=45), 2, "ok"),  # tiny holds: a short TTL costs little
    ],
)
def test_advice_verdicts(ttl: timedelta, worst: float, verdict: str) -> None:
    assert advise(ttl, stats(worst))["verdict"] == verdict


def test_advice_without_data_or_with_few_holds() -> None:
    assert advise(timedelta(minutes=5), None)["verdict"] == "no_data"
    few = advise(timedelta(minutes=3), stats(120, holds=2))
    assert few["verdict"] == "ok" and "first estimate" in few["message"]
    assert (few["recommended_min_seconds"], few["recommended_max_seconds"]) == (180, 240)


def event(kind: str, detail: dict[str, object], owner: str | None = "d/r", key: str = "k") -> Event:
    return Event(1, NOW, kind, key, owner, 7, detail)


def test_event_rows_link_run_task_and_blocker() -> None:
    row = report.event_row(
        event(
            "skipped_overlap",
            {
                "dag_id": "d",
                "run_id": "r2",
                "task_id": "t",
                "map_index": 1,
                "holder_owner": "d/r1",
                "holder_token": 6,
                "holder_expires_at": "2026-11-29T12:10:00.123456+00:00",
            },
        )
    )
    assert row["run"]["path"] == "dags/d/runs/r2"
    assert row["task"]["path"] == "dags/d/runs/r2/tasks/t/mapped/1"
    assert row["blocked_by"]["run_id"] == "r1"
    assert row["summary"] == "skipped: the lease was held by d/r1 with token 6 until 2026-11-29 12:10:00 UTC"


def test_summaries_of_other_kinds() -> None:
    catchup = report.summarize(
        event(
            "skipped_catchup",
            {
                "count": 14,
                "first_start": "2026-11-28T08:00:00+00:00",
                "last_end": "2026-11-29T21:50:00+00:00",
                "max_backfill": 1,
            },
        )
    )
    assert catchup.startswith("catch-up skipped 14 older slot(s) from 2026-11-28 08:00:00 UTC")
    fence = report.summarize(event("fence_rejected", {"outcome": "stale", "current_token": 9}, key="blog"))
    assert fence == "fence 'blog' rejected token 7 (a stale token); it had accepted token 9"
    forced = report.summarize(event("force_released", {"by": "alice", "reason": "host lost", "new_token": 8}))
    assert forced == "force-released by alice: host lost; new token 8"
    assert report.summarize(event("released", {"held_seconds": 754})) == "released after 12m34s"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59, "59s"), (60, "1m"), (754, "12m34s"), (3600, "1h"), (11100, "3h05m"), (190800, "2d05h")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert report.format_duration(seconds) == text


def test_task_instance_matching() -> None:
    about = report._about
    skip = event("skipped_overlap", {"dag_id": "d", "run_id": "r", "task_id": "t", "map_index": -1})
    assert about(skip, "d", "r", "t", -1)
    assert not about(skip, "d", "r", "other", -1)
    assert not about(skip, "d", "r2", "t", -1)
    catchup = event("skipped_catchup", {"dag_id": "d", "run_id": "r", "count": 3})
    assert about(catchup, "d", "r", "any_task", -1)
    # acquired/released/lost carry only the owner: the run, and the map index of a mapped instance
    assert about(event("released", {"held_seconds": 3}, owner="d/r"), "d", "r", "t", -1)
    assert about(event("released", {"held_seconds": 3}, owner="d/r/2"), "d", "r", "t", 2)
    assert not about(event("released", {"held_seconds": 3}, owner="d/r/2"), "d", "r", "t", 3)
    assert not about(event("released", {}, owner="d/r9"), "d", "r", "t", -1)
