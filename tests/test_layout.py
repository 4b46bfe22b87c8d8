"""The package's layering, checked on its source: Airflow internals behind one module, a core without Airflow.

- Outside ``airflow_lease_provider/version_compat.py`` a module may import from Airflow only its public
  interface (``PUBLIC_AIRFLOW``); every private or internal name goes through the compat module, so that
  one file says what changes between Airflow versions. No private Airflow name (a ``_`` module, class,
  method or attribute of Airflow's) is used anywhere else, and the compat module stays version flags,
  conditional imports and the few internals that need a reason (issue 40 item 3).
- ``airflow_lease_provider.core`` imports nothing from Airflow, nor from the Airflow-facing parts of the
  package, and imports in a process where Airflow cannot be imported at all.
- The task lease stays the lease's life, its overlap policies strategies beside it; imports of the package's
  own modules inside functions are few, each with its reason; no two subpackages import each other
  (issue 40 items 1 and 4).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "airflow_lease_provider"
COMPAT = PACKAGE / "version_compat.py"

#: The Airflow modules any module may import: the Task SDK's top level, the timetable, trigger and
#: plugin base classes Airflow documents for extension authors, the built-in cron timetable (documented for
#: DAG authors: the capped catch-up describes its schedule as it does), and provider packages.
PUBLIC_AIRFLOW = (
    "airflow.sdk", "airflow.timetables.base", "airflow.timetables.trigger", "airflow.triggers.base",
    "airflow.plugins_manager",
)
PUBLIC_AIRFLOW_PREFIXES = ("airflow.providers.",)


def _sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def _airflow_imports(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every import of an Airflow module or name in ``path``, and every string that names one
    where modules are looked up by name (``sys.modules``, ``importlib.import_module``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "airflow"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "airflow":
                found += [(node.lineno, f"{node.module}:{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"airflow(\.\w+)+", node.value):
                found.append((node.lineno, f"string {node.value!r}"))
    return found


def _is_public(what: str) -> bool:
    if what.startswith("string "):
        return False  # a module looked up by name is an internal contact by definition
    module, _, name = what.partition(":")
    if any(part.startswith("_") for part in module.split(".")) or name.startswith("_"):
        return False
    return module in PUBLIC_AIRFLOW or module.startswith(PUBLIC_AIRFLOW_PREFIXES)


def test_the_check_itself_sees_private_and_internal_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        textwrap.dedent(
            """
            import sys
            from airflow._shared.timezones.timezone import make_aware
            from airflow.timetables._cron import CronMixin
            from airflow.models.connection import Connection
            from airflow.sdk import BaseOperator, _private
            import airflow.utils.dates
            from airflow.providers.standard.operators.python import PythonOperator
            runner = sys.modules.get("airflow.sdk.execution_time.task_runner")
            """
        )
    )
    private = [what for _, what in _airflow_imports(sample) if not _is_public(what)]
    assert private == [
        "airflow._shared.timezones.timezone:make_aware",
        "airflow.timetables._cron:CronMixin",
        "airflow.models.connection:Connection",
        "airflow.sdk:_private",
        "airflow.utils.dates",
        "string 'airflow.sdk.execution_time.task_runner'",
    ]


def test_no_module_but_version_compat_reaches_airflow_internals() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in _sources(PACKAGE, ROOT / "dags_examples")
        if path != COMPAT
        for line, what in _airflow_imports(path)
        if not _is_public(what)
    ]
    assert offenders == [], "import these from airflow_lease_provider.version_compat:\n" + "\n".join(offenders)


def test_version_compat_is_where_the_internals_are() -> None:
    # The check above would pass vacuously if the names had simply vanished; they live here instead (imported,
    # or named for an import on first use).
    internal = {what.partition(":")[0] for _, what in _airflow_imports(COMPAT) if not _is_public(what)}
    assert {"airflow.sdk.bases.decorator", "airflow.sdk.definitions._internal.contextmanager"} <= internal
    assert {"string 'airflow.models.connection'", "string 'airflow.utils.dates'"} <= internal


# -- private Airflow names, and the one door (issue 40 item 3) ------------------------------------------------

#: Private Airflow names this package has used, looked for as names and attributes outside the compat module
#: (the checks below see any ``_`` import, override or assignment; these catch a bare use as well).
AIRFLOW_PRIVATE_NAMES = {
    "_TaskDecorator", "_expand", "_expand_called", "_time_restriction", "_align_to_prev", "_align_to_next",
    "CronMixin", "DagContext", "TaskGroupContext", "get_merged_defaults", "SUPERVISOR_COMMS",
}


def _private_uses(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every use in ``path`` of a name in :data:`AIRFLOW_PRIVATE_NAMES` (a name, an attribute, a
    definition, an imported name), and of every assignment to a ``_`` attribute of an object not ``self``/``cls``
    (someone else's private state)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = node.name
        elif isinstance(node, ast.alias):
            name = node.name.rpartition(".")[2]
        if name in AIRFLOW_PRIVATE_NAMES:
            found.append((getattr(node, "lineno", 0), name))
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute) and target.attr.startswith("_") and not target.attr.startswith("__")
                and not (isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"))
            ):
                found.append((node.lineno, f"assigns {ast.unparse(target)}"))
    return sorted(found)


def test_no_private_airflow_name_outside_version_compat(tmp_path: Path) -> None:
    # The core is checked apart (it imports nothing from Airflow; its own objects set each other's state).
    sources = [p for p in _sources(PACKAGE, ROOT / "dags_examples") if p != COMPAT and PACKAGE / "core" not in p.parents]
    offenders = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in sources for line, what in _private_uses(p)]
    assert offenders == [], "behind airflow_lease_provider/version_compat.py, with the reason:\n" + "\n".join(offenders)
    # The check sees each form the package once had.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from x import DagContext\n"
        "class D(Base):\n    def _expand(self, i):\n        return super()._expand(i)\n"
        "partial._expand_called = True\n"
        "self._mine = 1\n"
        "grid = CronMixin(e, 'UTC')\n"
    )
    assert _private_uses(sample) == [
        (1, "DagContext"), (3, "_expand"), (4, "_expand"), (5, "_expand_called"), (5, "assigns partial._expand_called"),
        (7, "CronMixin"),
    ]


def test_no_class_of_the_package_overrides_a_private_member_of_an_airflow_class() -> None:
    """A subclass that redefines Airflow's ``_x`` (``_TaskDecorator._expand``, once) breaks on any change to it."""
    import importlib
    import inspect
    import pkgutil
    from types import FunctionType

    import airflow_lease_provider

    offenders: list[str] = []
    names = [m.name for m in pkgutil.walk_packages(airflow_lease_provider.__path__, "airflow_lease_provider.")]
    for name in names:
        if name == "airflow_lease_provider.version_compat" or name.endswith((".s3_fence", ".fences.s3")):
            continue  # the one door; the S3 fence needs the s3 extra
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            airflow_bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "airflow"]
            for member, value in vars(cls).items():
                code = isinstance(value, FunctionType | property | classmethod | staticmethod)
                if code and member.startswith("_") and not member.startswith("__"):
                    owners = [b.__qualname__ for b in airflow_bases if member in vars(b)]
                    if owners:
                        offenders.append(f"{name}.{cls.__qualname__}.{member} overrides {owners[0]}.{member}")
    assert len(names) > 50
    assert offenders == []


#: The compat module's size: version flags, conditional imports, the internals with their reasons (the
#: standard provider's is about 60 lines).
COMPAT_MAX_LINES = 120


def test_version_compat_is_flags_conditional_imports_and_reasoned_internals() -> None:
    source = COMPAT.read_text()
    assert len(source.splitlines()) <= COMPAT_MAX_LINES
    tree = ast.parse(source)
    allowed = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.If, ast.FunctionDef, ast.Expr)
    assert [type(n).__name__ for n in tree.body if not isinstance(n, allowed)] == []  # no classes, no loops
    # Every branch is on a version flag or TYPE_CHECKING, and holds imports only.
    for node in (n for n in tree.body if isinstance(n, ast.If)):
        assert ast.unparse(node.test) in ("TYPE_CHECKING", "AIRFLOW_V_3_2_PLUS"), ast.unparse(node.test)
        assert all(isinstance(n, ast.Import | ast.ImportFrom) for n in (*node.body, *node.orelse))
    # Every version flag is used: by the compat module itself or by another module.
    flags = {t.id for n in tree.body if isinstance(n, ast.AnnAssign | ast.Assign)
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
             if isinstance(t, ast.Name) and t.id.startswith("AIRFLOW_V_")}
    assert flags
    others = "".join(p.read_text() for p in _sources(PACKAGE) if p != COMPAT)
    unused = [f for f in flags if source.count(f) < 2 and f not in others]
    assert unused == []
    # Every function says why it is here (the private or internal name it hides, or the version it bridges).
    for node in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name != "__getattr__"):
        assert ast.get_docstring(node), node.name


#: Client libraries of the user's write targets: their fences live in ``fences/``, never in the core (issue 40
#: item 2), so the core installs and imports with none of them.
TARGET_CLIENTS = ("airflow", "botocore", "boto3")


def test_core_source_imports_nothing_from_airflow_or_the_airflow_layer() -> None:
    offenders = []
    for path in _sources(PACKAGE / "core"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            modules: list[str] = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            for module in modules:
                top = module.split(".")[0]
                inside = module == "airflow_lease_provider" or module.startswith("airflow_lease_provider.core")
                if top in TARGET_CLIENTS or (top == "airflow_lease_provider" and not inside):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module}")
    assert offenders == []


def test_the_fences_of_targets_import_the_core_only_and_no_airflow() -> None:
    """``fences/`` holds the fences that need a target's client library; they import the core's interface and
    rule, nothing of the Airflow layer, and Airflow not at all (hooks build them from connections)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _sources(PACKAGE / "fences")
        for line, module in _imported_modules(path)
        if module.split(".")[0] == "airflow"
        or (module.startswith("airflow_lease_provider.") and not module.startswith("airflow_lease_provider.core."))
    ]
    assert offenders == []
    assert any(m == "botocore.exceptions.ClientError" for _, m in _imported_modules(PACKAGE / "fences" / "s3.py"))


def test_every_fence_is_the_one_interface_and_decides_by_the_one_rule() -> None:
    """Three fences, one interface (``core/fencing.py``): the PostgreSQL and DB-API fences are ``Fence``s,
    the object store's a ``FenceView``; none but ``fencing.py`` defines the rule or the decision, and the
    object store's fence calls the rule (the SQL fences are checked against it by the parity test)."""
    from airflow_lease_provider.core.dbapi_fence import DbApiFence
    from airflow_lease_provider.core.fence import FenceStore
    from airflow_lease_provider.core.fencing import Fence, FenceView
    from airflow_lease_provider.fences.s3 import ObjectFence

    assert issubclass(FenceStore, Fence) and issubclass(DbApiFence, Fence) and issubclass(ObjectFence, FenceView)
    for name in ("advance", "transaction", "current", "tokens", "published"):
        assert all(name in vars(cls) for cls in (FenceStore, DbApiFence)), name
    for name in ("current", "tokens", "published"):
        assert name in vars(ObjectFence), name
    defined = {
        path.relative_to(ROOT).as_posix(): node.name
        for path in _sources(PACKAGE)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in ("decide", "FenceDecision", "FenceEntry")
    }
    assert set(defined) == {"airflow_lease_provider/core/fencing.py"}, defined
    assert "decide(" in (PACKAGE / "fences" / "s3.py").read_text()


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``, including ``from X import name`` as ``X.name``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_the_cli_and_the_core_do_not_import_the_ui_package(tmp_path: Path) -> None:
    # The read model and TTL advice are domain logic (reading.py, ttl_advice.py); the UI package builds on them.
    sources = [PACKAGE / "cli.py", PACKAGE / "reading.py", PACKAGE / "ttl_advice.py", *_sources(PACKAGE / "core")]
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sources
        for line, module in _imported_modules(path)
        if module == "airflow_lease_provider.plugins" or module.startswith("airflow_lease_provider.plugins.")
    ]
    assert offenders == []
    # The check sees every import form.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import airflow_lease_provider.plugins.api\n"
        "from airflow_lease_provider.plugins import report\n"
        "from airflow_lease_provider import plugins\n"
    )
    assert [m for _, m in _imported_modules(sample)] == [
        "airflow_lease_provider.plugins.api", "airflow_lease_provider.plugins.report", "airflow_lease_provider.plugins",
    ]


# Run in a fresh interpreter: a meta-path finder refuses every ``airflow`` module, as if Airflow were
# not installed, then the core and each of its modules is imported.
_NO_AIRFLOW = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, sys

    class NoAirflow(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "airflow" or name.startswith("airflow."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, NoAirflow())
    import airflow_lease_provider.core as core
    names = [m.name for m in pkgutil.walk_packages(core.__path__, "airflow_lease_provider.core.")]
    for name in names:
        importlib.import_module(name)
    store = core.LeaseStore  # the public API is there
    leaked = sorted(m for m in sys.modules if m == "airflow" or m.startswith("airflow."))
    print(len(names), "modules", leaked)
    try:
        import airflow  # noqa: F401
    except ModuleNotFoundError:
        print("airflow blocked")
    """
)


def test_core_imports_with_airflow_absent() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _NO_AIRFLOW], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    count, _, rest = result.stdout.partition(" modules ")
    assert int(count) >= 10, result.stdout  # every core module was imported, not just the package
    assert rest.splitlines() == ["[]", "airflow blocked"], result.stdout


def test_the_airflow_layer_does_need_airflow() -> None:
    # The blocker works: the same process cannot import the Airflow-facing parts.
    code = _NO_AIRFLOW.split("import airflow_lease_provider.core")[0] + "import airflow_lease_provider.hooks\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode != 0
    assert "blocked by the test" in result.stderr


@pytest.mark.parametrize("found", ["2.11.0", "3.0.0", "3.0.6"])
def test_airflow_older_than_3_1_is_refused_with_a_clear_message(found: str) -> None:
    from airflow_lease_provider import MIN_AIRFLOW_VERSION, __version__, check_airflow_version

    with pytest.raises(RuntimeError) as raised:
        check_airflow_version(found)
    assert str(raised.value).startswith(
        f"The package `airflow-lease-provider:{__version__}` needs Apache Airflow {MIN_AIRFLOW_VERSION}+ "
        f"(found Apache Airflow {found})"
    )


@pytest.mark.parametrize("found", ["3.1.0rc1", "3.1.0", "3.1.8", "3.2.2", "3.3.2", "3.4.0.dev0"])
def test_supported_airflow_is_accepted(found: str) -> None:
    from airflow_lease_provider import check_airflow_version

    check_airflow_version(found)


def test_the_version_is_read_from_the_distribution_metadata() -> None:
    from importlib import metadata

    import tomllib

    from airflow_lease_provider import __version__
    from airflow_lease_provider.get_provider_info import get_provider_info

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert __version__ == metadata.version("airflow-lease-provider") == declared
    assert get_provider_info()["versions"] == [declared]
    # Written once: no module repeats the number.
    repeats = [p for p in _sources(PACKAGE) if f'"{declared}"' in p.read_text() and p.name != "get_provider_info.py"]
    assert repeats == []


LEASED = PACKAGE / "operators" / "leased.py"


def _operator_classes(path: Path) -> set[str]:
    """The classes ``path`` defines at its top level."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def _imports_from(path: Path, module: str, source: str | None = None) -> list[tuple[int, str]]:
    """(line, name) of every name ``path`` (or ``source``, as if it were ``path``) imports from ``module``,
    by absolute or relative import."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base == module:
                found += [(node.lineno, alias.name) for alias in node.names]
    return found


def test_operators_leased_is_only_the_operator() -> None:
    # What other modules need (argument checks, run identity, signal handling, the class factory) lives in
    # modules named for it; operators/leased.py defines the operator class and nothing beside it.
    tree = ast.parse(LEASED.read_text(), filename=str(LEASED))
    functions = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert functions == []
    assert _operator_classes(LEASED) == {"LeasedOperator"}
    assert "globals()" not in LEASED.read_text()


def test_no_module_imports_a_helper_from_operators_leased() -> None:
    allowed = _operator_classes(LEASED)
    importers = []
    offenders = []
    for path in _sources(PACKAGE, ROOT / "tests", ROOT / "dags_examples", ROOT / "bench", ROOT / "scripts"):
        for line, name in _imports_from(path, "airflow_lease_provider.operators.leased"):
            importers.append(path)
            if name not in allowed:
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert offenders == [], "import these from the module named for them, not operators/leased.py:\n" + "\n".join(
        offenders
    )
    # The check reads real imports: the operator package itself imports the operator class from there.
    assert PACKAGE / "operators" / "__init__.py" in importers


def test_the_import_check_resolves_relative_imports() -> None:
    source = "from .leased import LeasedOperator, check_name\nfrom . import leased\nfrom ..operators.leased import x\n"
    found = _imports_from(PACKAGE / "operators" / "sample.py", "airflow_lease_provider.operators.leased", source)
    assert found == [(1, "LeasedOperator"), (1, "check_name"), (3, "x")]


def test_the_provider_info_and_its_table_import_without_airflow() -> None:
    # Airflow calls get_provider_info while it is still configuring itself, in every process that
    # lists providers: the table must not import Airflow, nor the core (psycopg2, the store).
    code = _NO_AIRFLOW.split("import airflow_lease_provider.core")[0] + textwrap.dedent(
        """
        from airflow_lease_provider.get_provider_info import get_provider_info
        info = get_provider_info()
        leaked = sorted(
            m for m in sys.modules
            if m in ("airflow", "psycopg2", "airflow_lease_provider.core") or m.startswith("airflow.")
        )
        print(sorted(info["config"]["lease"]["options"]), leaked)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("'schema'] []"), result.stdout


# -- import cycles ------------------------------------------------------------------------------------


def _module_files(root: Path, *packages: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package) for every module of ``packages`` under ``root``."""
    found: dict[str, tuple[Path, bool]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports, anywhere in its file.

    Every import counts: at module level, inside a function (a deferred import still needs the other
    module, and hides the circle until that function runs) and under ``if TYPE_CHECKING:`` (a circle of
    types is a circle of concerns). ``from X import n`` is an edge to the module ``X.n`` when that is a
    module, else to ``X``; ``import X.Y`` to ``X.Y``. The parent packages Python also imports on the way
    are not edges: a package's ``__init__`` that imported its own submodules would otherwise be a circle.
    """
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name.split(".") if is_package else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            wanted: list[str] = []
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package[: len(package) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in wanted:
                while target and target not in modules:
                    target = target.rpartition(".")[0]  # a name inside a module: the module
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_import_cycle_in_the_package_or_the_bench() -> None:
    graph = _import_graph(_module_files(ROOT, "airflow_lease_provider", "bench"))
    assert len(graph) > 50 and graph["airflow_lease_provider.hooks.lease"]  # the graph was read
    assert _cycles(graph) == [], "modules that import each other (directly or through others)"


def test_the_cycle_check_sees_deferred_relative_and_indirect_imports(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "from pkg import a\n",  # a package importing its submodule: no circle
        "pkg/a.py": "def f():\n    from pkg import b\n",  # deferred, inside a function
        "pkg/b.py": "from .c import name\n",  # relative, a name from a module
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        "pkg/d.py": "import pkg.c\n",  # into the circle, not part of it
        "pkg/sub/__init__.py": "",
        "pkg/sub/e.py": "from .. import d\nfrom . import f\n",
        "pkg/sub/f.py": "from pkg.sub.e import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = _import_graph(_module_files(tmp_path, "pkg"))
    assert graph["pkg.sub.e"] == {"pkg.d", "pkg.sub.f"}
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.sub.e", "pkg.sub.f"]]


def _class_swaps(path: Path) -> list[int]:
    """Lines of ``path`` that assign an object's ``__class__`` (``x.__class__ = ...``, ``setattr(x, "__class__", ...)``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__class__":
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__class__"
        ):
            lines.append(node.lineno)
        flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple | ast.List) else [target])]
        lines += [t.lineno for t in flat if isinstance(t, ast.Attribute) and t.attr == "__class__"]
    return lines


def test_no_module_swaps_the_class_of_an_object(tmp_path: Path) -> None:
    """``@task.leased`` once turned Airflow's decorator object into another class (``decorator.__class__ = ...``);
    a class swap of someone else's object breaks on any change to that class. None is left."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}" for path in _sources(PACKAGE, ROOT / "dags_examples") for line in _class_swaps(path)
    ]
    assert offenders == []
    # The check sees every form.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "d.__class__ = Other\n"
        "a, d.__class__ = 1, Other\n"
        "setattr(d, '__class__', Other)\n"
        "object.__setattr__(d, '__class__', Other)\n"
        "d.__class__.__name__ = 'x'\n"  # renames the class, swaps nothing: not flagged
    )
    assert _class_swaps(sample) == [1, 2, 3, 4]


def test_no_shim_keeps_an_import_path_that_was_never_released() -> None:
    """Nothing was released (CHANGELOG.md): a name has one import path, no alias module or deprecated spelling
    (issue 40 item 5). ``current_lease`` is the runtime's; ``core.object_fence`` became ``fences.s3``."""
    import importlib.util

    for gone in ("airflow_lease_provider.context", "airflow_lease_provider.core.object_fence"):
        assert importlib.util.find_spec(gone) is None, gone
    for path in _sources(PACKAGE):
        assert "DeprecationWarning" not in path.read_text(), path


def test_the_driver_is_imported_only_by_the_core_s_database_layer() -> None:
    """psycopg2 is imported by ``core/db/`` alone (issue 24 item 2): the rest asks it for rows by name."""
    db_layer = PACKAGE / "core" / "db"
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if db_layer not in path.parents
        for line, module in _imported_modules(path)
        if module == "psycopg2" or module.startswith("psycopg2.")
    ]
    assert offenders == []
    # The check sees an import where there is one.
    assert any(m.startswith("psycopg2") for _, m in _imported_modules(db_layer / "database.py"))


# -- the task lease and its policies (issue 40 item 1) ---------------------------------------------------------

TASK_LEASE = PACKAGE / "runtime" / "task_lease.py"
POLICIES = PACKAGE / "runtime" / "policies.py"
TASK_LEASE_MAX_LINES = 450


def test_the_task_lease_keeps_the_lease_s_life_and_the_policies_are_strategies() -> None:
    assert len(TASK_LEASE.read_text().splitlines()) <= TASK_LEASE_MAX_LINES
    from airflow_lease_provider.runtime import policies

    # One class per policy, all of one interface, registered by name; the arguments accept exactly those.
    assert set(policies.OVERLAP_POLICIES) == {"skip", "wait", "fail", "replace"}
    for name, policy in policies.OVERLAP_POLICIES.items():
        assert isinstance(policy, policies.OverlapPolicy) and policy.name == name
    assert len({type(p) for p in policies.OVERLAP_POLICIES.values()}) == 4
    # The hub names no policy: no branch on a policy's name, class or flags in the task lease.
    branches = []
    for node in ast.walk(ast.parse(TASK_LEASE.read_text())):
        if isinstance(node, ast.Compare):
            values = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
            branches += [f"{node.lineno}: compares {v!r}" for v in values if v in policies.OVERLAP_POLICIES]
        elif isinstance(node, ast.Attribute) and node.attr in ("waits", "replaces", "max_waiting", "outcome"):
            branches.append(f"{node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in {type(p).__name__ for p in policies.OVERLAP_POLICIES.values()} - {
            "OverlapPolicy"  # the interface: what the hub holds
        }:
            branches.append(f"{node.lineno}: names {node.id}")
    assert branches == []
    # The operator only passes arguments: it neither acquires, holds nor records anything itself.
    leased = LEASED.read_text()
    for step in (".acquire(", ".hold(", ".record_catchup(", ".keep_for_run(", ".run_lease("):
        assert step not in leased, step


# -- imports inside functions, and loops between subpackages (issue 40 item 4) --------------------------------

#: At most this many imports of the package's own modules inside functions, each with its reason.
FUNCTION_IMPORTS_MAX = 15


def _function_level_imports(path: Path, package: str = "airflow_lease_provider") -> list[tuple[int, int, str]]:
    """(first line, last line, module) of every import of ``package``'s own modules inside a function of
    ``path`` (relative imports included)."""
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, ast.Import | ast.ImportFrom):
                if isinstance(child, ast.Import):
                    modules = [a.name for a in child.names]
                else:
                    modules = ["." * child.level + (child.module or "")]
                if any(m == package or m.startswith((package + ".", ".")) for m in modules):
                    found.append((child.lineno, child.end_lineno or child.lineno, modules[0]))
            visit(child, inside or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def _has_reason(lines: list[str], first: int, last: int) -> bool:
    """A comment on the import's lines, or in the three lines above it that are not imports of its run."""
    if any("#" in line for line in lines[first - 1 : last]):
        return True
    above, seen = first - 2, 0
    while above >= 0 and seen < 3:
        line = lines[above].strip()
        if line.startswith("#") or ("#" in line and line.startswith(("from ", "import "))):
            return True
        if line and not line.startswith(("from ", "import ")):
            seen += 1
        above -= 1
    return False


def test_imports_of_the_package_inside_functions_are_few_and_say_why(tmp_path: Path) -> None:
    found = {p: _function_level_imports(p) for p in _sources(PACKAGE)}
    total = sum(len(v) for v in found.values())
    assert 0 < total <= FUNCTION_IMPORTS_MAX, "\n".join(
        f"{p.relative_to(ROOT)}:{first}: {m}" for p, v in found.items() for first, _, m in v
    )
    unexplained = [
        f"{p.relative_to(ROOT)}:{first}: {module}"
        for p, imports in found.items()
        for first, last, module in imports
        if not _has_reason(p.read_text().splitlines(), first, last)
    ]
    assert unexplained == [], "say why this import is inside the function:\n" + "\n".join(unexplained)
    # The checks see what they look for.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import airflow_lease_provider\n"
        "def f():\n"
        "    # only where it is used: it imports boto3\n"
        "    from airflow_lease_provider.hooks import s3_fence\n"
        "    from airflow_lease_provider import settings\n"
        "    from . import x  # relative\n"
        "    import json\n"
        "def g():\n"
        "    x = 1\n"
        "    y = 2\n"
        "    z = 3\n"
        "    from airflow_lease_provider.core import (\n"
        "        LeaseStore,\n"
        "    )\n"
    )
    imports = _function_level_imports(sample)
    assert [(first, module) for first, _, module in imports] == [
        (4, "airflow_lease_provider.hooks"), (5, "airflow_lease_provider"), (6, "."), (12, "airflow_lease_provider.core"),
    ]
    lines = sample.read_text().splitlines()
    assert [_has_reason(lines, first, last) for first, last, _ in imports] == [True, True, True, False]


def test_no_two_subpackages_import_each_other() -> None:
    """Every import counts (inside functions too). A top-level module of the package is a part of its own.
    (The last loop, runtime <-> timetables through the catch-up recording, went with issue 40 item 4.)"""
    graph = _import_graph(_module_files(ROOT, "airflow_lease_provider"))
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        part = ".".join(module.split(".")[:2])
        parts.setdefault(part, set()).update(".".join(t.split(".")[:2]) for t in targets)
    for part, targets in parts.items():
        targets.discard(part)
    assert len(parts) > 15
    assert _cycles(parts) == []
