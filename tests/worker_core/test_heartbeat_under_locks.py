"""A worker's heartbeat under a table lock (a DBA's LOCK TABLE, a VACUUM FULL, an ALTER TABLE, a migration).

The heartbeat thread (Worker._flush_and_beat) does, on one connection: extend the leases of its jobs
(job_queue), beat its own row (workers), then the rest. Each statement was bounded at 30 s only
(db.OWN_STATEMENT_TIMEOUT_MS), and a failure ended the beat, so a lock on one table stalled the other's beat:

- job_queue locked: a worker with jobs in flight never reached its row; after 30 s (stats.LOST_AFTER_SECONDS)
  the console and ``qconsole workers`` showed it ``✗ LOST`` while it was alive and well, and on-call restarted
  live workers. An idle one's beat waited as long on its look for solo work (job_queue too).
- workers locked: the leases were extended, then the beat waited on the row: the next extension came after
  the lock (or 30 s), and a lease shorter than that ran out under a live worker.
- a worker stopping under such a lock could not record its stop, and read as lost for a day.

Now each statement of a beat waits for a lock one beat interval at most (the heartbeat connection's
lock_timeout, Worker.beat_lock_wait_seconds), gives up for that beat, and the others go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.worker_core.helpers import WorkerThread, config, running_worker, scalar, wait_for
from worker_core import db, stats, worker
from worker_core.clock import SYSTEM_CLOCK


@contextmanager
def _locked(dsn: str, table: str, at_most: float = 90.0) -> Iterator[threading.Event]:
    """``table`` locked ACCESS EXCLUSIVE by another session for the block (``at_most`` seconds at most), or
    until the Event it gives is set."""
    ready, release = threading.Event(), threading.Event()

    def hold() -> None:
        with db.connect(dsn) as c:
            c.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            ready.set()
            release.wait(at_most)
            c.rollback()

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert ready.wait(10), f"could not lock {table}"
    try:
        yield release
    finally:
        release.set()
        t.join(10)


def _heartbeat_ages(dsn: str, ids: list[str]) -> dict[str, float]:
    """Seconds since each worker's last heartbeat, by the server's clock."""
    with db.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT id, extract(epoch FROM clock_timestamp() - last_heartbeat_at)::float8 AS age FROM workers"
            " WHERE id = ANY(%s)",
            (ids,),
        ).fetchall()
    return {r["id"]: r["age"] for r in rows}


@pytest.mark.parametrize(("interval", "shown"), [(2.0, "2s"), (0.1, "500ms"), (30.0, "5s")])
def test_the_heartbeats_connection_waits_for_a_lock_one_beat_interval_within_bounds(
    dsn: str, interval: float, shown: str
) -> None:
    w = worker.Worker(config(dsn, heartbeat_interval=interval))
    conn = w._heartbeat_conn()
    try:
        row = conn.execute("SELECT current_setting('lock_timeout') AS l, current_setting('statement_timeout') AS s")
        assert row.fetchone() == {"l": shown, "s": "30s"}
    finally:
        conn.close()


@pytest.mark.slow
def test_a_live_worker_is_not_reported_lost_while_job_queue_is_locked(dsn: str, make_job: Any) -> None:
    """The reviewer's reproduction: a worker runs a long job; another session holds LOCK TABLE job_queue for
    40 s. The worker is alive the whole time: it is never reported lost (its row is beaten whatever job_queue
    does). It was: its heartbeat blocked on the job leases' UPDATE, never reached its row, and after 30 s it
    was ✗ LOST."""
    job = make_job("t.slow", {"seconds": 70}, timeout_seconds=90)
    with running_worker(dsn, heartbeat_interval=0.5) as w:
        wait_for(lambda: scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (job,)) == "running", 20)
        seen_lost: list[float] = []
        with _locked(dsn, "job_queue", at_most=stats.LOST_AFTER_SECONDS + 10):
            deadline = time.monotonic() + stats.LOST_AFTER_SECONDS + 8
            with db.connect(dsn, autocommit=True) as reader:
                while time.monotonic() < deadline:
                    mine = [x for x in stats.workers(reader, SYSTEM_CLOCK) if x.id == w.id]
                    assert mine, "the worker's row is gone"
                    if mine[0].lost:
                        seen_lost.append(time.monotonic())
                        break
                    time.sleep(1)
        w.stop()
    assert not seen_lost, (
        "a live worker (running a job, heartbeat thread alive) was reported LOST while job_queue was locked:"
        " its heartbeat never reached its workers row"
    )


def test_busy_and_idle_workers_rows_are_beaten_every_beat_while_job_queue_is_locked(
    dsn: str, make_job: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # the lease update waits one beat interval for the lock, gives up, and the worker's row is beaten; the
    # idle worker's look for solo work did the same. Neither waits more than about an interval per beat. Once
    # the lock ends, the leases are extended again, and the job, which nobody could claim meanwhile, ends
    # once, on its worker
    caplog.set_level(logging.INFO, logger="worker_core.worker")
    job = make_job("t.slow", {"seconds": 14}, timeout_seconds=60)
    with running_worker(dsn, concurrency=1, heartbeat_interval=0.5) as busy:
        wait_for(lambda: scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (job,)) == "running", 20)
        with running_worker(dsn, concurrency=1, heartbeat_interval=0.5) as idle:
            ids = [busy.id, idle.id]
            wait_for(lambda: len(_heartbeat_ages(dsn, ids)) == 2, 10, what="both workers' rows")
            oldest = dict.fromkeys(ids, 0.0)
            with _locked(dsn, "job_queue"):
                until = time.monotonic() + 7
                while time.monotonic() < until:
                    for wid, age in _heartbeat_ages(dsn, ids).items():
                        oldest[wid] = max(oldest[wid], age)
                    time.sleep(0.1)
            released = scalar(dsn, "SELECT clock_timestamp()")
            # stale by more than a beat or two (plus a loaded machine's slack): the beat waited on the lock
            assert oldest[busy.id] < 3.0, f"the busy worker's row went {oldest[busy.id]:.1f} s without a beat"
            assert oldest[idle.id] < 3.0, f"the idle worker's row went {oldest[idle.id]:.1f} s without a beat"
            wait_for(
                lambda: scalar(dsn, "SELECT locked_until > %s FROM job_queue WHERE id = %s", (released, job)),
                5,
                what="the job's lease extended again after the lock",
            )
            wait_for(lambda: scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (job,)) == "succeeded", 30)
    assert scalar(dsn, "SELECT attempts FROM job_queue WHERE id = %s", (job,)) == 1
    said = [r.getMessage() for r in caplog.records if r.name == "worker_core.worker"]
    held_up = [m for m in said if m.startswith("heartbeat: the jobs' leases (job_queue) waited")]
    assert len(held_up) == 1, said  # said once a minute while it lasts, not on every beat
    assert any(m.startswith("heartbeat: no longer held up by a lock") for m in said), said
    assert not [m for m in said if m.startswith("heartbeat failed")], said  # the connection was kept


def test_the_jobs_leases_are_extended_while_the_workers_table_is_locked(dsn: str, make_job: Any) -> None:
    # the other way round: the worker's row waited (up to 30 s) after the leases were extended, and the next
    # extension came only after it: a lease shorter than the lock ran out under a live worker
    job = make_job("t.slow", {"seconds": 12}, timeout_seconds=30)
    with running_worker(dsn, concurrency=1, heartbeat_interval=0.5) as w:
        wait_for(lambda: scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (job,)) == "running", 20)
        last, changed_at, longest = None, time.monotonic(), 0.0
        with _locked(dsn, "workers"):
            until = time.monotonic() + 6
            while time.monotonic() < until:
                lease = scalar(dsn, "SELECT locked_until FROM job_queue WHERE id = %s", (job,))
                if lease != last:
                    last, changed_at = lease, time.monotonic()
                longest = max(longest, time.monotonic() - changed_at)
                time.sleep(0.1)
        assert longest < 3.0, f"the job's lease went {longest:.1f} s unextended while the workers table was locked"
        wait_for(lambda: _heartbeat_ages(dsn, [w.id])[w.id] < 2, 5, what="the worker's row beaten again")
        wait_for(lambda: scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (job,)) == "succeeded", 20)
    assert scalar(dsn, "SELECT attempts FROM job_queue WHERE id = %s", (job,)) == 1


def test_a_worker_stopping_while_job_queue_is_locked_records_its_stop(dsn: str, make_job: Any) -> None:
    # its final beat waited 30 s on the leases' UPDATE, failed, and never wrote stopped_at: the worker read as
    # lost for a day. Its slot's release of the job waits for the lock (that is the job's lease's business:
    # it is released, or run again once its lease runs out), the stop is recorded all the same
    job = make_job("t.slow", {"seconds": 60}, timeout_seconds=90)
    wt = WorkerThread(dsn, burst=False, concurrency=1, heartbeat_interval=0.5, shutdown_grace=0.5, cancel_grace=0.2)
    wt.start()
    wait_for(lambda: scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (job,)) == "running", 20)
    with _locked(dsn, "job_queue"):
        began = time.monotonic()
        assert wt.stop(timeout=20) == 0
        took = time.monotonic() - began
        stopped = scalar(dsn, "SELECT stopped_at IS NOT NULL FROM workers WHERE id = %s", (wt.worker.id,))
    assert stopped, "the worker's stop was not recorded while job_queue was locked"
    assert took < 15, f"the stop took {took:.1f} s"
    # once the lock is gone, the slot's release goes through: the job is queued again, not run twice
    wait_for(lambda: scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (job,)) == "queued", 35)
    assert scalar(dsn, "SELECT attempts FROM job_queue WHERE id = %s", (job,)) == 0


def test_a_stop_record_held_up_by_a_short_lock_on_workers_is_made_once_the_lock_ends(dsn: str) -> None:
    # each try waits beat_lock_wait_seconds for the lock and is made again, for STOP_RECORD_SECONDS at most
    wt = WorkerThread(dsn, burst=False, concurrency=1, heartbeat_interval=0.5).start()
    wait_for(lambda: wt.worker.id in _heartbeat_ages(dsn, [wt.worker.id]), 10, what="the worker's row")
    with _locked(dsn, "workers") as release:
        threading.Timer(2.0, release.set).start()
        assert wt.stop(timeout=20) == 0
    assert scalar(dsn, "SELECT stopped_at IS NOT NULL FROM workers WHERE id = %s", (wt.worker.id,))


def test_a_stop_record_held_up_by_a_long_lock_on_workers_gives_up_in_bounded_time(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="worker_core.worker")
    wt = WorkerThread(dsn, burst=False, concurrency=1, heartbeat_interval=0.5).start()
    wait_for(lambda: wt.worker.id in _heartbeat_ages(dsn, [wt.worker.id]), 10, what="the worker's row")
    with _locked(dsn, "workers"):
        began = time.monotonic()
        assert wt.stop(timeout=30) == 0
        took = time.monotonic() - began
    # the heartbeat thread's last beat (a lock wait at most), then the stop record's tries
    assert took < worker.STOP_RECORD_SECONDS + 2 * wt.worker.beat_lock_wait_seconds + 3, f"the stop took {took:.1f} s"
    assert any("could not record the worker's stop" in r.getMessage() for r in caplog.records)
    assert scalar(dsn, "SELECT stopped_at IS NULL FROM workers WHERE id = %s", (wt.worker.id,))


def test_a_worker_starting_behind_a_short_lock_on_the_contracts_still_publishes_them(dsn: str) -> None:
    # published once, at start, on the heartbeat's connection: they wait for a lock as before (up to the
    # statement timeout), not a beat's lock wait, which gave up and left them unpublished until a restart
    with _locked(dsn, "job_type_contracts") as release:
        threading.Timer(2.0, release.set).start()
        with running_worker(dsn, concurrency=1, heartbeat_interval=0.5) as w:
            wait_for(
                lambda: scalar(dsn, "SELECT count(*) FROM job_type_contracts WHERE reported_by = %s", (w.id,)) > 0,
                15,
                what="the worker's contracts",
            )
