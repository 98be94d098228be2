"""What a handler receives: ``handler(ctx, payload)``."""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from worker_core.logs import JobLogger


@dataclass
class JobContext:
    job_id: uuid.UUID
    job_type: str
    queue: str
    attempt: int
    max_attempts: int
    idempotency_key: str | None
    trace_id: str | None
    tenant_id: str | None
    worker_id: str
    #: a logger bound to the job's fields
    logger: JobLogger
    #: the job's own transaction, as ``ctx.tx``: a psycopg Connection (sync handlers) or AsyncConnection (async
    #: ones). Writes through it commit together with the idempotency record and the ``succeeded`` transition.
    _tx: Any = field(default=None, repr=False)
    #: the handler asked for ``ctx.tx``: its success must commit in that transaction
    tx_used: bool = False
    #: the worker's database, for work that must happen outside the job's transaction
    dsn: str | None = None
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    cancel_reason: str | None = None

    @property
    def tx(self) -> Any:
        self.tx_used = True
        return self._tx

    @tx.setter
    def tx(self, conn: Any) -> None:
        self._tx = conn

    @property
    def cancelled(self) -> bool:
        """True once the job was killed, its lease lost, its timeout hit or the worker is shutting down.
        A long sync handler should check it between steps and return."""
        return self._cancel.is_set()

    def cancel(self, reason: str) -> None:
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds, waking early when cancelled. Returns ``cancelled``."""
        return self._cancel.wait(timeout)
