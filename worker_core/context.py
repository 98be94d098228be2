"""What a handler receives: ``handler(ctx, payload)``.

``ctx.tx`` is typed by the context's parameter: ``JobContext`` (a sync handler's) gives a psycopg
``Connection``, ``AsyncJobContext`` (``JobContext[psycopg.AsyncConnection[dict[str, Any]]]``, an async
handler's) an ``AsyncConnection``; their rows are dicts either way."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic

import psycopg
from typing_extensions import TypeVar

from worker_core.logs import JobLogger, bound_logger

#: ``ctx.tx`` of a sync handler: the slot's connection, in the job's transaction
SyncTx = psycopg.Connection[dict[str, Any]]
#: ``ctx.tx`` of an async handler
AsyncTx = psycopg.AsyncConnection[dict[str, Any]]
#: what ``ctx.tx`` is: a bare ``JobContext`` is a sync handler's
TxT = TypeVar("TxT", bound=SyncTx | AsyncTx, default=SyncTx)

#: guards the lazy creation of a context's cancel event against a concurrent ``cancel``
_CANCEL_LOCK = threading.Lock()


@dataclass(eq=False)
class JobContext(Generic[TxT]):
    job_id: uuid.UUID
    job_type: str
    queue: str
    attempt: int
    max_attempts: int
    idempotency_key: str | None
    trace_id: str | None
    tenant_id: str | None
    worker_id: str
    #: builds the logger bound to the job's fields, on first use of ``ctx.logger`` (most jobs never log)
    _make_logger: Callable[[], JobLogger] = field(repr=False, default=lambda: bound_logger("worker_core.job"))
    #: the job's own transaction, as ``ctx.tx``: a psycopg Connection (sync handlers) or AsyncConnection (async
    #: ones). Writes through it commit together with the idempotency record and the ``succeeded`` transition.
    _tx: Any = field(default=None, repr=False)
    #: the handler asked for ``ctx.tx``: its success must commit in that transaction
    tx_used: bool = False
    #: the worker's database, for work that must happen outside the job's transaction
    dsn: str | None = None
    cancel_reason: str | None = None
    #: created by the first ``wait_cancelled`` only: an Event per job is measurable at thousands of jobs/s
    _cancel: threading.Event | None = field(default=None, repr=False)
    _logger: JobLogger | None = field(default=None, repr=False)
    #: called (on the worker's thread) when ``ctx.tx`` is first asked for: a grouped job opens its savepoint
    _on_tx: Callable[[], Any] | None = field(default=None, repr=False)

    @property
    def logger(self) -> JobLogger:
        """A logger bound to the job's fields (id, type, queue, attempt, trace and tenant ids)."""
        if self._logger is None:
            self._logger = self._make_logger()
        return self._logger

    @property
    def tx(self) -> TxT:
        """The job's transaction (see ``_tx``): a psycopg ``Connection`` for a sync handler, an
        ``AsyncConnection`` for an async one (annotate its ``ctx`` as ``AsyncJobContext``)."""
        if not self.tx_used:
            self.tx_used = True
            if self._on_tx is not None:
                self._on_tx()
        tx: TxT = self._tx
        return tx

    @tx.setter
    def tx(self, conn: SyncTx | AsyncTx | None) -> None:
        self._tx = conn

    @property
    def cancelled(self) -> bool:
        """True once the job was killed, its lease lost, its timeout hit or the worker is shutting down.
        A long sync handler should check it between steps and return."""
        return self.cancel_reason is not None

    def cancel(self, reason: str) -> None:
        with _CANCEL_LOCK:
            if self.cancel_reason is None:
                self.cancel_reason = reason
                if self._cancel is not None:
                    self._cancel.set()

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds, waking early when cancelled. Returns ``cancelled``."""
        with _CANCEL_LOCK:
            if self._cancel is None:
                self._cancel = threading.Event()
                if self.cancel_reason is not None:
                    self._cancel.set()
            event = self._cancel
        return event.wait(timeout)


#: what an async handler receives: ``async def h(ctx: AsyncJobContext, payload: dict[str, Any]) -> None``
AsyncJobContext = JobContext[AsyncTx]
