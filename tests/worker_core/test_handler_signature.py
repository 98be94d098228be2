"""``@task`` refuses, at import, a handler the worker cannot call as ``handler(ctx, payload)``.

Accepted before, a ``def h(payload)`` failed every job of its type with ``TypeError: h() takes 1 positional
argument but 2 were given``, classed unknown, retried through its whole budget and dead-lettered (found by an
integrator's review: tests/review_integrator, commit 4e59e1c)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import worker_core
from qconsole.cli import app
from worker_core.registry import HandlerSignatureError, Registry, Task, check_handler
from worker_core.registry import registry as global_registry


@pytest.fixture
def scratch_type() -> Iterator[str]:
    """A job type of the process-wide registry, forgotten after the test whatever it registered."""
    job_type = "sig.scratch"
    try:
        yield job_type
    finally:
        global_registry._tasks.pop(job_type, None)


def test_task_refuses_a_handler_that_takes_only_the_payload(scratch_type: str) -> None:
    """The review's finding, as the README's ``@worker_core.task`` is used."""

    def one_arg(payload: dict[str, Any]) -> None:
        return None

    with pytest.raises(TypeError, match="ctx") as raised:
        worker_core.task(scratch_type)(one_arg)  # type: ignore[type-var]
    message = str(raised.value)
    assert f"@task({scratch_type!r})" in message and "one_arg(payload" in message, message
    assert "handler(ctx, payload)" in message, message
    assert scratch_type not in global_registry


def _payload_only(payload: Any) -> None: ...
def _keyword_payload(ctx: Any, *, payload: Any) -> None: ...
def _extra_required(ctx: Any, payload: Any, session: Any) -> None: ...
def _extra_keyword_required(ctx: Any, payload: Any, *, session: Any) -> None: ...
def _nothing() -> None: ...
def _keywords_only(**kwargs: Any) -> None: ...
async def _async_payload_only(payload: Any) -> None: ...


class _WrongCall:
    def __call__(self, payload: Any) -> None: ...


REFUSED: dict[str, Any] = {
    "payload only": _payload_only,
    "payload keyword-only": _keyword_payload,
    "a third required parameter": _extra_required,
    "a required keyword-only parameter": _extra_keyword_required,
    "no parameter": _nothing,
    "keywords only": _keywords_only,
    "async, payload only": _async_payload_only,
    "a callable object whose __call__ takes one": _WrongCall(),
    "a partial that binds ctx and payload already": functools.partial(_extra_required, "ctx", "payload"),
    "a lambda of one": lambda payload: None,
    "a class (its instances would be the handler)": _WrongCall,
}


@pytest.mark.parametrize("handler", REFUSED.values(), ids=REFUSED.keys())
def test_a_handler_that_cannot_take_ctx_and_payload_is_refused(handler: Any) -> None:
    registry = Registry()
    with pytest.raises(HandlerSignatureError, match=r"cannot be called as handler\(ctx, payload\)"):
        registry.register(Task("sig.refused", handler))
    assert "sig.refused" not in registry


def test_a_refused_handler_is_a_type_error_and_a_value_error_as_the_other_refusals() -> None:
    """TypeError, as Python says of a wrong call; ValueError, as the registry's other refusals (a bad job type,
    an override without a reason) are, which the CLI reports as "a task module's @task is refused"."""
    with pytest.raises(TypeError):
        check_handler("sig.x", _payload_only)
    with pytest.raises(ValueError):
        check_handler("sig.x", _payload_only)


def test_a_handler_that_is_not_callable_is_refused() -> None:
    with pytest.raises(HandlerSignatureError, match="must be callable, not str"):
        Registry().register(Task("sig.refused", "module.handler"))  # type: ignore[arg-type]


def _plain(ctx: Any, payload: Any) -> None: ...
def _defaults(ctx: Any, payload: Any = None, retries: int = 3, *, dry_run: bool = False) -> None: ...
def _star_args(*args: Any) -> None: ...
def _ctx_and_star(ctx: Any, *rest: Any, **options: Any) -> None: ...
async def _async(ctx: Any, payload: Any) -> None: ...
def _with_session(session: Any, ctx: Any, payload: Any) -> None: ...


class _Handler:
    def __call__(self, ctx: Any, payload: Any) -> None: ...

    def handle(self, ctx: Any, payload: Any) -> None: ...


class _AsyncHandler:
    async def __call__(self, ctx: Any, payload: Any) -> None: ...


def _injecting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator that hands its function one argument more: what is called takes (ctx, payload), what it
    wraps (functools.wraps' __wrapped__) does not. The call is what counts."""

    @functools.wraps(fn)
    def wrapper(ctx: Any, payload: Any) -> Any:
        return fn(ctx, payload, "session")

    return wrapper


def _passing_through(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def _unreadable(ctx: Any, payload: Any) -> None: ...


_unreadable.__signature__ = "not a signature"  # type: ignore[attr-defined]  # inspect.signature raises

ACCEPTED: dict[str, Any] = {
    "ctx, payload": _plain,
    "defaults and keyword-only ones with defaults": _defaults,
    "*args": _star_args,
    "ctx, *rest, **options": _ctx_and_star,
    "async def": _async,
    "a partial": functools.partial(_with_session, "session"),
    "a callable object": _Handler(),
    "an async callable object": _AsyncHandler(),
    "a bound method": _Handler().handle,
    "a lambda": lambda ctx, payload: None,
    "a decorator that injects an argument": _injecting(_extra_required),
    "a decorator that passes everything through": _passing_through(_plain),
    "a signature that cannot be read": _unreadable,
}


@pytest.mark.parametrize("handler", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_a_handler_callable_as_ctx_payload_is_registered(handler: Any) -> None:
    registry = Registry()
    registry.register(Task("sig.accepted", handler))
    task = registry.get("sig.accepted")
    assert task is not None and task.fn is handler


def test_the_cli_worker_names_the_refused_handler_and_exits_2(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task module with such a handler: the worker refuses to start (exit 2, a configuration error, which
    neither --processes nor the console restarts), naming the type and the handler."""
    (tmp_path / "sig_wrong_tasks.py").write_text(
        "import worker_core\n\n@worker_core.task('sig.cli_wrong')\ndef charge(payload):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("QCONSOLE_DSN", dsn)
    try:
        result = CliRunner().invoke(app, ["worker", "--tasks", "sig_wrong_tasks", "--burst"])
    finally:
        sys.modules.pop("sig_wrong_tasks", None)
        global_registry._tasks.pop("sig.cli_wrong", None)
    assert result.exit_code == 2, result.output
    assert "@task is refused" in result.output and "'sig.cli_wrong'" in result.output, result.output
    assert "charge(payload)" in result.output, result.output
