"""The checker's rules for waiting places (``wait_claim`` / ``wait_release``; docs/core.md, "Waiting places").

A *place* is one row of ``lease_waiter``: (key, owner) taken at ``since`` (the insert's database time, which
every renewal of it keeps); each claim that takes or keeps it answers its ``expires_at`` (the claim's database
time plus the TTL asked for), so the claim's own database time is ``expires_at - ttl``. Every claim runs
under the key's advisory lock, so claims of one key are serialized, and a claim first deletes the key's
lapsed places, then renews the owner's place or inserts one when fewer than ``max_waiting`` are live.

What the history proves about a place, by the database clock (lower bounds only: a claim or give-back
whose answer was lost proves nothing, and is never held against the store):

* it was live from ``since`` to the last acknowledged claim of it (each renewal found it live);
* after that, until its last ``expires_at``, when its worker is seen doing something else next without
  having tried to give it back (a lapse: a dead waiter); not when its worker gave it back (whatever the
  answer), nor when nothing of the worker follows (it was killed, maybe in the middle of a give-back).

Rules (violation kinds):

``wait-over-max``        more than ``max_waiting`` live places of one key at one moment: in a claim's answer
                         (the live waiters the store listed under the key's lock), or by the proven
                         lifetimes above
``wait-forged-release``  a give-back with a forged capability (lease API) was answered as done, or changed
                         something: the place's next claim (its own request id, sent less than the TTL
                         after the claim before, by the host's monotonic clock, which runs at the database
                         clock's rate) did not find it (another ``since``, or no place)
``wait-renewed-after-end`` a claim renewed a place (answered its ``since``) that had been given back (an
                         acknowledged give-back before the claim was sent), or had lapsed (the claim's
                         database time later than the place's last known expiry by more than the statement
                         timeout, which bounds the time between the claim's delete of lapsed places and its
                         renewal): whatever place id (request id) the claim named
``wait-probe``           the waiters a fresh client listed after the final crash disagree with the history: a
                         key with more than ``max_waiting``; a place nobody claimed (and no claim of its owner
                         was in flight at the crash); a place given back with an acknowledgement; a place
                         proven live then (lapsing, not given back, expiry after the listing) missing
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

_ITERATION_RE = re.compile(r"^w(\d+)-(\d+)$")
#: The host's monotonic clock against the database's over a few seconds (both this host's clocks; NTP slews
#: them apart by well under a millisecond per second).
CLOCK_RATE_MARGIN = 0.05
#: Operations of a worker's keeper thread (the rest are its main thread's, one at a time).
KEEPER_OPS = ("renew", "lost")


def _when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


@dataclass
class Place:
    key: str
    owner: str
    since: datetime
    worker: int
    claims: list[dict[str, Any]] = field(default_factory=list)  # acknowledged ones, in order

    @property
    def last(self) -> dict[str, Any]:
        return self.claims[-1]

    def claimed_at(self, claim: dict[str, Any]) -> datetime:
        return _when(claim["expires_at"]) - timedelta(seconds=float(claim["ttl"]))  # type: ignore[operator]

    @property
    def expires(self) -> datetime:
        return max(_when(c["expires_at"]) for c in self.claims)  # type: ignore[type-var, return-value]


@dataclass
class Interval:
    place: Place
    start: datetime
    end: datetime
    closed: bool  # live at ``end`` itself (a claim renewed it then); else until just before (its expiry)


def check(ops: list[dict[str, Any]], probes: list[dict[str, Any]], statement_timeout: float,
          violate: Any) -> dict[str, Any]:
    """Judge the waiting-place operations of ``ops`` (the history's ``op`` records in monotonic order) and
    the final listing (``probe_waiters``); report each violation through ``violate(kind, detail)``.
    Returns the figures."""
    wait_ops = [op for op in ops if op["op"] in ("wait_claim", "wait_release")]
    if not wait_ops:
        return {}
    by_worker: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for op in ops:
        if op["op"] not in KEEPER_OPS:
            by_worker[int(op["w"])].append(op)
    limits: dict[str, int] = {}
    for op in wait_ops:
        if op["op"] == "wait_claim":
            limits[op["key"]] = min(limits.get(op["key"], int(op["max_waiting"])), int(op["max_waiting"]))
    places = _places(wait_ops)
    _listed_over_max(wait_ops, violate)
    starts: dict[int, list[float] | None] = {}
    for w, worker_ops in by_worker.items():
        t0s = [op["t0"] for op in worker_ops]
        starts[w] = t0s if all(a <= b for a, b in itertools.pairwise(t0s)) else None
    ends = {id(p): _proven_end(p, by_worker[p.worker], starts[p.worker]) for p in places.values()}
    _lifetimes_over_max(places, ends, limits, violate)
    _forged(by_worker, violate)
    _renewed_after_end(by_worker, places, statement_timeout, violate)
    listed = _probe(probes, places, ends, limits, by_worker, violate)
    outcomes = Counter(f"{op['op']}:{op.get('outcome')}" + (":forged" if op.get("forged") else "") for op in wait_ops)
    return {
        "waiting places: taken (distinct places acknowledged)": len(places),
        "waiting places: lapsed (left by their waiter, not given back)": sum(
            1 for p in places.values() if ends[id(p)] == "lapsed"),
        "waiting places: outcomes": dict(sorted(outcomes.items())),
        "waiting places: claims through the lease API": sum(
            1 for op in wait_ops if op["op"] == "wait_claim" and op.get("http")),
        "waiting places: listed by the final probe": listed,
    }


def _places(wait_ops: list[dict[str, Any]]) -> dict[tuple[str, str, datetime | None], Place]:
    places: dict[tuple[str, str, datetime | None], Place] = {}
    for op in wait_ops:
        if op["op"] == "wait_claim" and op.get("outcome") == "claimed" and op.get("since"):
            ident = (op["key"], op["owner"], _when(op["since"]))
            place = places.setdefault(ident, Place(op["key"], op["owner"], _when(op["since"]), int(op["w"])))  # type: ignore[arg-type]
            place.claims.append(op)
    return places


def _listed_over_max(wait_ops: list[dict[str, Any]], violate: Any) -> None:
    for op in wait_ops:
        if op["op"] == "wait_claim" and op.get("outcome") in ("claimed", "full"):
            listed = op.get("waiters") or []
            if len(listed) > int(op["max_waiting"]):
                violate("wait-over-max", f"{op['key']}: a claim by {op['owner']} (max_waiting={op['max_waiting']}) was "
                        f"answered with {len(listed)} live waiters: {[w[0] for w in listed]}")


def _proven_end(place: Place, worker_ops: list[dict[str, Any]], starts: list[float] | None) -> str:
    """``lapsed`` when the place's worker went on to something else after the place's last acknowledged claim
    without trying to give it back; else ``ended`` (given back, or maybe: only the last claim is proven).
    ``starts``: each of ``worker_ops``' ``t0`` when they are in order (a worker sends one operation at a
    time), else None: the operations after the claim are then found by bisection (a scan of them all per
    place took minutes on the long profile's history)."""
    last = place.last
    if starts is not None:
        after: Iterable[dict[str, Any]] = itertools.islice(worker_ops, bisect.bisect_left(starts, last["t1"]), None)
    else:
        after = (op for op in worker_ops if op["t0"] >= last["t1"])
    for op in after:
        if op["op"] == "wait_release" and op["key"] == place.key and op["owner"] == place.owner:
            if op.get("forged") and op.get("outcome") == "refused":
                continue  # refused: nothing changed (the forged rule checks it)
            return "ended"
        if op["op"] == "wait_claim" and op["key"] == place.key and op["owner"] == place.owner:
            continue  # a claim of it whose answer was lost, or another place id's: still this place's waiter
        return "lapsed"
    return "ended"  # nothing follows: killed, maybe while giving it back


def _lifetimes_over_max(places: dict[tuple[str, str, datetime | None], Place], ends: dict[int, str], limits: dict[str, int],
                        violate: Any) -> None:
    by_key: dict[str, list[Interval]] = defaultdict(list)
    for place in places.values():
        last_claim = place.claimed_at(place.last)
        if ends[id(place)] == "lapsed":
            by_key[place.key].append(Interval(place, place.since, place.expires, closed=False))
        else:
            by_key[place.key].append(Interval(place, place.since, last_claim, closed=True))
    for key, intervals in by_key.items():
        limit = limits[key]
        # Events: an open end before a start at the same instant, a start before a closed end.
        events = sorted(
            [(i.start, 1, n) for n, i in enumerate(intervals)]
            + [(i.end, 2 if i.closed else 0, n) for n, i in enumerate(intervals)]
        )
        live: set[int] = set()
        reported = False
        for at, kind, n in events:
            if kind == 1:
                live.add(n)
                if len(live) > limit and not reported:
                    reported = True
                    who = sorted(f"{intervals[m].place.owner} since {intervals[m].start.isoformat()}" for m in live)
                    violate("wait-over-max", f"{key} (max_waiting={limit}): {len(live)} places proven live at "
                            f"{at.isoformat()}: {who}")
            else:
                live.discard(n)


def _forged(by_worker: dict[int, list[dict[str, Any]]], violate: Any) -> None:
    for worker_ops in by_worker.values():
        for i, op in enumerate(worker_ops):
            if op["op"] != "wait_release" or not op.get("forged"):
                continue
            if op.get("outcome") == "ok":
                violate("wait-forged-release", f"{op['key']}: {op['owner']}'s place was given back with a forged capability")
            before = next((p for p in reversed(worker_ops[:i]) if p["op"] == "wait_claim"
                           and p["key"] == op["key"] and p["owner"] == op["owner"]), None)
            after = next((p for p in worker_ops[i + 1:] if p["op"] == "wait_claim" and p.get("after_forged")
                          and p["key"] == op["key"] and p["owner"] == op["owner"]), None)
            if before is None or after is None or before.get("outcome") != "claimed":
                continue
            if after["t1"] - before["t0"] >= float(before["ttl"]) - CLOCK_RATE_MARGIN:
                continue  # it may have lapsed meanwhile
            if after.get("outcome") in ("unknown", "error"):
                continue
            if after.get("outcome") != "claimed" or _when(after.get("since")) != _when(before.get("since")):
                violate("wait-forged-release",
                        f"{op['key']}: {op['owner']}'s place (since {before.get('since')}) was gone "
                        f"{after['t1'] - before['t0']:.2f}s after its claim (TTL {before['ttl']}s), after a give-back "
                        f"with a forged capability was refused: the next claim answered {after.get('outcome')} "
                        f"since {after.get('since')}")


def _renewed_after_end(by_worker: dict[int, list[dict[str, Any]]], places: dict[tuple[str, str, datetime | None], Place],
                       statement_timeout: float, violate: Any) -> None:
    for worker_ops in by_worker.values():
        given_back: dict[tuple[str, str], float] = {}  # (key, owner) -> when the first acknowledged give-back answered
        seen: dict[tuple[str, str], list[tuple[float, datetime | None]]] = defaultdict(list)  # claims: (t1, since)
        first_lost: dict[tuple[Any, Any], float] = {}  # (key, owner) -> when its first unanswered claim was sent
        for p in worker_ops:
            if p["op"] == "wait_claim" and p.get("outcome") in ("unknown", "error"):
                ident = (p.get("key"), p.get("owner"))
                first_lost[ident] = min(p["t0"], first_lost.get(ident, p["t0"]))
        for op in worker_ops:
            ident = (op.get("key"), op.get("owner"))
            if op["op"] == "wait_release" and op.get("outcome") == "ok" and not op.get("forged"):
                given_back.setdefault(ident, op["t1"])  # type: ignore[arg-type]
                continue
            if op["op"] != "wait_claim" or op.get("outcome") != "claimed" or not op.get("since"):
                continue
            since = _when(op["since"])
            for t1, earlier in seen[ident]:  # type: ignore[index]
                back = given_back.get(ident)  # type: ignore[arg-type]
                if earlier == since and back is not None and t1 < back < op["t0"]:
                    violate("wait-renewed-after-end", f"{op['key']}: {op['owner']}'s place since {since} was renewed "
                            "by a claim sent after it was given back")
                    break
            place = places.get((op["key"], op["owner"], since))
            earlier_claims = [c for c in (place.claims if place else []) if c["t1"] <= op["t0"]]
            lost_between = first_lost.get(ident, op["t0"]) < op["t0"]  # a claim of this place unanswered before
            if earlier_claims and place is not None and not lost_between:
                expiry = max(_when(c["expires_at"]) for c in earlier_claims)  # type: ignore[type-var]
                at = place.claimed_at(op)
                if (at - expiry).total_seconds() > statement_timeout:  # type: ignore[operator]
                    violate("wait-renewed-after-end", f"{op['key']}: {op['owner']}'s place since {since} lapsed at "
                            f"{expiry.isoformat()} and was renewed at {at.isoformat()}")
            seen[ident].append((op["t1"], since))  # type: ignore[index]


def _probe(probes: list[dict[str, Any]], places: dict[tuple[str, str, datetime | None], Place], ends: dict[int, str],
           limits: dict[str, int], by_worker: dict[int, list[dict[str, Any]]], violate: Any) -> int | None:
    probe = next(iter(probes), None)
    if probe is None or probe.get("waiters") is None:
        return None
    after = _when(probe.get("db_after"))
    listed = {(k, o, _when(s)) for k, o, s, _ in probe["waiters"]}
    for key, n in Counter(k for k, _, _ in listed).items():
        if key in limits and n > limits[key]:
            violate("wait-probe", f"{key}: {n} live waiters listed after the crash (max_waiting={limits[key]})")
    claimed_by = {(op["key"], op["owner"]) for ops in by_worker.values() for op in ops if op["op"] == "wait_claim"}
    last_iteration: dict[int, int] = {}
    for w, ops in by_worker.items():
        for op in ops:
            m = _ITERATION_RE.match(str(op.get("owner") or ""))
            if m:
                last_iteration[w] = max(last_iteration.get(w, 0), int(m.group(2)))
    for key, owner, since in listed:
        place = places.get((key, owner, since))
        if place is None:
            m = _ITERATION_RE.match(owner)
            in_flight = m is not None and int(m.group(2)) >= last_iteration.get(int(m.group(1)), 0)
            if (key, owner) not in claimed_by and not in_flight:
                violate("wait-probe", f"{key}: {owner}'s place (since {since}) listed after the crash was never claimed")
            continue
        gone = [op for op in by_worker[place.worker] if op["op"] == "wait_release" and not op.get("forged")
                and op.get("outcome") == "ok" and (op["key"], op["owner"]) == (key, owner) and op["t0"] >= place.last["t1"]]
        if gone:
            violate("wait-probe", f"{key}: {owner}'s place (since {since}) listed after the crash had been given back")
    if after is not None:
        for ident, place in places.items():
            if ends[id(place)] == "lapsed" and place.expires > after and ident not in listed:
                violate("wait-probe", f"{place.key}: {place.owner}'s place (since {place.since.isoformat()}, expiring "
                        f"{place.expires.isoformat()}) was live but not listed after the crash")
    return len(listed)
