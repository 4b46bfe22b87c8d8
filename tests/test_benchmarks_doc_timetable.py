"""docs/benchmarks.md shows the committed timetable run (issue 28 item 2) as ``python -m bench --timetable``
prints it, at the commit the run names, and every answer of that run was checked by brute force.

Nothing here runs a benchmark.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.timetable_rows import ROWS, timetable_report, verdict

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results-timetable.json"


def test_the_committed_timetable_run_is_in_the_docs_as_the_bench_prints_it() -> None:
    saved = json.loads(RESULTS.read_text())
    assert saved["meta"]["uncommitted_package_changes"] == []
    table = timetable_report(saved).split("\n\n", 2)[2]
    doc = DOC.read_text()
    assert table in doc, "docs/benchmarks.md lacks the committed timetable run's table as the bench prints it"
    assert f"`{saved['meta']['git_head'][:7]}`" in doc


def test_the_committed_run_covers_the_matrix_and_every_answer_is_checked() -> None:
    rows = json.loads(RESULTS.read_text())["rows"]
    measured = {(r["schedule"], r["zone"], r["years"], r["max_backfill"]) for r in rows}
    assert measured == set(ROWS)
    assert {r["call"] for r in rows} == {"first", "later", "dag_model"}
    assert all(r["checked"].startswith("ok") for r in rows), [
        r for r in rows if not r["checked"].startswith("ok")
    ]
    assert all(verdict(r).startswith(("PASS", "MISS")) for r in rows)
