"""worker_core: one uniform job contract on PostgreSQL. No UI code lives here."""

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
    TransientError,
)
from worker_core.models import EnqueueResult, Job, JobState
from worker_core.optimistic import VersionConflict, aversioned_update, versioned_update
from worker_core.producer import enqueue, enqueue_many
from worker_core.registry import Task, registry, task
from worker_core.retry import RetryPolicy

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
    "PermanentError",
    "ReadOnlyError",
    "RetryPolicy",
    "SingleFlightTimeout",
    "SystemClock",
    "Task",
    "TransientError",
    "VersionConflict",
    "asingle_flight",
    "aversioned_update",
    "enqueue",
    "enqueue_many",
    "registry",
    "single_flight",
    "task",
    "versioned_update",
]
