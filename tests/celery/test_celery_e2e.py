"""Leases on a distributed Airflow: CeleryExecutor, Redis broker, PostgreSQL metadata, two workers.

Runs are triggered through the REST API with no logical date; task states, try history, host names
and skip reasons are read back through the API. Tests run in file order on one deployment; the
``kill -9`` test is last because it leaves worker A dead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from airflow_lease_provider.core import EventKind, LeaseStore
from tests.celery.deployment import HEARTBEAT_TIMEOUT, LEASE_SCHEMA, Deployment
from tests.pg import execute, q

pytestmark = [pytest.mark.celery, pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.needs("redis")]


@contextlib.contextmanager
def explained(deployment: Deployment) -> Iterator[None]:
    """On failure, show what the processes and tasks logged."""
    try:
        yield
    except BaseException:
        print(deployment.tails())
        print("--- task logs ---\n" + deployment.task_logs()[-8000:])
        raise


def _pids(deployment: Deployment, marker: str) -> tuple[int, int, int]:
    pid, pgid, token = deployment.marker(marker).read_text().split()
    return int(pid), int(pgid), int(token)


def test_overlapping_runs_on_two_workers_one_runs_and_the_other_is_skipped_naming_the_holder(
    celery_deployment: Deployment, lease_store: LeaseStore
) -> None:
    d = celery_deployment
    with explained(d):
        run_a = d.trigger("celery_overlap_a")
        d.wait(lambda: d.marker("celery_overlap_a-acquired").exists(), "run A to take the lease on worker A")
        run_b = d.trigger("celery_overlap_b")
        d.wait(
            lambda: d.task_state("celery_overlap_b", run_b, "hold") in ("skipped", "success", "failed"),
            "run B's leased task to finish on worker B",
        )
        d.write_marker("overlap-let-go")
        assert d.wait_run("celery_overlap_a", run_a) == "success"

        held = d.task_instance("celery_overlap_a", run_a, "hold")
        skipped = d.task_instance("celery_overlap_b", run_b, "hold")
        assert (held["state"], held["hostname"]) == ("success", d.hostnames["a"])
        assert (skipped["state"], skipped["hostname"]) == ("skipped", d.hostnames["b"])
        assert not d.marker("celery_overlap_b-acquired").exists(), "the skipped run's body ran"

        detail = d.xcom("celery_overlap_b", run_b, "hold", "lease_skip_reason")
        reason = detail["reason"]
        assert f"celery_overlap_a/{run_a}" in reason, reason  # the holder's run ...
        assert f"on host {d.hostnames['a']}" in reason, reason  # ... and its worker's host
        assert detail["holder_host"] == d.hostnames["a"]
        assert detail["holder_owner"].startswith(f"celery_overlap_a/{run_a}")
        # The ledger agrees: one acquire (on worker A), one overlap skip (on worker B).
        acquired = lease_store.events.query(key="celery-overlap", kind=EventKind.ACQUIRED)
        assert [e.detail["host"] for e in acquired] == [d.hostnames["a"]]
        assert len(lease_store.events.query(key="celery-overlap", kind=EventKind.SKIPPED_OVERLAP)) == 1


def test_a_frozen_worker_is_retried_elsewhere_and_the_zombie_cannot_publish(
    celery_deployment: Deployment, lease_store: LeaseStore
) -> None:
    d = celery_deployment
    with explained(d):
        run = d.trigger("celery_zombie")
        d.wait(lambda: d.marker("zombie-try1").exists(), "try 1 to take the lease on worker A")
        _, task_pgid, token1 = _pids(d, "zombie-try1")
        # Freeze worker A: its Celery processes (with the supervisor that heartbeats) and the task's
        # own process group. Airflow stops hearing from the task; the lease stops being renewed.
        d.signal_worker("a", signal.SIGSTOP)
        os.killpg(task_pgid, signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            d.add_queue("b", "a")  # worker A's queue is served by B now, as by any other live worker
            d.wait(lambda: d.marker("zombie-try2-published").exists(), "try 2 to publish on worker B", timeout=300)
            retried_after = time.monotonic() - frozen_at
            assert retried_after >= HEARTBEAT_TIMEOUT  # Airflow waited for the missing heartbeats
            token2 = int(d.marker("zombie-try2-published").read_text())
            assert token2 > token1
            # A is resumed (its task first, the supervisor still frozen, so nothing kills the task
            # before it acts): its keeper reports the loss, and the publish it goes on with is refused.
            os.killpg(task_pgid, signal.SIGCONT)
            d.wait(lambda: d.marker("zombie-try1-lost").exists(), "the resumed zombie's keeper to report the loss")
            d.write_marker("zombie-go")
            d.wait(lambda: d.marker("zombie-try1-refused").exists(), "the zombie's publish to be refused")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(task_pgid, signal.SIGCONT)
            d.signal_worker("a", signal.SIGCONT)
            d.remove_queue("b", "a")
        assert d.wait_run("celery_zombie", run) == "success"

        tries = {t["try_number"]: t for t in d.tries("celery_zombie", run, "publish")}
        assert tries[1]["hostname"] == d.hostnames["a"] and tries[1]["state"] != "success"
        assert (tries[2]["hostname"], tries[2]["state"]) == (d.hostnames["b"], "success")
        # The target holds try 2's write only.
        rows = execute(d.lease_dsn, q("SELECT writer, token FROM {schema}.zombie_target", LEASE_SCHEMA))
        assert rows == [("try2", token2)], rows
        assert not d.marker("zombie-try1-published").exists()
        refusal = d.marker("zombie-try1-refused").read_text()
        assert f"rejected token {token1}: it has already accepted token {token2}" in refusal, refusal
        # The ledger: the keeper's loss of token 1, and the fence's refusal of it.
        lost = lease_store.events.query(key="celery-zombie", kind=EventKind.LOST)
        assert any(e.token == token1 for e in lost), lost
        rejected = lease_store.events.query(key="celery.zombie_target", kind=EventKind.FENCE_REJECTED)
        assert [e.token for e in rejected] == [token1], rejected
        hosts = {e.token: e.detail["host"] for e in lease_store.events.query(key="celery-zombie", kind="acquired")}
        assert hosts == {token1: d.hostnames["a"], token2: d.hostnames["b"]}


def test_the_store_unreachable_from_one_worker_fails_its_tasks_closed_and_the_other_runs(
    celery_deployment: Deployment, lease_store: LeaseStore
) -> None:
    d = celery_deployment
    with explained(d):
        d.proxies["b"].down()  # worker B's path to the store is cut; worker A's is not
        try:
            started = time.monotonic()
            run_a = d.trigger("celery_unreachable_a")
            run_b = d.trigger("celery_unreachable_b")
            assert d.wait_run("celery_unreachable_b", run_b) == "failed"
            assert d.wait_run("celery_unreachable_a", run_a) == "success"
            elapsed = time.monotonic() - started
        finally:
            d.proxies["b"].up()
        a = d.task_instance("celery_unreachable_a", run_a, "body")
        b = d.task_instance("celery_unreachable_b", run_b, "body")
        assert (a["state"], a["hostname"]) == ("success", d.hostnames["a"])
        assert (b["state"], b["hostname"]) == ("failed", d.hostnames["b"])
        assert d.marker("celery_unreachable_a-ran").exists()
        assert not d.marker("celery_unreachable_b-ran").exists(), "a task ran without its lease"
        assert "LeaseStoreUnavailable" in d.task_logs()
        assert lease_store.holder("celery-unreachable-b") is None
        assert elapsed < 180


def test_kill_9_of_a_worker_mid_task_the_lease_lapses_within_its_ttl_and_the_retry_succeeds_elsewhere(
    celery_deployment: Deployment, lease_store: LeaseStore
) -> None:
    d = celery_deployment
    with explained(d):
        run = d.trigger("celery_kill")
        d.wait(lambda: d.marker("kill-try1").exists(), "try 1 to take the lease on worker A")
        _, task_pgid, token1 = _pids(d, "kill-try1")
        lease = lease_store.holder("celery-kill")
        assert lease is not None and lease.token == token1
        ttl = lease.ttl.total_seconds()
        # The whole host goes: the Celery worker with its pool and supervisors, and the task.
        d.signal_worker("a", signal.SIGKILL)
        os.killpg(task_pgid, signal.SIGKILL)
        killed_at = time.monotonic()
        d.procs["worker-a-killed"] = d.procs.pop("worker-a")
        d.wait(lambda: lease_store.holder("celery-kill") is None, "the dead worker's lease to lapse", timeout=ttl + 5)
        lapsed_after = time.monotonic() - killed_at
        assert lapsed_after <= ttl + 1.0, f"lease outlived its TTL ({ttl} s) by {lapsed_after - ttl:.1f} s"
        d.add_queue("b", "a")
        assert d.wait_run("celery_kill", run, timeout=300) == "success"

        tries = {t["try_number"]: t for t in d.tries("celery_kill", run, "work")}
        assert tries[1]["hostname"] == d.hostnames["a"] and tries[1]["state"] != "success"
        assert (tries[2]["hostname"], tries[2]["state"]) == (d.hostnames["b"], "success")
        _, _, token2 = _pids(d, "kill-try2")
        assert token2 > token1
        assert lease_store.holder("celery-kill") is None  # released by try 2
