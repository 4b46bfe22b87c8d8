"""Run profiles: how many workers, for how long, and how often each fault strikes."""

from __future__ import annotations

from dataclasses import dataclass, replace

#: Faketime offsets of the workers whose clock is wrong (the first ones get them).
SKEWS = ("+10m", "-10m")


@dataclass(frozen=True)
class Profile:
    """One harness run.

    :ivar duration: seconds of the fault phase.
    :ivar settle: seconds after the last fault before every worker is killed and the probe starts.
    :ivar ttl: lease TTL in seconds (short, so that expiry and zombies happen often).
    :ivar skewed: how many workers run with a clock 10 minutes off (half ahead, half behind).
    :ivar *_every: mean seconds between two faults of that kind.
    """

    name: str
    duration: float
    workers: int
    keys: int
    ttl: float = 2.0
    skewed: int = 4
    settle: float = 4.0
    statement_timeout: float = 1.0
    connect_timeout: float = 2.0
    zombie_every: float = 5.0
    terminate_every: float = 2.5
    kill_every: float = 25.0
    lock_every: float = 9.0
    #: Share of iterations that work past the TTL, that use a keeper, that check the keeper before
    #: publishing, and that publish with an idempotency key.
    long_fraction: float = 0.15
    keeper_fraction: float = 0.7
    check_fraction: float = 0.5
    idempotent_fraction: float = 0.5
    #: Share of keeper starts that come after a pause (0.5-1.6 TTL after the acquire), and that join the
    #: lease late (a holder read with 0.05-0.5 TTL left), the way a run-lease task joins a run's lease.
    delay_fraction: float = 0.15
    join_fraction: float = 0.15
    #: Semaphore keys (``pool-0``, ...; each publishes to a resource of its own) and the share of the
    #: iterations that take one of them. Such an iteration acquires with the slot count of the current
    #: phase (``slot_counts`` in turn, each for ``count_phase`` seconds: 2 -> 3 -> 1, a count of 1 being a
    #: plain single-holder acquire), or with the previous phase's count (``stray_count_fraction``: a worker
    #: still running the old DAG version), or with one holder whatever the count (``single_fraction``), or
    #: replaces (``replace_fraction``: ``try_replace`` with a ``run_after`` that mostly grows with time).
    slot_keys: int = 0
    slot_fraction: float = 0.5
    slot_counts: tuple[int, ...] = (2, 3, 1)
    count_phase: float = 6.0
    stray_count_fraction: float = 0.15
    single_fraction: float = 0.15
    replace_fraction: float = 0.25
    #: Mean seconds between two force-releases by the admin (the nemesis), of a live holder's row.
    force_every: float = 1e9
    #: HTTP workers (the last ``http_workers`` of ``workers``): they take, renew, release and publish through
    #: the lease API (chaos.api: the plugin's app on a real uvicorn, in a process of its own, over the same
    #: store), on the same keys and with the same mix as the others. The API server's faults: paused
    #: (SIGSTOP, 1.3-2.2 TTL), killed and restarted, and windows of ``lossy_seconds`` in which a share
    #: ``lossy_fraction`` of its replies are lost after the store committed. ``api_timeout``: how long one
    #: request of an HTTP worker may take.
    http_workers: int = 0
    api_pause_every: float = 1e9
    api_kill_every: float = 1e9
    lossy_every: float = 1e9
    lossy_seconds: float = 3.0
    lossy_fraction: float = 0.3
    api_timeout: float = 1.5
    #: Waiting places (``wait_claim`` / ``wait_release``, through the store or the lease API): the share of
    #: the acquires refused because the key is held after which the worker takes a waiting place on that key
    #: (each key's ``max_waiting`` is fixed: 1 or 2, chaos.worker.max_waiting_of), keeps it by claiming it
    #: again ``1..wait_rounds`` times while it polls, then gives it back, or lets it lapse
    #: (``lapse_fraction``: a dead waiter). An HTTP worker sometimes first tries to give it back with a
    #: forged capability (``forged_fraction``, must be refused), and sometimes claims again with another
    #: place id after giving it back (``reclaim_fraction``: a new place, never the old one renewed).
    wait_fraction: float = 0.0
    #: The HTTP workers' share (more of them wait, so that the API server's pauses, kills and lost replies
    #: meet waiting-place claims and give-backs in every run).
    http_wait_fraction: float = 0.0
    wait_rounds: int = 4
    lapse_fraction: float = 0.25
    forged_fraction: float = 0.4
    reclaim_fraction: float = 0.25
    #: Coverage the run must reach for its result to count (the CI test asserts it too): at least
    #: ``min_wait_ops`` claims that took or kept a waiting place, and a tenth as many give-backs and claims
    #: refused for a full key, when it is set.
    min_operations: int = 0
    min_wait_ops: int = 0

    def with_overrides(self, **changes: object) -> Profile:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


PROFILES: dict[str, Profile] = {
    # CI: under a minute and a half end to end on two cores, >= 5,000 operations, every fault kind; a
    # semaphore key whose slot count changes every 6 s, with replaces and single holders on it, and an
    # admin's force-releases. (Two semaphore keys held up to 12 of the 16 workers at once: too few were
    # left asking for a held key, and a loaded run fell under 5,000 operations.)
    # Four of the 16 workers go through the lease API (issue 41), whose server is paused, killed and
    # restarted, and loses replies after committing (each about once or twice a run: every one of them
    # stops all HTTP workers for seconds), besides every fault of the store.
    # 15 % of the refused acquires take a waiting place (about 500 claims a run): at 25 % a run made 15-20 %
    # fewer operations (a waiting worker polls), too close to the 5,000 on a loaded machine.
    "short": Profile(name="short", duration=60.0, workers=16, keys=6, slot_keys=1, slot_fraction=0.4,
                     force_every=4.0, min_operations=5000, http_workers=4, api_pause_every=20.0,
                     api_kill_every=45.0, lossy_every=12.0, wait_fraction=0.15, http_wait_fraction=0.4,
                     min_wait_ops=50),
    # Release checks: half an hour, twice the workers, more keys, a slightly longer TTL.
    "long": Profile(
        name="long", duration=1800.0, workers=32, keys=8, ttl=3.0, skewed=8,
        kill_every=60.0, slot_keys=3, count_phase=9.0, force_every=6.0, min_operations=100_000,
        http_workers=8, api_pause_every=30.0, api_kill_every=90.0, lossy_every=15.0, wait_fraction=0.25,
        http_wait_fraction=0.4, min_wait_ops=1000,
    ),
    # The broken-variant tests: just long enough for the checker to see the variant fail.
    # No server kills (they take seconds each); more pauses, and more late work published unchecked, so
    # that a broken variant shows within seconds.
    "smoke": Profile(
        name="smoke", duration=20.0, workers=8, keys=4, skewed=4, kill_every=1e9, zombie_every=2.0,
        long_fraction=0.4, keeper_fraction=0.4, check_fraction=0.2,
    ),
    # The keeper's broken variant: the smoke profile with most keepers started late or joined late.
    "smoke-keeper": Profile(
        name="smoke-keeper", duration=20.0, workers=8, keys=4, skewed=4, kill_every=1e9, zombie_every=2.0,
        keeper_fraction=0.8, delay_fraction=0.5, join_fraction=0.2,
    ),
    # The semaphore's broken variants: most iterations on two semaphore keys, a count change every 4 s.
    "smoke-slots": Profile(
        name="smoke-slots", duration=20.0, workers=8, keys=2, skewed=2, kill_every=1e9, zombie_every=2.0,
        slot_keys=2, slot_fraction=0.8, count_phase=4.0, force_every=3.0,
    ),
    # The waiting places' broken variant: two keys, most refused acquires wait, few places given back early.
    "smoke-wait": Profile(
        name="smoke-wait", duration=20.0, workers=8, keys=2, skewed=2, kill_every=1e9, zombie_every=2.0,
        wait_fraction=0.8, lapse_fraction=0.5, min_wait_ops=20,
    ),
}

#: Variants: the real store, and deliberately broken ones the checker must catch (see chaos.stores).
VARIANTS = (
    "correct", "fence-off", "client-clock", "async-commit", "keeper-from-construction", "fence-cross-key",
    "replace-ignores-slots", "wait-ignores-max",
)
