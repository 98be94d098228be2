"""Signals that stop a worker or a supervisor, acted on off the signal handler.

A Python signal handler runs in the main thread, between two of its bytecodes, whatever that thread holds
at the time. The main loops of the worker and the supervisor wait on ``threading.Event``s; inside such a
wait (or a ``clear()``) the thread holds the Event's lock, and a handler that ``set()`` that Event from
there waited for it for ever: a woken worker hung so on SIGTERM. The handler only puts the signal in a
``queue.SimpleQueue``, whose ``put`` is reentrant, and a thread of its own calls back. When what they stop
has ended (Worker.run, Supervisor.run return), the handlers from before are put back and that thread ends.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: what a supervisor sends its worker processes: stop within the grace, and never the "second signal" that
#: ends it (a terminal's Ctrl-C, or systemd's SIGTERM to the whole cgroup, reaches the children too: the
#: supervisor's own SIGTERM on top of it ended their grace at once)
SUPERVISOR_STOP = signal.SIGUSR2
#: what a supervisor sends them on a second signal of its own: release the running jobs now
SUPERVISOR_STOP_NOW = signal.SIGUSR1
WORKER_SIGNALS = (*STOP_SIGNALS, SUPERVISOR_STOP, SUPERVISOR_STOP_NOW)


class SignalRelay:
    """Handlers installed by relay_signals, and the thread that calls back: ``uninstall()`` (from the main
    thread, when what they stop has ended) puts back the handlers that were there before and ends the thread.
    Left installed, every run of a worker on the main thread of one process added a relay thread that waited
    for ever, and kept that worker (its buffers, its in-flight map) alive with it."""

    _END = -1  # no signal's number

    def __init__(self, callback: Callable[[int], None], signals: Iterable[int]) -> None:
        self._received: queue.SimpleQueue[int] = queue.SimpleQueue()
        received = self._received

        def handler(signum: int, frame: Any) -> None:
            received.put(signum)

        self._handler = handler
        self._previous: dict[int, Any] = {}
        self.thread = threading.Thread(target=self._relay, args=(callback,), name="signals", daemon=True)
        self.thread.start()
        for sig in signals:
            self._previous[sig] = signal.signal(sig, handler)

    def _relay(self, callback: Callable[[int], None]) -> None:
        while (signum := self._received.get()) != self._END:
            callback(signum)

    def uninstall(self) -> None:
        """Put back the previous handlers (where ours is still the one installed: one put there since is
        left alone) and end the relay thread, once the signals already received are called back."""
        previous, self._previous = self._previous, {}
        if previous and threading.current_thread() is threading.main_thread():
            for sig, before in previous.items():
                # None: a handler not installed from Python, which cannot be put back (ours stays, relaying
                # to nothing)
                if before is not None and signal.getsignal(sig) is self._handler:
                    signal.signal(sig, before)
        self._received.put(self._END)


def relay_signals(callback: Callable[[int], None], signals: Iterable[int] = STOP_SIGNALS) -> SignalRelay | None:
    """From the main thread: on each of ``signals``, ``callback(signum)`` on the relay thread, until the
    returned relay's ``uninstall()``. None (and nothing installed) from any other thread, where
    ``signal.signal`` is refused."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return SignalRelay(callback, signals)
