"""Task overhead: a no-op ``@task.leased`` against a no-op ``@task`` in the same DAG run.

One DAG holds ``pairs`` plain and ``pairs`` leased no-op tasks in one chain, alternating which of each
pair runs first, so both kinds see the same drift. A throwaway ``AIRFLOW_HOME`` (SQLite metadata) is
migrated (or gets a copy of a migrated database cached under ``bench/out``), then one subprocess runs ``dag.test()`` once to warm up (imports, the first connection) and
``repeats`` more times; each task's duration is read from the metadata database. Per run, the overhead
is the median leased task's duration minus the median plain task's. Each leased task resolves its
connection, opens a new store connection, checks the schema, acquires (durable), records the event,
starts the keeper, releases (durable) and records that: what a real task pays.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import psycopg2.extensions

from bench.figures import spread

DAG_ID = "lease_bench_overhead"

DAG_FILE = textwrap.dedent(
    '''
    """The task-overhead DAG of the benchmark (written by bench/overhead.py)."""

    from __future__ import annotations

    import datetime
    import os

    import pendulum
    from airflow.sdk import DAG, task

    PAIRS = int(os.environ["LEASE_BENCH_PAIRS"])

    with DAG(
        dag_id="lease_bench_overhead",
        schedule=None,
        start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
        catchup=False,
    ) as dag:
        previous = None
        for i in range(PAIRS):

            @task(task_id=f"plain_{i}")
            def plain():
                return None

            @task.leased(
                task_id=f"leased_{i}", lease_key=f"bench-overhead-{i}", lease_ttl=datetime.timedelta(minutes=5)
            )
            def leased():
                return None

            a, b = plain(), leased()
            first, second = (a, b) if i % 2 == 0 else (b, a)
            if previous is not None:
                previous >> first
            first >> second
            previous = second

    MAPPED = int(os.environ.get("LEASE_BENCH_MAPPED", "0"))

    with DAG(
        dag_id="lease_bench_overhead_mapped",
        schedule=None,
        start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
        catchup=False,
    ) as mapped_dag:

        @task
        def plain_mapped(i):
            return None

        @task.leased(lease_ttl=datetime.timedelta(minutes=5))  # one lease per instance: <dag>.<task>[i]
        def leased_mapped(i):
            return None

        if MAPPED:
            plain_mapped.expand(i=list(range(MAPPED)))
            leased_mapped.expand(i=list(range(MAPPED)))
    '''
)

#: The reference arm under a deployment: the same pairs under their own DAG id and keys, in a file of their own
#: that sets ``[lease] push_lease_xcom = true`` (the opt-in lease XCom) for the task processes that parse it
#: (under an executor a task's process parses only its own DAG's file), as a deployment's environment would.
XCOM_DAG_ID = "lease_bench_overhead_xcom"
DAG_FILE_XCOM = (
    DAG_FILE.replace("The task-overhead DAG of", "The task-overhead pairs with [lease] push_lease_xcom = true, of")
    .replace("\nimport pendulum\n", '\nos.environ["AIRFLOW__LEASE__PUSH_LEASE_XCOM"] = "true"\n\nimport pendulum\n')
    .replace('dag_id="lease_bench_overhead"', f'dag_id="{XCOM_DAG_ID}"')
    .replace('lease_key=f"bench-overhead-{i}"', 'lease_key=f"bench-overhead-x-{i}"')
    .replace('dag_id="lease_bench_overhead_mapped"', 'dag_id="lease_bench_overhead_mapped_xcom"')
    .replace('MAPPED = int(os.environ.get("LEASE_BENCH_MAPPED", "0"))', "MAPPED = 0")
)

#: The API-path arm under a deployment (issue 41 item 5): the same pairs under their own DAG id and keys, in a
#: file that sets ``[lease] access = api`` for the task processes that parse it, so each leased task takes,
#: renews and releases its lease over HTTP through the api-server's lease API (docs/api.md), with the same store
#: behind it; the api-server has the ``lease_api`` connection (``bench/overhead_deployed.py``).
API_DAG_ID = "lease_bench_overhead_api"
DAG_FILE_API = (
    DAG_FILE.replace("The task-overhead DAG of", "The task-overhead pairs over the lease API ([lease] access = api), of")
    .replace("\nimport pendulum\n", '\nos.environ["AIRFLOW__LEASE__ACCESS"] = "api"\n\nimport pendulum\n')
    .replace('dag_id="lease_bench_overhead"', f'dag_id="{API_DAG_ID}"')
    .replace('lease_key=f"bench-overhead-{i}"', 'lease_key=f"bench-overhead-a-{i}"')
    .replace('dag_id="lease_bench_overhead_mapped"', 'dag_id="lease_bench_overhead_mapped_api"')
    .replace('MAPPED = int(os.environ.get("LEASE_BENCH_MAPPED", "0"))', "MAPPED = 0")
)

RUNNER = textwrap.dedent(
    """
    import importlib.util, json, sys, time
    from sqlalchemy import func, select
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    spec = importlib.util.spec_from_file_location("lease_bench_overhead", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = []
    dag = getattr(module, sys.argv[3] if len(sys.argv) > 3 else "dag")
    for _ in range(int(sys.argv[2])):
        started = time.monotonic()
        run = dag.test()
        wall = time.monotonic() - started
        with create_session() as session:
            tis = session.scalars(select(TaskInstance).where(
                TaskInstance.dag_id == dag.dag_id, TaskInstance.run_id == run.run_id)).all()
            pushed = session.scalar(select(func.count()).select_from(XComModel).where(
                XComModel.dag_id == dag.dag_id, XComModel.run_id == run.run_id, XComModel.key == "lease"))
            runs.append({"wall_s": wall, "state": str(run.state), "lease_xcoms": pushed,
                         "tasks": {ti.task_id + (f"[{ti.map_index}]" if ti.map_index >= 0 else ""):
                                   [ti.duration, str(ti.state)] for ti in tis}})
    print("LEASE_BENCH_JSON " + json.dumps(runs))
    """
)


def _lease_connection(dsn: str) -> str:
    """The lease connection as Airflow JSON (a Unix-socket host does not survive URI parsing)."""
    info = psycopg2.extensions.parse_dsn(dsn)
    conn: dict[str, Any] = {"conn_type": "postgres", "host": info.get("host", "localhost")}
    for ours, theirs in (("port", "port"), ("user", "login"), ("password", "password"), ("dbname", "schema")):
        if info.get(ours):
            conn[theirs] = int(info[ours]) if ours == "port" else info[ours]
    return json.dumps(conn)


#: Migrated SQLite metadata databases, one per Airflow version: ``airflow db migrate`` takes 10-20 s here,
#: and a copy of a freshly migrated database is the same thing.
CACHE_DIR = Path(__file__).resolve().parent / "out"


def _metadata_db(home: Path, env: dict[str, str], timeout: float) -> str | None:
    """Put a migrated metadata database into ``home``; returns an error text when migrating failed."""
    from importlib.metadata import version

    cached = CACHE_DIR / f"airflow-{version('apache-airflow')}-migrated.db"
    target = home / "airflow.db"
    if cached.exists():
        shutil.copyfile(cached, target)
        return None
    airflow = str(Path(sys.executable).parent / "airflow")
    migrate = subprocess.run(
        [airflow, "db", "migrate"], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if migrate.returncode != 0:
        return migrate.stderr[-2000:]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(target, cached)
    return None


def run_overhead(
    dsn: str, schema: str, repeats: int, pairs: int, timeout: float = 300.0, *, mapped: int = 0,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Measure; returns the figures or a ``not measured`` record that says why.

    With ``mapped``: the DAG run is instead one ``.expand()`` of ``mapped`` plain and one of ``mapped``
    leased no-op instances (``lease_bench_overhead_mapped``), compared per run as the pairs are.
    ``extra_env``: more environment for the DAG runs' process (``AIRFLOW__LEASE__PUSH_LEASE_XCOM``)."""
    home = Path(tempfile.mkdtemp(prefix="lease-bench-airflow-"))
    try:
        dags = home / "dags"
        dags.mkdir()
        dag_file = dags / f"{DAG_ID}.py"
        dag_file.write_text(DAG_FILE)
        env = dict(os.environ)
        env.update(
            {
                "AIRFLOW_HOME": str(home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW_CONN_LEASE_DEFAULT": _lease_connection(dsn),
                "AIRFLOW__LEASE__SCHEMA": schema,
                "LEASE_BENCH_PAIRS": str(pairs),
                "LEASE_BENCH_MAPPED": str(mapped),
                **(extra_env or {}),
            }
        )
        failed = _metadata_db(home, env, timeout)
        if failed is not None:
            return {"status": "not measured: airflow db migrate failed", "stderr": failed}
        proc = subprocess.run(
            [sys.executable, "-c", RUNNER, str(dag_file), str(repeats + 1), "mapped_dag" if mapped else "dag"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout * (1 + mapped / 50),
            check=False,
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LEASE_BENCH_JSON ")), None)
        if line is None:
            tail = (proc.stdout + proc.stderr)[-3000:]
            return {"status": "not measured: the DAG runs failed", "output": tail}
        runs = json.loads(line.split(" ", 1)[1])
    finally:
        shutil.rmtree(home, ignore_errors=True)
    # Whether the leased tasks pushed the ``lease`` XCom (the last run's count): tells the opt-out arm apart.
    pushed = {"lease_xcoms_last_run": runs[-1].get("lease_xcoms")}
    if mapped:
        return {**_figures(runs[1:], warmup=runs[0], pairs=mapped), "mapped": mapped, **pushed}
    return {**_figures(runs[1:], warmup=runs[0], pairs=pairs), **pushed}


def _figures(runs: list[dict[str, Any]], *, warmup: dict[str, Any], pairs: int, method: str = "") -> dict[str, Any]:
    per_run = []
    for run in runs:
        tasks = run["tasks"]
        failed = [t for t, (_, state) in tasks.items() if not state.endswith("success")]
        plain = [d * 1000 for t, (d, _) in tasks.items() if t.startswith("plain_") and d is not None]
        leased = [d * 1000 for t, (d, _) in tasks.items() if t.startswith("leased_") and d is not None]
        ratio = statistics.median(leased) / statistics.median(plain) if plain and leased else None
        per_run.append(
            {
                "plain_median_ms": statistics.median(plain) if plain else None,
                "leased_median_ms": statistics.median(leased) if leased else None,
                "overhead_ms": statistics.median(leased) - statistics.median(plain)
                if plain and leased
                else None,
                "ratio": ratio,
                "failed_tasks": failed,
                "wall_s": run["wall_s"],
            }
        )
    return {
        "status": "measured",
        "method": method or "dag.test() in one process, SQLite metadata; TaskInstance.duration",
        "pairs_per_run": pairs,
        "runs": per_run,
        "warmup_run_wall_s": warmup["wall_s"],
        "overhead_ms": spread(r["overhead_ms"] for r in per_run),
        "plain_ms": spread(r["plain_median_ms"] for r in per_run),
        "leased_ms": spread(r["leased_median_ms"] for r in per_run),
        "ratio": spread(r["ratio"] for r in per_run),
    }
