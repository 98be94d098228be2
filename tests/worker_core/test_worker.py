"""Every state transition of DESIGN.md through real Workers (threads of this process, or processes), and
the guarantees around them: timeouts, fencing, exactly-once effects, dedup vs idempotency, retry delays
from the policy (injected clock), lock_key leases, kills, requeue, pause, graceful shutdown, --processes."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import psycopg
import pytest

from tests.worker_core.helpers import (
    TASKS,
    WorkerThread,
    config,
    job,
    ledger,
    metric,
    run_burst,
    running_worker,
    scalar,
    spawn_python,
    state,
    wait_for,
)
from worker_core import FixedClock, RetryPolicy, db, enqueue, ops
from worker_core.execution import JobConnection, JobCursor
from worker_core.locks import PostgresLocks
from worker_core.signals import SUPERVISOR_STOP
from worker_core.supervisor import Supervisor
from worker_core.worker import Worker

ME = ops.Actor("tester")
NEEDS_TASKGROUP = pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is Python 3.11+")


def kinds(dsn: str, job_id: uuid.UUID) -> list[str]:
    return [e["kind"] for e in job(dsn, job_id)["errors"]]


def assert_settled(row: dict[str, Any], state_: str, attempts: int) -> None:
    assert (row["state"], row["attempts"]) == (state_, attempts), row["errors"]
    assert row["locked_until"] is None and row["finished_at"] is not None


# --------------------------------------------------------------------------- the state machine


def test_ok_succeeds_once(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.ok", {"ledger": True, "item": "a"}).id
    run_burst(dsn)
    row = job(dsn, j)
    assert_settled(row, "succeeded", 1)
    assert row["errors"] == [] and row["started_at"] is not None
    assert ledger(dsn) == [{"job_id": j, "item": "a", "attempt": 1}]
    assert metric(dsn, "succeeded") == 1 and metric(dsn, "started") == 1


def test_transient_errors_are_retried_then_succeed(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.flaky", {"fail_times": 2, "ledger": True}).id
    run_burst(dsn)
    row = job(dsn, j)
    assert_settled(row, "succeeded", 3)
    assert [(e["kind"], e["class"], e["attempt"]) for e in row["errors"]] == [
        ("transient", "TransientError", 1),
        ("transient", "TransientError", 2),
    ]
    assert row["errors"][1]["message"] == "upstream 503 on attempt 2"
    assert [r["attempt"] for r in ledger(dsn)] == [3]
    assert metric(dsn, "retried") == 2 and metric(dsn, "succeeded") == 1


def test_permanent_error_fails_at_once(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.permanent", {"invoice": "inv_42"}, max_attempts=5).id
    run_burst(dsn)
    row = job(dsn, j)
    assert_settled(row, "failed", 1)
    assert kinds(dsn, j) == ["permanent"]
    assert row["last_error"] == "PermanentError: invoice inv_42 does not exist"
    assert row["error_fingerprint"] == "PermanentError: invoice <id> does not exist"
    assert metric(dsn, "failed") == 1 and metric(dsn, "retried") == 0


@NEEDS_TASKGROUP
def test_a_permanent_error_inside_a_taskgroup_fails_the_job_at_once(conn: db.Conn, dsn: str) -> None:
    # the child's PermanentError reached the worker wrapped in an ExceptionGroup: classified unknown, it was
    # retried to its dead letters, its error recorded as "unhandled errors in a TaskGroup (1 sub-exception)"
    j = enqueue(conn, "t.fan_out", {"children": ["permanent"], "invoice": "inv_42"}).id
    run_burst(dsn)
    row = job(dsn, j)
    assert_settled(row, "failed", 1)
    assert [(e["kind"], e["class"]) for e in row["errors"]] == [("permanent", "ExceptionGroup")]
    assert row["last_error"] == (
        "ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception): "
        "PermanentError: invoice inv_42 does not exist"
    )
    assert row["error_fingerprint"].endswith("PermanentError: invoice <id> does not exist")
    assert metric(dsn, "failed") == 1 and metric(dsn, "retried") == 0 and metric(dsn, "anomalies") == 0


@NEEDS_TASKGROUP
def test_transient_errors_inside_a_taskgroup_retry_after_the_longest_delay_they_ask(conn: db.Conn, dsn: str) -> None:
    # an ExceptionGroup was classified unknown (an anomaly) and its children's retry_in were never read
    clock = FixedClock(dt.datetime.now(dt.timezone.utc).replace(microsecond=0))
    j = enqueue(conn, "t.fan_out", {"children": [7, None, 30, "0.5"]}, clock=clock).id
    with running_worker(dsn, clock=clock):
        row = wait_for(lambda: (r := job(dsn, j))["state"] == "retry_scheduled" and r, 10, what="the retry")
        assert row["scheduled_at"] == clock.now() + dt.timedelta(seconds=30)
        assert [e["kind"] for e in row["errors"]] == ["transient"]
        assert row["errors"][0]["message"] == (
            "unhandled errors in a TaskGroup (4 sub-exceptions): "
            + "; ".join(["TransientError: rate limited"] * 4)
        )
        clock.advance(30)
        wait_for(lambda: state(dsn, j) == "succeeded", 10, what="the second attempt")
    assert metric(dsn, "anomalies") == 0


def test_unknown_errors_are_retried_as_anomalies_then_dead_lettered(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.unknown", {"key": "customer_id"}).id  # max_attempts=2 from the task
    run_burst(dsn)
    row = job(dsn, j)
    assert_settled(row, "dead_lettered", 2)
    assert [(e["kind"], e["class"]) for e in row["errors"]] == [("unknown", "KeyError")] * 2
    assert metric(dsn, "anomalies") == 2 and metric(dsn, "retried") == 1 and metric(dsn, "dead_lettered") == 1


def test_base_exceptions_belong_to_their_job_and_the_worker_carries_on(conn: db.Conn, dsn: str) -> None:
    bad = {k: enqueue(conn, "t.base_exc", {"kind": k}).id for k in ("exit", "interrupt", "memory", "recursion")}
    good = [enqueue(conn, "t.ok", {"ledger": True, "item": str(i)}).id for i in range(6)]
    w = run_burst(dsn, concurrency=4)  # returns 0: the worker survived all of them
    classes = {"exit": "SystemExit", "interrupt": "KeyboardInterrupt", "memory": "MemoryError",
               "recursion": "RecursionError"}  # fmt: skip
    for k, j in bad.items():
        row = job(dsn, j)
        assert_settled(row, "dead_lettered", 1)  # max_attempts=1
        assert [(e["kind"], e["class"]) for e in row["errors"]] == [("unknown", classes[k])]
    for j in good:
        assert state(dsn, j) == "succeeded"
    assert len(ledger(dsn)) == 6
    assert w.claimed_total == 10


def test_an_async_handler_behind_a_decorator_or_in_an_object_runs_as_async(conn: db.Conn, dsn: str) -> None:
    # taken for sync (inspect.iscoroutinefunction of the handler itself), its coroutine was dropped unawaited
    # and the job settled succeeded, its body never run; a handler object that could not be hashed (a
    # dataclass) killed the claim loop, its claimed jobs left running for their whole lease
    # a sync wrapper that returns the coroutine of the async def it wraps is found out at its first call: the
    # job is given back, uncharged, and runs as async. One that runs the async def itself stays sync
    types = ("t.async_decorated", "t.async_callable", "t.sync_runs_async")
    ids = {t: enqueue(conn, t, {"item": t}).id for t in types}
    sneaky = enqueue(conn, "t.returns_coroutine", {}).id
    conn.commit()
    run_burst(dsn, timeout=30)
    assert {t: (state(dsn, j), job(dsn, j)["attempts"]) for t, j in ids.items()} == dict.fromkeys(ids, ("succeeded", 1))
    assert sorted(r["item"] for r in ledger(dsn)) == sorted(ids)
    assert (state(dsn, sneaky), job(dsn, sneaky)["attempts"]) == ("succeeded", 1)


def test_a_payload_too_deep_to_decode_fails_its_job_not_the_worker(conn: db.Conn, dsn: str) -> None:
    """Written by another producer than ours (ours refuses it): the claim decoded it with the stdlib's
    recursive json.loads, raised RecursionError after its commit, and the worker died with its batch."""
    good = [enqueue(conn, "t.ok", {"ledger": True, "item": str(i)}).id for i in range(3)]
    deep = enqueue(conn, "t.ok", {}).id
    conn.execute(
        "UPDATE job_queue SET payload = ('{\"a\":' || repeat('[', 5000) || repeat(']', 5000) || '}')::jsonb"
        " WHERE id = %s",
        (deep,),
    )
    w = run_burst(dsn, concurrency=2)
    row = conn.execute("SELECT state, attempts, last_error FROM job_queue WHERE id = %s", (deep,)).fetchone()
    assert row == {"state": "failed", "attempts": 1,
                   "last_error": "PermanentError: the payload cannot be decoded: nested too deeply"}  # fmt: skip
    assert [state(dsn, j) for j in good] == ["succeeded"] * 3
    assert w.claimed_total == 4


def test_a_finished_burst_worker_leaves_no_thread_or_connection_behind(conn: db.Conn, dsn: str) -> None:
    enqueue(conn, "t.ok", {})
    w = run_burst(dsn)
    wait_for(lambda: not any(t.is_alive() for t in w._threads), 10, what="the worker's threads to end")
    workers = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s"
    wait_for(lambda: scalar(dsn, workers, (w.config.application_name,)) == 0, 10, what="its connections to close")


# --------------------------------------------------------------------------- timeouts


def test_cooperative_sync_handler_is_stopped_at_its_timeout(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.slow", {"seconds": 60, "ledger": True}, timeout_seconds=0.5, max_attempts=1).id
    w = run_burst(dsn)
    row = job(dsn, j)
    assert_settled(row, "dead_lettered", 1)
    assert [(e["kind"], e["class"]) for e in row["errors"]] == [("timeout", "JobTimeout")]
    assert "timeout of 0.5s" in row["last_error"]
    assert ledger(dsn) == [] and w.zombies == 0
    assert metric(dsn, "timeouts") == 1


@pytest.mark.parametrize("cancel_grace", [0.2, 4.0], ids=["abandoned", "waited-for"])
def test_stubborn_sync_handler_times_out_and_its_late_write_never_commits(
    conn: db.Conn, dsn: str, cancel_grace: float
) -> None:
    # timeout 1 s; the handler ignores cancellation, sleeps 2.5 s, then writes to the ledger through ctx.tx
    j = enqueue(conn, "t.stubborn", {"seconds": 2.5, "item": "late"}).id
    w = run_burst(dsn, cancel_grace=cancel_grace)
    row = job(dsn, j)
    assert_settled(row, "dead_lettered", 1)
    assert kinds(dsn, j) == ["timeout"]
    assert w.zombies == (1 if cancel_grace < 1.5 else 0)
    # once the handler's thread has made its late write attempt: nothing of it is in the database
    wait_for(lambda: not any(t.is_alive() for t in w._threads), 15, what="the abandoned handler to finish")
    assert ledger(dsn) == []


def test_an_async_handler_that_ignores_its_cancellation_never_writes_into_the_next_job(
    conn: db.Conn, dsn: str
) -> None:
    # timeout 1 s: the handler swallows its cancellation and, 2.5 s in, writes through its ctx.tx; by then
    # the slot runs the next async job, whose transaction must not carry that write to its commit
    j = enqueue(conn, "t.async_stubborn", {"seconds": 2.5}, priority=0).id
    ok = enqueue(conn, "t.async_ok", {"item": "after", "sleep": 3}, priority=1).id
    run_burst(dsn, concurrency=1, cancel_grace=0.2)
    assert_settled(job(dsn, j), "dead_lettered", 1)
    assert state(dsn, ok) == "succeeded"
    assert [(r["job_id"], r["item"]) for r in ledger(dsn)] == [(ok, "after")]


def test_a_handler_abandoned_while_its_connection_opens_sends_nothing_through_it(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # it asks for ctx.tx just before its timeout (1 s); opening the slot's connection takes 1.5 s, so the
    # watchdog abandons it meanwhile and finds no connection to take away: the connection it then gets
    # must carry nothing of it (a sequence shows whatever reached the server, rolled back or not)
    conn.execute("CREATE SEQUENCE late_writes")
    j = enqueue(conn, "t.stubborn", {"seconds": 0.8, "sequence": "late_writes"}).id
    connect = db.connect

    def slow_slot_connect(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cls") is JobConnection:
            time.sleep(1.5)
        return connect(*args, **kwargs)

    monkeypatch.setattr(db, "connect", slow_slot_connect)
    w = run_burst(dsn, concurrency=1, cancel_grace=0.2)
    assert w.zombies == 1
    assert_settled(job(dsn, j), "dead_lettered", 1)
    time.sleep(1)  # the abandoned thread has long had its connection by now
    assert scalar(dsn, "SELECT is_called FROM late_writes") is False


@pytest.mark.parametrize("task", ["t.hold", "t.async_hold"], ids=["sync", "async"])
def test_an_abandoned_handler_holds_no_lock_its_next_attempt_needs(conn: db.Conn, dsn: str, task: str) -> None:
    # the first attempt writes through ctx.tx, then stays stuck for 8 s (deaf to its timeout of 1 s; the
    # async one blocks its event loop): its transaction holds the job's idempotency record. The second
    # attempt needs that record: it must run and succeed while the first is still stuck, so the worker has
    # ended the abandoned transaction on the server (the async one stayed open until the handler returned)
    seconds = 8.0
    j = enqueue(conn, task, {"seconds": seconds}, idempotency_key=f"hold-{task}").id
    with running_worker(dsn, concurrency=1, cancel_grace=0.2) as w:
        wait_for(lambda: state(dsn, j) == "succeeded", 30, what="the second attempt to succeed")
        assert w.zombies == 1
        slots = [t for t in w._threads if t.name.startswith("slot-")]  # the stuck one and its replacement
        assert len(slots) == 2 and all(t.is_alive() for t in slots), "the second attempt waited for the stuck one"
        # the stuck handler's late write, once it wakes, reaches nothing
        wait_for(lambda: sum(t.is_alive() for t in slots) == 1, seconds + 5, what="the abandoned handler to finish")
    assert [(r["item"], r["attempt"]) for r in ledger(dsn)] == [("attempt 2", 2)]
    assert job(dsn, j)["attempts"] == 2


def test_a_long_lived_worker_keeps_no_record_of_the_slot_threads_it_abandoned(conn: db.Conn, dsn: str) -> None:
    # Worker._threads kept every thread it had started: one more per abandoned handler, for the worker's life
    for i in range(6):  # deaf to their timeout of 1 s: abandoned and replaced, three at a time
        enqueue(conn, "t.stubborn", {"seconds": 1.4, "item": f"s{i}"})
    with running_worker(dsn, concurrency=3, cancel_grace=0.1, heartbeat_interval=0.3) as w:
        wait_for(lambda: w.zombies == 6, 30, what="six abandonments")
        wait_for(lambda: len([t for t in threading.enumerate() if t.name.startswith("slot-")]) == 3, 10,
                 what="the abandoned handlers to return")  # fmt: skip
        # what is left: the threads alive, and those that ended since the last replacement was started
        assert sum(not t.is_alive() for t in w._threads) <= 3, w._threads
    assert ledger(dsn) == []


def test_only_the_thread_that_uses_a_connection_closes_it(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # libpq is not thread-safe on one connection: the watchdog closing the connection of an abandoned
    # handler's thread, which may be inside libpq on it at that moment, frees what that thread reads
    closed_by: list[str] = []
    close = JobConnection.close

    def recording_close(self: JobConnection) -> None:
        closed_by.append(threading.current_thread().name)
        close(self)

    monkeypatch.setattr(JobConnection, "close", recording_close)
    # it writes through ctx.tx, then sleeps 2.5 s past its timeout of 1 s, holding its connection
    j = enqueue(conn, "t.hold", {"seconds": 2.5}, idempotency_key="hold").id
    w = run_burst(dsn, cancel_grace=0.2)
    assert w.zombies == 1
    assert_settled(job(dsn, j), "succeeded", 2)
    wait_for(lambda: not any(t.is_alive() for t in w._threads), 15, what="the abandoned handler to finish")
    assert closed_by and "watchdog" not in closed_by
    assert [(r["item"], r["attempt"]) for r in ledger(dsn)] == [("attempt 2", 2)]


def test_the_connection_of_an_abandoned_slot_sends_nothing(conn: db.Conn, dsn: str) -> None:
    # whatever way a stuck handler uses ctx.tx once its slot was given up, nothing reaches the server
    conn.execute("CREATE SEQUENCE abandoned_sends")
    conn.commit()
    tx = cast(JobConnection, db.connect(dsn, cls=JobConnection))
    tx.cursor_factory = JobCursor
    tx.slot = cast(Any, SimpleNamespace(abandoned=True, handler_running=False))
    nextval = "SELECT nextval('abandoned_sends')"
    attempts: list[Callable[[], object]] = [
        lambda: tx.execute(nextval),
        lambda: tx.cursor().executemany(nextval, [()]),
        lambda: list(tx.cursor().stream(nextval)),
        lambda: tx.cursor().copy(f"COPY ({nextval}) TO STDOUT").__enter__(),
        tx.commit,
    ]
    try:
        for attempt in attempts:
            with pytest.raises(psycopg.OperationalError, match="abandoned"):
                attempt()
    finally:
        tx.close()
    assert scalar(dsn, "SELECT is_called FROM abandoned_sends") is False


def test_an_async_handler_whose_task_ends_cancelled_unasked_fails_and_commits_nothing(
    conn: db.Conn, dsn: str
) -> None:
    j = enqueue(conn, "t.async_self_cancel", {}).id
    run_burst(dsn)
    row = job(dsn, j)
    assert (row["state"], row["attempts"]) == ("succeeded", 2)
    assert [e["class"] for e in row["errors"]] == ["CancelledError"]
    assert [r["attempt"] for r in ledger(dsn)] == [2]  # the first attempt's write did not commit


def test_an_async_job_waiting_on_its_key_behind_another_is_not_timed_out_for_the_wait(
    conn: db.Conn, dsn: str
) -> None:
    # B (timeout 1 s) has the key A holds while A runs for 3 s: B waits on the key's row, as a sync job
    # does, and its timeout starts with its handler. Then it finds the key processed: a hit, not a timeout
    a = enqueue(conn, "t.async_ok", {"sleep": 3, "item": "A"}, idempotency_key="K").id
    conn.commit()
    with running_worker(dsn, concurrency=2, cancel_grace=0.2) as w:
        wait_for(lambda: state(dsn, a) == "running", 10, what="A to start")
        time.sleep(0.2)  # A holds the key's row now
        b = enqueue(conn, "t.async_ok", {"item": "B"}, idempotency_key="K", timeout_seconds=1,
                    visibility_timeout_seconds=10).id  # fmt: skip
        conn.commit()
        wait_for(lambda: state(dsn, b) == "succeeded", 15, what="B to settle")
    assert job(dsn, b)["errors"] == [] and w.zombies == 0
    assert [r["item"] for r in ledger(dsn)] == ["A"]


@pytest.mark.parametrize("job_type", ["t.ledger", "t.async_ok"])
@pytest.mark.parametrize("how", ["kill", "shutdown"])
def test_a_job_waiting_for_its_key_can_be_killed_or_released(conn: db.Conn, dsn: str, job_type: str, how: str) -> None:
    # the wait for a key another transaction holds (here a frozen one) had no end: a killed job ran its
    # handler once the wait was over, and a stopped worker left the job running, its for a whole lease
    with db.connect(dsn) as holder:
        holder.execute(
            "INSERT INTO processed_keys (idempotency_key, job_id, job_type, processed_at, expires_at)"
            " VALUES ('K', gen_random_uuid(), 't.other', now(), now() + interval '1 day')"
        )  # not committed: the job's own record waits for this transaction to end
        j = enqueue(conn, job_type, {"item": "B"}, idempotency_key="K", visibility_timeout_seconds=120).id
        conn.commit()
        with running_worker(dsn, heartbeat_interval=0.2, cancel_grace=0.2, shutdown_grace=0.5):
            wait_for(lambda: state(dsn, j) == "running", 10, what="the job to wait for its key")
            time.sleep(0.3)
            if how == "kill":
                ops.kill(conn, [j], actor=ME, reason="stuck")
                wait_for(lambda: state(dsn, j) == "cancelled", 10, what="the kill to end the job")
        holder.rollback()
    row = job(dsn, j)
    assert (row["state"], row["locked_by"]) == (("cancelled", row["locked_by"]) if how == "kill" else ("queued", None))
    assert ledger(dsn) == []  # its handler never ran


def test_async_handler_is_cancelled_at_its_timeout(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.async_slow", {"seconds": 60}).id  # timeout 1 s, max_attempts 1
    ok = enqueue(conn, "t.async_ok", {"item": "after"}).id
    run_burst(dsn, concurrency=1)
    assert_settled(job(dsn, j), "dead_lettered", 1)
    assert kinds(dsn, j) == ["timeout"]
    assert state(dsn, ok) == "succeeded"  # the slot's event loop and connection still work
    assert [r["job_id"] for r in ledger(dsn)] == [ok]


# --------------------------------------------------------------------------- fencing and exactly once


def take_over(dsn: str, job_id: uuid.UUID, clock: FixedClock) -> Worker | None:
    """A worker B whose clock says the job's lease expired claims it; None if the row was busy (SKIP LOCKED
    skips it while the holder's heartbeat updates it)."""
    b = Worker(config(dsn), clock=clock)
    try:
        rows = b.claim(1)
    finally:
        if b._claim_conn is not None:
            b._claim_conn.close()
    assert [r["id"] for r in rows] in ([], [job_id])
    return b if rows else None


@pytest.mark.parametrize("heartbeat", [0.1, 30.0], ids=["heartbeat-sees-it", "settle-fence-refuses"])
def test_a_worker_whose_lease_was_taken_over_cannot_settle_and_rolls_back(
    conn: db.Conn, dsn: str, heartbeat: float
) -> None:
    j = enqueue(conn, "t.ledger", {"item": "fenced", "sleep": 1.0}, idempotency_key="fence-1").id
    a = WorkerThread(dsn, burst=False, heartbeat_interval=heartbeat).start()
    try:
        wait_for(lambda: job(dsn, j)["locked_by"] == a.worker.id, 10, what="worker A to claim")
        # A is inside the handler (its ledger write is done, uncommitted) when B takes the job over: to B's
        # clock, A's lease has expired (A froze, as far as anyone can tell)
        later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=1000)
        b = wait_for(lambda: take_over(dsn, j, FixedClock(later)), 10, what="B to take the job over")
        wait_for(lambda: a.worker.claimed_total == 1 and not a.worker._in_flight, 15, what="A to give up the job")
    finally:
        a.stop()
    row = job(dsn, j)
    assert (row["state"], row["locked_by"], row["attempts"]) == ("running", b.id, 2)  # A did not settle it
    assert ledger(dsn) == []  # A's write was rolled back
    assert scalar(dsn, "SELECT count(*) FROM processed_keys") == 0

    # B dies too; whoever rescues it runs it once, for good
    rescue_clock = FixedClock(later + dt.timedelta(seconds=row["visibility_timeout_seconds"] + 1))
    run_burst(dsn, clock=rescue_clock)
    assert_settled(job(dsn, j), "succeeded", 3)
    assert ledger(dsn) == [{"job_id": j, "item": "fenced", "attempt": 3}]


def test_effect_happens_once_when_the_handler_fails_after_writing(conn: db.Conn, dsn: str) -> None:
    ids = [enqueue(conn, "t.ledger", {"item": f"i{n}", "fail_after_write": 2}, idempotency_key=f"k{n}").id
           for n in range(4)]  # fmt: skip
    failing_async = enqueue(conn, "t.async_ok", {"item": "never", "fail": True}, max_attempts=2).id
    run_burst(dsn)
    for j in ids:
        assert_settled(job(dsn, j), "succeeded", 3)
    assert_settled(job(dsn, failing_async), "dead_lettered", 2)
    rows = ledger(dsn)
    assert sorted((r["job_id"], r["attempt"]) for r in rows) == sorted((j, 3) for j in ids)


def test_dedup_key_collapses_live_duplicates_and_frees_after_the_first_finishes(conn: db.Conn, dsn: str) -> None:
    first = enqueue(conn, "t.ok", {"ledger": True, "item": "first"}, dedup_key="report:7")
    dup = enqueue(conn, "t.ok", {"ledger": True, "item": "dup"}, dedup_key="report:7")
    assert first.created and not dup.created and dup.duplicate_of == first.id
    run_burst(dsn)
    assert state(dsn, first.id) == "succeeded"
    again = enqueue(conn, "t.ok", {"ledger": True, "item": "again"}, dedup_key="report:7")
    assert again.created and again.id != first.id
    run_burst(dsn)
    assert [r["item"] for r in ledger(dsn)] == ["first", "again"]


def test_idempotency_key_gives_one_effect_even_when_both_jobs_run_at_the_same_moment(
    conn: db.Conn, dsn: str
) -> None:
    # two messages, one business effect: both are jobs (no dedup key), both succeed, one effect
    a = enqueue(conn, "t.ledger", {"item": "invoice-1", "sleep": 0.5}, idempotency_key="invoice:inv_1").id
    b = enqueue(conn, "t.ledger", {"item": "invoice-1", "sleep": 0.5}, idempotency_key="invoice:inv_1").id
    run_burst(dsn, concurrency=2)
    ra, rb = job(dsn, a), job(dsn, b)
    assert ra["started_at"] == rb["started_at"]  # claimed together: they did run at the same moment
    assert_settled(ra, "succeeded", 1)
    assert_settled(rb, "succeeded", 1)
    (effect,) = ledger(dsn)
    assert effect["job_id"] in (a, b)
    assert scalar(dsn, "SELECT job_id FROM processed_keys WHERE idempotency_key = 'invoice:inv_1'") == effect["job_id"]
    assert metric(dsn, "idempotency_hits") == 1 and metric(dsn, "succeeded") == 2


# --------------------------------------------------------------------------- retry delays, injected clock


POLICIES = [
    ("type-default", None, [0.05, 0.05, 0.05]),  # t.flaky's FAST policy
    # an override is merged with the type's policy (FAST caps delays at 0.05 s): give the cap too
    ("fixed", {"backoff": "fixed", "base_seconds": 7, "max_delay_seconds": 600, "jitter": 0}, [7, 7, 7]),
    ("linear", {"backoff": "linear", "base_seconds": 3, "max_delay_seconds": 600, "jitter": 0}, [3, 6, 9]),
    ("exponential-capped", {"backoff": "exponential", "base_seconds": 2, "max_delay_seconds": 5, "jitter": 0},
     [2, 4, 5]),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "delays"), [p[1:] for p in POLICIES], ids=[p[0] for p in POLICIES])
def test_retry_delays_follow_the_policy(conn: db.Conn, dsn: str, policy: Any, delays: list[float]) -> None:
    clock = FixedClock(dt.datetime.now(dt.timezone.utc).replace(microsecond=0))
    fields = {"retry_policy": policy} if policy else {}
    j = enqueue(conn, "t.flaky", {"fail_times": 99}, max_attempts=len(delays) + 1, clock=clock, **fields).id
    with running_worker(dsn, clock=clock):
        for attempt, delay in enumerate(delays, start=1):
            row = wait_for(lambda a=attempt: (r := job(dsn, j))["attempts"] == a and r["state"] == "retry_scheduled"
                           and r, 10, what=f"retry after attempt {attempt}")  # fmt: skip
            failed_at = clock.now()
            assert row["scheduled_at"] == failed_at + dt.timedelta(seconds=delay)
            assert row["errors"][-1]["at"] == failed_at.isoformat()
            clock.advance(delay)  # due exactly now: claimable
        wait_for(lambda: state(dsn, j) == "dead_lettered", 10, what="the last attempt")
    assert job(dsn, j)["attempts"] == len(delays) + 1


@pytest.mark.parametrize("how", ["retry", "lock"])
def test_a_job_put_back_for_a_moment_runs_when_due_not_a_poll_later(conn: db.Conn, dsn: str, how: str) -> None:
    # nothing notifies a retry or a lock's contention coming due (NOTIFY comes with inserts): an idle worker
    # found them at its next poll, and jobs serialised behind one lock key waited up to a poll at each turn
    if how == "retry":
        ids = [enqueue(conn, "t.flaky", {"fail_times": 2}).id]  # retried twice, 0.05 s apart
    else:  # the second waits for the first's lock, its turn due again in ~0.2 s, as the first ends
        ids = [enqueue(conn, "t.slow", {"seconds": s}, lock_key="order:1").id for s in (0.1, 0.0)]
    conn.commit()
    with running_worker(dsn, poll_interval=60, lock_contention_delay=0.2, concurrency=2):
        wait_for(lambda: all(state(dsn, j) == "succeeded" for j in ids), 20, what="the jobs put back")
    if how == "retry":
        assert job(dsn, ids[0])["attempts"] == 3


def test_retry_jitter_stays_within_its_bounds(conn: db.Conn, dsn: str) -> None:
    clock = FixedClock(dt.datetime.now(dt.timezone.utc).replace(microsecond=0))
    policy = RetryPolicy("exponential", base_seconds=10, max_delay_seconds=12, jitter=0.5)
    ids = [enqueue(conn, "t.flaky", {"fail_times": 99}, retry_policy=policy, clock=clock).id for _ in range(8)]
    with running_worker(dsn, clock=clock):
        rows = [wait_for(lambda j=j: (r := job(dsn, j))["state"] == "retry_scheduled" and r, 10) for j in ids]
    delays = [(r["scheduled_at"] - clock.now()).total_seconds() for r in rows]
    assert all(5 <= d <= 12 for d in delays), delays  # 10 +- 50%, capped at 12
    assert len(set(delays)) > 1, "no jitter at all"


# --------------------------------------------------------------------------- lock_key


def _assert_never_overlapped(dsn: str, ids: list[uuid.UUID]) -> None:
    with db.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT job_id, started, ended FROM intervals WHERE job_id = ANY(%s) ORDER BY started", (ids,)
        ).fetchall()
        overlaps = c.execute(
            """SELECT count(*) AS n FROM intervals a JOIN intervals b
               ON a.job_id < b.job_id AND tstzrange(a.started, a.ended) && tstzrange(b.started, b.ended)
               WHERE a.job_id = ANY(%(ids)s) AND b.job_id = ANY(%(ids)s)""",
            {"ids": ids},
        ).fetchone()
    assert sorted(r["job_id"] for r in rows) == sorted(ids)
    assert overlaps == {"n": 0}, rows
    for j in ids:
        row = job(dsn, j)
        # contention rescheduled it and gave the attempt back: never a failure
        assert_settled(row, "succeeded", 1)
        assert row["errors"] == []
    assert metric(dsn, "lock_contention") >= 1


def test_jobs_sharing_a_lock_key_never_overlap(conn: db.Conn, dsn: str) -> None:
    ids = [enqueue(conn, "t.locked", {"seconds": 0.2}, lock_key="order:ord_987").id for _ in range(4)]
    free = enqueue(conn, "t.locked", {"seconds": 0.2}, lock_key="order:other").id
    run_burst(dsn, concurrency=5)
    _assert_never_overlapped(dsn, ids)
    assert state(dsn, free) == "succeeded"
    assert scalar(dsn, "SELECT count(*) FROM resource_locks") == 0  # every lease released
    assert metric(dsn, "started") == 5  # a rescheduled contention is no attempt started


@pytest.mark.parametrize(
    ("heartbeat", "thief_lease", "runs_after"),
    [(0.1, 1.0, 0.0), (30.0, 2.5, 2.0)],
    ids=["seen-by-a-heartbeat", "caught-at-the-commit"],
)
def test_a_job_that_loses_its_lock_key_lease_while_it_runs_commits_nothing_and_runs_again(
    conn: db.Conn, dsn: str, heartbeat: float, thief_lease: float, runs_after: float
) -> None:
    # during its 1.5 s another holder takes the lease (this one's ran out, say). A heartbeat sees it; with
    # no heartbeat in the job's time (a stalled process outlived its lease), the check in the job's own
    # transaction before its commit does. Nothing is committed without the lock; the job runs again once
    # the lock is free, its attempt given back
    j = enqueue(conn, "t.locked", {"seconds": 1.5}, lock_key="order:stolen").id
    conn.commit()
    with running_worker(dsn, heartbeat_interval=heartbeat, lock_contention_delay=0.2):
        wait_for(lambda: scalar(dsn, "SELECT count(*) FROM resource_locks") == 1, 10, what="the lock to be taken")
        time.sleep(0.3)
        stolen_at = scalar(
            dsn,
            "UPDATE resource_locks SET token = 'thief', expires_at = now() + make_interval(secs => %s)"
            " WHERE lock_key = 'order:stolen' RETURNING now()",
            (thief_lease,),
        )
        wait_for(lambda: state(dsn, j) == "succeeded", 20, what="the job to run again and succeed")
    rows = conn.execute("SELECT started FROM intervals WHERE job_id = %s", (j,)).fetchall()
    # the run that held the lock, only
    assert len(rows) == 1 and rows[0]["started"] > stolen_at + dt.timedelta(seconds=runs_after)
    assert job(dsn, j)["attempts"] == 1  # given back, not failed


def test_a_burst_worker_waits_for_a_job_it_gave_back_after_losing_its_lock(conn: db.Conn, dsn: str) -> None:
    # given back due a moment later, it was no work left for burst_remaining: the burst run (cron, CI) ended
    # with it queued
    j = enqueue(conn, "t.locked", {"seconds": 1.0}, lock_key="order:burst").id
    conn.commit()
    wt = WorkerThread(dsn, heartbeat_interval=0.2, lock_contention_delay=1.0).start()
    wait_for(lambda: scalar(dsn, "SELECT count(*) FROM resource_locks") == 1, 10, what="the lock to be taken")
    conn.execute(
        "UPDATE resource_locks SET token = 'thief', expires_at = now() + interval '0.3 seconds'"
        " WHERE lock_key = 'order:burst'"
    )
    conn.commit()
    assert wt.join(30) == 0
    assert state(dsn, j) == "succeeded"


def test_an_async_job_that_lost_its_lock_commits_nothing_either(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.async_ok", {"sleep": 1.5, "item": "a"}, lock_key="order:async").id
    conn.commit()
    with running_worker(dsn, heartbeat_interval=30, lock_contention_delay=0.2):
        wait_for(lambda: scalar(dsn, "SELECT count(*) FROM resource_locks") == 1, 10, what="the lock to be taken")
        conn.execute(
            "UPDATE resource_locks SET token = 'thief', expires_at = now() + interval '2.5 seconds'"
            " WHERE lock_key = 'order:async'"
        )
        conn.commit()
        time.sleep(2.0)  # the handler is done (1.5 s), the thief holds the lock on
        assert ledger(dsn) == [] and state(dsn, j) != "succeeded"
        wait_for(lambda: state(dsn, j) == "succeeded", 20, what="the job to run again and succeed")
    assert [r["item"] for r in ledger(dsn)] == ["a"]


def test_a_lock_backend_that_fails_to_extend_a_lease_does_not_stop_the_heartbeat(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    extend = PostgresLocks.extend
    back_at = time.monotonic() + 2.5

    def unreachable(*args: Any) -> bool:
        if time.monotonic() < back_at:
            raise ConnectionError("lock backend unreachable")
        return extend(*args)

    monkeypatch.setattr(PostgresLocks, "extend", unreachable)
    j = enqueue(conn, "t.locked", {"seconds": 4}, lock_key="order:flaky").id
    conn.commit()
    beat = "SELECT last_heartbeat_at FROM workers WHERE id = %s"
    with running_worker(dsn, heartbeat_interval=0.1) as w:
        wait_for(lambda: state(dsn, j) == "running", 10, what="the job to start")
        first = scalar(dsn, beat, (w.id,))
        # well within the job's 4 s
        wait_for(lambda: scalar(dsn, beat, (w.id,)) > first, 2, what="a beat while the lease cannot be extended")
        wait_for(lambda: state(dsn, j) == "succeeded", 10, what="the job to finish")


def test_a_lock_backend_that_hangs_holds_up_neither_the_job_leases_nor_the_workers_beat(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a Redis that stopped answering: each lock extension waited for its socket timeout, one job after
    # another, before the worker's row was written; the next beat (and the leases of every job held,
    # the prefetched ones too) came that much later, and a live worker's jobs were reclaimed as "died"
    calls: list[float] = []

    def hung(*args: Any) -> bool:
        calls.append(time.monotonic())
        time.sleep(1.5)
        raise TimeoutError("lock backend timed out")

    monkeypatch.setattr(PostgresLocks, "extend", hung)
    ids = [enqueue(conn, "t.locked", {"seconds": 5}, lock_key=f"order:{i}").id for i in range(4)]
    conn.commit()
    beat = "SELECT last_heartbeat_at FROM workers WHERE id = %s"
    with running_worker(dsn, heartbeat_interval=0.1, concurrency=4, cancel_grace=0.2) as w:
        wait_for(lambda: all(state(dsn, j) == "running" for j in ids), 10, what="the jobs to start")
        first = scalar(dsn, beat, (w.id,))
        # one hung call per beat (1.5 s), not one per job (6 s) before the worker's row
        wait_for(lambda: scalar(dsn, beat, (w.id,)) > first, 3, what="a beat while the backend hangs")
    assert calls


def test_the_lock_key_lease_of_an_abandoned_handler_is_not_given_away_while_it_may_still_run(
    conn: db.Conn, dsn: str
) -> None:
    # the handler ignores its timeout (1 s) and sleeps on (2.5 s): abandoned, its job settled, but Python
    # cannot stop its thread, which may still work on the locked resource. Its lease runs out by itself.
    j = enqueue(conn, "t.stubborn", {"seconds": 2.5}, lock_key="order:slow").id
    conn.commit()
    with running_worker(dsn, cancel_grace=0.2) as w:
        wait_for(lambda: state(dsn, j) == "dead_lettered", 10, what="the handler to be abandoned")
        assert w.zombies == 1
        assert scalar(dsn, "SELECT count(*) FROM resource_locks WHERE lock_key = 'order:slow'") == 1


REFUSE_SETTLING = """
CREATE FUNCTION refuse_settling() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'succeeded' AND OLD.state = 'running' AND NEW.id = %s::uuid THEN
        RAISE EXCEPTION 'the settlement refused (test)';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_settling BEFORE UPDATE ON job_queue FOR EACH ROW EXECUTE FUNCTION refuse_settling();
"""


@pytest.mark.parametrize("slow", ["row-held", "settlement-failing"])
def test_a_job_waiting_for_the_completer_keeps_its_lock_key_until_it_is_settled(
    conn: db.Conn, dsn: str, slow: str
) -> None:
    # a job with no effect to commit is settled by the completer after its handler; its lock was released when
    # the handler returned, before that settlement: a second job with the key ran while the first was still
    # running, its outcome unknown (killed, taken over: run again after the second). Here the completer cannot
    # settle it past its lock's lease (6.5 s): an operator's transaction holds its row, or the settlement fails
    lease = {"timeout_seconds": 1, "visibility_timeout_seconds": 6.5}
    first = enqueue(conn, "t.slow", {"seconds": 0.5}, lock_key="order:settling", **lease).id
    conn.commit()
    operator = db.connect(dsn)
    if slow == "settlement-failing":
        operator.execute(REFUSE_SETTLING.replace("%s", f"'{first}'"))
        operator.commit()
    try:
        with running_worker(dsn, heartbeat_interval=0.2, lock_contention_delay=0.1) as w:
            wait_for(lambda: state(dsn, first) == "running", 10, what="the first job to start")
            if slow == "row-held":
                operator.execute("SELECT 1 FROM job_queue WHERE id = %s FOR UPDATE", (first,))
            wait_for(lambda: first in {ex.job["id"] for ex in w.completer.waiting()}, 10,
                     what="the first job to wait for the completer")  # fmt: skip
            second = enqueue(conn, "t.locked", {"seconds": 0.1}, lock_key="order:settling").id
            conn.commit()
            time.sleep(7.5)  # past the first one's lock lease
            started = conn.execute("SELECT started FROM intervals WHERE job_id = %s", (second,)).fetchall()
            assert started == [], "the second job ran while the first one waited to be settled"
            assert state(dsn, first) == "running" and state(dsn, second) != "succeeded"
            let_go = scalar(dsn, "SELECT clock_timestamp()")
            if slow == "row-held":
                operator.rollback()
            else:
                operator.execute("DROP TRIGGER refuse_settling ON job_queue")
                operator.commit()
            wait_for(lambda: state(dsn, first) == state(dsn, second) == "succeeded", 20, what="both to succeed")
    finally:
        operator.close()
    (row,) = conn.execute("SELECT started FROM intervals WHERE job_id = %s", (second,)).fetchall()
    assert row["started"] > let_go
    assert scalar(dsn, "SELECT count(*) FROM resource_locks") == 0


REDIS = "redis://127.0.0.1:6379/15"


@pytest.fixture
def redis_url() -> str:
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS, socket_connect_timeout=1).ping()
    except Exception as e:
        pytest.skip(f"Redis is not reachable at {REDIS}: {e}")
    return REDIS


def test_jobs_sharing_a_lock_key_never_overlap_with_the_redis_backend(
    conn: db.Conn, dsn: str, redis_url: str
) -> None:
    import redis

    key = f"order:{uuid.uuid4().hex}"  # suites may share this Redis
    ids = [enqueue(conn, "t.locked", {"seconds": 0.2}, lock_key=key).id for _ in range(4)]
    run_burst(dsn, concurrency=4, lock_backend=redis_url)
    _assert_never_overlapped(dsn, ids)
    assert scalar(dsn, "SELECT count(*) FROM resource_locks") == 0  # the PostgreSQL backend was not used
    assert redis.Redis.from_url(redis_url).exists(f"qconsole:lock:{key}") == 0  # released


# --------------------------------------------------------------------------- operator actions


def test_kill_of_a_waiting_job_cancels_it_and_it_never_runs(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.ok", {"ledger": True}).id
    result = ops.kill(conn, [j], actor=ME, reason="wrong customer")
    assert result.changed == [j]
    row = job(dsn, j)
    assert (row["state"], row["attempts"]) == ("cancelled", 0)
    assert row["errors"][-1]["kind"] == "cancelled" and "tester" in row["last_error"]
    run_burst(dsn)
    assert state(dsn, j) == "cancelled" and ledger(dsn) == []


def test_kill_of_a_running_job_is_seen_within_a_heartbeat_and_never_retried(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.slow", {"seconds": 60, "ledger": True}).id  # max_attempts 5: retries were possible
    with running_worker(dsn, heartbeat_interval=0.2) as w:
        wait_for(lambda: state(dsn, j) == "running", 10, what="the job to start")
        assert ops.kill(conn, [j], actor=ME).changed == [j]
        wait_for(lambda: state(dsn, j) == "cancelled", 10, what="the worker to stop the job")
        assert w._in_flight == {} or wait_for(lambda: not w._in_flight, 5)
    row = job(dsn, j)
    assert_settled(row, "cancelled", 1)
    assert [(e["kind"], e["worker"]) for e in row["errors"]] == [("cancelled", w.id)]
    assert ledger(dsn) == []
    assert metric(dsn, "cancelled") == 1 and metric(dsn, "retried") == 0


@pytest.mark.parametrize("max_attempts", [3, 1], ids=["would-retry", "would-dead-letter"])
def test_a_killed_job_whose_handler_fails_before_the_kill_is_seen_is_not_retried(
    conn: db.Conn, dsn: str, max_attempts: int
) -> None:
    # killed while it runs; it fails (a retryable error) before the next heartbeat (30 s) could see the kill.
    # On its last attempt it would be dead-lettered, where a replay of its group would run it again.
    j = enqueue(conn, "t.fail_later", {"seconds": 1.0}, max_attempts=max_attempts).id
    with running_worker(dsn, heartbeat_interval=30) as w:
        wait_for(lambda: state(dsn, j) == "running", 10, what="the job to start")
        assert ops.kill(conn, [j], actor=ME).changed == [j]
        wait_for(lambda: state(dsn, j) not in ("running", "queued"), 10, what="the handler to fail")
        time.sleep(0.5)  # a retry would be due by now (its backoff is 0.05 s)
    row = job(dsn, j)
    assert_settled(row, "cancelled", 1)
    assert not row["cancel_requested"]
    assert [(e["kind"], e["class"]) for e in row["errors"]] == [("transient", "TransientError")]
    assert ledger(dsn) == [] and w.claimed_total == 1
    assert metric(dsn, "cancelled") == 1 and metric(dsn, "retried") == 0


@pytest.mark.parametrize("writes", [True, False], ids=["with-effects", "no-op"])
def test_a_killed_job_whose_handler_succeeds_before_the_kill_is_seen_ends_cancelled(
    conn: db.Conn, dsn: str, writes: bool
) -> None:
    # its success was settled, its writes committed, though the kill had given its dedup key away: an
    # equivalent message enqueued after the kill ran too, and the effect happened twice
    j = enqueue(conn, "t.slow", {"seconds": 1.0, "ledger": writes, "item": "once"}, dedup_key="order:1").id
    with running_worker(dsn, heartbeat_interval=30) as w:
        wait_for(lambda: state(dsn, j) == "running", 10, what="the job to start")
        assert ops.kill(conn, [j], actor=ME).changed == [j]
        again = enqueue(conn, "t.slow", {"seconds": 0, "ledger": writes, "item": "once"}, dedup_key="order:1")
        assert again.created and again.id != j
        conn.commit()
        wait_for(lambda: state(dsn, j) != "running" and state(dsn, again.id) == "succeeded", 10,
                 what="both jobs to end")  # fmt: skip
    row = job(dsn, j)
    assert_settled(row, "cancelled", 1)
    assert not row["cancel_requested"] and kinds(dsn, j) == ["cancelled"]
    assert [r["job_id"] for r in ledger(dsn)] == ([again.id] if writes else [])
    assert metric(dsn, "cancelled") == 1 and metric(dsn, "succeeded") == 1 and w.claimed_total == 2


def test_a_kill_during_a_graceful_shutdown_is_still_seen(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.slow", {"seconds": 60}).id
    wt = WorkerThread(dsn, burst=False, heartbeat_interval=0.2, shutdown_grace=60).start()
    try:
        wait_for(lambda: state(dsn, j) == "running", 10, what="the job to start")
        wt.worker.stop()  # graceful: the job may finish within 60 s
        ops.kill(conn, [j], actor=ME)
        # generous bound: the chaos test may load the machine at the same time (it returns at once when seen)
        wait_for(lambda: state(dsn, j) == "cancelled", 40, what="the kill to be seen during the grace period")
    finally:
        assert wt.join(30) == 0


def test_a_kill_the_worker_had_not_seen_when_it_releases_the_job_still_cancels_it(conn: db.Conn, dsn: str) -> None:
    # the shutdown grace (0.2 s) ends long before the next heartbeat (30 s) could see the kill
    j = enqueue(conn, "t.slow", {"seconds": 60, "ledger": True}).id
    wt = WorkerThread(dsn, burst=False, heartbeat_interval=30, shutdown_grace=0.2).start()
    try:
        wait_for(lambda: state(dsn, j) == "running", 10, what="the job to start")
        ops.kill(conn, [j], actor=ME)
    finally:
        assert wt.stop() == 0
    row = job(dsn, j)
    assert_settled(row, "cancelled", 1)  # not released to run again
    assert not row["cancel_requested"] and kinds(dsn, j) == ["cancelled"]
    assert run_burst(dsn).claimed_total == 0 and ledger(dsn) == []


def test_requeue_of_a_dead_letter_gives_a_fresh_budget_and_keeps_history(conn: db.Conn, dsn: str) -> None:
    j = enqueue(conn, "t.flaky", {"fail_times": 2, "ledger": True}, max_attempts=2).id
    run_burst(dsn)
    assert_settled(job(dsn, j), "dead_lettered", 2)
    result = ops.requeue(conn, [j], actor=ME, reason="upstream fixed")
    assert result.changed == [j]
    row = job(dsn, j)
    assert (row["state"], row["max_attempts"], row["finished_at"]) == ("queued", 3, None)
    run_burst(dsn)
    row = job(dsn, j)
    assert_settled(row, "succeeded", 3)
    assert [(e["kind"], e["attempt"]) for e in row["errors"]] == [("transient", 1), ("transient", 2)]
    assert [r["attempt"] for r in ledger(dsn)] == [3]
    # only final failures can be requeued
    assert ops.requeue(conn, [j], actor=ME).changed == []


def test_pause_and_resume(conn: db.Conn, dsn: str) -> None:
    ops.pause(conn, "default", actor=ME)
    held = enqueue(conn, "t.ok", {}).id
    other = enqueue(conn, "t.ok", {}, queue="elsewhere").id
    run_burst(dsn)  # a paused queue is not work to wait for
    assert state(dsn, held) == "queued" and state(dsn, other) == "succeeded"
    ops.resume(conn, "default", actor=ME)
    run_burst(dsn)
    assert state(dsn, held) == "succeeded"


def test_a_pause_gives_back_at_once_the_jobs_a_worker_claimed_but_has_not_started(conn: db.Conn, dsn: str) -> None:
    # the pause changed the next claims only: the jobs in the worker's prefetch buffer still started after
    # it, one after another (up to hundreds of fast grouped ones). Then they were given back only once a
    # slot came free: held and counted running for as long as the job in hand ran
    ids = [enqueue(conn, "t.slow", {"seconds": 6.0}, queue="q").id for _ in range(4)]
    conn.commit()
    with running_worker(dsn, concurrency=1, prefetch=3, heartbeat_interval=0.2, shutdown_grace=0):
        wait_for(lambda: [state(dsn, j) for j in ids].count("running") == 4, 10, what="a claim of all four")
        ops.pause(conn, "q", actor=ME)
        conn.commit()
        wait_for(lambda: [state(dsn, j) for j in ids].count("queued") == 3, 4, what="three given back")
        rows = [job(dsn, j) for j in ids]  # the one running goes on
    assert sorted(r["state"] for r in rows) == ["queued", "queued", "queued", "running"], rows
    assert sorted(r["attempts"] for r in rows) == [0, 0, 0, 1]  # released uncharged


def test_a_slot_that_gave_up_in_a_long_outage_still_waits_out_the_next_blip(conn: db.Conn, dsn: str) -> None:
    # the slot's "unreachable" mark of one give-up stayed for good: every later settlement got one try, a
    # blip of a second left the job running until its lease ran out, taken for a worker that died (and
    # as a suspect, blips could dead-letter it unrun)
    from tests.worker_core.helpers import FreezingProxy

    short = {"sleep": 0.5}
    lease = {"timeout_seconds": 1, "visibility_timeout_seconds": 6.1}
    proxy = FreezingProxy.before(dsn)
    a = enqueue(conn, "t.fail_slowly", short, **lease).id
    conn.commit()
    wt = WorkerThread(proxy.dsn, burst=False, concurrency=1, group_max=1, heartbeat_interval=0.2).start()
    try:
        wait_for(lambda: state(dsn, a) == "running", 10, what="A to start")
        proxy.cut()  # A's failure is settled during an outage longer than its lease: given up
        time.sleep(7.5)
        proxy.restore()
        b = enqueue(conn, "t.fail_slowly", short, priority=-1, **lease).id
        conn.commit()
        wait_for(lambda: state(dsn, b) == "running", 30, what="B to start")
        proxy.cut()  # a blip while B's failure is settled
        time.sleep(1.5)
        proxy.restore()
        wait_for(lambda: bool(kinds(dsn, b)), 20, what="B's first failure settled")
    finally:
        wt.stop()
        proxy.close()
    assert kinds(dsn, b)[0] == "transient", job(dsn, b)["errors"]  # not lease_expired, a lease later


def test_a_stop_gives_back_at_once_the_jobs_a_worker_claimed_but_has_not_started(conn: db.Conn, dsn: str) -> None:
    ids = [enqueue(conn, "t.slow", {"seconds": 6.0}).id for _ in range(4)]
    conn.commit()
    wt = WorkerThread(dsn, burst=False, concurrency=1, prefetch=3, heartbeat_interval=0.2, shutdown_grace=30).start()
    try:
        wait_for(lambda: [state(dsn, j) for j in ids].count("running") == 4, 10, what="a claim of all four")
        wt.worker.stop()  # the running one has its grace; the three others are given back now, not after it
        wait_for(lambda: [state(dsn, j) for j in ids].count("queued") == 3, 4, what="three given back")
    finally:
        wt.join(30)
    assert sorted(state(dsn, j) for j in ids) == ["queued", "queued", "queued", "succeeded"]


def test_a_dropped_job_in_a_paused_queue_does_not_hold_up_the_other_queues(conn: db.Conn, dsn: str) -> None:
    # a job whose worker died, its lease expired, in a paused queue: only a solo claim may take it, and the
    # pause forbids that. The worker must not stop claiming (to drain for a solo claim) on every heartbeat
    ops.pause(conn, "stuck", actor=ME, allow_unknown=True)  # before any job of it
    dropped = enqueue(conn, "t.ok", {}, queue="stuck").id
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'gone',"
        " locked_until = now() - interval '1 minute' WHERE id = %s",
        (dropped,),
    )
    conn.commit()
    slow = enqueue(conn, "t.slow", {"seconds": 4}).id
    conn.commit()
    with running_worker(dsn, heartbeat_interval=0.1, concurrency=2):
        wait_for(lambda: state(dsn, slow) == "running", 10, what="the slow job to start")
        time.sleep(0.5)  # heartbeats have looked for solo work by now
        quick = enqueue(conn, "t.ok", {}).id
        conn.commit()
        wait_for(lambda: state(dsn, quick) == "succeeded", 10, what="the quick job to run")
        assert state(dsn, slow) == "running", "the quick job waited for the slow one to finish"
    assert state(dsn, dropped) == "running"  # still the pause's


def test_a_long_housekeeping_round_does_not_hold_up_the_heartbeat(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a round that takes long (a large backlog to prune): meanwhile the worker beats, and runs jobs. (The
    # round at start runs before the first claim, when nothing is in flight: that one is quick here.)
    in_round, release, rounds = threading.Event(), threading.Event(), []

    def long_round(self: Worker, hk_conn: db.Conn, round_seconds: float | None = None) -> bool:
        rounds.append(threading.current_thread().name)
        if len(rounds) > 1:
            in_round.set()
            release.wait(20)
        return True

    monkeypatch.setattr(Worker, "housekeeping", long_round)
    beat = "SELECT last_heartbeat_at FROM workers WHERE id = %s"
    try:
        with running_worker(dsn, heartbeat_interval=0.1, housekeeping_interval=0.3) as w:
            assert in_round.wait(10)
            first = wait_for(lambda: scalar(dsn, beat, (w.id,)), 10, what="a first beat")
            wait_for(lambda: scalar(dsn, beat, (w.id,)) > first, 5, what="a beat during the round")
            j = enqueue(conn, "t.ok", {}).id
            conn.commit()
            wait_for(lambda: state(dsn, j) == "succeeded", 10, what="a job to run during the round")
            release.set()
    finally:
        release.set()
    # the first on the worker's own thread before it claimed, the next on the housekeeping thread
    assert rounds[0].startswith("test-worker-") and rounds[1] == "housekeeping"


def test_jobs_claimed_before_a_later_claim_statement_fails_still_run(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the main claim committed; the claims for limited types that follow it fail (the connection broke):
    # what the first one claimed must still run now, not wait out its lease (60 s) held by nobody
    j = enqueue(conn, "t.ok", {}, timeout_seconds=10, visibility_timeout_seconds=60).id
    conn.commit()
    failed: list[bool] = []

    def broken(self: Worker, claim_conn: db.Conn, free: int) -> list[dict[str, Any]]:
        if not failed:
            failed.append(True)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return []

    monkeypatch.setattr(Worker, "_claim_limited", broken)
    with running_worker(dsn) as w:
        wait_for(lambda: state(dsn, j) == "succeeded", 10, what="the claimed job to run")
    assert failed
    row = job(dsn, j)
    assert (row["attempts"], row["lease_expirations"]) == (1, 0) and w.claimed_total == 1


def _once(exc: BaseException, then: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in that raises ``exc`` the first time, then calls ``then``."""
    calls: list[int] = []

    def f(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return then(*args, **kwargs)

    return f


def test_a_burst_worker_survives_a_database_error_while_it_checks_whether_it_is_done(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    j = enqueue(conn, "t.ok", {}).id
    conn.commit()
    params, failed = Worker._claim_params, []

    def lost_once(self: Worker, limit: int) -> dict[str, Any]:
        if limit == 0 and not failed:  # the burst's check (burst_remaining)
            failed.append(True)
            raise psycopg.OperationalError("connection lost")
        return params(self, limit)

    monkeypatch.setattr(Worker, "_claim_params", lost_once)
    run_burst(dsn)  # exits 0
    assert failed
    assert state(dsn, j) == "succeeded"


def test_the_watchdog_survives_an_error_and_goes_on_enforcing_timeouts(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # abandoning the stubborn handler fails once (no thread could be started, say): the next tick does it
    monkeypatch.setattr(Worker, "_abandon", _once(RuntimeError("can't start new thread"), Worker._abandon))
    j = enqueue(conn, "t.stubborn", {"seconds": 2.5, "item": "late"}).id
    w = run_burst(dsn, cancel_grace=0.2)
    assert w.zombies == 1  # the watchdog lived on (the handler returned by itself before)
    assert_settled(job(dsn, j), "dead_lettered", 1)


def test_the_completer_survives_an_error_of_its_own(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker_core.completer

    params = worker_core.completer.settle_many_params
    monkeypatch.setattr(worker_core.completer, "settle_many_params", _once(ValueError("a bug"), params))
    ids = [enqueue(conn, "t.ok", {}).id for _ in range(3)]
    conn.commit()
    run_burst(dsn, timeout=20)
    assert [state(dsn, j) for j in ids] == ["succeeded"] * 3


# --------------------------------------------------------------------------- processes

WORKER_PROCESS = """
import sys
from worker_core.worker import Worker, WorkerConfig
cfg = WorkerConfig(dsn=sys.argv[1], task_modules=("tests.worker_core.tasks",), concurrency=1, poll_interval=0.1,
                   heartbeat_interval=0.3, shutdown_grace=float(sys.argv[2]), cancel_grace=1.0)
sys.exit(Worker(cfg).run())
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_lets_the_running_job_finish_within_grace_and_exits_0(
    conn: db.Conn, dsn: str, tmp_path: Path, sig: signal.Signals
) -> None:
    """The README: SIGTERM, SIGINT or SIGHUP (an SSH session that drops) stops claiming and gives the running
    jobs --shutdown-grace."""
    started = tmp_path / "started"
    slow = enqueue(conn, "t.slow", {"seconds": 3, "ledger": True, "item": "finished", "started_file": str(started)}).id
    proc = spawn_python(WORKER_PROCESS, dsn, "60", log=tmp_path / "worker.log")
    try:
        wait_for(started.exists, 20, what="the worker process to start the job")  # begun, not only claimed
        waiting = enqueue(conn, "t.ok", {}).id  # no free slot until the slow job is done
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_settled(job(dsn, slow), "succeeded", 1)
    assert [r["item"] for r in ledger(dsn)] == ["finished"]
    assert state(dsn, waiting) == "queued"  # a stopping worker claims nothing more
    assert scalar(dsn, "SELECT stopped_at IS NOT NULL FROM workers") is True


@pytest.mark.parametrize("how", ["returns", "raises"])
def test_a_handler_stopped_by_a_shutdown_is_released_uncharged_however_it_stops(
    conn: db.Conn, dsn: str, how: str
) -> None:
    # one that raised when told to stop (the usual way) was charged an attempt: its last one dead-lettered it
    j = enqueue(conn, "t.slow", {"seconds": 60, "raise_when_cancelled": how == "raises"}, max_attempts=1).id
    conn.commit()
    with running_worker(dsn, shutdown_grace=0.5):
        wait_for(lambda: state(dsn, j) == "running", 10, what="the job to start")
    row = job(dsn, j)
    assert (row["state"], row["attempts"], row["errors"]) == ("queued", 0, [])


def test_sigterm_with_a_short_grace_releases_the_job_with_its_attempt(
    conn: db.Conn, dsn: str, tmp_path: Path
) -> None:
    slow = enqueue(conn, "t.slow", {"seconds": 60, "ledger": True}).id
    proc = spawn_python(WORKER_PROCESS, dsn, "0.2", log=tmp_path / "worker.log")
    try:
        wait_for(lambda: state(dsn, slow) == "running", 20, what="the worker process to start the job")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    row = job(dsn, slow)
    assert (row["state"], row["attempts"], row["locked_by"], row["errors"]) == ("queued", 0, None, [])
    assert ledger(dsn) == []
    again = Worker(config(dsn))  # claimable again, with its attempt given back
    try:
        assert [(r["id"], r["attempts"]) for r in again.claim(1)] == [(slow, 1)]
    finally:
        if again._claim_conn is not None:
            again._claim_conn.close()


def test_a_second_sigterm_releases_the_running_job_at_once(conn: db.Conn, dsn: str, tmp_path: Path) -> None:
    slow = enqueue(conn, "t.slow", {"seconds": 120, "ledger": True}).id
    proc = spawn_python(WORKER_PROCESS, dsn, "120", log=tmp_path / "worker.log")  # a grace of 2 minutes
    try:
        wait_for(lambda: state(dsn, slow) == "running", 20, what="the worker process to start the job")
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)  # the worker is in its grace period, waiting for the job
        proc.send_signal(signal.SIGTERM)  # the operator means it: the grace ends now
        assert proc.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    row = job(dsn, slow)
    assert (row["state"], row["attempts"], row["locked_by"]) == ("queued", 0, None)


def test_a_heartbeat_stuck_in_a_statement_does_not_hold_up_the_stop(conn: db.Conn, dsn: str) -> None:
    # the final beat (the worker's stopped_at) went through the heartbeat's connection, waiting for that
    # connection's statement to end (no statement timeout): now it opens its own once the 5 s join is over
    slow = enqueue(conn, "t.slow", {"seconds": 30}).id  # keeps the stop in its grace while the beat sticks
    wt = WorkerThread(dsn, burst=False, heartbeat_interval=0.1, shutdown_grace=1, cancel_grace=0.2)
    worker = wt.worker
    beat = worker._flush_and_beat

    def stuck_once_stopping(final: bool = False) -> None:
        if not final and worker.stopping:
            worker._heartbeat_conn().execute("SELECT pg_sleep(25)")
        beat(final)

    worker._flush_and_beat = stuck_once_stopping  # type: ignore[method-assign]
    wt.start()
    wait_for(lambda: state(dsn, slow) == "running", 10)
    assert wt.stop(timeout=15) == 0
    assert state(dsn, slow) == "queued"  # released at the end of the grace
    assert scalar(dsn, "SELECT count(*) FROM workers WHERE stopped_at IS NOT NULL") == 1
    with db.connect(dsn, autocommit=True) as c:  # the stuck statement's backend, left to the test's end
        c.execute("SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(25)%%'")


SUPERVISED = """
import sys
from worker_core.supervisor import Supervisor
from worker_core.worker import WorkerConfig
cfg = WorkerConfig(dsn=sys.argv[1], task_modules=("tests.worker_core.tasks",), concurrency=1, poll_interval=0.1,
                   heartbeat_interval=0.3, shutdown_grace=60, cancel_grace=1.0)
sys.exit(Supervisor(cfg, processes=1).run())
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_on_a_supervisor_gives_the_running_jobs_their_grace(
    conn: db.Conn, dsn: str, tmp_path: Path, presses: int
) -> None:
    # a terminal's Ctrl-C reaches the supervisor and its children at once (one process group), and the
    # supervisor passes the stop on: the child must not take that for a second signal (which ends the grace
    # at once). A second Ctrl-C does mean it.
    started = tmp_path / "started"
    slow = enqueue(conn, "t.slow", {"seconds": 3, "ledger": True, "started_file": str(started)}).id
    proc = spawn_python(SUPERVISED, dsn, log=tmp_path / "supervisor.log", new_session=True)
    try:
        # its handler begun, not only claimed: a job claimed and not started is given back at once on a stop
        # (a loaded machine's CI signalled between the claim and the start, and the job went back unrun)
        wait_for(started.exists, 30, what="the child to start the job")
        os.killpg(proc.pid, signal.SIGINT)
        if presses == 2:
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0, (tmp_path / "supervisor.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    row = job(dsn, slow)
    if presses == 1:  # it finished within its grace
        assert (row["state"], row["attempts"]) == ("succeeded", 1), (tmp_path / "supervisor.log").read_text()
        assert [r["job_id"] for r in ledger(dsn)] == [slow]
    else:  # released at once, its attempt given back
        assert (row["state"], row["attempts"]) == ("queued", 0)
        assert ledger(dsn) == []


def test_workers_whose_supervisor_was_killed_stop_gracefully(conn: db.Conn, dsn: str, tmp_path: Path) -> None:
    # SIGKILL (or the OOM killer) on the supervisor runs none of its code: its worker went on claiming,
    # orphaned, out of reach of the signals sent to the service. It now stops as on the supervisor's stop:
    # its running job finishes within the grace
    started = tmp_path / "started"
    slow = enqueue(conn, "t.slow", {"seconds": 2, "ledger": True, "started_file": str(started)}).id
    proc = spawn_python(SUPERVISED, dsn, log=tmp_path / "supervisor.log", new_session=True)
    try:
        wait_for(started.exists, 30, what="the child to start the job")  # begun, not only claimed
        child = scalar(dsn, "SELECT pid FROM workers WHERE stopped_at IS NULL")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: scalar(dsn, "SELECT count(*) FROM workers WHERE stopped_at IS NULL") == 0, 30,
                 what="the orphaned worker to stop")  # fmt: skip
        wait_for(lambda: not os.path.exists(f"/proc/{child}"), 10, what="its process to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert (job(dsn, slow)["state"], [r["job_id"] for r in ledger(dsn)]) == ("succeeded", [slow])


SIGNAL_UNDER_LOCK = """
import os, signal, sys
from worker_core.supervisor import Supervisor
from worker_core.worker import Worker, WorkerConfig
cfg = WorkerConfig(dsn=sys.argv[1], task_modules=("tests.worker_core.tasks",))
if sys.argv[2] == "worker":
    target = Worker(cfg)
    target._install_signals()
    held, stopped = target._wake, target._stopping
else:
    target = Supervisor(cfg, processes=1)
    target._install_signals()
    held = stopped = target._stop
with held._cond:  # as the claim loop (or the supervisor's loop) holds it in every wait() and clear()
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(10000):
        pass  # the handler runs here, between two bytecodes, with the lock held
print("stopping" if stopped.wait(10) else "not stopping", flush=True)
"""


@pytest.mark.parametrize("who", ["worker", "supervisor"])
def test_a_signal_while_the_main_thread_holds_an_event_lock_still_stops(
    dsn: str, tmp_path: Path, who: str
) -> None:
    # a handler runs between two bytecodes of the main thread: setting an Event from it waited for ever on
    # the Event's lock when the main thread was inside that Event's wait() or clear() (a woken worker hung
    # so on SIGTERM in CI). The handler only queues the signal; a thread of its own acts on it.
    proc = spawn_python(SIGNAL_UNDER_LOCK, dsn, who, log=tmp_path / "out.log")
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    assert code == 0 and (tmp_path / "out.log").read_text().splitlines()[-1] == "stopping", (
        tmp_path / "out.log"
    ).read_text()


def test_a_worker_run_on_the_main_thread_puts_its_signal_handlers_back_when_it_ends(conn: db.Conn, dsn: str) -> None:
    # each run of a Worker on the main thread (a cron-like loop, an application embedding it) left a relay
    # thread waiting for signals for ever, which kept that Worker alive: 5 runs, 5 threads, 5 Workers
    import gc
    import weakref

    assert threading.current_thread() is threading.main_thread()
    mine = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, SUPERVISOR_STOP, signal.SIGUSR1]
    before = {s: signal.getsignal(s) for s in mine}
    refs = []
    try:
        for i in range(3):
            enqueue(conn, "t.ok", {"item": str(i)})
            w = Worker(config(dsn))
            assert w.run() == 0 and w.claimed_total == 1
            assert {s: signal.getsignal(s) for s in mine} == before  # the handlers from before, back
            refs.append(weakref.ref(w))
            del w
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "signals"], 5, what="the relay threads to end")
    wait_for(lambda: gc.collect() >= 0 and not [r for r in refs if r() is not None], 5, what="the workers to be freed")


def supervised(sup: Supervisor, timeout: float) -> list[int]:
    """Run a supervised burst in a thread; its exit code, or [] (failing the test) if it did not finish."""
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        sup.stop()
        t.join(30)
        pytest.fail("the supervised burst did not finish")
    return result


def test_processes_a_payload_that_kills_its_process_is_dead_lettered_while_others_flow(
    conn: db.Conn, dsn: str
) -> None:
    crash = enqueue(conn, "t.crash", {}).id  # max_attempts 2
    oks = [enqueue(conn, "t.ok", {"ledger": True, "item": str(i)}).id for i in range(12)]
    sup = Supervisor(config(dsn, concurrency=2, task_modules=TASKS), processes=2)
    assert supervised(sup, 90) == [0]
    row = job(dsn, crash)
    assert row["state"] == "dead_lettered" and row["finished_at"] is not None
    assert kinds(dsn, crash) == ["lease_expired", "lease_expired"]
    assert sup.restarts == 2  # one per run of the poison pill, none after
    for j in oks:
        assert state(dsn, j) == "succeeded"
    assert sorted(r["item"] for r in ledger(dsn)) == sorted(str(i) for i in range(12))  # each effect once
    live = "SELECT count(*) FROM job_queue WHERE state IN ('queued', 'running', 'retry_scheduled')"
    assert scalar(dsn, live) == 0
    # its lease expirations and its run alone are counted though the process died right after (counted in
    # memory until the next beat, they died with it: one expiration, no start). Its first run, among others
    # and not suspected yet, may die uncounted with the process
    counts = "SELECT sum(started) AS s, sum(lease_expirations) AS e, sum(dead_lettered) AS d FROM job_metrics_minute"
    with db.connect(dsn, autocommit=True) as c:
        row = c.execute(counts + " WHERE job_type = 't.crash'").fetchone()
    assert row is not None and (row["e"], row["d"]) == (2, 1) and row["s"] >= 1


def test_processes_a_payload_that_exits_with_2_is_a_crash_not_a_refused_configuration(
    conn: db.Conn, dsn: str
) -> None:
    # exit code 2 is also what a worker that refuses its configuration exits with: a job calling exit(2)
    # had its process taken for one, not restarted, its leases left to run out, and with every child gone
    # so the supervisor exited 2 ("bad input") with the jobs undone
    doomed = enqueue(conn, "t.exit_code", {"code": 2}).id  # max_attempts 2
    oks = [enqueue(conn, "t.ok", {"ledger": True, "item": str(i)}).id for i in range(4)]
    sup = Supervisor(config(dsn, concurrency=2, task_modules=TASKS), processes=1)
    assert supervised(sup, 90) == [0]
    assert (sup.restarts, sup.refused) == (2, 0)  # one per run of it, none after
    assert (state(dsn, doomed), kinds(dsn, doomed)) == ("dead_lettered", ["lease_expired", "lease_expired"])
    assert all(state(dsn, j) == "succeeded" for j in oks)


def test_ending_a_dead_workers_leases_ends_its_jobs_lock_leases_too(conn: db.Conn, dsn: str) -> None:
    # the job's lease ended, its lock_key lease did not: reclaimed at once, it found its own lock taken and
    # was rescheduled for contention every ~2 s until the lock's lease (its visibility timeout) ran out
    from worker_core.supervisor import end_dead_worker

    held = enqueue(conn, "t.ok", {}, lock_key="order:1").id
    other = enqueue(conn, "t.ok", {}, lock_key="order:2").id
    conn.execute("UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'dead', "
                 "locked_until = now() + interval '1 hour' WHERE id = %s", (held,))  # fmt: skip
    conn.execute("INSERT INTO resource_locks (lock_key, token, job_id, expires_at) VALUES "
                 "('order:1', 'a', %s, now() + interval '1 hour'), ('order:2', 'b', %s, now() + interval '1 hour')",
                 (held, other))  # fmt: skip
    conn.commit()
    assert end_dead_worker(dsn, worker_id="dead") == [str(held)]
    assert scalar(dsn, "SELECT array_agg(lock_key) FROM resource_locks") == ["order:2"]  # another's stays


def test_a_worker_process_that_dies_during_the_stop_has_its_leases_ended(conn: db.Conn, dsn: str) -> None:
    # only a child the supervisor had to kill had its leases ended: one that died on its own during the
    # grace (a payload that kills its process) left its jobs running, held by nobody, for a whole lease
    doomed = enqueue(conn, "t.crash_later", {"seconds": 1.5}, visibility_timeout_seconds=120).id
    slow = enqueue(conn, "t.slow", {"seconds": 30}, visibility_timeout_seconds=120).id
    conn.commit()
    sup = Supervisor(config(dsn, burst=False, concurrency=2, task_modules=TASKS, shutdown_grace=5), processes=1)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    t.start()
    try:
        wait_for(lambda: state(dsn, doomed) == state(dsn, slow) == "running", 30, what="both jobs to start")
        worker_id = job(dsn, slow)["locked_by"]
        sup.stop()
        t.join(60)
    finally:
        sup.stop()
    assert result == [0]
    ended = "SELECT locked_until <= now() FROM job_queue WHERE id = %s"
    assert scalar(dsn, ended, (doomed,)) and scalar(dsn, ended, (slow,))  # any worker may take them at once
    assert scalar(dsn, "SELECT stopped_at IS NOT NULL FROM workers WHERE id = %s", (worker_id,))


def test_a_worker_whose_metrics_port_is_taken_exits_as_misconfigured_and_is_not_restarted(dsn: str) -> None:
    # it died with a traceback; under --processes the supervisor restarted it for ever (13 times in 20 s),
    # and a --burst run never finished
    import socket

    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        assert Worker(config(dsn, task_modules=TASKS, metrics_port=port)).run() == 2
        sup = Supervisor(config(dsn, task_modules=TASKS, metrics_port=port), processes=1)
        assert (supervised(sup, 60), sup.restarts, sup.refused) == ([2], 0, 1)


def test_a_worker_whose_metrics_port_is_out_of_range_exits_as_misconfigured_and_is_not_restarted(dsn: str) -> None:
    # bind() raises OverflowError, not OSError, for a port past 65535: the worker died with a traceback, and
    # the supervisor took that for a crash to restart
    assert Worker(config(dsn, task_modules=TASKS, metrics_port=70000)).run() == 2
    sup = Supervisor(config(dsn, task_modules=TASKS, metrics_port=65535), processes=2)  # process 1: 65536
    assert (supervised(sup, 60), sup.refused) == ([2], 1)


def test_a_supervisor_whose_workers_die_before_their_first_heartbeat_gives_up(dsn: str) -> None:
    # a child that fails at start for good (a module it cannot import there) was restarted every ~3 s for
    # ever, and the supervisor exited 0 on SIGTERM: Restart=on-failure and alerting never saw it
    from worker_core.supervisor import EXIT_GAVE_UP, GIVE_UP_AFTER

    cfg = config(dsn, burst=False, task_modules=("tests.worker_core.tasks_broken_in_child",), shutdown_grace=1)
    sup = Supervisor(cfg, processes=2)
    assert supervised(sup, 120) == [EXIT_GAVE_UP] and EXIT_GAVE_UP not in (0, 1, 2, 3)
    assert sup.restarts == GIVE_UP_AFTER - 1  # every death before the last was restarted


def test_a_supervisor_forgets_the_start_times_of_its_dead_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    # the start time of a dead child was popped only if it had never beaten (``beat is False and ...pop()``,
    # short-circuited): children that crash after their first beat (os._exit in a handler, the OOM killer)
    # left one entry each, for the supervisor's life
    sentinels: list[int] = []

    class Crashed:  # a child process that died at once, after a beat (see _expire below)
        exitcode, pid = 13, None

        def __init__(self, **_: Any) -> None:
            self.sentinel, write_end = os.pipe()  # a dead process's sentinel: ready (at end of file)
            os.close(write_end)
            sentinels.append(self.sentinel)

        def start(self) -> None:
            pass

        def is_alive(self) -> bool:
            return False

        def join(self, *_: Any) -> None:
            pass

    sup = Supervisor(config("postgresql://unused/x"), processes=10)  # 30 deaths before any backoff
    sup.ctx = cast(Any, SimpleNamespace(Process=Crashed, Value=lambda *_, **__: SimpleNamespace(value=0)))
    monkeypatch.setattr(sup, "_expire", lambda worker_id: True)  # it had beaten: a crash, not a stillbirth
    returned: list[int] = []
    t = threading.Thread(target=lambda: returned.append(sup._supervise()), daemon=True)
    t.start()
    wait_for(lambda: sup.restarts >= 25, 20, what="25 restarts")
    sup.stop()
    t.join(10)
    for fd in sentinels:
        os.close(fd)
    assert returned == [0]  # its stop went through (the children it had then were waited for)
    assert len(sup._started_at) <= 10 and len(sup._refusals) <= 10, (len(sup._started_at), len(sup._refusals))


def test_a_supervisor_that_cannot_start_a_worker_stops_the_ones_it_started(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the second child cannot be started (no process left, say): the first must not be left running,
    # unsupervised, out of reach of the signals sent to the supervisor
    sup = Supervisor(config(dsn, burst=False, task_modules=TASKS, shutdown_grace=1), processes=2)
    start = Supervisor._start

    def second_fails(self: Supervisor, slot: int) -> None:
        if slot == 1:
            raise OSError("Resource temporarily unavailable")
        start(self, slot)

    monkeypatch.setattr(Supervisor, "_start", second_fails)
    with pytest.raises(OSError):
        sup.run()
    proc, _ = sup.children[0]
    # stopped (or, if the stop came before its signal handlers were in place, ended by it: it held no job)
    assert not proc.is_alive() and proc.exitcode in (0, -SUPERVISOR_STOP)


def test_a_worker_says_which_policy_file_it_runs_on(dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    # the file is looked for in the working directory: a worker started elsewhere ran on the built-in defaults,
    # and nothing said so
    caplog.set_level("INFO", logger="worker_core")
    run_burst(dsn)
    starting = [r.getMessage() for r in caplog.records if "worker starting" in r.getMessage()]
    assert starting and starting[0].endswith(f"policy={os.environ['QCONSOLE_POLICY_FILE']}")
