"""Who may hold a key at once, checked over a history: semaphore slots, single holders, replaces, and
changes of a key's slot count (docs/core.md states the rule; docs/reliability.md lists the properties).

A *grant* is one token of one lease row, valid from its ``acquired_at`` until it ends (its last expiry,
its release, or the moment its row moved past it: a force-release, a replace's takeover, the next grant).
A key's grants live in its rows: slot 1 is the key's own row, slot ``i > 1`` the row ``key#i``; a single
holder and a replace use the key's own row with a slot count of 1.

The rule, at every instant, for the live grants of one key: exactly one single holder (a plain acquire or
a replace), or up to N holders that all acquired with the same count N (each in its own slot). A key's
*count era* changes whenever a grant's count differs from the grant before it (by ``acquired_at``); a
grant of a later era must carry a larger fencing order than every grant of the key before the change,
and once a holder of a later era has published to a resource, no grant of an earlier era may publish
there (a zombie of a slot that the change dropped, or of the count before it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

#: The lease row's column that orders grants across slot-count changes, where the store has one (read
#: from the audit's ``extra``: every column the harness does not name): the count epoch of migration 15,
#: the token floor of the key's holding period. Without it the token alone.
EPOCH_COLUMNS = ("count_epoch",)

Violate = Callable[[str, str], None]


def when(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(value)


@dataclass
class Grant:
    base: str
    row: str
    token: int
    owner: str
    slots: int
    kind: str  # "single", "slot" or "replace"
    start: datetime
    end: datetime
    seq: int = 0  # ties on ``start``: the audit's order
    epoch: int = 0
    era: int = 0

    @property
    def order(self) -> tuple[int, int]:
        """The fencing order: the store's count epoch (where it has one), then the token."""
        return (self.epoch, self.token)

    def describe(self) -> str:
        shape = {"slot": f"slots={self.slots}", "single": "one holder", "replace": "replace"}[self.kind]
        epoch = f", epoch {self.epoch}" if self.epoch else ""
        return f"{self.row} token {self.token}{epoch} of {self.owner} ({shape})"


def kind_of(slots: int, replace: bool) -> str:
    return "replace" if replace else ("slot" if slots > 1 else "single")


def epoch_of(row: dict[str, Any]) -> int:
    extra = row.get("extra") or {}
    for column in EPOCH_COLUMNS:
        if extra.get(column) is not None:
            return int(extra[column])
    return 0


def base_of(row_key: str, slot: int | None, slot_of: str | None) -> str:
    if slot_of:
        return slot_of
    suffix = f"#{slot}"
    return row_key[: -len(suffix)] if slot and slot > 1 and row_key.endswith(suffix) else row_key


def committed_grants(audit: Iterable[dict[str, Any]]) -> list[Grant]:
    """Every grant the database committed, from the audit of the lease rows, with the moment it ended."""
    by_row: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in audit:
        by_row[row["key"]].append(row)
    grants: list[Grant] = []
    for row_key, changes in by_row.items():
        changes.sort(key=lambda r: (when(r["at"]), r["id"]))
        current: Grant | None = None
        for r in changes:
            token = int(r["token"])
            granted = r["op"] == "INSERT" or (
                r.get("old_token") is not None and token != int(r["old_token"]) and r["released_at"] is None
            )
            if current is not None and token != current.token:
                # The row moved past the grant: a new grant (a takeover ends it at once), or a force-release.
                cut = when(r["acquired_at"]) if granted else (when(r["released_at"]) or when(r["at"]))
                if cut is not None:
                    current.end = min(current.end, cut)
                current = None
            if granted:
                slots = int(r.get("slots") or 1)
                current = Grant(
                    base=base_of(row_key, r.get("slot"), r.get("slot_of")), row=row_key, token=token,
                    owner=r["owner"], slots=slots, kind=kind_of(slots, r.get("run_after") is not None),
                    start=when(r["acquired_at"]), end=when(r["expires_at"]),  # type: ignore[arg-type]
                    seq=int(r["id"]), epoch=epoch_of(r),
                )
                grants.append(current)
            elif current is not None:
                current.end = when(r["expires_at"])  # type: ignore[assignment]  # renewed, or released
    assign_eras(grants)
    return grants


def cut_short(audit: Iterable[dict[str, Any]]) -> dict[tuple[str, int, str], datetime]:
    """Grants that ended before their expiry without their holder's doing: (row, token, owner) -> when.
    A force-release ends its grant at its release; a replace's takeover at the new grant."""
    cuts: dict[tuple[str, int, str], datetime] = {}
    for r in audit:
        if r["op"] != "UPDATE" or r.get("old_token") is None or int(r["token"]) == int(r["old_token"]):
            continue
        if r["old_released_at"] is not None:
            continue  # it had ended already
        if r["released_at"] is not None:
            at = when(r["released_at"])
        elif r.get("replaced_token") is not None and int(r["replaced_token"]) == int(r["old_token"]):
            at = when(r["acquired_at"])
        else:
            continue
        if at is not None:
            cuts[(r["key"], int(r["old_token"]), r["old_owner"])] = at
    return cuts


def assign_eras(grants: list[Grant]) -> None:
    """Number each key's count eras: a grant whose count differs from the grant before it starts one."""
    for items in by_base(grants).values():
        era, count = 0, None
        for grant in items:
            if count is not None and grant.slots != count:
                era += 1
            grant.era, count = era, grant.slots


def by_base(grants: Iterable[Grant]) -> dict[str, list[Grant]]:
    groups: dict[str, list[Grant]] = defaultdict(list)
    for grant in grants:
        groups[grant.base].append(grant)
    for items in groups.values():
        items.sort(key=lambda g: (g.start, g.seq))
    return groups


def broken_rule(live: list[Grant], grant: Grant) -> str | None:
    """What is wrong with ``grant`` joining the key's ``live`` grants, or None."""
    if not live:
        return None
    group = [*live, grant]
    if any(g.slots == 1 for g in group):
        return "a single holder beside another holder"
    counts = sorted({g.slots for g in group})
    if len(counts) > 1:
        return f"holders of slot counts {counts} at once"
    if len(group) > grant.slots:
        return f"{len(group)} holders of {grant.slots} slots"
    return None


def check_exclusion(grants: Iterable[Grant], violate: Violate, kind: str) -> None:
    """At every grant, the key's live grants (including it) follow the rule; one violation per grant."""
    for base, items in by_base(grants).items():
        live: list[Grant] = []
        for grant in items:
            live = [g for g in live if g.end > grant.start and g.row != grant.row]
            problem = broken_rule(live, grant)
            if problem:
                violate(kind, f"{base}: {grant.describe()} granted at {grant.start.isoformat()} while "
                              f"{'; '.join(f'{g.describe()} held until {g.end.isoformat()}' for g in live)}: {problem}")
            live.append(grant)


def check_count_tokens(grants: Iterable[Grant], violate: Violate) -> None:
    """Every grant after a count change carries a larger fencing order than every grant of the key before
    the change (so a fence that compares them can refuse the old ones)."""
    for base, items in by_base(grants).items():
        before: Grant | None = None  # the largest order of the eras before the current one
        era_top: Grant | None = None
        era = 0
        for grant in items:
            if grant.era != era:
                if era_top is not None and (before is None or era_top.order > before.order):
                    before = era_top
                era, era_top = grant.era, None
            if before is not None and grant.order <= before.order:
                violate("count-token-order",
                        f"{base}: {grant.describe()} granted at {grant.start.isoformat()} under a new slot count, "
                        f"not above {before.describe()} granted at {before.start.isoformat()} before the change")
            if era_top is None or grant.order > era_top.order:
                era_top = grant


def check_superseded_publishes(grants: Iterable[Grant], targets: Iterable[dict[str, Any]], violate: Violate) -> None:
    """No publish of a grant of an earlier count era, once a grant of a later era of its key published to
    that resource (by commit order). Zombies within one era are the fence's order per row (fence-order)."""
    index = {(g.row, g.token): g for g in grants}
    rows = sorted(targets, key=lambda t: (when(t.get("committed_at") or t["at"]), t["id"]))
    newest: dict[tuple[str, str], tuple[Grant, dict[str, Any]]] = {}
    for row in rows:
        grant = index.get((row.get("key", ""), int(row["token"])))
        if grant is None:
            continue  # never granted (publish-not-holder says so), or a history from before per-key fences
        ident = (row["resource"], grant.base)
        top = newest.get(ident)
        if top is not None and grant.era < top[0].era:
            violate(
                "superseded-publish",
                f"{row['resource']}: {grant.describe()} (count era {grant.era}) published at "
                f"{row.get('committed_at') or row['at']}, after {top[0].describe()} of a later slot count "
                f"(era {top[0].era}) had published at {top[1].get('committed_at') or top[1]['at']}",
            )
        if top is None or grant.era > top[0].era:
            newest[ident] = (grant, row)


def later_era_published(grants: Iterable[Grant], fence_rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str], int]:
    """(resource, key) -> the latest count era of that key whose grant the fence accepted there."""
    index = {(g.row, g.token): g for g in grants}
    top: dict[tuple[str, str], int] = {}
    for row in fence_rows:
        grant = index.get((row.get("key", ""), int(row["token"])))
        if grant is not None:
            ident = (row["resource"], grant.base)
            top[ident] = max(top.get(ident, 0), grant.era)
    return top
