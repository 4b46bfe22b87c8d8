"""End to end: where the stored next run is moved forward, a real scheduler must be able to create it.

After an outage the scheduler creates the run it stored in ``DagModel`` before the outage; the timetable
moves that stale run forward (``next_run_info_from_dag_model``). Two ways that went wrong, each read back
through the REST API a user has:

* a DAG with an ``end_date`` that has passed (``catchup=True``): the stored run is the first slot of its
  range, and it was moved to the newest slot *now*, past the ``end_date`` (a run 21 months after the
  DAG's end, and none in its range);
* a manual run triggered with a logical date during the outage (the REST API, the UI's "logical date"
  field) takes the slot the run is moved to: the scheduler checks only the stored slot for an existing
  run, the insert hit ``dag_run_dag_id_logical_date_key`` and the scheduler process exited
  (``PendingRollbackError``), and again on every restart.

A third case shares the deployment (its own DAG file and id): a coalesced catch-up
(``CappedCatchupTimetable("*/5 * * * *", coalesce=True)``, issue 26 item 4) after a one-day outage gives
one kept run whose data interval covers the whole gap, read back over REST, with its ``coalesced`` record
in the ledger, read back through the ``airflow-lease`` CLI's ``--json``.

Two DAGs that only set the timetable (plain ``@task``s, no leased task; issue 38 item 9), one skipping and
one coalescing, after the same one-day outage: the scheduler records the ``skipped_catchup`` /
``coalesced`` record of the first kept run once (the plugin's ``on_dag_run_running`` listener), read back
through the CLI, and once still after the run is cleared and runs again. Across the deployment each
recorded slot is counted once in the metrics.

The outage is a dag-processor that parsed the file once (``min_file_process_interval`` of an hour) and a
``DagModel`` row holding the next run stored five hours ago, as a scheduler leaves it when it stops.
"""

from __future__ import annotations

import datetime
import itertools
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pendulum
import psycopg2
import pytest

from airflow_lease_provider.core import DEFAULT_SCHEMA
from demo.airflow_api import wait
from demo.deployment import Deployment, MetadataTemplate, scratch_dir

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(600)]

END_DATE_DAG = "capped_end_date_passed"
COLLISION_DAG = "capped_manual_in_the_gap"
LATEST_ONLY_DAG = "capped_catchup_false"
COALESCED_DAG = "capped_coalesced_outage"

# Its own file: a leased task (lease_default, the deployment's store) records the coalesced range.
COALESCED_FILE = f'''
from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

from airflow_lease_provider.timetables import CappedCatchupTimetable

with DAG("{COALESCED_DAG}", schedule=CappedCatchupTimetable("*/5 * * * *", coalesce=True),
         start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=True):
    @task.leased(lease_key="{COALESCED_DAG}", lease_ttl=pendulum.duration(seconds=60))
    def incremental(**context):
        return [context["data_interval_start"].isoformat(), context["data_interval_end"].isoformat()]

    incremental()
'''

# Only the timetable: plain tasks, nothing leased. The scheduler records what the cap skipped or coalesced.
PLAIN_SKIP_DAG = "capped_plain_skip"
PLAIN_COALESCE_DAG = "capped_plain_coalesce"
PLAIN_FILE = f'''
from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

from airflow_lease_provider.timetables import CappedCatchupTimetable

with DAG("{PLAIN_SKIP_DAG}", schedule=CappedCatchupTimetable("*/5 * * * *", max_backfill=2),
         start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=True, max_active_runs=1):
    @task
    def skip_mode():
        pass

    skip_mode()

with DAG("{PLAIN_COALESCE_DAG}", schedule=CappedCatchupTimetable("*/5 * * * *", coalesce=True),
         start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=True):
    @task
    def coalesce_mode():
        pass

    coalesce_mode()
'''

DAG_FILE = f'''
from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

from airflow_lease_provider.timetables import CappedCatchupTimetable

with DAG("{END_DATE_DAG}", schedule=CappedCatchupTimetable("0 0 * * *", max_backfill=2),
         start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), end_date=pendulum.datetime(2025, 3, 1, tz="UTC"),
         catchup=True, max_active_runs=1):
    @task
    def ended():
        pass

    ended()

with DAG("{COLLISION_DAG}", schedule=CappedCatchupTimetable("0 * * * *", max_backfill=1),
         start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=True):
    @task
    def hourly():
        pass

    hourly()

with DAG("{LATEST_ONLY_DAG}", schedule=CappedCatchupTimetable("0 * * * *", max_backfill=5),
         start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False, max_active_runs=1):
    @task
    def latest():
        pass

    latest()
'''

def _store_stale(airflow: Deployment, dag_id: str, end: pendulum.DateTime, minutes: int = 60) -> None:
    """The DagModel row a scheduler leaves when it stops right after creating a run: the next run it stored,
    the slot ending at ``end``. Written with SQL on the metadata database (the ``dag`` table's columns that
    ``DagModel.next_dagrun``, ``next_dagrun_data_interval`` and ``next_dagrun_create_after`` map): a Python
    process importing Airflow's models for it took about 5 CPU s."""
    start = end - pendulum.duration(minutes=minutes)
    conn = psycopg2.connect(airflow.dsn, connect_timeout=10)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(
                "UPDATE dag SET next_dagrun = %s, next_dagrun_data_interval_start = %s,"
                " next_dagrun_data_interval_end = %s, next_dagrun_create_after = %s WHERE dag_id = %s",
                (start, start, end, end, dag_id),
            )
            assert cur.rowcount == 1, f"no dag row for {dag_id}"
    finally:
        conn.close()


# A scheduler that stopped right after its last run finished: that run (a success, covering the slot
# ending at argv[2]) and the next run it stored. Its logical date is the slot's start, as the scheduler's.
PREVIOUS_RUN = """
import sys
import pendulum
from airflow.models.dag import DagModel
from airflow.models.serialized_dag import SerializedDagModel
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState
from airflow.utils.types import DagRunTriggeredByType, DagRunType

end = pendulum.parse(sys.argv[2])
step = pendulum.duration(minutes=int(sys.argv[3]))
with create_session() as session:
    dag = SerializedDagModel.get_dag(sys.argv[1], session=session)
    dag.create_dagrun(
        run_id=f"scheduled__{(end - step).isoformat()}", logical_date=end - step, data_interval=(end - step, end),
        run_after=end, run_type=DagRunType.SCHEDULED, triggered_by=DagRunTriggeredByType.TIMETABLE,
        state=DagRunState.SUCCESS, session=session,
    )
    model = session.get(DagModel, sys.argv[1])
    model.next_dagrun = end
    model.next_dagrun_data_interval = (end, end + step)
    model.next_dagrun_create_after = end + step
"""


@pytest.fixture(scope="module")
def airflow(metadata_template: MetadataTemplate) -> Iterator[Deployment]:
    template = metadata_template
    source = scratch_dir("capped-moves-") / "capped_moves.py"
    source.write_text(textwrap.dedent(DAG_FILE))
    coalesced = source.with_name("capped_coalesced.py")
    coalesced.write_text(textwrap.dedent(COALESCED_FILE))
    plain = source.with_name("capped_plain.py")
    plain.write_text(textwrap.dedent(PLAIN_FILE))
    deployment = Deployment(
        template, [source, coalesced, plain],
        extra_env={"AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600"},
    )
    try:
        deployment.start({END_DATE_DAG, COLLISION_DAG, LATEST_ONLY_DAG, COALESCED_DAG, PLAIN_SKIP_DAG, PLAIN_COALESCE_DAG})
        yield deployment
    except BaseException:
        print(deployment.tails())
        raise
    finally:
        deployment.stop()


def _scheduler_alive(deployment: Deployment) -> bool:
    scheduler = next(p for p in deployment.started if "scheduler" in p.args)
    return scheduler.poll() is None


def test_an_end_date_that_has_passed_keeps_the_runs_inside_it(airflow: Deployment) -> None:
    api = airflow.api
    api.unpause(END_DATE_DAG)
    # The schedule ends (no next run) once the runs it allows are created; then they finish.
    wait(lambda: api.get(f"/dags/{END_DATE_DAG}")["next_dagrun_logical_date"], lambda nxt: nxt is None, 120,
         f"the schedule of {END_DATE_DAG} to end")
    runs = wait(lambda: api.runs(END_DATE_DAG),
                lambda found: found and all(r["state"] in ("success", "failed") for r in found), 120,
                f"the runs of {END_DATE_DAG} to finish")
    # The newest 2 of the slots Airflow allows (logical date not after the end_date), and nothing later.
    assert [(r["run_type"], r["logical_date"], r["data_interval_end"]) for r in runs] == [
        ("scheduled", "2025-02-28T00:00:00Z", "2025-03-01T00:00:00Z"),
        ("scheduled", "2025-03-01T00:00:00Z", "2025-03-02T00:00:00Z"),
    ], runs
    assert all(r["state"] == "success" for r in runs), runs


def test_a_manual_run_on_the_slot_the_stale_run_moves_to_does_not_stop_the_scheduler(airflow: Deployment) -> None:
    api = airflow.api
    hour = pendulum.now("UTC").start_of("hour")
    if pendulum.now("UTC") > hour.add(minutes=58):
        hour = hour.add(hours=1)  # keep "the newest slot" the same for the test's few seconds
        wait(lambda: pendulum.now("UTC"), lambda now: now >= hour.add(seconds=5), 150, "the next hour")
    _store_stale(airflow, COLLISION_DAG, hour.subtract(hours=5))
    # During the "outage" a user triggers the newest slot by hand: its run would have logical date
    # hour - 1h (the interval [hour - 1h, hour]).
    newest_logical = hour.subtract(hours=1)
    manual = api.trigger(COLLISION_DAG, logical_date=newest_logical.isoformat())
    api.unpause(COLLISION_DAG)
    runs = wait(lambda: api.runs(COLLISION_DAG),
                lambda found: any(r["run_type"] == "scheduled" for r in found) or not _scheduler_alive(airflow),
                90, f"a scheduled run of {COLLISION_DAG}")
    assert _scheduler_alive(airflow), airflow.tails()
    scheduled = [r for r in runs if r["run_type"] == "scheduled"]
    # The newest slot is the manual run's: the scheduler moves on to the slot after it (due at hour + 1h),
    # never back to a stale one.
    assert [(r["logical_date"], r["data_interval_end"]) for r in scheduled] == [
        (_z(hour), _z(hour.add(hours=1)))
    ], runs
    assert [r["dag_run_id"] for r in runs if r["run_type"] == "manual"] == [manual]
    log = (airflow.logs / "scheduler.log").read_text(errors="replace")
    assert "Failed creating DagRun" not in log, log[-5000:]


def test_catchup_false_with_max_backfill_runs_only_the_newest_slot_after_an_outage(airflow: Deployment) -> None:
    """catchup=False means latest-only whatever max_backfill says: one run for the newest slot, as Airflow.

    Before the fix the stored run (five hours stale) was moved only to the oldest of the newest 5 slots;
    the scheduler created it, and then the catchup=False schedule jumped to the newest: two runs.
    """
    api = airflow.api
    hour = pendulum.now("UTC").start_of("hour")
    if pendulum.now("UTC") > hour.add(minutes=56):
        hour = hour.add(hours=1)
        wait(lambda: pendulum.now("UTC"), lambda now: now >= hour.add(seconds=5), 300, "the next hour")
    _store_stale(airflow, LATEST_ONLY_DAG, hour.subtract(hours=5))
    api.unpause(LATEST_ONLY_DAG)
    # The schedule has caught up once the next run it stores is the one due at hour + 1h; by then every
    # run it would create for the outage exists (one at a time: max_active_runs=1).
    wait(lambda: api.get(f"/dags/{LATEST_ONLY_DAG}")["next_dagrun_logical_date"],
         lambda nxt: nxt == _z(hour), 150, f"the schedule of {LATEST_ONLY_DAG} to reach the newest slot")
    runs = wait(lambda: api.runs(LATEST_ONLY_DAG),
                lambda found: found and all(r["state"] in ("success", "failed") for r in found), 120,
                f"the runs of {LATEST_ONLY_DAG} to finish")
    assert [(r["run_type"], r["logical_date"], r["data_interval_end"]) for r in runs] == [
        ("scheduled", _z(hour.subtract(hours=1)), _z(hour)),
    ], runs


def _newest_five_minute_slot() -> pendulum.DateTime:
    """The newest due 5-minute slot boundary, after waiting out a boundary that is about to pass (so that
    "the newest slot" stays the same for the test's seconds)."""
    now = pendulum.now("UTC")
    if now.minute % 5 == 4 and now.second > 30:
        wait(lambda: pendulum.now("UTC"), lambda t: t.minute % 5 == 0 and t.second >= 5, 60, "the next slot")
        now = pendulum.now("UTC")
    return now.start_of("minute").subtract(minutes=now.minute % 5)


def _cli_events(airflow: Deployment, kind: str) -> list[dict]:
    """The ledger's events of ``kind``, read through the ``airflow-lease`` CLI (``events --json``).

    Given the deployment's store (``--dsn``/``--schema``, as the deployment tier's reads): the CLI's way
    through Airflow's configuration imports Airflow, about 5 CPU s a call on a 2-core machine, 13 calls
    here; that way is tested in ``tests/cli``."""
    schema = airflow.env.get("AIRFLOW__LEASE__SCHEMA", DEFAULT_SCHEMA)
    cli = subprocess.run(
        [str(Path(sys.executable).with_name("airflow-lease")), "--dsn", airflow.dsn, "--schema", schema,
         "events", "--kind", kind, "--json"],
        env=airflow.env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    events: list[dict] = json.loads(cli.stdout)["events"]
    return events


def _counted_once(airflow: Deployment) -> None:
    """Every recorded slot of the deployment counted once: each kind's metric is its records' total count.

    The module's other DAGs keep running while this reads, and a record is committed before its metric is
    sent: a record can land between the two reads. So both are read until they agree (a slot counted twice,
    or recorded and never counted, never agrees and fails after 60 s).
    """
    for kind, metric in (("skipped_catchup", "scheduled.skipped_catchup"), ("coalesced", "scheduled.coalesced")):
        def both(kind: str = kind, metric: str = metric) -> tuple[int, int]:
            recorded = sum(int(e["detail"]["count"]) for e in _cli_events(airflow, kind))
            return recorded, airflow.statsd.count(metric)
        wait(both, lambda pair: pair[0] == pair[1], 60, f"the {kind} records and the {metric} metric to agree")


def _rerun(airflow: Deployment, dag_id: str, run: dict, task_id: str) -> None:
    """Clear a finished run (the UI's Clear, resetting the run): the scheduler starts it again."""
    airflow.api.clear(dag_id, run["dag_run_id"], [task_id])
    wait(lambda: airflow.api.run(dag_id, run["dag_run_id"]),
         lambda found: found["state"] in ("success", "failed") and found["end_date"] != run["end_date"], 240,
         f"run {run['dag_run_id']} of {dag_id} to run again")


def test_a_coalesced_catch_up_after_a_day_outage_is_one_run_over_the_whole_gap(airflow: Deployment) -> None:
    """A 5-minute schedule, down for a day: one kept run whose data interval starts where the last run's
    ended (the slot stored before the outage) and ends at the newest due slot; nothing of the day is
    dropped. Before coalesce=True the kept run covered its last five minutes only."""
    api = airflow.api
    newest = _newest_five_minute_slot()
    # The last run before the outage covered [newest - 1 day - 5 min, newest - 1 day]; the scheduler stored
    # the next slot, [newest - 1 day, newest - 1 day + 5 min], and stopped.
    last_end = newest.subtract(days=1)
    _store_stale(airflow, COALESCED_DAG, last_end.add(minutes=5), minutes=5)
    api.unpause(COALESCED_DAG)
    runs = wait(lambda: api.runs(COALESCED_DAG),
                lambda found: found and all(r["state"] in ("success", "failed") for r in found), 150,
                f"the runs of {COALESCED_DAG} to finish")
    first = runs[0]
    # One kept run over the whole gap: from where the last run ended to the newest due slot.
    assert (first["run_type"], first["logical_date"], first["data_interval_start"]) == (
        "scheduled", _z(last_end), _z(last_end)
    ), runs
    end = pendulum.parse(first["data_interval_end"])
    assert newest <= end <= pendulum.now("UTC") and end.minute % 5 == 0, runs
    assert first["state"] == "success", runs
    # Any later run is the normal next slot (a 5-minute boundary passed meanwhile), never one in the gap.
    for before, after in itertools.pairwise(runs):
        assert after["data_interval_start"] == before["data_interval_end"], runs
        assert pendulum.parse(after["data_interval_end"]) - pendulum.parse(after["data_interval_start"]) == (
            pendulum.duration(minutes=5)
        ), runs
    # The task saw the whole range; the ledger holds one coalesced record for it, read through the CLI.
    seen = api.xcom(COALESCED_DAG, first["dag_run_id"], "incremental")
    assert [pendulum.parse(v) for v in seen] == [last_end, end], seen
    # The scheduler records it as the run starts, and the leased task's own record finds it written: one.
    (event,) = [e for e in _cli_events(airflow, "coalesced") if e["dag_id"] == COALESCED_DAG]
    slots = int((end - last_end).total_seconds() // 300) - 1
    assert event["detail"]["count"] == slots and event["run_id"] == first["dag_run_id"], event
    assert (event["detail"]["coalesced_start"], event["detail"]["coalesced_end"]) == (
        last_end.isoformat(), end.isoformat()
    ), event
    assert event["summary"].startswith(f"catch-up coalesced {slots} missed slot(s) into this run"), event
    assert [e for e in _cli_events(airflow, "skipped_catchup") if e["dag_id"] == COALESCED_DAG] == []
    assert airflow.statsd.count("scheduled.coalesced") == slots
    _counted_once(airflow)


def test_a_timetable_only_dag_records_its_skipped_catch_up_once(airflow: Deployment) -> None:
    """Plain tasks, ``CappedCatchupTimetable(max_backfill=2)``, down for a day after a run: the newest 2 slots
    run, and the ledger holds one ``skipped_catchup`` record of the first of them with the slots in between,
    written by the scheduler (keyed by the DAG id), also after that run is cleared and runs again. Before
    issue 38 item 9 nothing was recorded: only a leased task or an explicit helper call wrote it."""
    api = airflow.api
    newest = _newest_five_minute_slot()
    last_end = newest.subtract(days=1)
    result = subprocess.run(
        [sys.executable, "-c", PREVIOUS_RUN, PLAIN_SKIP_DAG, last_end.isoformat(), "5"],
        env=airflow.env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    api.unpause(PLAIN_SKIP_DAG)
    previous = f"scheduled__{last_end.subtract(minutes=5).isoformat()}"
    runs = wait(lambda: [r for r in api.runs(PLAIN_SKIP_DAG) if r["dag_run_id"] != previous],
                lambda found: len(found) >= 2 and all(r["state"] in ("success", "failed") for r in found), 180,
                f"the kept runs of {PLAIN_SKIP_DAG} to finish")
    first = runs[0]
    assert first["run_type"] == "scheduled" and first["state"] == "success", runs
    start = pendulum.parse(first["data_interval_start"])
    # The newest 2 due slots ran (a 5-minute boundary may have passed since): everything from the end of
    # the run before the outage to the first kept slot was skipped.
    assert newest.subtract(minutes=10) <= start <= pendulum.now("UTC"), runs
    skipped = int((start - last_end).total_seconds() // 300)
    assert skipped >= 286, (skipped, runs)

    def recorded() -> list[dict]:
        return [e for e in _cli_events(airflow, "skipped_catchup") if e["dag_id"] == PLAIN_SKIP_DAG]

    (event,) = recorded()
    assert (event["key"], event["run_id"], event["detail"]["count"]) == (PLAIN_SKIP_DAG, first["dag_run_id"], skipped)
    assert (event["detail"]["first_start"], event["detail"]["last_end"]) == (last_end.isoformat(), start.isoformat())
    assert event["detail"]["max_backfill"] == 2 and event["task_id"] is None, event
    assert event["summary"].startswith(f"catch-up skipped {skipped} older slot(s)"), event
    # The warning the writer of the record logs: the scheduler's.
    line = f"catch-up: {skipped} older slots of {PLAIN_SKIP_DAG} skipped"
    assert line in (airflow.logs / "scheduler.log").read_text(errors="replace"), airflow.tails()
    # Cleared and run again (the scheduler starts it again): still one record, logged and counted once.
    _rerun(airflow, PLAIN_SKIP_DAG, first, "skip_mode")
    assert [e["id"] for e in recorded()] == [event["id"]]
    assert (airflow.logs / "scheduler.log").read_text(errors="replace").count(line) == 1
    _counted_once(airflow)


def test_a_timetable_only_dag_records_its_coalesced_catch_up_once(airflow: Deployment) -> None:
    """Plain tasks, ``CappedCatchupTimetable(coalesce=True)``, down for a day: the kept run covers the whole
    gap, and the ledger holds one ``coalesced`` record of it, written by the scheduler, also after the run
    is cleared and runs again."""
    api = airflow.api
    newest = _newest_five_minute_slot()
    last_end = newest.subtract(days=1)
    _store_stale(airflow, PLAIN_COALESCE_DAG, last_end.add(minutes=5), minutes=5)
    api.unpause(PLAIN_COALESCE_DAG)
    runs = wait(lambda: api.runs(PLAIN_COALESCE_DAG),
                lambda found: found and all(r["state"] in ("success", "failed") for r in found), 150,
                f"the runs of {PLAIN_COALESCE_DAG} to finish")
    first = runs[0]
    assert (first["run_type"], first["state"], first["data_interval_start"]) == ("scheduled", "success", _z(last_end))
    end = pendulum.parse(first["data_interval_end"])
    slots = int((end - last_end).total_seconds() // 300) - 1

    def recorded() -> list[dict]:
        return [e for e in _cli_events(airflow, "coalesced") if e["dag_id"] == PLAIN_COALESCE_DAG]

    (event,) = recorded()
    assert (event["key"], event["run_id"], event["detail"]["count"]) == (
        PLAIN_COALESCE_DAG, first["dag_run_id"], slots
    ), event
    assert (event["detail"]["coalesced_start"], event["detail"]["coalesced_end"]) == (
        last_end.isoformat(), end.isoformat()
    ), event
    assert [e for e in _cli_events(airflow, "skipped_catchup") if e["dag_id"] == PLAIN_COALESCE_DAG] == []
    _rerun(airflow, PLAIN_COALESCE_DAG, first, "coalesce_mode")
    assert [e["id"] for e in recorded()] == [event["id"]]
    _counted_once(airflow)


def _z(moment: datetime.datetime) -> str:
    return pendulum.instance(moment).in_timezone("UTC").format("YYYY-MM-DDTHH:mm:ss") + "Z"

