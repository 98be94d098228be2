"""The batch completer: one thread per worker that settles, many per statement, the successes that have
no effect to commit with them."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import uuid
from typing import TYPE_CHECKING

import psycopg

from worker_core import db
from worker_core.execution import Execution, RecurringFailure, Slot, settle_many_params
from worker_core.sql import queries

if TYPE_CHECKING:
    from worker_core.worker import Worker


class Completer:
    """Settles, in batches, the successes that have no effect to commit with them (see execution.Slot: a
    handler that never asked for ``ctx.tx``, no idempotency key).

    A job waits here a few milliseconds, as a rule; if the worker dies first, the job's lease expires and it
    runs again, which is harmless for a job that wrote nothing transactional and has no idempotency key.
    While the worker lives, the heartbeat extends the leases of the jobs waiting here (``waiting``), as of
    those running: when a settlement cannot go through for a while (a row lock it waits on, the database
    away), they were run again by another worker, or by this one, as their first run waited to be settled.
    A job whose row another transaction holds is settled with a later batch (see _flush). While its
    settlements fail, the worker claims nothing more once ``max_in_flight`` jobs wait here
    (Worker._completer_full). A job with a lock_key keeps its lock while it waits here (the heartbeat
    extends it with the job's lease), and the completer releases it once the job is settled."""

    FLUSH_SECONDS = 0.005
    MAX_BATCH = 500
    #: how soon a job whose row another transaction held locked is tried again (doubling, up to BUSY_MAX)
    BUSY_RETRY_SECONDS = 0.05
    BUSY_MAX_SECONDS = 1.0

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
        #: the batch being settled, out of _pending meanwhile
        self._flushing: list[Execution] = []
        self.flushed = 0
        #: its last settlement failed (it is backing off): the worker then claims nothing more once as many
        #: jobs wait here as it may hold in flight (Worker._completer_full)
        self.failing = False
        #: its settlements failing through an outage: said once, then once a minute, and their end
        self._failures = RecurringFailure(worker.log, "completer")

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
        return len(self._pending) + len(self._flushing)

    def waiting(self) -> list[Execution]:
        """The jobs not settled yet: the batch being settled and those waiting for the next (the heartbeat
        extends their leases)."""
        while True:
            try:  # a copy while the slots append (a deque cannot be iterated as it changes)
                return self._flushing + list(self._pending)
            except RuntimeError:
                continue

    def _connect(self) -> db.Conn:
        if self._conn is None or self._conn.closed or self._conn.broken:
            name = self.w.config.application_name
            self._conn = db.connect(self.w.dsn, application_name=name, statement_timeout_ms=db.OWN_STATEMENT_TIMEOUT_MS)
        return self._conn

    def run(self) -> None:
        backoff = 0.05
        busy_wait = self.BUSY_RETRY_SECONDS
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
                    self._flushing = batch
                    try:
                        busy = self._flush(batch)
                        self._flushing = []
                        backoff = 0.05
                        if self.failing:
                            self.failing = False
                            self._failures.succeeded()
                            self.w.completer_recovered()
                        if busy:
                            # rows another transaction holds locked: tried again with the next batch, soon
                            self._pending.extendleft(reversed(busy))
                            if self._stop.is_set() and time.monotonic() > self._give_up_at:
                                self.w.log.warning("completer: %s jobs not settled: they run again", len(self._pending))
                                return
                            time.sleep(busy_wait)
                            busy_wait = min(busy_wait * 2, self.BUSY_MAX_SECONDS)
                        else:
                            busy_wait = self.BUSY_RETRY_SECONDS
                    except Exception as e:  # the thread must live on: the batch is tried again
                        self.failing = True
                        if isinstance(e, psycopg.Error):
                            self._conn = None
                            self._failures.failed(e, db.redact(str(e).strip(), self.w.dsn), "retrying")
                        else:
                            self.w.log.exception("completer error; retrying")
                        self._pending.extendleft(reversed(batch))
                        self._flushing = []
                        if self._stop.is_set() and time.monotonic() > self._give_up_at:
                            self.w.log.warning("completer: %s jobs not settled: they run again", len(self._pending))
                            return
                        time.sleep(backoff)
                        backoff = min(backoff * 2, 5.0)
                if stopping:
                    return
        finally:
            if self._conn is not None:
                self._conn.close()
            self._exited.set()

    def _flush(self, batch: list[Execution]) -> list[Execution]:
        """Settle ``batch``; returns the jobs to try again: those whose row another transaction held locked
        (an operator's, a kill in progress). It waits on no row lock: waiting, it held the rows of its batch
        it had come to, which the heartbeat (that skips locked rows) then could not extend, up to its
        statement timeout: their leases ran out while their worker lived, and another worker ran them."""
        conn = self._connect()
        params = settle_many_params(self.w, batch)
        with conn.transaction():
            rows = conn.execute(queries["settle_succeeded_available"], params).fetchall()
            settled = {r["id"] for r in rows}
            busy_ids: set[uuid.UUID] = set()
            own: set[uuid.UUID] = set()
            if len(settled) < len(batch):
                # skipped, or no longer this worker's at this attempt (killed, taken over): still ours means
                # skipped (its row locked by another transaction)
                missing = [ex for ex in batch if ex.job["id"] not in settled]
                found = conn.execute(queries["settle_still_ours"], settle_many_params(self.w, missing))
                busy_ids = {r["id"] for r in found}
                # or settled already, by this worker at this attempt: this very batch, tried again after a
                # COMMIT whose answer was lost with the connection. Its jobs succeeded: counted now, once (the
                # try that lost the answer counted nothing), and not taken for jobs another worker took over
                gone = [ex for ex in missing if ex.job["id"] not in busy_ids]
                if gone:
                    own = {r["id"] for r in conn.execute(queries["settled_here"], settle_many_params(self.w, gone))}
        if own:
            self.w.log.info(
                "completer: %s jobs were settled by a commit whose answer was lost with the connection: counted now",
                len(own),
            )
            settled |= own
        self.flushed += len(settled)
        counts: dict[tuple[str, str], int] = {}
        refused = []
        busy = []
        for ex in batch:
            job = ex.job
            if job["id"] in settled:
                counts[(job["queue"], job["job_type"])] = counts.get((job["queue"], job["job_type"]), 0) + 1
            elif job["id"] in busy_ids:
                busy.append(ex)
            else:
                refused.append(ex)
        for (queue, job_type), n in counts.items():
            self.w.metrics.add(queue, job_type, "succeeded", n)
        if refused:  # killed since the last beat (settled cancelled), or held by another worker now
            slot = Slot(self.w, -1)
            try:
                for ex in refused:
                    try:
                        slot.settle_refused(ex)
                    except Exception:  # the batch is settled: this one's lease brings it back
                        ex.ctx.logger.exception("could not settle the killed job")
            finally:
                slot.close()
        for ex in batch:
            if ex.lock is not None and ex.job["id"] not in busy_ids:
                self._release_lock(conn, ex)
        return busy

    def _release_lock(self, conn: db.Conn, ex: Execution) -> None:
        """The lock_key lease of a job this batch settled, or that is no longer this worker's: held until
        now (the heartbeat extends it while the job waits here), so that no other job with the key ran while
        this one's outcome was not written."""
        assert ex.lock is not None
        try:
            self.w.locks.release(conn, *ex.lock)
        except Exception as e:
            why = db.redact(str(e).strip(), self.w.dsn)
            ex.ctx.logger.warning("could not release lock %s: %s (it expires by itself)", ex.lock[0], why)
