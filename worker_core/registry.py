"""Handlers register with ``@worker_core.task("invoice.generate", ...)``; sync or async, called
``handler(ctx, payload)``. The registry also gives producers the per-type defaults of the envelope."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from worker_core import policy
from worker_core.context import JobContext
from worker_core.envelope import DEFAULT_QUEUE, JOB_TYPE_RE, TypeDefaults, _number
from worker_core.models import TypeContract
from worker_core.retry import RetryPolicy

#: a handler, as ``@task`` takes it: callable as ``handler(ctx, payload)``, sync or async (its result is not
#: used). The decorator gives back the handler's own type; mypy flags one that cannot take those two.
Handler = TypeVar("Handler", bound=Callable[[JobContext[Any], Any], object])


def _is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling the handler gives a coroutine to await: an ``async def`` (a partial of one too), or an
    object whose ``__call__`` is one. Decided from what is registered, never from what it wraps: a sync
    decorator around an async def may run it itself (``asyncio.run``, asgiref's ``async_to_sync``). One
    that returns the coroutine instead is found out at its first call (execution.Slot._call_sync, which
    marks the task async). Worked out once, when the task is made (Task.is_async)."""
    if inspect.iscoroutinefunction(fn):
        return True
    if inspect.isroutine(fn) or not callable(fn):
        return False
    return inspect.iscoroutinefunction(type(fn).__call__)


class HandlerSignatureError(TypeError, ValueError):
    """A handler that cannot be called as ``handler(ctx, payload)``. A TypeError, and a ValueError as the
    registry's other refusals are (the CLI says "a task module's @task is refused" for those)."""


def _name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"functools.partial({_name(fn.func)}, ...)"
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


def check_handler(job_type: str, fn: Any) -> None:
    """Refuse, at registration, a handler the worker cannot call as ``handler(ctx, payload)``: registered, a
    ``def h(payload)`` or ``def h(ctx, *, payload)`` failed every job of its type with a TypeError, classed
    unknown, retried through its whole budget and dead-lettered. What is called is checked, not what it wraps
    (a decorator made with functools.wraps may call its function with other arguments); a callable whose
    signature cannot be read (some builtins, C extensions) is taken as it is."""
    if not callable(fn):
        raise HandlerSignatureError(f"@task({job_type!r}): the handler must be callable, not {type(fn).__name__}")
    try:
        sig = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, None)
    except TypeError as e:
        name = _name(fn)
        raise HandlerSignatureError(
            f"@task({job_type!r}): {name}{sig} cannot be called as handler(ctx, payload) ({e}): a handler takes"
            " the job's context and its payload as its first two positional parameters, def handler(ctx, payload)"
        ) from None


@dataclass(frozen=True)
class Task:
    job_type: str
    fn: Callable[..., Any]
    queue: str = DEFAULT_QUEUE
    # overrides of the deployment's policy (None: inherit); any of them needs a reason
    max_attempts: int | None = None
    timeout: float | None = None
    visibility_timeout: float | None = None
    retry: RetryPolicy | None = None
    #: the type has side effects: producers must give an idempotency_key
    requires_idempotency_key: bool = False
    #: at most this many jobs of the type run at once across every worker (None: no limit)
    concurrency: int | None = None
    #: why this type differs from the deployment's defaults
    reason: str | None = None
    _async: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_async", _is_async(self.fn))

    @property
    def is_async(self) -> bool:
        """Asked for every job the worker hands out: worked out once (_is_async)."""
        return self._async

    def found_async(self) -> None:
        """Its call returned a coroutine (a sync wrapper that returns what an async def gave it): it runs as
        async from now on."""
        object.__setattr__(self, "_async", True)

    def overrides(self) -> dict[str, Any]:
        """The policy fields this type sets itself."""
        out: dict[str, Any] = {}
        if self.max_attempts is not None:
            out["max_attempts"] = self.max_attempts
        if self.timeout is not None:
            out["timeout_seconds"] = self._seconds("timeout", self.timeout)
        if self.visibility_timeout is not None:
            out["visibility_timeout_seconds"] = self._seconds("visibility_timeout", self.visibility_timeout)
        if self.retry is not None:
            out.update(self.retry.overrides())
        return out

    def _seconds(self, name: str, value: Any) -> float:
        """A timeout as enqueue takes one: a finite number, never a bool (``float(True)`` registered a type
        whose jobs timed out after 1 s)."""
        problems: list[str] = []
        seconds = _number(problems, name, value)
        if seconds is None:
            raise ValueError(f"@task({self.job_type!r}): {problems[0]}")
        return seconds

    def layer(self) -> policy.Layer | None:
        found = self.overrides()
        return policy.Layer(f"type:{self.job_type}", found, self.reason) if found else None

    def effective(self) -> dict[str, tuple[Any, str]]:
        """The contract this type runs under: ``{field: (value, source)}``, source default/queue:*/type:*."""
        return policy.current().effective(self.queue, self.layer())

    def contract(self) -> TypeContract:
        return TypeContract(
            job_type=self.job_type,
            queue=self.queue,
            fields=self.effective(),
            reason=self.reason,
            requires_idempotency_key=self.requires_idempotency_key,
            concurrency=self.concurrency,
        )

    def defaults(self, queue: str | None = None) -> TypeDefaults:
        """The envelope's defaults in the type's queue, or in ``queue`` when a producer sends a job of the
        type elsewhere: that queue's policy, under the type's own overrides."""
        return policy.current().type_defaults(queue or self.queue, self.layer(), self.requires_idempotency_key)


class Registry:
    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}

    def register(self, task: Task) -> Task:
        if not JOB_TYPE_RE.match(task.job_type):
            raise ValueError(f"job type {task.job_type!r} must match [a-z0-9_.-]+")
        check_handler(task.job_type, task.fn)
        if task.overrides() and not (task.reason or "").strip():
            raise policy.PolicyError(
                f"@task({task.job_type!r}) overrides {', '.join(sorted(task.overrides()))} of the deployment's "
                "policy without a reason: add reason='why this type differs'"
            )
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
    max_attempts: int | None = None,
    timeout: float | None = None,
    visibility_timeout: float | None = None,
    retry: RetryPolicy | None = None,
    requires_idempotency_key: bool = False,
    concurrency: int | None = None,
    reason: str | None = None,
) -> Callable[[Handler], Handler]:
    """Register a handler ``fn(ctx, payload)`` for a job type.

    ``max_attempts``, ``timeout``, ``visibility_timeout`` and ``retry`` override the deployment's policy
    (worker_core.policy) for this type, and need a ``reason``."""

    def decorate(fn: Handler) -> Handler:
        registry.register(
            Task(
                job_type=job_type,
                fn=fn,
                queue=queue,
                max_attempts=max_attempts,
                timeout=timeout,
                visibility_timeout=visibility_timeout,
                retry=retry,
                requires_idempotency_key=requires_idempotency_key,
                concurrency=concurrency,
                reason=reason,
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
