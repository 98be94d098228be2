"""Handlers register with ``@worker_core.task("invoice.generate", ...)``; sync or async, called
``handler(ctx, payload)``. The registry also gives producers the per-type defaults of the envelope."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from worker_core.envelope import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    DEFAULT_TIMEOUT_SECONDS,
    JOB_TYPE_RE,
    TypeDefaults,
)
from worker_core.retry import DEFAULT_RETRY_POLICY, RetryPolicy

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Task:
    job_type: str
    fn: Callable[..., Any]
    queue: str = DEFAULT_QUEUE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    timeout: float = DEFAULT_TIMEOUT_SECONDS
    visibility_timeout: float | None = None
    retry: RetryPolicy = DEFAULT_RETRY_POLICY
    #: the type has side effects: producers must give an idempotency_key
    requires_idempotency_key: bool = False
    #: at most this many jobs of the type run at once across every worker (None: no limit)
    concurrency: int | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def defaults(self) -> TypeDefaults:
        return TypeDefaults(
            queue=self.queue,
            max_attempts=self.max_attempts,
            timeout_seconds=self.timeout,
            visibility_timeout_seconds=self.visibility_timeout,
            retry_policy=self.retry,
            requires_idempotency_key=self.requires_idempotency_key,
        )


class Registry:
    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}

    def register(self, task: Task) -> Task:
        if not JOB_TYPE_RE.match(task.job_type):
            raise ValueError(f"job type {task.job_type!r} must match [a-z0-9_.-]+")
        if task.concurrency is not None and task.concurrency < 1:
            raise ValueError(f"job type {task.job_type!r}: concurrency must be >= 1")
        existing = self._tasks.get(task.job_type)
        if existing is not None and existing.fn is not task.fn:
            qual = getattr(existing.fn, "__qualname__", existing.fn)
            raise ValueError(f"job type {task.job_type!r} is already registered by {qual}")
        # validate the type's defaults once, at import time, not at the first enqueue
        from worker_core.envelope import build_envelope

        build_envelope(task.job_type, {}, {"idempotency_key": "x"}, task.defaults())
        self._tasks[task.job_type] = task
        return task

    def get(self, job_type: str) -> Task | None:
        return self._tasks.get(job_type)

    def __contains__(self, job_type: object) -> bool:
        return job_type in self._tasks

    def __iter__(self) -> Iterator[Task]:
        return iter(sorted(self._tasks.values(), key=lambda t: t.job_type))

    def job_types(self) -> list[str]:
        return sorted(self._tasks)

    def subset(self, job_types: Iterable[str]) -> Registry:
        out = Registry()
        for jt in job_types:
            out._tasks[jt] = self._tasks[jt]
        return out


#: the process-wide registry that @task writes to
registry = Registry()


def task(
    job_type: str,
    *,
    queue: str = DEFAULT_QUEUE,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    visibility_timeout: float | None = None,
    retry: RetryPolicy | None = None,
    requires_idempotency_key: bool = False,
    concurrency: int | None = None,
) -> Callable[[F], F]:
    """Register a handler ``fn(ctx, payload)`` for a job type."""

    def decorate(fn: F) -> F:
        registry.register(
            Task(
                job_type=job_type,
                fn=fn,
                queue=queue,
                max_attempts=max_attempts,
                timeout=timeout,
                visibility_timeout=visibility_timeout,
                retry=retry or DEFAULT_RETRY_POLICY,
                requires_idempotency_key=requires_idempotency_key,
                concurrency=concurrency,
            )
        )
        return fn

    return decorate


def import_task_modules(modules: Iterable[str]) -> list[str]:
    """Import the modules that hold @task handlers; return the job types now registered."""
    for name in modules:
        name = name.strip()
        if name:
            importlib.import_module(name)
    return registry.job_types()
