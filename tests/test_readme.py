"""The README is a front page for the people who write DAGs (issue 39): short, the first DAG early and
real, an install step, one picture of the UI, links that lead somewhere, and no lab notebook (commit
hashes, dated timings, defect narratives: those belong in docs/testing.md, docs/benchmarks.md and
CHANGELOG.md). PACKAGE.md, the PyPI page, shows the same DAG and the same install step."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PACKAGE = ROOT / "PACKAGE.md"


def _block(text: str, lang: str) -> tuple[int, str]:
    """The first fenced block of ``lang``: the line it starts on (1-based) and its code."""
    start = text.index(f"```{lang}\n")
    end = text.index("\n```", start)
    return text[:start].count("\n") + 1, text[start + len(lang) + 4 : end + 1]


def test_the_readme_is_short_and_shows_a_dag_early() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 120
    line, dag = _block(text, "python")
    assert line <= 40, f"the first DAG starts on line {line}"
    for shown in ("LeasedOperator.wrap(", "@task.leased(", "CappedCatchupTimetable(", "fenced_transaction("):
        assert shown in dag
    install = _block(text, "bash")[1]
    assert "pip install" in install and "--constraint" in install and "constraints-${AIRFLOW_VERSION}" in install
    for extra in ("embedded", "s3", "sql", "statsd"):
        assert f"`{extra}`" in text


def test_the_readme_dag_is_a_dag_airflow_loads(tmp_path: Path) -> None:
    from airflow.dag_processing.dagbag import DagBag

    from airflow_lease_provider.timetables import CappedCatchupTimetable

    (tmp_path / "first_dag.py").write_text(_block(README.read_text(), "python")[1])
    bag = DagBag(dag_folder=str(tmp_path), bundle_path=tmp_path, bundle_name="readme")
    assert bag.import_errors == {}
    dag = bag.dags["article_publisher"]
    assert sorted(dag.task_ids) == ["publish", "sync"]
    assert isinstance(dag.timetable, CappedCatchupTimetable) and dag.timetable.max_backfill == 1
    assert dag.get_task("sync").on_overlap == "wait"


def test_the_readme_is_no_lab_notebook() -> None:
    text = README.read_text()
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert hashes == [], f"commit hashes: {hashes}"
    timings = re.findall(r"\d+ min \d+ s|\d+(?:\.\d+)? ?s\b(?! of)|load average", text)
    assert timings == [], f"timings: {timings}"
    assert not re.search(r"open defect|not yet|\bred\b|failed at", text, re.IGNORECASE)


def test_the_picture_and_every_local_link_exist() -> None:
    text = README.read_text()
    images = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", text)
    assert images == ["docs/img/leases.png"]
    assert (ROOT / images[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for doc in (README, ROOT / "docs" / "README.md", ROOT / "CHANGELOG.md"):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not link.startswith("http"):
                assert (doc.parent / link).exists(), f"{doc.name} links to {link}, which does not exist"


def test_every_docs_page_is_in_the_index() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert [p for p in pages if f"]({p})" not in index] == []


def test_the_pypi_page_shows_the_same_dag_and_install() -> None:
    readme, package = README.read_text(), PACKAGE.read_text()
    assert _block(package, "python")[1] == _block(readme, "python")[1]
    assert _block(package, "bash")[1] == _block(readme, "bash")[1]
