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
from worker_core.worker import EXIT_CONFIG, EXIT_UNAVAILABLE, WorkerConfig, check_worker_database, run_worker

#: what a supervisor exits with when its worker processes keep dying before their first heartbeat
EXIT_GAVE_UP = 4
#: how many of them in a row (whatever their slot), each within STARTUP_SECONDS of its start
GIVE_UP_AFTER = 5
STARTUP_SECONDS = 60.0


#: the connection that ends a dead worker's leases and records its stop: each statement waits this long at most
#: for a lock (a LOCK TABLE on job_queue, a VACUUM FULL, a migration; an operator's open transaction on the
#: workers row), and runs this long at most, as a worker's own statements do (its beats' lock_timeout). With no
#: bound, behind a table lock it waited for the whole lock, and the supervisor with it: it restarted no child and
#: watched no other meanwhile. What did not go through is tried again later (Supervisor._retry_unended)
END_LOCK_TIMEOUT_MS = 1_000
END_STATEMENT_TIMEOUT_MS = 5_000
#: all its statements together, for a server that stopped answering while TCP still acknowledges (db.Deadline)
END_DEADLINE_SECONDS = 10.0
#: a dead worker whose leases or stop could not be written is tried again after 1 s, then 2, 4... up to this
END_RETRY_MAX_SECONDS = 30.0
#: dead workers kept for another try at most (the oldest are forgotten: their leases run out by themselves)
END_RETRY_MAX_WORKERS = 1_000
#: at its own end (stopped, or every burst over), the dead children whose leases or stop could not be written are
#: tried again every second for shutdown_grace plus this many seconds at most (the database may be back by then):
#: it exited after one try, saying "tried again in 4 s", and their jobs sat `running` until their leases ran out
END_AT_EXIT_EXTRA_SECONDS = 5.0
END_AT_EXIT_RETRY_SECONDS = 1.0

#: how often the supervisor looks whether the embedded server it started (or attached to) still runs: its worker
#: processes are only given its URI, so none of them may start it again (worker_core.embedded.revive_if_down)
WATCH_SERVER_SECONDS = 1.0


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
    run out by themselves), after END_LOCK_TIMEOUT_MS at most behind a lock. :func:`_end_dead_worker` says
    too whether it had a row (it beat once at least)."""
    if (worker_id is None) == (process is None):
        raise ValueError("name the worker by its id or by its process")
    ended = _end_dead_workers(dsn, [worker_id] if worker_id is not None else [], process=process)
    if ended.error is not None:
        raise ended.error
    return ended.jobs, bool(ended.beaten)


@dataclasses.dataclass
class _Ended:
    #: the jobs whose leases ended
    jobs: list[str]
    #: the workers named that had a row (they beat once at least); None: not read (the database did not answer)
    beaten: set[str] | None
    #: what failed, if anything did: the leases, the stop, or both are to be tried again
    error: psycopg.Error | None


def _end_dead_workers(
    dsn: str, ids: list[str], *, process: tuple[str, int] | None = None, budget: float | None = None
) -> _Ended:
    """Ends the leases of dead workers ``ids`` (and of the workers of ``process``), and records the stop of
    those whose row does not say it: a child that exited without recording its own (its stop record failed:
    the workers table locked, the connection lost) read as lost for a day. The leases and the stops are two
    transactions: behind a lock on job_queue the stops are recorded all the same. Never waits longer than
    END_LOCK_TIMEOUT_MS for a lock, END_STATEMENT_TIMEOUT_MS for a statement, END_DEADLINE_SECONDS in all;
    what failed is in ``error`` (both parts may be tried again: each changes only what is still to change).
    ``budget``: seconds left for it all (connecting, at least 2, included), where less than those bounds."""
    deadline = END_DEADLINE_SECONDS if budget is None else max(1.0, min(END_DEADLINE_SECONDS, budget))
    jobs: list[str] = []
    beaten: set[str] | None = None
    error: psycopg.Error | None = None
    try:
        conn = db.connect(
            dsn,
            application_name="qconsole-supervisor",
            autocommit=True,
            statement_timeout_ms=END_STATEMENT_TIMEOUT_MS,
            lock_timeout_ms=END_LOCK_TIMEOUT_MS,
            connect_timeout=max(2, min(5, int(deadline))),  # libpq's least is 2 s
        )
    except psycopg.Error as e:
        return _Ended(jobs, beaten, e)
    try:
        with conn, db.Deadline(conn, deadline):
            if process is not None:
                rows = conn.execute(queries["workers_of_process"], {"host": process[0], "pid": process[1]})
                ids = [*ids, *(r["id"] for r in rows.fetchall())]
            now = now_on(conn, SYSTEM_CLOCK)  # the server's: a host ahead ended the leases in its own future
            try:
                with conn.transaction():
                    ended = conn.execute(queries["expire_worker_leases"], {"now": now, "workers": ids}).fetchall()
                    if ended:
                        conn.execute(queries["release_locks_of_jobs"], {"jobs": [r["id"] for r in ended]})
                jobs = [str(r["id"]) for r in ended]
            except psycopg.Error as e:
                if conn.broken:
                    raise
                error = e  # behind a lock on job_queue, say: the stops are recorded all the same
            with conn.transaction():
                had = conn.execute(_WORKERS_OF, {"ids": ids}).fetchall()
                conn.execute(_STOPPED_IF_NOT, {"now": now, "ids": ids})
            beaten = {str(r["id"]) for r in had}
    except psycopg.Error as e:
        error = e
    return _Ended(jobs, beaten, error)


#: which of the workers named have a row (they beat once at least), locked for the stop below
_WORKERS_OF = "SELECT id FROM workers WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE"
#: their stop, where it is not recorded yet: one a child recorded itself stays as it wrote it
_STOPPED_IF_NOT = (
    "UPDATE workers SET stopped_at = %(now)s, in_flight = 0, last_heartbeat_at = %(now)s"
    " WHERE id = ANY(%(ids)s) AND stopped_at IS NULL"
)


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
        #: dead children whose leases or stop are still to be written (see _expire), since when
        self._unended: dict[str, float] = {}
        self._retry_at = 0.0
        self._retry_delay = 1.0
        #: stopping, or every child gone: what could not be ended is tried again until it exits (_end_at_exit)
        self._exiting = False
        #: a second stop signal: its exit does not wait to end its dead children's leases any longer
        self._hurry = threading.Event()
        #: the dead children whose failure to be ended was said already while exiting (said once)
        self._said_unended: set[str] = set()
        self._end_error = ""
        self._watch_at = 0.0
        self.dsn = db.resolve_dsn(config.dsn)

    def _start(self, slot: int) -> None:
        self._generation += 1
        worker_id = f"{socket.gethostname()}:{os.getpid()}:w{slot}.{self._generation}"
        port = self.config.metrics_port + slot if self.config.metrics_port else None
        # checked once, by run(), for them all
        cfg = dataclasses.replace(
            self.config, worker_id=worker_id, dsn=self.dsn, metrics_port=port, check_database=False
        )
        refused = self.ctx.Value("b", 0, lock=False)
        proc = self.ctx.Process(
            target=_child, args=(cfg, self.log_format, self.log_level, refused), name=f"worker-{slot}", daemon=False
        )
        proc.start()
        self.children[slot] = (proc, worker_id)
        self._refusals[worker_id] = refused
        self._started_at[worker_id] = time.monotonic()

    def _expire(self, worker_id: str) -> bool | None:
        """Ends a dead child's leases and records its stop if it did not (_end_dead_workers), bounded: what
        did not go through is tried again later (_retry_unended), never waited for. Whether it had beaten once
        at least (None: the database did not say)."""
        return self._end(worker_id)

    def _end(self, *worker_ids: str, budget: float | None = None) -> bool | None:
        """_expire for dead children ``worker_ids`` and those still to be ended (_unended), on one connection:
        whether one of ``worker_ids`` had beaten once at least (None: the database did not say). ``budget``:
        seconds it may take at most (see _end_dead_workers)."""
        ids = [*worker_ids, *(i for i in self._unended if i not in worker_ids)]
        if not ids:
            return None
        ended = _end_dead_workers(self.dsn, ids, budget=budget)
        if ended.jobs:
            self.log.warning("ended %s leases of dead worker %s", len(ended.jobs), ", ".join(worker_ids or ids))
        if ended.error is not None:
            self._end_error = db.redact(str(ended.error).strip(), self.dsn)
            if not self._exiting:
                self.log.warning(
                    "could not end the leases or record the stop of %s (tried again in %.0f s): %s",
                    ", ".join(ids), self._retry_delay, self._end_error,
                )  # fmt: skip
            elif not set(ids) <= self._said_unended:  # once: it is tried again every second
                self._said_unended.update(ids)
                self.log.warning(
                    "could not end the leases or record the stop of %s (tried again every %g s before this"
                    " supervisor exits, %g s at most after its last worker process): %s",
                    ", ".join(ids), END_AT_EXIT_RETRY_SECONDS, self._exit_window(), self._end_error,
                )  # fmt: skip
            for worker_id in ids:
                self._unended.setdefault(worker_id, time.monotonic())
            while len(self._unended) > END_RETRY_MAX_WORKERS:
                del self._unended[next(iter(self._unended))]
            delay = END_AT_EXIT_RETRY_SECONDS if self._exiting else self._retry_delay
            self._retry_at = time.monotonic() + delay
            self._retry_delay = min(END_RETRY_MAX_SECONDS, 2 * self._retry_delay)
        else:
            if self._said_unended:
                self.log.warning(
                    "the database answered again: the leases of %s are ended and their stops recorded",
                    ", ".join(i for i in ids if i in self._said_unended),
                )
                self._said_unended.clear()
            self._unended.clear()
            self._retry_delay = 1.0
        if ended.beaten is None:
            return None
        return any(i in ended.beaten for i in worker_ids)

    def _exit_window(self) -> float:
        return self.config.shutdown_grace + END_AT_EXIT_EXTRA_SECONDS

    def _end_at_exit(self) -> None:
        """The dead children still to be ended (_unended) when the supervisor is about to exit, all its worker
        processes gone: tried again every END_AT_EXIT_RETRY_SECONDS for shutdown_grace +
        END_AT_EXIT_EXTRA_SECONDS at most (a second stop signal ends it sooner), then said, as an error: which
        worker processes, and what becomes of their jobs. It exited after one try, having said "tried again in
        4 s", and their jobs sat `running`, their workers read as lost, until their leases ran out."""
        self._exiting = True
        until = time.monotonic() + self._exit_window()
        self._retry_at = min(self._retry_at, time.monotonic() + END_AT_EXIT_RETRY_SECONDS)
        while self._unended and not self._hurry.is_set():
            left = until - time.monotonic()
            if left <= 0:
                break
            if time.monotonic() >= self._retry_at:
                self._watch_server()
                self._end(budget=left)
            else:
                self._hurry.wait(min(self._retry_at, until) - time.monotonic())
        if not self._unended:
            return
        self.log.error(
            "gave up ending the leases and recording the stops of worker processes %s (%s): the jobs they held"
            " stay running until their leases run out (each job's visibility timeout after its worker's last"
            " heartbeat that reached the database), then any worker takes them again; until then the console"
            " shows those workers as lost",
            ", ".join(self._unended), self._end_error or "the database did not answer",
        )  # fmt: skip

    def _watch_server(self) -> None:
        """The embedded server this process started (or attached to), looked at every WATCH_SERVER_SECONDS
        (worker_core.embedded.revive_if_dead: no connection) and started again if it died (a kill -9, the OOM
        killer). Its worker processes are only given its URI, and revive_if_down leaves a URI a process was only
        given alone (the server it would start is not counted for it, nothing would stop it): this process, the
        one attached, opened no connection while they lived, and the server stayed down for ever, their beats
        failing. As a container's PID 1, the dead postmaster is its child, which it reaps here. Nothing for
        another DSN."""
        now = time.monotonic()
        if now < self._watch_at:
            return
        self._watch_at = now + WATCH_SERVER_SECONDS
        embedded = sys.modules.get("worker_core.embedded")
        if embedded is None:  # never loaded: no embedded server here
            return
        try:
            embedded.revive_if_dead(self.dsn)
        except Exception:  # it says what failed itself; a surprise must not end the supervision
            self.log.exception("could not look at the embedded server")

    def _retry_unended(self) -> None:
        """The dead children whose leases or stop could not be written (behind a lock, the database away),
        once their retry is due: one connection for all of them."""
        if self._unended and time.monotonic() >= self._retry_at:
            self._end()

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
            self._hurry.set()  # nor is its end held up by dead children's leases any longer (_end_at_exit)
        self.stop()

    def _signal_children(self, signum: int) -> None:
        for proc, _ in list(self.children.values()):
            if proc.is_alive() and proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def run(self) -> int:
        """Supervise until stopped; an exit code. Refused first, as Worker.run() is (NotMigrated,
        WorkerRefused: see check_worker_database), before any process starts; its processes do not check again,
        each (unless config.check_database is False: the caller checked)."""
        if self.config.check_database:
            try:
                check_worker_database(
                    self.dsn,
                    embedded=db.configured_dsn(self.config.dsn) is None,
                    application_name=self.config.application_name,
                )
            except psycopg.OperationalError as e:  # its workers say it, and do what they do then
                self.log.warning(
                    "could not check the database before starting (starting anyway): %s",
                    db.redact(str(e).strip(), self.dsn),
                )
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
                    # it released what it held; its stop is recorded if its own record failed
                    self._expire(worker_id)
                    del self.children[slot]
                    self._refusals.pop(worker_id, None)
                    continue
                said = self._refusals.get(worker_id)
                gave_up = said is not None and said.value == EXIT_UNAVAILABLE  # said by it: see _child
                if self.config.burst and proc.exitcode == EXIT_UNAVAILABLE and gave_up:
                    # its claims kept failing (behind a lock on job_queue, say): restarted, its burst began
                    # again, for ever. What it held it released, or its leases run out; ending them here
                    # waits behind the same lock END_LOCK_TIMEOUT_MS at most, and its stop is recorded
                    self.log.error("worker %s gave up its burst: not restarted", worker_id)
                    self._expire(worker_id)
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
                self._exiting = True
                if self._unended:
                    self._end()  # a last try now, then again a while, bounded
                self._end_at_exit()
                return EXIT_CONFIG if self.refused else EXIT_UNAVAILABLE if self.gave_up else 0
            self._watch_server()
            self._retry_unended()
            self._stop.wait(0.2)
        return self._shutdown()

    def _shutdown(self) -> int:
        """Its children stop (killed after the grace, the cancel grace and 10 s), meanwhile the embedded server
        is watched and the dead ones' leases ended; what could not be is tried again a while (_end_at_exit)."""
        import multiprocessing.connection

        self._exiting = True
        self._signal_children(SUPERVISOR_STOP)
        deadline = time.monotonic() + self.config.shutdown_grace + self.config.cancel_grace + 10
        clean = []
        waiting = list(self.children.values())
        while waiting:
            left = deadline - time.monotonic()
            if left > 0:
                multiprocessing.connection.wait([proc.sentinel for proc, _ in waiting], min(0.5, left))
            for proc, worker_id in list(waiting):
                if proc.is_alive():
                    if time.monotonic() < deadline:
                        continue
                    self.log.error("worker %s did not stop in time: killed", worker_id)
                    proc.kill()
                    proc.join(5)
                else:
                    proc.join()
                waiting.remove((proc, worker_id))
                if proc.exitcode != 0:
                    # killed, or died of its own during the stop (a payload that kills its process): what it
                    # held is released now, not when its leases run out
                    self._expire(worker_id)
                else:
                    clean.append(worker_id)
            # an embedded server killed now: the workers' releases and stop records go through once it is back
            self._watch_server()
            self._retry_unended()
        # a clean exit released its jobs itself (or could not, the database away: their leases end here); its stop
        # is recorded here where its own record failed (it read as lost for a day): one connection for them all,
        # and for the dead children still to be ended
        if clean or self._unended:
            self._end(*clean)
        self._end_at_exit()
        return 0


def run_supervised(
    config: WorkerConfig, processes: int, log_format: str = "text", log_level: str | int = "INFO"
) -> int:
    return Supervisor(config, processes, log_format, log_level).run()


__all__ = ["EXIT_GAVE_UP", "Supervisor", "end_dead_worker", "exit_process", "run_supervised"]
