"""Run the Airflow-level fault run: a deployment, the chaos DAGs, a nemesis; collect the history.

The deployment is :class:`demo.deployment.Deployment` (api-server, scheduler, dag-processor;
LocalExecutor, or with ``--executor celery`` CeleryExecutor and two Celery workers on the machine's Redis;
PostgreSQL metadata copied from a migrated template). The lease store is a database of
its own, reached by the tasks only through a :class:`demo.store_proxy.StoreProxy` (Airflow's metadata
does not go through it), so the nemesis can make the store unreachable for the tasks alone. The
history (the bodies' rows and the target's rows) lives in the store's database, written by the tasks
over a direct connection the nemesis never cuts.

Nemesis faults (every few seconds: first the profile's schedule, then at random of its kinds):

- ``sigstop-task``: SIGSTOP a running task process (its supervisor still heartbeats), SIGCONT later;
- ``sigstop-worker``: SIGSTOP the task process and its supervisor (the LocalExecutor worker's
  process for that task: no heartbeats, so the scheduler fails it over to a retry), SIGCONT later;
  with Celery the whole Celery worker that runs the task: its main process, its pool, every
  supervisor and task process in it;
- ``kill-task`` / ``kill-supervisor``: SIGKILL a task process / its supervisor (with Celery a pool
  process of the worker, which Celery replaces);
- ``kill-worker`` (Celery): SIGKILL a whole Celery worker with its tasks, start it again 2-6 s later
  (as a service manager does);
- ``scheduler-restart``: SIGKILL the scheduler's process group (the LocalExecutor's workers and their
  tasks with it), start a new scheduler a few seconds later (the capped catch-up DAG then catches up);
- ``terminate``: ``pg_terminate_backend`` of every store session (``application_name`` airflow-lease);
- ``store-down``: the proxy refuses and cuts every connection for a few seconds.

Task processes are found through the history (a running body's pid) and checked to carry this run's
marker in their environment (``CHAOS_AF_RUN``) before any signal is sent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg2
from psycopg2 import sql

from airflow_lease_provider.core import LeaseStore
from chaos.airflow.profiles import PROCESS_FAULTS, AirflowProfile
from demo.deployment import (
    EXECUTORS,
    Deployment,
    MetadataTemplate,
    connection_json,
    drop_database,
    with_database,
)
from demo.store_proxy import StoreProxy

log = logging.getLogger("chaos.airflow")

DAG_FILE = Path(__file__).parent / "dags" / "chaos_af.py"
DAG_IDS = ("chaos_pair", "chaos_mapped", "chaos_catchup")
#: The history's schema and the lease store's, in the store's database.
SCHEMA = "chaos_af"
LEASE_SCHEMA = "airflow_lease"
VARIANTS = ("correct", "lease-off", "unfenced")
HEARTBEAT_TIMEOUT = 10
#: After a scheduler dies its running task instances are orphans: the new scheduler's heartbeat check
#: only looks at the task instances it queued itself (``queued_by_job_id``), so they stay ``running``
#: until ``adopt_or_reset_orphaned_tasks`` finds the old scheduler dead (no heartbeat for
#: ``scheduler_health_check_threshold``) at its next ``orphaned_tasks_check_interval`` (defaults 30 s
#: and 300 s). Shortened here; docs/reliability.md says what it means for a deployment's recovery.
SCHEDULER_DEAD_AFTER = 15
ORPHAN_CHECK_EVERY = 5
#: A task whose Celery message a killed worker had received, but whose task process had not yet told
#: the API it runs, stays ``queued``: Airflow acknowledges Celery messages late (``task_acks_late``), so the
#: message waits in Redis's unacknowledged set for the broker's ``visibility_timeout`` (a day, Airflow's
#: default for Redis) and no worker gets it again; the scheduler requeues such a task only after
#: ``[scheduler] task_queued_timeout`` (default 600 s), checked every ``task_queued_timeout_check_interval``
#: (120 s). A ``kill-worker`` fault left a ``chaos_mapped`` part queued past the drain that way. Shortened
#: here (longer than any wait for a free worker slot in a run: a frozen worker holds its two for at most
#: 2.2 TTL); docs/reliability.md says what it means for a deployment.
QUEUED_TIMEOUT = 40
QUEUED_CHECK_EVERY = 5

_DDL = """
CREATE SCHEMA {schema};
CREATE TABLE {bodies} (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    dag_id      text        NOT NULL,
    run_id      text        NOT NULL,
    task_id     text        NOT NULL,
    map_index   integer     NOT NULL,
    try_number  integer     NOT NULL,
    key         text        NOT NULL,
    resource    text        NOT NULL,
    slot        text        NOT NULL,
    token       bigint,
    pid         integer     NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at    timestamptz,
    outcome     text
);
CREATE TABLE {target} (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    body      bigint      NOT NULL,
    resource  text        NOT NULL,
    key       text        NOT NULL,
    slot      text        NOT NULL,
    token     bigint,
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


def _connect(dsn: str) -> Any:
    conn = psycopg2.connect(dsn, connect_timeout=10, application_name="chaos-harness")
    conn.autocommit = True
    return conn


def _rows(conn: Any, table: str) -> list[dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(sql.Identifier(SCHEMA, table)))
        names = [c.name for c in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def _tree(root: int) -> list[int]:
    """``root`` and every live process descending from it, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = _ppid(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


class AirflowChaos:
    """One fault run: ``start()``, ``faults()``, ``settle()``, ``collect()``, ``close()``."""

    def __init__(self, profile: AirflowProfile, variant: str, out: Path, seed: int, admin_dsn: str,
                 template: str | None = None, executor: str = "local") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: expected one of {', '.join(VARIANTS)}")
        if executor not in EXECUTORS:
            raise ValueError(f"executor={executor!r}: expected one of {', '.join(EXECUTORS)}")
        self.executor = executor
        self.profile, self.variant, self.out, self.seed = profile.for_executor(executor), variant, out, seed
        self.random = random.Random(seed)
        self.admin_dsn = admin_dsn
        self.id = secrets.token_hex(6)
        self.own_template = template is None
        self.template = MetadataTemplate(admin_dsn) if template is None else MetadataTemplate.existing(admin_dsn, template)
        self.store_db = f"chaos_af_store_{self.id}"
        self.deployment: Deployment | None = None
        self.proxy: StoreProxy | None = None
        self.faults: list[dict[str, Any]] = []
        self.frozen: list[tuple[float, list[int], dict[str, Any]]] = []
        self.store_back_at: float | None = None
        self.scheduler_back_at: float | None = None
        self.schedulers = 1
        #: Celery workers killed and when each starts again, with its fault.
        self.workers_back: dict[str, tuple[float, dict[str, Any]]] = {}
        self.marks: dict[str, Any] = {}

    # -- set-up ---------------------------------------------------------------------------------------

    def start(self) -> None:
        conn = _connect(self.admin_dsn)
        try:
            with conn.cursor() as cur:
                cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.store_db)))
        finally:
            conn.close()
        self.store_dsn = with_database(self.admin_dsn, self.store_db)
        self.db = _connect(self.store_dsn)
        with self.db.cursor() as cur:
            cur.execute(sql.SQL(_DDL).format(schema=sql.Identifier(SCHEMA), bodies=sql.Identifier(SCHEMA, "bodies"),
                                              target=sql.Identifier(SCHEMA, "target")))
        with LeaseStore(self.store_dsn, schema=LEASE_SCHEMA) as store:
            store.ensure_schema()
        parts = psycopg2.extensions.parse_dsn(self.store_dsn)
        host, port = parts.get("host") or "127.0.0.1", int(parts.get("port") or 5432)
        # A Unix socket directory (the embedded server) or a TCP address.
        self.proxy = StoreProxy(f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port))
        proxied = psycopg2.extensions.make_dsn(self.store_dsn, host="127.0.0.1", port=self.proxy.port)
        p = self.profile
        self.deployment = Deployment(self.template, [DAG_FILE], extra_env={
            "CHAOS_AF_RUN": self.id,
            "CHAOS_AF_HISTORY_DSN": self.store_dsn,
            "CHAOS_AF_SCHEMA": SCHEMA,
            "CHAOS_AF_VARIANT": self.variant,
            "CHAOS_AF_TTL": str(p.ttl),
            "CHAOS_AF_EVERY": str(p.every),
            "CHAOS_AF_WORK": str(p.work),
            "CHAOS_AF_START": str(time.time() - 4 * p.every),
            "AIRFLOW__LEASE__SCHEMA": LEASE_SCHEMA,
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": str(SCHEDULER_DEAD_AFTER),
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": str(ORPHAN_CHECK_EVERY),
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": str(QUEUED_TIMEOUT),
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL": str(QUEUED_CHECK_EVERY),
        }, executor=self.executor)
        # The tasks reach the store only through the proxy; the history DSN above is direct.
        self.deployment.env["AIRFLOW_CONN_LEASE_DEFAULT"] = connection_json(proxied)
        self.deployment.start(set(DAG_IDS))
        for dag_id in DAG_IDS:
            self.deployment.api.unpause(dag_id)
        self.marks["started"] = self.db_now()

    def db_now(self) -> datetime:
        with self.db.cursor() as cur:
            cur.execute("SELECT clock_timestamp()")
            value: datetime = cur.fetchone()[0]
            return value

    # -- the nemesis ----------------------------------------------------------------------------------

    def _ours(self, pid: int) -> bool:
        """Whether ``pid`` belongs to this run's deployment: its session is one of the processes it started.

        (A task process's environment is not readable: Airflow makes it non-dumpable; its stat is.)
        """
        assert self.deployment is not None
        sessions = {process.pid for process in self.deployment.started}
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return int(stat.rpartition(")")[2].split()[3]) in sessions

    def _running_bodies(self) -> list[dict[str, Any]]:
        frozen = {pid for _, pids, _ in self.frozen for pid in pids}
        with self.db.cursor() as cur:
            cur.execute(sql.SQL(
                "SELECT id, pid, dag_id, run_id, task_id, map_index, try_number, key FROM {} "
                "WHERE ended_at IS NULL AND started_at > clock_timestamp() - interval '60 seconds'"
            ).format(sql.Identifier(SCHEMA, "bodies")))
            names = [c.name for c in cur.description]
            found = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        return [b for b in found if b["pid"] not in frozen and self._ours(b["pid"])]

    def _record(self, kind: str, **detail: Any) -> dict[str, Any]:
        fault = {"kind": kind, "at": self.db_now().isoformat(), **detail}
        self.faults.append(fault)
        log.info("fault %s", fault)
        return fault

    def _signal(self, pids: list[int], sig: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _scheduler(self) -> subprocess.Popen[bytes]:
        assert self.deployment is not None
        return [p for p in self.deployment.started if "scheduler" in p.args[1:2]][-1]  # type: ignore[operator]

    def _celery_worker(self, pid: int) -> str | None:
        """The name of the running Celery worker whose process tree ``pid`` is in."""
        assert self.deployment is not None
        mains = {process.pid: name for name, process in self.deployment.workers.items()
                 if name not in self.workers_back}
        for _ in range(8):
            if pid in mains:
                return mains[pid]
            parent = _ppid(pid)
            if parent is None or parent <= 1:
                return None
            pid = parent
        return None

    def inject(self, kind: str) -> bool:
        """One fault of ``kind``; False when there was nothing to inject it into."""
        p, rnd = self.profile, self.random
        if kind in PROCESS_FAULTS:
            bodies = self._running_bodies()
            if not bodies:
                return False
            b = rnd.choice(bodies)
            ti = {k: b[k] for k in ("dag_id", "run_id", "task_id", "map_index", "try_number", "key")}
            pids = [b["pid"]]
            detail: dict[str, Any] = {}
            if self.executor == "celery" and kind in ("sigstop-worker", "kill-worker"):
                worker = self._celery_worker(b["pid"])
                if worker is None:
                    return False
                assert self.deployment is not None
                pids = _tree(self.deployment.workers[worker].pid)
                # Every task the worker runs is hit, not only the one it was found by.
                hit = [other for other in bodies if other["pid"] in pids]
                detail = {"worker": worker, "tis": [{k: o[k] for k in ti} for o in hit]}
            elif kind in ("sigstop-worker", "kill-supervisor"):
                parent = _ppid(b["pid"])
                if parent is None or not self._ours(parent):
                    return False
                pids = [parent] if kind == "kill-supervisor" else [parent, b["pid"]]
            elif kind == "kill-worker":
                return False  # a LocalExecutor has no worker of its own to kill (scheduler-restart does)
            if kind.startswith("sigstop"):
                seconds = rnd.uniform(0.5 * p.ttl, 2.2 * p.ttl)
                self._signal(pids, signal.SIGSTOP)
                fault = self._record(kind, pids=pids, ti=ti, body=b["id"], seconds=round(seconds, 1), **detail)
                self.frozen.append((time.monotonic() + seconds, pids, fault))
            else:
                self._signal(pids, signal.SIGKILL)
                fault = self._record(kind, pids=pids, ti=ti, body=b["id"], **detail)
                if kind == "kill-worker":
                    seconds = rnd.uniform(2.0, 6.0)
                    fault["seconds"] = round(seconds, 1)
                    self.workers_back[detail["worker"]] = (time.monotonic() + seconds, fault)
            return True
        if kind == "scheduler-restart":
            if self.scheduler_back_at is not None:
                return False
            # The whole process group, as a service manager's restart does: with the LocalExecutor the
            # executor's workers, their supervisors and tasks are the scheduler's children. (Killing the
            # scheduler alone left its log and health servers holding their ports: the next scheduler
            # stalled in its start-up.)
            scheduler = self._scheduler()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(scheduler.pid, signal.SIGKILL)
            scheduler.wait(timeout=30)
            seconds = rnd.uniform(*(p.scheduler_down or (2.0, p.every)))
            self.scheduler_back_at = time.monotonic() + seconds
            self.scheduler_fault = self._record(kind, seconds=round(seconds, 1))
            return True
        if kind == "terminate":
            with self.db.cursor() as cur:
                cur.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                            "WHERE datname = %s AND application_name = 'airflow-lease'", (self.store_db,))
                sessions = int(cur.fetchone()[0])
            self._record(kind, sessions=sessions)
            return True
        if kind == "store-down":
            if self.store_back_at is not None:
                return False
            assert self.proxy is not None
            seconds = rnd.uniform(3.0, 1.5 * p.ttl)
            self.proxy.down()
            self.store_back_at = time.monotonic() + seconds
            self.store_fault = self._record(kind, seconds=round(seconds, 1))
            return True
        raise ValueError(f"unknown fault kind {kind!r}")

    def _heal(self, everything: bool = False) -> None:
        now = time.monotonic()
        for entry in list(self.frozen):
            if everything or entry[0] <= now:
                self._signal(entry[1], signal.SIGCONT)
                entry[2]["ended"] = self.db_now().isoformat()
                self.frozen.remove(entry)
        if self.store_back_at is not None and (everything or self.store_back_at <= now):
            assert self.proxy is not None
            self.proxy.up()
            self.store_fault["ended"] = self.db_now().isoformat()
            self.store_back_at = None
        if self.scheduler_back_at is not None and (everything or self.scheduler_back_at <= now):
            assert self.deployment is not None
            self.schedulers += 1
            self.deployment._start(f"scheduler-{self.schedulers}", "scheduler")
            self.scheduler_fault["ended"] = self.db_now().isoformat()
            self.scheduler_back_at = None
        for name, (back_at, fault) in list(self.workers_back.items()):
            if everything or back_at <= now:
                assert self.deployment is not None
                self.deployment.workers[name].wait(timeout=30)
                self.deployment.start_worker(name)
                fault["ended"] = self.db_now().isoformat()
                del self.workers_back[name]

    def plan(self) -> list[str]:
        """The profile's schedule: its scheduler restarts first, the other faults shuffled from the seed."""
        schedule = list(self.profile.schedule)
        first = [k for k in schedule if k == "scheduler-restart"]
        rest = [k for k in schedule if k != "scheduler-restart"]
        self.random.shuffle(rest)
        return first + rest

    def run_faults(self) -> None:
        p = self.profile
        time.sleep(p.warmup)
        self.marks["faults_started"] = self.db_now()
        kinds = [k for k, _ in p.weights]
        weights = [w for _, w in p.weights]
        end = time.monotonic() + p.seconds
        next_fault = time.monotonic()
        plan = self.plan()
        pending: str | None = None
        given_up = time.monotonic()
        while time.monotonic() < end or (plan and time.monotonic() < end + p.overtime):
            self._heal()
            if plan:
                # The first fault of the plan that can go in now: a process fault waits for a body to run
                # (they come in bursts, one per schedule tick); one at a time of the scheduler and the store.
                if time.monotonic() >= next_fault:
                    for i, kind in enumerate(plan):
                        if self.inject(kind):
                            del plan[i]
                            next_fault = time.monotonic() + self.random.uniform(*p.gap)
                            # A fault injected late still gets one TTL before everything is healed.
                            end = max(end, time.monotonic() + p.ttl)
                            break
            elif kinds and time.monotonic() < end and pending is None and time.monotonic() >= next_fault:
                pending = self.random.choices(kinds, weights)[0]
                given_up = time.monotonic() + p.every
            if pending is not None:
                # A process fault waits for a body to run (they come in bursts, one per schedule tick).
                if self.inject(pending) or time.monotonic() > given_up:
                    pending = None
                    next_fault = time.monotonic() + self.random.uniform(*p.gap)
            time.sleep(0.2)
        self._heal(everything=True)
        self.marks["faults_ended"] = self.db_now()
        self.marks["schedule_left"] = plan

    # -- after the faults -----------------------------------------------------------------------------

    def recover(self) -> None:
        """Wait for an accepted publish of every DAG after the faults (at most TTL + interval + slack)."""
        p = self.profile
        deadline = time.monotonic() + p.ttl + p.every + p.work + SCHEDULER_DEAD_AFTER + ORPHAN_CHECK_EVERY + 60
        ended = self.marks["faults_ended"]
        while time.monotonic() < deadline:
            with self.db.cursor() as cur:
                cur.execute(sql.SQL(
                    "SELECT b.dag_id, min(t.at) FROM {} t JOIN {} b ON b.id = t.body "
                    "WHERE t.at > %s GROUP BY b.dag_id").format(
                        sql.Identifier(SCHEMA, "target"), sql.Identifier(SCHEMA, "bodies")), (ended,))
                if len(cur.fetchall()) == len(DAG_IDS):
                    break
            time.sleep(1)

    def drain(self, timeout: float = 120) -> None:
        """Wait for the runs that exist now to finish (the DAGs keep running; later runs are not judged)."""
        assert self.deployment is not None
        api = self.deployment.api
        self.judged = {(d, r["dag_run_id"]) for d in DAG_IDS for r in api.runs(d)}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = [r for d in DAG_IDS for r in api.runs(d)
                    if (d, r["dag_run_id"]) in self.judged and r["state"] not in ("success", "failed")]
            if not busy:
                break
            time.sleep(2)
        self.marks["drained"] = self.db_now()

    def collect(self) -> dict[str, Any]:
        assert self.deployment is not None
        api = self.deployment.api
        tis: list[dict[str, Any]] = []
        for dag_id in DAG_IDS:
            for run in api.runs(dag_id):
                if (dag_id, run["dag_run_id"]) not in self.judged:
                    continue
                for ti in api.task_instances(dag_id, run["dag_run_id"]).values():
                    entry = {k: ti.get(k) for k in ("dag_id", "dag_run_id", "task_id", "map_index", "state",
                                                    "try_number")}
                    entry["run_type"] = run.get("run_type")
                    if ti["state"] == "skipped":
                        entry["skip_reason"] = api.xcom(dag_id, run["dag_run_id"], ti["task_id"], "lease_skip_reason",
                                                        map_index=ti["map_index"])
                    if ti["state"] == "failed":
                        entry["log_tail"] = api.log(dag_id, run["dag_run_id"], ti["task_id"],
                                                    try_number=max(1, int(ti["try_number"] or 1)),
                                                    map_index=ti["map_index"])[-4000:]
                        # Each try's process (a fault that killed or froze a whole worker hit every task
                        # process in it, also one that had not started its body) and Airflow's own record
                        # of why a try ended (a heartbeat timeout, say): what the checker reports with an
                        # unexplained failure.
                        entry["tries"] = [{k: t.get(k) for k in ("try_number", "state", "pid", "hostname",
                                                                 "start_date", "end_date")}
                                          for t in api.tries(dag_id, run["dag_run_id"], ti["task_id"],
                                                             map_index=ti["map_index"])]
                        entry["events"] = [{"event": e.get("event"), "when": e.get("when"),
                                            "try_number": e.get("try_number"), "map_index": e.get("map_index"),
                                            "extra": str(e.get("extra") or "")[:300]}
                                           for e in api.events(dag_id, run["dag_run_id"], ti["task_id"])
                                           if e.get("map_index") in (None, ti["map_index"])]
                    tis.append(entry)
        p = self.profile
        return {
            "profile": {"name": p.name, "seconds": p.seconds, "ttl": p.ttl, "every": p.every, "work": p.work,
                        "orphan_reset": SCHEDULER_DEAD_AFTER + ORPHAN_CHECK_EVERY,
                        "queued_reset": QUEUED_TIMEOUT + QUEUED_CHECK_EVERY,
                        "intervals": {"chaos_pair": p.every, "chaos_mapped": p.every * 2 / 3,
                                      "chaos_catchup": p.every * 4 / 3}},
            "variant": self.variant, "seed": self.seed, "executor": self.executor,
            "marks": {k: v.isoformat() if isinstance(v, datetime) else v for k, v in self.marks.items()},
            "bodies": _rows(self.db, "bodies"), "target": _rows(self.db, "target"),
            "task_instances": tis, "faults": self.faults,
        }

    def close(self) -> None:
        if self.deployment is not None:
            # resume whatever is still frozen so that SIGTERM can be handled
            self._signal([pid for _, pids, _ in self.frozen for pid in pids], signal.SIGCONT)
            if self.deployment.logs.exists():
                shutil.copytree(self.deployment.logs, self.out / "process-logs", dirs_exist_ok=True)
            with contextlib.suppress(Exception):
                self.deployment.stop()
            for entry in Path("/proc").iterdir():  # nothing of this run may outlive it
                if entry.name.isdigit() and int(entry.name) != os.getpid() and self._ours(int(entry.name)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(entry.name), signal.SIGKILL)
        if self.proxy is not None:
            self.proxy.close()
        with contextlib.suppress(Exception):
            self.db.close()
        with contextlib.suppress(psycopg2.Error):
            drop_database(self.admin_dsn, self.store_db)
        if self.own_template:
            self.template.drop()


def run(profile: AirflowProfile, variant: str, out: Path, seed: int, admin_dsn: str,
        template: str | None = None, executor: str = "local") -> Path:
    """The whole run; the path of its history (``history.json`` in ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    chaos = AirflowChaos(profile, variant, out, seed, admin_dsn, template, executor)
    try:
        chaos.start()
        chaos.run_faults()
        chaos.recover()
        chaos.drain()
        history = chaos.collect()
    finally:
        chaos.close()
    path = out / "history.json"
    path.write_text(json.dumps(history, indent=1, default=str))
    return path
