"""Running claimed jobs: a slot thread runs a job, or a group of them, and settles it.

Per job (DESIGN.md, "The worker"): lock_key lease, then in one transaction the idempotency record, the
handler's writes through ``ctx.tx`` and the fenced ``succeeded`` transition. Any failure rolls that
transaction back and settles the job in a new one: retry with backoff, failed, dead_lettered or cancelled.

Groups: the claimer (worker.Worker._hand_out) hands the claimed sync jobs to the slots in groups sized from
each type's measured handler time (as many as fit in ``group_seconds``, at most ``group_max``; a type not
yet measured, or a slow one, goes one job per group so that slow jobs keep their parallelism). A slot runs
a group's jobs one after another in one transaction, each inside its own savepoint, and commits them with
one fenced settlement: a failing job rolls back to its savepoint only, and is settled on its own after the
commit. The exactly-once contract is unchanged (the idempotency record, the effect and the settlement of a
job still commit together or not at all); only the commits are shared. The group's idempotency records are
written by its first statement (Slot._record_group_keys), outside the jobs' savepoints: a job that fails
deletes its own, and a handler may not end the transaction they are in (JobConnection, JobCursor). Jobs
with a ``lock_key``, solo jobs and async handlers run one per transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import inspect
import json
import logging
import math
import random
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import psycopg
from psycopg.abc import PQGen
from psycopg.generators import execute as execute_generator
from psycopg.types.json import Jsonb

from worker_core import db
from worker_core.context import JobContext
from worker_core.errors import JobTimeout, LeaseLost, PermanentError, TransientError, classify, is_group, leaves
from worker_core.fingerprint import fingerprint
from worker_core.locks import PostgresLocks, lease_seconds, new_token
from worker_core.logs import job_fields
from worker_core.metrics import MetricsBuffer
from worker_core.registry import Task
from worker_core.retry import RetryPolicy
from worker_core.sql import queries

if TYPE_CHECKING:
    from worker_core.worker import Worker

MAX_ERROR_MESSAGE = 2000
RECORD_GROUP_KEYS = queries["record_group_keys"].encode()
RECORD_GROUP_KEY = queries["record_group_key"].encode()
FORGET_GROUP_KEY = queries["forget_group_key"].encode()
UNRECORD_GROUP_KEYS = queries["unrecord_group_keys"].encode()
_PLACEHOLDER = re.compile(rb"%\((\w+)\)s")


def fill(template: bytes, values: dict[bytes, bytes]) -> bytes:
    """A statement with its ``%(name)s`` placeholders replaced by already quoted values, in one pass: a
    value (an idempotency key, say) that itself contains ``%(now)s`` is never substituted again."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


#: an async handler cancels itself at its timeout; the watchdog only steps in when its event loop is stuck
ASYNC_GRACE_MARGIN = 1.0
ABANDONED = "the job was abandoned after its timeout"
GROUP_CONNECTION_LOST = "the connection of the group's transaction was lost"
#: how long a slot waits before it gives back the jobs of a group the database failed (they come back to it)
OUTAGE_PAUSE = 0.5
#: how long a group's settlement waits for a job's row another transaction holds (an operator's open
#: transaction), at most a third of the group's shortest lease: then the group is rolled back and given back
SETTLE_LOCK_WAIT_SECONDS = 5.0


@dataclass(eq=False)
class Execution:
    job: dict[str, Any]
    ctx: JobContext
    #: its lock_key lease (key, token), held from before its handler until it is settled
    lock: tuple[str, str] | None = None
    #: its success went to the completer, which releases its lock once it is settled (Completer._flush)
    settling: bool = False
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
    #: its start's counters (started, queue latency), taken when its slot began it and counted once it is
    #: known to run its handler (Slot._count_start): an idempotency hit runs none, and counts as no start
    start_counts: dict[str, float] | None = None
    #: its start was counted: its duration is counted when it is done (the average divides by the starts)
    start_counted: bool = False
    #: monotonic time its handler returned
    ended: float = 0.0
    #: the group it runs in, if any
    group: Group | None = None
    #: its handler ran (and returned, raised or was given up on): Slot._end_handler
    handler_ran: bool = False
    #: its idempotency key was already processed: settled without running the handler
    hit: bool = False
    #: while it waits for its idempotency key (another job holding it is in its transaction): the
    #: connection the wait is on, which a kill or a shutdown cancels (Worker._watchdog_tick)
    key_wait: Any = None
    #: its share of a slot while in flight (Worker.job_load)
    load: float = 1.0
    #: its idempotency record was written by its group's first statement (Slot._record_group_keys): the
    #: record is not in its savepoint, and a failure deletes it
    key_recorded: bool = False
    #: its group's first statement found its key processed already
    key_hit: bool = False
    #: a record its group wrote for it may have committed without it (a handler before it ended the group's
    #: transaction) and could not be deleted then (Slot._unrecord_waiting): deleted before it runs again
    stale_record: bool = False
    #: (the worker's clock) when its lease runs out, as far as this worker knows: the claim's, then each beat's
    #: extension of it. What a stop that could not release it says of it (Worker._say_left_held)
    lease_until: dt.datetime | None = None
    #: a settlement of its success committed, its answer lost with the connection: found when the settlement
    #: (or the release after it) was tried again, refused by the fence (Slot._write), and counted then
    settled_here: bool = False


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
    #: each job's own values, for the observers (histograms observe one job's latency, not a group's sum)
    samples: dict[tuple[str, str], list[dict[str, float]]] = field(default_factory=dict)

    def count(self, job: dict[str, Any], values: dict[str, float]) -> None:
        key = (job["queue"], job["job_type"])
        row = self.counts.setdefault(key, {})
        for name, value in values.items():
            row[name] = row.get(name, 0) + value
        self.samples.setdefault(key, []).append(values)

    def flush_counts(self, metrics: MetricsBuffer) -> None:
        counts, self.counts = self.counts, {}
        samples, self.samples = self.samples, {}
        for (queue, job_type), values in counts.items():
            metrics.add_many(queue, job_type, values, samples.get((queue, job_type)))


class UndecodablePayload:
    """A claimed payload Python cannot decode (nested deeper than its recursion allows: written by another
    producer than ours, which refuses it). The job fails for good with that reason, not the worker."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


#: SQLSTATE classes of the errors a job's own writes bring about at its settlement or its COMMIT: integrity
#: (a DEFERRABLE constraint checked at COMMIT), data, syntax and access (a search_path the handler changed:
#: undefined table), a trigger's RAISE. Anything else (a lost connection, whose error has no SQLSTATE, a
#: read-only server, an idle-in-transaction timeout, internal errors) is an outage, not the job's doing.
_JOB_MADE_CLASSES = ("22", "23", "42", "P0")


def _job_made(e: BaseException) -> bool:
    """An error the server answered our own statement with (its settlement, its COMMIT), caused by what the
    job did in the transaction: not an outage (connection lost, statement cancelled or timed out)."""
    state = getattr(e, "sqlstate", None)
    return isinstance(e, psycopg.DatabaseError) and bool(state) and str(state)[:2] in _JOB_MADE_CLASSES


def _answered(e: BaseException) -> bool:
    """The server answered our statement with this error on a live connection: not a lost connection (no
    SQLSTATE, class 08), too many clients (53) or a shutdown or cancel by an operator (57)."""
    state = str(getattr(e, "sqlstate", None) or "")
    return bool(state) and not state.startswith(("08", "53", "57"))


LOST_UNDER_HANDLER = "the connection of the job's transaction was lost while its handler ran"
#: a job given back uncharged for database errors around it more often than this (in one worker) is charged
MAX_UNCHARGED_GIVE_BACKS = 3


class LostUnderHandler(psycopg.OperationalError):
    """The job's connection was lost while its handler ran, by an outage for all the worker can tell (a
    restart, a failover, a network cut): the job is given back uncharged (Slot._lost_under), as for any
    outage around a job, but a few times only (MAX_UNCHARGED_GIVE_BACKS): a handler that ends its own
    session in a way that looks like one (it terminates its own backend, closes its socket) would run
    again for ever."""


_RV = TypeVar("_RV")


def _lost_under_handler(conn: db.Conn | db.AsyncConn) -> str | None:
    """Whether the job's connection broke while its handler ran, though no statement found out yet, or the
    handler swallowed the error that did: None if it did not; else the SQLSTATE the server ended the
    session with (JobConnection.ended_with: 25P03 for an idle-in-transaction timeout during a slow call,
    57P01 for a restart or a failover), "" if none came (the network dropped the connection, or the handler
    closed it under psycopg). Non-blocking reads of the socket."""
    if conn.closed or conn.broken:
        return getattr(conn, "ended_with", None) or ""
    pgconn = conn.pgconn
    try:
        # the first read takes the server's last message (FATAL: terminating connection...), which the
        # parse (is_busy) hands to the notice processor (_on_fatal: no statement is in progress); the
        # second meets the end of the stream
        pgconn.consume_input()
        pgconn.is_busy()
        pgconn.consume_input()
    except psycopg.OperationalError:
        return getattr(conn, "ended_with", None) or ""
    if pgconn.status == psycopg.pq.ConnStatus.BAD:
        return getattr(conn, "ended_with", None) or ""
    return None


def _ended_by_job(cause: str) -> bool:
    """The server ended the job's session for something the job did: it left its transaction idle, or open,
    too long (class 25: idle_in_transaction_session_timeout 25P03, transaction_timeout 25P04). Anything
    else (57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now, class 08, none at all) is
    an outage for all the worker can tell."""
    return cause[:2] == "25"


def _on_fatal(conn: JobConnection | AsyncJobConnection) -> Callable[[psycopg.errors.Diagnostic], None]:
    """The FATAL error the server ended the connection's session with, when no statement was in progress
    to receive it (libpq hands it to the notice processor): its SQLSTATE, kept (ended_with)."""
    ref = weakref.ref(conn)

    def notice(diag: psycopg.errors.Diagnostic) -> None:
        target = ref()
        if target is not None and diag.severity_nonlocalized in ("FATAL", "PANIC") and not target.ended_with:
            target.ended_with = diag.sqlstate or ""

    return notice


def _note_ended(conn: db.Conn | db.AsyncConn, sqlstate: str | None) -> None:
    """A statement of the connection failed with ``sqlstate``: if the session ended with it, kept as the
    SQLSTATE it ended with (JobConnection.ended_with)."""
    if sqlstate and not getattr(conn, "ended_with", True) and conn.pgconn.status == psycopg.pq.ConnStatus.BAD:
        cast(JobConnection, conn).ended_with = sqlstate


#: the largest idle_in_transaction_session_timeout PostgreSQL takes (ms)
MAX_IDLE_BOUND_MS = 2**31 - 1


def _idle_bound_ms(jobs: list[Execution]) -> int:
    """How long the transaction these jobs run in may stay idle, in ms (Slot._bound_idle): a job alone, no
    longer than its lease. A group's stays idle across several handlers (between one job's write and the
    settlement, the jobs after it may use no ctx.tx at all): all their timeouts, and the longest lease on
    top. Within what the server takes (a lease of 25 days is beyond it)."""
    lease = max(ex.job["visibility_timeout_seconds"] for ex in jobs)
    handlers = sum(ex.job["timeout_seconds"] for ex in jobs) if len(jobs) > 1 else 0
    return min(int((lease + handlers) * 1000), MAX_IDLE_BOUND_MS)


async def _settled(result: Any) -> Any:
    """An async handler's call that gave no coroutine (a sync wrapper of an async def, which ran it itself or
    returned a future): awaited if it can be, else its result as it is."""
    return await result if inspect.isawaitable(result) else result


def _drop(awaitable: Any) -> None:
    """A sync handler's awaitable nobody will await: closed, so that Python does not warn of it later."""
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()


class HandlerFailure(Exception):
    """Wraps whatever a handler raised (BaseException included) so it never unwinds the worker."""

    def __init__(self, exc: BaseException) -> None:
        # never repr(exc): an argument whose __repr__ raises (an ORM object of a closed session) made this
        # raise, and the job went round its group uncharged for ever. Its message is read, safely, later
        super().__init__(type(exc).__name__)
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


def _lock_wait(jobs: list[Execution]) -> str:
    """How long a group's settlement waits for a row lock (ms, as text for set_config): SETTLE_LOCK_WAIT_SECONDS,
    at most a third of the shortest lease among ``jobs`` (the rows it has locked meanwhile are not extended)."""
    shortest = min((ex.job["visibility_timeout_seconds"] for ex in jobs), default=SETTLE_LOCK_WAIT_SECONDS * 3)
    return str(max(1, int(1000 * min(SETTLE_LOCK_WAIT_SECONDS, shortest / 3))))


def settle_many_params(worker: Worker, batch: list[Execution]) -> dict[str, Any]:
    return {
        "ids": array_literal([ex.job["id"] for ex in batch]),
        "fences": array_literal([f"{ex.job['id']}/{ex.job['attempts']}" for ex in batch]),
        "worker": worker.id,
        "now": worker.clock.now(),
    }


#: command tags of statements that end a transaction (END's tag is COMMIT, ABORT's is ROLLBACK)
_ENDING_TAGS = (b"COMMIT", b"PREPARE TRANSACTION", b"COMMIT PREPARED", b"ROLLBACK PREPARED")


def _tx_ended_error() -> PermanentError:
    return PermanentError(
        "the handler ended ctx.tx's transaction itself (a COMMIT or ROLLBACK statement): ctx.tx commits with"
        " the job's idempotency record and settlement"
    )


def _swallowed_error() -> RuntimeError:
    return RuntimeError("the handler swallowed a database error: its transaction is aborted")


def _notice_end(cursor: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> None:
    """After a statement of a JobCursor or AsyncJobCursor: if a handler ended its transaction with it, say so
    to the slot (Slot.tx_ended)."""
    conn = cursor.connection
    slot = getattr(conn, "slot", None)
    if slot is None or not slot.handler_running:
        return
    idle = conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    tags = [r.command_status or b"" for r in cursor._results]
    # ROLLBACK is also ROLLBACK TO SAVEPOINT's tag: it ends the transaction only if nothing is left open
    if idle or any(t.startswith(_ENDING_TAGS) or (t == b"ROLLBACK" and idle) for t in tags):
        if not slot.tx_ended:
            # the statement that ended the group's transaction decides. COMMIT's tag is ROLLBACK when the
            # transaction had failed, so "COMMIT" means what came before stays, unless the server warned
            # that no transaction was in progress (a ROLLBACK ended it first: _on_notice)
            slot.tx_committed = _committed(tags, slot.no_transaction_warnings)
        slot.tx_ended = True


def _refuse_abandoned(conn: Any) -> None:
    """A statement of a handler whose slot thread was given up (Worker._abandon) never reaches the server:
    its transaction was ended there (Slot.end_abandoned_backends), and this holds even when that failed.
    Every statement of ctx.tx passes here: a handler's marks the session for a reset (Slot._reset_session)."""
    slot = getattr(conn, "slot", None)
    if slot is not None and slot.abandoned:
        raise psycopg.OperationalError(ABANDONED)
    if slot is not None and slot.handler_running:
        conn.handler_used = conn.handler_used_in_tx = True


#: what a handler may have left in the slot's session through ctx.tx, undone before the next job uses it: a
#: plain SET (a search_path, a statement_timeout, a role), a temporary table, a session advisory lock, a
#: LISTEN, a cursor WITH HOLD. Left, one tenant's search_path sent the next job's writes to that tenant's
#: schema, one job's statement_timeout failed another type's queries, a temp table failed the next run of
#: its own type. Its prepared statements stay (psycopg's, the worker's, are among them). The last statement
#: sets the slot's idle limit again (_bound_idle), which RESET ALL took away.
_RESET_SESSION = (
    b"SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; SET SESSION AUTHORIZATION DEFAULT; RESET ALL;"
    b" DISCARD TEMP; SET idle_in_transaction_session_timeout = %d"
)
#: the same, after the COMMIT of a transaction in which a handler used ctx.tx, in its round trip (no round
#: trip of its own on the hot path). After it, not before: the job's own SET LOCAL (a tenant for its RLS
#: policies, a search_path) must hold for its deferred constraints and triggers, which run at COMMIT
_COMMIT_AND_RESET = b"COMMIT; " + _RESET_SESSION
#: between two jobs of a group (one transaction), before the next one's savepoint, in its round trip: the
#: settings (SET LOCAL too: a tenant set by one job was the next one's) and temporary tables, ~6 us of a
#: round trip here; a role and the rest wait for the transaction's end (_RESET_AND_COMMIT)
_RESET_IN_GROUP = b"RESET ALL; DISCARD TEMP; SET idle_in_transaction_session_timeout = %d; "


def _refuse(slot: Slot | None, what: str) -> None:
    """commit(), rollback() and set_autocommit() of ctx.tx, while a handler runs: the job fails."""
    if slot is not None and slot.handler_running:
        raise PermanentError(
            f"a handler must not {what} ctx.tx: it commits with the job's idempotency record and settlement"
            " (ctx.tx.transaction() makes a nested block)"
        )


def _transaction_probe(conn: Any) -> bytes | None:
    """Before a handler's stream() or copy() (the caller holds the connection's lock): the id of the job's
    transaction, assigned now if it had none, so that _ended_unseen can tell afterwards whether that
    statement ended the transaction and whether it committed. Their command tags, which execute()'s are read
    for (_notice_end), are dropped by psycopg: stream() raises for a statement that returns no rows, copy()
    for one that is no COPY, both after the server ran it (``COMMIT`` among them)."""
    slot = getattr(conn, "slot", None)
    if slot is None or not slot.handler_running or slot.tx_ended:
        return None
    if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
        return None
    res = slot._exec(b"SELECT pg_current_xact_id()", psycopg.pq.ExecStatus.TUPLES_OK, conn)
    return cast(bytes, res.get_value(0, 0))


def _ended_unseen(conn: Any, xid: bytes | None) -> None:
    """After that stream() or copy() (its lock released, the caller holding it again): if the job's
    transaction ended, the slot is told (Slot.tx_ended), as _notice_end does, with whether it committed,
    which the server knows for certain (``pg_xact_status``)."""
    slot = getattr(conn, "slot", None)
    if xid is None or slot is None or not slot.handler_running or slot.tx_ended:
        return
    status = conn.pgconn.transaction_status
    rows = psycopg.pq.ExecStatus.TUPLES_OK
    if status == psycopg.pq.TransactionStatus.INTRANS:
        if slot._exec(b"SELECT pg_current_xact_id_if_assigned()", rows, conn).get_value(0, 0) == xid:
            return
    elif status != psycopg.pq.TransactionStatus.IDLE:
        return  # the statement failed in the job's transaction (a COPY's bad row), or is still busy
    fate = slot._exec(b"SELECT pg_xact_status('" + xid + b"')", rows, conn).get_value(0, 0)
    slot.tx_ended = True
    slot.tx_committed = fate == b"committed"


class _StreamCopyWatched:
    """A JobCursor's stream() and copy(): refused for an abandoned slot and a left-over task, and watched,
    as execute() is, for a statement that ends the job's transaction (_transaction_probe)."""

    connection: Any

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        conn = self.connection
        _refuse_abandoned(conn)
        rows = super().stream(*args, **kwargs)  # type: ignore[misc]

        def watched() -> Iterator[Any]:
            with conn.lock:
                xid = _transaction_probe(conn)
            try:
                yield from rows
            finally:
                rows.close()
                with conn.lock:
                    _ended_unseen(conn, xid)

        return watched()

    @contextlib.contextmanager
    def copy(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        conn = self.connection
        _refuse_abandoned(conn)
        with conn.lock:
            xid = _transaction_probe(conn)
        try:
            with super().copy(*args, **kwargs) as copy:  # type: ignore[misc]
                yield copy
        finally:
            with conn.lock:
                _ended_unseen(conn, xid)


class _AsyncStreamCopyWatched:
    """_StreamCopyWatched for AsyncJobCursor."""

    connection: Any

    def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        conn = self.connection
        _refuse_abandoned(conn)
        _refuse_left_over(conn)
        rows = super().stream(*args, **kwargs)  # type: ignore[misc]

        async def watched() -> AsyncIterator[Any]:
            async with conn.lock:
                xid = _transaction_probe(conn)
            try:
                async for row in rows:
                    yield row
            finally:
                await rows.aclose()  # it holds the connection's lock while it streams
                async with conn.lock:
                    _ended_unseen(conn, xid)

        return watched()

    @contextlib.asynccontextmanager
    async def copy(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        conn = self.connection
        _refuse_abandoned(conn)
        _refuse_left_over(conn)
        async with conn.lock:
            xid = _transaction_probe(conn)
        try:
            async with super().copy(*args, **kwargs) as copy:  # type: ignore[misc]
                yield copy
        finally:
            async with conn.lock:
                _ended_unseen(conn, xid)


class JobCursor(_StreamCopyWatched, psycopg.Cursor[dict[str, Any]]):
    """The cursors of a JobConnection: a statement a handler sends through ``ctx.tx`` that ends the job's
    transaction (``ctx.tx.execute("COMMIT")``, which ``commit()``'s refusal cannot stop) is noticed
    (Slot.tx_ended), and the job fails (Slot._run_grouped, TxEnded; Slot._run_sync)."""

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_abandoned(self.connection)
        _statement_starts(self.connection)
        try:
            return super().execute(*args, **kwargs)
        finally:
            _notice_end(self)

    def executemany(self, *args: Any, **kwargs: Any) -> None:
        _refuse_abandoned(self.connection)
        _statement_starts(self.connection)
        try:
            super().executemany(*args, **kwargs)
        finally:
            _notice_end(self)


def _committed(tags: list[bytes], warnings: int) -> bool:
    """Whether the statement that ended the group's transaction committed it, from its command tags and the
    number of "no transaction in progress" warnings (25P01) it drew: each COMMIT or ROLLBACK sent outside a
    transaction draws one. A ROLLBACK tag inside the transaction is either ROLLBACK TO SAVEPOINT (it goes
    on) or a ROLLBACK (it ends): every reading of the tags that draws as many warnings as came is tried,
    and the transaction counts as committed only if all of them commit it. Ambiguous means not committed:
    the jobs before run again (at least once), rather than be settled with their writes gone."""
    ends = [t for t in tags if t in (b"COMMIT", b"ROLLBACK") or t.startswith(_ENDING_TAGS)]
    if any(t != b"COMMIT" and t != b"ROLLBACK" for t in ends):
        return False  # PREPARE TRANSACTION and the like: nothing committed here
    outcomes = set()
    rollbacks = [i for i, t in enumerate(ends) if t == b"ROLLBACK"]
    for choice in range(1 << min(len(rollbacks), 8)):
        real = {i for n, i in enumerate(rollbacks) if choice >> n & 1}
        inside, drawn, outcome = True, 0, None
        for i, t in enumerate(ends):
            if not inside:
                drawn += 1
            elif t == b"COMMIT" or i in real:
                inside, outcome = False, t == b"COMMIT"
        if drawn == warnings and outcome is not None:
            outcomes.add(outcome)
    return outcomes == {True}


def _statement_starts(conn: Any) -> None:
    slot = getattr(conn, "slot", None)
    if slot is not None:
        slot.no_transaction_warnings = 0


def _on_notice(slot: Slot) -> Callable[[psycopg.errors.Diagnostic], None]:
    """The warning a COMMIT sent outside any transaction draws (25P01): with it, that COMMIT committed
    nothing (``ROLLBACK; COMMIT``); without it, a COMMIT whose statement also rolled back to a savepoint
    (``ROLLBACK TO SAVEPOINT s; COMMIT``, the same command tags) committed what came before."""

    def notice(diag: psycopg.errors.Diagnostic) -> None:
        if diag.sqlstate == "25P01":
            slot.no_transaction_warnings += 1

    return notice


#: the reason a job is given back when its sync handler's call returned a coroutine (Slot._call_sync)
FOUND_ASYNC = "found_async"


class KeyWaitCancelled(Exception):
    """A group's first statement waited for a key, and a job of the group was killed, or the worker is
    stopping (Slot._waiting_for_keys)."""


class TxEnded(Exception):
    """A grouped handler ended the group's transaction with a statement of its own."""


class JobConnection(psycopg.Connection[dict[str, Any]]):
    """A slot's connection: ``ctx.tx`` of sync handlers. While a handler runs, the transaction belongs to
    the job (and in a group to the jobs after it too: the group's first statement wrote their idempotency
    records in it), so ``commit()`` and ``rollback()`` refuse, failing the job: the worker ends the
    transaction with the job's settlement."""

    slot: Slot | None = None
    #: its server process, read when it was opened (Slot.backend_pids)
    backend_pid = 0
    #: its idle_in_transaction_session_timeout, as Slot._bound_idle set it (0: none)
    idle_bound_ms = 0
    #: a handler sent statements through it since its session was last reset (Slot._reset_session), since
    #: its settings were last reset in a group's transaction (Slot._in_group_reset)
    handler_used = False
    handler_used_in_tx = False
    #: the SQLSTATE of the FATAL error the server ended its session with, once it did (None: not seen)
    ended_with: str | None = None

    def wait(self, gen: PQGen[_RV], *args: Any, **kwargs: Any) -> _RV:
        try:
            return super().wait(gen, *args, **kwargs)
        except psycopg.Error as e:
            _note_ended(self, e.sqlstate)  # a handler may swallow the error: the slot still learns why (_lost_under)
            raise

    def commit(self) -> None:
        _refuse(self.slot, "commit")
        _refuse_abandoned(self)
        super().commit()

    def rollback(self) -> None:
        _refuse(self.slot, "roll back")
        super().rollback()

    def set_autocommit(self, value: bool) -> None:  # the ``autocommit`` attribute's setter too
        _refuse(self.slot, "switch autocommit on or off on")
        super().set_autocommit(value)

    def close(self) -> None:
        _refuse(self.slot, "close")
        super().close()

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """``with ctx.tx:`` in a handler is a block of the job's transaction, nothing more: the worker
        commits it with the settlement (or rolls it back with the failure). psycopg's own exit would commit
        or roll back and then close the connection, ending the job's (and its group's) transaction: given
        back uncharged, the group ran again for ever."""
        slot = self.slot
        if slot is not None and slot.handler_running:
            return
        super().__exit__(exc_type, exc_val, exc_tb)


#: the job whose handler a task belongs to (set for the handler's task, inherited by every task it starts):
#: the slot's event loop runs job after job, and a task a finished job left behind (the others of a
#: gather whose first one failed, a fire-and-forget write) must not write into the next job's transaction
_HANDLER_OF: contextvars.ContextVar[Execution | None] = contextvars.ContextVar("worker_core_handler_of", default=None)


def _refuse_left_over(conn: Any) -> None:
    slot = getattr(conn, "slot", None)
    owner = _HANDLER_OF.get()
    if slot is not None and owner is not None and owner is not slot.async_job:
        raise PermanentError(
            f"a task of job {owner.job['id']}, finished, used ctx.tx: it would write into another job's"
            " transaction (await every task a handler starts)"
        )


class AsyncJobCursor(_AsyncStreamCopyWatched, psycopg.AsyncCursor[dict[str, Any]]):
    """JobCursor for async handlers."""

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_abandoned(self.connection)
        _refuse_left_over(self.connection)
        try:
            return await super().execute(*args, **kwargs)
        finally:
            _notice_end(self)

    async def executemany(self, *args: Any, **kwargs: Any) -> None:
        _refuse_abandoned(self.connection)
        _refuse_left_over(self.connection)
        try:
            await super().executemany(*args, **kwargs)
        finally:
            _notice_end(self)


class AsyncJobConnection(psycopg.AsyncConnection[dict[str, Any]]):
    """A slot's async connection: ``ctx.tx`` of async handlers, guarded as JobConnection is (Slot._async_job
    says while the handler runs)."""

    slot: Slot | None = None
    backend_pid = 0
    idle_bound_ms = 0
    handler_used = False
    handler_used_in_tx = False
    ended_with: str | None = None

    async def wait(self, gen: PQGen[_RV], *args: Any, **kwargs: Any) -> _RV:
        try:
            return await super().wait(gen, *args, **kwargs)
        except psycopg.Error as e:
            _note_ended(self, e.sqlstate)
            raise

    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        """``ctx.tx.transaction()``, refused to a task of a finished job as its statements are: its
        SAVEPOINT went into the next job's transaction, and its ROLLBACK TO, when its statement was refused,
        took the next job's writes made since with it (that job settled succeeded without them)."""
        _refuse_abandoned(self)
        _refuse_left_over(self)
        return super().transaction(*args, **kwargs)

    async def commit(self) -> None:
        _refuse(self.slot, "commit")
        _refuse_abandoned(self)  # its settlement too: the slot that replaced it settles the job
        _refuse_left_over(self)
        await super().commit()

    async def rollback(self) -> None:
        _refuse(self.slot, "roll back")
        _refuse_left_over(self)
        await super().rollback()

    async def set_autocommit(self, value: bool) -> None:
        _refuse(self.slot, "switch autocommit on or off on")
        await super().set_autocommit(value)

    async def close(self) -> None:
        _refuse(self.slot, "close")
        await super().close()

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """``async with ctx.tx:``: a block of the job's transaction (see JobConnection.__exit__)."""
        slot = self.slot
        if slot is not None and slot.handler_running:
            return
        await super().__aexit__(exc_type, exc_val, exc_tb)


#: the longest delay a handler's ``retry_in`` may ask for (a year)
MAX_RETRY_IN_SECONDS = 366 * 86400.0


def _retry_in(exc: BaseException) -> float | None:
    """A TransientError's ``retry_in``, if it is a usable number of seconds (a Retry-After header passed on
    as the string it came as would otherwise fail the settlement itself), within a year."""
    value = getattr(exc, "retry_in", None)
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    try:
        seconds = float(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError, OverflowError):  # 10**400: too large for a float
        return None
    if seconds is None or math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_IN_SECONDS)


def _text(exc: BaseException) -> str:
    try:
        return str(exc).strip() or repr(exc)
    except Exception:
        return f"<{type(exc).__name__} whose message could not be read>"


def _error_message(exc: BaseException) -> str:
    """An error's message as the database can store it: its own text (or, if that fails, a placeholder),
    with no NUL (PostgreSQL text refuses it) nor lone surrogate (UTF-8 refuses them), bounded. An exception
    group's names its leaves after its own ("unhandled errors in a TaskGroup (1 sub-exception)" alone says
    nothing of what went wrong, and gave every such error the same fingerprint)."""
    message = _text(exc)
    if is_group(exc):
        message += ": " + "; ".join(f"{type(leaf).__name__}: {_text(leaf)}" for leaf in leaves(exc))
    message = message.replace("\x00", "\\0").encode("utf-8", "backslashreplace").decode("utf-8")
    return message[:MAX_ERROR_MESSAGE]


def _is_db_error(exc: BaseException) -> bool:
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


#: while a recurring failure lasts (RecurringFailure), it is said again at most this often
FAILURE_REMINDER_SECONDS = 60.0


def _unreachable_kind(kind: tuple[str, str | None]) -> bool:
    """An error of this kind (RecurringFailure) means the server could not be talked to: no SQLSTATE (a
    connection refused, lost, timed out), a connection exception (08) or the server shutting down (57P)."""
    sqlstate = kind[1]
    return sqlstate is None or sqlstate.startswith(("08", "57P"))


class RecurringFailure:
    """A failure that comes back at every try (a beat, a claim, a settlement batch, tried again through an
    outage), said without flooding the log: the first in full, once; while it lasts, a reminder at most once
    every FAILURE_REMINDER_SECONDS (for how long, how many tries failed); an error of another kind (its class
    and SQLSTATE: a statement timeout after a lost connection, a missing table) at once, in full, never hidden
    by the reminders; and the first try that goes through after it, once ("database reachable again after N
    s"). A heartbeat at the default interval logged 30 multi-line warnings a minute per worker through an
    outage, and nothing said when the database was back."""

    def __init__(self, log: Any, what: str) -> None:
        self.log = log
        #: what fails, as the lines name it ("heartbeat", "claim", "completer")
        self.what = what
        #: (monotonic) since when it fails (None: the last try went through), how many tries failed since
        self.since: float | None = None
        self.failures = 0
        #: the kind of the last failure, and those said in full during this one
        self._kind: tuple[str, str | None] | None = None
        self._kinds: set[tuple[str, str | None]] = set()
        self._said_at = 0.0

    def failed(self, error: BaseException, text: str, then: str = "") -> None:
        """A try failed with ``error``, whose (redacted) text is ``text``; ``then``: what happens next, said
        with the first line ("retrying in 0.2s")."""
        now = time.monotonic()
        kind = (type(error).__name__, getattr(error, "sqlstate", None))
        self.failures += 1
        tail = f"; {then}" if then else ""
        if self.since is None:
            self.since, self.failures, self._kinds = now, 1, set()
        self._kind = kind
        if kind not in self._kinds:  # the first failure, or one of a kind not said yet during it
            self._kinds.add(kind)
            self._said_at = now
            self.log.warning("%s failed: %s%s (said again once a minute while it fails)", self.what, text, tail)
            return
        if now >= self._said_at + FAILURE_REMINDER_SECONDS:
            self._said_at = now
            first = (text.splitlines() or [""])[0]
            self.log.warning("%s still failing after %.0f s (%s tries failed): %s", self.what, now - self.since,
                             self.failures, first)  # fmt: skip

    def succeeded(self) -> None:
        """A try went through: the end of the failure, if there was one, said once."""
        if self.since is None:
            return
        took, failures, kind = time.monotonic() - self.since, self.failures, self._kind
        self.since, self.failures, self._kind = None, 0, None
        if kind is not None and _unreachable_kind(kind):
            self.log.info("%s: database reachable again after %.0f s (%s tries failed)", self.what, took, failures)
        else:
            self.log.info("%s: going through again after %.0f s (%s tries failed)", self.what, took, failures)


class Slot:
    """One unit of concurrency: a connection (and, lazily, an event loop and async connection)."""

    def __init__(self, worker: Worker, index: int) -> None:
        self.w = worker
        self.index = index
        self._conn: JobConnection | None = None
        #: set while giving a group back, once the database could not be reached (see _write)
        self._unreachable = False
        #: set while giving back a group that a held row held up (_held_up): how long each of its settlements
        #: waits for a row lock (ms, text), tried again until the job's lease would have run out (see _write)
        self._lock_wait: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aconn: db.AsyncConn | None = None
        #: a handler is running on this slot's thread (see JobConnection)
        self.handler_running = False
        #: the running handler ended its transaction with a statement (see JobCursor)
        self.tx_ended = False
        #: the statement that ended it was a COMMIT: what the group's jobs before it did, committed
        self.tx_committed = False
        #: the async job whose handler runs (or is being settled) in this slot's loop (_refuse_left_over)
        self.async_job: Execution | None = None
        #: how often the server warned, during the last statement of ctx.tx, that no transaction was in
        #: progress (_committed)
        self.no_transaction_warnings = 0
        #: the watchdog gave up on this slot's thread (Worker._abandon): it opens and sends nothing more
        self.abandoned = False
        #: while a group runs, the connection its transaction is on (see conn): a group never goes on, nor
        #: settles, on another
        self._in_group = False
        self._pinned: JobConnection | None = None

    # connections -----------------------------------------------------------------

    @property
    def conn(self) -> db.Conn:
        if self.abandoned:
            raise psycopg.OperationalError(ABANDONED)
        pinned = self._pinned
        if pinned is not None:
            if pinned is not self._conn or pinned.closed or pinned.broken:
                # what the group did so far went with it: a new connection would settle its jobs with their
                # effects lost, and run the next ones without their records (run_group gives it all back)
                raise psycopg.OperationalError(GROUP_CONNECTION_LOST)
            return pinned
        if self._conn is None or self._conn.closed or self._conn.broken:
            name = self.w.config.application_name
            conn = cast(JobConnection, db.connect(self.w.dsn, application_name=name, cls=JobConnection))
            conn.slot = self
            conn.cursor_factory = JobCursor
            conn.add_notice_handler(_on_notice(self))
            conn.add_notice_handler(_on_fatal(conn))
            conn.backend_pid = conn.info.backend_pid
            self._conn = conn
            if self.abandoned:  # while it connected: nothing of it may reach the server through it
                raise psycopg.OperationalError(ABANDONED)
        conn = self._conn
        if conn.handler_used:  # between transactions only: before a job's first statement
            self._reset_session(conn)
        if self.idle_bound_ms > conn.idle_bound_ms:
            self._bound_idle(conn)
        if self._in_group:
            self._pinned = conn
        return conn

    def _flush_before_suspect(self) -> None:
        """A job that runs alone may be the one that kills its process (a poison pill): what was counted so
        far, its lease expiration and this start among them, is written before it runs. Counted in memory
        until the next beat, they died with the process: a poison pill read one lease expiration whatever
        its attempts, and no start. Best effort: a failure keeps the counts for the beat. Its start is counted
        once its idempotency key is recorded (an idempotency hit is no start), in the job's transaction: then
        the counts go through a connection of their own."""
        conn = self.conn
        with contextlib.suppress(psycopg.Error):
            if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                self.w.metrics.flush(conn)
            else:
                name, timeout_ms = self.w.config.application_name, db.OWN_STATEMENT_TIMEOUT_MS
                with db.connect(self.w.dsn, application_name=name, statement_timeout_ms=timeout_ms) as c:
                    self.w.metrics.flush(c)

    def _reset_session(self, conn: JobConnection | AsyncJobConnection) -> None:
        """Between jobs: what the last handler left in the session goes (_RESET_SESSION). One round trip, only
        after a job whose handler used ctx.tx; between transactions only (in one, a rollback would undo it)."""
        if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return
        self._exec(_RESET_SESSION % conn.idle_bound_ms, psycopg.pq.ExecStatus.COMMAND_OK, conn)
        conn.handler_used = conn.handler_used_in_tx = False

    def _commit(self, conn: JobConnection) -> None:
        """The worker's COMMIT of a job's (or group's) transaction; after handlers used ctx.tx, with the
        session's reset in the same round trip (_COMMIT_AND_RESET). The COMMIT's own result decides: a reset
        that fails after it leaves the flag set, and the reset has a round trip of its own before the next
        job (_reset_session), as after a transaction that rolled back. The answer is waited for as psycopg
        waits, the GIL released: libpq's own wait held it, and a slow COMMIT froze every thread of the
        worker (its beats, the other slots, the watchdog)."""
        if not conn.handler_used:
            conn.commit()
            return
        if self.abandoned:
            raise psycopg.OperationalError(ABANDONED)
        with conn.lock:
            conn.pgconn.send_query(_COMMIT_AND_RESET % conn.idle_bound_ms)
            results = conn.wait(execute_generator(conn.pgconn))
        self._committed(conn, results)

    async def _acommit(self, aconn: db.AsyncConn) -> None:
        """_commit for async jobs, waiting on the event loop."""
        conn = cast(AsyncJobConnection, aconn)
        if not conn.handler_used:
            await aconn.commit()
            return
        if self.abandoned:
            raise psycopg.OperationalError(ABANDONED)
        async with conn.lock:
            conn.pgconn.send_query(_COMMIT_AND_RESET % conn.idle_bound_ms)
            results = await conn.wait(execute_generator(conn.pgconn))
        self._committed(conn, results)

    def _committed(self, conn: JobConnection | AsyncJobConnection, results: list[psycopg.pq.abc.PGresult]) -> None:
        committed = results[0] if results else None
        if committed is None or committed.status != psycopg.pq.ExecStatus.COMMAND_OK:
            raise self._failed(committed, conn)
        if all(r.status in (psycopg.pq.ExecStatus.COMMAND_OK, psycopg.pq.ExecStatus.TUPLES_OK) for r in results):
            conn.handler_used = conn.handler_used_in_tx = False

    def _in_group_reset(self, conn: JobConnection) -> bytes:
        """What goes before a grouped job's savepoint: the last job's settings and temporary tables undone
        (a plain SET outlives the savepoint of a job that succeeded), if its handler used ctx.tx."""
        if not conn.handler_used_in_tx or conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
            return b""
        conn.handler_used_in_tx = False
        return _RESET_IN_GROUP % conn.idle_bound_ms

    #: how long the transaction of the jobs this slot runs now may stay idle (ms): see _bound_idle
    idle_bound_ms = 0

    def _bound_idle(self, conn: JobConnection | AsyncJobConnection) -> None:
        """A transaction of this slot's left idle for longer than its jobs' leases (a group's: see
        _idle_bound_ms) is ended by the server (``idle_in_transaction_session_timeout``, raised as jobs with
        longer leases come, never lowered).
        Else a worker that froze (SIGSTOP, a paused VM, a network partition the server cannot see) in the
        middle of a job holds that job's idempotency record for as long as it stays frozen, and the worker
        that takes the job over when its lease expires waits on that record as long, extending its own
        lease all the while: the job was stuck for good. A handler is never idle that long: its timeout is
        shorter than its lease. Set between transactions only (set inside one, a rollback would undo it)."""
        if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return
        want = self.idle_bound_ms
        self._exec(b"SET idle_in_transaction_session_timeout = %d" % want, psycopg.pq.ExecStatus.COMMAND_OK, conn)
        conn.idle_bound_ms = want

    def _group_connection_lost(self) -> bool:
        pinned = self._pinned
        return pinned is not None and (pinned.closed or pinned.broken)

    def reset(self) -> None:
        """Drop the connections (they broke, or this thread was given up on). Only from this slot's own
        thread: libpq is not thread-safe on one connection, and closing frees what a call in progress
        reads."""
        conn, self._conn = self._conn, None
        self._pinned = None  # the group, if any, is given back: its settlements go on a new connection
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.cancel_safe(timeout=1)
            conn.close()
        aconn, self._aconn = self._aconn, None
        loop, self._loop = self._loop, None
        usable = loop is not None and not loop.is_closed() and not loop.is_running()
        if aconn is not None:
            if usable and not self.abandoned:
                with contextlib.suppress(BaseException):
                    cast(asyncio.AbstractEventLoop, loop).run_until_complete(asyncio.wait_for(aconn.close(), 2))
            else:  # no loop to run its close in (or a stuck task of this thread's may still be in it)
                with contextlib.suppress(Exception):
                    aconn.pgconn.finish()
        if usable:
            cast(asyncio.AbstractEventLoop, loop).close()

    def close(self) -> None:
        self.reset()

    @property
    def backend_pids(self) -> list[int]:
        """The server processes of the slot's connections, as read when they were opened: from another
        thread, libpq may not be called on them."""
        # ``_closed`` is psycopg's own flag, set by close(), a plain attribute: the pid of a closed connection may
        # be another process's by now
        conns = [c for c in (self._conn, self._aconn) if c is not None and not getattr(c, "_closed", True)]
        return [pid for c in conns if (pid := getattr(c, "backend_pid", 0))]

    def abandon(self) -> None:
        """From the watchdog, while this slot's thread is stuck in a handler: from now on the slot opens no
        connection and its handler's statements are refused (_refuse_abandoned). The connections stay
        this thread's to close (reset, when the handler returns); the slot that replaces it ends their
        server processes, and with them the abandoned transaction and its locks (end_abandoned_backends)."""
        self.abandoned = True

    def end_abandoned_backends(self, abandoned: Slot) -> None:
        """On the slot that replaces ``abandoned``, before it settles the job: terminate the server
        processes of the abandoned slot's connections. Its transaction holds the job's idempotency record
        and whatever rows the handler wrote: left open until the stuck handler returns (never, perhaps),
        they would hold up the job's next attempt. A failure is logged; the server then ends that
        transaction when the handler returns (reset) or the worker exits."""
        pids = abandoned.backend_pids
        if not pids:
            return
        try:
            conn = self.conn
            ended = {r["pid"] for r in conn.execute(queries["terminate_backends"], {"pids": pids}) if r["terminated"]}
            conn.commit()
        except psycopg.Error as e:
            self.reset()
            why = db.redact(str(e).strip(), self.w.dsn)
            self.w.log.warning("could not end the abandoned handler's transaction: %s", why)
            return
        if set(pids) - ended:  # gone already (it broke, say), or not this user's to end
            left = sorted(set(pids) - ended)
            self.w.log.warning("could not end server processes %s of the abandoned handler (gone already?)", left)

    def _rollback(self) -> None:
        if self._conn is not None and not self._conn.closed:
            try:
                self._conn.rollback()
            except psycopg.Error:
                self.reset()

    # the job -------------------------------------------------------------------

    def run_one(self, ex: Execution) -> None:
        """A job in a transaction of its own."""
        self._unreachable = False  # one give-up's, not this job's (_write): its settlements get their lease
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
        with w._exec_lock:  # from here a pause no longer holds it (Worker._hold_paused)
            ex.begun = True
        self.idle_bound_ms = _idle_bound_ms([ex])
        if ctx.cancelled:
            # killed, lease lost, its queue paused or shutting down while it waited in the prefetch buffer:
            # never started
            self._after_failure(ex, self._cancel_exc(ex))
            return
        task = w.registry.get(job["job_type"])
        now = w.clock.now()
        latency_ms = max(0.0, (now - job["scheduled_at"]).total_seconds() * 1000)
        ex.start_counts = {"started": 1, "latency_ms_sum": latency_ms}
        if task is None:  # the claim filters on registered types; only a changed registry gets here
            self._count_start(ex)
            self.settle_failure(ex, PermanentError(f"no handler for job type {job['job_type']!r}"))
            return
        if isinstance(job["payload"], UndecodablePayload):
            self._count_start(ex)
            self.settle_failure(ex, PermanentError(f"the payload cannot be decoded: {job['payload'].reason}"))
            return
        if job["lock_key"]:
            token = new_token()
            ttl = lease_seconds(job["visibility_timeout_seconds"])
            try:
                got = w.locks.acquire(self.conn, job["lock_key"], token, ttl, job["id"])
            except Exception as e:
                ctx.logger.warning("lock backend failed: %s", db.redact(str(e), w.dsn))
                self._forget_lock(job["lock_key"], token)
                # only a refusal is counted towards a charge: a connection lost on the way (dropped when
                # idle, a failover, an outage) is never the job's, whatever the number
                if w.locks.refused(e) and self._charged_for_lock_backend(ex, e):
                    return
                got = False
            if not got:
                w.metrics.add(job["queue"], job["job_type"], "lock_contention")
                delay = w.config.lock_contention_delay * random.uniform(0.8, 1.5)
                ctx.logger.info("lock contention on %s: rescheduled in %.1fs", job["lock_key"], delay)
                w._burst_hold_until = max(w._burst_hold_until, time.monotonic() + delay)
                self.release(ex, delay)
                return  # not an attempt (it is given back): not counted as started
            ex.lock = (job["lock_key"], token)
        # its start is counted by _run_sync / _async_job once its idempotency key (if any) is found not
        # processed yet: a hit runs no handler
        ex.started = time.monotonic()
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
            self.settle_refused(ex)
        except psycopg.Error as e:
            if _job_made(e):
                # the server answered with an error of the job's making at its settlement or commit: a
                # deferred constraint its writes broke, a search_path it changed. Its failure, charged an
                # attempt (given back uncharged, it ran again for ever, never dead-lettered)
                self.reset()
                self._after_failure(ex, e)
            else:
                # our own statements failed (database outage): the effect did not commit; give the job back,
                # uncharged, but not for ever: a job given back so again and again, by a database that
                # answers all along (its handler made the transaction read-only, or set a lock_timeout its
                # settlement meets), is charged (given back uncharged, it never reached its dead letters)
                self.reset()
                why = db.redact(str(e).strip(), w.dsn)
                # counted only where the job may be the cause: its handler ran, and the server answered (an
                # error with a SQLSTATE, not a lost connection, too many clients or a shutdown)
                suspect = ex.handler_ran and _answered(e)
                times = w.given_back_for_errors(job["id"]) if suspect else 0
                if times > MAX_UNCHARGED_GIVE_BACKS:
                    ctx.logger.warning("database error around the job, %d times: charged (%s)", times, why)
                    self._after_failure(ex, e)
                else:
                    ctx.logger.warning("database error around the job: %s", why)
                    self.release(ex, 0.0)
        finally:
            if not ex.abandoned:  # else the slot that replaces this one finishes the job
                self._finish(ex, ex.started)

    def _count_start(self, ex: Execution) -> None:
        """Count the job's start (``started`` and its queue latency), once: when its handler is to run, or
        it fails as an attempt without one. Not for an idempotency hit, which runs no handler, nor for a job
        given back or cancelled before that (not an attempt)."""
        counts, ex.start_counts = ex.start_counts, None
        if counts is None:
            return
        ex.start_counted = True
        job = ex.job
        if ex.group is not None:
            ex.group.count(job, counts)
            return
        self.w.metrics.add_many(job["queue"], job["job_type"], counts)
        if job["ran_solo"]:
            self._flush_before_suspect()
            ex.started = time.monotonic()  # the flush is no handler time

    def _finish(self, ex: Execution, t0: float) -> None:
        job = ex.job
        values = dict(ex.outcome)
        # a job whose start was not counted (an idempotency hit, a job given back or cancelled before its
        # handler) says nothing of the handler's time: its duration is neither observed nor summed
        if ex.start_counted:
            seconds = (ex.ended or time.monotonic()) - t0
            self.w.observe_handler(job["job_type"], seconds)
            values["duration_ms_sum"] = seconds * 1000
        if ex.group is not None:
            ex.group.count(job, values)
        else:
            self.w.metrics.add_many(job["queue"], job["job_type"], values)
        if ex.lock is not None and ex.abandoned:
            # Python cannot stop its thread, which may still work on the resource: not given to another job
            # now; the lease, no longer extended, runs out within the job's visibility timeout
            ex.ctx.logger.info("lock %s kept until its lease runs out: the abandoned handler may still run", ex.lock[0])
        elif ex.lock is not None and not ex.settling:
            try:
                self.w.locks.release(self.conn, *ex.lock)
            except Exception as e:
                ex.ctx.logger.warning("could not release lock %s: %s (it expires by itself)", ex.lock[0], e)

    def finish_abandoned(self, ex: Execution) -> None:
        """Settle the job of an abandoned slot thread (timed out, killed, lease lost or shutting down), and
        the rest of its group: their transaction ends with the thread's connections."""
        w = self.w
        if ex.slot is not None and ex.slot is not self:
            self.end_abandoned_backends(ex.slot)
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
                if other.settled_here:  # the group had committed, its answer lost: counted with the group's
                    self._finish(other, other.started)
            for other, exc in group.failed:
                try:
                    self._after_failure(other, exc)
                except Exception:  # the others are settled all the same; this one's lease brings it back
                    other.ctx.logger.exception("could not settle the job's failure")
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
        self._unreachable = False  # as in run_one
        group = Group(waiting=list(jobs))
        current: Execution | None = None
        self._in_group, self._pinned = True, None
        self.idle_bound_ms = _idle_bound_ms(jobs)
        try:
            self._delete_stale(group.waiting)
            self._record_group_keys(group.waiting)
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
        except TxEnded:
            assert current is not None
            self._tx_ended_by(current, group)
        except KeyWaitCancelled:
            self._rollback()
            self._give_back_group(group)
        except BaseException as e:
            # one of our own statements failed (the handlers' errors are their jobs' failures), or the
            # database went away: nothing of the group committed; the job in progress is given back too
            self.reset()
            if _job_made(e):
                # the server refused the group's settlement or COMMIT for something a job did (a deferred
                # constraint): which one, the group cannot tell. Its types run one job per transaction from
                # now on, where that job fails alone, charged (else the group came back, round and round)
                kinds = sorted({x.job["job_type"] for x in [*group.effects, *group.done, *group.waiting]})
                w.ungroup(kinds, db.redact(str(e).strip(), w.dsn))
            elif isinstance(e, psycopg.Error):
                why = db.redact(str(e).strip(), w.dsn)
                w.log.warning("database error around a group of jobs: %s", why)
                again = [x for x in group.effects if _answered(e) and w.given_back_for_errors(x.job["id"]) > 1]
                if again:
                    # the same jobs' group failed before: they run alone next, where one that keeps causing
                    # it is charged (MAX_UNCHARGED_GIVE_BACKS)
                    w.ungroup(sorted({x.job["job_type"] for x in again}), why)
                if isinstance(e, psycopg.OperationalError) and group.waiting:
                    # the server is likely gone: the jobs not begun, given back at once, would come straight
                    # back here, round and round, a warning each time
                    w._stopping.wait(OUTAGE_PAUSE)
            else:
                w.log.exception("unexpected error around a group of jobs")
            if current is not None and current not in group.effects and all(f[0] is not current for f in group.failed):
                group.effects.append(current)
            self._give_back_group(group)
        finally:
            self._in_group, self._pinned = False, None
            group.flush_counts(w.metrics)

    def _raw(self, sql: bytes, expect: psycopg.pq.ExecStatus = psycopg.pq.ExecStatus.COMMAND_OK) -> int:
        """Statements (SAVEPOINT...) sent in one round trip straight through libpq: a group's savepoints cost
        no more than that round trip. Returns the number of rows of the last statement."""
        return self._exec(sql, expect).ntuples

    def _exec(
        self, sql: bytes, expect: psycopg.pq.ExecStatus, conn: db.Conn | db.AsyncConn | None = None
    ) -> psycopg.pq.abc.PGresult:
        """_raw, returning the last statement's result (on ``conn``, else the slot's connection)."""
        if self.abandoned:
            raise psycopg.OperationalError(ABANDONED)
        conn = self.conn if conn is None else conn
        res = conn.pgconn.exec_(sql)
        if res.status != expect:
            raise self._failed(res, conn)
        return res

    @staticmethod
    def _failed(res: psycopg.pq.abc.PGresult | None, conn: db.Conn | db.AsyncConn) -> psycopg.Error:
        """The error a statement's unexpected result stands for."""
        if res is not None and res.status == psycopg.pq.ExecStatus.FATAL_ERROR:
            sqlstate = res.error_field(psycopg.pq.DiagnosticField.SQLSTATE)
            if sqlstate and conn.pgconn.status != psycopg.pq.ConnStatus.BAD:
                return psycopg.errors.error_from_result(res, conn.info.encoding)
            # the session ended under the statement: why, if the result says (_lost_under; PQexec's never does)
            _note_ended(conn, sqlstate.decode(errors="replace") if sqlstate else None)
        if res is None or res.status == psycopg.pq.ExecStatus.FATAL_ERROR:
            # the server closed the connection (no SQLSTATE): an outage, never an error of the job's making
            raw = (res.error_message if res is not None else b"") or conn.pgconn.error_message
            message = (raw or b"server closed the connection unexpectedly").decode(errors="replace")
            return psycopg.OperationalError(message.strip())
        return psycopg.OperationalError(f"unexpected result {psycopg.pq.ExecStatus(res.status).name}")

    def _begin_for_handler(self, conn: db.Conn | db.AsyncConn) -> None:
        """On a handler's first use of ``ctx.tx`` (a job alone in its transaction, or async): the job's
        transaction begins now if none of its statements began it yet (no idempotency key), as psycopg
        would before the first statement anyway. Else a ``ctx.tx.transaction()`` block would be a
        transaction of its own, committed at its end, before the job's settlement and whatever the job
        does next; begun, it is a savepoint in the job's transaction. Straight through libpq: the async
        connection too, from the event loop's thread, while the handler waits on this property."""
        if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            self._exec(b"BEGIN", psycopg.pq.ExecStatus.COMMAND_OK, conn)

    def _record_group_keys(self, jobs: list[Execution]) -> None:
        """The idempotency records of a group's jobs in one statement, in the round trip that begins its
        transaction (queries.sql ``record_group_keys``): a job then costs its savepoint and its handler's
        statements, not a round trip more for its record. A key that comes twice in the group is recorded by
        its later jobs one by one (_open_with_key): whether it is a hit depends on how the first one ends."""
        first: dict[str, Execution] = {}
        for ex in jobs:
            # a job given back from a lost group comes here again: what that group recorded is gone
            ex.key_recorded = ex.key_hit = False
            key = ex.job["idempotency_key"]
            if key and key not in first and not ex.ctx.cancelled:
                first[key] = ex
        if len(first) < 2:
            return  # one key: _open_with_key records it in its savepoint's round trip
        conn = self.conn
        enc = conn.info.encoding
        quote = psycopg.pq.Escaping(conn.pgconn).escape_literal
        rows = b", ".join(
            b"(%s, '%s', %s)" % (quote(key.encode(enc)), str(ex.job["id"]).encode(), quote(job_type.encode(enc)))
            for key, ex in first.items()
            for job_type in (ex.job["job_type"],)
        )
        sql = fill(
            RECORD_GROUP_KEYS,
            {
                b"rows": rows,
                b"now": quote(self.w.clock.now().isoformat().encode()),
                b"retention_seconds": repr(float(self.w.config.idempotency_retention_seconds)).encode(),
            },
        )
        begin = b"BEGIN; " if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE else b""
        with self._waiting_for_keys(list(first.values()), conn):
            res = self._exec(begin + sql, psycopg.pq.ExecStatus.TUPLES_OK)
        recorded = {res.get_value(i, 0) for i in range(res.ntuples)}
        for ex in first.values():
            if str(ex.job["id"]).encode() in recorded:
                ex.key_recorded = True
            else:
                ex.key_hit = True

    def _tx_ended_by(self, ex: Execution, group: Group) -> None:
        """``ex``'s handler ended the group's transaction with a statement of its own (JobCursor). What the
        jobs before it did committed or vanished with it: they are given back (a committed one is a hit when
        it runs again, a lost one runs again); the records the group wrote for the jobs after it, committed
        perhaps, are deleted; ``ex`` fails."""
        ex.ended = time.monotonic()
        ex.ctx.logger.error("the handler ended ctx.tx's transaction itself: the job fails, its group runs again")
        try:
            self._rollback()
            self._unrecord_waiting(group)
            if self.tx_committed and group.effects:
                self._settle_committed(group)
        except psycopg.Error as e:
            self.reset()
            why = db.redact(str(e).strip(), self.w.dsn)
            self.w.log.warning("could not delete the records of a broken group: %s", why)
        group.failed.append((ex, _tx_ended_error()))
        self._give_back_group(group)

    def _settle_committed(self, group: Group) -> None:
        """A handler's COMMIT committed what the group's jobs before it did: they are settled succeeded
        (fenced), not given back, where a job without an idempotency key would run, and write, again."""
        effects = group.effects
        with self.conn.transaction():
            rows = self.conn.execute(queries["settle_succeeded_many"], settle_many_params(self.w, effects)).fetchall()
        group.effects = []  # settled (or another worker's): if the statement failed, they are given back
        held = {r["id"] for r in rows}
        for done in effects:
            if done.job["id"] in held:
                self._succeeded(done, idempotency_hit=done.hit)
            else:  # its effects committed with the handler's COMMIT; killed since, it ends cancelled
                self.settle_refused(done)
            self._finish(done, done.started)
        self._leave(group, effects)

    def _unrecord_waiting(self, group: Group) -> None:
        """The records the group's first statement wrote for the jobs not begun yet, once a handler ended the
        group's transaction (_tx_ended_by): committed perhaps, they are deleted at once, and those jobs record
        their keys again in the group they run in."""
        waiting = [ex for ex in group.waiting if ex.key_recorded or ex.stale_record]
        for ex in waiting:
            ex.key_recorded = False
            ex.stale_record = True  # until the deletion is done: the database may be gone (_delete_stale)
        self._delete_stale(waiting)

    def _delete_stale(self, jobs: list[Execution]) -> None:
        """Delete the records that may have committed for jobs that never ran (``stale_record``), outside any
        transaction (the connection is idle): done at once, whatever the group they run in does next. Else,
        run again, they would find their own record and settle as hits, their handlers never run. The mark
        lives in this process only: if it exits before the database is back, or another worker claims such
        a job when its lease ends, that job is settled as a hit. It takes a handler that sends COMMIT
        through ctx.tx and an outage at that very moment."""
        stale = [ex for ex in jobs if ex.stale_record]
        if stale:
            if self.conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                self._rollback()  # nothing of these jobs' group has begun: what is open is left over
            ids = array_literal([ex.job["id"] for ex in stale]).encode()
            self._raw(fill(UNRECORD_GROUP_KEYS, {b"ids": b"'" + ids + b"'"}))
            for ex in stale:
                ex.stale_record = False

    def _forget_key(self, ex: Execution, rollback_to: bytes | None) -> None:
        """A grouped job failed: roll back to its savepoint, if it opened one, and delete the record its
        group wrote for it (not in its savepoint), in one round trip."""
        sql = [b"ROLLBACK TO SAVEPOINT " + rollback_to] if rollback_to else []
        if ex.key_recorded:
            conn = self.conn
            quote = psycopg.pq.Escaping(conn.pgconn).escape_literal
            key = quote(ex.job["idempotency_key"].encode(conn.info.encoding))
            sql.append(fill(FORGET_GROUP_KEY, {b"key": key, b"job_id": quote(str(ex.job["id"]).encode())}))
            ex.key_recorded = False
        if sql:
            self._raw(b"; ".join(sql))

    def _open_with_key(self, savepoint: bytes, ex: Execution) -> bool:
        """The job's savepoint and its idempotency record in one round trip, the record's values quoted by
        libpq (queries.sql ``record_group_key``). True: recorded; False: the key was processed already."""
        conn = self.conn
        job, enc = ex.job, conn.info.encoding
        quote = psycopg.pq.Escaping(conn.pgconn).escape_literal
        record = fill(
            RECORD_GROUP_KEY,
            {
                b"key": quote(job["idempotency_key"].encode(enc)),
                b"job_id": quote(str(job["id"]).encode()),
                b"job_type": quote(job["job_type"].encode(enc)),
                b"now": quote(self.w.clock.now().isoformat().encode()),
                b"retention_seconds": repr(float(self.w.config.idempotency_retention_seconds)).encode(),
            },
        )
        begin = b"BEGIN; " if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE else b""
        sql = begin + self._in_group_reset(cast(JobConnection, conn)) + b"SAVEPOINT " + savepoint + b"; " + record
        return self._raw(sql, psycopg.pq.ExecStatus.TUPLES_OK) == 1

    def _run_grouped(self, ex: Execution, group: Group, n: int) -> None:
        w, job, ctx = self.w, ex.job, ex.ctx
        with w._exec_lock:  # from here a pause no longer holds it (Worker._hold_paused)
            ex.begun = True
        ex.started = time.monotonic()
        if ctx.cancelled:  # killed, lease lost, paused or shutting down while it waited in the prefetch buffer
            self._forget_key(ex, None)
            group.failed.append((ex, self._cancel_exc(ex)))
            return
        task = w.registry.get(job["job_type"])
        assert task is not None  # groupable
        latency_ms = max(0.0, (w.clock.now() - job["scheduled_at"]).total_seconds() * 1000)
        ex.start_counts = {"started": 1, "latency_ms_sum": latency_ms}  # counted once it is known no hit
        savepoint = f"job{n}".encode()
        opened = False

        def open_savepoint() -> None:
            nonlocal opened
            if ex.abandoned:  # its connection was taken away: nothing it does may reach the database
                raise psycopg.OperationalError("the job was abandoned after its timeout")
            conn = self.conn
            if ex.abandoned:  # while it connected: the watchdog found no connection to take away
                raise psycopg.OperationalError("the job was abandoned after its timeout")
            ctx.tx = conn
            if not opened:
                if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                    self._raw(b"BEGIN; SAVEPOINT " + savepoint)
                else:
                    self._raw(self._in_group_reset(cast(JobConnection, conn)) + b"SAVEPOINT " + savepoint)
                opened = True

        try:
            if ex.key_hit:  # found processed by the group's first statement
                ex.hit = True
                group.effects.append(ex)
                return
            if job["idempotency_key"] and not ex.key_recorded:
                # blocks while another job holding the same key is in its transaction: one effect, ever
                opened = True  # in the round trip that records the key, before it: rolled back to if need be
                with self._waiting_for_key(ex, self.conn):
                    recorded = self._open_with_key(savepoint, ex)
                if not recorded:
                    ex.hit = True
                    group.effects.append(ex)
                    return
            self._count_start(ex)
            # the handler's first use of ctx.tx opens its savepoint (and the slot's connection, if need be)
            ctx._on_tx = open_savepoint
            self.tx_ended = self.tx_committed = False
            try:
                self._call_sync(ex, task)
            except HandlerFailure as f:
                # it raised what its lost connection gave it: an outage (a restart, a failover) is nobody's
                # failure, the group is given back whole (run_group), this job too
                pinned = self._pinned
                if pinned is not None and _is_db_error(f.exc) and not self.tx_ended:
                    cause = _lost_under_handler(pinned)
                    if cause is not None and not _ended_by_job(cause):
                        raise self._lost_under(ex, cause, f.exc) from f.exc
                raise
            pinned = self._pinned
            cause = None if pinned is None else _lost_under_handler(pinned)
            if cause is not None:
                raise self._lost_under(ex, cause)
            status = self.conn.pgconn.transaction_status if opened else None
            if self.tx_ended or status == psycopg.pq.TransactionStatus.IDLE:
                raise TxEnded()
            if status == psycopg.pq.TransactionStatus.INERROR:
                raise HandlerFailure(_swallowed_error())
        except HandlerFailure as f:
            if self.tx_ended:  # it ended the transaction, then failed: its savepoint is gone with the rest
                raise TxEnded() from None
            ex.ended = time.monotonic()
            try:
                if _is_db_error(f.exc) and self._group_connection_lost():
                    raise psycopg.OperationalError(GROUP_CONNECTION_LOST) from f.exc
                self._forget_key(ex, savepoint if opened else None)  # finds a lost connection lost
            except psycopg.OperationalError:
                # the group's connection went while this handler ran, by its own doing (an
                # idle_in_transaction_session_timeout during a slow call: _lost_under), or an outage given
                # back too often: the group is given back, the others uncharged; this one is charged, as a
                # job alone is (else it ran again for ever, never dead-lettered)
                group.failed.append((ex, f.exc))
                raise
            group.failed.append((ex, f.exc))
            return
        ex.ended = time.monotonic()
        if opened or ex.key_recorded:
            group.effects.append(ex)
            return
        # nothing to commit with it: the completer settles it with others in one statement
        self._to_completer(ex)
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
            params = {**settle_many_params(w, effects), "lock_wait": _lock_wait(effects)}
            try:
                rows = conn.execute(queries["settle_group"], params).fetchall()
            except psycopg.errors.LockNotAvailable:
                self._held_up(group)
                return
            if len(rows) < len(effects):
                # a job was killed since the last beat, or a lease was lost (the worker could not heartbeat
                # for a whole visibility timeout): the group commits nothing; a killed job is settled
                # cancelled, the jobs still held run again, the others belong to another worker
                conn.rollback()
                held = {r["id"] for r in rows}
                for ex in effects:
                    if ex.job["id"] not in held:
                        try:
                            self.settle_refused(ex)
                        finally:
                            w._done(ex)
                group.effects = [ex for ex in effects if ex.job["id"] in held]
                self._give_back_group(group)
                return
            self._commit(cast(JobConnection, conn))
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
            except Exception:  # the others are settled all the same; this one's lease brings it back
                ex.ctx.logger.exception("could not settle the job's failure")
            finally:
                self._finish(ex, ex.started)
                self._leave(group, [ex])

    def _held_up(self, group: Group) -> None:
        """The group's settlement waited its bound for a job's row another transaction holds (an operator's
        open transaction, say): the group is rolled back, nothing of it committed (its effects and records
        are gone: run again, they happen once), and its jobs are given back uncharged, those whose rows are
        free first. A held one is given back once its row is free, waiting for it a bound at a time; still
        held when its lease would have run out, it is left to its lease (README, "Leases"). Waiting instead
        for as long as the other transaction stayed open held the slot, the group's idempotency records (a
        job with one of those keys waited too) and the rows its handlers wrote."""
        self._rollback()
        jobs = [*group.effects, *(ex for ex, _ in group.failed)]
        lock_wait = _lock_wait(jobs)
        ids = array_literal([ex.job["id"] for ex in jobs])
        try:
            with self.conn.transaction():
                held = {r["id"] for r in self.conn.execute(queries["rows_held_elsewhere"], {"ids": ids})}
        except psycopg.Error:
            self.reset()
            held = set()
        self.w.log.warning(
            "a group's settlement waited %s ms for a row another transaction holds (%s): rolled back, its %s"
            " job(s) given back", lock_wait, ", ".join(sorted(map(str, held))) or "free by now", len(jobs),
        )  # fmt: skip
        group.effects.sort(key=lambda ex: ex.job["id"] in held)  # the free ones first: the others wait
        group.failed.sort(key=lambda f: f[0].job["id"] in held)
        self._lock_wait = lock_wait
        try:
            self._give_back_group(group)
        finally:
            self._lock_wait = None

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

    def _to_completer(self, ex: Execution) -> None:
        """A success with no effect: the completer settles it, and counts it once its fenced settlement
        went through (a job meanwhile killed or reclaimed is not a success of this worker). Its lock_key lease
        is held until then, and the completer releases it: released as its handler returned, it let another job
        with the key run while this one's outcome was still unwritten (its settlement held up by a row lock or
        failing, and in the end perhaps not a success: killed, or run again after the other)."""
        ex.outcome = {}
        ex.settling = True
        self.w.completer.add(ex)

    def _succeeded(self, ex: Execution, idempotency_hit: bool) -> None:
        if idempotency_hit:
            ex.hit = True
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
            with self._waiting_for_key(ex, conn):
                recorded = conn.execute(queries["record_processed_key"], self._idempotency_params(ex)).fetchone()
            if recorded is None:
                if conn.execute(queries["settle_succeeded"], self._fence(ex)).fetchone() is None:
                    raise LeaseLost()
                conn.commit()
                self._succeeded(ex, idempotency_hit=True)
                return
        self._count_start(ex)
        ex.ctx.tx = conn
        ex.ctx._on_tx = lambda: self._begin_for_handler(conn)
        self.tx_ended = False
        try:
            self._call_sync(ex, task)
        except HandlerFailure as f:
            if self.tx_ended:  # what it wrote before its COMMIT stays; a retry would be a hit, losing the rest
                raise HandlerFailure(_tx_ended_error()) from None
            if _is_db_error(f.exc) and (ex.ctx.tx_used or job["idempotency_key"]):
                # it raised what its lost connection gave it: an outage is not its failure
                cause = _lost_under_handler(conn)
                if cause is not None and not _ended_by_job(cause):
                    raise self._lost_under(ex, cause, f.exc) from f.exc
            raise
        if self.tx_ended:
            raise HandlerFailure(_tx_ended_error())
        cause = _lost_under_handler(conn) if ex.ctx.tx_used or job["idempotency_key"] else None
        if cause is not None:
            raise self._lost_under(ex, cause)
        if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            raise HandlerFailure(_swallowed_error())
        if not ex.ctx.tx_used and not job["idempotency_key"]:
            # no effect to commit with it: the completer settles it with others in one statement
            self._to_completer(ex)
            return
        if ex.lock is not None and not self._lock_held_to_commit(ex):
            raise HandlerFailure(Cancelled("lock_lost"))
        if conn.execute(queries["settle_succeeded"], self._fence(ex)).fetchone() is None:
            raise LeaseLost()
        self._commit(cast(JobConnection, conn))
        self._succeeded(ex, idempotency_hit=False)

    @contextlib.contextmanager
    def _waiting_for_key(self, ex: Execution, conn: db.Conn | db.AsyncConn) -> Iterator[None]:
        """The wait for a job's idempotency key, which has no end of its own (the job holding the key may run
        for its whole timeout, or belong to a frozen worker): a kill or a shutdown cancels it
        (Worker._watchdog_tick), and the job ends as a job cancelled before it started: its handler never
        runs (it ran, after the wait, though killed), a stopping worker releases it (it stayed running, held
        by a stopped worker for a whole lease)."""
        with self.w._exec_lock:
            ex.key_wait = conn
        try:
            yield
        except psycopg.errors.QueryCanceled:
            if ex.ctx.cancelled:
                raise HandlerFailure(self._cancel_exc(ex)) from None
            raise
        finally:
            with self.w._exec_lock:
                ex.key_wait = None
        if ex.ctx.cancelled:
            raise HandlerFailure(self._cancel_exc(ex))

    @contextlib.contextmanager
    def _waiting_for_keys(self, jobs: list[Execution], conn: db.Conn) -> Iterator[None]:
        """_waiting_for_key for a group's first statement, which records the keys of all its jobs: a kill of
        one of them, or a shutdown, cancels the wait, and the group is given back (KeyWaitCancelled), its
        cancelled jobs then ending as cancelled or released, the others waiting again in a new group."""
        with self.w._exec_lock:
            for ex in jobs:
                ex.key_wait = conn
        try:
            yield
        except psycopg.errors.QueryCanceled:
            if any(ex.ctx.cancelled for ex in jobs):
                raise KeyWaitCancelled() from None
            raise
        finally:
            with self.w._exec_lock:
                for ex in jobs:
                    ex.key_wait = None

    def _forget_lock(self, key: str, token: str) -> None:
        """After an acquire that raised: its answer may be what was lost (the lease taken, the reply late),
        and a lease no one knows the token of would hold the key for a whole lease. Released by its token
        (fenced: never another holder's), at best."""
        try:
            self.w.locks.release(self.conn, key, token)
        except Exception:
            self.reset()  # the backend is down: the lease, if it was taken, runs out by itself

    def _charged_for_lock_backend(self, ex: Execution, e: BaseException) -> bool:
        """A lock backend error around a job (an acquire or the check before its commit that raised, not a
        lock another job holds): given back uncharged a few times, as a database error around a job is
        (Slot.execute), then charged, retried under its policy and in the end dead-lettered, its error
        recorded. Each time taken for contention or a lost lock, it ran again for ever, never charged nor
        recorded (a Redis refusing scripts or writes). True: settled here."""
        times = self.w.given_back_for_errors(ex.job["id"])
        if times <= MAX_UNCHARGED_GIVE_BACKS:
            return False
        why = db.redact(str(e).strip(), self.w.dsn)
        ex.ctx.logger.warning("lock backend failed around the job, %d times: charged (%s)", times, why)
        self.settle_failure(ex, TransientError(f"lock backend failed: {why}"))
        return True

    def _lock_held_to_commit(self, ex: Execution) -> bool:
        """A job with a lock_key commits its effect only if it still holds the lock: its lease may have run out
        and another job taken it since the last heartbeat (a stalled process). Extended in the job's own
        transaction (the PostgreSQL backend), the lock's row stays locked until the commit: a job taking the
        lock meanwhile waits for that commit, then finds the lease extended. A lock it cannot prove it holds
        (the backend unreachable) counts as lost: the job is rolled back and runs again."""
        assert ex.lock is not None
        key, token = ex.lock
        try:
            held = self.w.locks.extend(self.conn, key, token, lease_seconds(ex.job["visibility_timeout_seconds"]))
        except psycopg.Error:
            # the PostgreSQL backend, in the job's transaction: an error there is the transaction's (a handler
            # that set a search_path or made it read-only, or an outage), judged as any error at its settlement
            # is (Slot.execute). Taken for a lost lock, it gave the job back uncharged, for ever
            raise
        except Exception as e:
            ex.ctx.logger.warning("could not check lock %s before the commit: %s", key, db.redact(str(e), self.w.dsn))
            return self._lock_unchecked(ex, e)
        return held

    def _lock_unchecked(self, ex: Execution, e: BaseException) -> bool:
        """The lock backend raised at the check before the commit: counted as a lost lock (the job rolled back
        and given back); a refusal of the backend's, a few times, then the job's failure
        (_charged_for_lock_backend)."""
        if self.w.locks.refused(e) and self.w.given_back_for_errors(ex.job["id"]) > MAX_UNCHARGED_GIVE_BACKS:
            why = db.redact(str(e).strip(), self.w.dsn)
            raise HandlerFailure(TransientError(f"lock backend failed before the commit: {why}"))
        return False

    async def _alock_held_to_commit(self, ex: Execution, aconn: db.AsyncConn) -> bool:
        """_lock_held_to_commit for an async job: in its own transaction too, with the PostgreSQL backend."""
        assert ex.lock is not None
        key, token = ex.lock
        ttl = lease_seconds(ex.job["visibility_timeout_seconds"])
        try:
            if isinstance(self.w.locks, PostgresLocks):
                params = {"key": key, "token": token, "ttl": ttl, "now": self.w.clock.now()}
                return await (await aconn.execute(queries["lock_extend"], params)).fetchone() is not None
            return self.w.locks.extend(self.conn, key, token, ttl)
        except psycopg.Error:
            raise  # the job's transaction's: see _lock_held_to_commit
        except Exception as e:
            ex.ctx.logger.warning("could not check lock %s before the commit: %s", key, db.redact(str(e), self.w.dsn))
            return self._lock_unchecked(ex, e)

    def _lost_under(self, ex: Execution, cause: str, raised: BaseException | None = None) -> BaseException:
        """What a job whose connection was lost while its handler ran fails with (``cause``: see
        _lost_under_handler; ``raised``: what the handler raised, if it raised what that gave it). Its session
        ended for something it did (an idle-in-transaction timeout during a slow call): its failure, charged
        (given back uncharged, it ran again for ever). Else an outage, for all the worker can tell (a
        restart, a failover, a network cut): LostUnderHandler, the job given back uncharged, its group too
        (Slot.execute, Slot.run_group); given back so more than MAX_UNCHARGED_GIVE_BACKS times in this
        worker, charged (a handler that ends its own session as an outage would ran again for ever)."""
        why = f"{LOST_UNDER_HANDLER} (SQLSTATE {cause})" if cause else LOST_UNDER_HANDLER
        if _ended_by_job(cause):
            return HandlerFailure(raised or psycopg.OperationalError(why))
        times = self.w.given_back_for_errors(ex.job["id"])
        if times > MAX_UNCHARGED_GIVE_BACKS:
            ex.ctx.logger.warning("%s, %d times: charged", why, times)
            return HandlerFailure(raised or psycopg.OperationalError(why))
        return LostUnderHandler(why)

    def _begin_handler(self, ex: Execution, grace_margin: float = 0.0) -> None:
        """From here the watchdog enforces the job's timeout (see Worker._watchdog_main)."""
        ex.slot = self
        ex.cancel_seen = None
        ex.grace_margin = grace_margin
        ex.deadline = time.monotonic() + ex.job["timeout_seconds"]

    def _end_handler(self, ex: Execution) -> None:
        self.handler_running = False
        ex.handler_ran = True
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
        self.handler_running = True
        try:
            result = task.fn(ctx, ex.job["payload"])
            if inspect.isawaitable(result):
                # a sync wrapper that returns what an async def gave it: nothing of it ran (the coroutine
                # never started). The job is given back, uncharged, and the type runs as async from now on
                _drop(result)
                task.found_async()
                raise Cancelled(FOUND_ASYNC)
        except BaseException as e:  # SystemExit, KeyboardInterrupt, MemoryError... all belong to the job
            error = e
        self._end_handler(ex)
        # told to stop, a handler that stops by raising (``if ctx.wait_cancelled(...): raise ...``, the usual
        # way) stops for that reason, as one that returns: given back uncharged at a shutdown, a timeout
        # counted as one (its own error was charged, and dead-lettered a job on its last attempt)
        if ctx.cancelled and not (isinstance(error, Cancelled) and error.reason == FOUND_ASYNC):
            raise HandlerFailure(self._cancel_exc(ex))
        if error is not None:
            raise HandlerFailure(error)

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
        try:
            loop.run_until_complete(self._async_job(ex, task))
        except (HandlerFailure, LeaseLost, psycopg.Error):
            raise
        except BaseException as e:  # a SystemExit escaping a task surfaces here
            aconn = self._aconn
            if aconn is not None:
                # its transaction (the job's writes, its idempotency record) ends now, not whenever the
                # garbage collector gets to the connection: the job's next attempt waited on its own key
                with contextlib.suppress(Exception):
                    aconn.pgconn.finish()
            self._loop = None
            self._aconn = None
            raise HandlerFailure(e) from None
        finally:
            self.async_job = None  # from here, a task of this job that uses ctx.tx is refused
            if self._loop is not loop:
                loop.close()  # dropped (see _forsake_loop): what is still pending in it never runs
            self._end_handler(ex)

    async def _async_job(self, ex: Execution, task: Task) -> None:
        if self._aconn is None or self._aconn.closed or self._aconn.broken:
            name = self.w.config.application_name
            opened = await db.aconnect(self.w.dsn, application_name=name, cls=AsyncJobConnection)
            cast(AsyncJobConnection, opened).slot = self
            opened.add_notice_handler(_on_fatal(cast(AsyncJobConnection, opened)))
            opened.cursor_factory = AsyncJobCursor
            cast(AsyncJobConnection, opened).backend_pid = opened.info.backend_pid
            self._aconn = opened
        aconn = self._aconn
        if cast(AsyncJobConnection, aconn).handler_used:
            self._reset_session(cast(AsyncJobConnection, aconn))
        if self.idle_bound_ms > cast(AsyncJobConnection, aconn).idle_bound_ms:
            self._bound_idle(cast(AsyncJobConnection, aconn))
        job, ctx = ex.job, ex.ctx
        try:
            if job["idempotency_key"]:
                with self._waiting_for_key(ex, aconn):
                    cur = await aconn.execute(queries["record_processed_key"], self._idempotency_params(ex))
                if await cur.fetchone() is None:
                    cur = await aconn.execute(queries["settle_succeeded"], self._fence(ex))
                    if await cur.fetchone() is None:
                        raise LeaseLost()
                    await aconn.commit()
                    self._succeeded(ex, idempotency_hit=True)
                    return
            self._count_start(ex)
            ctx.tx = aconn
            ctx._on_tx = lambda: self._begin_for_handler(aconn)
            self.tx_ended = False
            # from here, not before: its wait on the key's row (another job holding it) is no handler time,
            # as for sync jobs. The job cancels its own handler at the timeout; the watchdog only steps in
            # if the loop is stuck
            self._begin_handler(ex, ASYNC_GRACE_MARGIN)
            self.handler_running = True  # ctx.tx is the handler's until it is done (AsyncJobConnection)
            try:
                self.async_job = ex
                owner = _HANDLER_OF.set(ex)  # the handler's task, and every task it starts, belong to ex
                try:
                    result = task.fn(ctx, job["payload"])
                    handler = asyncio.ensure_future(result if asyncio.iscoroutine(result) else _settled(result))
                finally:
                    _HANDLER_OF.reset(owner)
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
            finally:
                self.handler_running = False
            if handler.done():
                # its timeout is over with it: its settlement and COMMIT (a deferred trigger, a standby that
                # lags) are no handler time, as for sync jobs. The watchdog abandoned the slot in the
                # middle of that COMMIT, and the job failed as a timeout, attempt after attempt
                with self.w._exec_lock:
                    if not ex.abandoned:
                        ex.deadline = None
            if not handler.done():
                self._forsake_loop(aconn)
            elif not handler.cancelled():
                # retrieved, whatever the verdict: else the task, collected, logs "Task exception was never
                # retrieved" from whichever thread the garbage collector runs on, in the middle of its work
                handler.exception()
            if self.tx_ended:  # before its own verdict: see _run_sync
                raise HandlerFailure(_tx_ended_error())
            if ctx.cancelled:
                raise HandlerFailure(self._cancel_exc(ex))
            if handler.cancelled():
                # nobody cancelled the job: its task ended cancelled of itself (it awaited a future another
                # task cancelled, or raised CancelledError): not a success, nothing of it commits
                raise HandlerFailure(asyncio.CancelledError("the handler's task ended cancelled"))
            failure = handler.exception()
            cause = None
            if (ctx.tx_used or job["idempotency_key"]) and (failure is None or _is_db_error(failure)):
                # under the connection's lock: a statement one of its tasks still has in flight gets its
                # reply first (read here, it would be taken from under that statement, which then waits
                # for ever)
                async with aconn.lock:
                    cause = _lost_under_handler(aconn)
            if failure is not None:
                if cause is not None and not _ended_by_job(cause):
                    # it raised what its lost connection gave it: an outage is not its failure
                    raise self._lost_under(ex, cause, failure) from failure
                raise HandlerFailure(failure)
            if cause is not None:
                raise self._lost_under(ex, cause)
            if aconn.pgconn.transaction_status == psycopg.pq.TransactionStatus.INERROR:
                raise HandlerFailure(_swallowed_error())
            if not ctx.tx_used and not job["idempotency_key"]:
                # nothing to commit with it: the completer settles it with others, as for sync handlers
                self._to_completer(ex)
                return
            if ex.lock is not None and not await self._alock_held_to_commit(ex, aconn):
                raise HandlerFailure(Cancelled("lock_lost"))
            cur = await aconn.execute(queries["settle_succeeded"], self._fence(ex))
            if await cur.fetchone() is None:
                raise LeaseLost()
            await self._acommit(aconn)
            self._succeeded(ex, idempotency_hit=False)
        except BaseException:
            if not aconn.closed:
                try:
                    await aconn.rollback()
                except psycopg.Error:
                    await aconn.close()
            raise

    def _forsake_loop(self, aconn: db.AsyncConn) -> None:
        """The handler swallowed its cancellation and is still a task of this slot's event loop, holding
        ``ctx.tx``: run again, the loop would resume it inside the next async job, its writes in that job's
        transaction. The loop is dropped (the task never runs again) and the connection closed at once."""
        with contextlib.suppress(Exception):
            aconn.pgconn.finish()
        self._aconn = None
        self._loop = None
        self.w.log.warning("an async handler ignored its cancellation: its event loop and connection are dropped")

    # settling failures -------------------------------------------------------------------

    def give_back(self, ex: Execution) -> None:
        """A job cancelled before it began (a pause, a stop: Worker._give_back_queued), from outside the
        slots: released as a slot would release it."""
        assert ex.ctx.cancel_reason is not None
        self._after_failure(ex, Cancelled(ex.ctx.cancel_reason))

    def _after_failure(self, ex: Execution, exc: BaseException) -> None:
        if isinstance(exc, Cancelled):
            if exc.reason == "lease_lost":
                ex.ctx.logger.warning("lease lost while running: rolled back, not settled")
                return
            if exc.reason == "shutdown":
                # said once it is: a release the database did not take is said by _write, and at the stop's end
                if self.release(ex, 0.0):
                    ex.ctx.logger.info("worker shutting down: job released")
                return
            if exc.reason == FOUND_ASYNC:
                ex.ctx.logger.info("the handler returned a coroutine: job released, it runs as async from now on")
                self.release(ex, 0.0)
                return
            if exc.reason == "paused":
                ex.ctx.logger.info("its queue was paused before it started: job released")
                self.release(ex, 0.0)
                return
            if exc.reason == "held":
                ex.ctx.logger.info("a limit of 0 holds its type, set before it started: job released")
                self.release(ex, 0.0)
                return
            if exc.reason == "lock_lost":
                # what it did without the lock was rolled back; it runs again, its attempt given back
                delay = self.w.config.lock_contention_delay * random.uniform(0.8, 1.5)
                ex.ctx.logger.warning("lost its lock %s while running: rolled back, again in %.1fs", ex.job["lock_key"],
                                      delay)  # fmt: skip
                self.w.metrics.add(ex.job["queue"], ex.job["job_type"], "lock_contention")
                # a --burst worker waits for it, as for a contended one: it is due again in a moment
                self.w._burst_hold_until = max(self.w._burst_hold_until, time.monotonic() + delay)
                self.release(ex, delay)
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
            # an exception group's leaves each ask for their retry_in, or the policy's delay: the longest
            asked = [_retry_in(leaf) for leaf in leaves(exc)]
            policy_delay = self._policy_delay(ex, attempt) if None in asked else 0.0
            delay = max(policy_delay if d is None else d for d in asked)
            scheduled_at = now + dt.timedelta(seconds=delay)
        cls = type(exc).__name__
        message = _error_message(exc)
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
        row = self._write(queries["settle_error"], params, ex)
        if not row:
            return None
        if row["state"] != state:  # killed meanwhile: not retried, not dead-lettered
            state, scheduled_at = row["state"], None
            ctx.logger.info("killed while it ran: cancelled")
        if scheduled_at is not None:
            w.comes_due((scheduled_at - now).total_seconds())
        q, jt = job["queue"], job["job_type"]
        if kind == "timeout":
            w.metrics.add(q, jt, "timeouts")
        if kind == "unknown":
            w.metrics.add(q, jt, "anomalies")
        w.metrics.add(q, jt, {"retry_scheduled": "retried", "cancelled": "cancelled"}.get(state, state))
        log = ctx.logger.warning if state == "retry_scheduled" else ctx.logger.error
        log("%s (%s error): %s: %s", state, kind, cls, message, extra={"next_run_at": scheduled_at})
        return state

    @staticmethod
    def _policy_delay(ex: Execution, attempt: int) -> float:
        """The job's retry policy's delay after ``attempt``. Claims return the policy as text: decoded only
        here, on the failure path. One this worker cannot read (written by SQL, another producer, a later
        version with a field of its own) gives the default policy's delay, said in the job's log: raising
        here lost the settlement, and the job, running for no one until its lease ran out, was taken for a
        crash (a lease expiration, then a poison pill) with its real error never recorded."""
        stored = ex.job["retry_policy"]
        try:
            policy = json.loads(stored) if isinstance(stored, str) else stored
            delay = float(RetryPolicy.from_json(policy).delay(attempt))
            if not 0 <= delay <= MAX_RETRY_IN_SECONDS:  # NaN too
                raise ValueError(f"a delay of {delay} s")
            return delay
        except Exception as e:
            ex.ctx.logger.warning("retry policy %r unreadable (%s): the default policy's delay", stored, e)
            return float(RetryPolicy().delay(attempt))

    def settle_refused(self, ex: Execution) -> None:
        """A job's success was refused it (its effects rolled back): an operator killed it since the worker
        last looked (settle_succeeded refuses a killed job: the kill is final), and it is settled cancelled
        now, fenced; or another worker holds it (its lease ran out), and that fence refuses this too."""
        if self.settle_failure(ex, Cancelled("killed")) is None and not ex.settled_here:
            ex.ctx.logger.warning("lease lost to another worker: rolled back, not settled")

    def release(self, ex: Execution, delay: float) -> bool:
        """Give ``ex`` back, its attempt not counted, due in ``delay`` seconds; whether it was (not: refused,
        then settled cancelled if an operator killed it; or the database did not take it, left to its lease)."""
        params = {**self._fence(ex), "scheduled_at": self.w.clock.now() + dt.timedelta(seconds=delay)}
        written = self._write(queries["release_job"], params, ex)
        if written:
            self.w.comes_due(delay)
            return True
        elif written is False and not ex.settled_here:
            # refused: another worker holds the job, or an operator killed it before this worker saw the
            # flag (a shutdown shorter than a heartbeat). A killed job must never run again: settle it
            # cancelled (fenced too, so a job another worker holds is left alone)
            self.settle_failure(ex, Cancelled("killed"))
        return False

    def _settled_here(self, ex: Execution) -> bool:
        """Whether ``ex``'s row says it was settled succeeded by this worker at its attempt (queries.sql
        ``settled_here``), in _write's transaction."""
        return self.conn.execute(queries["settled_here"], settle_many_params(self.w, [ex])).fetchone() is not None

    def _lost_answer(self, ex: Execution) -> None:
        """``ex`` succeeded: its settlement committed, its answer lost with the connection. Counted once, as
        its answer would have counted it (its slot's _finish adds ex.outcome: the job's own path, the group's
        give-back), and said as what it is: neither a lease lost nor a release."""
        ex.settled_here = True
        self._succeeded(ex, idempotency_hit=ex.hit)
        ex.ctx.logger.info("its settlement had committed (the answer was lost with the connection): succeeded")

    def _write(self, query: str, params: dict[str, Any], ex: Execution) -> dict[str, Any] | Literal[False] | None:
        """A fenced settlement, retried through a database outage until the job's lease would have run out
        (after that another worker owns the job and the fence would refuse us anyway). The row it returned:
        written; False: refused by the fence; None: the database could not be reached."""
        # a group's jobs after one that could not be written get one try each, not a lease's worth of
        # retries each (their leases expire and another worker takes them)
        # and a stopping worker's, until its grace periods are over (Worker.settle_deadline), read again at each
        # try: a stop that began meanwhile bounds it too
        deadline = 0.0 if self._unreachable else time.monotonic() + ex.job["visibility_timeout_seconds"]
        backoff = 0.1
        lock_wait = self._lock_wait
        while True:
            try:
                with self.conn.transaction():
                    if lock_wait is not None:
                        self.conn.execute(queries["bound_lock_wait"], {"lock_wait": lock_wait})
                    row = self.conn.execute(query, params).fetchone()
                    own = row is None and self._settled_here(ex)
                if own:
                    # our own success, committed by a COMMIT whose answer was lost (the group's, the job's):
                    # not taken over by anyone; counted now, as its answer would have been
                    self.w.settled(ex)
                    self._lost_answer(ex)
                    return False
                if row is None:
                    ex.ctx.logger.warning("job no longer held by this worker: not settled")
                    return False
                self.w.settled(ex)
                return row
            except psycopg.Error as e:
                until = min(deadline, self.w.settle_deadline())
                if lock_wait is not None and isinstance(e, psycopg.errors.LockNotAvailable):
                    # its row is still held (see _held_up): tried again, a bound at a time, until its lease
                    # would have run out (or the worker stops)
                    if time.monotonic() > until or self.w.stopping:
                        ex.ctx.logger.warning("its row is held by another transaction: not settled, left to its lease")
                        self.w.left_held(ex)
                        return None
                    continue
                self.reset()
                if time.monotonic() + backoff > until or not _is_db_error(e):
                    ex.ctx.logger.error("could not settle the job: %s", db.redact(str(e).strip(), self.w.dsn))
                    self._unreachable = self._unreachable or _is_db_error(e)
                    self.w.left_held(ex)
                    return None
                time.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, 5.0)
