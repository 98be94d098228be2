"""worker_core: one uniform job contract on PostgreSQL. No UI code lives here.

``Worker`` and ``WorkerConfig`` (worker_core.worker) are imported on first use: a producer's ``import
worker_core`` does not load the worker's machinery."""

from typing import TYPE_CHECKING, Any

from worker_core.clock import FixedClock, SystemClock
from worker_core.context import AsyncJobContext, JobContext
from worker_core.coordination import SingleFlightTimeout, asingle_flight, single_flight
from worker_core.envelope import EnvelopeFields
from worker_core.errors import (
    EnvelopeError,
    JobTimeout,
    NotFound,
    PermanentError,
    ReadOnlyError,
    TableLocked,
    TransientError,
    WorkerRefused,
)
from worker_core.models import EnqueueResult, Job, JobState
from worker_core.optimistic import VersionConflict, aversioned_update, versioned_update
from worker_core.producer import NotMigrated, aenqueue, aenqueue_many, enqueue, enqueue_many
from worker_core.registry import Task, registry, task
from worker_core.retry import RetryPolicy

if TYPE_CHECKING:
    from worker_core.worker import Worker, WorkerConfig

__all__ = [
    "AsyncJobContext",
    "EnqueueResult",
    "EnvelopeError",
    "EnvelopeFields",
    "FixedClock",
    "Job",
    "JobContext",
    "JobState",
    "JobTimeout",
    "NotFound",
    "NotMigrated",
    "PermanentError",
    "ReadOnlyError",
    "RetryPolicy",
    "SingleFlightTimeout",
    "SystemClock",
    "TableLocked",
    "Task",
    "TransientError",
    "VersionConflict",
    "Worker",
    "WorkerConfig",
    "WorkerRefused",
    "aenqueue",
    "aenqueue_many",
    "asingle_flight",
    "aversioned_update",
    "enqueue",
    "enqueue_many",
    "registry",
    "single_flight",
    "task",
    "versioned_update",
]


_LAZY = ("Worker", "WorkerConfig")


def __getattr__(name: str) -> Any:
    """``worker_core.Worker``, ``from worker_core import WorkerConfig``: imported when first asked for."""
    if name in _LAZY:
        from worker_core import worker

        value = getattr(worker, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'worker_core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
