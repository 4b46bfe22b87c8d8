"""Turning client records into figures: per cell, then median and min-max over repeats."""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from bench.pool import CellSpec, ClientResult

NS_PER_MS = 1_000_000


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1) of already sorted values; None when there are none."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return float(sorted_values[rank - 1])


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    """Median, min and max of the repeats' values (None values are left out)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "n": len(present)}


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / NS_PER_MS


def handoff_gaps_ns(results: list[ClientResult]) -> list[int]:
    """For every release, the time from its start to the next successful acquire by anyone.

    Leases are exclusive, so releases and successful acquires alternate; one clock (CLOCK_MONOTONIC)
    serves every process.
    """
    successes = sorted(t for r in results for t in r.success_at_ns)
    gaps = []
    for released in sorted(t for r in results for t in r.release_at_ns):
        i = bisect.bisect_right(successes, released)
        if i < len(successes):
            gaps.append(successes[i] - released)
    return gaps


def timeline(results: list[ClientResult], duration: float, bin_s: float = 1.0) -> list[dict[str, Any]]:
    """Per-bin attempts/s and p99, from each measured attempt's start offset and latency."""
    bins: list[list[int]] = [[] for _ in range(max(1, math.ceil(duration / bin_s)))]
    for r in results:
        for start, latency in zip(r.starts_ns, r.latencies_ns, strict=True):
            index = min(int(start / (bin_s * 1e9)), len(bins) - 1)
            bins[index].append(latency)
    out = []
    for i, values in enumerate(bins):
        values.sort()
        out.append(
            {
                "t_s": round(i * bin_s, 3),
                "attempts_per_s": len(values) / bin_s,
                "p50_ms": _ms(percentile(values, 0.50)),
                "p99_ms": _ms(percentile(values, 0.99)),
            }
        )
    return out


def cell_figures(
    spec: CellSpec,
    results: list[ClientResult],
    *,
    wal_raw: int,
    wal_attributed: dict[str, int] | None,
    hot: tuple[int, int] | None,
) -> dict[str, Any]:
    """The figures of one cell. ``hot`` is (updates, HOT updates) of the arm's main table in the cell."""
    attempts = sum(r.attempts for r in results)
    successes = sum(r.successes for r in results)
    total_attempts = sum(r.total_attempts for r in results)
    total_successes = sum(r.total_successes for r in results)
    latencies = sorted(v for r in results for v in r.latencies_ns)
    figures: dict[str, Any] = {
        "attempts": attempts,
        "successes": successes,
        "total_attempts": total_attempts,
        "total_successes": total_successes,
        "attempts_per_s": attempts / spec.duration,
        "successes_per_s": successes / spec.duration,
        "success_share": successes / attempts if attempts else None,
        "p50_ms": _ms(percentile(latencies, 0.50)),
        "p99_ms": _ms(percentile(latencies, 0.99)),
        "max_ms": _ms(latencies[-1]) if latencies else None,
        "wal_raw_bytes": wal_raw,
        "wal_raw_per_attempt": wal_raw / total_attempts if total_attempts else None,
        "wal_bytes": None,
        "wal_per_attempt": None,
        "wal_per_success": None,
        "hot_share": None,
        "updates": None,
        "hot_updates": None,
    }
    if wal_attributed is not None:
        figures["wal_bytes"] = wal_attributed["bytes"]
        figures["wal_records"] = wal_attributed["records"]
        figures["wal_fpi_records"] = wal_attributed["fpi_records"]
        figures["wal_per_attempt"] = wal_attributed["bytes"] / total_attempts if total_attempts else None
        figures["wal_per_success"] = wal_attributed["bytes"] / total_successes if total_successes else None
    if hot is not None:
        updates, hot_updates = hot
        figures["updates"], figures["hot_updates"] = updates, hot_updates
        figures["hot_share"] = hot_updates / updates if updates else None
    if spec.pool:
        figures["pool_exhausted"] = any(r.total_attempts > spec.pool for r in results)
    if any(r.success_at_ns for r in results):
        gaps = sorted(handoff_gaps_ns(results))
        figures["handoffs"] = len(gaps)
        figures["handoff_p50_ms"] = _ms(percentile(gaps, 0.50))
        figures["handoff_p99_ms"] = _ms(percentile(gaps, 0.99))
    if spec.timeline:
        figures["timeline"] = timeline(results, spec.duration)
    errors = [r.error for r in results if r.error]
    if errors:
        figures["errors"] = errors[:3]
    return figures


# The figures summarised over repeats (median, min, max), in the order the JSON lists them.
SUMMARY_FIGURES = (
    "attempts_per_s",
    "successes_per_s",
    "success_share",
    "p50_ms",
    "p99_ms",
    "handoff_p50_ms",
    "handoff_p99_ms",
    "wal_per_attempt",
    "wal_per_success",
    "wal_raw_per_attempt",
    "hot_share",
    "load1",
    "cpu_busy",
    "others_active",
)


def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (scenario, arm, clients, variant) with every figure's median and min-max."""
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for cell in cells:
        key = (cell["scenario"], cell["arm"], cell["clients"], cell.get("variant", ""))
        groups.setdefault(key, []).append(cell)
    rows = []
    for (scenario, arm, clients, variant), group in groups.items():
        row: dict[str, Any] = {
            "scenario": scenario,
            "arm": arm,
            "clients": clients,
            "variant": variant,
            "repeats": len(group),
        }
        for name in SUMMARY_FIGURES:
            summary = spread(cell["figures"].get(name) for cell in group)
            if summary is not None:
                row[name] = summary
        row["errors"] = sum(1 for cell in group if cell["figures"].get("errors"))
        row["pool_exhausted"] = any(cell["figures"].get("pool_exhausted") for cell in group)
        rows.append(row)
    return rows


def paired_ratios(
    cells: list[dict[str, Any]],
    scenario: str,
    clients: int,
    numerator: str,
    denominator: str,
    figure: str = "attempts_per_s",
) -> list[float]:
    """``numerator / denominator`` arm's figure, per repeat: the two cells ran next to each other."""
    by_repeat: dict[int, dict[str, float]] = {}
    for cell in cells:
        if cell["scenario"] == scenario and cell["clients"] == clients and not cell.get("variant"):
            value = cell["figures"].get(figure)
            if value is not None:
                by_repeat.setdefault(cell["repeat"], {})[cell["arm"]] = value
    return [
        arms[numerator] / arms[denominator]
        for arms in by_repeat.values()
        if numerator in arms and denominator in arms and arms[denominator] > 0
    ]
