"""``airflow-lease`` answers the outcomes of ``replace`` and ``wait`` with ``max_waiting`` (issue 26, item 5): who
replaced whom, who waits for a key, who was skipped because the waiting place was taken."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from airflow_lease_provider.core import EventKind, LeaseStore, RunRef
from tests.cli.test_cli import run, run_json  # noqa: F401 (the fixture)

TTL = timedelta(minutes=10)


def ref(n: int) -> RunRef:
    return RunRef("job", f"manual__2026-12-0{n}T00:00:00+00:00", task_id="work")


def test_status_and_events_answer_replaced_waiting_and_buffer_full(run, store: LeaseStore) -> None:  # noqa: F811
    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
    for n in (1, 2):
        assert store.try_replace("rep-key", ref(n).owner(), TTL, run_after=t0 + timedelta(days=n), run=ref(n)).lease
    assert store.acquire("buf-key", ref(3).owner(), TTL, run=ref(3)) is not None
    claim = store.wait_claim("buf-key", ref(4).owner(), TTL, run=ref(4))
    store.events.record(
        EventKind.SKIPPED_BUFFER_FULL, "buf-key", owner=ref(5).owner(), run=ref(5),
        detail={"holder_owner": ref(3).owner(), "max_waiting": 1, "policy": "wait",
                "waiters": [w.to_dict() for w in claim.waiters]},
    )

    (buffered,) = run_json(run, "status", "--key", "buf-key")["leases"]
    assert [(w["owner"], w["run_id"]) for w in buffered["waiting"]] == [(ref(4).owner(), ref(4).run_id)]
    code, text = run("status")
    assert code == 0
    header, *rows = text.splitlines()
    assert header.split()[-1] == "WAITING"
    assert any(row.startswith("buf-key") and ref(4).owner() in row for row in rows), text

    (replaced,) = run_json(run, "events", "--kind", "replaced")["events"]
    assert replaced["owner"] == ref(1).owner() and replaced["run"]["run_id"] == ref(1).run_id
    assert replaced["blocked_by"]["run_id"] == ref(2).run_id
    assert replaced["detail"]["by_owner"] == ref(2).owner() and replaced["detail"]["by_token"] > replaced["token"]
    (full,) = run_json(run, "events", "--kind", "skipped_buffer_full")["events"]
    assert [w["run_id"] for w in full["waiting"]] == [ref(4).run_id] and ref(4).owner() in full["summary"]


def test_status_and_events_answer_which_slot_of_a_semaphore_is_held_by_whom(run, store: LeaseStore) -> None:  # noqa: F811
    """lease_slots=N (issue 26 items 3 and 5): ``status --key`` lists every slot held, "slot i of N"."""
    for n in (1, 2):
        assert store.try_acquire("sem-key", ref(n).owner(), TTL, slots=3, run=ref(n)).lease is not None
    rows = run_json(run, "status", "--key", "sem-key")["leases"]
    assert [(r["key"], r["lease_key"], r["slot"], r["slots"], r["slot_label"], r["owner"]) for r in rows] == [
        ("sem-key", "sem-key", 1, 3, "slot 1 of 3", ref(1).owner()),
        ("sem-key#2", "sem-key", 2, 3, "slot 2 of 3", ref(2).owner()),
    ]
    code, text = run("status", "--key", "sem-key")
    assert code == 0 and "held (slot 2 of 3)" in text and ref(2).owner() in text, text
    (acquired,) = run_json(run, "events", "--key", "sem-key#2", "--kind", "acquired")["events"]
    assert acquired["detail"]["slot"] == 2 and "slot 2 of 3 of 'sem-key'" in acquired["summary"]
