"""A --burst worker whose claims keep failing (behind a lock on job_queue, say) gives up after
``burst_give_up`` seconds and returns EXIT_UNAVAILABLE; a worker that is not a burst one keeps trying. The
lock is a real one, held by another session."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import tests.worker_core.tasks  # noqa: F401
from tests.worker_core.helpers import WorkerThread, state, wait_for
from worker_core import db, enqueue
from worker_core.worker import EXIT_UNAVAILABLE


@pytest.fixture
def short_statements(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's own statements (claims, beats) fail behind a lock within 0.3 s, not 30."""
    monkeypatch.setattr(db, "OWN_STATEMENT_TIMEOUT_MS", 300)


def test_a_burst_worker_behind_a_table_lock_gives_up_and_says_why(
    dsn: str, conn: db.Conn, short_statements: None, caplog: pytest.LogCaptureFixture
) -> None:
    # each claim failed at its statement timeout and was tried again, for ever: a cron job's burst never
    # exited, and the next runs piled up behind it
    job = enqueue(conn, "t.ok", {}).id
    with db.connect(dsn) as locker:
        locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
        pid = locker.info.backend_pid
        began = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="worker_core.worker"):
            wt = WorkerThread(dsn, burst_give_up=1.5, housekeeping=False).start()
            assert wt.join(30) == EXIT_UNAVAILABLE
        assert time.monotonic() - began >= 1.5
        said = wt.worker.gave_up or ""
        assert "no claim has gone through for" in said and "canceling statement due to statement timeout" in said
        assert f"job_queue is locked by pid {pid} (idle in transaction" in said and "AccessExclusiveLock" in said
        assert any("burst: giving up" in r.getMessage() for r in caplog.records)
        locker.rollback()
    assert state(dsn, job) == "queued"  # nothing of it was run


def test_a_worker_that_is_not_a_burst_one_keeps_trying_behind_the_lock(
    dsn: str, conn: db.Conn, short_statements: None
) -> None:
    job = enqueue(conn, "t.ok", {}).id
    locker = db.connect(dsn)
    try:
        locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
        wt = WorkerThread(dsn, burst=False, burst_give_up=0.5, housekeeping=False).start()
        time.sleep(3)  # six times its burst_give_up, many failed claims
        assert wt.thread.is_alive() and wt.worker.gave_up is None
        locker.rollback()
        wait_for(lambda: state(dsn, job) == "succeeded", 15, what="the job to run once the lock is gone")
        assert wt.stop() == 0
    finally:
        locker.close()


def test_a_burst_worker_outlasts_a_lock_shorter_than_its_bound(
    dsn: str, conn: db.Conn, short_statements: None
) -> None:
    # it gives up on claims failing for the whole bound, not on the first that fails
    job = enqueue(conn, "t.ok", {}).id
    locker = db.connect(dsn)
    try:
        locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
        threading.Timer(1.5, locker.rollback).start()
        wt = WorkerThread(dsn, burst_give_up=6.0, housekeeping=False).start()
        assert wt.join(30) == 0 and wt.worker.gave_up is None
    finally:
        time.sleep(0.1)
        locker.close()
    assert state(dsn, job) == "succeeded"
