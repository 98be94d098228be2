"""aenqueue and aenqueue_many: the producer API on a psycopg AsyncConnection, in the caller's async transaction.

An async service (FastAPI, aiohttp) holds an AsyncConnection; ``enqueue(aconn, ...)`` failed inside psycopg
(``'_AsyncGeneratorContextManager' object does not support the context manager protocol``). The async calls
run the very steps of the sync ones (worker_core.producer: validation, the contract's resolution, dedup), so
these tests check that they behave alike, not every rule again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import pytest

import tests.worker_core.tasks  # noqa: F401 - the t.* types
import worker_core
from tests.worker_core.helpers import job, run_burst
from worker_core import EnvelopeError, aenqueue, aenqueue_many, db, enqueue, producer
from worker_core.registry import Registry

T = TypeVar("T")


def on_async(dsn: str, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], autocommit: bool = False) -> T:
    """``work(aconn)`` on a fresh AsyncConnection of the application's (tuple rows, psycopg's default)."""

    async def main() -> T:
        aconn = await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit)
        try:
            return await work(aconn)
        finally:
            await aconn.close()

    return asyncio.run(main())


def count(dsn: str) -> int:
    with db.connect(dsn, autocommit=True) as c:
        got = c.execute("SELECT count(*) AS n FROM job_queue").fetchone()
    assert got is not None
    return int(got["n"])


def test_aenqueue_commits_and_rolls_back_with_the_callers_async_transaction(dsn: str) -> None:
    async def work(aconn: psycopg.AsyncConnection[Any]) -> Any:
        async with aconn.transaction():
            await aconn.execute("CREATE TABLE orders (id int)")
            await aconn.execute("INSERT INTO orders VALUES (1)")
            kept = await aenqueue(aconn, "t.ok", {"order": 1}, priority=3)
        with pytest.raises(RuntimeError):
            async with aconn.transaction():
                await aenqueue(aconn, "t.ok", {"order": 2})
                raise RuntimeError("the business write failed")
        return kept

    kept = on_async(dsn, work)
    assert kept.created
    got = job(dsn, kept.id)
    assert (got["payload"], got["priority"], got["state"]) == ({"order": 1}, 3, "queued")
    assert count(dsn) == 1  # the rolled-back one never existed


def test_aenqueue_before_the_business_write_belongs_to_the_callers_transaction(dsn: str) -> None:
    """A non-autocommit connection with no transaction open: the job opens the caller's, which commits it."""

    async def work(aconn: psycopg.AsyncConnection[Any]) -> Any:
        res = await aenqueue(aconn, "t.ok", {})
        seen_before_commit = count(dsn)
        await aconn.commit()
        return res, seen_before_commit

    res, seen_before_commit = on_async(dsn, work)
    assert seen_before_commit == 0 and job(dsn, res.id)["state"] == "queued"


def test_aenqueue_on_an_autocommit_connection_and_its_dedup(dsn: str) -> None:
    async def work(aconn: psycopg.AsyncConnection[Any]) -> Any:
        first = await aenqueue(aconn, "t.ok", {}, dedup_key="order:1")
        again = await aenqueue(aconn, "t.ok", {}, dedup_key="order:1")
        return first, again

    first, again = on_async(dsn, work, autocommit=True)
    assert first.created and not again.created and again.id == first.id
    with db.connect(dsn, autocommit=True) as c:
        hits = c.execute("SELECT sum(hits) AS n FROM dedup_hit_counts").fetchone()
    assert hits is not None and hits["n"] == 1  # the hit is counted as enqueue counts it


def test_aenqueue_validates_as_enqueue_does_and_writes_nothing(dsn: str) -> None:
    async def refused(aconn: psycopg.AsyncConnection[Any]) -> list[str]:
        problems = []
        for job_type, fields in (("t.ledger", {}), ("t.ok", {"max_attempts": 0, "timeout": 5})):
            with pytest.raises(EnvelopeError) as err:
                await aenqueue(aconn, job_type, {}, **fields)
            problems += err.value.problems
        return problems

    problems = on_async(dsn, refused, autocommit=True)
    assert "an idempotency_key is required" in problems[0]  # t.ledger's @task requires one
    assert any("max_attempts must be" in p for p in problems)
    assert any("did you mean 'timeout_seconds'" in p for p in problems)
    assert count(dsn) == 0


def test_aenqueue_many_keeps_input_order_collapses_duplicates_and_lists_every_problem(dsn: str) -> None:
    async def work(aconn: psycopg.AsyncConnection[Any]) -> Any:
        async with aconn.transaction():
            results = await aenqueue_many(
                aconn,
                [("t.ok", {"n": 1}), ("t.ok", {"n": 2}, {"dedup_key": "k"}), ("t.ok", {"n": 3}, {"dedup_key": "k"})],
            )
        with pytest.raises(EnvelopeError) as err:
            await aenqueue_many(aconn, [("t.ok", {}), ("t.ok", [1]), ("Bad", {})])
        return results, err.value.problems

    results, problems = on_async(dsn, work)
    assert [r.created for r in results] == [True, True, False] and results[2].id == results[1].id
    assert [job(dsn, r.id)["payload"]["n"] for r in results[:2]] == [1, 2]
    assert [p[:6] for p in problems] == ["job 1:", "job 2:"]
    assert count(dsn) == 2


def test_aenqueue_takes_the_contract_the_workers_registered(dsn: str) -> None:
    run_burst(dsn)  # registers the t.* contracts: t.swallow has max_attempts=2
    producer._registered_cache.clear()

    async def work(aconn: psycopg.AsyncConnection[Any]) -> Any:
        async with aconn.transaction():
            return await aenqueue(aconn, "t.swallow", {}, registry=Registry())

    assert job(dsn, on_async(dsn, work).id)["max_attempts"] == 2


def test_a_connection_of_the_other_kind_is_refused_with_the_call_that_takes_it(dsn: str) -> None:
    async def sync_call_on_async(aconn: psycopg.AsyncConnection[Any]) -> None:
        async with aconn.transaction():
            for call in (
                lambda: enqueue(aconn, "t.ok", {}),  # type: ignore[arg-type]
                lambda: worker_core.enqueue_many(aconn, [("t.ok", {})]),  # type: ignore[arg-type]
            ):
                with pytest.raises(TypeError, match=r"AsyncConnection.*await worker_core\.aenqueue"):
                    call()

    on_async(dsn, sync_call_on_async)
    refused = pytest.raises(TypeError, match=r"takes a psycopg\.AsyncConnection.*worker_core\.enqueue_many")
    with db.connect(dsn) as conn, refused:
        asyncio.run(aenqueue_many(conn, [("t.ok", {})]))  # type: ignore[arg-type]
    assert count(dsn) == 0


def test_aenqueue_on_an_unmigrated_database_says_to_migrate(empty_dsn: str) -> None:
    async def work(aconn: psycopg.AsyncConnection[Any]) -> None:
        with pytest.raises(worker_core.NotMigrated, match="qconsole migrate"):
            await aenqueue(aconn, "t.ok", {}, scheduled_at=dt.datetime.now(dt.timezone.utc))

    on_async(empty_dsn, work, autocommit=True)
