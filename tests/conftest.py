from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypothesis
import pytest

from airflow_lease_provider.core import FenceStore, LeaseStore
from tests.pg import EmbeddedServer, drop_schema, external_dsn, new_schema_name, scratch_dir, stop_shared

if TYPE_CHECKING:
    from demo.deployment import MetadataTemplate
    from tests.airflow.warm import WarmServer


# Hypothesis's per-example deadline (200 ms) is a timing check, not a property: on the loaded 2-core
# machine a cheap example took 264 ms once and failed the run (tests/core/test_default_keys.py). Off for
# the suite; a test's own ``@settings(deadline=...)`` still applies, and HYPOTHESIS_PROFILE picks another.
hypothesis.settings.register_profile("lease-suite", deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "lease-suite"))


# -- what the test processes build once per run and share (under xdist) ------------------------------------
#
# A migrated metadata database (PostgreSQL) and a migrated SQLite Airflow home are built by the first
# worker that needs one, under a file lock in a directory the controller makes for the run; the other
# workers read its record and copy from the same template. The controller removes them at the end.
# Without xdist the fixture builds and removes its own.

SHARED_DIR = "lease_shared_dir"


def _drop_metadata(record: dict[str, Any]) -> None:
    from demo.deployment import drop_database

    drop_database(record["admin_dsn"], record["name"])


def _remove_path(record: dict[str, Any]) -> None:
    shutil.rmtree(record["path"], ignore_errors=True)


def _stop_embedded(record: dict[str, Any]) -> None:
    stop_shared(record["path"])


def _stop_warm(record: dict[str, Any]) -> None:
    from tests.airflow.warm import WarmServer

    WarmServer(Path(record["socket"]), record["pid"]).stop()
    _remove_path(record)


#: How the controller removes each kind of shared record.
_CLEANUPS: dict[str, Callable[[dict[str, Any]], None]] = {
    "metadata": _drop_metadata, "airflow-sqlite": _remove_path, "warm-airflow": _stop_warm,
    "embedded-pg": _stop_embedded,
}


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        config.stash[_SHARED] = scratch_dir("lease-shared-")


_SHARED = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist, on the controller: tell each worker where the run's shared records are."""
    node.workerinput[SHARED_DIR] = str(node.config.stash[_SHARED])


def pytest_unconfigure(config: pytest.Config) -> None:
    shared = config.stash.get(_SHARED, None)
    if shared is None:
        return
    records = [json.loads(path.read_text()) for path in sorted(shared.glob("*.json"))]
    for record in sorted(records, key=lambda record: record["kind"] == "embedded-pg"):  # the server last
        with contextlib.suppress(Exception):
            _CLEANUPS[record["kind"]](record)
    shutil.rmtree(shared, ignore_errors=True)


@contextlib.contextmanager
def built_once(config: pytest.Config, name: str, kind: str, build: Callable[[], dict[str, Any]], *,
               shared: bool = True) -> Iterator[dict[str, Any]]:
    """The record of ``name``, built by ``build`` once per run: under xdist (and ``shared``) once for
    all workers (the first builds it under a lock, the rest read its record), else in this process."""
    workerinput = getattr(config, "workerinput", None)
    if not shared or workerinput is None or SHARED_DIR not in workerinput:
        record = {**build(), "kind": kind}
        try:
            yield record
        finally:
            _CLEANUPS[kind](record)
        return
    shared = Path(workerinput[SHARED_DIR])
    path = shared / f"{name}.json"
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not path.exists():
                record = {**build(), "kind": kind}
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(record))
                tmp.rename(path)
            record = json.loads(path.read_text())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    yield record  # the controller removes it (pytest_unconfigure)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.needs("pgbouncer", ...)``: the system tools of tests/tools.py, before any fixture."""
    from tests.tools import require

    for mark in item.iter_markers("needs"):
        for name in mark.args:
            require(name)


@pytest.fixture(scope="session")
def pg_dsn(pytestconfig: pytest.Config) -> Iterator[str]:
    """The server under test: ``LEASE_TEST_DSN`` if set, else a throwaway embedded PostgreSQL, one per run
    (shared by the xdist workers as ``LEASE_TEST_DSN``'s server is, so the migrated metadata template
    below is one per run on it too; one server per worker migrated a template on each)."""
    dsn = external_dsn()
    if dsn:
        yield dsn
        return

    def build() -> dict[str, Any]:
        owner = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
        server = EmbeddedServer(shared=True, owner=owner)
        return {"path": str(server.root), "dsn": server.dsn}

    with built_once(pytestconfig, "embedded-pg", "embedded-pg", build) as record:
        yield record["dsn"]


@pytest.fixture(scope="session")
def metadata_template(pg_dsn: str, pytestconfig: pytest.Config) -> Iterator[MetadataTemplate]:
    """A migrated Airflow metadata database: every tier that starts Airflow copies its databases from it
    (``CREATE DATABASE ... TEMPLATE``) instead of migrating one of its own (``airflow db migrate`` is
    most of a minute of CPU). One per run, shared by the xdist workers, on the run's server."""
    from demo.deployment import MetadataTemplate

    def build() -> dict[str, Any]:
        template = MetadataTemplate(pg_dsn)
        shutil.rmtree(template.root, ignore_errors=True)
        return {"admin_dsn": pg_dsn, "name": template.name}

    with built_once(pytestconfig, "metadata-template", "metadata", build) as record:
        template = MetadataTemplate.existing(record["admin_dsn"], record["name"])
        try:
            yield template
        finally:
            shutil.rmtree(template.root, ignore_errors=True)


@pytest.fixture(scope="session")
def airflow_template(pytestconfig: pytest.Config) -> Iterator[Path]:
    """An AIRFLOW_HOME with a migrated SQLite metadata database (``airflow.db``), to copy homes from:
    the ``airflow dags test`` tier and the UI tier's api-server. Once per run."""
    from tests.airflow.harness import migrate_template

    def build() -> dict[str, Any]:
        root = scratch_dir("lease-airflow-template-")
        try:
            home = migrate_template(root)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return {"path": str(root), "home": str(home)}

    with built_once(pytestconfig, "airflow-sqlite-template", "airflow-sqlite", build) as record:
        yield Path(record["home"])


#: ``LEASE_TEST_WARM_AIRFLOW=0`` runs every ``airflow`` command of the ``airflow_home`` tier as a process of
#: its own instead of a child of the warm server (tests/airflow/warm.py): the same tests, the cold way.
WARM_AIRFLOW = os.environ.get("LEASE_TEST_WARM_AIRFLOW", "1") != "0"


@pytest.fixture(scope="session")
def warm_airflow(airflow_template: Path, pytestconfig: pytest.Config) -> Iterator[WarmServer | None]:
    """The warm Airflow server the ``airflow_home`` tier's commands run in (tests/airflow/warm.py): one per
    run, shared by the xdist workers, on a home copied from the migrated template."""
    if not WARM_AIRFLOW:
        yield None
        return
    from tests.airflow.harness import DAGS, base_env
    from tests.airflow.warm import WarmServer

    def build() -> dict[str, Any]:
        root = scratch_dir("lease-warm-airflow-")
        try:
            home = root / "home"
            home.mkdir()
            shutil.copy(airflow_template / "airflow.db", home / "airflow.db")
            server = WarmServer.start(root, base_env(home, DAGS))
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return {"path": str(root), "socket": str(server.socket_path), "pid": server.pid}

    with built_once(pytestconfig, "warm-airflow", "warm-airflow", build) as record:
        yield WarmServer(Path(record["socket"]), record["pid"])


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    """A schema name of this test's own, dropped afterwards."""
    name = new_schema_name()
    yield name
    drop_schema(pg_dsn, name)


@pytest.fixture
def store(pg_dsn: str, schema: str) -> Iterator[LeaseStore]:
    leases = LeaseStore(pg_dsn, schema=schema)
    yield leases
    leases.close()


@pytest.fixture
def fences(pg_dsn: str, schema: str) -> Iterator[FenceStore]:
    fence_store = FenceStore(pg_dsn, schema=schema)
    yield fence_store
    fence_store.close()


# -- the budget: the longest test files, printed at the end of every run ----------------------------------

#: Seconds per test file: setup, call and teardown of each of its tests (a module-scoped fixture's start
#: counts in its first test's setup). Filled from the test reports, which under xdist arrive on the
#: controller from every worker, so this works with and without ``-n``.
_FILE_SECONDS: dict[str, float] = {}
#: CPU seconds per test file: the test process's own and that of the processes it started and reaped
#: (an Airflow CLI, a deployment's scheduler and what it reaped), measured per phase on the process
#: that ran the test. On two cores the wall time of a loaded run is mostly other files' CPU, so this is
#: the figure a file's cost is read from. A process nobody reaps (one killed by its parent's death and
#: taken by init) is not counted. A module's deployment counts in its file (its last test's teardown
#: reaps it); a session-scoped one (the UI world) in the last file of the process that started it.
_FILE_CPU: dict[str, float] = {}
_CPU_MARK = pytest.StashKey[float]()
CPU_PROPERTY = "lease_cpu_seconds"
LONGEST_FILES = 15


def _cpu_now() -> float:
    from tests.airflow.warm import CHILD_CPU  # the warm server's children this process had run

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + CHILD_CPU[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    item.stash[_CPU_MARK] = _cpu_now()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    now = _cpu_now()
    report.user_properties.append((CPU_PROPERTY, now - item.stash.get(_CPU_MARK, now)))
    item.stash[_CPU_MARK] = now


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    cpu = sum(float(value) for name, value in report.user_properties if name == CPU_PROPERTY)
    _FILE_CPU[path] = _FILE_CPU.get(path, 0.0) + cpu


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _FILE_SECONDS:
        return  # an xdist worker: the controller prints the whole run's figures
    longest = sorted(_FILE_SECONDS.items(), key=lambda item: item[1], reverse=True)[:LONGEST_FILES]
    terminalreporter.write_sep(
        "=", f"the {len(longest)} longest test files (s: setup + call + teardown; CPU s of it and its processes)"
    )
    for path, seconds in longest:
        terminalreporter.write_line(f"{seconds:8.1f} {_FILE_CPU.get(path, 0.0):8.1f} cpu  {path}")
    terminalreporter.write_line(
        f"{sum(_FILE_SECONDS.values()):8.1f} {sum(_FILE_CPU.values()):8.1f} cpu  all {len(_FILE_SECONDS)} files"
    )
    if times := os.environ.get("LEASE_TEST_TIMES"):  # every file's figures: DURATIONS below is one
        Path(times).write_text(json.dumps(
            {path: {"seconds": round(seconds, 1), "cpu": round(_FILE_CPU.get(path, 0.0), 1)}
             for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: item[1], reverse=True)},
            indent=1,
        ))
    by_cpu = sorted(_FILE_CPU.items(), key=lambda item: item[1], reverse=True)[:LONGEST_FILES]
    terminalreporter.write_sep("=", f"the {len(by_cpu)} test files that used the most CPU (s)")
    for path, cpu in by_cpu:
        terminalreporter.write_line(f"{cpu:8.1f}  {path}")


# -- scheduling under xdist: the longest units first, the UI's shared server in one process ----------------
#
# scripts/test runs ``--dist loadfile --no-loadscope-reorder``. With ``loadfile`` the scheduler below
# (``pytest_xdist_make_scheduler``) sends each file to one process, as xdist's own does (a module's
# deployment stays in one process), except the modules that share the UI tier's session-scoped ``world``
# (one api-server with seeded runs): those go to one process together, which starts it once. (xdist's
# ``loadgroup`` would do that with ``xdist_group`` marks, but with pytest 9.2 it groups nothing: it marks a
# group by rewriting the test's node id, which pytest no longer takes: pytest-xdist issue 1386, open.)
# The work units go out in collection order (``--no-loadscope-reorder``), and the collection is ordered
# longest unit first by the seconds of a full run (``DURATIONS``), so no long unit starts last and keeps
# one process busy after the others. xdist's own order is the units with the most tests first, which
# started the one-test scheduler files last.

#: Tests sent to a process on their own, apart from the rest of their file: they share no fixture wider
#: than a function with it, and together they made the file the longest unit of the run. The core fault
#: run's short profile (60 s of faults) and its broken variants (two pairs of 20 s, one module fixture)
#: are 131 s in one process, the longest file of the inner loop (``--no-airflow``); apart, they run
#: side by side (they are mostly waiting: 22 CPU s).
OWN_UNIT = ("tests/reliability/test_chaos.py::test_short_profile_zero_violations_over_5000_operations_and_every_fault",)
#: Files whose tests are each a work unit of their own: long files of independent tests (no fixture wider
#: than a function but the session's), each test one or two ``airflow dags test`` processes or a wait.
#: As one unit, ``test_leased_e2e.py`` was the longest of the run (418 s under load, 250 s idle) and
#: kept one process busy while the others had finished; apart, its tests fill the gaps beside the
#: deployments. A test in one of them that uses a module-, class- or package-scoped fixture is refused at
#: collection (it would start that fixture once per test, in several processes).
SPLIT_FILES = (
    "tests/airflow/test_leased_e2e.py",
    "tests/airflow/test_task_process_settings.py",
    "tests/airflow/test_terminate.py",
    "tests/cli/test_embedded_store.py",
    "tests/airflow/test_provider.py",
    "tests/airflow/test_wrap.py",
)
#: Files sharing the UI tier's ``world`` fixture (tests/ui/conftest.py).
UI_WORLD = ("tests/ui/test_api_server.py", "tests/ui/test_browser.py", "tests/ui/test_timeline_browser.py",
            "tests/ui/test_lease_api_server.py")
#: Every test file's seconds (setup + call + teardown of its tests) and CPU seconds in a full run: what
#: ``LEASE_TEST_TIMES=tests/durations.json scripts/test`` writes. Measured, not kept by hand: run that
#: again when the printed budget shows the order is off (a new long file, a file made faster).
DURATIONS = Path(__file__).with_name("durations.json")
#: A unit of a minute or more: see ``FileScheduling`` below.
LONG_SECONDS = 60.0
#: What a file the durations do not have yet is taken to last: one that starts Airflow about a typical
#: such file, one that does not next to nothing.
UNMEASURED_AIRFLOW_SECONDS, UNMEASURED_SECONDS = 30.0, 1.0


def _durations() -> dict[str, float]:
    try:
        return {path: float(found["seconds"]) for path, found in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


_MEASURED = _durations()
#: The units that are long, by the measured seconds (the UI world's files together).
LONG_UNITS = frozenset(
    {*OWN_UNIT, *(p for p, seconds in _MEASURED.items()
                  if seconds >= LONG_SECONDS and p not in UI_WORLD and p not in SPLIT_FILES)}
    | ({"ui-world"} if sum(_MEASURED.get(p, 0.0) for p in UI_WORLD) >= LONG_SECONDS else set())
)


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


#: Fixtures that build or start Airflow (its CLI, a deployment, a migrated metadata database), by the
#: conftest that defines them: a test using one is an ``airflow`` test, marked or not, so
#: ``-m "not airflow"`` (``scripts/test --no-airflow``) leaves it out.
AIRFLOW_FIXTURES = {
    "airflow_home": "tests.airflow.conftest",
    "airflow_template": "tests.conftest",
    "metadata_template": "tests.conftest",
    "celery_deployment": "tests.celery.conftest",
}


def _starts_airflow(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name, module in AIRFLOW_FIXTURES.items():
        definitions = info.name2fixturedefs.get(name)
        if definitions and getattr(definitions[-1].func, "__module__", None) == module:
            return True
    return False


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures of ``item`` wider than a function and narrower than the session."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return sorted(
        name for name, definitions in info.name2fixturedefs.items()
        if definitions and definitions[-1].scope in ("module", "class", "package")
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _file_of(item) in SPLIT_FILES and (shared := _shared_fixtures(item)):
            raise pytest.UsageError(
                f"{item.nodeid} uses {', '.join(shared)} (wider than a function): its file is in SPLIT_FILES "
                "(tests/conftest.py), whose tests run as units of their own; take the file out of it"
            )
        if not item.get_closest_marker("airflow") and _starts_airflow(item):
            item.add_marker(pytest.mark.airflow)
    ui_world = [f for f in UI_WORLD if f in {_file_of(i) for i in items}]

    def unit(item: pytest.Item) -> str:
        path = _file_of(item)
        return ui_world[0] if path in UI_WORLD else path  # the group goes where its first file goes

    tests_of: dict[str, int] = {}
    starts_airflow: set[str] = set()
    for item in items:
        tests_of[_file_of(item)] = tests_of.get(_file_of(item), 0) + 1
        if item.get_closest_marker("airflow") or item.get_closest_marker("celery"):
            starts_airflow.add(_file_of(item))

    def seconds(path: str) -> float:
        """A unit's expected seconds: a split file's are per test (each test is a unit)."""
        if path in UI_WORLD:
            return sum(_MEASURED.get(p, UNMEASURED_AIRFLOW_SECONDS) for p in UI_WORLD)
        found = _MEASURED.get(path, UNMEASURED_AIRFLOW_SECONDS if path in starts_airflow else UNMEASURED_SECONDS)
        return found / tests_of[path] if path in SPLIT_FILES else found

    order = {id(item): index for index, item in enumerate(items)}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(unit(item), index)
    # Longest unit first; equal ones, and the tests within a unit, in the collection's order.
    items.sort(key=lambda item: (-seconds(unit(item)), first[unit(item)], order[id(item)]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``: a work unit per file, the UI world's files one unit, each of ``OWN_UNIT`` and
    each test of ``SPLIT_FILES`` one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        """xdist's, with one change: a unit sent to a process still busy with a long unit is the queue's
        last (shortest), not its first.

        An xdist worker starts a test only once it knows the next (or is told to stop), so a process given
        a one-test unit, or down to its last two tests, is sent another unit at once, from the head of the
        queue: at the start each process took two of the longest units, one after the other, and a long
        one could wait behind a long one while other processes ran out of work.
        """

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if nodeid in OWN_UNIT or path in SPLIT_FILES:
                return nodeid
            return "ui-world" if path in UI_WORLD else path

        def _assign_work_unit(self, node: Any) -> None:
            busy = self.assigned_work.get(node, {})
            if len(self.workqueue) > 1 and any(
                scope in LONG_UNITS and not all(unit.values()) for scope, unit in busy.items()
            ):
                self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
            super()._assign_work_unit(node)

    return FileScheduling(config, log)
