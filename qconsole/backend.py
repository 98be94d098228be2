"""What the console needs from worker_core, as a Protocol, and the adapter over a real database.

The UI only talks to a :class:`ConsoleBackend`; tests hand it a fake with fixed data. The real one,
:class:`DatabaseBackend`, calls ``worker_core.stats`` (reading) and ``worker_core.ops`` (operator
actions) over connections of its own: named ``qconsole-console`` in ``pg_stat_activity``, every statement
bounded by ``statement_timeout``, read-only transactions in ``--read-only`` mode. It is used from worker
threads. Reads share one connection, one call at a time (a lock), which reconnects by itself after it broke.
An action (and the fetch of a group's jobs before it) runs on a connection opened for it, with a bound of
its own: it may write a whole group of jobs, which a read's bound would cancel, and the reads go on meanwhile,
and so do other actions (a pause is not held up by a long requeue; the database serialises those that touch
the same rows).
An action whose connection died after it was sent may have committed (the answer to its COMMIT lost): the
console then tells which on a new connection (:class:`ActionLost`), by the token its audit entry carries, once
its session has ended (an advisory lock it held until then).
Quitting aborts the actions (:meth:`DatabaseBackend.abort_actions`): those running fail and are rolled back,
and none starts after it; and the reads (:meth:`DatabaseBackend.abort_reads`): one waiting on a server that
stopped answering fails at once, and none starts after it.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import psycopg

from worker_core import db, ops, stats
from worker_core.clock import SYSTEM_CLOCK, Clock, ServerAlignedClock, SystemClock
from worker_core.errors import ReadOnlyError
from worker_core.models import (
    ActionResult,
    AuditEntry,
    DeadLetterGroup,
    DeadLetterGroups,
    Job,
    Overview,
    TypeContract,
    WorkerInfo,
)
from worker_core.stats import JobHolders

APPLICATION_NAME = "qconsole-console"
STATEMENT_TIMEOUT_MS = 3000
#: the bound of an action's statements: a requeue of a dead-letter group writes every job of it (150,000 in
#: about 8 s here), which the read bound cancelled every time
ACTION_STATEMENT_TIMEOUT_MS = 600_000
CONNECT_TIMEOUT_S = 3
#: the least a call may take before the console gives up on the server (DatabaseBackend.call_deadline_s)
CALL_DEADLINE_MIN_S = 10.0
#: how often the server checks that an action's client is still there while it waits (PostgreSQL 14+): an action
#: aborted at quit while it waits for a row lock ends then, with the locks it took, not once that lock is free
CLIENT_CHECK_INTERVAL_MS = 1000
#: how often the console measures its host's clock against the server's (DatabaseBackend._align_clock)
CLOCK_ALIGN_EVERY_S = 60.0
#: how long, after an action's connection was lost, the console waits for its session to end to tell whether it
#: committed (DatabaseBackend.lost_settle_s)
LOST_SETTLE_S = 5.0
#: the states the dead-letters screen groups: what an operator requeues (dead, failed) or kills (retrying)
DEAD_LETTER_STATES = ("dead_lettered", "failed", "retry_scheduled")

T = TypeVar("T")


@dataclass(frozen=True)
class ChartData:
    """The series behind the charts screen, per minute over the last hour, oldest first."""

    retries: dict[str, list[float]] = field(default_factory=dict)
    lease_expirations: dict[str, list[float]] = field(default_factory=dict)
    lag: dict[str, list[float]] = field(default_factory=dict)
    attempts: dict[str, dict[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class OverviewData:
    overview: Overview
    #: average queue latency per minute, per queue (seconds)
    lag: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class ContractsData:
    """Each job type's effective contract (as its workers registered it) and the concurrency limits."""

    contracts: list[TypeContract] = field(default_factory=list)
    #: job_type, queue ('*' for all), max_running, source, reason
    limits: list[dict[str, Any]] = field(default_factory=list)


class ConsoleBackend(Protocol):
    """Everything the console reads or changes. Methods block: call them from a thread worker."""

    read_only: bool

    @property
    def description(self) -> str:
        """Where the data comes from, safe to show (no password)."""
        ...

    def overview(self) -> OverviewData: ...

    def charts(self) -> ChartData: ...

    def list_jobs(
        self,
        *,
        state: str | None,
        job_type: str | None,
        queue: str | None,
        search: str | None,
        limit: int,
        next_first: bool = False,
        after: Job | None = None,
    ) -> list[Job]: ...

    def get_job(self, job_id: uuid.UUID) -> tuple[Job, JobHolders]:
        """The job, and who holds what it needs: its lock_key (whichever job), the worker of its lease."""
        ...

    def dead_letter_groups(self) -> DeadLetterGroups: ...

    def group_job_ids(self, group: DeadLetterGroup) -> list[uuid.UUID]: ...

    def workers(self) -> list[WorkerInfo]: ...

    def audit_log(self, limit: int = 200) -> list[AuditEntry]: ...

    def contracts(self) -> ContractsData: ...

    def requeue(
        self,
        job_ids: Sequence[uuid.UUID],
        reason: str | None = None,
        groups: Sequence[Mapping[str, Any]] | None = None,
        payload: Mapping[str, Any] | None = None,
        if_payload: Mapping[str, Any] | None = None,
    ) -> ActionResult: ...

    def kill(
        self, job_ids: Sequence[uuid.UUID], reason: str | None = None, groups: Sequence[Mapping[str, Any]] | None = None
    ) -> ActionResult: ...

    def discard(
        self, job_ids: Sequence[uuid.UUID], reason: str | None = None, groups: Sequence[Mapping[str, Any]] | None = None
    ) -> ActionResult: ...

    def set_paused(self, queue: str, paused: bool, reason: str | None = None) -> ActionResult: ...

    def set_limit(
        self, job_type: str, max_running: int, queue: str = "*", reason: str | None = None, *, current: int | None
    ) -> ActionResult: ...

    def clear_limit(
        self, job_type: str, queue: str = "*", reason: str | None = None, *, current: int | None
    ) -> ActionResult: ...

    def audit_worker(
        self,
        action: str,
        *,
        number: int,
        pid: int | None,
        host: str,
        queues: Sequence[str],
        concurrency: int,
        tasks: Sequence[str],
        restart_cancelled: bool = False,
    ) -> ActionResult:
        """The audit entry of an embedded worker the console started or stopped (ops.audit_worker)."""
        ...

    def abort_actions(self) -> None:
        """The console is quitting: the actions running fail (rolled back), and none starts after it."""
        ...

    def abort_reads(self) -> None:
        """The console is quitting: a read waiting on the server fails at once, and none starts after it."""
        ...

    def close(self) -> None: ...


class ActionsAborted(RuntimeError):
    """An action asked for while (or after) the console quit: not run."""


class ActionLost(Exception):
    """An action failed with an outage (its connection died): did it change anything? ``committed`` True: yes
    (``audit_id`` its audit entry, ``changed`` the jobs it names); False: no (it never reached the server, or
    its session ended without committing); None: it could not be told (the database unreachable, or its
    session still alive after DatabaseBackend.lost_settle_s). ``cause`` is the error it failed with."""

    def __init__(
        self,
        cause: BaseException,
        committed: bool | None,
        audit_id: int | None = None,
        changed: int = 0,
        note: str = "",
    ) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.committed = committed
        self.audit_id = audit_id
        self.changed = changed
        #: said after the error (why it is known to have changed nothing)
        self.note = note


class ReadsAborted(RuntimeError):
    """A read asked for while (or after) the console quit: not run, or woken from its wait."""


#: the SQLSTATEs of an OperationalError that mean the session is gone or cannot be had: the server shut down,
#: crashed or is starting (57P01-57P03), or has no connection to spare (53300); with class 08 (connection
#: exceptions) and no SQLSTATE at all (the socket died)
_OUTAGE_STATES = ("57P01", "57P02", "57P03", "53300")


def is_outage(exc: BaseException) -> bool:
    """The database could not be reached (or the session was lost), as opposed to answering with an error:
    a statement over its time limit, a lock timeout (55P03, a DBA's lock_timeout behind a worker's row locks),
    a deadlock, a full disk are answers of a live server, on a connection that still works (they read as
    unreachable, the console dropped its connection each time, and an action's outcome was looked up as if
    its connection had died)."""
    if isinstance(exc, (psycopg.InterfaceError, ConnectionError)):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = str(exc.sqlstate or "")
    return not state or state.startswith("08") or state in _OUTAGE_STATES


def describe_error(exc: BaseException, dsn: str | None = None) -> str:
    """One line for a banner or a notification, without the DSN's password."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return db.redact(f"{type(exc).__name__}: {text}", dsn)


#: how long the read of a dead-letter group's jobs (before its question) waits for a lock on job_queue
GROUP_READ_LOCK_WAIT_S = 5.0


class DatabaseBackend:
    """The real backend: worker_core.stats and worker_core.ops over one self-healing connection."""

    def __init__(
        self,
        dsn: str,
        *,
        read_only: bool = False,
        clock: Clock = SYSTEM_CLOCK,
        statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
        connect_timeout: int = CONNECT_TIMEOUT_S,
        call_deadline_s: float | None = None,
        action_timeout_ms: int = ACTION_STATEMENT_TIMEOUT_MS,
    ) -> None:
        self.dsn = dsn
        self.read_only = read_only
        #: the system's clock is put onto the server's (its leases, lags, schedules and ages are in the
        #: server's time: a console on a host two minutes ahead read every lag two minutes long, and requeued
        #: jobs for two minutes later); give the app this clock too (run_console does)
        self.clock: Clock = ServerAlignedClock(clock) if isinstance(clock, SystemClock) else clock
        self._align_due = 0.0  # monotonic time of the next measure (on the first call, then every minute)
        self.statement_timeout_ms = statement_timeout_ms
        self.connect_timeout = connect_timeout
        #: a call (a screen's read: a few statements, each under the statement timeout) still without an
        #: answer after this long is ended here (see _unstick)
        self.call_deadline_s = call_deadline_s or max(CALL_DEADLINE_MIN_S, 2 * statement_timeout_ms / 1000 + 2)
        self.action_timeout_ms = action_timeout_ms
        #: an action whose connection was lost: how long to wait for its session to end (ActionLost)
        self.lost_settle_s = LOST_SETTLE_S
        #: the same for an action, under its own bound
        self.action_deadline_s = max(CALL_DEADLINE_MIN_S, 2 * action_timeout_ms / 1000 + 2)
        self.actor = ops.Actor.current()
        self._conn: db.Conn | None = None
        self._lock = threading.Lock()
        #: each action runs on a connection of its own, alongside the others (those running now: quitting
        #: ends them)
        self._action_conns: set[db.Conn] = set()
        self._action_guard = threading.Lock()  # abort_actions shuts down no connection _act has closed
        #: the console quits (abort_actions, close): no action starts any more
        self._actions_aborted = False
        #: the connection a read waits on now (abort_reads wakes it), under its own lock: abort_reads shuts down
        #: no connection _call has closed (its descriptor may be another socket's by then)
        self._reading: db.Conn | None = None
        self._read_guard = threading.Lock()
        #: the console quits (abort_reads): no read starts any more
        self._reads_aborted = False

    @property
    def description(self) -> str:
        return db.redact_dsn(self.dsn)

    # ---------------------------------------------------------------- connection

    def _connection(self) -> db.Conn:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            self._conn = self._open(self.statement_timeout_ms)
        return self._conn

    def _open(self, statement_timeout_ms: int) -> db.Conn:
        """A connection of the console's: named, autocommit, every statement bounded, read-only if asked."""
        return db.connect(
            self.dsn,
            application_name=APPLICATION_NAME,
            autocommit=True,
            statement_timeout_ms=statement_timeout_ms,
            read_only=self.read_only,
            connect_timeout=self.connect_timeout,
            jit=False,
            tolerant_json=True,
        )

    def _call(self, fn: Callable[[db.Conn], T]) -> T:
        with self._lock:
            self._refuse_if_reads_aborted()
            conn = self._connection()
            with self._read_guard:
                aborted = self._reads_aborted
                if not aborted:
                    self._reading = conn
            if aborted:  # the console quit while this one connected
                self._refuse_if_reads_aborted()
            # a server that stopped answering: the screen says the database is unreachable (db.Deadline)
            deadline = db.Deadline(conn, self.call_deadline_s)
            try:
                with deadline:
                    self._align_clock(conn)
                    return fn(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                if not is_outage(e) and not deadline.expired:
                    raise  # the server answered (a statement or lock timeout): the connection is fine
                # a dead server, a terminated session or a timeout: start from a new connection next time
                self._done_reading()  # before the connection is closed
                self._drop()
                if self._reads_aborted:
                    raise ReadsAborted("the console quit: the read was abandoned") from e
                if deadline.expired:
                    raise psycopg.OperationalError(
                        f"the server did not answer within {self.call_deadline_s:g}s: connection dropped"
                    ) from e
                raise
            finally:
                self._done_reading()

    def _done_reading(self) -> None:
        with self._read_guard:
            self._reading = None

    def _refuse_if_reads_aborted(self) -> None:
        if self._reads_aborted:
            raise ReadsAborted("the console quit: the read was not run")

    def abort_reads(self) -> None:
        """The console quits: no read starts any more, and the one waiting on the server (one that stopped
        answering: up to the call deadline) has its connection's socket shut down, which fails it at once.
        Without it the console's exit waited for that read (asyncio.run joins the thread it runs in): ``q`` took
        up to 10 s on a hung server. Returns at once; a read that is connecting ends within its connect timeout."""
        with self._read_guard:
            self._reads_aborted = True
            if self._reading is not None:
                db.shut_down(self._reading)

    def _act(self, fn: Callable[[db.Conn], T]) -> T:
        """Run an action (or the read before one) on a connection opened for it, under the action bound: a
        long one (a whole group requeued) neither fails at the read bound nor holds the screens' reads up, nor
        another action: each has its own connection, and the database serialises those that touch the same
        rows (a second requeue of a group waits for the first's row locks, then skips what it requeued)."""
        self._refuse_if_aborted()
        conn = self._open(self.action_timeout_ms)
        with self._action_guard:
            aborted = self._actions_aborted
            if not aborted:
                self._action_conns.add(conn)
        if aborted:  # the console quit while this one connected
            with contextlib.suppress(psycopg.Error):
                conn.close()
            self._refuse_if_aborted()
        deadline = db.Deadline(conn, self.action_deadline_s)
        try:
            with deadline:
                if conn.info.server_version >= 140000:
                    conn.execute(f"SET client_connection_check_interval = {CLIENT_CHECK_INTERVAL_MS}")
                return fn(conn)
        except (psycopg.OperationalError, psycopg.InterfaceError) as e:
            if self._actions_aborted:
                raise ActionsAborted("the console quit: the action was rolled back") from e
            if deadline.expired:
                raise psycopg.OperationalError(
                    f"the server did not answer within {self.action_deadline_s:g}s: connection dropped"
                ) from e
            raise
        finally:
            with self._action_guard:
                self._action_conns.discard(conn)
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def _act_told(self, fn: Callable[[db.Conn, str], ActionResult]) -> ActionResult:
        """An operator action (``fn`` writes the token it is given into its audit entry) whose outcome is told
        even when its connection dies: the answer to its COMMIT lost, it was said "failed, nothing changed" while
        it had committed. An outage raises :class:`ActionLost`, which says whether it committed."""
        token = secrets.token_hex(8)
        key = int.from_bytes(bytes.fromhex(token)[:4], "big", signed=True)
        sent = False

        def run(conn: db.Conn) -> ActionResult:
            nonlocal sent
            # held by the session until it ends, then released by the server whatever became of its client
            ops.hold_action_token(conn, key)
            sent = True
            return fn(conn, token)

        try:
            return self._act(run)
        except Exception as e:
            if not is_outage(e):
                raise  # the server answered with an error: rolled back (or it never ran: the console quit)
            if not sent:
                raise ActionLost(e, committed=False) from e  # nothing of it reached the server
            raise self._tell(e, token, key) from e

    def _tell(self, error: BaseException, token: str, key: int) -> ActionLost:
        """Whether the action whose connection died committed, on a new connection: once its session has ended
        (its advisory lock free: nothing of it can commit any more), by its token in the newest audit entries."""
        until = time.monotonic() + self.lost_settle_s
        try:
            conn = self._open(self.statement_timeout_ms)
        except psycopg.Error:
            return ActionLost(error, committed=None)
        with self._action_guard:  # quitting wakes it as it wakes the actions
            aborted = self._actions_aborted
            if not aborted:
                self._action_conns.add(conn)
        try:
            if aborted:
                return ActionLost(error, committed=None)
            with db.Deadline(conn, self.call_deadline_s + self.lost_settle_s):
                while True:
                    if ops.action_session_ended(conn, key):
                        break
                    if time.monotonic() >= until or self._actions_aborted:
                        return ActionLost(error, committed=None)  # its session lives on: it may still commit
                    time.sleep(0.2)
                found = ops.audit_entry_of_token(conn, token)
            if found is None:
                return ActionLost(error, committed=False, note="the connection was lost before it committed")
            return ActionLost(error, committed=True, audit_id=found[0], changed=found[1])
        except psycopg.Error:
            return ActionLost(error, committed=None)
        finally:
            with self._action_guard:
                self._action_conns.discard(conn)
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def _align_clock(self, conn: db.Conn) -> None:
        """Measure the clock against the server's (one round trip) on a connection's first call and every
        CLOCK_ALIGN_EVERY_S after: the actions, which run on connections of their own, use what was measured."""
        if isinstance(self.clock, ServerAlignedClock) and time.monotonic() >= self._align_due:
            self._align_due = time.monotonic() + CLOCK_ALIGN_EVERY_S
            self.clock.align_on(conn)

    def _refuse_if_aborted(self) -> None:
        if self._actions_aborted:
            raise ActionsAborted("the console quit: the action was not run")

    def abort_actions(self) -> None:
        """The console quits: no action starts any more, and each one running (waiting for a lock, say) has
        its connection's socket shut down, which fails it at once; it never commits, and the server rolls it
        back (at once where it checks its clients, PostgreSQL 14+; else once it next reads from it)."""
        with self._action_guard:
            self._actions_aborted = True
            for conn in self._action_conns:
                db.shut_down(conn)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._align_due = 0.0  # the next connection may be to another server (a failover): measure again
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def switch_dsn(self, dsn: str) -> None:
        """Point at another server (the next call connects to it)."""
        with self._lock:
            self.dsn = dsn
            self._drop()

    def close(self, wait: float = 0.5) -> None:
        """Close the connection. A call still waiting for the server (a slow or vanished one) after
        ``wait`` seconds is woken by shutting its socket down, which fails it at once; closing the
        connection from this thread instead would free what libpq, in that call, still uses. An action
        still running fails at once, and is rolled back (abort_actions)."""
        self.abort_actions()
        if not self._lock.acquire(timeout=wait):
            conn = self._conn
            if conn is not None:
                db.shut_down(conn)
            if not self._lock.acquire(timeout=5):
                return  # still in libpq: the process ends anyway
        try:
            self._drop()
        finally:
            self._lock.release()

    # ---------------------------------------------------------------- reading

    def overview(self) -> OverviewData:
        def read(conn: db.Conn) -> OverviewData:
            ov = stats.overview(conn, self.clock)
            waiting: dict[str, float] = {}
            for t in ov.types:
                waiting[t.queue] = max(waiting.get(t.queue, 0.0), t.oldest_waiting_seconds)
            return OverviewData(ov, stats.latency_series(conn, self.clock, waiting=waiting))

        return self._call(read)

    def charts(self) -> ChartData:
        def read(conn: db.Conn) -> ChartData:
            return ChartData(
                retries=stats.series(conn, "retried", self.clock),
                lease_expirations=stats.series(conn, "lease_expirations", self.clock),
                lag=stats.latency_series(conn, self.clock, waiting=stats.oldest_waiting(conn, self.clock)),
                attempts=stats.attempts_distribution(conn, self.clock),
            )

        return self._call(read)

    def list_jobs(
        self,
        *,
        state: str | None,
        job_type: str | None,
        queue: str | None,
        search: str | None,
        limit: int,
        next_first: bool = False,
        after: Job | None = None,
    ) -> list[Job]:
        return self._call(
            lambda c: stats.list_jobs(
                c,
                state=state,
                job_type=job_type,
                queue=queue,
                search=search,
                limit=limit,
                next_first=next_first,
                after=after,
            )
        )

    def get_job(self, job_id: uuid.UUID) -> tuple[Job, JobHolders]:
        def read(conn: db.Conn) -> tuple[Job, JobHolders]:
            job = stats.get_job(conn, job_id)
            return job, stats.job_holders(conn, job, self.clock)

        return self._call(read)

    def dead_letter_groups(self) -> DeadLetterGroups:
        return self._call(lambda c: stats.dead_letter_groups(c, states=DEAD_LETTER_STATES))

    def group_job_ids(self, group: DeadLetterGroup) -> list[uuid.UUID]:
        """The first step of a group's action: however many jobs, under the action bound, on a connection of
        its own (an action running, a long requeue, holds no question up). A lock on the table (a migration,
        VACUUM FULL, LOCK TABLE) is waited for ``GROUP_READ_LOCK_WAIT_S`` at most: behind one, the question came
        unannounced up to 10 minutes after the key, long after the operator had looked elsewhere."""

        def read(c: db.Conn) -> list[uuid.UUID]:
            with c.transaction():
                c.execute(f"SET LOCAL lock_timeout = '{round(GROUP_READ_LOCK_WAIT_S * 1000)}ms'")
                return ops.group_job_ids(c, group.job_type, group.fingerprint, group.state)

        return self._act(read)

    def workers(self) -> list[WorkerInfo]:
        return self._call(lambda c: stats.workers(c, self.clock))

    def audit_log(self, limit: int = 200) -> list[AuditEntry]:
        return self._call(lambda c: stats.audit_log(c, limit))

    def contracts(self) -> ContractsData:
        return self._call(lambda c: ContractsData(stats.type_contracts(c), stats.limits(c)))

    # ---------------------------------------------------------------- acting (audited by worker_core.ops)

    def _refuse_if_read_only(self) -> None:
        if self.read_only:
            raise ReadOnlyError("read-only mode: operator actions are refused (restart without --read-only)")

    def requeue(
        self,
        job_ids: Sequence[uuid.UUID],
        reason: str | None = None,
        groups: Sequence[Mapping[str, Any]] | None = None,
        payload: Mapping[str, Any] | None = None,
        if_payload: Mapping[str, Any] | None = None,
    ) -> ActionResult:
        """``groups``: the dead-letter groups the jobs were asked for, said in the audit entry (ops.GROUPS_KEY);
        ``payload``: one job's corrected payload (the audit entry keeps its diff), made from ``if_payload``: a
        job whose payload is another by now (someone else's fix) is skipped, and says so."""
        if payload is None:
            return self._on_jobs(ops.requeue, job_ids, reason, groups)
        return self._on_jobs(
            functools.partial(ops.requeue, payload=payload, if_payload=if_payload), job_ids, reason, groups
        )

    def kill(
        self, job_ids: Sequence[uuid.UUID], reason: str | None = None, groups: Sequence[Mapping[str, Any]] | None = None
    ) -> ActionResult:
        return self._on_jobs(ops.kill, job_ids, reason, groups)

    def discard(
        self, job_ids: Sequence[uuid.UUID], reason: str | None = None, groups: Sequence[Mapping[str, Any]] | None = None
    ) -> ActionResult:
        return self._on_jobs(ops.discard, job_ids, reason, groups)

    def _on_jobs(
        self,
        action: Callable[..., ActionResult],
        job_ids: Sequence[uuid.UUID],
        reason: str | None,
        groups: Sequence[Mapping[str, Any]] | None,
    ) -> ActionResult:
        """An operator's action on jobs (ops.requeue, kill, discard): refused read-only, audited, told."""
        self._refuse_if_read_only()
        return self._act_told(
            lambda c, token: action(
                c, job_ids, actor=self.actor, reason=reason, clock=self.clock, token=token, groups=groups
            )
        )

    def set_paused(self, queue: str, paused: bool, reason: str | None = None) -> ActionResult:
        self._refuse_if_read_only()
        return self._act_told(
            lambda c, token: ops.set_paused(
                c, queue, paused, actor=self.actor, reason=reason, clock=self.clock, token=token
            )
        )

    def set_limit(
        self, job_type: str, max_running: int, queue: str = "*", reason: str | None = None, *, current: int | None
    ) -> ActionResult:
        """A type's concurrency limit, from the console's form: only if the limit there is still ``current``,
        the one the form showed (ChangedMeanwhile, else). Of a type the overview or the job types list shows,
        so it is not refused as unknown (its worker gone, its jobs pruned meanwhile); a queue no job, worker or
        pause names is (a misspelt one typed into the form would hold nothing)."""
        self._refuse_if_read_only()
        return self._act_told(
            lambda c, token: ops.set_limit(
                c, job_type, max_running, queue=queue, actor=self.actor, reason=reason, clock=self.clock,
                allow_unknown=True, token=token, check_current=True, current=current,
            )
        )  # fmt: skip

    def clear_limit(
        self, job_type: str, queue: str = "*", reason: str | None = None, *, current: int | None
    ) -> ActionResult:
        self._refuse_if_read_only()
        return self._act_told(
            lambda c, token: ops.clear_limit(
                c, job_type, queue=queue, actor=self.actor, reason=reason, clock=self.clock, token=token,
                check_current=True, current=current,
            )
        )  # fmt: skip

    def audit_worker(
        self,
        action: str,
        *,
        number: int,
        pid: int | None,
        host: str,
        queues: Sequence[str],
        concurrency: int,
        tasks: Sequence[str],
        restart_cancelled: bool = False,
        reason: str | None = None,
    ) -> ActionResult:
        self._refuse_if_read_only()
        return self._act_told(
            lambda c, token: ops.audit_worker(
                c, action, number=number, pid=pid, host=host, queues=queues, concurrency=concurrency, tasks=tasks,
                restart_cancelled=restart_cancelled, actor=self.actor, reason=reason, clock=self.clock, token=token,
            )
        )  # fmt: skip
