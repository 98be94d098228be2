"""The task module of the README's "Running a worker from Python" (tests/worker_core/test_worker_api.py): its
``myapp.tasks``, whose handlers write their effect in the job's transaction."""

from __future__ import annotations

from typing import Any

import worker_core
from worker_core import JobContext


@worker_core.task("readme.invoice", queue="billing")
def generate(ctx: JobContext, payload: dict[str, Any]) -> None:
    ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, payload["order_id"], ctx.attempt)
    )


@worker_core.task("readme.report")
def report(ctx: JobContext, payload: dict[str, Any]) -> None:
    ctx.tx.execute("INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, "report", 1))
