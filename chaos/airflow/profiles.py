"""Profiles of the Airflow-level fault run."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class AirflowProfile:
    name: str
    #: Seconds of faults (the DAGs run before, during and after).
    seconds: float
    ttl: float = 8.0
    every: float = 15.0
    work: float = 4.0
    #: Seconds between two faults (uniform in this range).
    gap: tuple[float, float] = (2.0, 5.0)
    #: Weights of the fault kinds (those missing are not injected).
    weights: tuple[tuple[str, int], ...] = (
        ("sigstop-task", 3), ("sigstop-worker", 3), ("kill-task", 2), ("kill-supervisor", 1),
        ("scheduler-restart", 1), ("terminate", 2), ("store-down", 2),
    )
    #: Seconds of calm before the faults start (the first runs go through unharmed).
    warmup: float = 20.0

    def with_seconds(self, seconds: float | None) -> AirflowProfile:
        return self if seconds is None else replace(self, seconds=seconds)


PROFILES = {
    "ci": AirflowProfile("ci", seconds=75.0),
    "long": AirflowProfile("long", seconds=900.0),
    # The broken variants need no nemesis to show: two tasks of one key overlap in every run.
    "smoke": AirflowProfile("smoke", seconds=25.0, weights=(), warmup=0.0),
}
