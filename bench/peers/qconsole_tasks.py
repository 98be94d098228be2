"""qconsole handlers for the benchmark (``--tasks bench.peers.qconsole_tasks``)."""

from __future__ import annotations

from typing import Any

import worker_core
from bench.peers.common import EFFECT_INSERT, record_pickup
from worker_core import JobContext


@worker_core.task("bench.noop")
def noop(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Does nothing: measures the queue itself (claim, run, settle)."""


@worker_core.task("bench.noop_async")
async def noop_async(ctx: JobContext, payload: dict[str, Any]) -> None:
    """The async flavour of the same."""


@worker_core.task("bench.write", requires_idempotency_key=True)
def write(ctx: JobContext, payload: dict[str, Any]) -> None:
    """One business row through the job's transaction: it commits with the idempotency record and the
    ``succeeded`` transition, so the effect happens exactly once."""
    ctx.tx.execute(EFFECT_INSERT, (ctx.idempotency_key, payload["i"]))


@worker_core.task("bench.pickup")
def pickup(ctx: JobContext, payload: dict[str, Any]) -> None:
    record_pickup(payload["i"])
