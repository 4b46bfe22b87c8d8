"""A lease lost mid-run stops the task at once: the keeper thread interrupts the task's main thread."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow_lease_provider.core import LeaseKeeper, LeaseLost

# The keeper interrupts the task's main thread with this signal when the lease is lost mid-run.
_LOST_SIGNAL = signal.SIGUSR1


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
