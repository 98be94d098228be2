"""What keeps a fleet of autonomous workers from hurting shared resources.

``single_flight(key, ttl, refill)``: against cache stampedes. Of many concurrent jobs that need the same
cache entry, exactly one (the holder of the lease ``single-flight:<key>``, the same lease mechanism as
lock_key: PostgreSQL, or Redis) runs ``refill``; its value is kept for ``ttl`` seconds, and the others
wait for it, or give up after ``wait`` seconds with a TransientError (so their job retries with backoff).
If the refiller dies, its lease expires and another job takes over.

Use a connection outside the job's transaction (``ctx.tx`` would hide the lease from the others until the
job commits): pass ``dsn=`` or an autocommit ``conn=``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from psycopg.types.json import Jsonb

from worker_core import db
from worker_core.clock import SYSTEM_CLOCK, Clock
from worker_core.errors import TransientError
from worker_core.locks import LockBackend, PostgresLocks, new_token
from worker_core.sql import queries

T = TypeVar("T")
LEASE_PREFIX = "single-flight:"


class SingleFlightTimeout(TransientError):
    """Waited too long for another job's refill: retry later."""


def _get(conn: db.Conn, key: str, clock: Clock) -> tuple[bool, Any]:
    row = conn.execute(queries["single_flight_get"], {"key": key, "now": clock.now()}).fetchone()
    return (True, row["value"]) if row else (False, None)


def _put(conn: db.Conn, key: str, value: Any, ttl: float, clock: Clock) -> None:
    conn.execute(queries["single_flight_put"], {"key": key, "value": Jsonb(value), "ttl": ttl, "now": clock.now()})


def single_flight(
    key: str,
    ttl: float,
    refill: Callable[[], T],
    *,
    conn: db.Conn | None = None,
    dsn: str | None = None,
    wait: float = 30.0,
    lease: float = 60.0,
    poll: float = 0.05,
    locks: LockBackend | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> T:
    """The value for ``key``: the fresh one if there is one, else from exactly one refill (JSON-able)."""
    own = conn is None
    c = conn or db.connect(db.resolve_dsn(dsn), application_name="worker_core-single-flight", autocommit=True)
    if not c.autocommit:
        raise ValueError("single_flight needs an autocommit connection (not the job's transaction)")
    locks = locks or PostgresLocks(clock)
    deadline = time.monotonic() + wait
    try:
        while True:
            hit, value = _get(c, key, clock)
            if hit:
                return value
            token = new_token()
            if locks.acquire(c, LEASE_PREFIX + key, token, lease):
                try:
                    hit, value = _get(c, key, clock)  # filled between our read and our lease
                    if hit:
                        return value
                    value = refill()
                    json.dumps(value)  # fail here, not in the others, if it is not JSON
                    _put(c, key, value, ttl, clock)
                    return value
                finally:
                    locks.release(c, LEASE_PREFIX + key, token)
            if time.monotonic() + poll > deadline:
                raise SingleFlightTimeout(f"waited {wait:g}s for the refill of {key!r}")
            time.sleep(poll)
    finally:
        if own:
            c.close()


async def asingle_flight(
    key: str,
    ttl: float,
    refill: Callable[[], Awaitable[T]],
    *,
    dsn: str | None = None,
    wait: float = 30.0,
    lease: float = 60.0,
    poll: float = 0.05,
    clock: Clock = SYSTEM_CLOCK,
) -> T:
    """``single_flight`` for async handlers: the refill is awaited; waiting never blocks the loop."""
    c = await db.aconnect(db.resolve_dsn(dsn), application_name="worker_core-single-flight", autocommit=True)
    deadline = time.monotonic() + wait
    name = LEASE_PREFIX + key

    async def get() -> tuple[bool, Any]:
        cur = await c.execute(queries["single_flight_get"], {"key": key, "now": clock.now()})
        row = await cur.fetchone()
        return (True, row["value"]) if row else (False, None)

    try:
        while True:
            hit, value = await get()
            if hit:
                return value
            token = new_token()
            cur = await c.execute(
                queries["lock_acquire"], {"key": name, "token": token, "ttl": lease, "job_id": None, "now": clock.now()}
            )
            if await cur.fetchone():
                try:
                    hit, value = await get()
                    if hit:
                        return value
                    value = await refill()
                    await c.execute(
                        queries["single_flight_put"],
                        {"key": key, "value": Jsonb(value), "ttl": ttl, "now": clock.now()},
                    )
                    return value
                finally:
                    await c.execute(queries["lock_release"], {"key": name, "token": token})
            if time.monotonic() + poll > deadline:
                raise SingleFlightTimeout(f"waited {wait:g}s for the refill of {key!r}")
            await asyncio.sleep(poll)
    finally:
        await c.close()


def forget(conn: db.Conn, key: str) -> None:
    """Drop a cached value, so the next caller refills it."""
    conn.execute(queries["single_flight_forget"], {"key": key})
