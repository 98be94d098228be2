"""procrastinate 3.10 app for the benchmark: ``procrastinate --app bench.peers.procrastinate_app.app worker``.

The DSN comes from ``QCBENCH_DSN``. The write handler inserts one row through a connection of its own,
in its own transaction: procrastinate marks the job finished in a separate transaction, so the effect and
the settlement do not commit together (at-least-once, made idempotent by the row's key) — less than
qconsole's guarantee, which only makes the comparison kinder to procrastinate.
"""

from __future__ import annotations

import os

import procrastinate
from psycopg_pool import AsyncConnectionPool

from bench.peers.common import EFFECT_INSERT_PEER, record_pickup

DSN = os.environ.get("QCBENCH_DSN", "")

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DSN))

_pool: AsyncConnectionPool | None = None


async def _effects_pool() -> AsyncConnectionPool:
    global _pool
    if _pool is None:
        _pool = AsyncConnectionPool(DSN, min_size=1, max_size=int(os.environ.get("QCBENCH_POOL", "8")), open=False)
        await _pool.open()
    return _pool


@app.task(name="noop")
async def noop(i: int) -> None:
    return None


@app.task(name="write")
async def write(i: int) -> None:
    pool = await _effects_pool()
    async with pool.connection() as conn:
        await conn.execute(EFFECT_INSERT_PEER, (f"k{i}", i))


@app.task(name="pickup")
async def pickup(i: int) -> None:
    record_pickup(i)
