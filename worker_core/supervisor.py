"""``--processes N``: N worker processes under one supervisor, with no coordinator beyond PostgreSQL.

The supervisor restarts a child that dies (with backoff when it keeps dying), and ends a dead child's
leases at once so its jobs are reclaimed without waiting for their visibility timeout. A stop signal is
passed on to the children (as SUPERVISOR_STOP: see worker_core.signals), which finish or release their
jobs within the grace period; a second one, as SUPERVISOR_STOP_NOW, ends the grace. Then it exits 0.
Children that keep dying before their first heartbeat (GIVE_UP_AFTER in a row) make it give up: EXIT_GAVE_UP.
With ``burst``, a child that ends its burst is not restarted, nor one that gave up on its claims (they kept
failing: EXIT_UNAVAILABLE, which the supervisor exits with once the others are done too).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import psycopg

from worker_core import db
from worker_core.clock import SYSTEM_CLOCK, now_on
from worker_core.logs import bound_logger
from worker_core.signals import STOP_SIGNALS, SUPERVISOR_STOP, SUPERVISOR_STOP_NOW, SignalRelay, relay_signals
from worker_core.sql import queries
from worker_core.worker import EXIT_CONFIG, EXIT_UNAVAILABLE, WorkerConfig, run_worker

#: what a supervisor exits with when its worker processes keep dying before their first heartbeat
EXIT_GAVE_UP = 4
#: how many of them in a row (whatever their slot), each within STARTUP_SECONDS of its start
GIVE_UP_AFTER = 5
STARTUP_SECONDS = 60.0


def end_dead_worker(dsn: str, *, worker_id: str | None = None, process: tuple[str, int] | None = None) -> list[str]:
    """A worker process that died without stopping: its leases end now (see :func:`_end_dead_worker`)."""
    return _end_dead_worker(dsn, worker_id=worker_id, process=process)[0]


def _end_dead_worker(
    dsn: str, *, worker_id: str | None = None, process: tuple[str, int] | None = None
) -> tuple[list[str], bool]:
    """A worker process that died without stopping (killed, crashed, or a payload that killed it): its leases
    end now, so any worker reclaims its jobs at once instead of when their visibility timeout runs out, and
    its row in ``workers`` says it stopped (it read as alive until its heartbeat went stale, then as lost),
    and the lock_key leases of those jobs (PostgreSQL backend; Redis ones run out by themselves) end too.
    Name it by ``worker_id``, or by ``process`` = (host, pid) when its id is not known (a worker a console
    started). Returns the ids of the jobs whose leases ended; raises psycopg.Error (the leases then still
    run out by themselves). :func:`_end_dead_worker` says too whether it had a row (it beat once at least)."""
    if (worker_id is None) == (process is None):
        raise ValueError("name the worker by its id or by its process")
    with db.connect(dsn, application_name="qconsole-supervisor") as conn, conn.transaction():
        if process is not None:
            rows = conn.execute(queries["workers_of_process"], {"host": process[0], "pid": process[1]})
            ids = [r["id"] for r in rows.fetchall()]
        else:
            ids = [worker_id]
        now = now_on(conn, SYSTEM_CLOCK)  # the server's: a host ahead ended the leases in its own future
        ended = conn.execute(queries["expire_worker_leases"], {"now": now, "workers": ids}).fetchall()
        if ended:
            conn.execute(queries["release_locks_of_jobs"], {"jobs": [r["id"] for r in ended]})
        beat = False
        for one in ids:
            beat = conn.execute(queries["worker_stopped"], {"now": now, "id": one}).rowcount > 0 or beat
    return [str(r["id"]) for r in ended], beat


def _child(config: WorkerConfig, log_format: str, log_level: str | int, refused: Any) -> None:
    from worker_core.logs import setup_logging

    setup_logging(log_format, log_level)
    _stop_when_orphaned()
    code = run_worker(config)
    if code in (EXIT_CONFIG, EXIT_UNAVAILABLE):
        # said by the worker itself: an exit code alone is no proof, a payload (or a C library) may call
        # exit(2), and that one is a crash to restart from
        refused.value = code
    exit_process(code)


def exit_process(code: int) -> NoReturn:
    """End a worker process whose Worker.run() returned (its jobs released, its final beat written) now.

    The interpreter's own exit joins the threads of every concurrent.futures executor, unbounded: an async
    handler's asyncio.to_thread (or run_in_executor) call blocking on after its job was released kept the
    process for as long as it ran (under --processes, until the supervisor killed it, its leases left to
    run out). What atexit runs is run first, explicitly: the embedded server's bookkeeping (the last process
    using it stops it), the logging handlers' flush, multiprocessing's own; then the standard streams are
    flushed, and ``os._exit``."""
    try:
        atexit._run_exitfuncs()  # each one's error is printed, and the others run
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _stop_when_orphaned() -> None:
    """A worker whose supervisor died (SIGKILL, the OOM killer: nothing of it ran) stops as on the
    supervisor's stop, gracefully: else it went on claiming, out of reach of the signals sent to the
    service, and a restarted service started a second set beside it."""
    import multiprocessing.connection

    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), SUPERVISOR_STOP)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


class Supervisor:
    def __init__(
        self, config: WorkerConfig, processes: int, log_format: str = "text", log_level: str | int = "INFO"
    ) -> None:
        self.config = config
        self.processes = processes
        self.log_format = log_format
        self.log_level = log_level
        self.log = bound_logger("worker_core.supervisor")
        self.ctx = mp.get_context("spawn")
        self.children: dict[int, tuple[BaseProcess, str]] = {}
        #: per worker id: set by the child to its worker's exit code when it refused its configuration, or gave
        #: up its burst (see _child)
        self._refusals: dict[str, Any] = {}
        self._started_at: dict[str, float] = {}
        #: children in a row that died within STARTUP_SECONDS of their start, before their first heartbeat
        self._stillborn = 0
        self.restarts = 0
        #: children that refused their configuration, and were not restarted
        self.refused = 0
        #: burst children that gave up on their claims (EXIT_UNAVAILABLE), and were not restarted
        self.gave_up = 0
        self._stop = threading.Event()
        self._generation = 0
        self._recent_deaths: list[float] = []
        self.dsn = db.resolve_dsn(config.dsn)

    def _start(self, slot: int) -> None:
        self._generation += 1
        worker_id = f"{socket.gethostname()}:{os.getpid()}:w{slot}.{self._generation}"
        port = self.config.metrics_port + slot if self.config.metrics_port else None
        cfg = dataclasses.replace(self.config, worker_id=worker_id, dsn=self.dsn, metrics_port=port)
        refused = self.ctx.Value("b", 0, lock=False)
        proc = self.ctx.Process(
            target=_child, args=(cfg, self.log_format, self.log_level, refused), name=f"worker-{slot}", daemon=False
        )
        proc.start()
        self.children[slot] = (proc, worker_id)
        self._refusals[worker_id] = refused
        self._started_at[worker_id] = time.monotonic()

    def _expire(self, worker_id: str) -> bool | None:
        """Ends a dead child's leases. Whether it had beaten once at least (None: the database did not say)."""
        try:
            ended, beat = _end_dead_worker(self.dsn, worker_id=worker_id)
        except psycopg.Error as e:
            self.log.warning("could not end the leases of %s: %s", worker_id, db.redact(str(e), self.dsn))
            return None
        if ended:
            self.log.warning("ended %s leases of dead worker %s", len(ended), worker_id)
        return beat

    def stop(self) -> None:
        self._stop.set()

    def _install_signals(self) -> None:
        # not from the handler: see worker_core.signals. SUPERVISOR_STOP too, as a worker takes it (from a
        # console that started this one, say): graceful, never a second signal
        self._signals = relay_signals(self._on_signal, (*STOP_SIGNALS, SUPERVISOR_STOP))

    _signals: SignalRelay | None = None

    def _on_signal(self, signum: int) -> None:
        """The first: stop (the children get SUPERVISOR_STOP, graceful). A second: the children release
        their running jobs now."""
        if self._stop.is_set() and signum != SUPERVISOR_STOP:
            self._signal_children(SUPERVISOR_STOP_NOW)
        self.stop()

    def _signal_children(self, signum: int) -> None:
        for proc, _ in list(self.children.values()):
            if proc.is_alive() and proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def run(self) -> int:
        self._install_signals()
        try:
            return self._supervise()
        except BaseException:
            # a child that cannot be started (no memory, no process left), say: the ones running are not
            # left behind, unsupervised and out of reach of the signals sent to this process
            self.log.exception("supervisor error: stopping the worker processes")
            self._shutdown()
            raise
        finally:
            # the handlers from before come back and the relay thread ends (worker_core.signals)
            relay, self._signals = self._signals, None
            if relay is not None:
                relay.uninstall()

    def _supervise(self) -> int:
        for slot in range(self.processes):
            self._start(slot)
        self.log.info("supervising %s worker processes", self.processes)
        while not self._stop.is_set():
            for slot, (proc, worker_id) in list(self.children.items()):
                if proc.is_alive():
                    continue
                proc.join()
                # forgotten whatever comes next: a child that had beaten, then died, kept its entry for ever
                started_at = self._started_at.pop(worker_id, 0.0)
                if self.config.burst and proc.exitcode == 0:
                    del self.children[slot]
                    self._refusals.pop(worker_id, None)
                    continue
                said = self._refusals.get(worker_id)
                gave_up = said is not None and said.value == EXIT_UNAVAILABLE  # said by it: see _child
                if self.config.burst and proc.exitcode == EXIT_UNAVAILABLE and gave_up:
                    # its claims kept failing (behind a lock on job_queue, say): restarted, its burst began
                    # again, for ever. What it held it released, or its leases run out: ending them here
                    # would wait behind the same lock, with no statement timeout
                    self.log.error("worker %s gave up its burst: not restarted", worker_id)
                    del self.children[slot]
                    self._refusals.pop(worker_id, None)
                    self.gave_up += 1
                    continue
                # whatever it died of, what it held is released now (a child that refused its configuration
                # held nothing: its row only says stopped)
                beat = self._expire(worker_id)
                refusal = self._refusals.pop(worker_id, None)
                if proc.exitcode == EXIT_CONFIG and refusal is not None and refusal.value == EXIT_CONFIG:
                    # its configuration was refused (a metrics port taken): restarted, it failed again and
                    # again, for ever; the others go on. A job's exit(2) is a crash like any other
                    self.log.error("worker %s refused its configuration: not restarted", worker_id)
                    del self.children[slot]
                    self.refused += 1
                    continue
                if beat is False and time.monotonic() - started_at < STARTUP_SECONDS:
                    self._stillborn += 1  # died at its start, before its first beat
                elif beat:
                    self._stillborn = 0
                if self._stillborn >= GIVE_UP_AFTER:
                    # failing for good at start (a module it cannot import there, say): restarted every few
                    # seconds for ever, the service looked up; exit non-zero so a process manager sees it
                    self.log.error(
                        "%s worker processes in a row died before their first heartbeat (the last exited with %s):"
                        " giving up, see their errors above",
                        self._stillborn,
                        proc.exitcode,
                    )
                    del self.children[slot]
                    self._shutdown()
                    return EXIT_GAVE_UP
                self.log.warning("worker %s exited with %s: restarting", worker_id, proc.exitcode)
                now = time.monotonic()
                self._recent_deaths = [t for t in self._recent_deaths if now - t < 30] + [now]
                if len(self._recent_deaths) > 3 * self.processes:
                    self._stop.wait(min(5.0, 0.2 * len(self._recent_deaths)))
                if self._stop.is_set():
                    break  # stopped during the backoff: not restarted, only to be stopped at once
                self.restarts += 1
                self._start(slot)
            if not self.children:
                return EXIT_CONFIG if self.refused else EXIT_UNAVAILABLE if self.gave_up else 0
            self._stop.wait(0.2)
        return self._shutdown()

    def _shutdown(self) -> int:
        self._signal_children(SUPERVISOR_STOP)
        deadline = time.monotonic() + self.config.shutdown_grace + self.config.cancel_grace + 10
        for proc, worker_id in self.children.values():
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                self.log.error("worker %s did not stop in time: killed", worker_id)
                proc.kill()
                proc.join(5)
            if proc.exitcode != 0:
                # killed, or died of its own during the stop (a payload that kills its process): what it
                # held is released now, not when its leases run out. A clean exit released its jobs itself
                self._expire(worker_id)
        return 0


def run_supervised(
    config: WorkerConfig, processes: int, log_format: str = "text", log_level: str | int = "INFO"
) -> int:
    return Supervisor(config, processes, log_format, log_level).run()


__all__ = ["EXIT_GAVE_UP", "Supervisor", "end_dead_worker", "exit_process", "run_supervised"]
