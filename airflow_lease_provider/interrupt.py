"""A lease lost mid-run stops the task at once: the keeper thread interrupts the task's main thread.

And a task told to stop (SIGTERM: marked failed or success, or cleared, while it runs; a worker shutting
down) stops and gives its lease back. Airflow 3's task runner answers SIGTERM only by calling the
operator's ``on_kill`` and lets the body go on; its supervisor sends SIGKILL 5 s later, so the lease was
never released and the next run of the job was skipped for the rest of the TTL.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow_lease_provider.core import LeaseKeeper, LeaseLost

# The keeper interrupts the task's main thread with this signal when the lease is lost mid-run.
_LOST_SIGNAL = signal.SIGUSR1


class TaskTerminated(Exception):
    """The task process got SIGTERM while it held a lease: the body is stopped and the lease released.

    An ``Exception`` (not Airflow's ``AirflowTaskTerminated``) so that the task's retries apply as for
    any other failure when nobody else decides its state.
    """


@contextmanager
def stop_on_terminate() -> Iterator[None]:
    """While the body runs, SIGTERM runs the handler in place (the task runner's: ``on_kill``) and then
    raises :class:`TaskTerminated` in the main thread, so the operator's way out releases the lease.

    Off the main thread (where handlers cannot be installed) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:  # someone chose to ignore it: so do we
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        if callable(previous):
            previous(signum, frame)
        raise TaskTerminated("the task process received SIGTERM: stopping the body and releasing the lease")

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def interrupt_on_loss(keeper: LeaseKeeper) -> Iterator[None]:
    """While the body runs, a lost lease raises :class:`LeaseLost` in the main thread at once.

    The keeper thread sends a signal to the main thread, whose handler raises; blocking system calls
    are interrupted too. Off the main thread (where handlers cannot be installed) the loss is
    reported when the body returns instead.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_lost(signum: int, frame: Any) -> None:
        if keeper.lost:
            keeper.check()

    previous = signal.signal(_LOST_SIGNAL, raise_lost)
    main = threading.main_thread().ident
    original = keeper.on_lost

    def on_lost(exc: LeaseLost) -> None:
        if original is not None:
            original(exc)
        if main is not None:
            signal.pthread_kill(main, _LOST_SIGNAL)

    keeper.on_lost = on_lost
    try:
        yield
    finally:
        keeper.on_lost = original
        signal.signal(_LOST_SIGNAL, previous)
