"""docs/benchmarks.md shows the committed run as the benchmark prints it, and every missed target says why.

The figures in "Results" are claims: each table there must be what ``python -m bench --report
bench/results.json`` prints for the committed run (its targets computed again from its cells by the current
report code), at the commit the section names. Nothing here runs a benchmark or needs a database.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.report import render
from bench.run import recomputed

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results.json"


def _report() -> str:
    return render(recomputed(json.loads(RESULTS.read_text())))


def _results_section() -> str:
    doc = DOC.read_text()
    start = doc.index("\n## Results\n")
    end = doc.index("\n## ", start + 1)
    return doc[start:end]


def test_every_table_of_the_committed_run_is_in_the_docs_as_the_report_prints_it() -> None:
    report = _report()
    sections = [s.strip() for s in re.split(r"(?m)^(?=### )", report[report.index("### Store arms"):]) if s.strip()]
    assert len(sections) >= 8, "the report lost its tables"
    results = _results_section()
    stale = [s.splitlines()[0] for s in sections if s not in results]
    assert not stale, f"docs/benchmarks.md 'Results' differs from `python -m bench --report bench/results.json` in: {stale}"


def test_the_docs_name_the_commit_the_committed_run_was_made_at() -> None:
    meta = json.loads(RESULTS.read_text())["meta"]
    assert meta["uncommitted_package_changes"] == []
    assert f"commit `{meta['git_head'][:7]}`" in _results_section()


def test_every_missed_issue_15_row_says_why_and_what_closing_it_would_cost() -> None:
    found = recomputed(json.loads(RESULTS.read_text()))["targets"]
    missed = [t for t in found if "MISS" in t["verdict"]]
    assert missed, "no row misses: this test (and docs/benchmarks.md's 'Why each miss') needs updating"
    assert all(t.get("cost") for t in missed), [t["figure"] for t in missed if not t.get("cost")]
    table = _report().split("### Issue 15 misses: why, and what closing each would cost", 1)[1]
    for t in missed:
        assert f"| {t['figure']} | {t['cost']} |" in table


def test_the_committed_overhead_run_is_in_the_docs_as_the_bench_prints_it() -> None:
    """Issue 28 item 1: ``python -m bench --overhead``'s table, from bench/results-overhead.json, at its commit."""
    from bench.report import overhead_report

    saved = json.loads((ROOT / "bench" / "results-overhead.json").read_text())
    assert saved["meta"]["uncommitted_package_changes"] == []
    table = overhead_report(saved).split("\n\n", 2)[2]
    doc = DOC.read_text()
    assert table in doc, "docs/benchmarks.md lacks the committed overhead run's table as the bench prints it"
    rows = table.splitlines()[2:]
    # A target row says PASS or MISS; a reference row (the lease XCom pushed, no target) says so instead.
    reference = "| reference (no target) | reference |"
    assert all(row.count("|") >= 6 and ("PASS" in row or "MISS" in row or reference in row) for row in rows), table
    assert sum("PASS" in row or "MISS" in row for row in rows) >= 2, table


def test_the_committed_api_run_is_in_the_docs_as_the_bench_prints_it() -> None:
    """Issue 41 item 5: ``python -m bench --api``'s tables, from bench/results-api.json, at its commit: the API
    arm's row against the target, the direct arm of the same run beside it, and the thousand leases."""
    from bench.report import api_report

    saved = json.loads((ROOT / "bench" / "results-api.json").read_text())
    assert saved["meta"]["uncommitted_package_changes"] == []
    tables = api_report(saved).split("\n\n", 2)[2]
    assert tables in DOC.read_text(), "docs/benchmarks.md lacks the committed API run's tables as the bench prints it"
    rows = [row for row in tables.splitlines() if row.startswith("| ") and "---" not in row]
    assert any("over the lease API" in row and ("PASS" in row or "MISS" in row) for row in rows), tables
    assert any(row.startswith("| no-op pairs, LocalExecutor") for row in rows), tables
    from bench.api_scale import verdict

    assert saved["api_scale"]["leases"] == 1000 and verdict(saved["api_scale"]) in tables


def _slugs(doc: str) -> set[str]:
    """GitHub's anchors of the doc's headings."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in doc.splitlines() if line.startswith("#")}


def test_the_index_at_the_top_names_the_current_figure_of_each_question() -> None:
    """Issue 39 item 5: one place (the doc's first section, and ``python -m bench.current`` for scripts) with
    each question's current figure, its file, commit and command; every anchor leads to its section."""
    from bench.current import QUESTIONS, rows, table

    doc = DOC.read_text()
    top = doc[: doc.index("\n## Running it\n")]
    assert "\n## The current figures\n" in top and table() in top
    assert {q.section for q in QUESTIONS} <= _slugs(doc)
    for row in rows():
        meta = json.loads((ROOT / row["file"]).read_text())["meta"]
        assert meta["uncommitted_package_changes"] == [] and row["commit"] == meta["git_head"][:7]


def test_no_results_file_beside_the_current_ones_is_superseded() -> None:
    """Each results file in bench/ is the current answer to a question in the index (the others are in
    bench/archive/), and a run answers only its own questions: the store run carries no task overhead."""
    from bench.current import QUESTIONS

    assert {p.name for p in (ROOT / "bench").glob("results*.json")} == {q.file for q in QUESTIONS}
    assert json.loads(RESULTS.read_text())["task_overhead"]["status"] != "measured"
    archive = ROOT / "bench" / "archive"
    listed = (archive / "README.md").read_text()
    assert all(f"`{p.name}`" in listed for p in archive.glob("*.json"))
