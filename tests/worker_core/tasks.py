"""Handlers the worker tests run (importable as ``tests.worker_core.tasks`` by worker processes)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

import psycopg

import worker_core
from worker_core import JobContext, PermanentError, TransientError

FAST = worker_core.RetryPolicy(backoff="fixed", base_seconds=0.05, max_delay_seconds=0.05, jitter=0)


def _ledger(ctx: JobContext, payload: dict[str, Any]) -> None:
    ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
        (ctx.job_id, payload.get("item", "x"), ctx.attempt),
    )


@worker_core.task("t.ok", retry=FAST, reason="tests need fast, bounded retries")
def ok(ctx: JobContext, payload: dict[str, Any]) -> None:
    if payload.get("ledger"):
        _ledger(ctx, payload)


@worker_core.task(
    "t.ledger", retry=FAST, timeout=20, requires_idempotency_key=True, reason="tests need fast, bounded retries"
)
def ledger(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes its effect through ctx.tx, then fails afterwards on the first attempts if asked. With ``sleep``,
    sleeps that long after its write (and writes again after it with ``write_again``)."""
    _ledger(ctx, payload)
    if payload.get("sleep"):
        time.sleep(payload["sleep"])
        if payload.get("write_again"):
            _ledger(ctx, payload)
    if ctx.attempt <= payload.get("fail_after_write", 0):
        raise TransientError("failed after writing")


@worker_core.task("t.self_commit", retry=FAST, reason="tests need fast, bounded retries")
def self_commit(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Misuses ctx.tx: commits it itself."""
    _ledger(ctx, payload)
    ctx.tx.commit()


@worker_core.task("t.raw_commit", retry=FAST, reason="tests need fast, bounded retries")
def raw_commit(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Misuses ctx.tx past what commit() refuses: ends its transaction with a statement (COMMIT or ROLLBACK),
    then, if asked, goes on (a new transaction begins). ``via`` "stream" or "copy" sends it through a cursor's
    stream() or copy(), which then raise ProgrammingError (a COMMIT yields no rows, and is no COPY):
    raised, or swallowed if ``swallow``."""
    _ledger(ctx, payload)
    end, via = payload.get("end", "COMMIT"), payload.get("via", "execute")
    if via == "execute":
        ctx.tx.execute(end)
    else:
        try:
            if via == "stream":
                list(ctx.tx.cursor().stream(end))
            else:
                with ctx.tx.cursor().copy(end):
                    pass
        except psycopg.ProgrammingError:
            if not payload.get("swallow"):
                raise
    if payload.get("then") == "select":
        ctx.tx.execute("SELECT 1")
    if payload.get("then") == "raise":
        raise TransientError("failed after ending its transaction")


@worker_core.task("t.swallow", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
def swallow(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes its effect, then catches the database error of a statement of its own and returns as if all
    went well: its transaction is aborted."""
    _ledger(ctx, payload)
    with contextlib.suppress(psycopg.Error):
        ctx.tx.execute("SELECT 1 / 0")


@worker_core.task("t.async_swallow", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
async def async_swallow(ctx: JobContext, payload: dict[str, Any]) -> None:
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, payload["item"], ctx.attempt)
    )
    with contextlib.suppress(psycopg.Error):
        await ctx.tx.execute("SELECT 1 / 0")


@worker_core.task("t.autocommit", retry=FAST, reason="tests need fast, bounded retries")
def autocommit(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Switches ctx.tx to autocommit before writing: each statement would commit on its own."""
    ctx.tx.autocommit = True
    _ledger(ctx, payload)


@worker_core.task("t.async_autocommit", retry=FAST, reason="tests need fast, bounded retries")
async def async_autocommit(ctx: JobContext, payload: dict[str, Any]) -> None:
    await ctx.tx.set_autocommit(True)
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, payload["item"], ctx.attempt)
    )


@worker_core.task("t.tx_block", retry=FAST, reason="tests need fast, bounded retries")
def tx_block(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes its effect in a ``ctx.tx.transaction()`` block, then fails on the first ``fail_times`` attempts."""
    with ctx.tx.transaction():
        _ledger(ctx, payload)
    if ctx.attempt <= payload.get("fail_times", 0):
        raise TransientError("failed after its block")


@worker_core.task("t.async_tx_block", retry=FAST, reason="tests need fast, bounded retries")
async def async_tx_block(ctx: JobContext, payload: dict[str, Any]) -> None:
    async with ctx.tx.transaction():
        await ctx.tx.execute(
            "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, payload["item"], ctx.attempt)
        )
    if ctx.attempt <= payload.get("fail_times", 0):
        raise TransientError("failed after its block")


@worker_core.task("t.flaky", retry=FAST, max_attempts=5, reason="tests need fast, bounded retries")
def flaky(ctx: JobContext, payload: dict[str, Any]) -> None:
    if ctx.attempt <= payload.get("fail_times", 1):
        raise TransientError(f"upstream 503 on attempt {ctx.attempt}")
    if payload.get("ledger"):
        _ledger(ctx, payload)


@worker_core.task("t.permanent", retry=FAST, reason="tests need fast, bounded retries")
def permanent(ctx: JobContext, payload: dict[str, Any]) -> None:
    raise PermanentError(f"invoice {payload.get('invoice', 'inv_1')} does not exist")


@worker_core.task("t.fan_out", retry=FAST, max_attempts=4, reason="tests need fast, bounded retries")
async def fan_out(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Fans out with ``asyncio.TaskGroup``, on its first attempt, one child per entry of ``children``:
    "permanent" (the invoice does not exist) or a number, or None (rate limited: a TransientError with that
    ``retry_in``). Its children's errors reach the worker in the TaskGroup's ExceptionGroup: each yields
    once first, so all of them have started (and fail in the same turn of the loop) before the first error
    cancels the others."""
    if ctx.attempt > 1:
        return

    async def child(spec: Any) -> None:
        await asyncio.sleep(0)
        if spec == "permanent":
            raise PermanentError(f"invoice {payload.get('invoice', 'inv_1')} does not exist")
        raise TransientError("rate limited", retry_in=spec)

    async with asyncio.TaskGroup() as tg:
        for spec in payload["children"]:
            tg.create_task(child(spec))


@worker_core.task("t.unknown", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
def unknown(ctx: JobContext, payload: dict[str, Any]) -> None:
    raise KeyError(payload.get("key", "customer_id"))


@worker_core.task("t.base_exc", retry=FAST, max_attempts=1, reason="tests need fast, bounded retries")
def base_exc(ctx: JobContext, payload: dict[str, Any]) -> None:
    kind = payload.get("kind", "exit")
    if kind == "exit":
        raise SystemExit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "memory":
        raise MemoryError("out of memory")
    if kind == "recursion":

        def f(n: int) -> int:
            return f(n + 1) + 1

        f(0)


@worker_core.task("t.started_seen", retry=FAST, reason="tests need fast, bounded retries")
def started_seen(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes to the ledger how many starts of its type the metrics table holds as it runs (committed by
    others: its own transaction reads them at each statement)."""
    row = ctx.tx.execute(
        "SELECT coalesce(sum(started), 0) AS n FROM job_metrics_minute WHERE job_type = %s", (ctx.job_type,)
    ).fetchone()
    _ledger(ctx, {"item": str(row["n"])})


@worker_core.task(
    "t.crash", retry=FAST, max_attempts=2, timeout=2, visibility_timeout=8, reason="tests need fast, bounded retries"
)
def crash(ctx: JobContext, payload: dict[str, Any]) -> None:
    os._exit(13)


@worker_core.task("t.slow", retry=FAST, timeout=30, reason="tests need fast, bounded retries")
def slow(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Sleeps cooperatively: returns early when cancelled (killed, timed out, shutdown). ``started_file``:
    touched as it starts (a job's state says `running` from its claim, before its handler begins)."""
    if payload.get("started_file"):
        Path(payload["started_file"]).touch()
    deadline = time.monotonic() + payload.get("seconds", 5)
    while time.monotonic() < deadline:
        if ctx.wait_cancelled(0.05):
            if payload.get("raise_when_cancelled"):  # the other way handlers honour it
                raise TransientError(f"interrupted: {ctx.cancel_reason}")
            return
    if payload.get("ledger"):
        _ledger(ctx, payload)


@worker_core.task(
    "t.stubborn",
    retry=FAST,
    timeout=1,
    visibility_timeout=10,
    max_attempts=1,
    reason="tests need fast, bounded retries",
)
def stubborn(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Ignores cancellation; tries to write after its timeout: the write must never commit. With
    ``sequence``, its write is a ``nextval`` of that sequence instead, which no rollback takes back."""
    time.sleep(payload.get("seconds", 2.5))
    if payload.get("sequence"):
        ctx.tx.execute(f"SELECT nextval('{payload['sequence']}')")
    else:
        _ledger(ctx, payload)


@worker_core.task("t.async_ok", retry=FAST, reason="tests need fast, bounded retries")
async def async_ok(ctx: JobContext, payload: dict[str, Any]) -> None:
    await asyncio.sleep(payload.get("sleep", 0.01))
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
        (ctx.job_id, payload.get("item", "x"), ctx.attempt),
    )
    if payload.get("fail"):
        raise TransientError("async failure after write")


@worker_core.task("t.async_self_end", retry=FAST, reason="tests need fast, bounded retries")
async def async_self_end(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Misuses ctx.tx as t.self_commit and t.raw_commit do, from an async handler: ``how`` is "commit"
    (``await ctx.tx.commit()``) or a statement ("COMMIT", "ROLLBACK"); then, if asked, it writes again and
    raises."""
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, payload["item"], ctx.attempt)
    )
    how, via = payload.get("how", "commit"), payload.get("via", "execute")
    if how == "commit":
        await ctx.tx.commit()
    elif via == "execute":
        await ctx.tx.execute(how)
    else:  # through a cursor's stream() or copy(), as t.raw_commit does
        try:
            if via == "stream":
                [row async for row in ctx.tx.cursor().stream(how)]
            else:
                async with ctx.tx.cursor().copy(how):
                    pass
        except psycopg.ProgrammingError:
            if not payload.get("swallow"):
                raise
    if payload.get("then") == "raise":
        await ctx.tx.execute(
            "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
            (ctx.job_id, payload["item"] + "-after", ctx.attempt),
        )
        raise TransientError("failed after ending its transaction")


@worker_core.task("t.async_plain", retry=FAST, reason="tests need fast, bounded retries")
async def async_plain(ctx: JobContext, payload: dict[str, Any]) -> None:
    """An async handler with no transactional effect."""
    await asyncio.sleep(0)


#: async handlers with a timeout of 1 s and a single attempt
ONE_SECOND_ONCE: dict[str, Any] = {
    "retry": FAST, "timeout": 1, "visibility_timeout": 10, "max_attempts": 1,
    "reason": "tests need fast, bounded retries",
}  # fmt: skip


@worker_core.task("t.async_slow", **ONE_SECOND_ONCE)
async def async_slow(ctx: JobContext, payload: dict[str, Any]) -> None:
    await asyncio.sleep(payload.get("seconds", 5))


@worker_core.task("t.async_stubborn", **ONE_SECOND_ONCE)
async def async_stubborn(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Ignores its cancellation until ``seconds`` have passed, then writes to the ledger through ctx.tx."""
    until = time.monotonic() + payload["seconds"]
    while time.monotonic() < until:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            continue
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, "late", ctx.attempt)
    )


@worker_core.task("t.locked", retry=FAST, timeout=10, reason="tests need fast, bounded retries")
def locked(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Records when it ran, to check that two jobs with one lock_key never overlap."""
    start = time.time()
    time.sleep(payload.get("seconds", 0.3))
    ctx.tx.execute(
        "INSERT INTO intervals (job_id, started, ended) VALUES (%s, to_timestamp(%s), to_timestamp(%s))",
        (ctx.job_id, start, time.time()),
    )


#: a timeout of 1 s and a second attempt, soon after the first
ONE_SECOND_TWICE: dict[str, Any] = {**ONE_SECOND_ONCE, "max_attempts": 2}


@worker_core.task("t.hold", requires_idempotency_key=True, **ONE_SECOND_TWICE)
def hold(ctx: JobContext, payload: dict[str, Any]) -> None:
    """First attempt: writes through ctx.tx (its idempotency record and that row stay locked in its
    transaction), then sleeps ``seconds`` past its timeout, deaf to its cancellation, and writes again.
    Later attempts write and return."""
    _ledger(ctx, {"item": f"attempt {ctx.attempt}"})
    if ctx.attempt == 1:
        time.sleep(payload["seconds"])
        _ledger(ctx, {"item": "late"})


@worker_core.task("t.async_hold", requires_idempotency_key=True, **ONE_SECOND_TWICE)
async def async_hold(ctx: JobContext, payload: dict[str, Any]) -> None:
    """t.hold for async handlers: the first attempt blocks its event loop, so only the watchdog can end it."""
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
        (ctx.job_id, f"attempt {ctx.attempt}", ctx.attempt),
    )
    if ctx.attempt == 1:
        time.sleep(payload["seconds"])  # a stuck event loop is the point
        await ctx.tx.execute(
            "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, "late", ctx.attempt)
        )


@worker_core.task("t.fail_later", retry=FAST, max_attempts=3, reason="tests need fast, bounded retries")
def fail_later(ctx: JobContext, payload: dict[str, Any]) -> None:
    """First attempt: fails transiently after ``seconds``, deaf to cancellation. Later ones write the ledger."""
    if ctx.attempt == 1:
        time.sleep(payload["seconds"])
        raise TransientError("failed after a while")
    _ledger(ctx, payload)


@worker_core.task(
    "t.cut_group_conn", retry=FAST, timeout=20, requires_idempotency_key=True, reason="tests need fast, bounded retries"
)
def cut_group_conn(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Once (a marker row decides): from a connection of its own, terminates the server process of the
    transaction its group has open (the only one idle in a transaction), as a failover would, before it
    writes through ctx.tx. Then, and every other time, writes its ledger row."""
    with psycopg.connect(ctx.dsn, autocommit=True) as c:
        c.execute("CREATE TABLE IF NOT EXISTS once (name text PRIMARY KEY)")
        if c.execute("INSERT INTO once VALUES ('cut') ON CONFLICT DO NOTHING RETURNING name").fetchone():
            c.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE state = 'idle in transaction'"
                " AND datname = current_database() AND pid <> pg_backend_pid()"
            )
            time.sleep(0.3)
    _ledger(ctx, payload)


@worker_core.task("t.async_self_cancel", retry=FAST, reason="tests need fast, bounded retries")
async def async_self_cancel(ctx: JobContext, payload: dict[str, Any]) -> None:
    """First attempt: writes, then its task ends cancelled (it awaited something another task cancelled,
    say) though nobody cancelled the job. Later attempts write and return."""
    _ = await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, "x", ctx.attempt)
    )
    if ctx.attempt == 1:
        raise asyncio.CancelledError()


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


@worker_core.task("t.awkward_failure", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
def awkward_failure(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Fails, the first time, with an error the worker has to settle carefully: ``how`` is "retry_in" (a
    Retry-After header passed on as it came, a string), "nul" (a NUL and a lone surrogate in its message)
    or "unprintable" (its __str__ raises)."""
    if ctx.attempt > 1:
        _ledger(ctx, payload)
        return
    how = payload["how"]
    if how == "retry_in":
        raise TransientError("rate limited", retry_in="0.05")  # type: ignore[arg-type]
    if how == "nul":
        raise ValueError("bad\x00byte \ud800 here")
    raise _Unprintable()


# ----------------------------------------------------------------------- errors of the job's own making, found
# at its settlement or commit, and handlers that leave work behind (test_settlement_errors)


@worker_core.task("t.deferred_fk", retry=FAST, max_attempts=3, reason="tests need fast, bounded retries")
def deferred_fk(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes a child row whose parent does not exist, under a DEFERRABLE INITIALLY DEFERRED foreign key (as
    Django declares every one): the violation shows only at COMMIT."""
    _ledger(ctx, payload)
    ctx.tx.execute("INSERT INTO child (parent_id) VALUES (%s)", (payload.get("parent", 999),))


@worker_core.task("t.async_deferred_fk", retry=FAST, max_attempts=3, reason="tests need fast, bounded retries")
async def async_deferred_fk(ctx: JobContext, payload: dict[str, Any]) -> None:
    await ctx.tx.execute("INSERT INTO child (parent_id) VALUES (%s)", (payload.get("parent", 999),))


@worker_core.task("t.tenant_path", retry=FAST, max_attempts=3, reason="tests need fast, bounded retries")
def tenant_path(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Switches ctx.tx to a tenant's schema (as django-tenants does) and leaves it so."""
    ctx.tx.execute("CREATE SCHEMA IF NOT EXISTS tenant_42")
    ctx.tx.execute("SET search_path TO tenant_42")


@worker_core.task("t.with_tx", retry=FAST, max_attempts=3, reason="tests need fast, bounded retries")
def with_tx(ctx: JobContext, payload: dict[str, Any]) -> None:
    """``with ctx.tx as c:`` around its write; fails inside the block on its first ``fail_times`` attempts."""
    with ctx.tx as c:
        c.execute("INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, "w", ctx.attempt))
        if ctx.attempt <= payload.get("fail_times", 0):
            raise TransientError("upstream 503")


@worker_core.task("t.async_gather", retry=FAST, max_attempts=3, reason="tests need fast, bounded retries")
async def async_gather(ctx: JobContext, payload: dict[str, Any]) -> None:
    """gather(a write 0.3 s later, a call that fails on attempt 1): the failure ends the handler while the
    write is still pending in the slot's loop."""

    async def write() -> None:
        await asyncio.sleep(0.3)
        await ctx.tx.execute(
            "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, "g", ctx.attempt)
        )

    async def call() -> None:
        await asyncio.sleep(0.01)
        if ctx.attempt == 1:
            raise TransientError("upstream 503")

    await asyncio.gather(write(), call())


@worker_core.task("t.async_exit", retry=FAST, timeout=5, max_attempts=3, reason="tests need fast, bounded retries")
async def async_exit(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes, then raises SystemExit on its first attempt (which asyncio lets escape its loop)."""
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, "e", ctx.attempt)
    )
    if ctx.attempt == 1:
        raise SystemExit(3)


@worker_core.task("t.idle_too_long", retry=FAST, timeout=20, max_attempts=3, reason="tests need fast, bounded retries")
def idle_too_long(ctx: JobContext, payload: dict[str, Any]) -> None:
    """On its first attempt: writes, then makes a slow call longer than the session's
    idle_in_transaction_session_timeout, so the server ends its connection, then writes again."""
    if ctx.attempt == 1:
        ctx.tx.execute("SET idle_in_transaction_session_timeout = '500ms'")
    _ledger(ctx, payload)
    if ctx.attempt == 1:
        time.sleep(1.2)
    _ledger(ctx, payload)


@worker_core.task("t.idle_quiet", retry=FAST, timeout=20, max_attempts=3, reason="tests need fast, bounded retries")
def idle_quiet(ctx: JobContext, payload: dict[str, Any]) -> None:
    """t.idle_too_long that, on its first attempt, does not touch ctx.tx after its slow call (the next job
    of its group would find the connection gone) or, with ``swallow``, touches it and swallows the error."""
    if ctx.attempt == 1:
        ctx.tx.execute("SET idle_in_transaction_session_timeout = '500ms'")
    _ledger(ctx, payload)
    if ctx.attempt == 1:
        time.sleep(1.2)
        if payload.get("swallow"):
            with contextlib.suppress(psycopg.Error):  # a "best effort" write
                _ledger(ctx, payload)


@worker_core.task("t.read_only_tx", retry=FAST, max_attempts=3, reason="tests need fast, bounded retries")
def read_only_tx(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Makes its transaction read-only: the worker's settlement in it fails with 25006, as on a read-only
    server, though the server is fine and answers."""
    ctx.tx.execute("SET TRANSACTION READ ONLY")


@worker_core.task("t.async_fire_and_forget", retry=FAST, timeout=5, reason="tests need fast, bounded retries")
async def async_fire_and_forget(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes, then starts a write it does not await, and returns while that write is in flight."""
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, "f", ctx.attempt)
    )
    _background.add(asyncio.ensure_future(ctx.tx.execute("SELECT 1")))
    await asyncio.sleep(0.01)  # the statement is sent, its reply waits in the socket when the handler returns


_background: set[Any] = set()


def _logged(fn: Any) -> Any:
    """A plain (sync) decorator, as many are written, around an async handler: it returns the coroutine."""

    @functools.wraps(fn)
    def wrapper(ctx: JobContext, payload: dict[str, Any]) -> Any:
        return fn(ctx, payload)

    return wrapper


@worker_core.task("t.async_decorated", retry=FAST, reason="tests need fast, bounded retries")
@_logged
async def async_decorated(ctx: JobContext, payload: dict[str, Any]) -> None:
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, payload["item"], ctx.attempt)
    )


@dataclasses.dataclass
class Charge:
    """A handler object (a dataclass: unhashable) whose ``__call__`` is async."""

    suffix: str = ""

    async def __call__(self, ctx: JobContext, payload: dict[str, Any]) -> None:
        await ctx.tx.execute(
            "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
            (ctx.job_id, payload["item"] + self.suffix, ctx.attempt),
        )


worker_core.task("t.async_callable", retry=FAST, reason="tests need fast, bounded retries")(Charge())


@worker_core.task("t.returns_coroutine", retry=FAST, reason="tests need fast, bounded retries")
def returns_coroutine(ctx: JobContext, payload: dict[str, Any]) -> Any:
    """A sync function that returns a coroutine, with nothing to say what it is."""
    return async_plain(ctx, payload)


@worker_core.task("t.crash_later", retry=FAST, timeout=20, reason="tests need fast, bounded retries")
def crash_later(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Kills its process after ``seconds``, whatever happens meanwhile (a stop, its cancellation)."""
    time.sleep(payload["seconds"])
    os._exit(13)


def _runs_itself(fn: Any) -> Any:
    """A sync decorator that runs an async def to its end itself (as asgiref's async_to_sync does)."""

    @functools.wraps(fn)
    def wrapper(ctx: JobContext, payload: dict[str, Any]) -> Any:
        return asyncio.run(fn(ctx, payload))

    return wrapper


@worker_core.task("t.sync_runs_async", retry=FAST, reason="tests need fast, bounded retries")
@_runs_itself
async def sync_runs_async(ctx: JobContext, payload: dict[str, Any]) -> None:
    await asyncio.sleep(0)
    ctx.tx.execute(  # the sync connection: this handler is sync
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)", (ctx.job_id, payload["item"], ctx.attempt)
    )


_DIRTY = (
    "SET search_path TO dirty_tenant, public",
    "SET statement_timeout = '150ms'",
    "CREATE TEMP TABLE staging (i int)",
    "SELECT pg_advisory_lock(4242)",
    "SELECT set_config('app.tenant', 'tenant-1', true)",  # an RLS policy's tenant, for this transaction
)
_PROBE = (
    "INSERT INTO public.ledger (job_id, item, attempt) SELECT %s, concat_ws('|', current_setting('search_path'),"
    " current_setting('statement_timeout'), to_regclass('pg_temp.staging') IS NULL, (SELECT count(*) FROM"
    " pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()), coalesce(current_setting('app.tenant',"
    " true), '')), %s"
)


@worker_core.task("t.dirty_session", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
def dirty_session(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Leaves its session changed: a search_path, a statement_timeout, a temp table, an advisory lock."""
    for statement in _DIRTY:
        ctx.tx.execute(statement)


@worker_core.task("t.session_probe", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
def session_probe(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes what it finds of its session to the ledger: search_path|statement_timeout|no temp table|locks|
    app.tenant."""
    ctx.tx.execute(_PROBE, (ctx.job_id, ctx.attempt))


@worker_core.task("t.async_dirty_session", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
async def async_dirty_session(ctx: JobContext, payload: dict[str, Any]) -> None:
    for statement in _DIRTY:
        await ctx.tx.execute(statement)


@worker_core.task("t.async_session_probe", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
async def async_session_probe(ctx: JobContext, payload: dict[str, Any]) -> None:
    await ctx.tx.execute(_PROBE, (ctx.job_id, ctx.attempt))


class _Detached:
    """An ORM object of a closed session: reading it raises."""

    def __repr__(self) -> str:
        raise RuntimeError("DetachedInstanceError: the session is closed")

    __str__ = __repr__


@worker_core.task("t.bad_repr", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
def bad_repr(ctx: JobContext, payload: dict[str, Any]) -> None:
    raise ValueError(_Detached())


@worker_core.task("t.tenant_local", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
def tenant_local(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Sets its tenant for this transaction (as an RLS setup does) and writes a row a deferred trigger checks."""
    ctx.tx.execute("SELECT set_config('app.tenant', %s, true)", (payload["tenant"],))
    ctx.tx.execute("INSERT INTO tenant_items (tenant) VALUES (%s)", (payload["tenant"],))


@worker_core.task("t.fail_slowly", retry=FAST, max_attempts=5, reason="tests need fast, bounded retries")
def fail_slowly(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Takes its time, then fails (transient): its failure is settled when the test has cut the database."""
    time.sleep(payload.get("sleep", 1.0))
    raise TransientError("upstream 503")


@worker_core.task("t.slow_commit", retry=FAST, max_attempts=2, reason="tests need fast, bounded retries")
def slow_commit(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes a row whose deferred trigger takes its time at COMMIT (synchronous replication, a slow disk)."""
    ctx.tx.execute("INSERT INTO slow_commit (job_id) VALUES (%s)", (ctx.job_id,))


@worker_core.task("t.async_leaves_a_block", retry=FAST, timeout=5, reason="tests need fast, bounded retries")
async def async_leaves_a_block(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes, then starts an audit write in a ``ctx.tx.transaction()`` block it does not await: the block
    begins 0.3 s later, while the next job of the slot runs."""

    async def audit() -> None:
        await asyncio.sleep(0.3)
        async with ctx.tx.transaction():
            await asyncio.sleep(0.5)
            await ctx.tx.execute("INSERT INTO ledger (job_id, item, attempt) VALUES (%s, 'audit', 1)", (ctx.job_id,))

    await ctx.tx.execute("INSERT INTO ledger (job_id, item, attempt) VALUES (%s, 'A', %s)", (ctx.job_id, ctx.attempt))
    _background.add(asyncio.ensure_future(audit()))


@worker_core.task("t.async_steps", retry=FAST, timeout=10, reason="tests need fast, bounded retries")
async def async_steps(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Two writes 0.6 s apart, then a pause."""
    for item in ("b1", "b2"):
        await ctx.tx.execute("INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
                             (ctx.job_id, item, ctx.attempt))  # fmt: skip
        await asyncio.sleep(0.6)


@worker_core.task(
    "t.async_slow_commit", retry=FAST, timeout=1, max_attempts=1, reason="tests need fast, bounded retries"
)
async def async_slow_commit(ctx: JobContext, payload: dict[str, Any]) -> None:
    """t.slow_commit, async: its deferred trigger takes its time at COMMIT, after its timeout."""
    await ctx.tx.execute("INSERT INTO slow_commit (job_id) VALUES (%s)", (ctx.job_id,))


@worker_core.task(
    "t.exit_code",
    retry=FAST,
    max_attempts=2,
    timeout=2,
    visibility_timeout=8,
    reason="tests need fast, bounded retries",
)
def exit_code(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Ends its process with ``code`` (a payload, or a C library, calling exit(2): not a refused configuration)."""
    os._exit(payload["code"])



@worker_core.task("t.async_to_thread", retry=FAST, timeout=60, reason="tests need fast, bounded retries")
async def async_to_thread(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Awaits a blocking call on the event loop's default executor: cancelled, the thread sleeps on."""
    await asyncio.to_thread(time.sleep, payload["seconds"])


@worker_core.task("t.async_ledger", retry=FAST, timeout=20, reason="tests need fast, bounded retries")
async def async_ledger(ctx: JobContext, payload: dict[str, Any]) -> None:
    """t.ledger for async handlers: writes its effect through ctx.tx, then sleeps ``sleep`` seconds, its
    transaction open (and writes again after it with ``write_again``)."""
    await ctx.tx.execute(
        "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
        (ctx.job_id, payload.get("item", "x"), ctx.attempt),
    )
    await asyncio.sleep(payload.get("sleep", 0.0))
    if payload.get("write_again"):
        await ctx.tx.execute(
            "INSERT INTO ledger (job_id, item, attempt) VALUES (%s, %s, %s)",
            (ctx.job_id, payload.get("item", "x"), ctx.attempt),
        )


@worker_core.task("t.own_end", retry=FAST, timeout=20, max_attempts=2, reason="tests need fast, bounded retries")
def own_end(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Writes through ctx.tx, then ends its own session the way an outage would, and swallows what that
    raised: ``how`` "terminate" (its backend terminated by itself: FATAL 57P01, as a restart sends) or
    "finish" (its connection closed under psycopg: no SQLSTATE, as a network cut)."""
    _ledger(ctx, payload)
    if payload["how"] == "terminate":
        with contextlib.suppress(psycopg.Error):
            ctx.tx.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    else:
        ctx.tx.pgconn.finish()
