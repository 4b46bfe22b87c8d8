"""The main demo: a real Airflow (standalone) with the example DAGs on the embedded PostgreSQL.

``scripts/demo`` runs this. It starts ``airflow standalone`` in the background under ``.demo/airflow``,
then makes three things happen for real and leaves Airflow running:

1. a catch-up skip: ``article_publisher`` is unpaused after "downtime" since 2026-01-01; only the
   newest 45-minute slot runs and the older ones are recorded and counted once;
2. an overlap skip: two runs of ``article_publisher`` start together; one writes, the other is skipped
   with the holder named in the reason;
3. a rejected zombie publish: a run of ``zombie_demo`` stalls past its TTL, a newer run takes the lease
   and publishes, and the stalled one's publish is refused by the fence.

Then it prints what happened, the URL and the logins. ``scripts/demo stop`` stops Airflow;
``scripts/demo core`` runs the short core-only demo instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / ".demo"
HOME = DEMO / "airflow"
DAGS = DEMO / "dags"
PORT = int(os.environ.get("LEASE_DEMO_PORT", "8080"))
PIDFILE = DEMO / "standalone.pid"


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
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "True",
            "PATH": f"{Path(sys.executable).parent}:{base.get('PATH', '')}",
        }
    )
    return base


def say(text: str = "") -> None:
    print(text, flush=True)


def airflow(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["airflow", *args], env=env(), capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise SystemExit(f"airflow {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return result


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


def healthy() -> bool:
    try:
        with urllib.request.urlopen(f"http://localhost:{PORT}/api/v2/monitor/health", timeout=2) as reply:
            health = json.load(reply)
    except OSError:
        return False
    return all(part.get("status") == "healthy" for part in (health.get("scheduler", {}), health.get("metadatabase", {})))


def wait(predicate, what: str, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise SystemExit(f"demo: timed out waiting for {what}; see {DEMO / 'standalone.log'}")
        time.sleep(1)


def run_states(dag_id: str) -> list[dict]:
    out = airflow("dags", "list-runs", dag_id, "-o", "json", check=False).stdout
    line = next((x for x in reversed(out.splitlines()) if x.startswith("[")), "[]")
    return json.loads(line)


def start() -> None:
    stop()
    shutil.rmtree(DEMO, ignore_errors=True)
    DAGS.mkdir(parents=True)
    HOME.mkdir(parents=True)
    for source in [*sorted((ROOT / "dags_examples").glob("*.py")), ROOT / "demo" / "dags" / "zombie_demo.py"]:
        shutil.copy(source, DAGS / source.name)
    log = open(DEMO / "standalone.log", "w")  # noqa: SIM115 - kept open by the background process
    proc = subprocess.Popen(
        ["airflow", "standalone"], env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    PIDFILE.write_text(str(proc.pid))
    say(f"Starting Airflow standalone in {HOME} (log: {DEMO / 'standalone.log'}) ...")
    wait(healthy, "Airflow to become healthy")
    wait(lambda: "zombie_demo" in airflow("dags", "list", "-o", "plain", check=False).stdout, "the DAGs to be parsed")
    say("Airflow is up; the DAGs are parsed.")


def scene_catchup_and_overlap() -> None:
    say("\n1. Catch-up: article_publisher was 'down' since 2026-01-01; unpausing it runs only the newest slot")
    airflow("dags", "unpause", "article_publisher")
    wait(lambda: any(r["state"] in ("success", "failed") for r in run_states("article_publisher")), "the catch-up run")
    say("   done: the older slots were skipped, logged once and counted (scheduled.skipped_catchup)")

    say("\n2. Overlap: two manual runs start together; each would write for 40 s")
    for _ in range(2):
        airflow("dags", "trigger", "article_publisher", "--conf", json.dumps({"work_seconds": 40}))
    wait(lambda: sum(r["state"] in ("success", "failed") for r in run_states("article_publisher")) >= 3, "the two runs", 300)
    say("   done: one wrote the article, the other was skipped (not failed) with the holder in the reason")


def scene_zombie() -> None:
    say("\n3. Zombie: a run stalls past its 8 s TTL; a newer run takes over and publishes")
    markers = HOME / "demo-markers"
    airflow("dags", "unpause", "zombie_demo")
    airflow("dags", "trigger", "zombie_demo", "--conf", json.dumps({"stall": True}))
    wait(lambda: (markers / "stalled").exists(), "the stalled run to take the lease")
    time.sleep(10)
    airflow("dags", "trigger", "zombie_demo", "--conf", json.dumps({"stall": False}))
    wait(lambda: any(r["state"] == "success" for r in run_states("zombie_demo")), "the newer run")
    (markers / "go").write_text("wake up")
    wait(lambda: any(r["state"] == "failed" for r in run_states("zombie_demo")), "the stalled run to fail")
    say("   done: the stalled run woke up and its publish was refused by the fence (StaleFencingToken)")


def report() -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.update(env())
    from airflow_lease_provider.hooks import LeaseHook

    store = LeaseHook().get_store()
    say("\nThe lease ledger (newest first):")
    for event in store.events.query(limit=25):
        detail = event.detail.get("reason") or event.detail.get("outcome") or ""
        if event.kind == "skipped_catchup":
            detail = f"{event.detail.get('count')} slots from {event.detail.get('first')} to {event.detail.get('last')}"
        say(f"   {event.at:%H:%M:%S} {event.kind:<16} {event.key:<18} token={event.token} {str(detail)[:90]}")
    passwords = json.loads((HOME / "simple_auth_manager_passwords.json.generated").read_text())
    say(f"\nAirflow is running: http://localhost:{PORT}  (open 'Leases' in the navigation)")
    for user, password in passwords.items():
        say(f"   login: {user} / {password}")
    say("Stop it with: scripts/demo stop")


def main(argv: list[str]) -> int:
    if argv[:1] == ["stop"]:
        stop()
        return 0
    if argv[:1] == ["core"]:
        return subprocess.call([sys.executable, str(ROOT / "demo" / "core_demo.py")])
    start()
    scene_catchup_and_overlap()
    scene_zombie()
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
