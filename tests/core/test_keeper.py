"""The renewal keeper against a real PostgreSQL: long work, killed connections, lost leases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from airflow_lease_provider.core import EventKind, LeaseStore
from airflow_lease_provider.core.errors import InvalidArgument
from tests.pg import execute


def test_keeper_holds_a_3s_lease_through_15s_of_work(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=3))
    assert lease is not None
    with store.keep(lease) as keeper:
        assert keeper.renew_every == timedelta(seconds=1)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            keeper.check()
            assert store.acquire("job", owner="b", ttl=timedelta(seconds=3)) is None
            time.sleep(0.5)
        assert keeper.renewals >= 12
        assert not keeper.lost
        current = keeper.lease
    assert store.holder("job") is None  # released on exit
    assert current.token == lease.token


def test_keeper_survives_pg_terminate_backend(store: LeaseStore, pg_dsn: str) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=3))
    assert lease is not None
    with store.keep(lease) as keeper:
        for _ in range(3):
            time.sleep(1.2)
            killed = execute(
                pg_dsn,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'airflow-lease' AND pid <> pg_backend_pid() "
                "AND query LIKE %s",
                (f'%"{store.schema}"%',),
            )
            assert killed, "the keeper's connection should have been found"
        time.sleep(4)
        keeper.check()
        assert keeper.renewals >= 5
    assert store.events.query(key="job", kind=EventKind.LOST) == []


KEEPER_CHILD = """
import json, sys, threading
from datetime import timedelta
from airflow_lease_provider.core import LeaseStore
store = LeaseStore(sys.argv[1], schema=sys.argv[2])
lease = store.acquire("job", owner="zombie", ttl=timedelta(seconds=3))
keeper = store.keep(lease)
print(json.dumps({"token": lease.token}), flush=True)
sys.stdin.readline()  # the test pauses us (SIGSTOP) and wakes us (SIGCONT), then writes a line
lost = keeper.wait_lost(timeout=10)
keeper.stop()  # waits for the loss to reach the ledger
print(json.dumps({"lost": lost, "reason": keeper.lost_reason, "renewals": keeper.renewals}), flush=True)
"""


def test_keeper_reports_lost_when_another_owner_took_the_lease_after_expiry(
    store: LeaseStore, pg_dsn: str
) -> None:
    store.ensure_schema()
    child = subprocess.Popen(
        [sys.executable, "-c", KEEPER_CHILD, pg_dsn, store.schema],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        token = json.loads(child.stdout.readline())["token"]
        # The holder's whole process freezes past its TTL: a GC pause, a lost VM, a SIGSTOP.
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(3.5)
        thief = store.acquire("job", owner="thief", ttl=timedelta(seconds=30))
        assert thief is not None and thief.token == token + 1
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        report = json.loads(child.stdout.readline())
    finally:
        child.kill()
        child.wait()
    assert report["lost"] is True
    # Either the keeper noticed the deadline had passed while frozen, or its renewal was refused.
    assert report["reason"]
    assert store.holder("job").owner == "thief"  # it never re-acquired
    lost = store.events.query(key="job", kind=EventKind.LOST)
    assert len(lost) == 1 and lost[0].token == token and lost[0].owner == "zombie"


def test_keeper_reports_a_refused_renewal_with_the_new_holder(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=3))
    assert lease is not None
    keeper = store.keep(lease)
    store.force_release("job", by="admin")
    other = store.acquire("job", owner="b", ttl=timedelta(seconds=30))
    assert other is not None
    assert keeper.wait_lost(timeout=5)
    assert "renewal refused" in (keeper.lost_reason or "")
    assert "'b'" in (keeper.lost_reason or "")
    # It never re-acquires on its own.
    time.sleep(1.5)
    assert store.holder("job").owner == "b"
    assert keeper.stop(release=True) is False


def test_wait_lost_times_out_while_the_lease_is_fine(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=3))
    assert lease is not None
    with store.keep(lease) as keeper:
        started = time.monotonic()
        assert keeper.wait_lost(timeout=1.5) is False
        assert 1.4 <= time.monotonic() - started < 3


def test_renew_every_must_be_shorter_than_the_ttl(store: LeaseStore) -> None:
    lease = store.acquire("job", owner="a", ttl=timedelta(seconds=3))
    assert lease is not None
    with pytest.raises(InvalidArgument, match="renew_every"):
        store.keep(lease, renew_every=timedelta(seconds=3))
    with pytest.raises(InvalidArgument, match="renew_every"):
        store.keep(lease, renew_every=timedelta(0))
    assert threading.active_count() >= 1
