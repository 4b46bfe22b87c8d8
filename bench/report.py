"""The printed tables (markdown, so docs/benchmarks.md can carry them verbatim) and the targets."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from bench import arms, pgbench
from bench.cells import PACED_INTERVAL, SCENARIO_TITLES, SCENARIOS, TOP_ONLY
from bench.figures import paired_ratios, spread

#: The store's smallest accepted TTL. There is no default TTL (``lease_ttl`` is required, or derived
#: from ``execution_timeout``), so the pressure target is judged against the strictest TTL/3 there is.
STRICTEST_TTL = timedelta(seconds=1)
PLACEHOLDER_OVERHEAD = "not yet measured: needs @task.leased"


# -- formatting ---------------------------------------------------------------------------------------


def _num(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "rate":
        return f"{value:,.0f}"
    if kind == "ms":
        return f"{value:.3g}" if value < 100 else f"{value:,.0f}"
    if kind == "bytes":
        return f"{value:,.0f}" if value >= 10 or value == 0 else f"{value:.2g}"
    if kind == "pct":
        return f"{value * 100:.0f}%"
    if kind == "x":
        return f"{value:.2f}x" if value < 100 else f"{value:,.0f}x"
    return f"{value:.3g}"


def cell_text(summary: dict[str, Any] | None, kind: str) -> str:
    """``median (min-max)``; just the median when all repeats agree."""
    if not summary:
        return "-"
    median, low, high = (_num(summary[k], kind) for k in ("median", "min", "max"))
    return median if low == high else f"{median} ({low}-{high})"


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]], align: str) -> list[str]:
    return [_row(header), _row(":--" if a == "l" else "--:" for a in align), *(_row(r) for r in rows)]


# -- tables -------------------------------------------------------------------------------------------


ALL_SCENARIOS = {**SCENARIOS, **TOP_ONLY}


def main_table(summary: list[dict[str, Any]]) -> list[str]:
    rows = []
    order = {name: i for i, name in enumerate(ALL_SCENARIOS)}
    for row in sorted(
        (r for r in summary if r["scenario"] in ALL_SCENARIOS),
        key=lambda r: (order[r["scenario"]], r["clients"], ALL_SCENARIOS[r["scenario"]].index(r["arm"])),
    ):
        flag = " (pool ran out)" if row.get("pool_exhausted") else ""
        flag += f" ({row['errors']} errors)" if row.get("errors") else ""
        rows.append(
            [
                SCENARIO_TITLES[row["scenario"]].split(" (")[0],
                str(row["clients"]),
                row["arm"] + flag,
                cell_text(row.get("attempts_per_s"), "rate"),
                cell_text(row.get("success_share"), "pct"),
                cell_text(row.get("p50_ms"), "ms"),
                cell_text(row.get("p99_ms"), "ms"),
                cell_text(row.get("wal_per_attempt"), "bytes"),
                cell_text(row.get("hot_share"), "pct"),
                cell_text(row.get("load1"), "load"),
            ]
        )
    header = [
        "scenario",
        "clients",
        "arm",
        "attempts/s",
        "ok",
        "p50 ms",
        "p99 ms",
        "WAL B/attempt",
        "HOT",
        "load1",
    ]
    return _table(header, rows, "lrlrrrrrrr")


def handoff_table(summary: list[dict[str, Any]]) -> list[str]:
    rows = []
    for row in sorted(
        (r for r in summary if r["scenario"] == "handoff"),
        key=lambda r: (r["clients"], SCENARIOS["handoff"].index(r["arm"])),
    ):
        rows.append(
            [
                str(row["clients"]),
                row["arm"],
                cell_text(row.get("successes_per_s"), "rate"),
                cell_text(row.get("handoff_p50_ms"), "ms"),
                cell_text(row.get("handoff_p99_ms"), "ms"),
                cell_text(row.get("wal_per_success"), "bytes"),
            ]
        )
    header = ["clients", "arm", "hand-offs/s", "hand-off p50 ms", "hand-off p99 ms", "WAL B/hand-off"]
    return _table(header, rows, "rlrrrr")


def pressure_table(cells: list[dict[str, Any]]) -> list[str]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        if cell["scenario"] == "pressure":
            groups.setdefault(cell["variant"], []).append(cell)
    rows = []
    for variant in sorted(groups, reverse=True):
        group = groups[variant]

        def fig(name: str, group: list[dict[str, Any]] = group) -> dict[str, Any] | None:
            return spread(c["figures"].get(name) for c in group)

        def tl(
            pick: Callable[[list[dict[str, Any]]], float | None], group: list[dict[str, Any]] = group
        ) -> Any:
            return spread(pick(c["figures"]["timeline"]) for c in group if c["figures"].get("timeline"))

        growth = spread(
            (c["figures"]["table_bytes_after"] - c["figures"]["table_bytes_before"]) / 1024
            for c in group
            if c["figures"].get("table_bytes_after") is not None
        )
        rows.append(
            [
                variant,
                str(group[0]["clients"]),
                cell_text(fig("attempts_per_s"), "rate"),
                cell_text(tl(lambda t: t[0]["attempts_per_s"]), "rate"),
                cell_text(tl(lambda t: t[-1]["attempts_per_s"]), "rate"),
                cell_text(fig("p99_ms"), "ms"),
                cell_text(tl(lambda t: max((b["p99_ms"] or 0) for b in t)), "ms"),
                cell_text(fig("hot_share"), "pct"),
                cell_text(fig("dead_tuples_after"), "rate"),
                cell_text(growth, "rate"),
            ]
        )
    header = [
        "variant",
        "clients",
        "renews/s",
        "first s",
        "last s",
        "p99 ms",
        "worst 1-s p99 ms",
        "HOT",
        "dead tuples",
        "lease table growth KiB",
    ]
    return _table(header, rows, "lrrrrrrrrr")


def catchup_table(catchup: dict[str, Any]) -> list[str]:
    rows = []
    for schedule in catchup.get("schedules", []):
        for name, arm in schedule["arms"].items():
            what, per = name, cell_text(arm["ms"], "ms")
            if name == "enumerate":
                what = (
                    f"enumerate: {len(arm['segment_slots'])} segments of "
                    f"{catchup['enumerate_seconds_per_segment']:g} s, {arm['slots_enumerated']:,} of "
                    f"{schedule['missed_slots']:,} slots in {arm['total_ms'] / 1000:.1f} s (lower bound)"
                )
                per = f"{_num(arm['total_ms'], 'ms')} for those slots ({cell_text(arm['ms_per_slot'], 'ms')} per slot)"
            rows.append([f"`{schedule['schedule']}`", what, per, f"{arm['croniter_calls']:,}"])
    return _table(["schedule", "arm", "ms per next-run computation", "croniter calls"], rows, "llrr")


def pgbench_lines(found: dict[str, Any]) -> list[str]:
    if found.get("status") != "measured":
        return [f"pgbench: {found.get('status')}"]
    rows = []
    for name, arm in found["arms"].items():
        upsert = found["ratios"].get(f"{name} / ShedLock upsert, prepared (as JDBC sends it)")
        update = found["ratios"].get(f"{name} / ShedLock UPDATE, prepared")
        rows.append(
            [
                name,
                cell_text(arm["tps"], "rate"),
                cell_text(arm["latency_avg_ms"], "ms"),
                cell_text(upsert, "x") if upsert else "1x" if "upsert" in name else "-",
                cell_text(update, "x") if update else "1x" if "UPDATE" in name else "-",
            ]
        )
    header = [
        f"statement ({found['clients']} clients, pgbench -j 2, {found['seconds']} s)",
        "attempts/s",
        "avg latency ms",
        "vs ShedLock upsert",
        "vs ShedLock UPDATE",
    ]
    return _table(header, rows, "lrrrr")


def overhead_lines(overhead: dict[str, Any]) -> list[str]:
    if overhead.get("status") != "measured":
        return [f"Task overhead: {overhead.get('status', PLACEHOLDER_OVERHEAD)}"]
    header = ["", "no-op @task", "no-op @task.leased", "added per task"]
    rows = [
        [
            f"median task duration, ms ({overhead['pairs_per_run']} of each per DAG run)",
            cell_text(overhead["plain_ms"], "ms"),
            cell_text(overhead["leased_ms"], "ms"),
            cell_text(overhead["overhead_ms"], "ms"),
        ]
    ]
    return _table(header, rows, "lrrr")


#: Issue 28 item 1: a no-op leased task against a no-op plain one in the same DAG run.
OVERHEAD_RATIO_TARGET = 1.25

#: The arms of issue 28 item 1 as ``python -m bench --overhead`` saves them, and how each row names them. The
#: default arms have no lease XCom (``[lease] push_lease_xcom`` defaults to false since issue 28).
OVERHEAD_ARMS = (
    ("in_process", "no-op pairs, in-process (`dag.test()`)"),
    # Saved by runs before the default changed (the default arms then pushed the XCom).
    ("in_process_no_xcom", "no-op pairs, in-process, opt-out `[lease] push_lease_xcom = false`"),
    ("in_process_xcom", "reference: no-op pairs, in-process, `[lease] push_lease_xcom = true`"),
    ("in_process_mapped", "`.expand()` of {n} each, in-process (`dag.test()`)"),
    ("deployed", "no-op pairs, LocalExecutor deployment (REST durations)"),
    ("deployed_no_xcom", "no-op pairs, LocalExecutor deployment, opt-out `[lease] push_lease_xcom = false`"),
    ("deployed_xcom", "reference: no-op pairs, LocalExecutor deployment, `[lease] push_lease_xcom = true`"),
    ("deployed_mapped", "`.expand()` of {n} each, LocalExecutor deployment (REST durations)"),
    # Issue 41 item 5 (``python -m bench --api``, bench/results-api.json): the same pairs, their leases over HTTP.
    ("deployed_api", "no-op pairs over the lease API (`[lease] access = api`), LocalExecutor deployment (REST durations)"),
)

#: Arms that runs saved before (or after) them lack (their rows are left out, not "not measured").
OPTIONAL_OVERHEAD_ARMS = ("in_process_xcom", "deployed_xcom", "in_process_no_xcom", "deployed_no_xcom", "deployed_api")
#: Arms measured for reference, not against the target (the opt-in lease XCom push).
REFERENCE_OVERHEAD_ARMS = ("in_process_xcom", "deployed_xcom")


def _run_ratios(overhead: dict[str, Any]) -> list[float]:
    """Per DAG run: the median leased task's duration over the median plain task's (saved runs before the
    ratio was recorded give it from their medians)."""
    out = []
    for run in overhead.get("runs", []):
        ratio = run.get("ratio")
        if ratio is None and run.get("plain_median_ms") and run.get("leased_median_ms") is not None:
            ratio = run["leased_median_ms"] / run["plain_median_ms"]
        if ratio is not None:
            out.append(ratio)
    return out


def overhead_targets(
    arms_found: dict[str, Any], commit: str | None, command: str, *, absent: str = "not measured",
    only: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """Issue 28 item 1's rows: leased / plain <= 1.25x in the same run, per arm, with PASS/MISS (the reference
    arms with their ratio and no verdict). ``absent``: what an arm not in ``arms_found`` says. ``only``: these
    arms' rows alone."""
    rows = []
    where = f"`{(commit or 'unknown')[:7]}`, `{command}`"
    for name, title in OVERHEAD_ARMS:
        if only is not None and name not in only:
            continue
        found = arms_found.get(name) or {}
        if name in OPTIONAL_OVERHEAD_ARMS and not found:  # a run saved before that arm was measured
            continue
        reference = name in REFERENCE_OVERHEAD_ARMS
        target = "reference (no target)" if reference else f"<= {OVERHEAD_RATIO_TARGET:g}x"
        figure = title.format(n=found.get("mapped", 500))
        ratios = _run_ratios(found) if found.get("status") == "measured" else []
        if not ratios:
            rows.append(_issue_row(figure, found.get("status", absent), target, "not measured", at=where))
            continue
        median = statistics.median(ratios)
        measured = (
            f"{_ratio_text(ratios)} (plain {cell_text(found['plain_ms'], 'ms')} ms, "
            f"leased {cell_text(found['leased_ms'], 'ms')} ms)"
        )
        verdict = "reference" if reference else _short(median, OVERHEAD_RATIO_TARGET, False)
        rows.append(_issue_row(figure, measured, target, verdict, ratios=ratios, at=where))
    return rows


def overhead_target_lines(overhead: dict[str, Any] | None, commit: str | None, command: str) -> list[str]:
    """The full bench's issue 28 item 1 rows: its in-process pairs arm; the other arms are measured by
    ``python -m bench --overhead`` (``bench/results-overhead.json``)."""
    found = overhead_targets({"in_process": overhead or {}}, commit, command,
                             absent="not measured in this run: `python -m bench --overhead`")
    rows = [[t["figure"], t["measured"], t["target"], t["verdict"], t["at"]] for t in found]
    return _table(["figure", "leased / plain (median (min-max) over runs)", "target", "verdict", "commit, command"],
                  rows, "lllll")


def overhead_report(results: dict[str, Any]) -> str:
    """What ``python -m bench --overhead`` prints: the issue 28 item 1 rows, with the commit and command."""
    meta = results["meta"]
    found = overhead_targets(results["task_overhead_runs"], meta.get("git_head"), meta.get("command", ""))
    rows = [[t["figure"], t["measured"], t["target"], t["verdict"], t["at"]] for t in found]
    lines = [
        "### Issue 28 item 1: leased / plain task duration in the same DAG run",
        "",
        f"{meta['cpus']} CPUs; load average at start {meta['load_start']}, at end {meta['load_end']}; "
        f"{meta['elapsed_s']:.0f} s. Each figure: median (min-max) over DAG runs after a warm-up run.",
        "",
        *_table(["figure", "leased / plain (median (min-max) over runs)", "target", "verdict", "commit, command"],
                rows, "lllll"),
    ]
    return "\n".join(lines)


def api_report(results: dict[str, Any]) -> str:
    """What ``python -m bench --api`` prints (issue 41 item 5): the direct and API-path overhead rows of one
    deployment run, the API arm against the direct one per round, and the thousand leases through the
    api-server, with the commit and command."""
    meta = results["meta"]
    runs = results["task_overhead_runs"]
    found = overhead_targets(runs, meta.get("git_head"), meta.get("command", ""), only=("deployed", "deployed_api"))
    rows = [[t["figure"], t["measured"], t["target"], t["verdict"], t["at"]] for t in found]
    api = runs.get("deployed_api") or {}
    against = (api.get("api_over_direct") or {}).get("ratios") or []
    rows.append(["leased over the API / leased direct, same round (reference)", _ratio_text(against),
                 "reference (no target)", "reference", found[0]["at"] if found else "-"])
    lines = [
        "### Issue 41 item 5: a leased task over the lease API, and a thousand leases through one api-server",
        "",
        f"{meta['cpus']} CPUs; load average at start {meta['load_start']}, at end {meta['load_end']}; "
        f"{meta['elapsed_s']:.0f} s. Each ratio: median (min-max) over DAG runs after a warm-up run; the "
        f"direct and API arms' runs interleaved round by round in one deployment (leased tasks over the API: "
        f"{api.get('leased_over_api', '-')} of {api.get('pairs_per_run', '-')} keys show a capability in the store).",
        "",
        *_table(["figure", "leased / plain (median (min-max) over runs)", "target", "verdict", "commit, command"],
                rows, "lllll"),
    ]
    scale = results.get("api_scale")
    if scale:
        lines += ["", *api_scale_lines(scale)]
    return "\n".join(lines)


def api_scale_lines(scale: dict[str, Any]) -> list[str]:
    """The thousand leases through one api-server, as a table (issue 41 item 5's second target)."""
    if "leases" not in scale:
        return [f"Leases through one api-server: {scale.get('verdict', 'not measured')}"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}" if value >= 10 else f"{value:.1f}"

    from bench.api_scale import verdict

    load = scale.get("load_1min_during") or {}
    header = ["leases", "TTL, renewal", "held / verified in store", "lost", "late renewals", "renewals",
              "HTTP errors", "renewal p50 / p99 / max ms", "acquire p50 / p99 ms", "api-server CPU",
              "`api_pool_size`", "peak DB backends", "load (1 min)", "verdict"]
    row = [f"{scale['leases']:,}", f"{scale['ttl_s']:g} s, every {scale['renew_every_s']:g} s",
           f"{scale['held']:,} / {scale['held_at_once_verified']:,}", str(scale["lost"]), str(scale["late_renewals"]),
           f"{scale['renewals']:,} ({scale['renewals_per_s']:.0f}/s)", str(scale["http_errors"]),
           f"{ms(scale['renew_p50_ms'])} / {ms(scale['renew_p99_ms'])} / {ms(scale['renew_max_ms'])}",
           f"{ms(scale['acquire_p50_ms'])} / {ms(scale['acquire_p99_ms'])}",
           f"{scale['api_server_cpu_s']:.0f} s over {scale['api_server_cpu_window_s']:.0f} s "
           f"({scale['api_server_cores']:.2f} cores)", str(scale["api_pool_size"]),
           str(scale["peak_database_backends"]),
           f"{load.get('min', 0):.1f}-{load.get('max', 0):.1f}" if load else "-", verdict(scale)]
    return _table(header, [row], "l" * len(header))


# -- targets ------------------------------------------------------------------------------------------


def _target(text: str, measured: str, passed: bool | None, **extra: Any) -> dict[str, Any]:
    verdict = "not measured" if passed is None else ("pass" if passed else "miss")
    return {"target": text, "measured": measured, "verdict": verdict, **extra}


def _ratio_text(ratios: list[float]) -> str:
    return cell_text(spread(ratios), "x") if ratios else "-"


def _per_repeat(
    cells: list[dict[str, Any]], scenario: str, arm: str, clients: int, figure: str, variant: str = ""
) -> list[float]:
    return [
        c["figures"][figure]
        for c in cells
        if c["scenario"] == scenario
        and c["arm"] == arm
        and c["clients"] == clients
        and c.get("variant", "") == variant
        and c["figures"].get(figure) is not None
    ]


def _renew_targets(cells: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    p99 = _per_repeat(cells, "renew", arms.LEASE, top, "p99_ms")
    floor = _per_repeat(cells, "floor", arms.SELECT1, top, "p99_ms")
    out = [
        _target(
            f"renew p99 <= 10 ms at {top} clients (back to back, saturated)",
            f"{cell_text(spread(p99), 'ms')} ms; SELECT 1 floor at {top} clients {cell_text(spread(floor), 'ms')} ms",
            bool(p99) and statistics.median(p99) <= 10,
            p99_ms=p99,
            floor_p99_ms=floor,
        )
    ]
    paced = _per_repeat(cells, "renew-paced", arms.LEASE, top, "p99_ms")
    if paced:
        out.append(
            _target(
                f"renew p99 <= 10 ms at {top} clients (paced: each renews every {PACED_INTERVAL * 1000:.0f} ms)",
                f"{cell_text(spread(paced), 'ms')} ms",
                statistics.median(paced) <= 10,
                p99_ms=paced,
            )
        )
    return out


def earlier_targets(
    cells: list[dict[str, Any]],
    clients: tuple[int, ...],
    catchup: dict[str, Any] | None,
    overhead: dict[str, Any] | None,
    pressure_clients: int,
) -> list[dict[str, Any]]:
    out = []
    top = 64
    if top in clients:
        ratios = paired_ratios(cells, "hot", top, arms.LEASE, arms.SHEDLOCK)
        wal = _per_repeat(cells, "hot", arms.LEASE, top, "wal_per_attempt")
        ok = bool(ratios) and statistics.median(ratios) >= 5 and bool(wal) and max(wal) == 0
        out.append(
            _target(
                "hot key, 64 clients: lease >= 5x ShedLock upsert attempts/s, 0 WAL bytes per failed attempt",
                f"{_ratio_text(ratios)}; WAL per failed attempt {cell_text(spread(wal), 'bytes')} B",
                ok,
                ratios=ratios,
                wal_per_attempt=wal,
            )
        )
    else:
        out.append(
            _target("hot key, 64 clients: lease >= 5x ShedLock upsert", "64 clients not in profile", None)
        )
    per_clients = {c: paired_ratios(cells, "success", c, arms.LEASE, arms.SHEDLOCK) for c in clients}
    ok = all(r and statistics.median(r) >= 0.9 for r in per_clients.values())
    out.append(
        _target(
            "success path: lease >= 0.9x ShedLock upsert at every concurrency",
            "; ".join(f"{c} clients {_ratio_text(r)}" for c, r in per_clients.items()),
            ok,
            ratios={str(c): r for c, r in per_clients.items()},
        )
    )
    if 1 in clients:
        ratios = paired_ratios(cells, "success", 1, arms.LEASE, arms.NAIVE)
        out.append(
            _target(
                "success path, 1 client: lease >= 1.5x read-then-CAS",
                _ratio_text(ratios),
                bool(ratios) and statistics.median(ratios) >= 1.5,
                ratios=ratios,
            )
        )
    if top in clients:
        out.extend(_renew_targets(cells, top))
    p99 = _per_repeat(cells, "pressure", arms.LEASE, pressure_clients, "p99_ms", "idle-in-transaction")
    limit_ms = STRICTEST_TTL.total_seconds() * 1000 / 3
    if p99:
        worst = [
            max((b["p99_ms"] or 0) for b in c["figures"]["timeline"])
            for c in cells
            if c["scenario"] == "pressure" and c.get("variant") == "idle-in-transaction"
        ]
        out.append(
            _target(
                f"pressure cell ({pressure_clients} clients renewing, idle-in-transaction session): renew p99 < TTL/3 "
                f"(no default TTL exists; judged at the smallest TTL, 1 s: {limit_ms:.0f} ms)",
                f"p99 {cell_text(spread(p99), 'ms')} ms; worst 1-s window {cell_text(spread(worst), 'ms')} ms",
                statistics.median(p99) < limit_ms and max(worst) < limit_ms,
                p99_ms=p99,
                worst_window_p99_ms=worst,
            )
        )
    if catchup and catchup.get("schedules"):
        for schedule in catchup["schedules"]:
            for name, ratio in schedule["ratios"].items():
                if ratio is None:
                    continue
                if name.endswith("/ latest-only"):
                    out.append(
                        _target(
                            f"catch-up `{schedule['schedule']}`: {name} <= 2x",
                            cell_text(ratio, "x"),
                            ratio["median"] <= 2,
                        )
                    )
                else:
                    out.append(
                        _target(
                            f"catch-up `{schedule['schedule']}`: {name} >= 1000x",
                            cell_text(ratio, "x"),
                            True if ratio["median"] >= 1000 else None,
                            note="enumeration timed over a prefix of the gap: a lower bound; below 1000x it proves nothing",
                        )
                    )
    else:
        out.append(_target("catch-up targets", "catch-up arm not run", None))
    if overhead and overhead.get("status") == "measured" and overhead.get("overhead_ms"):
        value = overhead["overhead_ms"]
        out.append(
            _target(
                "leased task overhead <= 50 ms per task",
                f"{cell_text(value, 'ms')} ms",
                value["median"] <= 50,
            )
        )
    else:
        status = (overhead or {}).get("status", PLACEHOLDER_OVERHEAD)
        out.append(_target("leased task overhead <= 50 ms per task", status, None))
    return out


def _short(median: float, target: float, at_least: bool) -> str:
    """PASS, or MISS with by how much."""
    if at_least:
        if median >= target:
            return "PASS"
        return f"MISS: short by {(1 - median / target) * 100:.0f}% ({median:.2f}x of {target:g}x)"
    if median <= target:
        return "PASS"
    return f"MISS: over by {(median / target - 1) * 100:.0f}% ({median:.2f}x against at most {target:g}x)"


def _issue_row(figure: str, measured: str, target: str, verdict: str, **extra: Any) -> dict[str, Any]:
    return {"figure": figure, "measured": measured, "target": target, "verdict": verdict, **extra}


def _ratio_row(
    figure: str, ratios: list[float], target: float, at_least: bool, measured: str = "", **extra: Any
) -> dict[str, Any]:
    target_text = f"{'>=' if at_least else '<='} {target:g}x"
    if not ratios:
        return _issue_row(figure, measured or "not measured in this run", target_text, "not measured", **extra)
    text = _ratio_text(ratios) + (f" ({measured})" if measured else "")
    return _issue_row(figure, text, target_text, _short(statistics.median(ratios), target, at_least), ratios=ratios, **extra)


def _rate_pair(cells: list[dict[str, Any]], scenario: str, clients: int, *arm_names: str) -> str:
    """Median attempts/s of each arm, ``a vs b / c``."""
    rates = [spread(_per_repeat(cells, scenario, name, clients, "attempts_per_s")) for name in arm_names]
    text = [cell_text(r, "rate") + "/s" if r else "-" for r in rates]
    return text[0] + " vs " + " / ".join(text[1:])


def _paired_cross(
    cells: list[dict[str, Any]], a: tuple[str, str], b: tuple[str, str], clients: int, figure: str
) -> list[float]:
    """(scenario, arm) ``a`` over ``b`` per repeat, at one concurrency (both ran in the same pool)."""
    def by_repeat(scenario: str, arm: str) -> dict[int, float]:
        return {
            c["repeat"]: c["figures"][figure]
            for c in cells
            if c["scenario"] == scenario and c["arm"] == arm and c["clients"] == clients and not c.get("variant")
            and c["figures"].get(figure) is not None
        }

    num, den = by_repeat(*a), by_repeat(*b)
    return [num[r] / den[r] for r in sorted(num) if r in den and den[r] > 0]


def _gain(cells: list[dict[str, Any]], scenario: str, clients: tuple[int, ...], before: str, label: str) -> str:
    """The lease against the same lease sent another way (``before``), in the same repeats, at each
    concurrency (empty if that arm was not measured)."""
    gains = [paired_ratios(cells, scenario, c, arms.LEASE, before) for c in clients]
    if not all(gains):
        return ""
    return f"; {label} at {' / '.join(map(str, clients))} clients " + " / ".join(_ratio_text(g) for g in gains)


def _prepared_gain(cells: list[dict[str, Any]], scenario: str, clients: tuple[int, ...]) -> str:
    return _gain(cells, scenario, clients, arms.LEASE_TEXT, "prepared vs as text")


def targets(
    cells: list[dict[str, Any]],
    clients: tuple[int, ...],
    sql_level: dict[str, Any] | None,
    catchup: dict[str, Any] | None,
    overhead: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """The rows of issue 15's table, in its order: figure, measured, target, verdict (PASS, or MISS by how much)."""
    top = max(clients)
    out = []
    # 1. hot key from pgbench: the acquire SQL against ShedLock's steady-state UPDATE.
    if sql_level and sql_level.get("status") == "measured":
        runs = sql_level["arms"]

        def pg(name: str) -> list[float]:
            return [r["tps"] for r in runs[name]["runs"] if "tps" in r]

        def pg_ratio(name: str) -> list[float]:
            return [
                a["tps"] / b["tps"]
                for a, b in zip(runs[name]["runs"], runs[pgbench.SHEDLOCK_UPDATE]["runs"], strict=True)
                if "tps" in a and "tps" in b
            ]

        def has(name: str) -> bool:
            return name in runs and bool(pg(name))

        # What the library sends (its prefix and EXECUTE of its prepared statement); a run from before
        # the store prepared its statements has only the plain text.
        sent = pgbench.LEASE_SENT if has(pgbench.LEASE_SENT) else pgbench.LEASE_SIMPLE
        lease, shed = spread(pg(sent)), spread(pg(pgbench.SHEDLOCK_UPDATE))
        context = [
            f"SQL alone as text {_ratio_text(pg_ratio(pgbench.LEASE_SIMPLE))}",
            f"as text with the SET LOCAL prefix (a connection's first call) {_ratio_text(pg_ratio(pgbench.LEASE_WITH_PREFIX))}",
            f"SQL alone prepared {_ratio_text(pg_ratio(pgbench.LEASE_PREPARED))}",
            f"version 6's SQL {_ratio_text(pg_ratio(pgbench.LEASE_BEFORE))}",
            f"version 8's (SET search_path) {_ratio_text(pg_ratio(pgbench.LEASE_V8_SIMPLE))}, "
            f"prepared {_ratio_text(pg_ratio(pgbench.LEASE_V8_PREPARED))}",
        ]
        if has(pgbench.HOLDER_FLOOR):
            context.append(
                f"the floor of any statement that returns the holder's row (a bare prepared SELECT of it) "
                f"{_ratio_text(pg_ratio(pgbench.HOLDER_FLOOR))}"
            )
        floor_text = _ratio_text(pg_ratio(pgbench.HOLDER_FLOOR)) if has(pgbench.HOLDER_FLOOR) else "not measured"
        out.append(
            _ratio_row(
                f"hot key, pgbench C client, {sql_level['clients']} clients: lease acquire as the library sends it "
                "vs ShedLock's conditional UPDATE (prepared)",
                pg_ratio(sent),
                1.0,
                True,
                f"{cell_text(lease, 'rate')} vs {cell_text(shed, 'rate')}/s; " + ", ".join(context),
                cost=(
                    "No statement that answers a held key with the holder's row (the skip reason: owner, token, "
                    f"expiry) reaches 1x: a bare prepared SELECT of that row is {floor_text}. Without the SET LOCAL "
                    f"prefix the call is {_ratio_text(pg_ratio(pgbench.LEASE_PREPARED))}; the prefix is the "
                    "server-side statement timeout, READ COMMITTED under a role's other default and the durable "
                    "commit, per transaction so that pgbouncer transaction pooling keeps them (docs/core.md)"
                ),
            )
        )
    else:
        out.append(_ratio_row("hot key, pgbench C client: lease acquire SQL vs ShedLock's conditional UPDATE", [], 1.0, True))
    # 2. hot key, Python clients, top concurrency: vs ShedLock UPDATE and vs read-then-CAS's SELECT.
    vs_update = paired_ratios(cells, "hot", top, arms.LEASE, arms.SHEDLOCK_UPDATE)
    vs_cas = paired_ratios(cells, "hot", top, arms.LEASE, arms.NAIVE)
    vs_upsert = paired_ratios(cells, "hot", top, arms.LEASE, arms.SHEDLOCK)
    wal = _per_repeat(cells, "hot", arms.LEASE, top, "wal_per_attempt")
    if vs_update and vs_cas:
        verdicts = [_short(statistics.median(vs_update), 1.0, True), _short(statistics.median(vs_cas), 0.8, True)]
        verdict = "PASS" if verdicts == ["PASS", "PASS"] else f"vs UPDATE {verdicts[0]}; vs CAS {verdicts[1]}"
        if wal and max(wal) != 0:
            verdict += f"; MISS: a failed attempt wrote {max(wal):.0f} WAL bytes"
        out.append(
            _issue_row(
                f"hot key, Python clients, {top} clients: lease vs ShedLock UPDATE / vs read-then-CAS's SELECT",
                f"{_rate_pair(cells, 'hot', top, arms.LEASE, arms.SHEDLOCK_UPDATE, arms.NAIVE)}: "
                f"{_ratio_text(vs_update)} / {_ratio_text(vs_cas)} (vs the upsert {_ratio_text(vs_upsert)}); "
                f"WAL per failed attempt {cell_text(spread(wal), 'bytes')} B"
                + _prepared_gain(cells, "hot", clients),
                ">= 1.0x / >= 0.8x, 0 WAL bytes",
                verdict,
                cost=(
                    "The SQL of the row above, plus the library's Python around each call (every argument "
                    "validated, the watchdog that bounds a hung server, a typed Lease), against one bare "
                    "statement on a bare cursor. Closing it needs the row above closed and that Python gone: "
                    "clear errors for bad input and failing closed on a hung store"
                ),
                ratios_vs_update=vs_update,
                ratios_vs_cas=vs_cas,
                wal_per_attempt=wal,
            )
        )
    else:
        out.append(_ratio_row(f"hot key, Python clients, {top} clients: lease vs ShedLock UPDATE / CAS", [], 1.0, True))
    # 3. renew vs ShedLock extend.
    out.append(
        _ratio_row(
            f"renew, Python clients, {top} clients: lease vs ShedLock extend",
            paired_ratios(cells, "renew", top, arms.LEASE, arms.SHEDLOCK_EXTEND),
            1.0,
            True,
            _rate_pair(cells, "renew", top, arms.LEASE, arms.SHEDLOCK_EXTEND) + _prepared_gain(cells, "renew", clients)
            + _gain(cells, "renew", clients, arms.LEASE_FUNCTION, "the UPDATE vs lease_renew()"),
            cost=(
                "Both are one UPDATE by primary key and one flushed commit; the lease also sends the SET LOCAL "
                "prefix (the first row's guarantees), returns the row (the keeper takes the new expiry from it) "
                "and runs the library's Python (the row above). Closing it costs the prefix or the row"
            ),
        )
    )
    # 4. success path vs the upsert at every concurrency.
    per = {c: paired_ratios(cells, "success", c, arms.LEASE, arms.SHEDLOCK) for c in clients}
    if all(per.values()):
        worst = min(statistics.median(r) for r in per.values())
        out.append(
            _issue_row(
                "success path vs ShedLock upsert, " + " / ".join(f"{c}" for c in clients) + " clients",
                " / ".join(_ratio_text(r) for r in per.values()) + _prepared_gain(cells, "success", clients),
                ">= 1.0x at every concurrency",
                _short(worst, 1.0, True) + ("" if worst >= 1 else " (the worst concurrency)"),
                cost=(
                    "One HOT update and one flushed commit each"
                    + (f" ({cell_text(spread(_per_repeat(cells, 'success', arms.LEASE, min(clients), 'wal_per_attempt')), 'bytes')} "
                       f"against {cell_text(spread(_per_repeat(cells, 'success', arms.SHEDLOCK, min(clients), 'wal_per_attempt')), 'bytes')} "
                       f"WAL bytes at {min(clients)} client{'s' if min(clients) > 1 else ''})"
                       if _per_repeat(cells, "success", arms.LEASE, min(clients), "wal_per_attempt") else "")
                    + ": where the commit dominates (few clients) the lease is level; with many clients on the "
                    "cores the CPU parts of the three rows above decide, and closing it costs what they cost"
                ),
                ratios={str(c): r for c, r in per.items()},
            )
        )
    else:
        out.append(_ratio_row("success path vs ShedLock upsert at every concurrency", [], 1.0, True))
    # 5. success path p50 at one client vs the durable-commit floor.
    if 1 in clients:
        ratios = _paired_cross(cells, ("success", arms.LEASE), ("floor", arms.COMMIT), 1, "p50_ms")
        flushed = _paired_cross(cells, ("success", arms.LEASE), ("floor", arms.FLUSHED_COMMIT), 1, "p50_ms")
        lease_p50 = spread(_per_repeat(cells, "success", arms.LEASE, 1, "p50_ms"))
        floor_p50 = spread(_per_repeat(cells, "floor", arms.COMMIT, 1, "p50_ms"))
        flushed_p50 = spread(_per_repeat(cells, "floor", arms.FLUSHED_COMMIT, 1, "p50_ms"))
        out.append(
            _ratio_row(
                "success path at 1 client, p50, vs the durable-commit floor (`txid_current`)",
                ratios,
                2.0,
                False,
                f"{cell_text(lease_p50, 'ms')} vs {cell_text(floor_p50, 'ms')} ms; `txid_current` does not wait "
                f"for a WAL flush: against a commit that does (one WAL record, flushed: {cell_text(flushed_p50, 'ms')} ms) "
                f"{_ratio_text(flushed)}",
                cost=(
                    "`txid_current` writes no WAL that must be flushed, so it does not wait for the disk; a grant "
                    f"must be on disk before it is acknowledged (durable tokens). Against a flushed commit it is "
                    f"{_ratio_text(flushed)}. Closing it against `txid_current` costs durable tokens "
                    "(synchronous_commit off: a crash could hand out an acknowledged token again)"
                ),
                ratios_vs_flushed_commit=flushed,
            )
        )
        # 6. the ledger's cost on the success path.
        out.append(
            _ratio_row(
                "lease+events vs lease alone (the ledger on, as Airflow runs it), 1 client",
                paired_ratios(cells, "success", 1, arms.LEASE_EVENTS, arms.LEASE),
                0.9,
                True,
                _rate_pair(cells, "success", 1, arms.LEASE_EVENTS, arms.LEASE),
                cost=(
                    "One round trip and one commit either way; the ledger adds the event row"
                    + (f" ({cell_text(spread(_per_repeat(cells, 'success', arms.LEASE_EVENTS, 1, 'wal_per_attempt')), 'bytes')} "
                       f"against {cell_text(spread(_per_repeat(cells, 'success', arms.LEASE, 1, 'wal_per_attempt')), 'bytes')} "
                       "WAL bytes per grant)" if _per_repeat(cells, "success", arms.LEASE_EVENTS, 1, "wal_per_attempt") else "")
                    + ": the row, its jsonb detail, the index entries the UI and CLI read it by (time; key; DAG; "
                    "run), and the subtransaction that keeps the event best effort. Closing it costs an index (the "
                    "read it serves) or best effort (a broken ledger would fail acquires)"
                ),
            )
        )
    # 7. renew p99 back to back vs SELECT 1's p99 in the same run.
    ratios = _paired_cross(cells, ("renew", arms.LEASE), ("floor", arms.SELECT1), top, "p99_ms")
    extend = _paired_cross(cells, ("renew", arms.SHEDLOCK_EXTEND), ("floor", arms.SELECT1), top, "p99_ms")
    paced = _per_repeat(cells, "renew-paced", arms.LEASE, top, "p99_ms")
    p99 = spread(_per_repeat(cells, "renew", arms.LEASE, top, "p99_ms"))
    floor = spread(_per_repeat(cells, "floor", arms.SELECT1, top, "p99_ms"))
    out.append(
        _ratio_row(
            f"renew p99 at {top} clients, back to back, vs `SELECT 1` p99 in the same run",
            ratios,
            2.0,
            False,
            f"{cell_text(p99, 'ms')} vs {cell_text(floor, 'ms')} ms",
            cost=(
                "Each renewal back to back waits for a flushed commit while all clients and the server share the "
                f"cores; `SELECT 1` waits for neither. ShedLock's extend, a bare UPDATE, is {_ratio_text(extend)} "
                "of the same floor"
                + (" (so no renewal that waits for the disk reaches 2x on this machine)"
                   if extend and statistics.median(extend) > 2 else "")
                + (f"; paced as the keeper renews (every {PACED_INTERVAL * 1000:.0f} ms), renew p99 is "
                   f"{cell_text(spread(paced), 'ms')} ms" if paced else "")
                + ". Closing it costs durable renewals, or the prefix and the library's Python of the rows above"
            ),
        )
    )
    # 8. catch-up N = 10 vs latest-only (every schedule the arm ran).
    found = []
    for schedule in (catchup or {}).get("schedules") or []:
        ratio = schedule["ratios"].get("capped N=10 / latest-only")
        if ratio:
            found.append((schedule["schedule"], ratio))
    if found:
        worst = max(r["median"] for _, r in found)
        out.append(
            _issue_row(
                f"catch-up after a {catchup['outage_days']}-day outage, N = 10, vs Airflow latest-only"
                if catchup and catchup.get("outage_days") else "catch-up, N = 10, vs Airflow latest-only",
                "; ".join(f"`{name}` {cell_text(r, 'x')}" for name, r in found),
                "<= 1.5x",
                _short(worst, 1.5, False),
            )
        )
    else:
        out.append(_issue_row("catch-up, N = 10, vs Airflow latest-only", "catch-up arm not run", "<= 1.5x", "not measured"))
    # 9. @task.leased overhead.
    if overhead and overhead.get("status") == "measured" and overhead.get("overhead_ms"):
        value = overhead["overhead_ms"]
        verdict = "PASS" if value["median"] <= 50 else f"MISS: over by {value['median'] - 50:.1f} ms"
        out.append(_issue_row("`@task.leased` overhead per task", f"{cell_text(value, 'ms')} ms", "<= 50 ms", verdict))
    else:
        status = (overhead or {}).get("status", PLACEHOLDER_OVERHEAD)
        out.append(_issue_row("`@task.leased` overhead per task", status, "<= 50 ms", "not measured"))
    return out


def before_after_lines(cells: list[dict[str, Any]], clients: tuple[int, ...]) -> list[str]:
    """The library's SQL against version 6's, through the same code path, in the same run."""
    rows = []
    for scenario in ("hot", "success", "renew"):
        for c in clients:
            speedup = paired_ratios(cells, scenario, c, arms.LEASE, arms.LEASE_BEFORE)
            if speedup:
                rows.append(
                    [
                        SCENARIO_TITLES[scenario].split(" (")[0],
                        str(c),
                        _rate_pair(cells, scenario, c, arms.LEASE, arms.LEASE_BEFORE),
                        _ratio_text(speedup),
                    ]
                )
    header = ["scenario", "clients", "attempts/s: now vs version 6", "now / version 6"]
    return _table(header, rows, "lrlr")


def issue_table(found: list[dict[str, Any]]) -> list[str]:
    rows = [[t["figure"], t["measured"], t["target"], t["verdict"]] for t in found]
    return _table(["figure", "measured (median (min-max) over repeats)", "target", "verdict"], rows, "llll")


def misses_table(found: list[dict[str, Any]]) -> list[str]:
    """Each missed row of issue 15's table with why it misses and what closing it would cost, from the same run."""
    rows = [[t["figure"], t["cost"]] for t in found if "MISS" in t["verdict"] and t.get("cost")]
    if not rows:
        return []
    return _table(["missed row", "why, and what closing it would cost"], rows, "ll")


def targets_table(found: list[dict[str, Any]]) -> list[str]:
    rows = [[t["target"], t["measured"], t["verdict"]] for t in found]
    return _table(["target", "measured (median (min-max) over repeats)", "verdict"], rows, "lll")


def render(results: dict[str, Any]) -> str:
    """Everything the command prints, as markdown."""
    meta = results["meta"]
    lines = [
        f"## lease benchmark ({meta['profile']} profile): {meta['server']['server_version']} at "
        f"{meta['server_where']}",
        "",
        f"{meta['cpus']} CPUs; load average at start {meta['load_start']}, at end {meta['load_end']}; "
        f"{meta['elapsed_s']:.0f} s. WAL: {meta['wal_method']}.",
        "Each figure: median (min-max) over "
        f"{meta['repeats']} interleaved repeats; cells of {meta['warmup_s']} s warm-up + {meta['duration_s']} s.",
        "",
        "### Store arms",
        "",
        *main_table(results["summary"]),
        "",
        "### Hand-off (release -> the next successful acquire, by anyone)",
        "",
        *handoff_table(results["summary"]),
        "",
    ]
    if results.get("pgbench_hot_key"):
        lines += [
            "### Hot key from a C client (pgbench): the SQL without Python clients",
            "",
            *pgbench_lines(results["pgbench_hot_key"]),
            "",
        ]
    if any(c["scenario"] == "pressure" for c in results["cells"]):
        lines += ["### Pressure cell", "", *pressure_table(results["cells"]), ""]
    if results.get("catchup"):
        lines += [
            f"### Catch-up after a {results['catchup']['outage_days']}-day outage",
            "",
            *catchup_table(results["catchup"]),
            "",
        ]
    lines += ["### Task overhead", "", *overhead_lines(results.get("task_overhead") or {}), ""]
    if (results.get("task_overhead") or {}).get("status") == "measured":  # else measured apart (--overhead)
        lines += [
            "### Issue 28 item 1: leased / plain task duration in the same DAG run",
            "",
            *overhead_target_lines(results.get("task_overhead"), meta.get("git_head"),
                                   meta.get("command", "python -m bench")),
            "",
        ]
    lines += ["### Issue 15 targets", "", *issue_table(results["targets"]), ""]
    misses = misses_table(results["targets"])
    if misses:
        lines += ["### Issue 15 misses: why, and what closing each would cost", "", *misses, ""]
    if results.get("earlier_targets"):
        lines += ["### Earlier targets", "", *targets_table(results["earlier_targets"]), ""]
    before = before_after_lines(results["cells"], tuple(meta["clients"]))
    if len(before) > 2:
        lines += ["### Now against version 6's SQL (same code path, same run)", "", *before, ""]
    return "\n".join(lines)
