"""How long a run would take under another xdist scheduling, from a run's measured test durations.

    scripts/test --junitxml=/tmp/run.xml          # any full run
    .venv/bin/python -m tests.schedule_sim /tmp/run.xml [--workers 5]

Drives xdist's own scheduler classes (and tests/conftest.py's) with the run's collection and each test's
seconds (setup + call + teardown as the JUnit report gives them, measured beside the run's other work),
the way xdist's controller and workers do: a worker starts a test only once it knows the next one or is
told to stop, and reports each test when it ends, which is when the scheduler hands out more. The UI
world (tests/ui/conftest.py, session-scoped) is started once per process that runs a test of its files:
its start (the first UI test's seconds beyond its file's median) is added again for every process after
the first. Worker start-up and collection are not counted. A model, not a run: the figures compare
schedulings of one run's work; docs/testing.md has what it gave.
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def durations(junit: Path) -> dict[str, float]:
    """Node id -> seconds, from a JUnit report (``classname`` is the dotted module path, then any class)."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        for i in range(len(parts), 0, -1):
            module = "/".join(parts[:i]) + ".py"
            if (ROOT / module).exists():
                out["::".join([module, *parts[i:], case.get("name", "")])] = float(case.get("time", 0))
                break
    return out


def collection() -> list[str]:
    """The node ids in the order tests/conftest.py gives them (longest unit first)."""
    ids: list[str] = []

    class Collect:
        def pytest_collection_finish(self, session: pytest.Session) -> None:
            ids.extend(item.nodeid for item in session.items)

    pytest.main(["--collect-only", "-qq", "--disable-warnings", "-p", "no:cacheprovider", str(ROOT / "tests")],
                plugins=[Collect()])
    return ids


class _Quiet:
    """A log for the schedulers that says nothing (xdist's prints every hand-out)."""

    def __getattr__(self, name: str) -> _Quiet:
        return self

    def __call__(self, *args: object) -> None:
        pass


class _Node:
    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.queue: list[int] = []
        self.shutting_down = False
        self.running = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def simulate(ids: list[str], seconds: dict[str, float], workers: int, make: Callable[[Any, Any], Any], reorder: bool,
             ui_files: tuple[str, ...], ui_start: float) -> tuple[float, list[float]]:
    """The run's length and each process's busy seconds under the scheduler ``make`` builds."""
    config = SimpleNamespace(getvalue={"tx": [f"{workers}*popen"], "dist": "loadfile"}.get,
                             option=SimpleNamespace(loadscopereorder=reorder))
    sched = make(config, _Quiet())
    nodes = [_Node(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, ids)
    sched.schedule()
    busy = [0.0] * workers
    ui_processes: set[int] = set()
    events: list[tuple[float, int, int]] = []

    def start(now: float) -> None:
        for i, node in enumerate(nodes):
            if not node.running and node.queue and (len(node.queue) >= 2 or node.shutting_down):
                index = node.queue.pop(0)
                took = seconds.get(ids[index], 0.0)
                if ids[index].split("::")[0] in ui_files and i not in ui_processes:
                    took += ui_start if ui_processes else 0.0  # this process starts the world again
                    ui_processes.add(i)
                node.running, busy[i] = True, busy[i] + took
                heapq.heappush(events, (now + took, i, index))

    now = 0.0
    start(now)
    while events:
        now, i, index = heapq.heappop(events)
        nodes[i].running = False
        sched.mark_test_complete(nodes[i], index)
        start(now)
    assert not any(node.queue for node in nodes), "tests left unrun"
    return now, busy


def main(argv: list[str] | None = None) -> int:
    from xdist.scheduler import LoadFileScheduling

    import tests.conftest as conftest

    parser = argparse.ArgumentParser(prog="python -m tests.schedule_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path)
    parser.add_argument("--workers", type=int, default=5)
    args = parser.parse_args(argv)
    seconds = durations(args.junit)
    ours = collection()
    # pytest's own order: files in path order, tests in the order they were collected.
    position = {nodeid: i for i, nodeid in enumerate(ours)}
    plain = sorted(ours, key=lambda n: (n.split("::")[0].split("/"), position[n]))
    first_ui = next(n for n in ours if n.split("::")[0] in conftest.UI_WORLD)
    same = [seconds[n] for n in ours if n.split("::")[0] == first_ui.split("::")[0] and n != first_ui and n in seconds]
    # A run without the UI tier (the inner loop, scripts/test --no-airflow) starts no UI world.
    ui_start = max(0.0, seconds.get(first_ui, 0.0) - statistics.median(same)) if same else 0.0
    print(f"{len(seconds)} tests measured, {sum(n not in seconds for n in ours)} of {len(ours)} without a figure; "
          f"the UI world's start ~{ui_start:.0f} s")
    for name, ids, make, reorder in (
        ("tests/conftest.py's FileScheduling, longest unit first", ours,
         conftest.pytest_xdist_make_scheduler, False),
        ("xdist --dist loadfile, its own order (most tests first)", plain, LoadFileScheduling, True),
        ("xdist --dist loadfile --no-loadscope-reorder, longest unit first", ours, LoadFileScheduling, False),
    ):
        length, busy = simulate(ids, seconds, args.workers, make, reorder, conftest.UI_WORLD, ui_start)
        print(f"{length:7.0f} s  {name} (busy per process: {', '.join(f'{b:.0f}' for b in busy)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
