"""The worker: claim -> execute -> settle, with heartbeats, and nothing a handler does takes it down.

Threads of one worker process:
- the claimer (the caller's thread): claims as many jobs as there are free slots, woken by LISTEN/NOTIFY
  (the listener thread) with polling as the fallback;
- ``concurrency`` slot threads, each with its own connection: a job's transaction lives on it, and its
  handler runs on it;
- the watchdog thread: cancels a handler at its timeout and, if it ignores that for ``cancel_grace``
  seconds, abandons its slot thread (nothing more it sends reaches the server) and starts another in its
  place, which ends the abandoned transaction on the server before it settles the job;
- the heartbeat thread: extends the leases of in-flight jobs and of those waiting for the completer (and
  their lock_key leases), sees kills and lost leases, upserts the ``workers`` row, flushes metrics;
- the housekeeping thread, with a connection of its own: retention and rollups when it wins the lock
  (worker_core.maintenance); a long round never holds up the heartbeat, whose leases would run out;
- the completer thread: settles in batches the successes that have nothing to commit with them.

How a slot runs a job or a group of jobs, and settles it: worker_core.execution. The completer:
worker_core.completer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import heapq
import json
import math
import os
import queue as queue_mod
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import psycopg
from psycopg import sql
from psycopg.types.json import set_json_loads
from typing_extensions import LiteralString

from worker_core import db, maintenance, ops, policy
from worker_core.clock import SYSTEM_CLOCK, Clock, ServerAlignedClock, SystemClock
from worker_core.completer import Completer
from worker_core.context import JobContext
from worker_core.envelope import QUEUE_RE
from worker_core.errors import TableLocked, WorkerRefused
from worker_core.execution import Abandoned, Execution, RecurringFailure, Slot, UndecodablePayload, array_literal
from worker_core.locks import LockBackend, lease_seconds, lock_backend
from worker_core.logs import bound_logger, job_fields
from worker_core.metrics import MetricsBuffer
from worker_core.ops import check_schema, worker_refusal
from worker_core.producer import NotMigrated, publish_policy
from worker_core.registry import Registry, import_task_modules
from worker_core.registry import registry as global_registry
from worker_core.signals import SUPERVISOR_STOP, SUPERVISOR_STOP_NOW, WORKER_SIGNALS, SignalRelay, relay_signals
from worker_core.sql import queries

if TYPE_CHECKING:
    from worker_core.prometheus import WorkerExporter

#: a housekeeping round's statements (batches of deletes, an ANALYZE of a large table)
HOUSEKEEPING_TIMEOUT_MS = 300_000
#: the round at start prunes for this long at most: the first claim waits for it
FIRST_HOUSEKEEPING_SECONDS = 2.0
#: after a round that stopped with more past retention, the next one starts this soon
HOUSEKEEPING_CATCH_UP_SECONDS = 1.0
#: a worker's exit code when it refuses its configuration (a metrics port taken): starting it again would
#: change nothing, so neither the supervisor nor the console restarts it (the CLI's code for bad input)
EXIT_CONFIG = 2
#: a ``burst`` worker's exit code when it gave up on its claims (they kept failing for ``burst_give_up``
#: seconds: behind a lock on job_queue, a statement timeout, the server gone): the CLI's code for a database
#: unreachable or behind a lock. Also any worker's when its stop left jobs held that it could not release or
#: settle, the database not answering (Worker._say_left_held): their leases run out, then any worker takes them
EXIT_UNAVAILABLE = 3
#: how long a claim's read of its filters (paused queues, concurrency limits) waits for a lock on queues or
#: concurrency_limits before the claim goes on with those last read (Worker._refresh_filters_for_claims)
FILTERS_LOCK_WAIT_SECONDS = 1.0
#: a worker whose claims found the queue's tables missing (Worker._wait_for_migrations) runs the start check
#: again after 1 s, then after twice as long each time, up to this
MIGRATION_RECHECK_MAX_SECONDS = 30.0
#: how often the watchdog looks at running handlers (timeouts are enforced to within this)
WATCHDOG_TICK = 0.05
#: full groups of fast jobs a worker may hold beyond its slots' and prefetch's jobs (see Worker.max_in_flight):
#: in no-op and write drains on 2 cores, 3 x concurrency jobs in flight kept one or two groups running at a
#: time, and about 8 groups' worth was where throughput stopped rising (bench/README, "What changed")
GROUPS_IN_FLIGHT = 8
#: how long a busy worker stops claiming to drain for solo work (a lease expired, a suspect) it saw waiting,
#: once while it stays waiting: then it claims again, and runs the solo claim whenever it finds itself idle
#: (a fleet of long jobs stopped taking new work for as long as its longest job ran)
SOLO_DRAIN_SECONDS = 30.0
#: a worker's clock further than this from the database server's is said in its log (Worker._check_clock):
#: the worker itself then runs on the server's time (ServerAlignedClock), what else runs on its host does not
CLOCK_SKEW_WARN_SECONDS = 5.0
#: how long a statement of a beat waits for a lock before it gives up for this beat (the heartbeat connection's
#: lock_timeout): one beat interval, within these bounds. A table lock (a DBA's LOCK TABLE, a VACUUM FULL, an
#: ALTER TABLE, a migration) held up the whole beat until the statement timeout (30 s): behind a lock on
#: job_queue the worker's own row was never beaten, and every worker with jobs in flight read as lost. The
#: floor: the brief row waits of the fleet's metrics upserts must not fail the beats of a short interval
BEAT_LOCK_WAIT_MIN_SECONDS = 0.5
BEAT_LOCK_WAIT_MAX_SECONDS = 5.0
#: how long a stopping worker keeps trying to record its stop (workers.stopped_at) that failed (a lock on
#: workers, the connection lost): not recorded, it reads as lost until its row is pruned, a day later
STOP_RECORD_SECONDS = 5.0
#: how long past its grace periods (shutdown_grace, then cancel_grace) a stopping worker keeps trying to
#: release or settle its jobs through an outage (Worker.settle_deadline): each was tried again until its lease
#: would have run out, minutes, and the stop with it (systemd kills a unit after 90 s)
STOP_SETTLE_SECONDS = 3.0
#: the longest heartbeat_interval. A worker reads as lost after three of its own intervals (its row says its
#: interval: stats.lost_after_seconds), so a long one only delays that verdict, and its metrics reach the console
#: once an interval: past a minute, the console would say a dead worker's jobs are in good hands for minutes
MAX_HEARTBEAT_INTERVAL_SECONDS = 60.0
#: a job's lease is extended at least this many times over its visibility timeout, whatever the interval: a
#: lease shorter than the interval (a timeout of 1 s has a lease of 6 s; an interval of up to a minute) ran out
#: between two beats of a live worker, and an idle worker took the job and ran it again beside it
BEATS_PER_LEASE = 3
#: how often the heartbeat looks whether a beat is due: a job claimed with a short lease gets its first beat
#: within a third of its lease and this much, not at the next interval
HEARTBEAT_TICK_SECONDS = 0.5
#: the shortest wait between two beats, however short a lease in flight
MIN_BEAT_SECONDS = 0.5
CLAIM_RUN = queries["claim_run"].encode()
PLACEHOLDER_RE = re.compile(r"%\((\w+)\)s")


def _loads_utf8(data: str | bytes) -> Any:
    """The claimed payloads: JSON from the server is UTF-8, and json.loads of bytes guesses the encoding first.
    One too deeply nested for Python to decode fails its own job (UndecodablePayload), never the claim: the
    claim has committed, and an exception here would leave its whole batch running until the leases end."""
    try:
        return json.loads(data if isinstance(data, str) else str(data, "utf-8"))
    except RecursionError:
        return UndecodablePayload("nested too deeply")
    except ValueError as e:  # a number too long for int(): Python's limit of 4300 digits
        return UndecodablePayload(str(e))


def _lock_wait_error(error: BaseException) -> bool:
    """A statement cancelled by its statement timeout or refused by lock_timeout: what a claim behind a
    lock on job_queue fails with."""
    return isinstance(error, (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable))


def _schema_missing(error: BaseException) -> bool:
    """A statement named a table or a column the database does not have: it is not migrated (any more: it was
    recreated or restored without its migrations), or not by this version."""
    return isinstance(error, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn))


@dataclass
class WorkerConfig:
    dsn: str | None = None
    task_modules: tuple[str, ...] = ()
    #: None: every queue
    queues: tuple[str, ...] | None = None
    concurrency: int = 4
    batch_size: int | None = None
    #: sync jobs a slot may run in one transaction, each in its own savepoint (1: a transaction per job)
    group_max: int = 32
    #: the claimer puts no more of a type's measured handler time than this in one group. Wall time: under load it
    #: includes waits for the GIL and the server, so a budget of 20 ms shrank the groups of 2-process drains
    #: to ~2 jobs (more commits, more load, longer waits); 100 ms keeps fast handlers grouped while a
    #: handler of 100 ms or more (network calls) still runs one per slot, in parallel
    group_seconds: float = 0.1
    #: work claimed ahead of the free slots, so a slot never waits for a claim's round trip (None: twice
    #: ``concurrency``; 0: claim only for idle slots). Counted like ``concurrency``, in slot loads: a job
    #: that runs alone is one, a job of a type whose groups hold n jobs is 1/n (Worker.job_load). Their
    #: leases are extended by heartbeats like the rest.
    prefetch: int | None = None
    poll_interval: float = 1.0
    heartbeat_interval: float = 2.0
    shutdown_grace: float = 10.0
    #: how long a cancelled (killed, timed out) sync handler gets to return before it is abandoned
    cancel_grace: float = 2.0
    burst: bool = False
    #: a ``burst`` worker whose claims have failed for this long (seconds, with none going through since the
    #: run began or since the last that did) gives up: it stops as on a signal and ``run()`` returns
    #: EXIT_UNAVAILABLE. Behind a LOCK TABLE each claim fails at its statement timeout, and the burst retried
    #: for ever; a worker that is not a burst one keeps trying, whatever this says
    burst_give_up: float = 120.0
    lock_backend: str | None = None
    lock_contention_delay: float = 1.0
    idempotency_retention_seconds: float = 7 * 86400
    housekeeping_interval: float = 60.0
    #: whether this worker takes part in housekeeping: the winner of a round prunes with its own retention,
    #: for the whole fleet (a worker a console starts, with the defaults, takes no part)
    housekeeping: bool = True
    worker_id: str | None = None
    application_name: str = "qconsole-worker"
    #: serve this worker's Prometheus counters and histograms on this port
    metrics_port: int | None = None
    retention: maintenance.Retention = field(default_factory=maintenance.Retention)
    #: ``run()`` checks the database before it starts, as ``qconsole worker`` does (check_worker_database); False
    #: where the caller checked it: the CLI, and a supervisor for its worker processes (it checks once for all)
    check_database: bool = True

    def __post_init__(self) -> None:
        """Refused at construction, with what to write instead: ``task_modules="myapp.tasks"`` (a str) imported
        the modules ``m``, ``y``, ``a``... (``No module named 'm'``), and ``queues="billing"`` worked the
        queues ``b``, ``i``, ``l``..., none of them billing, claiming nothing and saying nothing. A list is
        taken as the tuple it would be."""
        self.task_modules = _names("task_modules", self.task_modules, "module", '("myapp.tasks",)')
        beat = self.heartbeat_interval
        # 0 beat without pause (Event.wait returns at once), and NaN compares false with everything
        if not (isinstance(beat, (int, float)) and beat > 0):
            raise ValueError(f"heartbeat_interval={beat!r}: a worker beats every so many seconds, more than 0")
        if beat > MAX_HEARTBEAT_INTERVAL_SECONDS:
            raise ValueError(
                f"heartbeat_interval={beat!r}: {MAX_HEARTBEAT_INTERVAL_SECONDS:g} s at most: a worker reads as lost"
                " only after three intervals, and its metrics reach the console once an interval"
            )
        if self.queues is not None:
            self.queues = _names("queues", self.queues, "queue", '("billing",)')
            bad = next((q for q in self.queues if not QUEUE_RE.match(q)), None)
            if bad is not None:
                raise ValueError(f"queues: {bad!r} is not a queue name (letters, digits, _ . : -)")


def _names(field_name: str, value: Any, what: str, example: str) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"WorkerConfig({field_name}={value!r}): a tuple of {what} names, not a str (it was read one letter per"
            f" {what}): write {field_name}=({value!r},), as in {field_name}={example}"
        )
    try:
        names = tuple(value)
    except TypeError:
        raise TypeError(f"WorkerConfig({field_name}={value!r}): a tuple of {what} names, as in {example}") from None
    for odd in (n for n in names if not isinstance(n, str) or not n.strip()):
        raise TypeError(f"WorkerConfig({field_name}=...): {odd!r} is not a {what} name (a non-empty str)")
    return names


def _hms(at: dt.datetime | None) -> str:
    """A lease's end, as a log line says it (UTC)."""
    if at is None:
        return "unknown"
    return at.astimezone(dt.timezone.utc).strftime("%H:%M:%SZ")


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(self, config: WorkerConfig, registry: Registry | None = None, clock: Clock = SYSTEM_CLOCK):
        self.config = config
        if config.task_modules:
            import_task_modules(config.task_modules)
        self.registry = registry or global_registry
        if not self.registry.job_types():
            raise ValueError("no task is registered: give --tasks MODULE with @worker_core.task handlers")
        # the system's clock is put onto the database server's when they differ (ServerAlignedClock); a test's
        # clock is taken as it is
        self.clock: Clock = ServerAlignedClock(clock) if isinstance(clock, SystemClock) else clock
        self.id = config.worker_id or default_worker_id()
        self.dsn = db.resolve_dsn(config.dsn)
        self.log = bound_logger("worker_core.worker", worker_id=self.id)
        self.locks: LockBackend = lock_backend(config.lock_backend, self.clock)
        self.metrics = MetricsBuffer(self.clock)
        self.completer = Completer(self)
        self.prefetch = 2 * config.concurrency if config.prefetch is None else max(0, config.prefetch)
        #: in slot loads (see job_load): what the slots run plus the prefetch buffer
        self.capacity = config.concurrency + self.prefetch
        #: in jobs: bounds what grouped fast jobs (a small load each) may add up to, and so the claims' size
        self.max_in_flight = max(self.capacity, GROUPS_IN_FLIGHT * config.group_max)
        self.batch_size = config.batch_size or self.max_in_flight
        self._stopping = threading.Event()
        #: set once the worker has fully stopped (after the grace period): ends the heartbeat thread, which
        #: keeps extending leases and seeing kills of the jobs that finish during a graceful shutdown
        self._halted = threading.Event()
        #: (monotonic) when the shutdown began: from then on settlements are tried again until settle_deadline
        self._stop_began: float | None = None
        #: jobs this worker could not release or settle (the database did not answer, or their rows stayed
        #: locked): still held by it until their leases run out (said when it stops: Worker._say_left_held)
        self._left_held: dict[uuid.UUID, Execution] = {}
        self._wake = threading.Event()
        self._slot_free = threading.Condition()
        self._in_flight: dict[uuid.UUID, Execution] = {}
        #: the in-flight jobs' slot loads, summed (see job_load); guarded by _slot_free like _in_flight
        self._load = 0.0
        #: jobs per slot load in the last claim: how many jobs the free load is worth in the next one
        self._jobs_per_load = 1.0
        #: in-flight jobs that run alone (a lease expired or a suspect): nothing else is claimed meanwhile
        self._solo_in_flight = 0
        #: guards the hand-over between a returning handler and the watchdog abandoning it
        self._exec_lock = threading.Lock()
        #: what the claimer hands the slots: a group of jobs (often of one), or None to stop a slot
        self._jobs: queue_mod.SimpleQueue[list[Execution] | None] = queue_mod.SimpleQueue()
        #: moving average of each job type's handler time (seconds): how many of its jobs make a group
        self._handler_seconds: dict[str, float] = {}
        #: the slot load of a job of each measured type that runs in groups (see job_load)
        self._type_load: dict[str, float] = {}
        self._threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()
        self._claim_conn: db.Conn | None = None
        #: the last claim found as many jobs as it asked for: the next waits for the WAL flush
        self._backlog = False
        #: the filters the claim connection's ``worker_core_claim`` was prepared with, and its quoting
        self._claim_prepared: tuple[dict[str, Any], Callable[[bytes], bytes]] | None = None
        #: when (by the worker's clock) the earliest claim began whose answer may have been lost: its jobs are
        #: looked for before the next claim (claimed_unheard), not left running for their visibility timeout
        self._unheard_since: dt.datetime | None = None
        #: when (by the worker's clock) the last claim began: its jobs' leases run from about then (lease_until)
        self._claimed_at = self.clock.now()
        #: lease-expired jobs or suspects are waiting: drain, then claim one to run alone
        self._want_solo = True
        #: until when (monotonic) the worker drains for solo work, claiming nothing while jobs are in flight:
        #: SOLO_DRAIN_SECONDS from the beat that found solo work, once while it stays waiting
        self._solo_drain_until = 0.0
        self._solo_seen = False
        #: (job_type, queue scope, max running) of the limited types this worker handles; refreshed on heartbeats
        self._limits: list[tuple[str, str, int]] = []
        #: types whose group commit the server refused for something a job did, until when (Worker.ungroup)
        self._ungrouped_until: dict[str, float] = {}
        #: job id -> times it was given back uncharged for a database error here (given_back_for_errors)
        self._given_back: dict[Any, int] = {}
        self._paused: list[str] = []
        self._filters_at: float | None = None
        self._limit_turn = 0
        #: a burst run does not end before this (monotonic) time: a job it gave back on lock contention is
        #: queued a little in the future, which ``burst_remaining`` does not count as work still to do
        self._burst_hold_until = 0.0
        #: (monotonic) since when a burst's claims (or its "anything left?" reads) have failed without one going
        #: through: the start of the run, or of the first failing one after one that went through
        self._failing_since: float | None = None
        #: why a burst worker gave up (see WorkerConfig.burst_give_up), once it has: run() returns
        #: EXIT_UNAVAILABLE
        self.gave_up: str | None = None
        #: (monotonic) times at which jobs this worker put back come due (retries, lock contention): an
        #: idle worker wakes for them, where nothing notifies (NOTIFY comes with inserts only); and until
        #: when the claim loop sleeps, if it does
        self._due: list[float] = []
        self._due_lock = threading.Lock()
        self._idle_until = 0.0
        #: this host's clock minus the database server's, at the last beat (seconds; None: not measured)
        self.clock_skew_seconds: float | None = None
        #: since when (monotonic) beats have been giving up on locks (None: the last one did not), and when
        #: that was last said
        self._held_up_since: float | None = None
        self._held_up_said_at = 0.0
        #: beats and claims that fail through an outage: said once, then once a minute, and their end
        self._beat_failures = RecurringFailure(self.log, "heartbeat")
        self._claim_failures = RecurringFailure(self.log, "claim")
        self._skew_said_until = 0.0
        self.zombies = 0
        #: jobs its stop left held (it could not release or settle them): run() then returns EXIT_UNAVAILABLE
        self.left_behind = 0
        self.claimed_total = 0
        #: claim statements that returned jobs, and groups committed: claimed_total / these = batch sizes
        self.claims = 0
        self.groups = 0

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Graceful: stop claiming; in-flight jobs get ``shutdown_grace`` seconds, then are released."""
        self._stopping.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def settle_deadline(self) -> float:
        """Until when (monotonic) a settlement or a release that the database does not take is tried again
        (Slot._write): while the worker runs, no bound but the job's lease; once it stops, its grace periods
        (read again: a second signal ends the first) and STOP_SETTLE_SECONDS from its stop's beginning. What
        could not be written by then is left to its lease, and said (_say_left_held)."""
        began = self._stop_began
        if began is None:
            return math.inf
        return began + self.config.shutdown_grace + self.config.cancel_grace + STOP_SETTLE_SECONDS

    def left_held(self, ex: Execution) -> None:
        """``ex``'s settlement or release could not be written: it stays this worker's until its lease runs
        out (its lease_until), then any worker takes it as an expired lease."""
        self._left_held[ex.job["id"]] = ex

    def settled(self, ex: Execution) -> None:
        """``ex``'s settlement or release was written after all (tried again later): no longer left held."""
        if self._left_held.get(ex.job["id"]) is ex:
            del self._left_held[ex.job["id"]]

    def _say_left_held(self) -> list[Execution]:
        """At the end of a stop: the jobs it could not release or settle (the database did not answer), said
        as such, with when their leases run out (after which any worker takes them, as expired leases: one at
        a time per idle worker, run alone, see claim_solo). Returns them."""
        now = self.clock.now()
        held = [ex for ex in self._left_held.values() if ex.lease_until is None or ex.lease_until > now]
        if not held:
            return held
        held.sort(key=lambda ex: (ex.lease_until or now, ex.job["id"].int))
        last = held[-1].lease_until
        listed = ", ".join(
            f"{ex.job['id']} ({ex.job['job_type']}, lease until {_hms(ex.lease_until)})" for ex in held[:20]
        )
        more = f" and {len(held) - 20} more" if len(held) > 20 else ""
        self.log.error(
            "stopped without releasing %s jobs (the database did not answer): they stay held by this worker until"
            " their leases run out, the last at %s, and any worker takes them then, as expired leases (one at a"
            " time per idle worker): %s%s",
            len(held), _hms(last), listed, more,
        )  # fmt: skip
        return held

    def _install_signals(self) -> None:
        self._signals = relay_signals(self._on_signal, WORKER_SIGNALS)

    def _uninstall_signals(self) -> None:
        """At the end of run(), after the shutdown (whose grace a second signal still ends): the handlers
        that were there before come back, and the relay thread ends (see worker_core.signals)."""
        relay, self._signals = self._signals, None
        if relay is not None:
            relay.uninstall()

    def _on_signal(self, signum: int) -> None:
        """SIGTERM, SIGINT, SIGHUP (on the relay thread: worker_core.signals): a graceful stop; a second
        one releases the jobs still running at once. From a supervisor: SUPERVISOR_STOP, graceful, which
        never counts as a first or second signal; SUPERVISOR_STOP_NOW, release now."""
        if signum == SUPERVISOR_STOP_NOW:
            self.config.shutdown_grace = 0
        elif signum != SUPERVISOR_STOP:
            self._stop_signals += 1
            if self._stop_signals > 1:
                self.config.shutdown_grace = 0  # second signal: release now
        # stopped first: a log line may block (a full pipe nobody reads), and the stop must not wait on it
        self.stop()
        self.log.info("signal %s: stopping (grace %ss)", signum, self.config.shutdown_grace)

    _stop_signals = 0
    _signals: SignalRelay | None = None
    #: the Prometheus endpoint (``metrics_port``), closed when run() ends
    _exporter: WorkerExporter | None = None

    def run(self) -> int:
        """Run until stopped (or, with ``burst``, until nothing is ready or running). Returns an exit code.

        First, as ``qconsole worker`` does, the database is checked (check_worker_database): a worker on a
        database with migrations pending (applied here on the embedded server), or on a read-only server or
        as a role that may not write the queue's tables, is refused before anything starts: NotMigrated or
        WorkerRefused is raised. Without it, it claimed nothing and said so once a second, for ever. Not
        with ``check_database=False`` (WorkerConfig): the caller checked. A worker whose claims later find the
        queue's tables missing (the database recreated or restored without its migrations, or not reachable when
        it started) says so once and waits for the migrations, checking again with backoff, or, with ``burst``,
        stops: see _wait_for_migrations."""
        if self.config.check_database:
            embedded = db.configured_dsn(self.config.dsn) is None
            try:
                check_worker_database(self.dsn, embedded=embedded, application_name=self.config.application_name)
            except psycopg.OperationalError as e:
                # not reachable now, or not answering in time: what it does then (a burst gives up after
                # burst_give_up, another keeps trying) it does as before
                self.log.warning(
                    "could not check the database before starting (starting anyway): %s",
                    db.redact(str(e).strip(), self.dsn),
                )
        self._install_signals()
        try:
            return self._run()
        finally:
            # after the shutdown: its final flush is served too, to a scrape that comes meanwhile
            if self._exporter is not None:
                self._exporter.close()
                self._exporter = None
            self._uninstall_signals()

    def _run(self) -> int:
        # a burst none of whose claims went through gives up counting from its start: behind a lock on
        # job_queue its start's own statements (beat, contracts, housekeeping) each waited out their timeout
        self._failing_since = time.monotonic()
        if self.config.metrics_port:
            from worker_core.prometheus import WorkerExporter

            try:
                exporter = WorkerExporter(self.metrics)
                exporter.serve(self.config.metrics_port)
                self._exporter = exporter
            except (OSError, OverflowError) as e:
                # taken, not ours to bind, or out of range (OverflowError): a configuration to fix, not a crash
                self.log.error("cannot serve metrics on port %s: %s", self.config.metrics_port, e)
                return EXIT_CONFIG
        # the policy file is looked for in the working directory: one started elsewhere (a systemd unit without
        # WorkingDirectory=) ran on the built-in defaults, and nothing said so
        try:
            policy_source = policy.current().source
        except policy.PolicyError as e:  # its types' contracts were built before: say it, run on them
            policy_source = f"unreadable ({e})"
        self.log.info(
            "worker starting: queues=%s types=%s concurrency=%s policy=%s",
            ",".join(self.config.queues) if self.config.queues else "*",
            ",".join(self.registry.job_types()),
            self.config.concurrency,
            policy_source,
        )
        # everything from the first thread on is undone by _shutdown, however it ends: a worker refused as it
        # published its types' contracts (a policy file that does not load) left its slot threads waiting for
        # ever, and the Worker with them
        try:
            for i in range(self.config.concurrency):
                self._spawn(self._slot_main, f"slot-{i}", i)
            self._publish_contracts()
            self._heartbeat_once()  # before the heartbeat thread: they share its connection
            if self.config.housekeeping:
                self._first_housekeeping()
            self._spawn(self._heartbeat_main, "heartbeat")
            if self.config.housekeeping:
                self._spawn(self._housekeeping_main, "housekeeping")
            self._spawn(self._watchdog_main, "watchdog")
            self._spawn(self.completer.run, "completer")
            self._spawn(self._listen_main, "listener")
            self._claim_loop()
        finally:
            self._shutdown()
        # jobs it could not release (the database away when it stopped) are still held: not a clean stop
        return EXIT_UNAVAILABLE if self.gave_up or self.left_behind else 0

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        """A thread of this worker, recorded in ``_threads`` while it lives: the ended ones are dropped here
        (a long-lived worker kept one record per abandoned handler's replacement slot, for ever)."""
        t = threading.Thread(target=target, args=args, name=f"{name}", daemon=True)
        t.start()
        with self._threads_lock:  # the claimer and the watchdog (_abandon) both spawn
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _shutdown(self) -> None:
        # from here settlements are bounded by the grace periods (settle_deadline), whatever the database does
        start = self._stop_began = time.monotonic()
        # jobs still waiting in the prefetch buffer are not started during a shutdown: released at once
        with self._exec_lock:
            for ex in list(self._in_flight.values()):
                if not ex.begun:
                    ex.ctx.cancel("shutdown")
        self._give_back_queued()
        with self._slot_free:
            # read again each time round: a second signal sets the grace to 0
            while self._in_flight and time.monotonic() < start + self.config.shutdown_grace:
                self._slot_free.wait(0.1)
        for ex in list(self._in_flight.values()):
            ex.ctx.cancel("shutdown")
        deadline = time.monotonic() + self.config.cancel_grace + 3
        with self._slot_free:
            while self._in_flight and time.monotonic() < deadline:
                self._slot_free.wait(0.1)
        for _ in range(self.config.concurrency):
            self._jobs.put(None)
        if any(t.name == "completer" for t in self._threads):  # not if the start failed before it
            # within the stop's bound too (1 s at least: its flush of what the slots handed it last)
            self.completer.stop(min(10.0, max(1.0, self.settle_deadline() - time.monotonic())))
            for ex in self.completer.waiting():  # not settled (the database away): held until their leases end
                self.left_held(ex)
        # a burst run ends without stop(): end the heartbeat and listener threads (and their connections)
        # too, or every embedded worker run would leave them behind. The listener ends within a second.
        self._halted.set()
        self._stopping.set()
        for t in self._threads:
            if t.name in ("heartbeat", "watchdog", "housekeeping"):
                t.join(5)
                if t.name == "heartbeat" and t.is_alive():
                    # stuck in a statement on its connection: the final beat takes one of its own rather
                    # than wait for that statement to end (nothing bounds it)
                    self._hb_conn = None
                hk = self._hk_conn
                if t.name == "housekeeping" and t.is_alive() and hk is not None:
                    # in a long round: cancelled (a cancel is safe from another thread), it ends and
                    # closes its connection itself; what it did is rolled back and done next time
                    with contextlib.suppress(Exception):
                        hk.cancel_safe(timeout=2)
        try:
            self._flush_and_beat(final=True)
        except Exception as e:
            self.log.warning("the final heartbeat failed: %s", db.redact(str(e).strip(), self.dsn))
        self._record_stop()
        if self._claim_conn is not None:
            self._claim_conn.close()
        if self._hb_conn is not None:
            self._hb_conn.close()
        self.log.info("worker stopped: %s jobs claimed, %s still in flight", self.claimed_total, len(self._in_flight))
        self.left_behind = len(self._say_left_held())

    # ------------------------------------------------------------------ claiming

    def _claim_params(self, limit: int) -> dict[str, Any]:
        return {"now": self.clock.now(), "limit": limit, **self._claim_filters()}

    def _claim_filters(self) -> dict[str, Any]:
        """What a claim's parameters hold besides ``now`` and ``limit``: who claims, and what it may claim."""
        queues = list(self.config.queues or [])
        return {
            "worker": self.id,
            "all_queues": not queues,
            "queues": queues,
            "job_types": self.registry.job_types(),
            "paused": self._paused,
            "limited_types": [t for t, scope, _ in self._limits if scope == "*"],
            "limited_pairs": [f"{t} {scope}" for t, scope, _ in self._limits if scope != "*"],
            "limits": json.dumps([{"job_type": t, "scope": s, "max_running": n} for t, s, n in self._limits]),
        }

    def _conn_for_claims(self) -> db.Conn:
        if self._claim_conn is None or self._claim_conn.closed or self._claim_conn.broken:
            conn = db.connect(
                self.dsn,
                application_name=self.config.application_name,
                autocommit=True,
                statement_timeout_ms=db.OWN_STATEMENT_TIMEOUT_MS,
            )
            # its statements are prepared (no parse per call) but planned with each call's parameters (the
            # solo and limited lanes: a generic plan cannot see that no queue is paused), except the main
            # claim, prepared with its filters written in (_claim_ready)
            conn.execute(queries["claim_session"], prepare=False)
            conn.prepare_threshold = 0
            set_json_loads(_loads_utf8, conn)
            self._claim_conn = conn
            self._claim_prepared = None
        return self._claim_conn

    def _claim_ready(self, conn: db.Conn, limit: int, retry: bool = True) -> list[dict[str, Any]]:
        """The main claim (queries.sql ``claim``), the one a busy worker runs over and over.

        It is prepared on the claim connection with this worker's filters written in as literals (its job
        types, queues, the paused queues and the limited types, which change only on a refresh), so that
        ``now`` and ``limit`` are its only parameters; it then runs with the generic plan, planned once per
        set of filters instead of once per claim (planning was a third of a claim's time), and that plan
        still sees the filters: it walks the ready index in order.

        An idle worker's claim (the pickup of new work, where latency counts) does not wait for the WAL
        flush to commit (the other third of its time). That costs no guarantee: the claim only takes a
        lease, and everything that depends on it commits synchronously later (the effect and the
        settlement of the job, in one transaction), which flushes the WAL up to and past the claim's commit
        record. A claim lost to a server crash in the ~200 ms before the WAL writer flushed it leaves the
        job queued at its previous attempt, where an unflushed lease would have expired: it runs again
        either way, as a job whose worker died does. Through a backlog (the last claim came back full)
        claims wait for the flush: rows written by a commit not yet flushed cannot be given hint bits, so
        every later reader pays a commit-log lookup per row, and in A/B drains asynchronous claims cost a
        fifth of the no-op throughput.
        """
        filters = self._claim_filters()
        if self._claim_prepared is None or self._claim_prepared[0] != filters:
            params = {name: sql.Literal(value).as_string(conn) for name, value in filters.items()}
            params.update(now="$1", limit="$2")
            text = PLACEHOLDER_RE.sub(lambda m: params[m.group(1)], queries["claim"])
            if self._claim_prepared is not None:
                with contextlib.suppress(psycopg.errors.InvalidSqlStatementName):  # gone already: see below
                    conn.execute("DEALLOCATE worker_core_claim", prepare=False)
            conn.execute(cast(LiteralString, "PREPARE worker_core_claim(timestamptz, int) AS " + text), prepare=False)
            self._claim_prepared = (filters, psycopg.pq.Escaping(conn.pgconn).escape_literal)
        now = self._claim_prepared[1](self.clock.now().isoformat().encode())
        try:
            run = CLAIM_RUN.replace(b"%(now)s", now).replace(b"%(limit)s", b"%d" % limit)
            cur = conn.execute(run.replace(b"%(sync)s", b"'on'" if self._backlog else b"'off'"), prepare=False)
        except psycopg.errors.InvalidSqlStatementName:
            # psycopg sends DEALLOCATE ALL after a ROLLBACK on the connection: prepare again (nothing was claimed)
            if not retry:
                raise
            self._claim_prepared = None
            return self._claim_ready(conn, limit, retry=False)
        cur.nextset()  # past the settings
        return cur.fetchall()

    def claim(self, limit: int) -> list[dict[str, Any]]:
        """Claim up to ``limit`` jobs; returns the rows now ``running`` and held by this worker.

        With nothing in flight and solo work waiting, it first claims one job whose lease expired (or a
        suspect), to run alone: see the ``claim_solo`` query."""
        began = self._claimed_at = self.clock.now()
        rows: list[dict[str, Any]] = []
        # each claim is one statement on an autocommit connection: atomic, and one round trip. Once one has
        # committed, its jobs are this worker's: a later one that fails must not lose them (nothing would
        # run or beat for them until their leases ran out). One whose answer was lost may have committed:
        # its jobs are looked for first, on the next connection (_claimed_unheard)
        try:
            conn = self._conn_for_claims()
            if self._filters_at is None:
                self._refresh_filters_for_claims(conn)
            if self._unheard_since is not None:
                rows = self._claimed_unheard(conn)  # this round's jobs, if any: the next round claims more
            if not rows and not self._in_flight and self._want_solo:
                rows = self._claim_solo(conn)
                self._want_solo = bool(rows)
            if not rows or all(r["state"] != "running" for r in rows):
                # the limited types first, in their own lane bounded by their limits: given what room the
                # main claim left, they got none through any backlog of unlimited jobs, whatever their
                # priority (a job of a type limited to 5 at priority -100 ran after 3,000 at 100)
                rows += self._claim_limited(conn, limit)
                if limit - len(rows) > 0:
                    rows += self._claim_ready(conn, limit - len(rows))
        except Exception as e:  # not only a database error: rows already claimed must run all the same
            if self._unheard_since is None or began < self._unheard_since:
                self._unheard_since = began
            if not rows:
                raise
            why = db.redact(str(e).strip(), self.dsn) if isinstance(e, psycopg.Error) else repr(e)
            self.log.warning("claim failed (%s); running the %s jobs claimed before", why, len(rows))
            self._claim_conn = None
            self._close_quietly(conn)
        running = []
        for row in rows:
            if row["reclaimed"]:
                self.metrics.add(row["queue"], row["job_type"], "lease_expirations")
            if row["state"] == "running":
                running.append(row)
            elif row["state"] == "dead_lettered":
                self.metrics.add(row["queue"], row["job_type"], "dead_lettered")
                self.log.warning(
                    "poison pill: lease expired with no attempts left, dead-lettered without running",
                    extra=job_fields(row),
                )
            elif row["state"] == "cancelled":
                self.metrics.add(row["queue"], row["job_type"], "cancelled")
        running.sort(key=lambda r: (r["priority"], r["scheduled_at"], r["id"].int))  # ints: UUID.__lt__ is Python
        return running

    def _claimed_unheard(self, conn: db.Conn) -> list[dict[str, Any]]:
        """The jobs a claim whose answer was lost made this worker's (queries.sql ``claimed_unheard``): run
        now, at the attempt that claim counted, as if its answer had come. Left alone they ran out their
        visibility timeout (minutes, at 3 a.m.) and came back as lease expirations: suspects, run alone."""
        with self._slot_free:
            known = list(self._in_flight)
        known += [ex.job["id"] for ex in self.completer.waiting()]
        params = {"worker": self.id, "since": self._unheard_since, "now": self.clock.now(), "known": known}
        rows = conn.execute(queries["claimed_unheard"], params).fetchall()
        self._unheard_since = None
        if rows:
            self.log.warning("%s jobs claimed by a claim whose answer was lost: running them now", len(rows))
        return rows

    def _limit_scopes(self) -> list[tuple[str, list[str]]]:
        """Each limited type with its scopes, in the order every worker takes their locks: types by name,
        '*' first, then queues by name (so that two workers never wait on each other in a circle)."""
        by_type: dict[str, set[str]] = {}
        for job_type, scope, _ in self._limits:
            by_type.setdefault(job_type, set()).add(scope)
        return [
            (t, (["*"] if "*" in scopes else []) + sorted(x for x in scopes if x != "*"))
            for t, scopes in sorted(by_type.items())
        ]

    def _claim_solo(self, conn: db.Conn) -> list[dict[str, Any]]:
        """claim_solo, under the locks of every limit of this worker's types when there are any: its limit
        check (full_limits) counts live leases in its own snapshot, and idle workers run it together after a
        crash, each blind to the others' reclaims (three ran at once under a limit of 1)."""
        scopes = self._limit_scopes()
        if not scopes:
            return conn.execute(queries["claim_solo"], self._claim_params(1)).fetchall()
        with conn.transaction():
            for job_type, order in scopes:
                for scope in order:
                    conn.execute(queries["limit_lock"], {"job_type": job_type, "scope": scope})
            return conn.execute(queries["claim_solo"], self._claim_params(1)).fetchall()

    def _claim_limited(self, conn: db.Conn, free: int) -> list[dict[str, Any]]:
        """Claims for the job types with a global concurrency limit, one type at a time.

        A type's limits are taken together in one transaction: its '*' limit (all its queues together)
        and its queues' own limits both apply. Their advisory locks are taken '*' first and then queue by
        queue in name order by every worker, so two workers never wait on each other in a circle."""
        rows: list[dict[str, Any]] = []
        by_type: dict[str, dict[str, int]] = {}
        for job_type, scope, max_running in self._limits:
            by_type.setdefault(job_type, {})[scope] = max_running
        if not by_type:
            return rows
        types = sorted(by_type)
        start = self._limit_turn % len(types)
        self._limit_turn += 1
        for job_type in types[start:] + types[:start]:
            if free - len(rows) <= 0:
                break
            scopes = by_type[job_type]
            type_max = scopes.get("*")
            order = (["*"] if type_max is not None else []) + sorted(s for s in scopes if s != "*")
            # the scopes take turns to claim first (claim after claim): the type-wide room would otherwise
            # always go to the first of them with a backlog, and the others starve under the '*' cap
            turn = self._limit_turn % len(order)
            got: list[dict[str, Any]] = []  # committed with the type's transaction only
            try:
                with conn.transaction():
                    for scope in order:
                        conn.execute(queries["limit_lock"], {"job_type": job_type, "scope": scope})
                    # claim_limited reads concurrency_limits: behind another session's ACCESS EXCLUSIVE lock on
                    # it, every claim, the other types' too, waited out its statement timeout and failed
                    conn.execute(queries["lock_wait_bound"], {"wait": f"{round(FILTERS_LOCK_WAIT_SECONDS * 1000)}ms"})
                    for scope in order[turn:] + order[:turn]:
                        room = free - len(rows) - len(got)
                        if room <= 0:
                            break
                        params = {**self._claim_params(room), "job_type": job_type, "scope": scope}
                        params.update(max_running=scopes[scope], type_max=type_max if scope != "*" else None)
                        got += conn.execute(queries["claim_limited"], params).fetchall()
            except psycopg.errors.LockNotAvailable:
                self._say_limits_locked(conn)
                break  # the limited types wait for the lock; the other types are claimed meanwhile
            rows += got
        return rows

    _limits_locked_said_at = -math.inf

    def _say_limits_locked(self, conn: db.Conn) -> None:
        """The limited types' claims gave up on a lock: said once a minute while they do, with who holds it."""
        at = time.monotonic()
        if at < self._limits_locked_said_at + 60:
            return
        self._limits_locked_said_at = at
        try:
            holders = "; ".join(map(str, ops.lock_holders(conn, (), ("concurrency_limits", "job_queue"))))
        except psycopg.Error as e:
            holders = f"(could not tell: {db.redact(str(e).strip(), self.dsn)})"
        self.log.warning(
            "the claims of the limited types waited %g s for a lock held by %s: claiming the other types meanwhile",
            FILTERS_LOCK_WAIT_SECONDS, holders or "a session that has ended since",
        )  # fmt: skip

    def refresh_claim_filters(self) -> None:
        """Re-read paused queues and concurrency limits now. Workers do it on every heartbeat and as soon as
        an operator action notifies ``worker_core_control``."""
        self._refresh_claim_filters(self._conn_for_claims())

    def _publish_contracts(self) -> None:
        """Record the effective contract of each type this worker runs, for the console and CLI."""
        rows = [
            {
                "job_type": c.job_type,
                "queue": c.queue,
                "contract": {k: {"value": v, "source": s} for k, (v, s) in c.fields.items()},
                "reason": c.reason,
                "requires_idempotency_key": c.requires_idempotency_key,
                "concurrency": c.concurrency,
            }
            for c in (t.contract() for t in self.registry)
        ]
        try:
            conn = self._heartbeat_conn()
            with conn.transaction():
                # once, at start: it waits for a lock as it did before the connection's lock_timeout (a beat's
                # bound), up to the statement timeout, rather than give up and leave the contracts unpublished
                conn.execute("SET LOCAL lock_timeout = 0")
                conn.execute(
                    queries["contract_upsert"], {"rows": json.dumps(rows), "worker": self.id, "now": self.clock.now()}
                )
                # and its policy file's defaults and queue layers, for producers without a policy file (0016)
                replaced = publish_policy(conn, self.id, self.clock.now())
        except psycopg.Error as e:
            self.log.warning("could not publish the job type contracts: %s", db.redact(str(e).strip(), self.dsn))
            return
        if replaced:
            self.log.warning(
                "this worker's policy (%s) replaces a different one (%s): producers without a policy file of"
                " their own take this one from now on",
                policy.current().source,
                replaced,
            )

    def _refresh_claim_filters(self, conn: db.Conn) -> None:
        """Paused queues and concurrency limits, as the claims' parameters."""
        before = {(t, scope): n for t, scope, n in self._limits}
        self._refresh_limits(conn)
        with conn.transaction():
            self._paused = [r["name"] for r in conn.execute(queries["paused_queues"])]
        self._filters_at = self._filters_read_at = time.monotonic()
        # a limit of 0 holds its type for as long as it stands; one set or lowered since the last reading
        # gives back once what this worker claimed under the room it had before
        holding = {(t, scope) for t, scope, n in self._limits if n == 0 or n < before.get((t, scope), n + 1)}
        if self._paused or holding:
            self._hold_paused(set(self._paused), holding)

    #: when (monotonic) the claim filters were last read (None: never yet), and when a claim last said that
    #: it went on with them, their read behind a lock
    _filters_read_at: float | None = None
    _filters_locked_said_at = -math.inf

    def _refresh_filters_for_claims(self, conn: db.Conn) -> None:
        """The claim filters read again before a claim (at the first, and after a pause, resume or limit was
        notified), waiting FILTERS_LOCK_WAIT_SECONDS at most for a lock on queues or concurrency_limits (the
        @task limits are written there too). Behind an operator's long transaction holding one, the read waited
        up to the statement timeout and failed the claim, again at every claim: the worker claimed nothing for
        as long as the lock was held. Now the filters last read stand, and the claim goes on (the next beat
        reads them again, under its own bound); said once a minute while it lasts, naming who holds the lock.
        A worker that has never read them (one starting behind the lock) cannot claim without them (the jobs of
        a paused queue, of a type held at 0): its claim fails, saying so, and is tried again."""
        try:
            with conn.transaction(), ops.lock_wait_bounded(
                conn, "the read of the claim filters (paused queues, concurrency limits)", ("concurrency_limits",),
                ("queues",), FILTERS_LOCK_WAIT_SECONDS,
            ):  # fmt: skip
                self._refresh_claim_filters(conn)
        except TableLocked as e:
            if self._filters_read_at is None:
                raise
            at = time.monotonic()
            self._filters_at = at  # not again before a beat, or the next notification
            if at >= self._filters_locked_said_at + 60:
                self._filters_locked_said_at = at
                self.log.warning("%s Claiming meanwhile with those read %.0f s ago", e, at - self._filters_read_at)

    def _hold_paused(self, paused: set[str], holding: set[tuple[str, str]] | None = None) -> None:
        """The jobs of a paused queue, or of a type a limit of 0 holds (the runbook's other "contain it"),
        this worker claimed but has not begun (its prefetch: up to hundreds of fast ones) are released,
        not started after the pause or the hold; those running go on. So are those of a type whose limit
        was just set or lowered (in ``holding`` with those a limit of 0 holds): claimed under the room the
        limit left before, they would all have started; given back, they are claimed again within it."""
        with self._exec_lock:
            held = False
            for ex in list(self._in_flight.values()):
                if ex.begun or ex.ctx.cancel_reason is not None:
                    continue
                queue, job_type = ex.job["queue"], ex.job["job_type"]
                if queue in paused:
                    ex.ctx.cancel("paused")
                elif holding and ((job_type, "*") in holding or (job_type, queue) in holding):
                    ex.ctx.cancel("held")
                else:
                    continue
                held = True
        if held:
            # from a thread of its own: this one beats for the running jobs, whose leases must not wait
            # for a release retried through a database outage
            threading.Thread(target=self._give_back_queued, name="give-back", daemon=True).start()

    #: why a job claimed and not begun is given back without running (Slot._after_failure releases it)
    GIVE_BACK_REASONS = ("paused", "held", "shutdown")

    def _give_back_queued(self) -> None:
        """The jobs a pause or a stop gives back that no slot has taken yet are released now, by this
        thread. Left in the queue until a slot came free, they stayed running and held by this worker,
        out of every other worker's reach, for as long as the longest job in hand ran (or the whole
        shutdown grace, then as lease expirations). Jobs a slot has taken are released by that slot."""
        kept: list[list[Execution] | None] = []
        out: list[Execution] = []
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue_mod.Empty:
                break
            if item is None:
                kept.append(None)
                continue
            stay: list[Execution] = []
            for ex in item:  # in the queue: no slot has it, so it has not begun
                (out if ex.ctx.cancel_reason in self.GIVE_BACK_REASONS else stay).append(ex)
            if stay:
                kept.append(stay)
        for again in kept:
            self._jobs.put(again)
        if not out:
            return
        slot = Slot(self, -1)
        try:
            for ex in out:
                try:
                    slot.give_back(ex)
                except Exception:
                    ex.ctx.logger.exception("could not give the job back: its lease brings it back")
        finally:
            slot.close()
            self._done_many(out)

    def _refresh_limits(self, conn: db.Conn) -> None:
        with conn.transaction():
            now = self.clock.now()
            for t in self.registry:
                if t.concurrency is not None:
                    conn.execute(
                        queries["limit_set_from_task"],
                        {"job_type": t.job_type, "max_running": t.concurrency, "reason": "@task(concurrency=...)",
                         "now": now},
                    )  # fmt: skip
            unlimited = [t.job_type for t in self.registry if t.concurrency is None]
            if unlimited:
                conn.execute(queries["limit_drop_from_task"], {"job_types": unlimited})
            found = conn.execute(queries["limits_for_types"], {"job_types": self.registry.job_types()}).fetchall()
        self._limits = [(r["job_type"], r["scope"], r["max_running"]) for r in found]

    def job_load(self, job: dict[str, Any]) -> float:
        """A job's share of a slot: 1 for a job that runs in a transaction of its own, 1/n for a job of a
        type whose groups hold n (its measured handler time, see _hand_out). A slot running a group of fast
        jobs is as busy as one running a slow job: counting jobs instead held one or two groups in flight
        for all the slots."""
        if job["lock_key"] or job["ran_solo"] or (self._ungrouped_until and self._is_ungrouped(job["job_type"])):
            return 1.0
        return self._type_load.get(job["job_type"], 1.0)  # a type not measured yet counts as slow

    def _room(self) -> int:
        """How many more jobs to claim: the free slot load (slots plus prefetch buffer) in jobs, as many
        per load as the last claim held, within ``max_in_flight``."""
        by_load = (self.capacity - self._load) * self._jobs_per_load
        return int(min(by_load + 1e-9, self.max_in_flight - len(self._in_flight)))

    def _keep_within(self, rows: list[dict[str, Any]], free: float) -> list[dict[str, Any]]:
        """The claimed jobs the slots and the prefetch can take (``free``, in slot loads); the rest go back
        at once, as they were, the attempt not counted (queries.sql ``release_surplus``). A claim is sized
        from the jobs of the one before (_room): after a run of fast jobs, one that brings slow ones would
        otherwise hold dozens that other workers could be running."""
        load = 0.0
        for i, row in enumerate(rows):
            load += self.job_load(row)
            if i and load > free + 1e-9:
                kept, surplus = rows[:i], rows[i:]
                break
        else:
            return rows
        try:
            conn = self._conn_for_claims()
            params = {"ids": array_literal([r["id"] for r in surplus]), "worker": self.id, "now": self.clock.now()}
            released = {r["id"] for r in conn.execute(queries["release_surplus"], params)}
        except psycopg.Error as e:
            self.log.warning("could not give back surplus claimed jobs (%s): running them", e)
            return rows
        # killed since the claim: kept, the heartbeat sees the kill and it is settled cancelled, never run
        return kept + [r for r in surplus if r["id"] not in released]

    def _completer_full(self) -> bool:
        """The completer cannot settle (its statement fails: the database away, or refusing it) and holds as
        many jobs as the worker may have in flight: while claims went through, the jobs it waited to settle (and the
        heartbeat extends) grew with every claim, without limit. Not while it settles: in a drain of no-op
        jobs it holds hundreds between two flushes, and a claimer parked on them idled the slots."""
        return self.completer.failing and self.completer.pending() >= self.max_in_flight

    def completer_recovered(self) -> None:
        """The completer settles again: a claimer parked on it (_completer_full) goes on at once."""
        with self._slot_free:
            self._slot_free.notify_all()

    def _may_claim(self) -> bool:
        """Not while a job runs alone, nor while draining for one, nor while a completer that cannot settle
        holds as many jobs as the worker may hold in flight; else when a slot is free."""
        if self._solo_in_flight:
            return False
        if self._completer_full():
            return False
        if self._want_solo and self._in_flight and time.monotonic() < self._solo_drain_until:
            return False
        room = self._room()
        if room <= 0:
            return False
        # claim in batches: at once when a slot may idle, else when half the buffer's load is free and a
        # quarter of max_in_flight (grouped jobs: not a claim per finished group)
        if len(self._in_flight) < self.config.concurrency:
            return True
        return (
            self.capacity - self._load >= max(1, self.prefetch / 2)
            and self.max_in_flight - len(self._in_flight) >= max(1, self.max_in_flight // 4)
        )

    def _claim_loop(self) -> None:
        backoff = 0.0
        while not self.stopping:
            with self._slot_free:
                while not self._may_claim() and not self.stopping:
                    self._slot_free.wait(0.5)
            if self.stopping:
                break
            limit = min(self._room(), self.batch_size)
            free = self.capacity - self._load
            self._wake.clear()
            claimed_at = time.monotonic()
            try:
                rows = self.claim(limit)
                backoff = 0.0
                self._failing_since = None
                self._claim_failures.succeeded()
            except Exception as e:  # the worker lives on: a database error, or rows it could not read
                backoff = min(max(backoff * 2, 0.2), 10.0)
                said = isinstance(e, (psycopg.Error, TableLocked))
                why = db.redact(str(e).strip(), self.dsn) if said else repr(e)
                self._close_quietly(self._claim_conn)  # closed, not only forgotten: a new one next claim
                self._claim_conn = None
                waited = self._wait_for_migrations(why) if _schema_missing(e) else None
                if waited is True:
                    break
                if waited is False:  # migrated again: claim at once
                    backoff = 0.0
                    continue
                # None: the start check finds nothing wrong (a table dropped by hand, a bug): said and retried
                # with the backoff, as any other claim failure, never claimed again at once in a loop
                if self._give_up(claimed_at, "claim", why, e):
                    break
                # said once, then once a minute while it lasts, and when claims go through again
                self._claim_failures.failed(e, why, f"retrying with a backoff ({backoff:.1f} s, up to 10 s)")
                self._stopping.wait(backoff * random.uniform(0.8, 1.2))
                continue
            claimed = len(rows)
            if rows:
                self.claims += 1
                executions = [self._dispatch(row) for row in self._keep_within(rows, free)]
                self._jobs_per_load = len(executions) / sum(ex.load for ex in executions)
                self._hand_out(executions)
            # a full batch: there is a backlog, and claims wait for the WAL flush (see _claim_ready)
            self._backlog = claimed == limit
            # a full batch, or an idle worker that wants its solo claim: again at once (a busy one past its
            # drain claims at the poll's pace: claiming again at once, it span thousands of claims a second)
            if claimed == limit or (self._want_solo and not self._in_flight):
                continue
            if self.config.burst and not self._in_flight and time.monotonic() >= self._burst_hold_until:
                checked_at = time.monotonic()
                done = self._burst_done()
                if done:
                    self.log.info("burst: nothing ready or running, exiting")
                    break
                if done is None and self._give_up(checked_at, "read of what is left", self._burst_error):
                    break
            wait = self._idle_wait(claimed_at)
            self._idle_until = time.monotonic() + wait
            self._wake.wait(wait)
            self._idle_until = 0.0

    #: what the claims found missing, while the worker waits for the migrations (None: it does not)
    not_migrated: str | None = None

    def _wait_for_migrations(self, why: str) -> bool | None:
        """A claim named a table or column the database does not have (``why``): it was recreated or restored
        without its migrations, or the worker could not check it at its start (unreachable then). Claiming
        again and again failed the same way, a warning every 10 s for ever, and the heartbeat's every beat.

        The start check (check_worker_database: on the embedded server, the migrations are applied) says what
        is wrong, once, with the fix. A burst worker then stops: run() returns EXIT_UNAVAILABLE (the CLI's code
        for a database not migrated). Another claims nothing, and runs the check again after 1 s, then twice
        as long each time, up to MIGRATION_RECHECK_MAX_SECONDS, saying what it finds only when that changes;
        once it passes, it says so and claims again. Returns whether the worker stops; None, at once, when the
        check finds nothing wrong (what is missing is not what the migrations make: the claim's failure is said
        and retried as any other's)."""
        what = (why.splitlines() or [""])[0]  # not the LINE 3: ... and caret lines of the statement's context
        said = self._database_problem(
            f"the database is not migrated for this worker ({what}): run `qconsole migrate` (as the schema's"
            " owner), or check that the DSN names the queue's database"
        )
        if said is None:  # migrated meanwhile (a restore that just ended), or nothing the check knows of
            return None
        self.not_migrated = said
        if self.config.burst:
            self.gave_up = f"a claim failed ({what}): {said}"
            self.log.error("burst: giving up, %s", self.gave_up)
            self._stopping.set()
            return True
        self.log.error("a claim failed (%s): %s; claiming nothing until it is (checked again every %g s at most)",
                       what, said, MIGRATION_RECHECK_MAX_SECONDS)  # fmt: skip
        since = time.monotonic()
        wait = 1.0
        while not self._stopping.wait(wait * random.uniform(0.8, 1.2)):
            wait = min(wait * 2, MIGRATION_RECHECK_MAX_SECONDS)
            found = self._database_problem(said)
            if found is None:
                self.not_migrated = None
                self.log.info("the database is migrated (after %.0f s): claiming again", time.monotonic() - since)
                return False
            self.log.debug("checked the database again: %s", found)
            if found != said:
                said = self.not_migrated = found
                self.log.error("still claiming nothing: %s", said)
        return False

    def _database_problem(self, unknown: str) -> str | None:
        """What the start check finds wrong with the database now (NotMigrated, WorkerRefused), None if
        nothing; ``unknown`` when it cannot tell (the database cannot be reached)."""
        embedded = db.configured_dsn(self.config.dsn) is None
        try:
            check_worker_database(self.dsn, embedded=embedded, application_name=self.config.application_name)
        except (NotMigrated, WorkerRefused) as e:
            return str(e)
        except psycopg.Error as e:
            self.log.debug("could not check the database: %s", db.redact(str(e).strip(), self.dsn))
            return unknown
        return None

    def _idle_wait(self, claimed_at: float) -> float:
        """A poll interval, or less when a job this worker put back comes due sooner (the claim that began
        at ``claimed_at`` found those due before it)."""
        wait = self.config.poll_interval * random.uniform(0.9, 1.1)
        with self._due_lock:
            while self._due and self._due[0] <= claimed_at:
                heapq.heappop(self._due)
            if self._due:
                wait = min(wait, max(0.0, self._due[0] - time.monotonic()) + 0.005)
        return wait

    def comes_due(self, delay: float) -> None:
        """A job this worker put back comes due in ``delay`` seconds (a retry, a lock's contention): the
        claim loop wakes for it then, not up to a poll interval later (a job serialised behind a lock key
        lost up to a second at each turn). Any worker may claim it; this one at least looks."""
        due = time.monotonic() + max(0.0, delay)
        with self._due_lock:
            if len(self._due) < 10_000:
                heapq.heappush(self._due, due)
        if due < self._idle_until:
            self._wake.set()

    def _burst_done(self) -> bool | None:
        """Nothing ready or running for this worker. A database error is not an answer: None (not done), and
        the error in ``_burst_error``."""
        try:
            conn = self._conn_for_claims()
            with conn.transaction():
                row = conn.execute(queries["burst_remaining"], self._claim_params(0)).fetchone()
        except psycopg.Error as e:
            self._burst_error = db.redact(str(e).strip(), self.dsn)
            self.log.warning("could not tell whether the burst is done: %s", self._burst_error)
            self._claim_conn = None
            return None
        self._failing_since = None  # an answer: the database reads this worker's tables again
        return row is not None and row["n"] == 0

    _burst_error = ""

    def _give_up(self, began: float, what: str, why: str, error: BaseException | None = None) -> bool:
        """After a failed claim (or burst_remaining read) that began at ``began`` (monotonic): whether a burst
        worker gives up now, its claims having failed for ``burst_give_up`` seconds. It then says so, with
        the last error and the sessions whose locks on job_queue hold claims back, and stops: run() returns
        EXIT_UNAVAILABLE. A worker that is not a burst one never gives up."""
        if self._failing_since is None:
            self._failing_since = began
        failing = time.monotonic() - self._failing_since
        if not self.config.burst or failing < self.config.burst_give_up:
            return False
        holders = self._claim_blockers() if error is None or _lock_wait_error(error) else ""
        why = (why.splitlines() or [""])[0]  # not the LINE 37: ... and caret lines of the statement's context
        self.gave_up = f"no {what} has gone through for {failing:.0f} s (the last failed: {why}){holders}"
        running = len(self._in_flight)
        grace = f"; the {running} jobs in flight get the shutdown grace" if running else ""
        self.log.error("burst: giving up, %s%s", self.gave_up, grace)
        self._stopping.set()
        return True

    def _claim_blockers(self) -> str:
        """The sessions holding a lock on job_queue that claims wait behind, as a burst giving up says them
        (nothing when there is none, or the database does not answer: its error was said)."""
        try:
            with db.connect(
                self.dsn, application_name=self.config.application_name, statement_timeout_ms=5000, autocommit=True
            ) as conn:
                rows = conn.execute(queries["claim_blockers"]).fetchall()
        except psycopg.Error:
            return ""
        if not rows:
            return ""
        said = "; ".join(
            f"pid {r['pid']} ({r['state'] or 'unknown'}"
            + (f", its transaction open {r['seconds']:.0f} s" if r["seconds"] is not None else "")
            + f", {r['mode']}): {r['query'] or ''}"
            for r in rows
        )
        return f"; job_queue is locked by {said}"

    def _dispatch(self, row: dict[str, Any]) -> Execution:
        ctx = JobContext(
            job_id=row["id"],
            job_type=row["job_type"],
            queue=row["queue"],
            attempt=row["attempts"],
            max_attempts=row["max_attempts"],
            idempotency_key=row["idempotency_key"],
            trace_id=row["trace_id"],
            tenant_id=row["tenant_id"],
            worker_id=self.id,
            _make_logger=lambda: self.log.bind(**job_fields(row)),
            dsn=self.dsn,
        )
        ex = Execution(job=row, ctx=ctx, load=self.job_load(row))
        # its lease as the claim wrote it, about (the claim's now is read a moment after this)
        visibility = row.get("visibility_timeout_seconds")
        ex.lease_until = None if visibility is None else self._claimed_at + dt.timedelta(seconds=visibility)
        with self._slot_free:
            # claimed again before its last run left the set (given back, then claimed by this worker at
            # once): the old entry is done now, and its own _done must not remove this one (_done_many)
            old = self._in_flight.get(row["id"])
            if old is not None:
                self._load -= old.load
                self._solo_in_flight -= 1 if old.job["ran_solo"] else 0
            self._in_flight[row["id"]] = ex
            self._load += ex.load
            if row["ran_solo"]:
                self._solo_in_flight += 1
        self.claimed_total += 1
        return ex

    def _hand_out(self, executions: list[Execution]) -> None:
        """Queue the claimed jobs for the slots, in groups (see the module docstring)."""
        group: list[Execution] = []
        budget = 0.0
        limit = self.config.group_seconds
        for ex in executions:
            if not self.groupable(ex):
                if group:
                    self._jobs.put(group)
                    group, budget = [], 0.0
                self._jobs.put([ex])  # alone, in a transaction of its own
                continue
            # a type not measured yet counts as slow: one job per group
            cost = self._handler_seconds.get(ex.job["job_type"], limit)
            if group and (budget + cost > limit or len(group) >= self.config.group_max):
                self._jobs.put(group)
                group, budget = [], 0.0
            group.append(ex)
            budget += cost
        if group:
            self._jobs.put(group)

    def observe_handler(self, job_type: str, seconds: float) -> None:
        old = self._handler_seconds.get(job_type)
        seconds = self._handler_seconds[job_type] = seconds if old is None else 0.8 * old + 0.2 * seconds
        task = self.registry.get(job_type)
        if self.config.group_max > 1 and task is not None and not task.is_async:
            # as many as _hand_out puts in a group
            fit = int(self.config.group_seconds / seconds) if seconds > 0 else self.config.group_max
            self._type_load[job_type] = 1.0 / max(1, min(self.config.group_max, fit))

    def _done(self, ex: Execution) -> None:
        self._done_many((ex,))

    def _done_many(self, executions: Iterable[Execution]) -> None:
        with self._slot_free:
            for ex in executions:
                if self._in_flight.get(ex.job["id"]) is ex:  # not a later run of the same job (_dispatch)
                    del self._in_flight[ex.job["id"]]
                    self._load -= ex.load
                    if ex.job["ran_solo"]:
                        self._solo_in_flight -= 1
            if not self._in_flight:
                self._load = 0.0  # no drift from the float sums
            # wake the claimer only when it may claim: not once per job
            if self._may_claim() or not self._in_flight or self.stopping:
                self._slot_free.notify_all()
        if not self._in_flight:
            self._wake.set()  # a burst run may be done, or a solo claim may go ahead

    # ------------------------------------------------------------------ listener and heartbeat

    def _listen_main(self) -> None:
        backoff = 0.5
        while not self.stopping:
            try:
                with db.connect(self.dsn, application_name=self.config.application_name, autocommit=True) as conn:
                    conn.execute("LISTEN worker_core_jobs")
                    conn.execute("LISTEN worker_core_control")
                    backoff = 0.5
                    while not self.stopping:
                        for note in conn.notifies(timeout=1.0, stop_after=1):
                            if note.channel == "worker_core_control":
                                self._filters_at = None  # a pause, resume or limit changed: re-read
                            self._wake.set()
            except psycopg.Error:
                self._stopping.wait(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, 10.0)

    def _heartbeat_main(self) -> None:
        last = time.monotonic()
        while True:
            # looked at again each tick: a job claimed meanwhile with a short lease brings the beat forward
            due = last + self.beat_period()
            if self._halted.wait(min(HEARTBEAT_TICK_SECONDS, max(0.0, due - time.monotonic()))):
                return
            if time.monotonic() < due:
                continue
            began = time.monotonic()
            held_up = self._heartbeat_once()
            # a beat that gave up on a lock counts that wait towards its interval: under a long table lock its
            # jobs' lease update is queued for the lock again at once (granted with the claims' when it is
            # released), and the worker's row is still beaten about once an interval
            last = began if held_up else time.monotonic()

    def beat_period(self) -> float:
        """The time between two beats: the heartbeat interval, or a third of the shortest lease in flight
        (BEATS_PER_LEASE) when that is shorter, MIN_BEAT_SECONDS at least. The leases of the jobs waiting for
        the completer count too: the beat extends theirs as well."""
        interval = self.config.heartbeat_interval
        leases = [ex.job["visibility_timeout_seconds"] for ex in list(self._in_flight.values())]
        leases += [ex.job["visibility_timeout_seconds"] for ex in self.completer.waiting()]
        shortest = min((float(v) for v in leases if v), default=None)
        if shortest is None or shortest >= interval * BEATS_PER_LEASE:
            return interval
        return max(shortest / BEATS_PER_LEASE, MIN_BEAT_SECONDS)

    def _heartbeat_once(self) -> bool:
        """One beat; True if a statement of it gave up waiting for a lock (see _flush_and_beat)."""
        try:
            held_up = self._flush_and_beat()
        except psycopg.Error as e:
            if self.not_migrated is None:  # said once, by the claim loop, which waits for the migrations
                self._beat_failures.failed(e, db.redact(str(e).strip(), self.dsn))
            self._drop_hb_conn()
        except Exception:
            self.log.exception("heartbeat error")
        else:
            self._beat_failures.succeeded()
            return held_up
        return False

    _hb_conn: db.Conn | None = None

    def _drop_hb_conn(self) -> None:
        """The heartbeat's connection after a failure: closed, not only forgotten (a session of a worker whose
        beats failed on a schema that was not there stayed open, idle, after its stop), a new one next beat."""
        if self._hb_conn is not None:
            self._close_quietly(self._hb_conn)
        self._hb_conn = None

    def _extend_lock(self, conn: db.Conn, ex: Execution) -> bool:
        """A running job's lock_key lease, extended with its job lease. Lost (it ran out and another job
        holds it now): the job is cancelled, and commits nothing of what it did without the lock
        (Slot._after_failure gives it back). The backend failing (Redis gone): tried again next beat, the
        other jobs' beats and the worker's go on meanwhile. False: the backend did not answer."""
        assert ex.lock is not None
        try:
            held = self.locks.extend(conn, ex.lock[0], ex.lock[1], lease_seconds(ex.job["visibility_timeout_seconds"]))
        except Exception as e:
            ex.ctx.logger.warning("could not extend the lease of lock %s: %s", ex.lock[0], db.redact(str(e), self.dsn))
            return False
        if not held:
            ex.ctx.cancel("lock_lost")
        return True

    @property
    def beat_lock_wait_seconds(self) -> float:
        """How long a statement of a beat waits for a lock (BEAT_LOCK_WAIT_MIN_SECONDS)."""
        interval = self.config.heartbeat_interval
        return min(max(interval, BEAT_LOCK_WAIT_MIN_SECONDS), BEAT_LOCK_WAIT_MAX_SECONDS)

    def _heartbeat_conn(self) -> db.Conn:
        if self._hb_conn is None or self._hb_conn.closed or self._hb_conn.broken:
            name, timeout = self.config.application_name, db.OWN_STATEMENT_TIMEOUT_MS
            self._hb_conn = db.connect(
                self.dsn,
                application_name=name,
                statement_timeout_ms=timeout,
                lock_timeout_ms=int(self.beat_lock_wait_seconds * 1000),
            )
        return self._hb_conn

    @contextlib.contextmanager
    def _unless_locked(self, what: str, held_up: list[str]) -> Iterator[None]:
        """A part of a beat that gives up on a lock (LockNotAvailable, after the connection's lock_timeout):
        noted in ``held_up``, and the beat's other parts go on, on the same connection (the transaction was
        rolled back). Any other error ends the beat, as before."""
        try:
            yield
        except psycopg.errors.LockNotAvailable:
            held_up.append(what)

    def _flush_and_beat(self, final: bool = False) -> bool:
        """A beat: the leases of the jobs in flight and waiting for the completer, then the worker's own row
        (not on the final beat: _record_stop writes the stop after it), their lock_key leases, the metrics,
        the claim filters, the look for solo work. Each part waits for a lock at most beat_lock_wait_seconds
        and gives up for this beat (_unless_locked), the others go on: behind a lock on job_queue the worker's
        row is beaten all the same (it read as lost after 30 s, while alive), and behind one on workers the
        leases are extended all the same. Returns whether a part gave up on a lock.

        Under a lock on job_queue (one that blocks the leases' UPDATE blocks every claim's too: the same lock
        mode) no lease is extended, and no other worker can take a job meanwhile; a lease that ran out while
        the table was locked is an expired lease when it is released, as after any other outage."""
        conn = self._heartbeat_conn()
        now = self.clock.now()
        held_up: list[str] = []
        in_flight = list(self._in_flight.values())
        # and the jobs whose handler is done, waiting for the completer to settle them: their leases ran out
        # while it could not (a row locked by an operator's open transaction, the database away), and they
        # were run again. Its fenced settlement finds what became of them: nothing to cancel here
        settling = self.completer.waiting()
        locked = [ex for ex in in_flight if ex.lock is not None]
        leases_held_up = False
        if in_flight or settling:
            ids = [ex.job["id"] for ex in in_flight] + [ex.job["id"] for ex in settling]
            rows: list[dict[str, Any]] | None = None
            with self._unless_locked("the jobs' leases (job_queue)", held_up), conn.transaction():
                rows = conn.execute(
                    queries["heartbeat_jobs"], {"now": now, "worker": self.id, "ids": array_literal(ids)}
                ).fetchall()
            # not read (the table locked): neither lost nor killed, as far as this beat can tell; their lock_key
            # leases are extended, those of the jobs waiting for the completer only once their rows are read
            leases_held_up = rows is None
            held = {r["id"]: r for r in rows or ()}
            for ex in [*in_flight, *settling]:
                r = held.get(ex.job["id"])
                if r is not None and r["extended"] and r["attempts"] == ex.job["attempts"]:
                    ex.lease_until = now + dt.timedelta(seconds=ex.job["visibility_timeout_seconds"])
            for ex in in_flight if rows is not None else ():
                r = held.get(ex.job["id"])
                if r is None or r["attempts"] != ex.job["attempts"]:
                    ex.ctx.cancel("lease_lost")
                elif r["cancel_requested"]:
                    ex.ctx.cancel("killed")
            # a job waiting for the completer holds its lock_key lease until it is settled (the completer
            # releases it), as long as the job is still this worker's (its row held by another transaction
            # included: no claim can take it meanwhile)
            running = {ex.job["id"] for ex in in_flight}
            for ex in settling:
                r = held.get(ex.job["id"])
                if ex.lock is not None and ex.job["id"] not in running and r and r["attempts"] == ex.job["attempts"]:
                    locked.append(ex)
        # the worker's own row, in a transaction of its own, whatever became of its jobs' leases
        if not final:
            with self._unless_locked("the worker's row (workers)", held_up), conn.transaction():
                sent_at = self._host_now()
                beat = conn.execute(
                    queries["worker_upsert"],
                    {
                        "now": now,
                        "id": self.id,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "queues": list(self.config.queues) if self.config.queues else None,
                        "tasks": self.registry.job_types(),
                        "concurrency": self.config.concurrency,
                        "in_flight": len(in_flight),
                        "heartbeat_interval": self.config.heartbeat_interval,
                    },
                ).fetchone()
                if beat is not None:
                    self._check_clock(sent_at, self._host_now(), beat["db_now"])
        # after the jobs' leases and the worker's row: a lock backend that hangs (Redis stopped answering:
        # each call waits for its socket timeout) delayed both, one call per job, until live workers' leases
        # ran out; and after one failure, no more calls this beat
        for ex in locked:
            if not (ex.ctx.cancelled and not ex.settling) and not self._extend_lock(conn, ex):
                break
        with self._unless_locked("the metrics (job_metrics_minute)", held_up):
            self.metrics.flush(conn)
        if not final:
            with self._unless_locked("the claim filters (queues, concurrency_limits)", held_up):
                self._refresh_claim_filters(conn)
        # not while job_queue is locked: its claims wait for it too, and this read would wait once more
        if not final and not leases_held_up:
            with self._unless_locked("the look for solo work (job_queue)", held_up):
                self._look_for_solo_work(conn)
        self._say_held_up(held_up)
        return bool(held_up)

    def _say_held_up(self, held_up: list[str]) -> None:
        """Beats that give up on a lock, said once a minute while they do, and when they no longer do."""
        at = time.monotonic()
        if not held_up:
            if self._held_up_since is not None:
                self.log.info("heartbeat: no longer held up by a lock (after %.0f s)", at - self._held_up_since)
                self._held_up_since = None
            return
        if self._held_up_since is None:
            self._held_up_since = at
        if at >= self._held_up_said_at + 60:
            self._held_up_said_at = at
            self.log.warning(
                "heartbeat: %s waited %.1f s for a lock another session holds (LOCK TABLE, VACUUM FULL, ALTER"
                " TABLE, a migration?): tried again next beat, the rest of the beat went on",
                ", ".join(held_up), self.beat_lock_wait_seconds,
            )  # fmt: skip

    def _record_stop(self) -> None:
        """The worker's stop, in its row (stopped_at): the console and ``qconsole workers`` then say
        "stopped", not "lost" (a day long, until its row is pruned). A try that fails (the workers table
        locked: the connection's lock_timeout; the connection lost, in a failover) is made again, on a new
        connection if need be, for STOP_RECORD_SECONDS at most: the process exits after it, and a supervisor
        gives its stop 10 s beyond the grace periods. A server that cannot be reached is not tried again."""
        deadline = time.monotonic() + STOP_RECORD_SECONDS
        while True:
            try:
                conn = self._heartbeat_conn()
            except psycopg.Error as e:
                self.log.warning("could not record the worker's stop: %s", db.redact(str(e).strip(), self.dsn))
                return
            try:
                with conn.transaction():
                    conn.execute(queries["worker_stopped"], {"now": self.clock.now(), "id": self.id})
                return
            except psycopg.Error as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.log.warning("could not record the worker's stop: %s", db.redact(str(e).strip(), self.dsn))
                    return
                if not isinstance(e, psycopg.errors.LockNotAvailable):
                    self._close_quietly(conn)
                    self._hb_conn = None
                time.sleep(min(0.5, left))

    def _host_now(self) -> dt.datetime:
        return self.clock.host_now() if isinstance(self.clock, ServerAlignedClock) else self.clock.now()

    def _check_clock(self, sent_at: dt.datetime, answered_at: dt.datetime, db_now: dt.datetime) -> None:
        """Leases are written and compared in the time of the worker that runs the statement (``locked_until``):
        a worker whose clock is ahead took live jobs from others as expired leases (the handler then ran twice
        at once), one whose clock is behind wrote leases others already found expired. Each beat measures
        this host's clock against the server's, against the middle of the statement's round trip, and not
        when that took more than a second (a beat that waited on a row lock read as skew). A difference of a
        second or more puts the worker's clock onto the server's (ServerAlignedClock.align); one past
        CLOCK_SKEW_WARN_SECONDS is also said, every ten minutes while it lasts, since what else runs on the
        host (producers' schedules, other programs) keeps the wrong time (``clock_skew_seconds``: the last
        measure, the host's clock against the server's)."""
        if not isinstance(self.clock, ServerAlignedClock):
            return  # a clock a test moves by hand
        trip = answered_at - sent_at
        if trip > dt.timedelta(seconds=1):
            return
        # the host's own readings (sent_at, answered_at): an aligned clock's would measure itself
        skew = (sent_at + trip / 2 - db_now).total_seconds()
        self.clock_skew_seconds = skew
        self.clock.align(skew, trip.total_seconds())
        if abs(skew) > CLOCK_SKEW_WARN_SECONDS and time.monotonic() >= self._skew_said_until:
            self._skew_said_until = time.monotonic() + 600
            aligned = self.clock.offset != 0.0
            self.log.warning(
                "this host's clock is %.1f s %s the database server's: %s; set the clocks right (NTP)",
                abs(skew), "ahead of" if skew > 0 else "behind",
                "this worker keeps its leases in the server's time, but what else runs here (handlers' own"
                " timestamps, other programs) does not" if aligned else
                "leases are written and compared in each worker's time, so a live job may look expired to one"
                " worker and be run by two at once",
            )  # fmt: skip

    def _look_for_solo_work(self, conn: db.Conn) -> None:
        """On each beat: whether solo work waits (a lease expired, a suspect: solo_work_waiting looks at the
        whole fleet's jobs). Found, the worker drains for it, for SOLO_DRAIN_SECONDS at most while it stays
        waiting; gone (another worker took it), the worker claims again at once. The mark stayed until this
        worker's own longest job ended: one dead worker stopped every busy worker of the fleet from taking
        new work for as long as its longest job ran, long after another had healed the orphan."""
        with conn.transaction():
            row = conn.execute(queries["solo_work_waiting"], self._claim_params(1)).fetchone()
        waiting = bool(row and row["waiting"])
        with self._slot_free:
            if waiting and not self._want_solo:
                self._want_solo = True
                if not self._solo_seen:
                    self._solo_drain_until = time.monotonic() + SOLO_DRAIN_SECONDS
                self._wake.set()
            elif not waiting and self._want_solo and self._in_flight:
                self._want_solo = False
                self._slot_free.notify_all()
            self._solo_seen = waiting

    def _first_housekeeping(self) -> None:
        """The round at start, before the first claim (a fresh table's statistics: see
        maintenance.analyze_if_stale), on the heartbeat's connection: nothing is in flight yet for the beats
        to wait on, and where connections are scarce it takes none the completer or the listener, which
        connect next, would then have to wait for."""
        try:
            # briefly: the first claim waits for it (a backlog past retention is pruned by the next rounds)
            self.housekeeping(self._heartbeat_conn(), round_seconds=FIRST_HOUSEKEEPING_SECONDS)
        except psycopg.Error as e:
            self.log.warning("housekeeping failed: %s", db.redact(str(e).strip(), self.dsn))
            self._drop_hb_conn()
        except Exception:
            self.log.exception("housekeeping error")

    def _housekeeping_main(self) -> None:
        """The rounds after the first, one every ``housekeeping_interval``, whichever worker wins the lock.
        A connection for the round only, closed after it."""
        wait = self.config.housekeeping_interval * random.uniform(0.9, 1.1)
        while not self._halted.wait(wait):
            wait = self.config.housekeeping_interval * random.uniform(0.9, 1.1)
            if self._housekeeping_behind:  # the last round left more past retention: the next goes on soon
                wait = min(wait, HOUSEKEEPING_CATCH_UP_SECONDS)
            try:
                name, timeout = self.config.application_name, HOUSEKEEPING_TIMEOUT_MS
                with db.connect(self.dsn, application_name=name, statement_timeout_ms=timeout) as conn:
                    self._hk_conn = conn
                    maintenance.bound_idle(conn)
                    self.housekeeping(conn)
            except psycopg.Error as e:
                if self.not_migrated is None:  # said once, as the heartbeat's
                    self.log.warning("housekeeping failed: %s", db.redact(str(e).strip(), self.dsn))
            except Exception:
                self.log.exception("housekeeping error")
            finally:
                self._hk_conn = None

    #: the housekeeping round's connection, while it runs (cancelled at shutdown if the round is long)
    _hk_conn: db.Conn | None = None

    @staticmethod
    def _close_quietly(conn: db.Conn | None) -> None:
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    #: the last round this worker ran stopped with more past retention (HousekeepingReport.more)
    _housekeeping_behind = False

    def housekeeping(self, conn: db.Conn, round_seconds: float | None = None) -> bool:
        """Retention and rollups (worker_core.maintenance), if this worker wins the lock for them."""
        retention = self.config.retention
        if round_seconds is not None:
            retention = dataclasses.replace(retention, round_seconds=min(round_seconds, retention.round_seconds))
        report = maintenance.housekeeping(conn, self.clock, retention)
        self._housekeeping_behind = bool(report and report.more)
        if report and report.pruned_jobs:
            more = " (more left: the next round runs soon)" if report.more else ""
            self.log.info("housekeeping: pruned %s finished jobs%s", report.pruned_jobs, more)
        return report is not None

    # ------------------------------------------------------------------ executing

    def _slot_main(self, index: int, orphan: Execution | None = None) -> None:
        slot = Slot(self, index)
        if orphan is not None:  # the job of the slot thread this one replaces
            slot.finish_abandoned(orphan)
        while True:
            group = self._jobs.get()
            if group is None:
                break
            try:
                if len(group) == 1 and not self.groupable(group[0]):
                    slot.run_one(group[0])
                else:
                    slot.run_group(group)
            except Abandoned:
                # the watchdog gave up on this thread; its replacement settled the job. A connection this
                # thread opened after the watchdog took the slot's away is closed here, by its owner: left
                # open in a transaction, its locks would hold up the job's next attempt (the same
                # idempotency key, say) for ever
                slot.close()
                return
        slot.close()

    #: how long a type runs one job per transaction after its group's commit was refused (Worker.ungroup)
    UNGROUP_SECONDS = 600.0

    def ungroup(self, job_types: Iterable[str], why: str) -> None:
        """These types' jobs run one per transaction in this worker for a while (Slot.run_group), where the
        job that broke the group's commit fails by itself."""
        until = time.monotonic() + self.UNGROUP_SECONDS
        new = sorted(t for t in job_types if t not in self._ungrouped)
        for t in job_types:
            self._ungrouped_until[t] = until
        if new:
            self.log.warning("a group's commit failed (%s): %s run one job per transaction for %.0f s", why,
                             ", ".join(new), self.UNGROUP_SECONDS)  # fmt: skip

    def given_back_for_errors(self, job_id: Any) -> int:
        """Count one more time this job was given back uncharged for a database error around it (Slot);
        return how many times that was, in this worker."""
        with self._slot_free:
            if len(self._given_back) > 10_000:
                self._given_back.clear()  # bounded: a long outage gives back many jobs once each
            n = self._given_back[job_id] = self._given_back.get(job_id, 0) + 1
        return n

    def _is_ungrouped(self, job_type: str) -> bool:
        return self._ungrouped_until.get(job_type, 0.0) > time.monotonic()

    @property
    def _ungrouped(self) -> set[str]:
        now = time.monotonic()
        return {t for t, until in self._ungrouped_until.items() if until > now}

    def groupable(self, ex: Execution) -> bool:
        job = ex.job
        task = self.registry.get(job["job_type"])
        return (
            self.config.group_max > 1
            and task is not None
            and not (self._ungrouped_until and self._is_ungrouped(job["job_type"]))
            and not isinstance(job.get("payload"), UndecodablePayload)
            and not task.is_async
            and not job["lock_key"]
            and not job["ran_solo"]
        )

    def _watchdog_main(self) -> None:
        """Timeouts and stuck handlers: see the module docstring."""
        while not self._halted.wait(WATCHDOG_TICK):
            try:
                self._watchdog_tick()
            except Exception:  # without it no timeout is enforced: it goes on, next tick tries again
                self.log.exception("watchdog error")

    def _watchdog_tick(self) -> None:
        now = time.monotonic()
        for ex in list(self._in_flight.values()):
            deadline = ex.deadline
            if deadline is None:
                if ex.ctx.cancel_reason is not None:
                    self._cancel_key_wait(ex)
                continue
            if now >= deadline:
                ex.ctx.cancel("timeout")
            if ex.ctx.cancel_reason is not None:
                if ex.cancel_seen is None:
                    ex.cancel_seen = now
                elif now - ex.cancel_seen >= self.config.cancel_grace + ex.grace_margin:
                    self._abandon(ex)

    def _cancel_key_wait(self, ex: Execution) -> None:
        """A job killed, or its worker stopping, while it waits for its idempotency key (Slot._waiting_for_key):
        the statement waiting is cancelled, from here (a cancel is safe from another thread)."""
        with self._exec_lock:
            conn, ex.key_wait = ex.key_wait, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.cancel()

    def _abandon(self, ex: Execution) -> None:
        """The handler ignores its cancellation: give up its slot thread (nothing it still sends reaches the
        server, so nothing it writes can ever commit), and start a slot thread that ends its transaction,
        settles the job and goes on. Its connections are not closed here: the stuck thread may be inside
        libpq on them (Slot.reset)."""
        with self._exec_lock:
            if ex.deadline is None or ex.abandoned or ex.slot is None:
                return  # it returned meanwhile
            ex.abandoned = True
        slot = ex.slot
        self.zombies += 1
        ex.ctx.logger.error("handler did not stop after %s; abandoned", ex.ctx.cancel_reason)
        slot.abandon()
        self._spawn(self._slot_main, f"slot-{slot.index}", slot.index, ex)


def check_worker_database(dsn: str, *, embedded: bool = False, application_name: str = "qconsole-worker") -> None:
    """What a worker checks before it starts (``Worker.run()``, a supervisor before its processes; ``qconsole
    worker`` checks the same, through the same ops.check_schema and ops.worker_refusal, and says it its own
    way): the database is migrated, by this version (NotMigrated otherwise, saying what to run; on the
    ``embedded`` server the migrations pending are applied here, as the CLI does), and a worker may run there:
    neither a read-only server or session (a replica) nor a role that may not write (or read) job_queue and
    workers (WorkerRefused, saying why). psycopg.OperationalError when the database cannot be reached, or does
    not answer within a worker's statement timeout."""
    with db.connect(
        dsn, application_name=application_name, autocommit=True, statement_timeout_ms=db.OWN_STATEMENT_TIMEOUT_MS
    ) as conn:
        try:
            check_schema(conn, migrate_dsn=dsn if embedded else None)
            refusal = worker_refusal(conn)
        except psycopg.errors.InsufficientPrivilege as e:
            raise WorkerRefused(
                f"this role cannot read the queue's tables ({db.redact(str(e).strip(), dsn)}): grant it SELECT,"
                " INSERT, UPDATE, DELETE on them, or run the worker as a role that has them"
            ) from e
    if refusal:
        raise WorkerRefused(f"the worker cannot run here: {refusal}")


def run_worker(config: WorkerConfig, registry: Registry | None = None) -> int:
    """Entry point for one worker process (used by the CLI and the supervisor's children)."""
    return Worker(config, registry).run()
