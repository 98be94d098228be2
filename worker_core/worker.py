"""The worker: claim -> execute -> settle, with heartbeats, and nothing a handler does takes it down.

Threads of one worker process:
- the claimer (the caller's thread): claims as many jobs as there are free slots, woken by LISTEN/NOTIFY
  (the listener thread) with polling as the fallback;
- ``concurrency`` slot threads, each with its own connection: a job's transaction lives on it, and its
  handler runs on it;
- the watchdog thread: cancels a handler at its timeout and, if it ignores that for ``cancel_grace``
  seconds, abandons its slot thread (taking its connection away) and starts another in its place;
- the heartbeat thread: extends the leases of in-flight jobs (and their lock_key leases), sees kills and
  lost leases, upserts the ``workers`` row, flushes metrics and does housekeeping when it wins the lock;
- the completer thread: settles in batches the successes that have nothing to commit with them.

Per job (DESIGN.md, "The worker"): lock_key lease, then in one transaction the idempotency record, the
handler's writes through ``ctx.tx`` and the fenced ``succeeded`` transition. Any failure rolls that
transaction back and settles the job in a new one: retry with backoff, failed, dead_lettered or cancelled.

Groups: the claimer hands the claimed sync jobs to the slots in groups sized from each type's measured
handler time (as many as fit in ``group_seconds``, at most ``group_max``; a type not yet measured, or a
slow one, goes one job per group so that slow jobs keep their parallelism). A slot runs a group's jobs one
after another in one transaction, each inside its own savepoint, and commits them with one fenced
settlement: a failing job rolls back to its savepoint only, and is settled on its own after the
commit. The exactly-once contract is unchanged (the idempotency record, the effect and the settlement of a
job still commit together or not at all); only the commits are shared. Jobs with a ``lock_key``, solo
jobs and async handlers run one per transaction.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import json
import logging
import os
import queue as queue_mod
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from worker_core import db, maintenance
from worker_core.clock import SYSTEM_CLOCK, Clock
from worker_core.context import JobContext
from worker_core.errors import JobTimeout, LeaseLost, PermanentError, classify
from worker_core.fingerprint import fingerprint
from worker_core.locks import LockBackend, lease_seconds, lock_backend, new_token
from worker_core.logs import bound_logger, job_fields
from worker_core.metrics import MetricsBuffer
from worker_core.registry import Registry, Task, import_task_modules
from worker_core.registry import registry as global_registry
from worker_core.retry import RetryPolicy
from worker_core.sql import queries

MAX_ERROR_MESSAGE = 2000
#: how often the watchdog looks at running handlers (timeouts are enforced to within this)
WATCHDOG_TICK = 0.05
#: an async handler cancels itself at its timeout; the watchdog only steps in when its event loop is stuck
ASYNC_GRACE_MARGIN = 1.0


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
    #: a slot stops adding jobs to its group after this long, and commits
    group_seconds: float = 0.02
    #: jobs claimed ahead of the free slots, so a slot never waits for a claim's round trip (None: twice
    #: ``concurrency``; 0: claim only for idle slots). Their leases are extended by heartbeats like the rest.
    prefetch: int | None = None
    poll_interval: float = 1.0
    heartbeat_interval: float = 2.0
    shutdown_grace: float = 10.0
    #: how long a cancelled (killed, timed out) sync handler gets to return before it is abandoned
    cancel_grace: float = 2.0
    burst: bool = False
    lock_backend: str | None = None
    lock_contention_delay: float = 1.0
    idempotency_retention_seconds: float = 7 * 86400
    housekeeping_interval: float = 60.0
    worker_id: str | None = None
    application_name: str = "qconsole-worker"
    #: serve this worker's Prometheus counters and histograms on this port
    metrics_port: int | None = None
    retention: maintenance.Retention = field(default_factory=maintenance.Retention)


@dataclass(eq=False)
class Execution:
    job: dict[str, Any]
    ctx: JobContext
    lock: tuple[str, str] | None = None
    #: a slot began it (it is no longer waiting in the prefetch buffer)
    begun: bool = False
    #: while its handler runs: the slot running it and the (monotonic) deadline the watchdog enforces
    slot: Slot | None = None
    deadline: float | None = None
    #: when the watchdog first saw the handler cancelled (it is abandoned ``cancel_grace`` later)
    cancel_seen: float | None = None
    grace_margin: float = 0.0
    #: the handler never returned: its slot thread was given up and another settles the job
    abandoned: bool = False
    #: monotonic time its slot began it
    started: float = 0.0
    #: outcome counters, added with its duration when it is done
    outcome: dict[str, float] = field(default_factory=dict)
    #: monotonic time its handler returned
    ended: float = 0.0
    #: the group it runs in, if any
    group: Group | None = None
    #: its idempotency key was already processed: settled without running the handler
    hit: bool = False


@dataclass(eq=False)
class Group:
    """The jobs a slot runs in one transaction. Kept where the watchdog's replacement slot finds them if
    the group's thread gets stuck: it gives back the uncommitted ones and settles the failed ones."""

    #: handler returned, effect (or idempotency hit) waiting for the group's commit
    effects: list[Execution] = field(default_factory=list)
    #: failed, rolled back to its savepoint: settled on its own after the commit
    failed: list[tuple[Execution, BaseException]] = field(default_factory=list)
    #: not begun yet
    waiting: list[Execution] = field(default_factory=list)
    #: settled by the completer, to leave the in-flight set with the group (one lock for all of them)
    done: list[Execution] = field(default_factory=list)
    #: the group's metrics, added to the worker's in one call per type when it ends
    counts: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)

    def count(self, job: dict[str, Any], values: dict[str, float]) -> None:
        row = self.counts.setdefault((job["queue"], job["job_type"]), {})
        for name, value in values.items():
            row[name] = row.get(name, 0) + value

    def flush_counts(self, metrics: MetricsBuffer) -> None:
        counts, self.counts = self.counts, {}
        for (queue, job_type), values in counts.items():
            metrics.add_many(queue, job_type, values)


class HandlerFailure(Exception):
    """Wraps whatever a handler raised (BaseException included) so it never unwinds the worker."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(repr(exc))
        self.exc = exc


class Abandoned(Exception):
    """Raised on a slot thread whose handler returned after the watchdog gave up on it: the thread ends,
    touching nothing (its replacement settled the job)."""


class Cancelled(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(f"job {reason}")
        self.reason = reason


def array_literal(values: Any) -> str:
    """``{a,b,c}`` for a list of uuids or ints, cast in SQL (``%(ids)s::uuid[]``): for the batches of the hot
    path, psycopg's per-element list adaptation costs more than the statement."""
    return "{" + ",".join(map(str, values)) + "}"


def settle_many_params(worker: Worker, batch: list[Execution]) -> dict[str, Any]:
    return {
        "ids": array_literal([ex.job["id"] for ex in batch]),
        "attempts": array_literal([ex.job["attempts"] for ex in batch]),
        "worker": worker.id,
        "now": worker.clock.now(),
    }


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def _is_db_error(exc: BaseException) -> bool:
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


class Worker:
    def __init__(self, config: WorkerConfig, registry: Registry | None = None, clock: Clock = SYSTEM_CLOCK):
        self.config = config
        if config.task_modules:
            import_task_modules(config.task_modules)
        self.registry = registry or global_registry
        if not self.registry.job_types():
            raise ValueError("no task is registered: give --tasks MODULE with @worker_core.task handlers")
        self.clock = clock
        self.id = config.worker_id or default_worker_id()
        self.dsn = db.resolve_dsn(config.dsn)
        self.log = bound_logger("worker_core.worker", worker_id=self.id)
        self.locks: LockBackend = lock_backend(config.lock_backend, clock)
        self.metrics = MetricsBuffer(clock)
        self.completer = Completer(self)
        self.prefetch = 2 * config.concurrency if config.prefetch is None else max(0, config.prefetch)
        self.capacity = config.concurrency + self.prefetch
        self.batch_size = config.batch_size or self.capacity
        self._stopping = threading.Event()
        #: set once the worker has fully stopped (after the grace period): ends the heartbeat thread, which
        #: keeps extending leases and seeing kills of the jobs that finish during a graceful shutdown
        self._halted = threading.Event()
        self._wake = threading.Event()
        self._slot_free = threading.Condition()
        self._in_flight: dict[uuid.UUID, Execution] = {}
        #: in-flight jobs that run alone (a lease expired or a suspect): nothing else is claimed meanwhile
        self._solo_in_flight = 0
        #: guards the hand-over between a returning handler and the watchdog abandoning it
        self._exec_lock = threading.Lock()
        #: what the claimer hands the slots: a group of jobs (often of one), or None to stop a slot
        self._jobs: queue_mod.SimpleQueue[list[Execution] | None] = queue_mod.SimpleQueue()
        #: moving average of each job type's handler time (seconds): how many of its jobs make a group
        self._handler_seconds: dict[str, float] = {}
        self._threads: list[threading.Thread] = []
        self._claim_conn: db.Conn | None = None
        self._last_housekeeping = 0.0
        #: lease-expired jobs or suspects are waiting: drain, then claim one to run alone
        self._want_solo = True
        #: (job_type, queue scope, max running) of the limited types this worker handles; refreshed on heartbeats
        self._limits: list[tuple[str, str, int]] = []
        self._paused: list[str] = []
        self._filters_at: float | None = None
        self._limit_turn = 0
        #: a burst run does not end before this (monotonic) time: a job it gave back on lock contention is
        #: queued a little in the future, which ``burst_remaining`` does not count as work still to do
        self._burst_hold_until = 0.0
        self.zombies = 0
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

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            if self._stopping.is_set():
                self.config.shutdown_grace = 0  # second signal: release now
            self.log.info("signal %s: stopping (grace %ss)", signum, self.config.shutdown_grace)
            self.stop()

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, handler)

    def run(self) -> int:
        """Run until stopped (or, with ``burst``, until nothing is ready or running). Returns an exit code."""
        self._install_signals()
        if self.config.metrics_port:
            from worker_core.prometheus import WorkerExporter

            WorkerExporter(self.metrics).serve(self.config.metrics_port)
        self.log.info(
            "worker starting: queues=%s types=%s concurrency=%s",
            ",".join(self.config.queues) if self.config.queues else "*",
            ",".join(self.registry.job_types()),
            self.config.concurrency,
        )
        for i in range(self.config.concurrency):
            self._spawn(self._slot_main, f"slot-{i}", i)
        self._publish_contracts()
        self._heartbeat_once()  # before the heartbeat thread: they share its connection
        self._spawn(self._heartbeat_main, "heartbeat")
        self._spawn(self._watchdog_main, "watchdog")
        self._spawn(self.completer.run, "completer")
        self._spawn(self._listen_main, "listener")
        try:
            self._claim_loop()
        finally:
            self._shutdown()
        return 0

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=f"{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def _shutdown(self) -> None:
        # jobs still waiting in the prefetch buffer are not started during a shutdown: released at once
        for ex in list(self._in_flight.values()):
            if not ex.begun:
                ex.ctx.cancel("shutdown")
        deadline = time.monotonic() + self.config.shutdown_grace
        with self._slot_free:
            while self._in_flight and time.monotonic() < deadline:
                self._slot_free.wait(0.1)
        for ex in list(self._in_flight.values()):
            ex.ctx.cancel("shutdown")
        deadline = time.monotonic() + self.config.cancel_grace + 3
        with self._slot_free:
            while self._in_flight and time.monotonic() < deadline:
                self._slot_free.wait(0.1)
        for _ in range(self.config.concurrency):
            self._jobs.put(None)
        self.completer.stop()
        # a burst run ends without stop(): end the heartbeat and listener threads (and their connections)
        # too, or every embedded worker run would leave them behind. The listener ends within a second.
        self._halted.set()
        self._stopping.set()
        for t in self._threads:
            if t.name in ("heartbeat", "watchdog"):
                t.join(5)
        try:
            self._flush_and_beat(final=True)
        except Exception as e:
            self.log.warning("could not record the worker's stop: %s", db.redact(str(e), self.dsn))
        if self._claim_conn is not None:
            self._claim_conn.close()
        if self._hb_conn is not None:
            self._hb_conn.close()
        self.log.info("worker stopped: %s jobs claimed, %s still in flight", self.claimed_total, len(self._in_flight))

    # ------------------------------------------------------------------ claiming

    def _claim_params(self, limit: int) -> dict[str, Any]:
        queues = list(self.config.queues or [])
        return {
            "now": self.clock.now(),
            "worker": self.id,
            "limit": limit,
            "all_queues": not queues,
            "queues": queues,
            "job_types": self.registry.job_types(),
            "paused": self._paused,
            "limited_types": [t for t, scope, _ in self._limits if scope == "*"],
            "limited_pairs": [f"{t} {scope}" for t, scope, _ in self._limits if scope != "*"],
        }

    def _conn_for_claims(self) -> db.Conn:
        if self._claim_conn is None or self._claim_conn.closed or self._claim_conn.broken:
            conn = db.connect(self.dsn, application_name=self.config.application_name, autocommit=True)
            # prepared (no parse per claim), but planned with each claim's parameters: a generic plan
            # cannot see that no queue is paused
            conn.execute(queries["claim_session"], prepare=False)
            conn.prepare_threshold = 0
            self._claim_conn = conn
        return self._claim_conn

    def claim(self, limit: int) -> list[dict[str, Any]]:
        """Claim up to ``limit`` jobs; returns the rows now ``running`` and held by this worker.

        With nothing in flight and solo work waiting, it first claims one job whose lease expired (or a
        suspect), to run alone: see the ``claim_solo`` query."""
        conn = self._conn_for_claims()
        if self._filters_at is None:
            self._refresh_claim_filters(conn)
        rows: list[dict[str, Any]] = []
        # each claim is one statement on an autocommit connection: atomic, and one round trip
        if not self._in_flight and self._want_solo:
            rows = conn.execute(queries["claim_solo"], self._claim_params(1)).fetchall()
            self._want_solo = bool(rows)
        if not rows or all(r["state"] != "running" for r in rows):
            rows += conn.execute(queries["claim"], self._claim_params(limit)).fetchall()
            rows += self._claim_limited(conn, limit - len(rows))
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
        running.sort(key=lambda r: (r["priority"], r["scheduled_at"], r["id"]))
        return running

    def _claim_limited(self, conn: db.Conn, free: int) -> list[dict[str, Any]]:
        """Claims for the job types with a global concurrency limit, one (type, scope) at a time."""
        rows: list[dict[str, Any]] = []
        limits = self._limits
        if not limits:
            return rows
        start = self._limit_turn % len(limits)
        self._limit_turn += 1
        for job_type, scope, max_running in limits[start:] + limits[:start]:
            if free - len(rows) <= 0:
                break
            params = {**self._claim_params(free - len(rows)), "job_type": job_type, "scope": scope}
            with conn.transaction():
                conn.execute(queries["limit_lock"], params)
                rows += conn.execute(queries["claim_limited"], {**params, "max_running": max_running}).fetchall()
        return rows

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
                conn.execute(
                    queries["contract_upsert"], {"rows": json.dumps(rows), "worker": self.id, "now": self.clock.now()}
                )
        except psycopg.Error as e:
            self.log.warning("could not publish the job type contracts: %s", db.redact(str(e).strip(), self.dsn))

    def _refresh_claim_filters(self, conn: db.Conn) -> None:
        """Paused queues and concurrency limits, as the claims' parameters."""
        self._refresh_limits(conn)
        with conn.transaction():
            self._paused = [r["name"] for r in conn.execute(queries["paused_queues"])]
        self._filters_at = time.monotonic()

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
            found = conn.execute(queries["limits_for_types"], {"job_types": self.registry.job_types()}).fetchall()
        self._limits = [(r["job_type"], r["scope"], r["max_running"]) for r in found]

    def _free_slots(self) -> int:
        """Room for more claimed jobs: the slots plus the prefetch buffer, less what is in flight."""
        return self.capacity - len(self._in_flight)

    def _may_claim(self) -> bool:
        """Not while a job runs alone, nor while draining for one; else when a slot is free."""
        if self._solo_in_flight:
            return False
        if self._want_solo and self._in_flight:
            return False
        free = self._free_slots()
        # claim in batches: at once when a slot may idle, else when half the buffer is gone
        return free > 0 and (len(self._in_flight) < self.config.concurrency or free >= max(1, self.prefetch // 2))

    def _claim_loop(self) -> None:
        backoff = 0.0
        while not self.stopping:
            with self._slot_free:
                while not self._may_claim() and not self.stopping:
                    self._slot_free.wait(0.5)
            if self.stopping:
                break
            limit = min(self._free_slots(), self.batch_size)
            self._wake.clear()
            try:
                rows = self.claim(limit)
                backoff = 0.0
            except psycopg.Error as e:
                backoff = min(max(backoff * 2, 0.2), 10.0)
                self.log.warning("claim failed (%s); retrying in %.1fs", db.redact(str(e).strip(), self.dsn), backoff)
                self._claim_conn = None
                self._stopping.wait(backoff * random.uniform(0.8, 1.2))
                continue
            if rows:
                self.claims += 1
                self._hand_out([self._dispatch(row) for row in rows])
            if len(rows) == limit or self._want_solo:
                continue
            if (
                self.config.burst
                and not self._in_flight
                and time.monotonic() >= self._burst_hold_until
                and self._burst_done()
            ):
                self.log.info("burst: nothing ready or running, exiting")
                break
            self._wake.wait(self._idle_wait())

    def _idle_wait(self) -> float:
        return self.config.poll_interval * random.uniform(0.9, 1.1)

    def _burst_done(self) -> bool:
        conn = self._conn_for_claims()
        with conn.transaction():
            row = conn.execute(queries["burst_remaining"], self._claim_params(0)).fetchone()
        return row is not None and row["n"] == 0

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
        ex = Execution(job=row, ctx=ctx)
        with self._slot_free:
            self._in_flight[row["id"]] = ex
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
        self._handler_seconds[job_type] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _done(self, ex: Execution) -> None:
        self._done_many((ex,))

    def _done_many(self, executions: Iterable[Execution]) -> None:
        with self._slot_free:
            for ex in executions:
                if self._in_flight.pop(ex.job["id"], None) is not None and ex.job["ran_solo"]:
                    self._solo_in_flight -= 1
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
        while not self._halted.wait(self.config.heartbeat_interval):
            self._heartbeat_once()

    def _heartbeat_once(self) -> None:
        try:
            self._flush_and_beat()
        except psycopg.Error as e:
            self.log.warning("heartbeat failed: %s", db.redact(str(e).strip(), self.dsn))
            self._hb_conn = None
        except Exception:
            self.log.exception("heartbeat error")

    _hb_conn: db.Conn | None = None

    def _heartbeat_conn(self) -> db.Conn:
        if self._hb_conn is None or self._hb_conn.closed or self._hb_conn.broken:
            self._hb_conn = db.connect(self.dsn, application_name=self.config.application_name)
        return self._hb_conn

    def _flush_and_beat(self, final: bool = False) -> None:
        conn = self._heartbeat_conn()
        now = self.clock.now()
        in_flight = list(self._in_flight.values())
        if in_flight:
            with conn.transaction():
                rows = conn.execute(
                    queries["heartbeat_jobs"],
                    {"now": now, "worker": self.id, "ids": array_literal([ex.job["id"] for ex in in_flight])},
                ).fetchall()
            held = {r["id"]: r for r in rows}
            for ex in in_flight:
                r = held.get(ex.job["id"])
                if r is None or r["attempts"] != ex.job["attempts"]:
                    ex.ctx.cancel("lease_lost")
                elif r["cancel_requested"]:
                    ex.ctx.cancel("killed")
                elif ex.lock is not None:
                    self.locks.extend(conn, ex.lock[0], ex.lock[1], lease_seconds(ex.job["visibility_timeout_seconds"]))
        with conn.transaction():
            if final:
                conn.execute(queries["worker_stopped"], {"now": now, "id": self.id})
            else:
                conn.execute(
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
                    },
                )
        self.metrics.flush(conn)
        if not final:
            self._refresh_claim_filters(conn)
        if not final and not self._want_solo:
            with conn.transaction():
                row = conn.execute(queries["solo_work_waiting"], self._claim_params(1)).fetchone()
            if row and row["waiting"]:
                self._want_solo = True
                self._wake.set()
        if not final and time.monotonic() - self._last_housekeeping > self.config.housekeeping_interval:
            self._last_housekeeping = time.monotonic()
            self.housekeeping(conn)

    def housekeeping(self, conn: db.Conn) -> bool:
        """Retention and rollups (worker_core.maintenance), if this worker wins the lock for them."""
        report = maintenance.housekeeping(conn, self.clock, self.config.retention)
        if report and report.pruned_jobs:
            self.log.info("housekeeping: pruned %s finished jobs", report.pruned_jobs)
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
                return  # the watchdog gave up on this thread; its replacement settled the job
        slot.close()

    def groupable(self, ex: Execution) -> bool:
        job = ex.job
        task = self.registry.get(job["job_type"])
        return (
            self.config.group_max > 1
            and task is not None
            and not task.is_async
            and not job["lock_key"]
            and not job["ran_solo"]
        )

    def _watchdog_main(self) -> None:
        """Timeouts and stuck handlers: see the module docstring."""
        while not self._halted.wait(WATCHDOG_TICK):
            now = time.monotonic()
            for ex in list(self._in_flight.values()):
                deadline = ex.deadline
                if deadline is None:
                    continue
                if now >= deadline:
                    ex.ctx.cancel("timeout")
                if ex.ctx.cancel_reason is not None:
                    if ex.cancel_seen is None:
                        ex.cancel_seen = now
                    elif now - ex.cancel_seen >= self.config.cancel_grace + ex.grace_margin:
                        self._abandon(ex)

    def _abandon(self, ex: Execution) -> None:
        """The handler ignores its cancellation: give up its slot thread, take its connection away so that
        nothing it still writes can ever commit, and start a slot thread that settles the job and goes on."""
        with self._exec_lock:
            if ex.deadline is None or ex.abandoned or ex.slot is None:
                return  # it returned meanwhile
            ex.abandoned = True
        slot = ex.slot
        self.zombies += 1
        ex.ctx.logger.error("handler did not stop after %s; abandoned", ex.ctx.cancel_reason)
        slot.drop_connection()
        self._spawn(self._slot_main, f"slot-{slot.index}", slot.index, ex)


class Completer:
    """Settles, in batches, the successes that have no effect to commit with them (see _run_sync).

    A job waits here at most a few milliseconds; if the worker dies first, the job's lease expires and it
    runs again, which is harmless for a job that wrote nothing transactional and has no idempotency key."""

    FLUSH_SECONDS = 0.005
    MAX_BATCH = 500

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        #: appended by the slots without a lock (deque appends and pops are atomic)
        self._pending: collections.deque[Execution] = collections.deque()
        #: set by the first job of a batch; the completer then gathers for FLUSH_SECONDS
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._exited = threading.Event()
        self._conn: db.Conn | None = None
        self._give_up_at = 0.0
        self.flushed = 0

    def add(self, ex: Execution) -> None:
        first = not self._pending
        self._pending.append(ex)
        if first:
            self._kick.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Flush what is pending, then end (a job not settled by then runs again after its lease)."""
        self._give_up_at = time.monotonic() + timeout
        self._stop.set()
        self._kick.set()
        self._exited.wait(timeout)

    def pending(self) -> int:
        return len(self._pending)

    def _connect(self) -> db.Conn:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = db.connect(self.w.dsn, application_name=self.w.config.application_name)
        return self._conn

    def run(self) -> None:
        backoff = 0.05
        # at once, like the worker's other own connections: where connections are scarce, the slots are
        # what waits for one, not the settlement of every job
        with contextlib.suppress(psycopg.Error):
            self._connect()
        try:
            while True:
                self._kick.wait(1.0)
                self._kick.clear()
                stopping = self._stop.is_set()
                if not stopping:
                    time.sleep(self.FLUSH_SECONDS)  # let a batch gather
                while self._pending:
                    batch = [self._pending.popleft() for _ in range(min(self.MAX_BATCH, len(self._pending)))]
                    try:
                        self._flush(batch)
                        backoff = 0.05
                    except psycopg.Error as e:
                        self._conn = None
                        self._pending.extendleft(reversed(batch))
                        if stopping and time.monotonic() > self._give_up_at:
                            self.w.log.warning("completer: %s jobs not settled: they run again", len(self._pending))
                            return
                        self.w.log.warning("completer: %s; retrying", db.redact(str(e).strip(), self.w.dsn))
                        time.sleep(backoff)
                        backoff = min(backoff * 2, 5.0)
                if stopping:
                    return
        finally:
            if self._conn is not None:
                self._conn.close()
            self._exited.set()

    def _flush(self, batch: list[Execution]) -> None:
        conn = self._connect()
        with conn.transaction():
            rows = conn.execute(queries["settle_succeeded_many"], settle_many_params(self.w, batch)).fetchall()
        self.flushed += len(rows)
        if len(rows) < len(batch):
            settled = {r["id"] for r in rows}
            for ex in batch:
                if ex.job["id"] not in settled:
                    ex.ctx.logger.warning("job no longer held by this worker: not settled")


class Slot:
    """One unit of concurrency: a connection (and, lazily, an event loop and async connection)."""

    def __init__(self, worker: Worker, index: int) -> None:
        self.w = worker
        self.index = index
        self._conn: db.Conn | None = None
        #: set while giving a group back, once the database could not be reached (see _write)
        self._unreachable = False
        #: the connection worker_core_record_key is prepared on (see _open_with_key)
        self._prepared_on: db.Conn | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aconn: db.AsyncConn | None = None

    # connections -----------------------------------------------------------------

    @property
    def conn(self) -> db.Conn:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = db.connect(self.w.dsn, application_name=self.w.config.application_name)
        return self._conn

    def reset(self) -> None:
        """Drop the connections: a handler may still hold them (abandoned), or they broke."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.cancel_safe(timeout=1)
            conn.close()
        aconn, self._aconn = self._aconn, None
        if aconn is not None and self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(BaseException):
                self._loop.run_until_complete(asyncio.wait_for(aconn.close(), 2))
        self._loop = None

    def close(self) -> None:
        self.reset()

    def drop_connection(self) -> None:
        """From the watchdog, while this slot's thread is stuck in a handler: cancel what the connection
        runs and close it, so the handler can never commit through ``ctx.tx``."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.cancel_safe(timeout=1)
            conn.close()
        self._aconn = None  # the stuck thread's event loop owns it; it never commits a cancelled job
        self._loop = None

    def _rollback(self) -> None:
        if self._conn is not None and not self._conn.closed:
            try:
                self._conn.rollback()
            except psycopg.Error:
                self.reset()

    # the job -------------------------------------------------------------------

    def run_one(self, ex: Execution) -> None:
        """A job in a transaction of its own."""
        try:
            self.execute(ex)
        except Abandoned:
            raise
        except BaseException:
            # nothing a job does may take the slot down; the lease heals whatever was left
            self.w.log.exception("unexpected error around a job", extra=job_fields(ex.job))
            self.reset()
        self.w._done(ex)

    def execute(self, ex: Execution) -> None:
        w, job, ctx = self.w, ex.job, ex.ctx
        ex.begun = True
        if ctx.cancelled:
            # killed, lease lost or shutting down while it waited in the prefetch buffer: never started
            self._after_failure(ex, self._cancel_exc(ex))
            return
        task = w.registry.get(job["job_type"])
        now = w.clock.now()
        latency_ms = max(0.0, (now - job["scheduled_at"]).total_seconds() * 1000)
        w.metrics.add_many(job["queue"], job["job_type"], {"started": 1, "latency_ms_sum": latency_ms})
        if task is None:  # the claim filters on registered types; only a changed registry gets here
            self.settle_failure(ex, PermanentError(f"no handler for job type {job['job_type']!r}"))
            return
        if job["lock_key"]:
            token = new_token()
            ttl = lease_seconds(job["visibility_timeout_seconds"])
            try:
                got = w.locks.acquire(self.conn, job["lock_key"], token, ttl, job["id"])
            except Exception as e:
                ctx.logger.warning("lock backend failed: %s", e)
                got = False
            if not got:
                w.metrics.add(job["queue"], job["job_type"], "lock_contention")
                delay = w.config.lock_contention_delay * random.uniform(0.8, 1.5)
                ctx.logger.info("lock contention on %s: rescheduled in %.1fs", job["lock_key"], delay)
                w._burst_hold_until = max(w._burst_hold_until, time.monotonic() + delay)
                self.release(ex, delay)
                return
            ex.lock = (job["lock_key"], token)
        t0 = ex.started = time.monotonic()
        try:
            if task.is_async:
                self._run_async(ex, task)
            else:
                self._run_sync(ex, task)
        except Abandoned:
            raise
        except HandlerFailure as f:
            self._rollback()
            self._after_failure(ex, f.exc)
        except LeaseLost:
            self._rollback()
            ctx.logger.warning("lease lost to another worker: rolled back, not settled")
        except psycopg.Error as e:
            # our own statements failed (database outage): the effect did not commit; give the job back
            self.reset()
            ctx.logger.warning("database error around the job: %s", db.redact(str(e).strip(), w.dsn))
            self.release(ex, 0.0)
        finally:
            if not ex.abandoned:  # else the slot that replaces this one finishes the job
                self._finish(ex, t0)

    def _finish(self, ex: Execution, t0: float) -> None:
        job = ex.job
        seconds = (ex.ended or time.monotonic()) - t0
        self.w.observe_handler(job["job_type"], seconds)
        values = {"duration_ms_sum": seconds * 1000, **ex.outcome}
        if ex.group is not None:
            ex.group.count(job, values)
        else:
            self.w.metrics.add_many(job["queue"], job["job_type"], values)
        if ex.lock is not None:
            try:
                self.w.locks.release(self.conn, *ex.lock)
            except Exception as e:
                ex.ctx.logger.warning("could not release lock %s: %s (it expires by itself)", ex.lock[0], e)

    def finish_abandoned(self, ex: Execution) -> None:
        """Settle the job of an abandoned slot thread (timed out, killed, lease lost or shutting down), and
        the rest of its group: their transaction went with the thread's connection."""
        w = self.w
        try:
            self._after_failure(ex, self._cancel_exc(ex))
            self._finish(ex, ex.started)
        except Exception:
            w.log.exception("could not settle an abandoned job", extra=job_fields(ex.job))
            self.reset()
        finally:
            if ex.group is None:
                w._done(ex)
            else:
                self._leave(ex.group, [ex])
        if ex.group is not None:
            self._give_back_group(ex.group)

    def _give_back_group(self, group: Group) -> None:
        """The group's transaction is lost: its uncommitted successes run again (no attempt counted), its
        failures are settled. If the database cannot be reached, the rest get one try each."""
        self._unreachable = False
        finished = group.done + group.effects + [other for other, _ in group.failed]
        try:
            for other in group.effects:
                self.release(other, 0.0)
            for other, exc in group.failed:
                try:
                    self._after_failure(other, exc)
                finally:
                    self._finish(other, other.started)
        finally:
            self._unreachable = False
            group.done, group.effects, group.failed = [], [], []
            self._leave(group, finished)
        if group.waiting:  # not begun: they run in a new group
            waiting, group.waiting = group.waiting, []
            self.w._jobs.put(waiting)

    # groups -------------------------------------------------------------------------

    def _leave(self, group: Group, finished: list[Execution]) -> None:
        """Jobs of the group leave the in-flight set, their metrics counted first: once nothing is in
        flight a burst run ends, and its last metrics flush must include them."""
        group.flush_counts(self.w.metrics)
        self.w._done_many(finished)

    def run_group(self, jobs: list[Execution]) -> None:
        """Run the jobs one after another in one transaction (see the module docstring)."""
        w = self.w
        w.groups += 1
        group = Group(waiting=list(jobs))
        current: Execution | None = None
        try:
            n = 0
            while group.waiting:
                current = group.waiting.pop(0)
                n += 1
                current.group = group
                self._run_grouped(current, group, n)
                current = None
            self._commit_group(group)
        except Abandoned:
            raise
        except BaseException as e:
            # one of our own statements failed (the handlers' errors are their jobs' failures), or the
            # database went away: nothing of the group committed; the job in progress is given back too
            self.reset()
            if isinstance(e, psycopg.Error):
                w.log.warning("database error around a group of jobs: %s", db.redact(str(e).strip(), w.dsn))
            else:
                w.log.exception("unexpected error around a group of jobs")
            if current is not None and current not in group.effects and all(f[0] is not current for f in group.failed):
                group.effects.append(current)
            self._give_back_group(group)
        finally:
            group.flush_counts(w.metrics)

    def _raw(self, sql: bytes, expect: psycopg.pq.ExecStatus = psycopg.pq.ExecStatus.COMMAND_OK) -> int:
        """Statements (SAVEPOINT...) sent in one round trip straight through libpq: a group's savepoints cost
        no more than that round trip. Returns the number of rows of the last statement."""
        conn = self.conn
        res = conn.pgconn.exec_(sql)
        if res.status != expect:
            if res.status == psycopg.pq.ExecStatus.FATAL_ERROR:
                raise psycopg.errors.error_from_result(res, conn.info.encoding)
            raise psycopg.OperationalError(f"unexpected result {psycopg.pq.ExecStatus(res.status).name}")
        return res.ntuples

    def _open_with_key(self, savepoint: bytes, ex: Execution) -> bool:
        """The job's savepoint and its idempotency record in one round trip, the record through a statement
        prepared on this connection, its parameters quoted by libpq. True: recorded; False: the key was
        processed already."""
        conn = self.conn
        if self._prepared_on is not conn:
            self._raw(queries["prepare_record_processed_key"].encode())
            self._prepared_on = conn
        job, enc = ex.job, conn.info.encoding
        quote = psycopg.pq.Escaping(conn.pgconn).escape_literal
        args = b", ".join(
            (
                quote(job["idempotency_key"].encode(enc)),
                quote(str(job["id"]).encode()),
                quote(job["job_type"].encode(enc)),
                quote(self.w.clock.now().isoformat().encode()),
                repr(float(self.w.config.idempotency_retention_seconds)).encode(),
            )
        )
        begin = b"BEGIN; " if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE else b""
        sql = begin + b"SAVEPOINT " + savepoint + b"; EXECUTE worker_core_record_key(" + args + b")"
        return self._raw(sql, psycopg.pq.ExecStatus.TUPLES_OK) == 1

    def _run_grouped(self, ex: Execution, group: Group, n: int) -> None:
        w, job, ctx = self.w, ex.job, ex.ctx
        ex.begun = True
        ex.started = time.monotonic()
        if ctx.cancelled:  # killed, lease lost or shutting down while it waited in the prefetch buffer
            group.failed.append((ex, self._cancel_exc(ex)))
            return
        task = w.registry.get(job["job_type"])
        assert task is not None  # groupable
        latency_ms = max(0.0, (w.clock.now() - job["scheduled_at"]).total_seconds() * 1000)
        group.count(job, {"started": 1, "latency_ms_sum": latency_ms})
        savepoint = f"job{n}".encode()
        opened = False

        def open_savepoint() -> None:
            nonlocal opened
            if ex.abandoned:  # its connection was taken away: nothing it does may reach the database
                raise psycopg.OperationalError("the job was abandoned after its timeout")
            ctx.tx = self.conn
            if not opened:
                if self.conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                    self._raw(b"BEGIN; SAVEPOINT " + savepoint)
                else:
                    self._raw(b"SAVEPOINT " + savepoint)
                opened = True

        try:
            if job["idempotency_key"]:
                # blocks while another job holding the same key is in its transaction: one effect, ever
                recorded = self._open_with_key(savepoint, ex)
                opened = True
                if not recorded:
                    ex.hit = True
                    group.effects.append(ex)
                    return
            # the handler's first use of ctx.tx opens its savepoint (and the slot's connection, if need be)
            ctx._on_tx = open_savepoint
            self._call_sync(ex, task)
            status = self.conn.pgconn.transaction_status if opened else None
            if status == psycopg.pq.TransactionStatus.INERROR:
                raise HandlerFailure(
                    RuntimeError("the handler swallowed a database error: its transaction is aborted")
                )
            if status == psycopg.pq.TransactionStatus.IDLE:
                ctx.logger.warning(
                    "the handler ended ctx.tx's transaction itself: what it committed is not settled with it"
                )
        except HandlerFailure as f:
            ex.ended = time.monotonic()
            if opened:
                self._raw(b"ROLLBACK TO SAVEPOINT " + savepoint)
            group.failed.append((ex, f.exc))
            return
        ex.ended = time.monotonic()
        if opened:
            group.effects.append(ex)
            return
        # nothing to commit with it: the completer settles it with others in one statement
        w.completer.add(ex)
        self._succeeded(ex, idempotency_hit=False)
        self._finish(ex, ex.started)
        group.done.append(ex)

    def _commit_group(self, group: Group) -> None:
        """One fenced settlement and one commit for the group's effects; then its failures, one by one."""
        w = self.w
        done, group.done = group.done, []
        self._leave(group, done)  # the completer settles these
        effects = group.effects
        if not effects and not group.failed:
            return
        conn = self.conn
        if effects:
            rows = conn.execute(queries["settle_succeeded_many"], settle_many_params(w, effects)).fetchall()
            if len(rows) < len(effects):
                # a lease was lost (the worker could not heartbeat for a whole visibility timeout): the
                # group commits nothing; the jobs still held run again, the others belong to another worker
                conn.rollback()
                held = {r["id"] for r in rows}
                for ex in effects:
                    if ex.job["id"] not in held:
                        ex.ctx.logger.warning("lease lost to another worker: rolled back, not settled")
                        w._done(ex)
                group.effects = [ex for ex in effects if ex.job["id"] in held]
                self._give_back_group(group)
                return
            conn.commit()
        elif conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()  # only failures, rolled back to their savepoints
        group.effects = []
        for ex in effects:
            self._succeeded(ex, idempotency_hit=ex.hit)
            self._finish(ex, ex.started)
        self._leave(group, effects)
        failed, group.failed = group.failed, []
        for ex, exc in failed:
            try:
                self._after_failure(ex, exc)
            finally:
                self._finish(ex, ex.started)
                self._leave(group, [ex])

    def _fence(self, ex: Execution) -> dict[str, Any]:
        return {
            "id": ex.job["id"],
            "attempt": ex.job["attempts"],
            "worker": self.w.id,
            "now": self.w.clock.now(),
        }

    def _idempotency_params(self, ex: Execution) -> dict[str, Any]:
        return {
            "key": ex.job["idempotency_key"],
            "job_id": ex.job["id"],
            "job_type": ex.job["job_type"],
            "now": self.w.clock.now(),
            "retention_seconds": self.w.config.idempotency_retention_seconds,
        }

    def _succeeded(self, ex: Execution, idempotency_hit: bool) -> None:
        if idempotency_hit:
            ex.outcome = {"idempotency_hits": 1, "succeeded": 1}
            ex.ctx.logger.info("idempotency key already processed: settled without running the handler")
        else:
            ex.outcome = {"succeeded": 1}
            if self.w.log.isEnabledFor(logging.DEBUG):
                ex.ctx.logger.debug("succeeded")

    def _run_sync(self, ex: Execution, task: Task) -> None:
        conn = self.conn
        job = ex.job
        if job["idempotency_key"]:
            # blocks while another job holding the same key is in its transaction: one effect, ever
            if conn.execute(queries["record_processed_key"], self._idempotency_params(ex)).fetchone() is None:
                if conn.execute(queries["settle_succeeded"], self._fence(ex)).fetchone() is None:
                    raise LeaseLost()
                conn.commit()
                self._succeeded(ex, idempotency_hit=True)
                return
        ex.ctx.tx = conn
        self._call_sync(ex, task)
        if not ex.ctx.tx_used and not job["idempotency_key"]:
            # no effect to commit with it: the completer settles it with others in one statement
            self.w.completer.add(ex)
            self._succeeded(ex, idempotency_hit=False)
            return
        if conn.execute(queries["settle_succeeded"], self._fence(ex)).fetchone() is None:
            raise LeaseLost()
        conn.commit()
        self._succeeded(ex, idempotency_hit=False)

    def _begin_handler(self, ex: Execution, grace_margin: float = 0.0) -> None:
        """From here the watchdog enforces the job's timeout (see Worker._watchdog_main)."""
        ex.slot = self
        ex.cancel_seen = None
        ex.grace_margin = grace_margin
        ex.deadline = time.monotonic() + ex.job["timeout_seconds"]

    def _end_handler(self, ex: Execution) -> None:
        with self.w._exec_lock:
            ex.deadline = None
            if ex.abandoned:
                raise Abandoned()

    def _call_sync(self, ex: Execution, task: Task) -> None:
        """Run the handler on this thread; the watchdog cancels it at its timeout and abandons this thread
        if it ignores that (a handler that never returns costs a thread, never the worker)."""
        ctx = ex.ctx
        error: BaseException | None = None
        self._begin_handler(ex)
        try:
            task.fn(ctx, ex.job["payload"])
        except BaseException as e:  # SystemExit, KeyboardInterrupt, MemoryError... all belong to the job
            error = e
        self._end_handler(ex)
        if error is not None:
            raise HandlerFailure(error)
        if ctx.cancelled:
            raise HandlerFailure(self._cancel_exc(ex))

    def _cancel_exc(self, ex: Execution) -> BaseException:
        reason = ex.ctx.cancel_reason or "cancelled"
        if reason == "timeout":
            return JobTimeout(f"handler ran past its timeout of {ex.job['timeout_seconds']:g}s")
        return Cancelled(reason)

    # async handlers -------------------------------------------------------------------

    def _run_async(self, ex: Execution, task: Task) -> None:
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        loop = self._loop
        # the job cancels its own handler at the timeout; the watchdog only steps in if the loop is stuck
        self._begin_handler(ex, ASYNC_GRACE_MARGIN)
        try:
            loop.run_until_complete(self._async_job(ex, task))
        except (HandlerFailure, LeaseLost, psycopg.Error):
            raise
        except BaseException as e:  # a SystemExit escaping a task surfaces here
            self._loop = None
            self._aconn = None
            raise HandlerFailure(e) from None
        finally:
            self._end_handler(ex)

    async def _async_job(self, ex: Execution, task: Task) -> None:
        if self._aconn is None or self._aconn.closed or self._aconn.broken:
            self._aconn = await db.aconnect(self.w.dsn, application_name=self.w.config.application_name)
        aconn = self._aconn
        job, ctx = ex.job, ex.ctx
        try:
            if job["idempotency_key"]:
                cur = await aconn.execute(queries["record_processed_key"], self._idempotency_params(ex))
                if await cur.fetchone() is None:
                    cur = await aconn.execute(queries["settle_succeeded"], self._fence(ex))
                    if await cur.fetchone() is None:
                        raise LeaseLost()
                    await aconn.commit()
                    self._succeeded(ex, idempotency_hit=True)
                    return
            ctx.tx = aconn
            handler = asyncio.ensure_future(task.fn(ctx, job["payload"]))
            deadline = time.monotonic() + job["timeout_seconds"]
            while not handler.done():
                await asyncio.wait({handler}, timeout=min(0.05, max(0.0, deadline - time.monotonic())))
                if handler.done():
                    break
                if time.monotonic() >= deadline:
                    ctx.cancel("timeout")
                if ctx.cancelled:
                    handler.cancel()
                    await asyncio.wait({handler}, timeout=self.w.config.cancel_grace)
                    break
            if ctx.cancelled:
                raise HandlerFailure(self._cancel_exc(ex))
            if not handler.cancelled() and handler.exception() is not None:
                raise HandlerFailure(handler.exception())
            if not ctx.tx_used and not job["idempotency_key"]:
                # nothing to commit with it: the completer settles it with others, as for sync handlers
                self.w.completer.add(ex)
                self._succeeded(ex, idempotency_hit=False)
                return
            cur = await aconn.execute(queries["settle_succeeded"], self._fence(ex))
            if await cur.fetchone() is None:
                raise LeaseLost()
            await aconn.commit()
            self._succeeded(ex, idempotency_hit=False)
        except BaseException:
            if not aconn.closed:
                try:
                    await aconn.rollback()
                except psycopg.Error:
                    await aconn.close()
            raise

    # settling failures -------------------------------------------------------------------

    def _after_failure(self, ex: Execution, exc: BaseException) -> None:
        if isinstance(exc, Cancelled):
            if exc.reason == "lease_lost":
                ex.ctx.logger.warning("lease lost while running: rolled back, not settled")
                return
            if exc.reason == "shutdown":
                ex.ctx.logger.info("worker shutting down: job released")
                self.release(ex, 0.0)
                return
        self.settle_failure(ex, exc)

    def settle_failure(self, ex: Execution, exc: BaseException) -> str | None:
        w, job, ctx = self.w, ex.job, ex.ctx
        now = w.clock.now()
        attempt, max_attempts = job["attempts"], job["max_attempts"]
        kind = "cancelled" if isinstance(exc, Cancelled) else classify(exc)
        scheduled_at = None
        if kind == "cancelled":
            state = "cancelled"
        elif kind == "permanent":
            state = "failed"
        elif attempt >= max_attempts:
            state = "dead_lettered"
        else:
            state = "retry_scheduled"
            retry_in = getattr(exc, "retry_in", None)
            # claims return the policy as text: decoded only here, on the failure path
            policy = job["retry_policy"]
            policy = json.loads(policy) if isinstance(policy, str) else policy
            delay = retry_in if retry_in is not None else RetryPolicy.from_json(policy).delay(attempt)
            scheduled_at = now + dt.timedelta(seconds=delay)
        cls = type(exc).__name__
        message = str(exc).strip() or repr(exc)
        message = message[:MAX_ERROR_MESSAGE]
        error = {
            "attempt": attempt,
            "kind": kind,
            "class": cls,
            "message": message,
            "worker": w.id,
            "at": now.isoformat(),
        }
        params = {
            **self._fence(ex),
            "state": state,
            "scheduled_at": scheduled_at,
            "error": Jsonb(error),
            "last_error": f"{cls}: {message}",
            "fingerprint": fingerprint(cls, message),
        }
        if not self._write(queries["settle_error"], params, ex):
            return None
        q, jt = job["queue"], job["job_type"]
        if kind == "timeout":
            w.metrics.add(q, jt, "timeouts")
        if kind == "unknown":
            w.metrics.add(q, jt, "anomalies")
        w.metrics.add(q, jt, {"retry_scheduled": "retried", "cancelled": "cancelled"}.get(state, state))
        log = ctx.logger.warning if state == "retry_scheduled" else ctx.logger.error
        log("%s (%s error): %s: %s", state, kind, cls, message, extra={"next_run_at": scheduled_at})
        return state

    def release(self, ex: Execution, delay: float) -> None:
        params = {**self._fence(ex), "scheduled_at": self.w.clock.now() + dt.timedelta(seconds=delay)}
        if self._write(queries["release_job"], params, ex) is False:
            # refused: another worker holds the job, or an operator killed it before this worker saw the
            # flag (a shutdown shorter than a heartbeat). A killed job must never run again: settle it
            # cancelled (fenced too, so a job another worker holds is left alone)
            self.settle_failure(ex, Cancelled("killed"))

    def _write(self, query: str, params: dict[str, Any], ex: Execution) -> bool | None:
        """A fenced settlement, retried through a database outage until the job's lease would have run out
        (after that another worker owns the job and the fence would refuse us anyway). True: written;
        False: refused by the fence; None: the database could not be reached."""
        # a group's jobs after one that could not be written get one try each, not a lease's worth of
        # retries each (their leases expire and another worker takes them)
        deadline = 0.0 if self._unreachable else time.monotonic() + ex.job["visibility_timeout_seconds"]
        backoff = 0.1
        while True:
            try:
                with self.conn.transaction():
                    row = self.conn.execute(query, params).fetchone()
                if row is None:
                    ex.ctx.logger.warning("job no longer held by this worker: not settled")
                return row is not None
            except psycopg.Error as e:
                self.reset()
                if time.monotonic() + backoff > deadline or not _is_db_error(e):
                    ex.ctx.logger.error("could not settle the job: %s", db.redact(str(e).strip(), self.w.dsn))
                    self._unreachable = self._unreachable or _is_db_error(e)
                    return None
                time.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, 5.0)


def run_worker(config: WorkerConfig, registry: Registry | None = None) -> int:
    """Entry point for one worker process (used by the CLI and the supervisor's children)."""
    return Worker(config, registry).run()
