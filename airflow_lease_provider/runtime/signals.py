"""A lease lost mid-run stops the task at once: the keeper thread interrupts the task's main thread.

And a task told to stop (SIGTERM: marked failed or success, or cleared, while it runs; a worker shutting
down) stops and gives its lease back. Airflow 3's task runner answers SIGTERM only by calling the
operator's ``on_kill`` and lets the body go on; its supervisor sends SIGKILL 5 s later, so the lease was
never released and the next run of the job was skipped for the rest of the TTL.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow_lease_provider.core import LeaseKeeper, LeaseLost
from airflow_lease_provider.core.errors import Interruption

log = logging.getLogger(__name__)

# The keeper interrupts the task's main thread with this signal when the lease is lost mid-run.
_LOST_SIGNAL = signal.SIGUSR1


class TaskTerminated(Interruption):
    """The task process got SIGTERM while it held a lease: the body is stopped and the lease released.

    An ``Exception`` (not Airflow's ``AirflowTaskTerminated``) so that the task's retries apply as for
    any other failure when nobody else decides its state; an
    :class:`~airflow_lease_provider.core.errors.Interruption`, since it lands wherever the body was, so a
    fence keeps the idempotency claim of a side effect it interrupted.
    """


class Terminate:
    """Whether SIGTERM came, from just before the acquire on, and whether it now stops the body at once."""

    def __init__(self) -> None:
        self.requested = False
        self._armed = False

    def check(self) -> None:
        """Raise :class:`TaskTerminated` if SIGTERM came (while the task acquired or got ready to run)."""
        if self.requested:
            raise TaskTerminated("the task process received SIGTERM: stopping and releasing the lease")

    @contextmanager
    def armed(self) -> Iterator[None]:
        """While the body runs: SIGTERM raises :class:`TaskTerminated` in the main thread at once (after the
        handler that was there before, the task runner's ``on_kill``); one that came earlier raises now."""
        self._armed = True  # before the check: a signal in between raises from the handler instead
        try:
            self.check()
            yield
        finally:
            self._armed = False


@contextmanager
def stop_on_terminate() -> Iterator[Terminate]:
    """From before the acquire until the task is done, SIGTERM runs the handler in place (the task runner's:
    ``on_kill``) and is noted. While the body runs (:meth:`Terminate.armed`) it then raises
    :class:`TaskTerminated`, so the operator's way out releases the lease; before that (the acquire, the
    XCom push, the keeper's start) the operator checks the note before the body starts and gives the lease
    back instead of running it: a SIGTERM in that window left the lease held for its whole TTL.

    Off the main thread (where handlers cannot be installed) nothing changes.
    """
    state = Terminate()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:  # someone chose to ignore it: so do we
        yield state
        return

    def terminate(signum: int, frame: Any) -> None:
        state.requested = True  # first: whatever the handler before does, the operator knows
        failed: Exception | None = None
        if callable(previous):
            try:
                previous(signum, frame)
            except Exception as exc:  # e.g. an on_kill that assumes the body started
                if state._armed:
                    failed = exc
                else:  # raised from here it would land anywhere (after a grant committed, say): note it only
                    log.warning("the SIGTERM handler before the lease's raised; the task stops all the same",
                                exc_info=True)
        if state._armed:
            raise TaskTerminated(
                "the task process received SIGTERM: stopping the body and releasing the lease"
            ) from failed

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def interrupt_on_loss(*keepers: LeaseKeeper) -> Iterator[None]:
    """While the body runs, a lost lease (of any of ``keepers``) raises :class:`LeaseLost` in the main
    thread at once.

    The keeper thread sends a signal to the main thread, whose handler raises; blocking system calls
    are interrupted too. Off the main thread (where handlers cannot be installed) the loss is
    reported when the body returns instead.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_lost(signum: int, frame: Any) -> None:
        for keeper in keepers:
            if keeper.lost:
                keeper.check()

    previous = signal.signal(_LOST_SIGNAL, raise_lost)
    main = threading.main_thread().ident
    originals = [keeper.on_lost for keeper in keepers]

    def on_lost_of(original: Any) -> Any:
        def on_lost(exc: LeaseLost) -> None:
            if original is not None:
                original(exc)
            if main is not None:
                signal.pthread_kill(main, _LOST_SIGNAL)

        return on_lost

    for keeper, original in zip(keepers, originals, strict=True):
        keeper.on_lost = on_lost_of(original)
    try:
        yield
    finally:
        for keeper, original in zip(keepers, originals, strict=True):
            keeper.on_lost = original
        signal.signal(_LOST_SIGNAL, previous)
