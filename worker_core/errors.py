"""Error classes of the contract.

A handler raises ``TransientError`` for "try again later" (retried with backoff within the budget) and
``PermanentError`` for "this will never work" (``failed`` at once). Anything else is *unknown*: retried
within the budget like a transient error, and counted as an anomaly.
"""

from __future__ import annotations

import builtins
import datetime as dt
import sys
from collections.abc import Sequence

if sys.version_info >= (3, 11):
    _GROUPS: tuple[type[BaseException], ...] = (builtins.BaseExceptionGroup,)
else:  # pragma: no cover - the backport, if a library brought it (anyio, trio)
    try:
        from exceptiongroup import BaseExceptionGroup as _Backport

        _GROUPS = (_Backport,)
    except ImportError:
        _GROUPS = ()


class WorkerCoreError(Exception):
    """Base of the errors worker_core raises itself."""


class EnvelopeError(WorkerCoreError, ValueError):
    """A producer gave an envelope that breaks the contract. Nothing was written."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid job envelope: " + "; ".join(problems))


class TransientError(Exception):
    """Raise from a handler: the attempt failed for a reason that may go away (network, contention)."""

    def __init__(self, message: str = "", *, retry_in: float | dt.timedelta | None = None) -> None:
        super().__init__(message)
        #: overrides the policy's delay for this retry, in seconds (or a timedelta)
        self.retry_in = retry_in


class PermanentError(Exception):
    """Raise from a handler: retrying cannot help (bad input, missing entity). The job fails at once."""


class JobTimeout(TransientError):
    """The handler ran past the job's timeout_seconds."""


class LeaseLost(WorkerCoreError):
    """The job's lease was taken over by another worker: this worker must not settle it."""


class UnknownJobType(PermanentError):
    """No handler is registered for the job's type in this worker."""


class NotFound(WorkerCoreError, LookupError):
    """No job with that id (or no limit where one was to be cleared)."""


class ReadOnlyError(WorkerCoreError):
    """An operator action was attempted in read-only mode."""


class WorkerRefused(WorkerCoreError):
    """A worker cannot run on this server as this role (:func:`worker_refusal` says why): a read-only server
    or session (a replica), or a role that may not write (or read) the queue's tables. Raised by
    ``Worker.run()`` before it starts; ``qconsole worker`` exits 1 with the same reason."""


class TableLocked(WorkerCoreError):
    """An operator action (or its audit entry) waited ``waited`` seconds (ops.ACTION_LOCK_WAIT_S) for a lock
    another session holds on a table it needs (audit_log, queues, concurrency_limits): it was not done, and
    nothing of it was written. ``holders``: the sessions holding locks on those tables, as said (pid, state,
    how long their transaction has been open, their last statement), the oldest transaction first."""

    def __init__(self, what: str, tables: Sequence[str], waited: float, holders: Sequence[str]) -> None:
        self.what = what
        self.tables = tuple(tables)
        self.holders = tuple(holders)
        held = "; ".join(self.holders) or "a session that has ended since"
        super().__init__(
            f"{what} was not done, nothing of it was written: it waited {waited:g} s for a lock on"
            f" {', '.join(self.tables)} that another session holds: {held}. End that transaction (or the session:"
            " pg_terminate_backend(pid)), or try again once it is done"
        )


class ChangedMeanwhile(WorkerCoreError, ValueError):
    """An operator action made from what was read (a limit in the console's form) found it changed since:
    nothing was done, so as not to undo another operator's change unseen."""


ERROR_KINDS = ("transient", "permanent", "unknown", "timeout", "lease_expired", "cancelled", "crash")


def is_group(exc: BaseException) -> bool:
    """Whether ``exc`` is an exception group (an ``asyncio.TaskGroup``'s, an ``except*``'s)."""
    return isinstance(exc, _GROUPS)


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, its nested groups opened; an exception that is no group:
    itself alone."""
    if not is_group(exc):
        return [exc]
    return [leaf for inner in exc.exceptions for leaf in leaves(inner)]  # type: ignore[attr-defined]


def classify(exc: BaseException) -> str:
    """The contract's error class of an exception raised by a handler. An exception group (a handler that
    fans out with ``asyncio.TaskGroup`` gets its child's error wrapped in one) is classified by its leaves:
    permanent if any of them is, a timeout if all of them are, transient if all of them are transient or
    timeouts, unknown otherwise."""
    if is_group(exc):
        kinds = {classify(leaf) for leaf in leaves(exc)}
        if "permanent" in kinds:
            return "permanent"
        if kinds == {"timeout"}:
            return "timeout"
        if kinds <= {"transient", "timeout"}:
            return "transient"
        return "unknown"
    if isinstance(exc, JobTimeout):
        return "timeout"
    if isinstance(exc, TransientError):
        return "transient"
    if isinstance(exc, PermanentError):
        return "permanent"
    return "unknown"
