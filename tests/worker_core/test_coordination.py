"""Single-flight refills and optimistic writes, with real workers and concurrent jobs."""

from __future__ import annotations

import threading

import pytest

from tests.worker_core.helpers import ledger, run_burst, scalar
from worker_core import PermanentError, db
from worker_core.coordination import SingleFlightTimeout, single_flight
from worker_core.locks import PostgresLocks
from worker_core.optimistic import VersionConflict, versioned_update
from worker_core.producer import enqueue, enqueue_many

TASKS = ("tests.worker_core.tasks_contract",)


def test_fifty_concurrent_jobs_asking_for_one_key_see_a_single_refill(dsn: str, conn: db.Conn) -> None:
    conn.execute("CREATE TABLE refills (id serial PRIMARY KEY)")
    enqueue_many(conn, [("t.cached_rate", {"n": i}) for i in range(50)])

    workers = [threading.Thread(target=run_burst, args=(dsn,), kwargs={"task_modules": TASKS, "concurrency": 10})
               for _ in range(2)]  # fmt: skip
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
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
