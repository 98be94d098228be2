"""What keeps the worker fast without weakening the contract: a prefetch buffer (a job killed while it
waits there never starts), batched settlement of jobs with no transactional effect, and planner statistics
refreshed by housekeeping after a burst."""

from __future__ import annotations

from tests.worker_core.helpers import ledger, run_burst, running_worker, state, wait_for
from worker_core import db, ops
from worker_core.maintenance import analyze_if_stale
from worker_core.producer import enqueue, enqueue_many


def test_a_job_killed_in_the_prefetch_buffer_never_starts(dsn: str, conn: db.Conn) -> None:
    blocker = enqueue(conn, "t.slow", {"seconds": 1.5}, priority=0).id
    waiting = enqueue(conn, "t.ok", {"ledger": True, "item": "must-not-run"}, priority=1).id
    with running_worker(dsn, concurrency=1, prefetch=1, heartbeat_interval=0.1) as worker:
        wait_for(lambda: state(dsn, blocker) == "running" and state(dsn, waiting) == "running", timeout=10)
        assert waiting in worker._in_flight  # claimed ahead, waiting for the busy slot
        ops.kill(conn, [waiting])
        wait_for(lambda: state(dsn, waiting) == "cancelled", timeout=10)
        wait_for(lambda: state(dsn, blocker) == "succeeded", timeout=10)
    assert ledger(dsn) == []


def test_successes_without_effects_settle_in_batches(dsn: str, conn: db.Conn) -> None:
    enqueue_many(conn, [("t.ok", {}) for _ in range(60)])
    enqueue_many(conn, [("t.ok", {"ledger": True, "item": f"e{i}"}) for i in range(5)])
    enqueue(conn, "t.ledger", {"item": "k"}, idempotency_key="k")
    worker = run_burst(dsn, concurrency=4)
    assert conn.execute("SELECT count(*) AS n FROM job_queue WHERE state = 'succeeded'").fetchone() == {"n": 66}
    # the 60 that never touched ctx.tx went through the completer; the 6 with effects committed their own
    assert worker.completer.flushed == 60
    assert sorted(r["item"] for r in ledger(dsn)) == [*(f"e{i}" for i in range(5)), "k"]


def test_housekeeping_analyzes_a_queue_table_after_a_burst(conn: db.Conn) -> None:
    enqueue_many(conn, [("t.ok", {}) for _ in range(3000)])
    assert analyze_if_stale(conn) is True
    assert analyze_if_stale(conn) is False  # fresh now
