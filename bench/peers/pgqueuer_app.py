"""pgqueuer 1.6 consumer for the benchmark: ``pgq run bench.peers.pgqueuer_app:factory --batch-size N``.

asyncpg driver (pgqueuer's fastest). The DSN comes from ``QCBENCH_DSN``. The write handler inserts one row
through a pool of its own, in its own transaction: pgqueuer's completion is a separate (batched) write,
so the effect and the job's settlement do not commit together (at-least-once, made idempotent by the
row's key) — less than qconsole's guarantee, which only makes the comparison kinder to pgqueuer.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.models import Job

from bench.peers.common import EFFECT_INSERT_ASYNCPG, record_pickup


@asynccontextmanager
async def factory() -> AsyncIterator[PgQueuer]:
    dsn = os.environ["QCBENCH_DSN"]
    conn = await asyncpg.connect(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=int(os.environ.get("QCBENCH_POOL", "8")))
    pgq = PgQueuer.from_asyncpg_connection(conn)

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        return None

    @pgq.entrypoint("write")
    async def write(job: Job) -> None:
        i = int(job.payload or b"0")
        await pool.execute(EFFECT_INSERT_ASYNCPG, f"k{i}", i)

    @pgq.entrypoint("pickup")
    async def pickup(job: Job) -> None:
        record_pickup(int(job.payload or b"0"))

    try:
        yield pgq
    finally:
        await pool.close()
        await conn.close()
