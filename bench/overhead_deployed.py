"""Task overhead under a real deployment: the same DAGs as ``bench/overhead.py``, run by a scheduler,
dag-processor and api-server with the LocalExecutor (``demo.deployment.Deployment``, PostgreSQL metadata),
each task in its own task-runner process as in production; each task's duration is read back over the
REST API (``end_date - start_date`` of ``/dags/{dag}/dagRuns/{run}/taskInstances``).

The first DAG run of each DAG is a warm-up (the first parse, the first connection); the ``repeats`` after it
count. Per run the figure is the median leased task's duration over the median plain task's, as in-process.

With ``api`` (issue 41 item 5, ``python -m bench --api``): a third pairs DAG whose leased tasks take their
lease over HTTP through the api-server's lease API (``[lease] access = api`` in their processes; the
api-server has the ``lease_api`` connection and the same store, the deployment's metadata database), its
runs interleaved with the direct pairs' round by round: plain, leased direct and leased over the API in one
run, under the same load. Per round, the API arm's leased median over the direct arm's is recorded too.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.figures import spread
from bench.overhead import API_DAG_ID, DAG_FILE, DAG_FILE_API, DAG_FILE_XCOM, DAG_ID, XCOM_DAG_ID, _figures

MAPPED_DAG_ID = "lease_bench_overhead_mapped"


def _duration_s(ti: dict[str, Any]) -> float | None:
    if ti.get("duration") is not None:
        return float(ti["duration"])
    if ti.get("start_date") and ti.get("end_date"):
        start = datetime.datetime.fromisoformat(ti["start_date"].replace("Z", "+00:00"))
        end = datetime.datetime.fromisoformat(ti["end_date"].replace("Z", "+00:00"))
        return (end - start).total_seconds()
    return None


def _task_instances(api: Any, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
    """Every task instance of the run, page by page (the API's page limit is 100 by default)."""
    found: dict[str, dict[str, Any]] = {}
    offset = 0
    while True:
        reply = api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100, "offset": offset})
        page = reply["task_instances"]
        for ti in page:
            found[ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else "")] = ti
        offset += len(page)
        if not page or offset >= reply.get("total_entries", 0):
            return found


def _runs(api: Any, dag_id: str, count: int, timeout: float) -> list[dict[str, Any]]:
    runs = []
    for _ in range(count):
        run_id = api.trigger(dag_id)
        state = api.wait_for_run(dag_id, run_id, timeout=timeout)
        tis = _task_instances(api, dag_id, run_id)
        runs.append(
            {"wall_s": 0.0, "state": state, "run_id": run_id,
             "tasks": {t: [_duration_s(ti), str(ti["state"])] for t, ti in tis.items()}}
        )
    return runs


def _pairs(
    api: Any, dag_ids: list[str], repeats: int, pairs: int, timeout: float, method: str
) -> dict[str, dict[str, Any]]:
    """The pairs DAGs' figures, their runs interleaved (round by round, which goes first alternating) so each
    sees the same load; and whether each DAG's last run's first leased task pushed the ``lease`` XCom (what
    tells the reference arm from the default one)."""
    found: dict[str, list[dict[str, Any]]] = {dag_id: [] for dag_id in dag_ids}
    for round_ in range(repeats + 1):
        for dag_id in dag_ids if round_ % 2 == 0 else dag_ids[::-1]:
            found[dag_id].extend(_runs(api, dag_id, 1, timeout))
    out = {}
    for dag_id, runs in found.items():
        pushed = api.xcom(dag_id, runs[-1]["run_id"], "leased_0", "lease") is not None
        out[dag_id] = {**_figures(runs[1:], warmup=runs[0], pairs=pairs, method=method), "lease_xcom_pushed": pushed,
                       "interleaved_with": [d for d in dag_ids if d != dag_id]}
    return out


def _over_api(dsn: str, schema: str, pairs: int) -> int:
    """How many of the API arm's keys the store shows taken through the lease API (a capability digest on the
    row: the direct path leaves it NULL, docs/api.md decision 4): proof the arm went over HTTP."""
    import psycopg2
    from psycopg2 import sql

    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*) FROM {}.lease WHERE key = ANY(%s) AND api_capability IS NOT NULL")
                        .format(sql.Identifier(schema)), ([f"bench-overhead-a-{i}" for i in range(pairs)],))
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def api_against_direct(direct: dict[str, Any], over_api: dict[str, Any]) -> dict[str, Any]:
    """Per round (the two DAGs' runs next to each other): the API arm's leased median over the direct arm's."""
    ratios = [a["leased_median_ms"] / d["leased_median_ms"] for d, a in zip(direct["runs"], over_api["runs"], strict=True)
              if a.get("leased_median_ms") and d.get("leased_median_ms")]
    return {"ratios": ratios, "ratio": spread(ratios)}


def run_overhead_deployed(
    dsn: str, repeats: int, pairs: int, mapped: int, timeout: float = 1800.0, *, xcom: bool = True, api: bool = False,
    then: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The arms under one deployment: the pairs DAG, the same pairs with ``[lease] push_lease_xcom = true``
    (unless not ``xcom``), with ``api`` the same pairs over the lease API, and (with ``mapped``) the
    ``.expand()`` DAG. ``then``: called with the running deployment after the arms (the api-server's
    thousand leases of ``python -m bench --api``); what it returns is ``out["then"]``."""
    from demo.deployment import Deployment, MetadataTemplate

    source = Path(tempfile.mkdtemp(prefix="lease-bench-deployed-")) / f"{DAG_ID}.py"
    source.write_text(DAG_FILE)
    files = [source]
    if xcom:
        files.append(source.parent / f"{XCOM_DAG_ID}.py")
        files[-1].write_text(DAG_FILE_XCOM)
    if api:
        files.append(source.parent / f"{API_DAG_ID}.py")
        files[-1].write_text(DAG_FILE_API)
    schema = f"lease_bench_deployed_{os.getpid()}"
    env = {
        "LEASE_BENCH_PAIRS": str(pairs),
        "LEASE_BENCH_MAPPED": str(mapped),
        "AIRFLOW__LEASE__SCHEMA": schema,
        "AIRFLOW__METRICS__STATSD_ON": "False",
    }
    if api:  # the lease API enabled on the api-server (its acquire secret), read by the API arm's tasks too
        env["AIRFLOW_CONN_LEASE_API"] = json.dumps({"conn_type": "http", "password": secrets.token_urlsafe(32)})
    template = MetadataTemplate(dsn)
    out: dict[str, Any] = {}
    try:
        deployment = Deployment(template, files, extra_env=env)
        try:
            pair_dags = [DAG_ID] + ([XCOM_DAG_ID] if xcom else []) + ([API_DAG_ID] if api else [])
            dag_ids = {MAPPED_DAG_ID, *pair_dags}
            deployment.start(dag_ids)
            for dag_id in dag_ids:
                deployment.api.unpause(dag_id)
            method = "LocalExecutor deployment (PostgreSQL metadata), one process per task; REST task durations"
            found = _pairs(deployment.api, pair_dags, repeats, pairs, timeout, method)
            out["pairs"] = found[DAG_ID]
            if xcom:
                out["xcom"] = found[XCOM_DAG_ID]
            if api:
                out["api"] = {**found[API_DAG_ID], "access": "api",
                              "leased_over_api": _over_api(deployment.dsn, schema, pairs),
                              "api_over_direct": api_against_direct(found[DAG_ID], found[API_DAG_ID])}
            if then is not None:
                out["then"] = then(deployment)
            if mapped:
                runs = _runs(deployment.api, MAPPED_DAG_ID, repeats + 1, timeout)
                out["mapped"] = {**_figures(runs[1:], warmup=runs[0], pairs=mapped, method=method), "mapped": mapped}
        except Exception as exc:
            out.setdefault("pairs", {"status": f"not measured: {type(exc).__name__}: {str(exc)[:300]}"})
            if mapped:
                out.setdefault("mapped", {"status": f"not measured: {type(exc).__name__}: {str(exc)[:300]}"})
            out["tails"] = deployment.tails()[-4000:]
        finally:
            deployment.stop()
    finally:
        template.drop()
        shutil.rmtree(source.parent, ignore_errors=True)
    return out
