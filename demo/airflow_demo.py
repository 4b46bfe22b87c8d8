"""The main demo: a real Airflow (standalone) with the example DAGs on the embedded PostgreSQL.

``scripts/demo`` runs this. It starts ``airflow standalone`` in the background under ``.demo/airflow``,
then makes three things happen for real, **checks each one through Airflow's own REST API and the lease
ledger**, and leaves Airflow running:

1. a catch-up skip: ``article_publisher`` is unpaused after "downtime" since 2026-01-01; only the
   newest 45-minute slot runs (one scheduled run, successful) and the older ones are recorded once in
   the ledger (``skipped_catchup``, with their range);
2. an overlap skip: two runs of ``article_publisher`` are triggered together (no logical date, as the UI
   does); one writes, the other's task is skipped (not failed) with the writer named in the reason;
3. a rejected zombie publish: a run of ``zombie_demo`` stalls past its TTL, a newer run takes the lease
   and publishes, and the stalled one's publish is refused by the fence (``fence_rejected`` in the
   ledger, ``StaleFencingToken`` in its log): that run is red, on purpose, and the only red run.

If any claim is false the demo says which scene and why, and exits with status 1. Then it prints the
ledger, the URL and the logins. ``scripts/demo stop`` stops Airflow; ``scripts/demo core`` runs the short
core-only demo instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demo.airflow_api import AirflowAPI, wait  # noqa: E402 - after the path that makes it importable
from demo.deployment import free_port  # noqa: E402

DEMO = ROOT / ".demo"
HOME = DEMO / "airflow"
DAGS = DEMO / "dags"
PIDFILE = DEMO / "standalone.pid"
PORTFILE = DEMO / "port"
#: How long each of the two overlapping runs writes: long enough that the second starts while the first
#: holds the lease, even on a busy 2-core machine.
OVERLAP_WORK_SECONDS = 12
ZOMBIE_TTL_SECONDS = 8  # demo/dags/zombie_demo.py


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port() -> int:
    """LEASE_DEMO_PORT, else 8080 if it is free, else any free port (the demo says which)."""
    if os.environ.get("LEASE_DEMO_PORT"):
        return int(os.environ["LEASE_DEMO_PORT"])
    return 8080 if _free(8080) else free_port()


PORT = 0  # set by start()


class ClaimFalse(Exception):
    """A scene's claim did not hold in Airflow or in the ledger."""

    def __init__(self, scene: str, problem: str) -> None:
        super().__init__(f"scene '{scene}': {problem}")
        self.scene = scene


def claim(scene: str, holds: bool, problem: str) -> None:
    """Fail the scene unless the claim holds; ``problem`` says what is wrong when it does not."""
    if not holds:
        raise ClaimFalse(scene, problem)


_PORTS: dict[str, str] = {}


def _env_port(name: str) -> str:
    if name not in _PORTS:
        _PORTS[name] = str(free_port())
    return _PORTS[name]


def env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    base.update(
        {
            "AIRFLOW_HOME": str(HOME),
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
            "AIRFLOW__API__PORT": str(PORT),
            "AIRFLOW__API__BASE_URL": f"http://localhost:{PORT}",
            # The standalone's other listeners on free ports, so a second Airflow on the host is no clash.
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": _env_port("health"),
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": _env_port("worker-logs"),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": _env_port("trigger-logs"),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "True",
            "PATH": f"{Path(sys.executable).parent}:{base.get('PATH', '')}",
        }
    )
    return base


def say(text: str = "") -> None:
    print(text, flush=True)


def stop() -> None:
    if PIDFILE.exists():
        pid = int(PIDFILE.read_text())
        try:
            os.killpg(pid, signal.SIGTERM)
            for _ in range(60):
                os.killpg(pid, 0)
                time.sleep(0.5)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        PIDFILE.unlink()
        say("Airflow stopped.")
    stop_embedded_store()


def stop_embedded_store() -> None:
    """The embedded PostgreSQL outlives the Airflow processes that started it (it is shared by them)."""
    data = HOME / "lease-postgres"
    if (data / "postmaster.pid").exists():
        sys.path.insert(0, str(ROOT))
        from airflow_lease_provider.core.embedded import EmbeddedPostgres

        store = EmbeddedPostgres(data, keep=True)
        store.start()  # attaches to the running server
        store.stop()
        say("Embedded PostgreSQL stopped.")


def start() -> AirflowAPI:
    """Start ``airflow standalone`` from a clean state; the API client, once the DAGs are parsed."""
    global PORT
    stop()
    shutil.rmtree(DEMO, ignore_errors=True)
    DAGS.mkdir(parents=True)
    HOME.mkdir(parents=True)
    PORT = _port()
    PORTFILE.write_text(str(PORT))
    for source in [*sorted((ROOT / "dags_examples").glob("*.py")), ROOT / "demo" / "dags" / "zombie_demo.py"]:
        shutil.copy(source, DAGS / source.name)
    log = open(DEMO / "standalone.log", "w")  # noqa: SIM115 - kept open by the background process
    proc = subprocess.Popen(
        ["airflow", "standalone"], env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    PIDFILE.write_text(str(proc.pid))
    say(f"Starting Airflow standalone in {HOME} on port {PORT} (log: {DEMO / 'standalone.log'}) ...")
    passwords = HOME / "simple_auth_manager_passwords.json.generated"
    probe = AirflowAPI(f"http://localhost:{PORT}", "admin", "")  # the health check needs no login

    def up() -> bool:
        if proc.poll() is not None:
            raise SystemExit(f"demo: airflow standalone exited ({proc.returncode}); see {DEMO / 'standalone.log'}")
        return passwords.exists() and probe.healthy()

    try:
        wait(up, bool, 300, "Airflow to become healthy")
    finally:
        probe.close()
    api = AirflowAPI(f"http://localhost:{PORT}", "admin", json.loads(passwords.read_text())["admin"])
    wait(api.dag_ids, lambda ids: {"article_publisher", "zombie_demo"} <= ids, 180, "the DAGs to be parsed")
    errors = api.import_errors()
    claim("start", not errors, f"DAG files failed to import: {errors}")
    say("Airflow is up; the DAGs are parsed.")
    return api


# -- the scenes: each makes something happen, then checks it through Airflow's API and the ledger ------


def finished(api: AirflowAPI, dag_id: str, run_id: str, timeout: float = 240) -> str:
    return api.wait_for_run(dag_id, run_id, timeout=timeout)


def scene_catchup(api: AirflowAPI, store: Any) -> str:
    """Scene 1; the scheduled run's id."""
    scene = "catch-up skip"
    say("\n1. Catch-up: article_publisher was 'down' since 2026-01-01; unpausing it runs only the newest slot")
    api.unpause("article_publisher")
    runs = wait(lambda: [r for r in api.runs("article_publisher") if r["run_type"] == "scheduled"],
                lambda found: any(r["state"] in ("success", "failed") for r in found), 240, "the catch-up run")
    claim(scene, len(runs) == 1, f"{len(runs)} scheduled runs instead of one (the newest slot): {runs}")
    run = runs[0]
    tasks = api.task_states("article_publisher", run["dag_run_id"])
    claim(scene, run["state"] == "success" and tasks == {"write_and_publish": "success"},
          f"the catch-up run {run['dag_run_id']} is {run['state']}, its tasks {tasks}")
    records = [e for e in store.events.query(kind="skipped_catchup")
               if e.detail.get("run_id") == run["dag_run_id"]]
    claim(scene, len(records) == 1 and records[0].detail.get("count", 0) >= 1,
          f"the ledger has {len(records)} skipped_catchup records for {run['dag_run_id']} (one expected)")
    detail = records[0].detail
    say(f"   checked: one scheduled run ({run['dag_run_id']}), successful; the ledger records "
        f"{detail['count']} older slots skipped, from {detail['first_start']} to {detail['last_end']}")
    return str(run["dag_run_id"])


def scene_overlap(api: AirflowAPI, store: Any) -> tuple[str, str]:
    """Scene 2; the writer's and the skipped run's ids."""
    say(f"\n2. Overlap: two manual runs start together; each would write for {OVERLAP_WORK_SECONDS} s")
    conf = {"work_seconds": OVERLAP_WORK_SECONDS}
    runs = [api.trigger("article_publisher", conf) for _ in range(2)]
    writer, loser, text = check_overlap(api, store, runs)
    say(f"   checked: {writer} wrote the article; {loser} was skipped (not failed): \"{text[:110]}\"")
    return writer, loser


def check_overlap(api: AirflowAPI, store: Any, runs: list[str]) -> tuple[str, str, str]:
    """Of two runs of article_publisher: the writer, the skipped run and its skip reason."""
    scene = "overlap skip"
    states = {run_id: finished(api, "article_publisher", run_id, 300) for run_id in runs}
    claim(scene, all(state == "success" for state in states.values()),
          f"the runs should both be successful (a skip is not a failure): {states}")
    tasks = {run_id: api.task_states("article_publisher", run_id)["write_and_publish"] for run_id in runs}
    writers = [r for r in runs if tasks[r] == "success"]
    skipped = [r for r in runs if tasks[r] == "skipped"]
    claim(scene, len(writers) == 1 and len(skipped) == 1,
          f"one run should write and the other be skipped; write_and_publish: {tasks}")
    writer, loser = writers[0], skipped[0]
    reason = api.xcom("article_publisher", loser, "write_and_publish", "lease_skip_reason")
    text = str((reason or {}).get("reason", ""))
    claim(scene, f"article_publisher/{writer}" in text,
          f"the skip reason should name the writing run {writer}: {reason}")
    events = [e for e in store.events.query(kind="skipped_overlap", key="article-publisher")
              if e.owner and loser in e.owner]
    claim(scene, len(events) == 1, f"the ledger has {len(events)} skipped_overlap events for {loser}")
    return writer, loser, text


def scene_zombie(api: AirflowAPI, store: Any, markers: Path) -> str:
    """Scene 3; the zombie run's id."""
    scene = "rejected zombie publish"
    say(f"\n3. Zombie: a run stalls past its {ZOMBIE_TTL_SECONDS} s TTL; a newer run takes over and publishes")
    api.unpause("zombie_demo")
    zombie = api.trigger("zombie_demo", {"stall": True})
    wait((markers / "stalled").exists, bool, 180, "the stalled run to take the lease")
    stale_token = int((markers / "stalled").read_text())
    time.sleep(ZOMBIE_TTL_SECONDS + 2)
    fresh = api.trigger("zombie_demo", {"stall": False})
    claim(scene, finished(api, "zombie_demo", fresh) == "success",
          f"the newer run {fresh} should publish: {api.task_states('zombie_demo', fresh)}")
    (markers / "go").write_text("wake up")
    claim(scene, finished(api, "zombie_demo", zombie) == "failed",
          f"the stalled run {zombie} should fail: {api.task_states('zombie_demo', zombie)}")
    rejected = [e for e in store.events.query(kind="fence_rejected") if e.token == stale_token]
    claim(scene, len(rejected) == 1,
          f"the ledger has {len(rejected)} fence_rejected events for token {stale_token} (one expected)")
    log = api.log("zombie_demo", zombie, "publish_once")
    claim(scene, "StaleFencingToken" in log, f"the stalled run's log does not show StaleFencingToken: {log[-500:]}")
    accepted = api.xcom("zombie_demo", fresh, "publish_once")
    say(f"   checked: {fresh} published with token {accepted}; the stalled run's token {stale_token} "
        "was refused by the fence (StaleFencingToken)")
    return zombie


def check_only_red(api: AirflowAPI, zombie: str) -> None:
    failed = api.get("/dags/~/dagRuns", params={"state": "failed", "limit": 100})["dag_runs"]
    red = sorted(f"{r['dag_id']}/{r['dag_run_id']}" for r in failed)
    claim("no other red", red == [f"zombie_demo/{zombie}"],
          f"the only failed run should be the zombie's (zombie_demo/{zombie}); failed runs: {red}")


def play(api: AirflowAPI, store: Any, markers: Path) -> dict[str, Any]:
    """All three scenes with their checks (raises :class:`ClaimFalse`); what each left behind."""
    outcome: dict[str, Any] = {}
    scene = "catch-up skip"
    try:
        outcome["catchup"] = scene_catchup(api, store)
        scene = "overlap skip"
        outcome["writer"], outcome["skipped"] = scene_overlap(api, store)
        scene = "rejected zombie publish"
        outcome["zombie"] = scene_zombie(api, store, markers)
    except TimeoutError as exc:  # what the scene waited for never happened: its claim is false too
        raise ClaimFalse(scene, str(exc)) from None
    check_only_red(api, outcome["zombie"])
    return outcome


def describe(event: Any) -> str:
    detail = event.detail
    if event.kind == "skipped_catchup":
        return f"{detail.get('count')} slots from {detail.get('first_start')} to {detail.get('last_end')}"
    return str(detail.get("reason") or detail.get("outcome") or "")


def report(store: Any, zombie: str) -> None:
    say("\nThe lease ledger (newest first):")
    for event in store.events.query(limit=25):
        say(f"   {event.at:%H:%M:%S} {event.kind:<16} {event.key:<18} token={event.token} {describe(event)[:90]}")
    # The generated passwords stay in their file, readable by its owner only: never printed (CI logs keep
    # what a command prints).
    passwords = HOME / "simple_auth_manager_passwords.json.generated"
    passwords.chmod(0o600)
    users = ", ".join(json.loads(passwords.read_text()))
    say(f"\nAirflow is running: http://localhost:{PORT}  (open 'Leases' in the navigation)")
    say(f"   log in as {users}: the passwords are in {passwords} (readable by you only)")
    say(f"The one red run, zombie_demo/{zombie}, is red on purpose: it is the zombie whose late publish the "
        "fence refused.")
    say("Stop it with: scripts/demo stop")


def main(argv: list[str]) -> int:
    if argv[:1] == ["stop"]:
        stop()
        return 0
    if argv[:1] == ["core"]:
        return subprocess.call([sys.executable, str(ROOT / "demo" / "core_demo.py")])
    try:
        api = start()
        os.environ.update(env())
        from airflow_lease_provider.hooks import LeaseHook

        store = LeaseHook().get_store()
        outcome = play(api, store, HOME / "demo-markers")
    except ClaimFalse as false:
        say(f"\ndemo: FAILED in {false}")
        say(f"Airflow is still running at http://localhost:{PORT} to look at; scripts/demo stop stops it.")
        return 1
    report(store, outcome["zombie"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
