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
import contextlib
import inspect
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

from worker_core import db
from worker_core.clock import SYSTEM_CLOCK, Clock, statement_now
from worker_core.envelope import NUL_IN_JSON_RE
from worker_core.errors import TransientError
from worker_core.locks import LockBackend, PostgresLocks, new_token
from worker_core.sql import queries

T = TypeVar("T")
LEASE_PREFIX = "single-flight:"
_log = logging.getLogger("worker_core.coordination")


class SingleFlightTimeout(TransientError):
    """Waited too long for another job's refill: retry later."""


def _get(conn: db.AnyConn, key: str, clock: Clock) -> tuple[bool, Any]:
    params = {"key": key, "now": statement_now(clock)}
    row = db.dict_cursor(conn).execute(queries["single_flight_get"], params).fetchone()
    return (True, row["value"]) if row else (False, None)


def _storable(key: str, value: Any) -> Any:
    """The value as every caller gets it back: as stored (a tuple comes back a list, ``{1: "x"}`` as
    ``{"1": "x"}``), the refiller too. NaN or a NUL character would fail in PostgreSQL, after the refill:
    refused here, with a clear message."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"single_flight({key!r}): the refill's value is not storable as JSON: {e}") from e
    if NUL_IN_JSON_RE.search(text):
        raise ValueError(f"single_flight({key!r}): the refill's value contains a NUL character")
    return json.loads(text)


def _put(conn: db.AnyConn, key: str, value: Any, ttl: float, clock: Clock) -> None:
    params = {"key": key, "value": Jsonb(value), "ttl": ttl, "now": statement_now(clock)}
    conn.execute(queries["single_flight_put"], params)


class _LeaseKeeper:
    """Extends a refill's lease every third of it while the refill runs, on a connection of its own (the
    caller's thread is busy refilling): a refill longer than ``lease`` let a second one start, the
    stampede single_flight is there to stop. Stops with the refill; a lease it finds taken it leaves."""

    def __init__(self, locks: LockBackend, conninfo: str, name: str, token: str, lease: float) -> None:
        self.locks, self.conninfo, self.name, self.token, self.lease = locks, conninfo, name, token, lease
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="single-flight-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn: db.Conn | None = None
        try:
            while not self._done.wait(self.lease / 3):
                try:
                    if conn is None or conn.closed or conn.broken:
                        conn = db.connect(self.conninfo, application_name="worker_core-single-flight", autocommit=True)
                    if not self.locks.extend(conn, self.name, self.token, self.lease):
                        _log.warning("single_flight: the lease %s was taken during its refill", self.name)
                        return
                except Exception as e:  # tried again a third of a lease later
                    _log.warning("single_flight: could not extend %s: %s", self.name, db.redact(str(e), self.conninfo))
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


def _conninfo(conn: db.AnyConn) -> str:
    """A DSN for another connection like ``conn`` (its password included, which ``info.dsn`` leaves out)."""
    password = conn.info.password
    return make_conninfo(conn.info.dsn, **({"password": password} if password else {}))


def single_flight(
    key: str,
    ttl: float,
    refill: Callable[[], T],
    *,
    conn: db.AnyConn | None = None,
    dsn: str | None = None,
    wait: float = 30.0,
    lease: float = 60.0,
    poll: float = 0.05,
    locks: LockBackend | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> T:
    """The value for ``key``: the fresh one if there is one, else from exactly one refill (JSON-able).
    The refill's lease is extended while it runs, however long it takes."""
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
                    keeper = _LeaseKeeper(locks, _conninfo(c), LEASE_PREFIX + key, token, lease)
                    try:
                        stored = _storable(key, refill())
                    finally:
                        keeper.stop()
                    _put(c, key, stored, ttl, clock)
                    return stored
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
    refill: Callable[[], Awaitable[T] | T],
    *,
    dsn: str | None = None,
    wait: float = 30.0,
    lease: float = 60.0,
    poll: float = 0.05,
    clock: Clock = SYSTEM_CLOCK,
) -> T:
    """``single_flight`` for async handlers: the refill's result is awaited when it is awaitable (a coroutine
    function, or a plain function returning a coroutine); a plain function's value is taken as it is, and the
    function runs on the loop (a slow one blocks it: pass ``lambda: asyncio.to_thread(fetch)``). Waiting never
    blocks the loop. The lease is extended while the refill runs, and released if the caller is cancelled
    while taking it."""
    target = db.resolve_dsn(dsn)
    c = await db.aconnect(target, application_name="worker_core-single-flight", autocommit=True)
    deadline = time.monotonic() + wait
    name = LEASE_PREFIX + key

    async def get() -> tuple[bool, Any]:
        cur = await c.execute(queries["single_flight_get"], {"key": key, "now": statement_now(clock)})
        row = await cur.fetchone()
        return (True, row["value"]) if row else (False, None)

    async def keep(token: str) -> None:
        while True:
            await asyncio.sleep(lease / 3)
            params = {"key": name, "token": token, "ttl": lease, "now": statement_now(clock)}
            if await (await c.execute(queries["lock_extend"], params)).fetchone() is None:
                _log.warning("single_flight: the lease %s was taken during its refill", name)
                return

    try:
        while True:
            hit, value = await get()
            if hit:
                return value
            token = new_token()
            try:
                params = {"key": name, "token": token, "ttl": lease, "job_id": None, "now": statement_now(clock)}
                cur = await c.execute(queries["lock_acquire"], params)
                got = await cur.fetchone() is not None
            except asyncio.CancelledError:
                # cancelled while taking it: the lease may be ours already, and would hold every other caller
                # off until it ran out. Released on a connection of its own (this one is mid-statement)
                await asyncio.shield(_release_elsewhere(target, name, token))
                raise
            if got:
                try:
                    hit, value = await get()
                    if hit:
                        return value
                    keeper = asyncio.ensure_future(keep(token))
                    try:
                        stored = _storable(key, await _value_of(refill()))
                    finally:
                        keeper.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await keeper
                    await c.execute(
                        queries["single_flight_put"],
                        {"key": key, "value": Jsonb(stored), "ttl": ttl, "now": statement_now(clock)},
                    )
                    return stored
                finally:
                    await c.execute(queries["lock_release"], {"key": name, "token": token})
            if time.monotonic() + poll > deadline:
                raise SingleFlightTimeout(f"waited {wait:g}s for the refill of {key!r}")
            await asyncio.sleep(poll)
    finally:
        await c.close()


async def _value_of(result: Awaitable[T] | T) -> T:
    """A refill's value: awaited if it is awaitable. ``lambda: {...}`` failed every attempt with "object dict
    can't be used in 'await' expression", retried until dead-lettered."""
    if inspect.isawaitable(result):
        return await result
    return result


async def _release_elsewhere(dsn: str, name: str, token: str) -> None:
    with contextlib.suppress(Exception):
        conn = await db.aconnect(dsn, application_name="worker_core-single-flight", autocommit=True)
        try:
            await conn.execute(queries["lock_release"], {"key": name, "token": token})
        finally:
            await conn.close()


def forget(conn: db.AnyConn, key: str) -> None:
    """Drop a cached value, so the next caller refills it."""
    conn.execute(queries["single_flight_forget"], {"key": key})
