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
    #: lease late (a holder read with 0.05-0.5 TTL left), the way a run-scoped task joins a run's lease.
    delay_fraction: float = 0.15
    join_fraction: float = 0.15
    #: Coverage the run must reach for its result to count (the CI test asserts it too).
    min_operations: int = 0

    def with_overrides(self, **changes: object) -> Profile:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


PROFILES: dict[str, Profile] = {
    # CI: under a minute and a half end to end on two cores, >= 5,000 operations, every fault kind.
    "short": Profile(name="short", duration=60.0, workers=16, keys=6, min_operations=5000),
    # Release checks: half an hour, twice the workers, more keys, a slightly longer TTL.
    "long": Profile(
        name="long", duration=1800.0, workers=32, keys=8, ttl=3.0, skewed=8,
        kill_every=60.0, min_operations=100_000,
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
}

#: Variants: the real store, and deliberately broken ones the checker must catch (see chaos.stores).
VARIANTS = (
    "correct", "fence-off", "client-clock", "async-commit", "keeper-from-construction", "fence-cross-key",
)
