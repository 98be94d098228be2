"""Signals that stop a worker or a supervisor, acted on off the signal handler.

A Python signal handler runs in the main thread, between two of its bytecodes, whatever that thread holds
at the time. The main loops of the worker and the supervisor wait on ``threading.Event``s; inside such a
wait (or a ``clear()``) the thread holds the Event's lock, and a handler that ``set()`` that Event from
there waited for it for ever: a woken worker hung so on SIGTERM. The handler only puts the signal in a
``queue.SimpleQueue``, whose ``put`` is reentrant, and a thread of its own calls back.
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


def relay_signals(callback: Callable[[int], None], signals: Iterable[int] = STOP_SIGNALS) -> bool:
    """From the main thread: on each of ``signals``, ``callback(signum)`` on the relay thread. False (and
    nothing installed) from any other thread, where ``signal.signal`` is refused."""
    if threading.current_thread() is not threading.main_thread():
        return False
    received: queue.SimpleQueue[int] = queue.SimpleQueue()

    def handler(signum: int, frame: Any) -> None:
        received.put(signum)

    def relay() -> None:
        while True:
            callback(received.get())

    threading.Thread(target=relay, name="signals", daemon=True).start()
    for sig in signals:
        signal.signal(sig, handler)
    return True
