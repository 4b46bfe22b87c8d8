"""The checker on hand-made histories: it passes a clean one and names every kind of violation.

A checker that cannot fail proves nothing; these run in milliseconds, while the harness runs in
``test_chaos.py`` show it failing the deliberately broken stores too.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from chaos import checker, history

T0 = datetime(2026, 11, 29, 10, 0, tzinfo=timezone.utc)
TTL = 2.0


def at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


class Story:
    """Builds a history the way a run records it: worker ops plus the committed ground truth."""

    def __init__(self, **profile: Any) -> None:
        self.records: list[dict[str, Any]] = [{
            "type": "meta", "ttl": TTL, "keys": ["job-0"], "resources": {"target-0": "job-0"},
            "profile": {"duration": 10, **profile},
        }]
        self.rows: dict[str, dict[str, Any]] = {}
        self.ids = 0

    def _id(self) -> int:
        self.ids += 1
        return self.ids

    def op(self, op: str, w: int, t: float, **fields: Any) -> None:
        self.records.append({"type": "op", "op": op, "w": w, "t0": t, "t1": t + 0.01, **fields})

    def audit(self, key: str, when: float, **new: Any) -> None:
        old = self.rows.get(key)
        row = {"slots": 1, "slot": 1, "slot_of": None, "run_after": None, "replaced_token": None, **(old or {}), **new}
        self.records.append({
            "type": "audit_lease", "id": self._id(), "at": at(when), "op": "UPDATE" if old else "INSERT",
            "key": key, "owner": row["owner"], "token": row["token"], "acquired_at": row["acquired_at"],
            "renewed_at": row["renewed_at"], "expires_at": row["expires_at"], "released_at": row.get("released_at"),
            "old_owner": old and old["owner"], "old_token": old and old["token"],
            "old_expires_at": old and old["expires_at"], "old_released_at": old and old.get("released_at"),
            **{name: row[name] for name in ("slots", "slot", "slot_of", "run_after", "replaced_token")},
            "extra": {"count_epoch": row.get("count_epoch", 0)},
        })
        self.rows[key] = row

    def acquire(
        self, key: str, token: int, owner: str, t: float, w: int = 0, *, committed: bool = True, slots: int = 1,
        slot: int = 1, replaced: int | None = None, replace: bool = False, epoch: int = 0,
    ) -> None:
        """A grant; ``slots`` > 1: slot ``slot`` of the semaphore ``key`` (its row ``key#slot``); ``replace``:
        a replace's grant (``replaced``: the token it took over)."""
        row = key if slot == 1 else f"{key}#{slot}"
        fields = {"acquired_at": at(t), "renewed_at": at(t), "expires_at": at(t + TTL), "observed_at": at(t)}
        shape: dict[str, Any] = {"slot": slot, "slots": slots, "lease_key": key} if slots > 1 else {}
        if replace:
            shape.update(replaced_token=replaced, replaced_owner=replaced and self.rows[row]["owner"])
        self.op("replace" if replace else "acquire", w, t, outcome="ok", key=row, token=token, owner=owner,
                **fields, **shape)
        if committed:
            self.audit(row, t, owner=owner, token=token, released_at=None, slots=slots, slot=slot,
                       slot_of=key if slot > 1 else None, run_after=at(t) if replace else None,
                       replaced_token=replaced, count_epoch=epoch,
                       **{k: v for k, v in fields.items() if k != "observed_at"})

    def force_release(self, key: str, t: float) -> None:
        """The admin's force-release: the row's token bumped, the lease ended now."""
        old = self.rows[key]
        self.audit(key, t, token=old["token"] + 1, released_at=at(t), expires_at=at(t))

    def release(self, key: str, token: int, owner: str, t: float, w: int = 0) -> None:
        self.op("release", w, t, outcome="ok", key=key, token=token, owner=owner)
        self.audit(key, t, released_at=at(t), expires_at=at(t))

    def publish(
        self, resource: str, token: int, owner: str, t: float, w: int = 0, idem: str | None = None,
        key: str | None = None,
    ) -> None:
        keyed = {} if key is None else {"key": key}
        self.op("publish", w, t, outcome="accepted", resource=resource, token=token, owner=owner, at=at(t), idem=idem,
                **keyed)
        self.records.append({
            "type": "target", "id": self._id(), "resource": resource, "token": token, "owner": owner,
            "worker": w, "idem": idem, "at": at(t), **keyed,
        })
        if key is not None:
            self.records.append({"type": "audit_fence", "id": self._id(), "at": at(t), "resource": resource,
                                 "key": key, "token": token, "owner": owner, "old_token": None})

    def crash_and_probe(self, delay: float = 1.0, publish: str = "accepted") -> None:
        self.records.append({"type": "crash_all", "t": 50.0, "db_time": at(50)})
        self.records.append({"type": "probe", "t": 51.0, "key": "job-0", "token": 99,
                             "acquired_at": at(50 + delay), "publish": publish})

    def check(self) -> checker.Report:
        return checker.check_records(self.records)


def clean() -> Story:
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0, w=0)
    s.publish("target-0", 1, "w0-1", 0.3, w=0, idem="slot-1")
    s.release("job-0", 1, "w0-1", 0.5, w=0)
    s.acquire("job-0", 2, "w1-1", 1.0, w=1)
    s.publish("target-0", 2, "w1-1", 1.2, w=1, idem="slot-2")
    # token 2 is never released: it lapses at 3.0, then token 3 comes.
    s.acquire("job-0", 3, "w0-2", 3.5, w=0)
    s.crash_and_probe()
    return s


def test_a_clean_history_passes() -> None:
    report = clean().check()
    assert report.violations == [], report.format()
    assert report.status == 0
    assert sum(report.operations.values()) == 6
    assert "max 1.00s" in report.recovery["new holder after all holders crashed"]


def kinds(report: checker.Report) -> set[str]:
    return {v.kind for v in report.violations}


def test_overlap_by_a_lease_taken_while_valid() -> None:
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0)
    s.acquire("job-0", 2, "w1-1", 1.0, w=1)  # token 1 is valid until 2.0
    s.crash_and_probe()
    assert kinds(s.check()) == {"overlap", "overlap-db"}


def test_a_same_owner_reentry_is_no_overlap() -> None:
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0)
    s.acquire("job-0", 2, "w0-1", 0.5)  # the same owner retrying: decision 5 says it may
    s.crash_and_probe()
    assert s.check().violations == []


def test_a_released_lease_ends_when_the_database_last_confirmed_it() -> None:
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0)
    s.op("release", 0, 0.4, outcome="unknown", key="job-0", token=1, owner="w0-1")
    s.audit("job-0", 0.4, released_at=at(0.4), expires_at=at(0.4))
    s.acquire("job-0", 2, "w1-1", 0.6, w=1)  # fine: the release (outcome unknown) did happen
    s.crash_and_probe()
    assert s.check().violations == []


def test_a_release_reported_refused_that_did_commit_ends_the_lease() -> None:
    """The reply to a committed release was lost; the resend was refused (already released)."""
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0)
    s.op("release", 0, 0.4, outcome="refused", key="job-0", token=1, owner="w0-1")
    s.audit("job-0", 0.4, released_at=at(0.4), expires_at=at(0.4))
    s.acquire("job-0", 2, "w1-1", 0.6, w=1)
    s.crash_and_probe()
    assert s.check().violations == []


def test_a_refused_release_that_never_committed_leaves_the_lease_valid() -> None:
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0)
    s.op("release", 0, 0.4, outcome="refused", key="job-0", token=1, owner="w0-1")
    s.acquire("job-0", 2, "w1-1", 0.6, w=1)  # taken from a lease valid until 2.0
    s.crash_and_probe()
    assert kinds(s.check()) == {"overlap", "overlap-db"}


def test_token_issued_twice() -> None:
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0)
    s.op("acquire", 1, 3.0, outcome="ok", key="job-0", token=1, owner="w1-1", acquired_at=at(3),
         renewed_at=at(3), expires_at=at(5), observed_at=at(3))
    s.crash_and_probe()
    assert "token-reissued" in kinds(s.check())


def test_tokens_out_of_time_order() -> None:
    s = Story()
    s.acquire("job-0", 2, "w0-1", 0.0)
    s.acquire("job-0", 1, "w1-1", 3.0, w=1)
    s.crash_and_probe()
    assert {"token-order", "token-regressed"} <= kinds(s.check())


def test_a_stale_publish_accepted_by_the_target() -> None:
    s = clean()
    s.publish("target-0", 1, "w0-1", 2.0, w=0)  # the zombie writes after token 2 did
    assert kinds(s.check()) == {"fence-order", "duplicate-publish"}


def test_a_publish_with_someone_elses_token() -> None:
    s = clean()
    s.publish("target-0", 3, "w1-1", 4.0, w=1)  # token 3 belongs to w0-2
    assert kinds(s.check()) == {"publish-not-holder"}


def test_an_idempotency_key_used_twice() -> None:
    s = clean()
    s.publish("target-0", 3, "w0-2", 4.0, w=0, idem="slot-2")
    assert kinds(s.check()) == {"duplicate-publish"}


def test_an_acknowledged_acquire_that_the_database_lost() -> None:
    s = clean()
    s.acquire("job-0", 4, "w1-2", 6.0, w=1, committed=False)
    assert kinds(s.check()) == {"lost-ack"}


def test_an_acknowledged_publish_that_the_database_lost() -> None:
    s = clean()
    s.op("publish", 0, 4.0, outcome="accepted", resource="target-0", token=3, owner="w0-2", at=at(4))
    assert kinds(s.check()) == {"lost-ack"}


def test_an_undocumented_error() -> None:
    s = clean()
    s.op("acquire", 0, 9.0, outcome="error", key="job-0", owner="w0-9", error="KeyError('x')")
    assert kinds(s.check()) == {"unexpected-error"}


def test_a_worker_that_died() -> None:
    s = clean()
    s.records.append({"type": "worker_exit", "t": 9.0, "w": 3, "code": 1, "log": "w3.log"})
    assert kinds(s.check()) == {"unexpected-error"}


@pytest.mark.parametrize(("delay", "publish"), [(TTL + 1.5, "accepted"), (0.5, "rejected: stale")])
def test_slow_or_blocked_recovery(delay: float, publish: str) -> None:
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0)
    s.crash_and_probe(delay=delay, publish=publish)
    assert kinds(s.check()) == {"recovery"}


def test_too_small_a_run_is_inconclusive_not_passed() -> None:
    s = Story(min_operations=1000, zombie_every=5.0, kill_every=60.0)
    s.acquire("job-0", 1, "w0-1", 0.0)
    s.crash_and_probe()
    report = s.check()
    assert report.violations == [] and report.status == 2
    assert any("fewer than the 1000" in problem for problem in report.coverage)
    assert any("no sigstop fault" in problem for problem in report.coverage)
    assert not any("kill9" in problem for problem in report.coverage)  # not scheduled in 10 s


def test_the_command_line_reads_a_file_and_exits_non_zero(tmp_path: Path) -> None:
    bad = Story()
    bad.acquire("job-0", 1, "w0-1", 0.0)
    bad.acquire("job-0", 2, "w1-1", 1.0, w=1)
    bad.crash_and_probe()
    path = tmp_path / "history.jsonl"
    path.write_text("".join(history.dumps(r) + "\n" for r in bad.records) + '{"type": "op", "cut sh')
    assert checker.main([str(path), "--json", str(tmp_path / "report.json")]) == 1
    assert '"overlap"' in (tmp_path / "report.json").read_text()
    good = tmp_path / "good.jsonl"
    good.write_text("".join(history.dumps(r) + "\n" for r in clean().records))
    assert checker.main([str(good)]) == 0


def test_the_history_gives_acknowledged_releases_their_database_time() -> None:
    s = clean()
    records = [r for r in s.records if r["type"] == "op"]
    history.with_release_times(records, [r for r in s.records if r["type"] == "audit_lease"])
    release = next(r for r in records if r["op"] == "release")
    assert release["released_at"] == at(0.5)


# -- the properties that catch a late-counting keeper and a cross-key fence ------------------------------


def test_a_keeper_check_that_passed_after_the_lease_ended() -> None:
    s = clean()  # token 2 of w1-1: acquired at 1.0, never renewed, expired at 3.0
    s.op("check", 1, 2.5, outcome="held", key="job-0", token=2, owner="w1-1", db_before=at(2.5), start="delayed")
    assert s.check().violations == []
    s.op("check", 1, 3.2, outcome="held", key="job-0", token=2, owner="w1-1", db_before=at(3.2), start="delayed")
    report = s.check()
    assert kinds(report) == {"stale-check"}
    assert "keeper started delayed" in report.violations[0].detail


def test_fence_order_is_judged_per_lease_key() -> None:
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0)
    s.release("job-0", 1, "w0-1", 0.1)
    s.acquire("job-0", 2, "w0-2", 0.2)
    s.publish("target-0", 2, "w0-2", 0.3, key="job-0")
    s.acquire("job-1", 1, "w1-1", 0.4, w=1)
    s.publish("target-0", 1, "w1-1", 0.5, w=1, key="job-1")  # another key: its own count
    s.crash_and_probe()
    assert s.check().violations == []
    s.publish("target-0", 1, "w0-1", 0.6, key="job-0")  # a stale token of job-0 itself
    assert "fence-order" in kinds(s.check())


def test_a_publish_refused_although_its_key_never_reached_that_token() -> None:
    s = Story()
    s.acquire("job-0", 3, "w0-1", 0.0)
    s.publish("target-0", 3, "w0-1", 0.1, key="job-0")
    s.acquire("job-1", 1, "w1-1", 0.2, w=1)
    refused = {"outcome": "stale", "resource": "target-0", "current": 3}
    s.op("publish", 0, 0.3, key="job-0", token=2, owner="w0-0", **refused)  # stale within job-0: fine
    s.crash_and_probe()
    assert s.check().violations == []
    s.op("publish", 1, 0.4, key="job-1", token=1, owner="w1-1", **refused)  # compared with job-0's token
    assert kinds(s.check()) == {"valid-refused"}


# -- semaphore slots, single holders, replaces and slot-count changes (chaos.exclusion) --------------------


def slots_story() -> Story:
    """A clean history of one key: two holders of 2 slots, then one holder, then 3 slots, each count's
    grants above every token of the count before (as a store that orders count changes must issue them)."""
    s = Story(slot_counts=[2, 3, 1])
    s.records[0]["slot_keys"] = ["pool-0"]
    s.acquire("pool-0", 1, "w0-1", 0.0, slots=2)
    s.acquire("pool-0", 1, "w1-1", 0.1, w=1, slots=2, slot=2)
    s.publish("target-9", 1, "w1-1", 0.2, w=1, key="pool-0#2")
    s.release("pool-0", 1, "w0-1", 0.5)
    s.release("pool-0#2", 1, "w1-1", 0.6, w=1)
    s.acquire("pool-0", 2, "w2-1", 1.0, w=2)  # the count is 1 now: a single holder
    s.publish("target-9", 2, "w2-1", 1.1, w=2, key="pool-0")
    s.release("pool-0", 2, "w2-1", 1.2, w=2)
    s.acquire("pool-0", 3, "w0-2", 1.5, slots=3)
    s.acquire("pool-0", 4, "w1-2", 1.6, w=1, slots=3, slot=2)
    s.acquire("pool-0", 5, "w3-1", 1.7, w=3, slots=3, slot=3)
    s.crash_and_probe()
    return s


def test_slots_of_one_count_then_one_holder_then_another_count_pass() -> None:
    report = slots_story().check()
    assert report.violations == [], report.format()
    assert report.figures["semaphore keys: committed grants"] == {"one holder": 1, "slots=2": 2, "slots=3": 3}
    assert report.figures["semaphore keys: slot-count changes"] == 2


def test_a_replace_granted_beside_a_live_slot() -> None:
    """Issue 38, defect 1: slot 1 released, slot 2 still held, and a replace takes the key."""
    s = Story()
    s.acquire("pool-0", 1, "w0-1", 0.0, slots=2)
    s.acquire("pool-0", 1, "w1-1", 0.1, w=1, slots=2, slot=2)  # valid until 2.1
    s.release("pool-0", 1, "w0-1", 0.3)
    s.acquire("pool-0", 2, "w2-1", 0.5, w=2, replace=True)
    s.crash_and_probe()
    report = s.check()
    assert kinds(report) == {"exclusion", "exclusion-db"}
    assert "a single holder beside another holder" in report.violations[0].detail


@pytest.mark.parametrize(("slots", "problem"), [(2, "3 holders of 2 slots"), (3, "holders of slot counts [2, 3]")])
def test_more_holders_than_slots_or_two_counts_at_once(slots: int, problem: str) -> None:
    s = Story()
    s.acquire("pool-0", 1, "w0-1", 0.0, slots=2)
    s.acquire("pool-0", 1, "w1-1", 0.1, w=1, slots=2, slot=2)
    s.acquire("pool-0", 2, "w2-1", 0.2, w=2, slots=slots, slot=3)
    s.crash_and_probe()
    report = s.check()
    assert kinds(report) == {"exclusion", "exclusion-db"}
    assert problem in report.violations[0].detail


def test_a_replace_that_takes_a_lease_over_and_a_force_release_end_the_old_grant() -> None:
    s = Story()
    s.acquire("job-0", 1, "w0-1", 0.0, replace=True)
    s.acquire("job-0", 2, "w1-1", 0.5, w=1, replace=True, replaced=1)  # a later run takes it over
    s.force_release("job-0", 0.8)  # token 3: nobody's
    s.acquire("job-0", 4, "w2-1", 1.0, w=2)
    s.crash_and_probe()
    assert s.check().violations == []
    s.acquire("job-0", 5, "w3-1", 1.5, w=3)  # token 4 is valid until 3.0
    assert kinds(s.check()) == {"overlap", "overlap-db"}


def test_a_grant_under_a_new_slot_count_below_a_token_of_the_old_count() -> None:
    """Issue 38, defect 3's cause: slot 3 is granted for the first time with token 1."""
    s = Story()
    s.acquire("pool-0", 5, "w0-1", 0.0, slots=2)
    s.release("pool-0", 5, "w0-1", 0.2)
    s.acquire("pool-0", 6, "w1-1", 0.5, w=1, slots=3)
    s.acquire("pool-0", 1, "w2-1", 0.6, w=2, slots=3, slot=3)
    s.crash_and_probe()
    report = s.check()
    assert kinds(report) == {"count-token-order"}
    assert "pool-0#3 token 1" in report.violations[0].detail


def test_a_zombie_of_a_dropped_slot_published_after_the_new_count_did() -> None:
    """Issue 38, defect 3: slot 2 of 2 frozen past its TTL, the count lowered to 1, the new holder
    publishes, the zombie wakes and publishes under its slot's key, which nobody was granted since."""
    s = Story()
    s.acquire("pool-0", 1, "w0-1", 0.0, slots=2, slot=2)  # expires at 2.0
    s.acquire("pool-0", 7, "w1-1", 2.5, w=1)  # one holder
    s.publish("target-9", 7, "w1-1", 2.6, w=1, key="pool-0")
    s.crash_and_probe()
    assert s.check().violations == []
    s.publish("target-9", 1, "w0-1", 2.7, key="pool-0#2")  # the zombie wakes
    report = s.check()
    assert kinds(report) == {"superseded-publish"}
    assert "pool-0#2 token 1 of w0-1 (slots=2) (count era 0)" in report.violations[0].detail


def test_a_refused_publish_is_justified_by_a_newer_count_or_a_newer_grant_of_its_slot() -> None:
    s = Story()
    s.acquire("pool-0", 1, "w0-1", 0.0, slots=2, slot=2)
    s.acquire("pool-0", 7, "w1-1", 2.5, w=1)
    s.publish("target-9", 7, "w1-1", 2.6, w=1, key="pool-0")
    refused = {"resource": "target-9", "current": None, "key": "pool-0#2", "token": 1, "owner": "w0-1"}
    s.op("publish", 0, 2.7, outcome="stale", **refused)  # the count changed and its holder published
    s.op("publish", 0, 2.8, outcome="superseded", **refused)
    s.crash_and_probe()
    assert s.check().violations == []
    s.acquire("pool-0", 8, "w2-1", 5.0, w=2, slots=2)
    s.op("publish", 2, 5.1, outcome="superseded", resource="target-9", current=7, key="pool-0", token=8,
         owner="w2-1")  # the newest grant of its row, in the newest count: nothing superseded it
    assert kinds(s.check()) == {"valid-refused"}


def test_a_refusal_by_count_epoch_is_justified_by_a_later_holding_period_of_the_key() -> None:
    """The store's count epoch (migration 15): a grant after a time with no holder of its count starts a
    holding period above every earlier token; the fence refuses tokens at or below a published one."""
    s = Story()
    s.acquire("pool-0", 1, "w0-1", 0.0, slots=2, slot=2)  # lapses at 2.0
    s.acquire("pool-0", 2, "w1-1", 2.5, w=1, slots=2, epoch=1)  # the same count, a new holding period
    s.publish("target-9", 2, "w1-1", 2.6, w=1, key="pool-0")
    s.op("publish", 0, 2.7, outcome="count_epoch", resource="target-9", current=None, key="pool-0#2", token=1,
         owner="w0-1")
    s.crash_and_probe()
    assert s.check().violations == []
    s.acquire("pool-0", 3, "w2-1", 2.7, w=2, slots=2, slot=2, epoch=1)  # the period's second holder
    s.op("publish", 2, 2.8, outcome="count_epoch", resource="target-9", current=2, key="pool-0#2", token=3,
         owner="w2-1")  # a holder of the newest period, refused: nothing is above it
    assert kinds(s.check()) == {"valid-refused"}


# -- HTTP workers (issue 41): their publishes are the fence's audit, and a resent acquire is granted once ----


def test_an_http_workers_publishes_are_read_from_the_fence_audit() -> None:
    """An HTTP worker publishes through /fence: no target row, only the fence's committed advance. A stale
    advance of its grant after a newer direct publish is a fence-order violation; an accepted /fence the
    fence never committed is a lost acknowledgement; a clean one passes."""
    s = Story()
    s.records[0]["http_workers"] = [1]
    s.acquire("job-0", 1, "w1-1", 0.0, w=1)
    s.op("publish", 1, 0.2, outcome="accepted", resource="target-0", key="job-0", token=1, owner="w1-1", http=True)
    s.records.append({"type": "audit_fence", "id": s._id(), "at": at(0.2), "resource": "target-0", "key": "job-0",
                      "token": 1, "owner": "w1-1", "old_token": None})
    s.release("job-0", 1, "w1-1", 0.4, w=1)
    s.acquire("job-0", 2, "w0-1", 0.5, w=0)
    s.publish("target-0", 2, "w0-1", 0.6, w=0, key="job-0")
    s.crash_and_probe()
    clean_report = s.check()
    assert clean_report.violations == [], clean_report.format()
    s.records.append({"type": "audit_fence", "id": s._id(), "at": at(0.8), "resource": "target-0", "key": "job-0",
                      "token": 1, "owner": "w1-1", "old_token": 2})
    s.op("publish", 1, 0.9, outcome="accepted", resource="target-0", key="job-0", token=5, owner="w1-1", http=True)
    assert {"fence-order", "lost-ack"} <= kinds(s.check())


def test_an_http_acquire_granted_twice() -> None:
    """An HTTP worker's owner granted a second slot while its first grant, whose capability the API bound,
    was live: a resend granted again. A second grant once the first ended is not."""
    s = Story()
    s.records[0]["http_workers"] = [1]
    s.acquire("pool-0", 1, "w1-1", 0.0, w=1, slots=2, slot=1)
    bound = next(r for r in reversed(s.records) if r["type"] == "audit_lease")
    bound["extra"] = {**bound["extra"], "api_capability": "\\x00"}
    s.acquire("pool-0", 1, "w1-1", 0.5, w=1, slots=2, slot=2)
    assert "api-granted-twice" in kinds(s.check())
    later = Story()
    later.records[0]["http_workers"] = [1]
    later.acquire("pool-0", 1, "w1-1", 0.0, w=1, slots=2, slot=1)
    bound = next(r for r in reversed(later.records) if r["type"] == "audit_lease")
    bound["extra"] = {**bound["extra"], "api_capability": "\\x00"}
    later.acquire("pool-0", 1, "w1-1", TTL + 0.5, w=1, slots=2, slot=2)
    assert "api-granted-twice" not in kinds(later.check())


# -- waiting places (chaos.waiting) ----------------------------------------------------------------------


class Waits:
    """Waiting-place operations as a worker records them; times in seconds from T0 (database) and from 0
    (the host's monotonic clock: the same numbers here)."""

    def __init__(self, story: Story, limit: int = 1) -> None:
        self.s = story
        self.limit = limit
        self.places: dict[tuple[str, str], float] = {}  # (key, owner) -> since

    def claim(self, owner: str, t: float, w: int, *, key: str = "job-0", listed: list[str] | None = None,
              outcome: str = "claimed", since: float | None = None, **shape: Any) -> None:
        """A claim answered at database time ``t`` (its place's ``since`` kept, or ``since``: a new place)."""
        fields: dict[str, Any] = {}
        if outcome == "claimed":
            start = self.places.setdefault((key, owner), t) if since is None else since
            self.places[(key, owner)] = start
            fields = {"since": at(start), "expires_at": at(t + TTL)}
        if outcome in ("claimed", "full"):
            fields["waiters"] = [(o, at(0), at(t + TTL)) for o in (listed if listed is not None else [owner])]
        self.s.op("wait_claim", w, t, key=key, owner=owner, max_waiting=self.limit, ttl=TTL, outcome=outcome,
                  **fields, **shape)

    def release(self, owner: str, t: float, w: int, *, key: str = "job-0", outcome: str = "ok",
                forged: bool = False) -> None:
        self.s.op("wait_release", w, t, key=key, owner=owner, forged=forged, outcome=outcome)
        if outcome == "ok" and not forged:
            self.places.pop((key, owner), None)

    def probe(self, listed: list[tuple[str, str, float]], when: float = 50.0) -> None:
        self.s.records.append({"type": "probe_waiters", "t": when, "db_before": at(when), "db_after": at(when),
                               "waiters": [(k, o, at(since), at(since + TTL)) for k, o, since in listed]})


def waits_story() -> tuple[Story, Waits]:
    """w0 holds job-0's one place (claimed at 0, kept at 0.5, given back at 0.7); w1 is refused meanwhile,
    then takes the place at 1.0 and lets it lapse (it acquires something else next)."""
    s = Story()
    waits = Waits(s)
    waits.claim("w0-1", 0.0, 0)
    waits.claim("w1-1", 0.2, 1, outcome="full", listed=["w0-1"])
    waits.claim("w0-1", 0.5, 0)
    waits.release("w0-1", 0.7, 0)
    waits.claim("w1-1", 1.0, 1)
    s.acquire("job-0", 1, "w1-2", 1.2, w=1)
    s.crash_and_probe()
    waits.probe([])
    return s, waits


def test_waiting_places_within_the_limit_pass() -> None:
    s, _ = waits_story()
    report = s.check()
    assert report.violations == [], report.format()
    assert report.figures["waiting places: taken (distinct places acknowledged)"] == 2
    assert report.figures["waiting places: lapsed (left by their waiter, not given back)"] == 1


def test_a_claim_answered_with_more_live_waiters_than_max_waiting() -> None:
    s, waits = waits_story()
    waits.claim("w2-1", 1.5, 2, listed=["w1-1", "w2-1"])
    assert kinds(s.check()) == {"wait-over-max"}


def test_more_places_proven_live_than_max_waiting_even_when_each_answer_lists_one() -> None:
    """Each claim lists only its own place (a store that lies in its listings too), but w1's place lapses
    at 3.0 (proven: w1 went on to an acquire) while w2's was taken at 1.5: two places at once for one."""
    s, waits = waits_story()
    waits.claim("w2-1", 1.5, 2)
    report = s.check()
    assert kinds(report) == {"wait-over-max"}, report.format()
    assert "proven live" in report.violations[0].detail


def test_a_place_whose_end_is_unknown_counts_until_its_last_claim_only() -> None:
    """w1's worker records nothing after its claim at 1.0 (killed, maybe while giving it back): its place
    is proven live at 1.0 only, so w2's place from 1.5 is no violation (no rule on an unknown end)."""
    s = Story()
    waits = Waits(s)
    waits.claim("w1-1", 1.0, 1)
    waits.claim("w2-1", 1.5, 2)
    s.crash_and_probe()
    assert s.check().violations == []
    waits.claim("w1-1", 1.6, 1)  # but a later claim proves it live at 1.6, beside w2's
    assert kinds(s.check()) == {"wait-over-max"}


def test_a_forged_give_back_that_was_done_or_that_lost_the_place() -> None:
    s, waits = waits_story()
    waits.release("w1-1", 1.2, 1, forged=True, outcome="ok")
    assert kinds(s.check()) == {"wait-forged-release"}
    s, waits = waits_story()
    waits.claim("w2-1", 5.0, 2)
    waits.release("w2-1", 5.2, 2, forged=True, outcome="refused")
    waits.claim("w2-1", 5.4, 2, after_forged=True)  # found: the same place, kept
    waits.release("w2-1", 5.6, 2)
    assert s.check().violations == []
    s, waits = waits_story()
    waits.claim("w2-1", 5.0, 2)
    waits.release("w2-1", 5.2, 2, forged=True, outcome="refused")
    waits.claim("w2-1", 5.4, 2, after_forged=True, since=5.4)  # a new place: the refused give-back removed it
    waits.release("w2-1", 5.6, 2)
    assert kinds(s.check()) == {"wait-forged-release"}


def test_a_place_renewed_after_it_was_given_back_or_had_lapsed() -> None:
    s, waits = waits_story()
    waits.claim("w0-1", 5.0, 0, since=0.0)  # the place given back at 0.7, renewed
    assert "wait-renewed-after-end" in kinds(s.check())
    s, waits = waits_story()
    waits.claim("w1-1", 5.0, 1, since=1.0)  # expired at 3.0, renewed 2 s later (statement timeout 1 s)
    assert "wait-renewed-after-end" in kinds(s.check())
    s, waits = waits_story()
    waits.claim("w1-1", 3.5, 1, since=1.0)  # 0.5 s after its expiry: within what one claim may take
    assert "wait-renewed-after-end" not in kinds(s.check())


def test_the_final_listing_of_waiters_is_held_to_the_history() -> None:
    s, waits = waits_story()
    s.records[-1]["waiters"] = [("job-0", "w0-1", at(0.0), at(2.5))]  # given back at 0.7
    assert kinds(s.check()) == {"wait-probe"}
    s, waits = waits_story()
    s.records[-1]["waiters"] = [("job-0", "w5-3", at(1.0), at(3.0))]  # never claimed by anyone
    s.op("acquire", 5, 2.0, key="job-1", owner="w5-4", outcome="held", asked=1)  # w5 went on to iteration 4
    assert kinds(s.check()) == {"wait-probe"}
    s.records.pop()  # w5's last iteration was 3: its claim may have been in flight at the crash
    assert s.check().violations == []
    s = Story()
    waits = Waits(s)
    waits.claim("w1-1", 47.0, 1)
    waits.claim("w1-1", 49.0, 1)  # kept until 51, after the listing at 50
    s.acquire("job-0", 1, "w1-2", 49.2, w=1)  # and w1 moved on: proven live at the listing
    s.crash_and_probe()
    waits.probe([])
    assert kinds(s.check()) == {"wait-probe"}
    s.records[-1]["waiters"] = [("job-0", "w1-1", at(47.0), at(51.0))]
    assert s.check().violations == []
