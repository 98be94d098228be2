"""Single-flight refills and optimistic writes, with real workers and concurrent jobs."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from tests.worker_core.helpers import WorkerThread, job, ledger, run_burst, running_worker, scalar, state, wait_for
from worker_core import PermanentError, db
from worker_core.coordination import SingleFlightTimeout, single_flight
from worker_core.locks import PostgresLocks
from worker_core.optimistic import VersionConflict, versioned_update
from worker_core.producer import enqueue, enqueue_many

TASKS = ("tests.worker_core.tasks_contract",)


def test_fifty_concurrent_jobs_asking_for_one_key_see_a_single_refill(dsn: str, conn: db.Conn) -> None:
    conn.execute("CREATE TABLE refills (id serial PRIMARY KEY)")
    enqueue_many(conn, [("t.cached_rate", {"n": i}) for i in range(50)])

    workers = [WorkerThread(dsn, task_modules=TASKS, concurrency=10).start() for _ in range(2)]
    assert [w.join(120) for w in workers] == [0, 0]  # a worker's error, or one still running, fails the test
    assert scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'succeeded'") == 50
    assert scalar(dsn, "SELECT count(*) FROM refills") == 1
    assert {r["item"] for r in ledger(dsn)} == {"1.1"}


def test_single_flight_waiters_give_up_after_their_bound(dsn: str, conn: db.Conn) -> None:
    # somebody else holds the refill lease and never finishes
    assert PostgresLocks().acquire(conn, "single-flight:slow", "someone-else", 60)
    with pytest.raises(SingleFlightTimeout):
        single_flight("slow", 60, lambda: 1, conn=conn, wait=0.3)


def test_single_flight_takes_over_when_the_refiller_died(dsn: str, conn: db.Conn) -> None:
    assert PostgresLocks().acquire(conn, "single-flight:k", "dead-refiller", 0.2)  # its lease runs out
    assert single_flight("k", 60, lambda: {"v": 2}, conn=conn, wait=5) == {"v": 2}
    assert single_flight("k", 60, lambda: {"v": 3}, conn=conn, wait=5) == {"v": 2}  # cached, not refilled


def test_a_refill_longer_than_its_lease_is_still_the_only_one(dsn: str, conn: db.Conn) -> None:
    """The refill's lease is extended while it runs: one longer than ``lease`` let a second caller take the
    lease over and refill again, the stampede single_flight is there to stop."""
    refills: list[str] = []

    def refill(who: str) -> dict[str, str]:
        refills.append(who)
        time.sleep(1.5)  # five leases of 0.3 s
        return {"by": who}

    got: dict[str, object] = {}

    def second() -> None:
        wait_for(lambda: refills == ["first"], 10, what="the first one to hold the lease and refill")
        got["second"] = single_flight("slow-refill", 60, lambda: refill("second"), dsn=dsn, wait=10, lease=0.3)

    t = threading.Thread(target=second)
    t.start()
    got["first"] = single_flight("slow-refill", 60, lambda: refill("first"), dsn=dsn, wait=10, lease=0.3)
    t.join(15)
    assert not t.is_alive()
    assert refills == ["first"]
    assert got == {"first": {"by": "first"}, "second": {"by": "first"}}


def test_a_refills_value_comes_back_as_stored_and_bad_values_fail_before_the_write(conn: db.Conn) -> None:
    assert single_flight("shape", 60, lambda: {"pair": (1, 2)}, conn=conn) == {"pair": [1, 2]}  # as the others see it
    with pytest.raises(ValueError, match="not storable as JSON"):
        single_flight("nan", 60, lambda: {"x": float("nan")}, conn=conn)
    with pytest.raises(ValueError, match="NUL character"):
        single_flight("nul", 60, lambda: {"x": "a\x00b"}, conn=conn)
    assert scalar_in(conn, "SELECT count(*) FROM resource_locks") == 0  # their leases released


def scalar_in(conn: db.Conn, query: str) -> object:
    row = conn.execute(query).fetchone()
    assert row is not None
    return next(iter(row.values()))


def test_versioned_update_raises_a_transient_conflict(conn: db.Conn) -> None:
    conn.execute("CREATE TABLE accounts (id text PRIMARY KEY, balance int NOT NULL, version int NOT NULL)")
    conn.execute("INSERT INTO accounts VALUES ('a', 10, 1)")
    assert versioned_update(conn, "accounts", {"id": "a"}, 1, {"balance": 15}) == 2
    with pytest.raises(VersionConflict):
        versioned_update(conn, "accounts", {"id": "a"}, 1, {"balance": 99})
    assert conn.execute("SELECT balance, version FROM accounts").fetchone() == {"balance": 15, "version": 2}
    # a None key or version is a bug of the caller, not a conflict that a retry could resolve
    with pytest.raises(PermanentError):
        versioned_update(conn, "accounts", {"id": None}, 2, {"balance": 1})
    with pytest.raises(PermanentError):
        versioned_update(conn, "accounts", {"id": "a"}, None, {"balance": 1})  # type: ignore[arg-type]


def test_concurrent_jobs_updating_one_entity_lose_no_update(dsn: str, conn: db.Conn) -> None:
    conn.execute("CREATE TABLE accounts (id text PRIMARY KEY, balance int NOT NULL, version int NOT NULL)")
    conn.execute("INSERT INTO accounts VALUES ('acc_1', 0, 1)")
    for amount in (5, 7, 11, 13):
        enqueue(conn, "t.deposit", {"account": "acc_1", "amount": amount})
    worker = run_burst(dsn, task_modules=TASKS, concurrency=4)
    assert scalar(dsn, "SELECT balance FROM accounts") == 36
    assert scalar(dsn, "SELECT version FROM accounts") == 5
    retried = scalar(dsn, "SELECT coalesce(sum(retried), 0) FROM job_metrics_minute WHERE job_type = 't.deposit'")
    assert retried >= 1, "four concurrent read-modify-writes must have collided at least once"
    assert worker.claimed_total >= 5


def test_a_kill_cancels_a_running_async_handler_and_rolls_back_its_writes(dsn: str, conn: db.Conn) -> None:
    from tests.worker_core.helpers import running_worker, state, wait_for
    from worker_core import ops

    conn.execute("CREATE TABLE refills (id serial PRIMARY KEY)")
    jid = enqueue(conn, "t.async_sleep", {"seconds": 30}).id
    with running_worker(dsn, task_modules=TASKS, heartbeat_interval=0.2):
        wait_for(lambda: state(dsn, jid) == "running", timeout=10)
        wait_for(lambda: scalar(dsn, "SELECT count(*) FROM refills") == 1, timeout=10, what="the handler to start")
        ops.kill(conn, [jid], actor=ops.Actor("tester"))
        wait_for(lambda: state(dsn, jid) == "cancelled", timeout=10, what="the kill to reach the async handler")
    assert scalar(dsn, "SELECT count(*) FROM refills") == 2  # CancelledError was raised inside the handler
    assert ledger(dsn) == []  # its write rolled back
    assert scalar(dsn, "SELECT attempts FROM job_queue WHERE id = %s", (jid,)) == 1  # never retried


def test_an_async_caller_cancelled_while_taking_the_lease_does_not_keep_it(dsn: str) -> None:
    """Cancelled while its lease's INSERT waits: that INSERT may still commit, and its lease would hold
    every other caller off for ``lease`` seconds. It is released on a connection of its own."""
    import asyncio

    from worker_core.coordination import asingle_flight

    with db.connect(dsn) as blocker, db.connect(dsn, autocommit=True) as look:
        # an uncommitted lease row: the caller's INSERT ... ON CONFLICT waits on it
        blocker.execute(
            "INSERT INTO resource_locks (lock_key, token, expires_at) VALUES ('single-flight:acancel', 'b', now())"
        )

        def callers(where: str) -> object:
            return scalar_in(
                look,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"  # noqa: S608
                f" AND application_name = 'worker_core-single-flight' {where}",
            )

        async def refill() -> int:
            return 1

        async def scenario() -> None:
            task = asyncio.ensure_future(asingle_flight("acancel", 60, refill, dsn=dsn, lease=60))
            await asyncio.to_thread(
                wait_for, lambda: callers("AND wait_event_type = 'Lock'") == 1, 10, what="the INSERT to wait"
            )
            task.cancel()
            blocker.rollback()  # the waiting INSERT goes through now, unless it was cancelled on the server
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(scenario())
        # the caller's sessions have ended (its INSERT, if it went through, committed by then)
        wait_for(lambda: callers("") == 0, 10, what="the caller's sessions to end")
        assert scalar_in(look, "SELECT count(*) FROM resource_locks WHERE lock_key = 'single-flight:acancel'") == 0


def test_asingle_flight_takes_a_plain_function_as_its_refill_as_well_as_a_coroutine(dsn: str) -> None:
    # `asingle_flight(key, ttl, lambda: {...})` in an async handler failed every attempt with "object dict can't
    # be used in 'await' expression", retried until dead-lettered
    import asyncio

    from worker_core.coordination import asingle_flight

    async def fetched() -> dict[str, int]:
        return {"rate": 3}

    async def scenario() -> list[Any]:
        return [
            await asingle_flight("plain", 60, lambda: {"rate": 1}, dsn=dsn),
            await asingle_flight("plain", 60, lambda: {"rate": 2}, dsn=dsn),  # cached: not refilled
            await asingle_flight("coroutine", 60, fetched, dsn=dsn),
            await asingle_flight("returns-a-coroutine", 60, lambda: fetched(), dsn=dsn),
        ]

    assert asyncio.run(scenario()) == [{"rate": 1}, {"rate": 1}, {"rate": 3}, {"rate": 3}]


def test_versioned_update_takes_any_column_name_and_refuses_what_no_retry_fixes(dsn: str, conn: db.Conn) -> None:
    import asyncio

    from worker_core.optimistic import aversioned_update

    conn.execute('CREATE TABLE odd ("a b" text PRIMARY KEY, "c)d" int NOT NULL, version int NOT NULL)')
    conn.execute("INSERT INTO odd VALUES ('k', 1, 1)")
    assert versioned_update(conn, "odd", {"a b": "k"}, 1, {"c)d": 2}) == 2  # a named placeholder broke on ")"
    with pytest.raises(ValueError, match="with '%' in it is not supported"):
        versioned_update(conn, "odd", {"a%b": "k"}, 2, {"c)d": 3})
    with pytest.raises(ValueError, match="leave it out of the changes"):
        versioned_update(conn, "odd", {"a b": "k"}, 2, {"version": 9})
    for bad in (1.5, float("nan"), True):
        with pytest.raises(PermanentError, match="must be an integer"):
            versioned_update(conn, "odd", {"a b": "k"}, bad, {"c)d": 3})  # type: ignore[arg-type]

    async def in_async_handler() -> int:
        aconn = await db.aconnect(dsn, autocommit=True)
        try:
            return await aversioned_update(aconn, "odd", {"a b": "k"}, 2, {"c)d": 3})
        finally:
            await aconn.close()

    assert asyncio.run(in_async_handler()) == 3
    assert conn.execute('SELECT "c)d" AS v, version FROM odd').fetchone() == {"v": 3, "version": 3}


def test_a_mistyped_lock_backend_url_does_not_show_its_password() -> None:
    from worker_core.locks import lock_backend

    with pytest.raises(ValueError) as caught:
        lock_backend("reddis://:S3cretPW@redis.internal:6379/0")
    assert "S3cretPW" not in str(caught.value) and "***" in str(caught.value)


def test_single_flight_on_a_plain_psycopg_connection(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as plain:  # tuple rows
        assert single_flight("plain", 60, lambda: {"v": 1}, conn=plain) == {"v": 1}
        assert single_flight("plain", 60, lambda: {"v": 2}, conn=plain) == {"v": 1}  # the cached one


class _Refusal(Exception):
    """A lock backend's answer refusing a call (Redis: a ResponseError)."""


class _BrokenBackend(PostgresLocks):
    """The PostgreSQL lock backend, with one of its calls refused as a Redis would refuse it (its ACL denies
    scripts, out of memory, read-only): ``acquire`` after taking the lease, or ``extend``."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken

    def refused(self, e: BaseException) -> bool:
        return isinstance(e, _Refusal)

    def acquire(self, conn: Any, key: str, token: str, ttl: float, job_id: Any = None) -> bool:
        taken = super().acquire(conn, key, token, ttl, job_id)
        if self.broken == "acquire":
            raise _Refusal("OOM command not allowed when used memory > 'maxmemory'")
        return taken

    def extend(self, conn: Any, key: str, token: str, ttl: float) -> bool:
        if self.broken == "extend":
            raise _Refusal("NOPERM this user has no permissions to run the 'evalsha' command")
        return super().extend(conn, key, token, ttl)


@pytest.mark.parametrize("broken", ["acquire", "extend"])
def test_a_lock_backend_that_keeps_failing_is_charged_to_the_job_not_looped(
    dsn: str, conn: db.Conn, broken: str
) -> None:
    # taken for contention or a lost lock, each time given back uncharged: the job ran again for ever (its
    # handler's outside effects each time), never charged, its errors never recorded; and a lease taken
    # whose answer was lost held the key for a whole lease, its token known to no one
    j = enqueue(conn, "t.ledger", {"item": "x"}, idempotency_key="ledger:x", lock_key="acct:1", max_attempts=2).id
    conn.commit()
    wt = WorkerThread(dsn, burst=False, heartbeat_interval=30)
    wt.worker.locks = _BrokenBackend(broken)
    wt.start()
    try:
        wait_for(lambda: state(dsn, j) == "dead_lettered", 30, what="the job to be charged to its dead letter")
    finally:
        wt.stop()
    errors = job(dsn, j)["errors"]
    assert [(e["kind"], e["class"]) for e in errors] == [("transient", "TransientError")] * 2
    assert "lock backend failed" in errors[-1]["message"] and ledger(dsn) == []
    assert scalar(dsn, "SELECT count(*) FROM resource_locks") == 0  # every lease taken was given back


def test_a_job_waiting_for_a_lock_is_never_charged_for_connections_dropped_under_it(
    dsn: str, conn: db.Conn, caplog: pytest.LogCaptureFixture
) -> None:
    # the PostgreSQL backend's acquire runs on the slot's connection: one an idle timeout (a pooler, a
    # firewall, idle_session_timeout) cut between two turns failed it, and after three such turns the job
    # was charged, and dead-lettered on its last attempt, for waiting on a lock
    assert PostgresLocks().acquire(conn, "acct:1", "another-holder", 600)
    conn.execute(f"ALTER DATABASE {conn.info.dbname} SET idle_session_timeout = '300ms'")
    j = enqueue(conn, "t.ok", {}, lock_key="acct:1", max_attempts=1).id
    conn.commit()
    caplog.set_level(logging.WARNING, logger="worker_core")
    with running_worker(dsn, concurrency=1, lock_contention_delay=0.6, heartbeat_interval=0.2):
        wait_for(lambda: caplog.text.count("lock backend failed") >= 6, 30, what="six dropped connections")
    assert (job(dsn, j)["state"], job(dsn, j)["attempts"], job(dsn, j)["errors"]) == ("queued", 0, [])
