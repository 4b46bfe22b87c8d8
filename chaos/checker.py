"""The checker: reads a history and reports violations of the store's promises, and its figures.

Safety, from what the workers saw (acknowledged operations) and from the ground truth the database
committed (the audit triggers and the publish target):

``token-reissued``      a token was acknowledged twice for one key, or a key's row was created twice
``token-order``         for one key, a larger token was granted earlier (database time) than a smaller one
``token-regressed``     a lease or fence row's token went down
``overlap``             for one key, a lease was granted to another owner while an acknowledged one was
                        still valid (database time); ``overlap-db``: the same, in the committed rows
``fence-order``         for one resource and lease key, the target accepted a token not larger than one of
                        that key it accepted before (a fence is per (resource, lease key))
``stale-check``         a keeper's ``check()`` passed although, by the database clock read just before it,
                        the lease had already ended (expired or released): a keeper that counts its deadline
                        from the wrong moment
``valid-refused``       a publish was refused as stale although the fence never accepted a token at least as
                        large of the same lease key: a fence that compares tokens of different keys
``publish-not-holder``  an accepted publish carried a token that was never granted to its owner
``duplicate-publish``   one idempotency key, or one token, was published twice to a resource
``lost-ack``            an acknowledged acquire, renewal, release or publish is missing from what the
                        database committed (after a SIGKILL of the server: a durability bug)
``unexpected-error``    an operation failed with an error other than the documented ones, or a worker died
``api-granted-twice``   an acquire through the lease API (HTTP workers: one request id per owner, sent again
                        once after a lost answer) was granted twice: a grant of the owner whose capability
                        was bound was still live when the owner was granted again (a resend must answer the
                        grant the first send made)
``wait-over-max``, ``wait-forged-release``, ``wait-renewed-after-end``, ``wait-probe``
                        waiting places (``wait_claim`` / ``wait_release``): see :mod:`chaos.waiting`
``recovery``            after the faults stopped and every worker crashed at once, a fresh client did
                        not acquire a key (and publish) within TTL + 1 s

Where several grants of one key may coexist (semaphore slots, single holders, replaces, slot-count
changes; see :mod:`chaos.exclusion`):

``exclusion``           a grant the workers were told of joined live grants of its key against the rule
                        (one single holder, or up to N holders of one count N); ``exclusion-db``: the same,
                        in the committed rows
``count-token-order``   a grant under a new slot count did not carry a larger fencing order than every
                        grant of its key before the change
``superseded-publish``  a grant of an earlier slot-count era published to a resource after a grant of a
                        later era of its key had (commit order): a zombie of a dropped slot let through

The HTTP workers (``meta.http_workers``) publish through the lease API's ``/fence``, which advances the
fence of the store's own schema without a target row: what it committed is the fence's audit, and each
accepted advance of an HTTP worker's grant is read as that worker's target row (``via: api``), so that
every publish property above holds for them too, mixed with the direct workers' publishes on the same
(resource, lease key).

Exit status: 0 when clean, 1 on any violation, 2 when clean but the run was too small to count
(fewer operations than the profile requires, or a fault kind that never happened).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from chaos import exclusion, history, waiting

#: Fault kinds and the profile field that schedules them (plus ``clock_skew``, set by ``skewed``).
FAULT_SCHEDULE = {
    "sigstop": "zombie_every", "terminate": "terminate_every", "kill9": "kill_every", "stmt_timeout": "lock_every",
    "force_release": "force_every",
    # The lease API server's (profiles with HTTP workers): paused, killed and restarted, a window of lost replies.
    "api_pause": "api_pause_every", "api_kill": "api_kill_every", "lossy_api": "lossy_every",
}
FAULT_KINDS = (*FAULT_SCHEDULE, "clock_skew")
_OWNER_RE = re.compile(r"^w(\d+)-\d+$")
#: How many violations of each kind are printed (all are counted).
SHOWN = 5


def when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


@dataclass
class Violation:
    kind: str
    detail: str


@dataclass
class Report:
    operations: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    coverage: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    recovery: dict[str, Any] = field(default_factory=dict)

    def violate(self, kind: str, detail: str) -> None:
        self.violations.append(Violation(kind, detail))

    @property
    def status(self) -> int:
        if self.violations:
            return 1
        return 2 if self.coverage else 0

    def violation_counts(self) -> dict[str, int]:
        return dict(Counter(v.kind for v in self.violations))

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "operations": sum(self.operations.values()),
            "operations_by_kind": dict(self.operations),
            "outcomes": {f"{op}:{outcome}": n for (op, outcome), n in sorted(self.outcomes.items())},
            "faults": dict(self.faults),
            "violations": self.violation_counts(),
            "violation_examples": [v.__dict__ for v in self.violations[:50]],
            "coverage": self.coverage,
            "figures": self.figures,
            "recovery": self.recovery,
        }

    def format(self) -> str:
        lines = [f"operations: {sum(self.operations.values())}"]
        for op, n in sorted(self.operations.items()):
            detail = ", ".join(f"{o} {c}" for (p, o), c in sorted(self.outcomes.items()) if p == op)
            lines.append(f"  {op:<8} {n:>7}  ({detail})")
        lines.append("faults:")
        lines.extend(f"  {kind:<13} {n:>5}" for kind, n in sorted(self.faults.items()))
        lines.append("figures:")
        lines.extend(f"  {name}: {value}" for name, value in self.figures.items())
        lines.append("recovery:")
        lines.extend(f"  {name}: {value}" for name, value in self.recovery.items())
        counts = self.violation_counts()
        lines.append(f"violations: {len(self.violations)}" + (f" {counts}" if counts else ""))
        shown: Counter[str] = Counter()
        for violation in self.violations:
            shown[violation.kind] += 1
            if shown[violation.kind] <= SHOWN:
                lines.append(f"  [{violation.kind}] {violation.detail}")
        for problem in self.coverage:
            lines.append(f"coverage: {problem}")
        lines.append({0: "RESULT: OK", 1: "RESULT: VIOLATIONS", 2: "RESULT: INCONCLUSIVE"}[self.status])
        return "\n".join(lines)


def _summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"n={len(values)} median={statistics.median(values):.2f}s max={max(values):.2f}s"
    )


@dataclass
class Lease:
    """A lease as the workers acknowledged it."""

    key: str
    token: int
    owner: str
    worker: int
    acquired_at: datetime
    expires_max: datetime
    last_seen: datetime
    release_attempted: bool = False
    #: Whether the committed history (the audit) is at hand, and when it says the release committed.
    audited: bool = False
    released_at: datetime | None = None
    #: The grant's shape: its slot count (1 for a single holder or a replace), whether it is a replace, and
    #: the key that was acquired (a semaphore's key for a slot row).
    slots: int = 1
    replace: bool = False
    base: str = ""
    #: When it ended without its holder's doing: a force-release, or a replace taking it over.
    cut_at: datetime | None = None

    @property
    def held_until(self) -> datetime:
        """Until when the lease was surely valid, by the database clock (never later than it really was).

        The last acknowledged expiry; or, when it was released, the committed release time (a release can
        commit and still be reported refused: ``Database.run`` resends it once when the reply is lost); or,
        when a release was sent but no history of the commit is at hand, the last moment the database
        confirmed the lease.
        """
        if self.released_at is not None:
            return min(self.released_at, self.expires_max)
        return self.last_seen if self.release_attempted and not self.audited else self.expires_max

    @property
    def valid_until(self) -> datetime:
        """:attr:`held_until`, or earlier when the lease was force-released or taken over by a replace (which
        its holder only learns at its next renewal or check of the store)."""
        return self.held_until if self.cut_at is None else min(self.held_until, self.cut_at)

    def grant(self) -> exclusion.Grant:
        return exclusion.Grant(
            base=self.base or self.key, row=self.key, token=self.token, owner=self.owner, slots=self.slots,
            kind=exclusion.kind_of(self.slots, self.replace), start=self.acquired_at, end=self.valid_until,
        )


class Checker:
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        self.by_type: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for record in records:
            self.by_type[record.get("type", "?")].append(record)
        meta = self.by_type["meta"]
        self.meta = meta[0] if meta else {}
        self.ttl = float(self.meta.get("ttl", 0) or 0)
        self.resources: dict[str, Any] = self.meta.get("resources", {})
        self.ops = self.by_type["op"]
        self.report = Report()
        self.http_workers = {int(w) for w in self.meta.get("http_workers") or ()}
        if self.http_workers:
            self.by_type["target"] = [*self.by_type["target"], *self._api_publishes()]
        #: Every grant the database committed, with when it ended and its slot-count era.
        self.grants = exclusion.committed_grants(self.by_type["audit_lease"])

    def _http_owner(self, owner: str | None) -> int | None:
        """The HTTP worker an owner belongs to (``w<N>-<iteration>``), or None."""
        match = _OWNER_RE.match(owner or "")
        worker = int(match.group(1)) if match else None
        return worker if worker in self.http_workers else None

    def _api_publishes(self) -> list[dict[str, Any]]:
        """The publishes the HTTP workers made through ``/fence``: the fence's committed advances of their
        grants, as target rows."""
        return [
            {"type": "target", "id": row["id"], "resource": row["resource"], "key": row["key"], "token": row["token"],
             "owner": row["owner"], "worker": worker, "idem": None, "at": row["at"],
             "committed_at": row.get("committed_at"), "via": "api"}
            for row in self.by_type["audit_fence"]
            if (worker := self._http_owner(row.get("owner"))) is not None
        ]

    # -- entry point -------------------------------------------------------------------------------

    def check(self) -> Report:
        self._count()
        leases = self._client_leases()
        self._client_tokens(leases)
        self._client_overlap(leases)
        owners = self._audit()
        self._acks_committed()
        self._fence(owners, leases)
        self._stale_checks(leases)
        self._exclusion(leases)
        self._valid_refused()
        self._api_granted_twice()
        self._waiting()
        self._errors()
        self._probe()
        self._figures()
        self._coverage()
        return self.report

    # -- counting ----------------------------------------------------------------------------------

    def _count(self) -> None:
        r = self.report
        for op in self.ops:
            r.operations[op["op"]] += 1
            r.outcomes[(op["op"], op.get("outcome", "?"))] += 1
        for fault in self.by_type["fault"]:
            kind = fault["kind"]
            if fault.get("skipped"):
                r.faults[kind + "_skipped"] += 1
            elif kind == "terminate":
                r.faults["terminate"] += int(fault.get("killed", 0))
            else:
                r.faults[kind] += 1

    # -- what the workers saw ------------------------------------------------------------------------

    def _client_leases(self) -> dict[tuple[str, int], list[Lease]]:
        leases: dict[tuple[str, int], list[Lease]] = defaultdict(list)
        taken: dict[tuple[str, int, str], datetime | None] = {}  # what the replaces said they took over
        for op in self.ops:
            if op["op"] in ("acquire", "replace") and op.get("outcome") == "ok":
                leases[(op["key"], int(op["token"]))].append(Lease(
                    op["key"], int(op["token"]), op["owner"], int(op["w"]), when(op["acquired_at"]),
                    when(op["expires_at"]), when(op["observed_at"]), slots=int(op.get("slots") or 1),
                    replace=op["op"] == "replace", base=op.get("lease_key") or op["key"],
                ))
                if op.get("replaced_token") is not None:
                    taken[(op["key"], int(op["replaced_token"]), op["replaced_owner"])] = when(op["acquired_at"])
        for op in self.ops:
            if op["op"] not in ("renew", "release") or "token" not in op:
                continue
            for lease in leases.get((op["key"], int(op["token"])), []):
                if lease.owner != op["owner"]:
                    continue
                if op["op"] == "renew" and op.get("outcome") == "ok":
                    lease.expires_max = max(lease.expires_max, when(op["expires_at"]))
                    lease.last_seen = max(lease.last_seen, when(op["observed_at"]))
                elif op["op"] == "release":
                    lease.release_attempted = True
        # With the audit at hand, a release is known exactly: committed (and when), or not at all; and so
        # is a force-release or a takeover that ended a lease early.
        audit = self.by_type["audit_lease"]
        released = {
            (r["key"], int(r["token"]), r["owner"]): when(r["released_at"])
            for r in audit if r["released_at"] is not None
        }
        cuts: dict[tuple[str, int, str], datetime | None] = {**taken, **exclusion.cut_short(audit)}
        for acks in leases.values():
            for lease in acks:
                lease.audited = bool(audit)
                lease.released_at = released.get((lease.key, lease.token, lease.owner))
                lease.cut_at = cuts.get((lease.key, lease.token, lease.owner))
        return leases

    def _client_tokens(self, leases: dict[tuple[str, int], list[Lease]]) -> None:
        for (key, token), acks in leases.items():
            if len(acks) > 1:
                self.report.violate(
                    "token-reissued",
                    f"{key}: token {token} acknowledged {len(acks)} times, to {[a.owner for a in acks]}",
                )
        by_key: dict[str, list[Lease]] = defaultdict(list)
        for acks in leases.values():
            by_key[acks[0].key].append(acks[0])
        for key, items in by_key.items():
            items.sort(key=lambda lease: (lease.acquired_at, lease.token))
            for earlier, later in zip(items, items[1:], strict=False):
                if later.token <= earlier.token:
                    self.report.violate(
                        "token-order",
                        f"{key}: token {later.token} granted at {later.acquired_at} after token "
                        f"{earlier.token} at {earlier.acquired_at}",
                    )

    def _client_overlap(self, leases: dict[tuple[str, int], list[Lease]]) -> None:
        by_key: dict[str, list[Lease]] = defaultdict(list)
        for acks in leases.values():
            by_key[acks[0].key].extend(acks)
        for key, items in by_key.items():
            items.sort(key=lambda lease: lease.token)
            latest: Lease | None = None  # the earlier lease valid the longest
            for lease in items:
                if latest is not None and latest.owner != lease.owner and lease.acquired_at < latest.valid_until:
                    self.report.violate(
                        "overlap",
                        f"{key}: token {lease.token} granted to {lease.owner} at {lease.acquired_at}, while "
                        f"token {latest.token} of {latest.owner} was valid until {latest.valid_until} "
                        f"({(latest.valid_until - lease.acquired_at).total_seconds():.3f}s of overlap)",
                    )
                if latest is None or lease.valid_until > latest.valid_until:
                    latest = lease

    # -- what the database committed -------------------------------------------------------------------

    def _audit(self) -> dict[str, dict[int, str]]:
        """Checks the committed lease rows; returns key -> token -> the owner it was granted to."""
        owners: dict[str, dict[int, str]] = defaultdict(dict)
        rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in self.by_type["audit_lease"]:
            rows[row["key"]].append(row)
        for key, changes in rows.items():
            changes.sort(key=lambda row: (when(row["at"]), row["id"]))
            top = 0
            for row in changes:
                token = int(row["token"])
                if row["op"] == "INSERT" and top:
                    self.report.violate("token-reissued", f"{key}: row created again with token {token}")
                if token < top:
                    self.report.violate("token-regressed", f"{key}: token went from {top} to {token}")
                if token > top:
                    owners[key][token] = row["owner"]
                    # A replace that took the lease over (replaced_token: the token it took) ends the old
                    # grant as it starts its own: not an overlap.
                    takeover = row.get("replaced_token") is not None and row["replaced_token"] == row["old_token"]
                    old_valid = (
                        row["op"] == "UPDATE" and row["old_released_at"] is None
                        and row["released_at"] is None and not takeover
                        and when(row["old_expires_at"]) > when(row["acquired_at"])
                    )
                    if old_valid and row["old_owner"] != row["owner"]:
                        self.report.violate(
                            "overlap-db",
                            f"{key}: token {token} granted to {row['owner']} at {row['acquired_at']} while token "
                            f"{row['old_token']} of {row['old_owner']} was valid until {row['old_expires_at']}",
                        )
                top = max(top, token)
        return owners

    def _acks_committed(self) -> None:
        audit = self.by_type["audit_lease"]
        if not audit:
            self.report.coverage.append("no audit rows: the committed state could not be checked")
            return
        granted = {(r["key"], int(r["token"]), r["owner"], when(r["acquired_at"])) for r in audit}
        renewed = {(r["key"], int(r["token"]), when(r["renewed_at"])) for r in audit}
        released = {(r["key"], int(r["token"]), r["owner"]) for r in audit if r["released_at"] is not None}
        published = {(r["resource"], int(r["token"]), r["owner"]) for r in self.by_type["target"]}
        for op in self.ops:
            kind, outcome = op["op"], op.get("outcome")
            missing = None
            if kind in ("acquire", "replace") and outcome == "ok":
                if (op["key"], int(op["token"]), op["owner"], when(op["acquired_at"])) not in granted:
                    missing = f"{kind} of {op['key']} token {op['token']} by {op['owner']}"
            elif kind == "renew" and outcome == "ok":
                if (op["key"], int(op["token"]), when(op["renewed_at"])) not in renewed:
                    missing = f"renewal of {op['key']} token {op['token']} at {op['renewed_at']}"
            elif kind == "release" and outcome == "ok":
                if (op["key"], int(op["token"]), op["owner"]) not in released:
                    missing = f"release of {op['key']} token {op['token']}"
            elif kind == "publish" and outcome == "accepted":
                if (op["resource"], int(op["token"]), op["owner"]) not in published:
                    missing = f"publish to {op['resource']} with token {op['token']} at {op.get('at', '(through the lease API)')}"
            if missing:
                self.report.violate("lost-ack", f"acknowledged {missing}, but not in the committed state")

    def _fence(self, owners: dict[str, dict[int, str]], leases: dict[tuple[str, int], list[Lease]]) -> None:
        fence_rows: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for row in self.by_type["audit_fence"]:
            fence_rows[(row["resource"], row.get("key", ""))].append(row)
        for resource, changes in fence_rows.items():
            changes.sort(key=lambda row: (when(row["at"]), row["id"]))
            top = 0
            for row in changes:
                if int(row["token"]) <= top:
                    self.report.violate(
                        "token-regressed", f"fence {resource}: accepted token {row['token']} after {top}"
                    )
                top = max(top, int(row["token"]))
        targets: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        idems: Counter[tuple[str, str]] = Counter()
        tokens: Counter[tuple[str, str, int]] = Counter()
        for row in self.by_type["target"]:
            key = self._key_of(row)
            targets[(row["resource"], key)].append(row)
            tokens[(row["resource"], key, int(row["token"]))] += 1
            if row.get("idem"):
                idems[(row["resource"], row["idem"])] += 1
        for (resource, idem), n in idems.items():
            if n > 1:
                self.report.violate("duplicate-publish", f"{resource}: idempotency key {idem!r} published {n} times")
        for (resource, key, token), n in tokens.items():
            if n > 1:
                self.report.violate("duplicate-publish", f"{resource}: token {token} of {key} published {n} times")
        for (resource, key), rows in targets.items():
            rows.sort(key=lambda row: (when(row["at"]), row["id"]))
            top: dict[str, Any] | None = None
            for row in rows:
                token = int(row["token"])
                if top is not None and token <= int(top["token"]):
                    self.report.violate(
                        "fence-order",
                        f"{resource} ({key}): accepted token {token} from {row['owner']} at {row['at']} after "
                        f"token {top['token']} from {top['owner']} at {top['at']}",
                    )
                if top is None or token > int(top["token"]):
                    top = row
                granted_to = owners.get(key, {}).get(token)
                if granted_to is None:
                    acks = leases.get((key, token))
                    granted_to = acks[0].owner if acks else None
                if granted_to is None:
                    self.report.violate(
                        "publish-not-holder", f"{resource}: token {token} published by {row['owner']} was never granted"
                    )
                elif granted_to != row["owner"] or not row["owner"].startswith(f"w{row['worker']}-"):
                    self.report.violate(
                        "publish-not-holder",
                        f"{resource}: token {token} published by {row['owner']} (worker {row['worker']}) "
                        f"was granted to {granted_to}",
                    )

    def _key_of(self, row: dict[str, Any]) -> str:
        """The lease key a target row was published under (histories before per-key fences: the one key
        of its resource)."""
        if row.get("key"):
            return str(row["key"])
        mapped = self.resources.get(row["resource"], row["resource"])
        return mapped if isinstance(mapped, str) else str(row["resource"])

    def _stale_checks(self, leases: dict[tuple[str, int], list[Lease]]) -> None:
        for op in self.ops:
            if op["op"] != "check" or op.get("outcome") != "held" or not op.get("db_before"):
                continue
            before = when(op["db_before"])
            for lease in leases.get((op["key"], int(op["token"])), []):
                if lease.owner == op["owner"] and before is not None and before >= lease.held_until:
                    self.report.violate(
                        "stale-check",
                        f"w{op['w']} {op['key']} token {op['token']}: keeper.check() passed after "
                        f"{op['db_before']} (database clock), but the lease ended at {lease.held_until} "
                        f"({(before - lease.held_until).total_seconds():.3f}s before; keeper started "
                        f"{op.get('start', '?')})",
                    )

    def _exclusion(self, leases: dict[tuple[str, int], list[Lease]]) -> None:
        violate = self.report.violate
        exclusion.check_exclusion([lease.grant() for acks in leases.values() for lease in acks], violate, "exclusion")
        exclusion.check_exclusion(self.grants, violate, "exclusion-db")
        exclusion.check_count_tokens(self.grants, violate)
        exclusion.check_superseded_publishes(self.grants, self.by_type["target"], violate)

    def _valid_refused(self) -> None:
        """A refused publish must have had a reason: the fence accepted a token at least as large of its own
        lease key, or a grant of a later slot-count era of its key, or one whose count epoch (the token
        floor of a later holding period of its key) is at least its token; a refusal by the fence in the
        lease store (``superseded``, ``count_epoch``) also when its row was granted past it, or its key was
        granted since under another count or in a holding period above its token."""
        # Only what the fence accepted while the workers ran: the probe publishes after they all crashed.
        crashes = self.by_type["crash_all"]
        crashed = when(crashes[0].get("db_time")) if crashes else None
        top: dict[tuple[str, str], int] = {}
        fenced = []
        for row in self.by_type["audit_fence"]:
            if crashed is not None and when(row["at"]) >= crashed:
                continue
            fenced.append(row)
            ident = (row["resource"], row.get("key", ""))
            top[ident] = max(top.get(ident, 0), int(row["token"]))
        if not self.by_type["audit_fence"] and not self.by_type["audit_lease"]:
            return  # no ground truth at hand
        later_era = exclusion.later_era_published(self.grants, fenced)
        grants = {(g.row, g.token): g for g in self.grants}
        row_top: dict[str, int] = {}
        last_era: dict[str, int] = {}
        top_epoch: dict[str, int] = {}
        for g in self.grants:
            row_top[g.row] = max(row_top.get(g.row, 0), g.token)
            last_era[g.base] = max(last_era.get(g.base, 0), g.era)
            top_epoch[g.base] = max(top_epoch.get(g.base, 0), g.epoch)
        published_epoch: dict[tuple[str, str], int] = {}
        for row in fenced:
            g = grants.get((row.get("key", ""), int(row["token"])))
            if g is not None:
                ident = (row["resource"], g.base)
                published_epoch[ident] = max(published_epoch.get(ident, 0), g.epoch)
        for row in self.by_type["audit_lease"]:  # a force-release moves the row's token too
            row_top[row["key"]] = max(row_top.get(row["key"], 0), int(row["token"]))
        for op in self.ops:
            outcome = op.get("outcome")
            refusals = ("stale", "superseded", "count_epoch", "other_store")
            if op["op"] != "publish" or outcome not in refusals or "key" not in op:
                continue
            token = int(op["token"])
            accepted = top.get((op["resource"], op["key"]), 0)
            if accepted >= token:
                continue
            grant = grants.get((op["key"], token))
            if grant is not None and (
                later_era.get((op["resource"], grant.base), -1) > grant.era
                or published_epoch.get((op["resource"], grant.base), 0) >= token
            ):
                continue
            if outcome in ("superseded", "count_epoch") and (
                row_top.get(op["key"], 0) > token
                or (grant is not None and (last_era[grant.base] > grant.era or top_epoch[grant.base] >= token))
            ):
                continue
            self.report.violate(
                "valid-refused",
                f"{op['resource']}: token {op['token']} of {op['key']} ({op['owner']}) refused as {outcome}, but "
                f"the fence never accepted a token of {op['key']} at least that large (largest: {accepted or 'none'}; "
                f"the fence reported {op.get('current')}), nor a grant of a later slot count of its key",
            )

    def _api_granted_twice(self) -> None:
        """An HTTP worker's owner asks once (one request id, sent at most twice): a second grant to it while
        a grant of it whose capability the API bound is still live means a resend was granted again."""
        bound = {
            (r["key"], int(r["token"]), r["owner"]) for r in self.by_type["audit_lease"]
            if (r.get("extra") or {}).get("api_capability") is not None
        }
        by_owner: dict[str, list[exclusion.Grant]] = defaultdict(list)
        for g in self.grants:
            if self._http_owner(g.owner) is not None:
                by_owner[g.owner].append(g)
        for owner, grants in by_owner.items():
            grants.sort(key=lambda g: (g.start, g.seq))
            for i, later in enumerate(grants):
                for earlier in grants[:i]:
                    if (earlier.row, earlier.token, owner) in bound and earlier.end > later.start:
                        self.report.violate(
                            "api-granted-twice",
                            f"{owner}: granted {later.row} token {later.token} at {later.start} while its grant "
                            f"{earlier.row} token {earlier.token} (capability bound) was live until {earlier.end}",
                        )

    def _waiting(self) -> None:
        """The waiting places' rules (chaos.waiting), and their figures."""
        timeout = float(self.meta.get("profile", {}).get("statement_timeout", 1.0) or 1.0)
        figures = waiting.check(self.ops, self.by_type["probe_waiters"], timeout, self.report.violate)
        if figures and self.http_workers:
            lost = Counter(str(f.get("path", "")).rsplit("/v1", 1)[-1] for f in self.by_type["fault"]
                           if f["kind"] == "lost_reply" and "/wait/" in str(f.get("path", "")))
            figures["waiting places: replies lost after the store answered (lease API)"] = dict(sorted(lost.items()))
            figures["waiting places: operations through the lease API with an unknown outcome"] = sum(
                1 for op in self.ops if op.get("http") and op["op"].startswith("wait_") and op.get("outcome") == "unknown")
        if figures:
            figures["waiting places: paused waiters, their next claim after waking"] = self._paused_waiters()
        self.report.figures.update(figures)

    def _paused_waiters(self) -> dict[str, int]:
        """What the waiters the nemesis paused (past the TTL) met at their first claim after waking."""
        outcomes: Counter[str] = Counter()
        wakes = [f for f in self.by_type["fault"] if f["kind"] == "sigcont"]
        for stop in self.by_type["fault"]:
            if stop["kind"] != "sigstop" or not stop.get("waiting"):
                continue
            woke = next((w["t"] for w in wakes if w["w"] == stop["w"] and w["t"] >= stop["t"]), None)
            mine = [op for op in self.ops if op["op"] == "wait_claim" and op["w"] == stop["w"]
                    and op["key"] == stop["waiting"]]
            before = [op for op in mine if op["t1"] <= stop["t"] and op.get("outcome") == "claimed"]
            after = [op for op in mine if woke is not None and op["t0"] >= woke]
            if not after or not before:
                outcomes["no claim after waking"] += 1
            elif after[0].get("outcome") != "claimed":
                outcomes[str(after[0].get("outcome"))] += 1
            else:
                same = after[0].get("since") == before[-1].get("since") and after[0]["owner"] == before[-1]["owner"]
                outcomes["claimed: the same place (not lapsed yet)" if same else "claimed: a new place"] += 1
        return dict(sorted(outcomes.items()))

    def _errors(self) -> None:
        for op in self.ops:
            if op.get("outcome") == "error":
                self.report.violate("unexpected-error", f"w{op.get('w')} {op['op']}: {op.get('error')}")
        for exit_ in self.by_type["worker_exit"]:
            self.report.violate(
                "unexpected-error", f"worker w{exit_['w']} died with exit code {exit_['code']} (see {exit_['log']})"
            )

    # -- liveness ----------------------------------------------------------------------------------

    def _probe(self) -> None:
        crashes = self.by_type["crash_all"]
        if not crashes:
            self.report.coverage.append("no final crash: recovery was not measured")
            return
        crashed = when(crashes[0].get("db_time"))
        limit = self.ttl + 1.0
        delays = {}
        for probe in self.by_type["probe"]:
            acquired = when(probe.get("acquired_at"))
            if acquired is None or crashed is None:
                self.report.violate("recovery", f"{probe['key']}: no fresh client acquired it after the crash")
                continue
            delay = (acquired - crashed).total_seconds()
            delays[probe["key"]] = round(delay, 3)
            if delay > limit:
                self.report.violate(
                    "recovery", f"{probe['key']}: acquired {delay:.2f}s after every holder crashed (limit {limit:.1f}s)"
                )
            if probe.get("publish") != "accepted":
                self.report.violate("recovery", f"{probe['key']}: the new holder could not publish: {probe.get('publish')}")
        self.report.recovery["new holder after all holders crashed"] = (
            f"max {max(delays.values()):.2f}s (limit TTL + 1 s = {limit:.1f}s) per key {delays}" if delays else "n/a"
        )

    def _figures(self) -> None:
        r = self.report
        answered = sorted(
            op["t1"] for op in self.ops if op.get("outcome") not in ("unknown", "error") and "t1" in op
        )
        acquired = sorted(op["t1"] for op in self.ops if op["op"] == "acquire" and op.get("outcome") == "ok")
        downtimes, first_answer, first_acquire = [], [], []
        for fault in self.by_type["fault"]:
            if fault["kind"] == "kill9" and not fault.get("skipped"):
                downtimes.append(float(fault["downtime_s"]))
                ready = float(fault["t1"])
                nxt = next((t for t in answered if t >= ready), None)
                if nxt is not None:
                    first_answer.append(nxt - ready)
                nxt = next((t for t in acquired if t >= ready), None)
                if nxt is not None:
                    first_acquire.append(nxt - ready)
        r.recovery["server down after kill -9 (kill to ready)"] = _summary(downtimes)
        r.recovery["first answered operation after restart"] = _summary(first_answer)
        r.recovery["first acquisition after restart"] = _summary(first_acquire)
        heal = self.by_type["heal"]
        if heal:
            healed = float(heal[0]["t"])
            per_key = {}
            for op in self.ops:
                if op["op"] == "acquire" and op.get("outcome") == "ok" and op["t1"] >= healed:
                    per_key.setdefault(op["key"], op["t1"] - healed)
            r.recovery["first new holder per key after the faults stopped"] = _summary(list(per_key.values()))
        self._zombies()
        self._pool_figures()
        timeouts = sum(1 for op in self.ops if "did not answer in time" in (op.get("error") or ""))
        r.figures["operations failed by a statement timeout"] = timeouts
        r.figures["operations with an unknown outcome"] = sum(1 for op in self.ops if op.get("outcome") == "unknown")
        skews = {s["w"]: s.get("client_minus_db_s") for s in self.by_type["worker_start"] if s.get("skew")}
        if skews:
            r.figures["skewed workers: client clock minus database clock (s)"] = skews
            r.figures["operations by skewed workers"] = sum(1 for op in self.ops if op.get("w") in skews)
        late = [op for op in self.ops if op["op"] == "publish" and op.get("late")]
        r.figures["publishes after working past the TTL"] = dict(Counter(op.get("outcome") for op in late))
        r.figures["keeper reported lost"] = r.operations.get("lost", 0)

    def _pool_grants(self) -> list[exclusion.Grant]:
        pools = set(self.meta.get("slot_keys") or [])
        return [g for g in self.grants if g.base in pools]

    def _pool_figures(self) -> None:
        pooled = self._pool_grants()
        if not pooled:
            return
        r = self.report
        label = {"slot": "slots={}", "single": "one holder", "replace": "replace"}
        r.figures["semaphore keys: committed grants"] = dict(sorted(Counter(
            label[g.kind].format(g.slots) for g in pooled).items()))
        eras = {g.base: g.era for g in pooled}
        r.figures["semaphore keys: slot-count changes"] = sum(eras.values())
        r.figures["semaphore keys: replaces that took a holder over"] = sum(
            1 for op in self.ops if op["op"] == "replace" and op.get("replaced_token") is not None
        )
        r.figures["semaphore keys: acquires refused for another slot count"] = sum(
            1 for op in self.ops if op["op"] in ("acquire", "replace") and op.get("outcome") == "mismatch"
        )
        r.figures["force-releases"] = r.faults.get("force_release", 0)
        r.figures["semaphore keys: publishes by a grant whose key changed its slot count since"] = (
            self._publishes_after_count_change(pooled)
        )

    def _publishes_after_count_change(self, pooled: list[exclusion.Grant]) -> dict[str, int]:
        """What became of the publishes of issue 38's third defect: by a grant whose key has been granted
        under another count since (by the database clock, mapped from the host's monotonic clock at the
        run's start) while its own slot was not granted again. Split by whether a holder of the later count
        had already published to that resource (then the publish must be refused), and by outcome."""
        t = self.meta.get("t")
        db_start = when(self.meta.get("db_time"))
        if t is None or db_start is None:
            return {}
        offset = db_start.timestamp() - float(t)
        grants = {(g.row, g.token): g for g in pooled}
        by_base = exclusion.by_base(pooled)
        by_row: dict[str, list[exclusion.Grant]] = defaultdict(list)
        for g in pooled:
            by_row[g.row].append(g)
        published: dict[tuple[str, str], list[tuple[float, int]]] = defaultdict(list)  # (resource, base) -> (at, era)
        for row in self.by_type["target"]:
            g = grants.get((row.get("key", ""), int(row["token"])))
            if g is not None:
                at = when(row.get("committed_at") or row["at"])
                if at is not None:
                    published[(row["resource"], g.base)].append((at.timestamp(), g.era))
        outcomes: Counter[str] = Counter()
        for op in self.ops:
            if op["op"] != "publish" or "key" not in op:
                continue
            g = grants.get((op["key"], int(op["token"])))
            if g is None:
                continue
            sent = float(op["t0"]) + offset
            if not any(h.era > g.era and h.start.timestamp() < sent for h in by_base[g.base]):
                continue
            if any(h.token > g.token and h.start.timestamp() < sent for h in by_row[g.row]):
                continue  # its own slot was granted again: the per-slot fence order decides
            after = any(at < sent and era > g.era for at, era in published[(op["resource"], g.base)])
            outcomes[f"{'after' if after else 'before'} a holder of the later count published: {op.get('outcome')}"] += 1
        return dict(sorted(outcomes.items()))

    def _zombies(self) -> None:
        """What woken workers did with the token they held before they were paused."""
        ops_by_worker: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for op in self.ops:
            ops_by_worker[int(op["w"])].append(op)
        outcomes: Counter[str] = Counter()
        stops = [f for f in self.by_type["fault"] if f["kind"] == "sigstop"]
        wakes = [f for f in self.by_type["fault"] if f["kind"] == "sigcont"]
        for stop in stops:
            token, key = stop.get("token"), stop.get("key")
            if token is None:
                continue
            woke = next((w["t"] for w in wakes if w["w"] == stop["w"] and w["t"] >= stop["t"]), None)
            if woke is None:
                continue
            # What it did with that token once awake (a publish in flight across the pause counts).
            after = [
                op for op in ops_by_worker[int(stop["w"])]
                if op["t1"] >= woke and op.get("key") == key and op.get("token") == token
                and op["op"] in ("publish", "lost")
            ]
            if not after:
                outcomes["no publish (released or crashed first)"] += 1
            elif after[0]["op"] == "lost":
                outcomes["stopped by the keeper"] += 1
            else:
                outcomes["publish " + str(after[0].get("outcome"))] += 1
        self.report.figures["paused holders, after waking"] = dict(outcomes)

    def _coverage(self) -> None:
        r = self.report
        profile = self.meta.get("profile", {})
        need = int(profile.get("min_operations", 0) or 0)
        total = sum(r.operations.values())
        if total < need:
            r.coverage.append(f"{total} operations, fewer than the {need} this profile requires")
        # A fault kind is expected when the profile schedules it at least once in its duration.
        duration = float(profile.get("duration", 0) or 0)
        expected = [
            kind for kind, every in FAULT_SCHEDULE.items()
            if every in profile and float(profile[every]) <= duration
        ]
        if int(profile.get("skewed", 0) or 0):
            expected.append("clock_skew")
        if "lossy_api" in expected:
            expected.append("lost_reply")
        for kind in expected:
            if not r.faults.get(kind):
                r.coverage.append(f"no {kind} fault was injected")
        if self.http_workers:
            through = sum(1 for op in self.ops if op.get("http"))
            accepted = sum(1 for row in self.by_type["target"] if row.get("via") == "api")
            r.figures["operations through the lease API"] = through
            r.figures["publishes through the lease API (committed fence advances)"] = accepted
            if not through or not accepted:
                r.coverage.append("the HTTP workers made no operation, or published nothing, through the lease API")
        if self.meta.get("slot_keys"):
            pooled = self._pool_grants()
            shapes = {(g.kind, g.slots) for g in pooled}
            for count in profile.get("slot_counts") or ():
                if count > 1 and ("slot", count) not in shapes:
                    r.coverage.append(f"no semaphore grant with slots={count}")
            for kind in ("single", "replace"):
                if (kind, 1) not in shapes:
                    r.coverage.append(f"no {kind} grant of a semaphore key")
            if not any(g.era for g in pooled):
                r.coverage.append("no slot-count change")
        need_wait = int(profile.get("min_wait_ops", 0) or 0)
        if need_wait:
            # Claims that took or kept a place, and give-backs answered; with HTTP workers, some through the
            # lease API, one answer lost there, and a forged give-back refused.
            counts = {
                "claims of a waiting place": r.outcomes.get(("wait_claim", "claimed"), 0),
                "give-backs of a waiting place": sum(
                    1 for op in self.ops if op["op"] == "wait_release" and op.get("outcome") == "ok"),
                "refused claims (every place taken)": r.outcomes.get(("wait_claim", "full"), 0),
            }
            for what, n in counts.items():
                if n < (need_wait if what.startswith("claims") else max(1, need_wait // 10)):
                    r.coverage.append(f"{n} {what}, fewer than this profile requires")
            if self.http_workers:
                http_wait = [op for op in self.ops if op.get("http") and op["op"] in ("wait_claim", "wait_release")]
                if not any(op["op"] == "wait_claim" and op.get("outcome") == "claimed" for op in http_wait):
                    r.coverage.append("no waiting place was claimed through the lease API")
                if not any(op.get("forged") and op.get("outcome") == "refused" for op in http_wait):
                    r.coverage.append("no give-back with a forged capability was tried through the lease API")


def check_acknowledged(records: list[dict[str, Any]]) -> Report:
    """Check only what the clients were told: for a run whose store failed over, where the database
    that answers at the end is not the one that acknowledged everything (tests/reliability/failover.py).

    ``token-reissued``, ``token-order`` and ``overlap`` as in :meth:`Checker.check`; ``fence-order``: a
    publish acknowledged as accepted whose token is not larger than one of the same (resource, lease key)
    acknowledged as accepted before it was sent; ``duplicate-publish``: one token acknowledged as accepted
    twice for one resource; ``unexpected-error``: an ``error`` outcome.
    """
    checker = Checker(records)
    checker._count()
    leases = checker._client_leases()
    checker._client_tokens(leases)
    checker._client_overlap(leases)
    accepted = sorted(
        (op for op in checker.ops if op["op"] == "publish" and op.get("outcome") == "accepted"),
        key=lambda op: op["t1"],
    )
    seen: Counter[tuple[str, str, int]] = Counter()
    done: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for op in accepted:
        ident, token = (op["resource"], op["key"]), int(op["token"])
        seen[(*ident, token)] += 1
        before = [p for p in done[ident] if p["t1"] < op["t0"] and int(p["token"]) >= token]
        if before:
            checker.report.violate(
                "fence-order",
                f"{op['resource']} ({op['key']}): token {token} of {op['owner']} accepted after token "
                f"{before[0]['token']} of {before[0]['owner']} was",
            )
        done[ident].append(op)
    for (resource, key, token), n in seen.items():
        if n > 1:
            checker.report.violate("duplicate-publish", f"{resource}: token {token} of {key} accepted {n} times")
    checker._errors()
    return checker.report


def check_records(records: list[dict[str, Any]]) -> Report:
    return Checker(records).check()


def check_file(path: Path) -> Report:
    return check_records(list(history.read(path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.checker", description=__doc__.splitlines()[0])
    parser.add_argument("history", type=Path)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    report = check_file(args.history)
    print(report.format())
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return report.status


if __name__ == "__main__":
    sys.exit(main())
