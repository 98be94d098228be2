"""Handlers for the rest of the contract: single-flight refills and optimistic writes."""

from __future__ import annotations

import time
from typing import Any

import worker_core
from worker_core import JobContext, db
from worker_core.coordination import single_flight
from worker_core.optimistic import versioned_update

FAST = worker_core.RetryPolicy(backoff="fixed", base_seconds=0.05, max_delay_seconds=0.05, jitter=0.5)


def _refill(dsn: str) -> dict[str, Any]:
    with db.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO refills DEFAULT VALUES")
    time.sleep(0.5)  # an expensive upstream call
    return {"eur_usd": 1.1}


@worker_core.task("t.cached_rate", retry=FAST, max_attempts=20, reason="tests need fast, bounded retries")
def cached_rate(ctx: JobContext, payload: dict[str, Any]) -> None:
    assert ctx.dsn is not None
    dsn = ctx.dsn
    value = single_flight("rates:eur_usd", ttl=60, refill=lambda: _refill(dsn), dsn=dsn, wait=20)
    ctx.tx.execute("INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
                   (ctx.job_id, str(value["eur_usd"]), ctx.attempt))  # fmt: skip


@worker_core.task("t.deposit", retry=FAST, max_attempts=50, reason="tests need fast, bounded retries")
def deposit(ctx: JobContext, payload: dict[str, Any]) -> None:
    row = ctx.tx.execute("SELECT balance, version FROM accounts WHERE id = %s", (payload["account"],)).fetchone()
    time.sleep(payload.get("think", 0.2))  # read-modify-write with a gap another job can fall into
    versioned_update(
        ctx.tx, "accounts", {"id": payload["account"]}, row["version"], {"balance": row["balance"] + payload["amount"]}
    )


@worker_core.task("t.limited", retry=FAST, concurrency=2, timeout=20, reason="tests need fast, bounded retries")
def limited(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Records when it ran; the test computes the peak overlap across every process."""
    start = time.time()
    time.sleep(payload.get("seconds", 0.15))
    ctx.tx.execute(
        "INSERT INTO intervals (job_id, started, ended) VALUES (%s, to_timestamp(%s), to_timestamp(%s))",
        (ctx.job_id, start, time.time()),
    )


@worker_core.task("t.async_sleep", retry=FAST, timeout=30, reason="tests need fast, bounded retries")
async def async_sleep(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Marks that it started, writes through ctx.tx, sleeps; a kill cancels it and its write rolls back.
    Each mark is committed on a side connection, so the test can see it."""
    import asyncio

    def mark() -> None:
        with db.connect(ctx.dsn or "", autocommit=True) as c:
            c.execute("INSERT INTO refills DEFAULT VALUES")

    mark()
    await ctx.tx.execute("INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
                         (ctx.job_id, "async-before-kill", ctx.attempt))  # fmt: skip
    try:
        await asyncio.sleep(payload.get("seconds", 20))
    except asyncio.CancelledError:
        mark()  # the cancellation reached the handler
        raise
