"""Mistakes ``mypy --strict`` catches in an application, each marked on its line with ``# expect: CODE``
(tests/worker_core/test_typing.py: these errors, and no other)."""

from __future__ import annotations

from typing import Any

import worker_core
from worker_core import JobContext
from worker_core.envelope import EnvelopeFields


@worker_core.task("sample.payload_only")  # expect: type-var
def payload_only(payload: dict[str, Any]) -> None: ...


@worker_core.task("sample.keyword_payload")  # expect: type-var
def keyword_payload(ctx: JobContext, *, payload: dict[str, Any]) -> None: ...


@worker_core.task("sample.needs_more")  # expect: type-var
def needs_more(ctx: JobContext, payload: dict[str, Any], session: object) -> None: ...


@worker_core.task("sample.not_a_context")  # expect: type-var
def not_a_context(ctx: str, payload: dict[str, Any]) -> None: ...


@worker_core.task("sample.sync_reads_a_row")
def sync_reads_a_row(ctx: JobContext, payload: dict[str, Any]) -> None:
    ctx.tx.execute("SELECT 1 AS one").fetchone()["one"]  # expect: index


@worker_core.task("sample.async_with_a_sync_context")
async def async_with_a_sync_context(ctx: JobContext, payload: dict[str, Any]) -> None:
    await ctx.tx.execute("SELECT 1")  # expect: misc


misspelt: EnvelopeFields = {"idempotancy_key": "invoice:ord_987"}  # expect: typeddict-unknown-key
wrong_type: EnvelopeFields = {"priority": "high"}  # expect: typeddict-item


def run_worker(dsn: str) -> None:
    from worker_core import Worker, WorkerConfig

    Worker(WorkerConfig(dsn=dsn, task_modules="myapp.tasks"))  # expect: arg-type
