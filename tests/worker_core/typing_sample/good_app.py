"""An application written as README.md shows, fully annotated: ``mypy --strict`` has nothing to say of it.

Checked by tests/worker_core/test_typing.py, with worker_core found as an installed package (py.typed)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import psycopg

import worker_core
from worker_core import AsyncJobContext, EnqueueResult, JobContext, PermanentError, RetryPolicy, TransientError


@worker_core.task(
    "sample.invoice.generate",
    queue="billing",
    max_attempts=8,
    timeout=30,
    retry=RetryPolicy(backoff="exponential", base_seconds=2, max_delay_seconds=300),
    requires_idempotency_key=True,
    reason="invoices wait on the PDF service, which has long outages",
)
def generate(ctx: JobContext, payload: dict[str, Any]) -> None:
    ctx.logger.info("generating")
    ctx.tx.execute("INSERT INTO invoices (order_id) VALUES (%s)", (payload["order_id"],))
    row = ctx.tx.execute("SELECT total FROM orders WHERE id = %s", (payload["order_id"],)).fetchone()
    if row is None:
        raise PermanentError(f"no order {payload['order_id']}")
    total: Any = row["total"]  # rows are dicts
    if total is None:
        raise TransientError("the order has no total yet")
    if ctx.cancelled or ctx.wait_cancelled(0.1):
        return


@worker_core.task("sample.mail.send")
async def send(ctx: AsyncJobContext, payload: dict[str, Any]) -> None:
    cur = await ctx.tx.execute("SELECT %s::text AS address", (payload["to"],))
    row = await cur.fetchone()
    assert row is not None
    ctx.logger.info("sending to %s", row["address"])


@worker_core.task("sample.untyped_payload")
def untyped(ctx: JobContext, payload: Any) -> None:
    """A payload may be typed as the application likes (a TypedDict, Any...): it is JSON."""


@worker_core.task("sample.with_defaults")
def with_defaults(ctx: JobContext, payload: dict[str, Any], retries: int = 3, *, dry_run: bool = False) -> None: ...


@dataclasses.dataclass
class Charge:
    """A handler object: its ``__call__`` takes (ctx, payload)."""

    currency: str

    async def __call__(self, ctx: AsyncJobContext, payload: dict[str, Any]) -> None: ...


charge = worker_core.task("sample.charge")(Charge("EUR"))


def _with_session(session: str, ctx: JobContext, payload: dict[str, Any]) -> None: ...


worker_core.task("sample.partial")(functools.partial(_with_session, "a session"))

# @task gives the handler back with its own type: it is still a function of (JobContext, dict)
kept: Callable[[JobContext, dict[str, Any]], None] = generate
kept_charge: Charge = charge


def produce(conn: psycopg.Connection[Any]) -> EnqueueResult:
    """A producer, inside its own transaction (README, "Using it")."""
    with conn.transaction():
        conn.execute("INSERT INTO orders (id) VALUES (%s)", ("ord_987",))
        worker_core.enqueue(conn, "sample.mail.send", {"to": "a@example.com"}, queue="mail", priority=5)
        worker_core.enqueue(conn, "sample.mail.send", {"to": "b@example.com"}, retry_policy={"base_seconds": 5})
        return worker_core.enqueue(
            conn,
            "sample.invoice.generate",
            {"order_id": "ord_987"},
            idempotency_key="invoice:ord_987",
            lock_key="order:ord_987",
            retry_policy=RetryPolicy(base_seconds=5),
            delay_seconds=1.5,
        )


def run_workers(dsn: str) -> int:
    """README, "Running a worker from Python": in a thread until stop(), then a burst."""
    import threading

    from worker_core import Worker, WorkerConfig

    config = WorkerConfig(dsn=dsn, task_modules=("myapp.tasks",), queues=("billing",), concurrency=4)
    worker = Worker(config)
    thread = threading.Thread(target=worker.run, name="worker_core")
    thread.start()
    worker.stop()
    thread.join()
    exit_code: int = Worker(WorkerConfig(dsn=dsn, task_modules=("myapp.tasks",), burst=True)).run()
    return exit_code
