"""Client processes: one per concurrent client, each with its own connection, started together.

A pool lives for one block of cells at one concurrency. Its processes are forked from the coordinator
(cheap: the modules are already imported) and connect after the fork. Every cell runs the same way:

1. the coordinator sends the cell to every client; each prepares (e.g. takes the lease it will renew)
   and waits at the barrier;
2. the coordinator, also at the barrier, reads the WAL position and table counters, sets a start time
   a little in the future, and meets the clients at the barrier again;
3. every client runs attempts from the start time for warm-up + duration, then flushes its table
   counters and reports. Only attempts that start after the warm-up count for rate and latency;
   WAL and HOT counters cover every attempt, warm-up included, and are divided by the total.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
import traceback
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from bench.arms import Client

#: How long a barrier or a client may take before the run is declared broken.
BARRIER_TIMEOUT = 120.0
#: Lead time between the coordinator's "go" and the common start instant.
START_LEAD = 0.02


@dataclass(frozen=True)
class CellSpec:
    """What every client of a cell runs.

    :ivar pool: free keys per client for the success path (ignored by other scenarios).
    :ivar timeline: keep each measured attempt's start offset, for per-second figures.
    :ivar interval: seconds between one client's attempts (open loop); 0 runs them back to back.
    """

    scenario: str
    arm: str
    clients: int
    warmup: float
    duration: float
    pool: int = 0
    timeline: bool = False
    interval: float = 0.0


@dataclass
class ClientResult:
    """One client's record of one cell. Times are ``time.monotonic_ns()``: one clock for all processes."""

    worker: int
    total_attempts: int = 0
    total_successes: int = 0
    attempts: int = 0
    successes: int = 0
    latencies_ns: array = field(default_factory=lambda: array("q"))
    starts_ns: array = field(default_factory=lambda: array("q"))
    success_at_ns: array = field(default_factory=lambda: array("q"))
    release_at_ns: array = field(default_factory=lambda: array("q"))
    measure_from_ns: int = 0
    error: str | None = None


def _run_attempts(client: Client, spec: CellSpec) -> ClientResult:
    result = ClientResult(worker=client.worker)
    attempt = client.build(spec.scenario, spec.arm, spec.pool)
    client.flush_stats()
    # Client-side garbage collection pauses would land on random arms: collect now (cheap: what was
    # inherited through fork is frozen), then keep the collector off until the cell ends.
    gc.collect()
    _BARRIER.wait(BARRIER_TIMEOUT)  # prepared
    _BARRIER.wait(BARRIER_TIMEOUT)  # go: the coordinator has read the counters and set the start
    start_ns = int(_GO_AT.value * 1e9)
    measure_from = start_ns + int(spec.warmup * 1e9)
    end = measure_from + int(spec.duration * 1e9)
    result.measure_from_ns = measure_from
    gc.disable()
    try:
        while time.monotonic_ns() < start_ns:
            time.sleep(0.0005)
        if spec.interval:
            _paced_loop(attempt.attempt, result, spec, start_ns, measure_from, end, client.worker)
        else:
            _loop(attempt.attempt, attempt.release, result, spec, measure_from, end)
    except Exception:
        result.error = traceback.format_exc(limit=5)
    finally:
        gc.enable()
    client.flush_stats()
    return result


def _loop(
    attempt: Callable[[], bool],
    release: Callable[[], None] | None,
    result: ClientResult,
    spec: CellSpec,
    measure_from: int,
    end: int,
) -> None:
    clock = time.monotonic_ns
    latencies = result.latencies_ns
    now = clock()
    while now < end:
        t0 = now
        ok = attempt()
        t1 = clock()
        result.total_attempts += 1
        measured = t0 >= measure_from
        if measured:
            latencies.append(t1 - t0)
            result.attempts += 1
            if spec.timeline:
                result.starts_ns.append(t0 - measure_from)
        if ok:
            result.total_successes += 1
            if measured:
                result.successes += 1
            if release is not None:
                r0 = clock()
                release()
                if measured:
                    result.success_at_ns.append(t1)
                    result.release_at_ns.append(r0)
                t1 = clock()
        now = t1


def _paced_loop(
    attempt: Callable[[], bool],
    result: ClientResult,
    spec: CellSpec,
    start_ns: int,
    measure_from: int,
    end: int,
    worker: int,
) -> None:
    """One attempt every ``spec.interval``, like a keeper's renewals; latency counts from the scheduled
    time, so an attempt that had to wait for a late predecessor is charged the wait (no coordinated
    omission)."""
    clock = time.monotonic_ns
    step = int(spec.interval * 1e9)
    # Spread the clients over the interval instead of firing them all at once.
    due = start_ns + (worker * 7919 % 1000) * step // 1000
    while due < end:
        now = clock()
        if now < due:
            time.sleep((due - now) / 1e9)
        ok = attempt()
        done = clock()
        result.total_attempts += 1
        result.total_successes += ok
        if due >= measure_from:
            result.latencies_ns.append(done - due)
            result.attempts += 1
            result.successes += ok
            if spec.timeline:
                result.starts_ns.append(due - measure_from)
        due += step


# Set in each forked client before its loop starts (inherited through fork, never pickled).
_BARRIER: Any = None
_GO_AT: Any = None


def _client_main(worker: int, dsn: str, schema: str, pipe: Connection, barrier: Any, go_at: Any) -> None:
    global _BARRIER, _GO_AT
    _BARRIER, _GO_AT = barrier, go_at
    # Everything inherited from the coordinator stays put: collections then only walk this client's own
    # objects and never touch (and so copy) the shared pages.
    gc.freeze()
    try:
        client = Client(worker, dsn, schema)
        pipe.send(("ready", client.backend_pid()))
    except Exception:
        pipe.send(("error", traceback.format_exc(limit=5)))
        return
    try:
        while True:
            spec = pipe.recv()
            if spec is None:
                break
            try:
                pipe.send(("done", _run_attempts(client, spec)))
            except Exception:
                barrier.abort()
                pipe.send(("error", traceback.format_exc(limit=5)))
    finally:
        client.close()


class BenchError(RuntimeError):
    """The benchmark could not run a cell (a client failed, a barrier broke, the server refused)."""


class ClientPool:
    """``clients`` forked client processes, each with one connection, for one block of cells."""

    def __init__(self, clients: int, dsn: str, schema: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.clients = clients
        self._barrier = ctx.Barrier(clients + 1)
        self._go_at = ctx.Value("d", 0.0)
        self._pipes: list[Connection] = []
        self._procs: list[Any] = []
        for worker in range(clients):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_client_main,
                args=(worker, dsn, schema, theirs, self._barrier, self._go_at),
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._pipes.append(ours)
            self._procs.append(proc)
        self.backend_pids: list[int] = []
        try:
            for pipe in self._pipes:
                kind, value = self._recv(pipe)
                if kind != "ready":
                    raise BenchError(f"a client could not connect:\n{value}")
                self.backend_pids.append(int(value))
        except BaseException:
            self.close()
            raise

    def _recv(self, pipe: Connection) -> tuple[str, Any]:
        if not pipe.poll(BARRIER_TIMEOUT + 60):
            raise BenchError("a client did not answer in time")
        kind, value = pipe.recv()
        return str(kind), value

    def run(self, spec: CellSpec, at_start: Callable[[], None]) -> list[ClientResult]:
        """Run one cell. ``at_start`` runs once every client is prepared, just before the start."""
        for pipe in self._pipes:
            pipe.send(spec)
        try:
            self._barrier.wait(BARRIER_TIMEOUT)
            at_start()
            self._go_at.value = time.monotonic() + START_LEAD
            self._barrier.wait(BARRIER_TIMEOUT)
        except Exception as exc:
            self._barrier.abort()
            errors = [value for kind, value in map(self._recv, self._pipes) if kind == "error"]
            raise BenchError(
                f"cell {spec.scenario}/{spec.arm}/{spec.clients} failed: {errors or exc}"
            ) from exc
        results: list[ClientResult] = []
        for pipe in self._pipes:
            kind, value = self._recv(pipe)
            if kind != "done":
                raise BenchError(f"cell {spec.scenario}/{spec.arm}/{spec.clients}: a client failed:\n{value}")
            results.append(value)
        return results

    def close(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for pipe in self._pipes:
            pipe.close()

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
