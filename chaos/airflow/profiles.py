"""Profiles of the Airflow-level fault run."""

from __future__ import annotations

from dataclasses import dataclass, replace

#: Every fault kind, and the executors it applies to.
KINDS = {
    "sigstop-task": ("local", "celery"), "sigstop-worker": ("local", "celery"), "kill-task": ("local", "celery"),
    "kill-supervisor": ("local", "celery"), "kill-worker": ("celery",), "scheduler-restart": ("local", "celery"),
    "terminate": ("local", "celery"), "store-down": ("local", "celery"),
}
#: The faults that need a body running at the time (the others can always be injected).
PROCESS_FAULTS = ("sigstop-task", "sigstop-worker", "kill-task", "kill-supervisor", "kill-worker")


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
    #: Weights of the fault kinds drawn at random (those missing are not drawn).
    weights: tuple[tuple[str, int], ...] = (
        ("sigstop-task", 3), ("sigstop-worker", 3), ("kill-task", 2), ("kill-supervisor", 1), ("kill-worker", 1),
        ("scheduler-restart", 1), ("terminate", 2), ("store-down", 2),
    )
    #: Faults injected before any drawn at random: a scheduler restart first (in the catch-up of the
    #: capped catch-up DAG), the rest in an order shuffled from the seed. Each is injected exactly once;
    #: the fault phase runs up to ``overtime`` past ``seconds`` to get them all in.
    schedule: tuple[str, ...] = ("scheduler-restart",)
    overtime: float = 30.0
    #: Seconds a restarted scheduler stays down (uniform); None: 2 s to one schedule interval.
    scheduler_down: tuple[float, float] | None = None
    #: Seconds of calm before the faults start (the first runs go through unharmed).
    warmup: float = 20.0

    def with_seconds(self, seconds: float | None) -> AirflowProfile:
        return self if seconds is None else replace(self, seconds=seconds)

    def for_executor(self, executor: str) -> AirflowProfile:
        """The profile without the fault kinds that ``executor`` has no process for."""
        def fits(kind: str) -> bool:
            return executor in KINDS[kind]

        return replace(self, weights=tuple((k, w) for k, w in self.weights if fits(k)),
                       schedule=tuple(k for k in self.schedule if fits(k)))


PROFILES = {
    # Deterministic: every kind of fault the CI test asserts, once (two sigstops of a task), in ~40 s;
    # the restarted scheduler is down 2-5 s. Drawn faults fill the time the schedule leaves (no more
    # scheduler restarts: each one's orphans hold a run ~20 s, see docs/reliability.md).
    "ci": AirflowProfile(
        "ci", seconds=40.0, warmup=8.0, gap=(1.5, 3.0), scheduler_down=(2.0, 5.0),
        schedule=("scheduler-restart", "sigstop-task", "sigstop-worker", "kill-task", "kill-supervisor",
                  "kill-worker", "terminate", "store-down", "sigstop-task"),
        weights=(("sigstop-task", 3), ("sigstop-worker", 2), ("kill-task", 1), ("terminate", 1)),
    ),
    "long": AirflowProfile("long", seconds=900.0),
    # The broken variants need no nemesis to show: two tasks of one key overlap in every run.
    "smoke": AirflowProfile("smoke", seconds=15.0, weights=(), schedule=(), warmup=0.0),
}
