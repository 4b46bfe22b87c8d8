"""The store goes away: at acquire, in the middle of a run, and for good or briefly; and it hangs.

A private embedded server (never ``LEASE_TEST_DSN``'s), since these tests stop, start and freeze it.
Promises checked (README): an unreachable store fails closed with LeaseStoreUnavailable within the connect
timeout (5 s by default; the issue allows 10 s); a keeper retries and reports the lease lost before its
TTL is up; once the store is back, the next acquire proceeds.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from datetime import timedelta

import psutil
import pytest

from airflow_lease_provider.core import FenceStore, LeaseLost, LeaseStore, LeaseStoreUnavailable
from tests.pg import EmbeddedServer, execute
from tests.reliability import outage
from tests.reliability.outage import Call, cluster, frozen, halt, is_up, start, stop

FAIL_CLOSED_WITHIN = 10.0
#: Short timeouts for the hang tests, and how long they wait for a call to give up: the connect timeout
#: plus the statement timeout, plus slack.
SHORT_TIMEOUTS = {"connect_timeout": timedelta(seconds=2), "statement_timeout": timedelta(seconds=2)}
SHORT_WAIT = 7.0



def test_store_down_at_acquire_fails_closed_fast_and_the_next_acquire_proceeds(
    server: EmbeddedServer, private: str
) -> None:
    warm = LeaseStore(server.dsn, schema=private)
    fences = FenceStore(server.dsn, schema=private)
    lease = warm.acquire("job", owner="run-1", ttl=timedelta(seconds=30))
    assert lease is not None and warm.release(lease) and fences.accept("blog", lease.token, key=lease.key)
    stop(server)
    cold = LeaseStore(server.dsn, schema=private)
    for name, call in {
        "open connection": lambda: warm.acquire("job", owner="run-2", ttl=timedelta(seconds=30)),
        "new store": lambda: cold.acquire("job", owner="run-2", ttl=timedelta(seconds=30)),
        "fence": lambda: fences.accept("blog", lease.token + 1, key=lease.key),
    }.items():
        started = time.monotonic()
        with pytest.raises(LeaseStoreUnavailable) as info:
            call()
        assert time.monotonic() - started < FAIL_CLOSED_WITHIN, name
        assert "unreachable" in str(info.value) and "password" not in str(info.value)
    start(server)
    nxt = warm.acquire("job", owner="run-2", ttl=timedelta(seconds=30))
    assert nxt is not None and nxt.token == lease.token + 1
    assert fences.accept("blog", nxt.token, key=nxt.key)


def test_a_server_that_accepts_no_connection_fails_closed_within_the_connect_timeout(
    server: EmbeddedServer, private: str
) -> None:
    store = LeaseStore(server.dsn, schema=private, connect_timeout=timedelta(seconds=3))
    with frozen(server, whole=False):  # the postmaster sleeps: connections wait in its backlog
        call = Call(lambda: store.acquire("job", owner="run-1", ttl=timedelta(seconds=30)))
        assert call.wait(FAIL_CLOSED_WITHIN), "acquire hung on a server that accepts no connection"
    assert isinstance(call.error, LeaseStoreUnavailable), call.error
    assert call.elapsed is not None and 2.5 <= call.elapsed < 3 + 1.5


def test_keeper_retries_through_an_outage_and_reports_lost_before_the_ttl_is_up(
    server: EmbeddedServer, private: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = LeaseStore(server.dsn, schema=private)
    ttl = timedelta(seconds=6)
    lease = store.acquire("job", owner="run-1", ttl=ttl)
    assert lease is not None
    lost: list[LeaseLost] = []
    keeper = store.keep(lease, on_lost=lost.append)
    while keeper.renewals < 1:
        time.sleep(0.05)
    caplog.set_level(logging.WARNING, logger="airflow_lease_provider.core.keeper")
    stopped = time.monotonic()  # the lease expires, by the database clock, at most one TTL from here
    stop(server)
    assert keeper.wait_lost(timeout=ttl.total_seconds() + 2)
    noticed = time.monotonic() - stopped
    assert noticed < ttl.total_seconds(), f"lost reported {noticed:.2f}s after the outage began"
    retries = [r for r in caplog.records if "renewal failed" in r.getMessage()]
    assert len(retries) >= 2, "the keeper gave up without retrying"
    with pytest.raises(LeaseLost, match="unreachable|no successful renewal"):
        keeper.check()
    assert len(lost) == 1 and lost[0].token == lease.token
    keeper.stop(release=True)
    start(server)
    # Back up: the next run gets in once the old lease has run out (database time), and not before.
    deadline = time.monotonic() + ttl.total_seconds() + 10
    nxt = None
    while nxt is None and time.monotonic() < deadline:
        nxt = store.acquire("job", owner="run-2", ttl=ttl)
        time.sleep(0.1)
    assert nxt is not None and nxt.token == lease.token + 1
    assert nxt.acquired_at >= keeper.lease.expires_at


def test_keeper_rides_out_an_outage_shorter_than_the_ttl(
    server: EmbeddedServer, private: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="airflow_lease_provider.core.keeper")
    store = LeaseStore(server.dsn, schema=private)
    lease = store.acquire("job", owner="run-1", ttl=timedelta(seconds=15))
    assert lease is not None
    with store.keep(lease) as keeper:
        while keeper.renewals < 1:
            time.sleep(0.05)
        stop(server)
        # Down until a renewal has failed at least once, then back.
        deadline = time.monotonic() + keeper.renew_every.total_seconds() + 3
        while not any("renewal failed" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no renewal was attempted during the outage"
            time.sleep(0.05)
        start(server)
        before = keeper.renewals
        deadline = time.monotonic() + 10
        while keeper.renewals <= before and time.monotonic() < deadline:
            keeper.check()
            time.sleep(0.1)
        keeper.check()
        assert keeper.renewals > before and keeper.late_renewals >= 1
        assert store.holder("job").token == lease.token  # the same lease, never re-acquired
    assert store.holder("job") is None


# -- a store that hangs: connected, but never answering ---------------------------------------------


def test_keeper_check_raises_lease_lost_while_the_store_hangs(server: EmbeddedServer, private: str) -> None:
    """``check()`` is the holder's safety net before a side effect. When the store hangs, the keeper thread
    sits in a renewal holding the store's connection lock; at the deadline, check() tries to write the
    LOST event through that same lock and blocks with it, instead of raising LeaseLost."""
    store = LeaseStore(server.dsn, schema=private)
    lease = store.acquire("job", owner="run-1", ttl=timedelta(seconds=3))
    assert lease is not None
    keeper = store.keep(lease)
    raised = threading.Event()

    def check_until_lost() -> None:
        while True:
            try:
                keeper.check()
            except LeaseLost:
                raised.set()
                return
            time.sleep(0.05)

    try:
        with frozen(server):
            started = time.monotonic()
            call = Call(check_until_lost)
            finished = call.wait(lease.ttl.total_seconds() + 2)
            assert finished and raised.is_set(), (
                f"keeper.check() still blocked {time.monotonic() - started:.1f}s into the hang"
            )
    finally:
        keeper.stop()


def test_acquire_on_an_open_connection_fails_closed_while_the_store_hangs(
    server: EmbeddedServer, private: str
) -> None:
    """statement_timeout is enforced by the server; a server that does not answer (frozen, or behind a
    partition that drops packets) leaves the client waiting in recv() for as long as it lasts."""
    store = LeaseStore(server.dsn, schema=private, **SHORT_TIMEOUTS)
    store.ensure_schema()
    with frozen(server):
        call = Call(lambda: store.acquire("job", owner="run-1", ttl=timedelta(seconds=30)))
        finished = call.wait(SHORT_WAIT)
    if finished:
        assert isinstance(call.error, LeaseStoreUnavailable), call.error
        assert call.elapsed is not None and call.elapsed < FAIL_CLOSED_WITHIN
    else:
        call.wait(30)  # it returns once the server is thawed
        pytest.fail(f"acquire was still waiting {SHORT_WAIT:.0f}s into the hang (timeouts: 2 s + 2 s)")


def test_acquire_with_default_timeouts_fails_closed_within_10s_while_the_store_hangs(
    server: EmbeddedServer, private: str
) -> None:
    """With the defaults (connect 5 s, statement 5 s): the watchdog cuts the statement off after 6 s, and
    then ``Database.run`` reconnects once, as it does for a connection that died while idle, and waits a
    full connect timeout more on the server that has just proved it does not answer: 11 s in all."""
    store = LeaseStore(server.dsn, schema=private)
    store.ensure_schema()
    with frozen(server):
        call = Call(lambda: store.acquire("job", owner="run-1", ttl=timedelta(seconds=30)))
        finished = call.wait(FAIL_CLOSED_WITHIN + 2)
    if not finished:
        call.wait(30)
        pytest.fail("acquire was still waiting 12 s into the hang")
    assert isinstance(call.error, LeaseStoreUnavailable), call.error
    assert call.elapsed is not None and call.elapsed < FAIL_CLOSED_WITHIN, f"failed closed after {call.elapsed:.1f}s"


# -- a connection that died while idle ------------------------------------------------------------


def test_fence_transaction_reconnects_a_connection_that_died_while_idle(
    fences: FenceStore, store: LeaseStore, pg_dsn: str, schema: str
) -> None:
    """After a server restart, a failover or an idle-session kill, the next publish must go through, as
    the next acquire does (``Database.run`` reconnects once; ``Database.transaction`` does not)."""
    assert fences.accept("blog", 1, key="job")
    assert store.holder("job") is None
    killed = execute(
        pg_dsn,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = 'airflow-lease' AND pid <> pg_backend_pid() AND query LIKE %s",
        (f'%"{schema}"%',),
    )
    assert len(killed) == 2, "both stores' sessions should have been found"
    assert store.holder("job") is None  # run() reconnects
    with fences.transaction("blog", 2, key="job") as cur:
        cur.execute("SELECT 1")
    assert fences.current("blog", key="job") == 2


# -- the outage helpers themselves: a freeze is always undone, and a server left stuck is recovered ---------


def test_a_backend_gone_while_the_server_freezes_leaves_no_process_stopped(
    server: EmbeddedServer, private: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend that exits (its client closed) and is reaped while ``frozen()`` stops the cluster: the
    freeze still holds every other process, and all of them run again after it. Here the listing of the
    postmaster's children includes a process that is already gone, as a listing taken just before the
    backend's exit does: before the fix its SIGSTOP raised NoSuchProcess before the freeze's ``try`` and
    left the postmaster and the rest stopped (the red run of issue 25: the next fast stop waited 60 s)."""
    exited = subprocess.Popen(["true"])
    gone = psutil.Process(exited.pid)
    exited.wait()  # exited and reaped: signalling it fails as for a backend the postmaster reaped
    children = psutil.Process.children

    def with_a_gone_one(self: psutil.Process, recursive: bool = False) -> list[psutil.Process]:
        return [*children(self, recursive=recursive), gone]

    monkeypatch.setattr(psutil.Process, "children", with_a_gone_one)
    with frozen(server):
        assert not is_up(server), "the server answered while frozen"
        listed = [p for p in cluster(server) if p.pid != gone.pid]
        assert listed and all(_status(p) in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE) for p in listed)
    monkeypatch.undo()
    assert not [p.pid for p in cluster(server) if _status(p) == psutil.STATUS_STOPPED]
    assert is_up(server)


def test_a_server_left_frozen_is_running_again_within_seconds(server: EmbeddedServer, private: str) -> None:
    """The fixtures' ``start()`` on a server a test left frozen (a freeze cut short): before, it found the
    server not answering and ran ``pg_ctl stop -m fast``, which waits for stopped processes until it gives
    up after 60 s, and the next test's setup did the same."""
    for proc in cluster(server):
        proc.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    start(server)
    assert is_up(server) and time.monotonic() - started < 15


def test_a_server_that_does_not_stop_is_killed_and_the_next_start_works(
    server: EmbeddedServer, private: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``halt()`` kills what a fast shutdown did not stop in time (here no time at all), and clears the
    lock files the killed postmaster left, so that the next start is not refused."""
    before = cluster(server)
    monkeypatch.setattr(outage, "STOP_WITHIN", 0.0)
    halt(server)
    assert not cluster(server) and not any(p.is_running() and _status(p) != psutil.STATUS_ZOMBIE for p in before)
    start(server)
    assert is_up(server)


def _status(proc: psutil.Process) -> str:
    try:
        return str(proc.status())
    except psutil.NoSuchProcess:
        return "gone"
