"""A graceful stop while the database is away (review drill 1): bounded by its grace periods whatever the database
does, and truthful about what it could not release.

Before: Slot._write tried a release again "until the job's lease would have run out" during a stop too, so a
SIGTERM took a lease (48 s with a grace of 10 s and 50 s leases), each job was said "released" before anything was
tried, nothing was, and the worker exited 0."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

import tests.worker_core.tasks  # noqa: F401
from tests.worker_core.helpers import FreezingProxy, WorkerThread, scalar, wait_for
from worker_core.worker import EXIT_UNAVAILABLE


def test_a_worker_stopped_while_the_database_is_away_stops_within_its_grace(
    dsn: str, make_job: Callable[..., uuid.UUID], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="worker_core")
    lease = {"visibility_timeout_seconds": 60}
    jobs = [
        make_job("t.ledger", {"item": str(i), "sleep": 1.0}, idempotency_key=f"t.ledger:{i}", **lease)
        for i in range(8)
    ]
    proxy = FreezingProxy.before(dsn, hang_ups=True)
    wt = WorkerThread(proxy.dsn, burst=False, concurrency=4, shutdown_grace=1.0, cancel_grace=1.0,
                      heartbeat_interval=0.5).start()  # fmt: skip
    try:
        wait_for(lambda: scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'running'") >= 4,
                 what="jobs running")  # fmt: skip
        proxy.cut()  # the database goes away
        time.sleep(0.5)
        began = time.monotonic()
        wt.worker.stop()
        wt.thread.join(60)
        took = time.monotonic() - began
    finally:
        proxy.cut()
        proxy.close()
        if wt.thread.is_alive():
            wt.worker.stop()
            wt.thread.join(60)
    messages = [r.getMessage() for r in caplog.records]
    said_released = [m for m in messages if "job released" in m]
    # grace 1 s + cancel grace 1 s + STOP_SETTLE_SECONDS + the final beat and the stop's record + a margin
    assert took < 12, (
        f"stop() took {took:.0f} s with shutdown_grace=1, cancel_grace=1 (the jobs' lease is 60 s);"
        f" it said 'job released' {len(said_released)} times meanwhile"
    )
    # nothing could be released: nothing is said released, and what is still held is said, with its lease's end
    held = [row["id"] for row in _rows(dsn) if row["state"] == "running"]
    assert held, "the database was away: nothing could be released"
    assert not said_released, said_released
    said = [m for m in messages if m.startswith("stopped without releasing")]
    assert len(said) == 1, messages[-10:]
    assert f"stopped without releasing {len(held)} jobs" in said[0], said[0]
    assert all(str(job_id) in said[0] for job_id in held), said[0]
    assert "lease until" in said[0] and "any worker takes them" in said[0], said[0]
    # and the exit code says the stop was not clean (the CLI's code for a database unreachable)
    assert wt.error is None and wt.result == EXIT_UNAVAILABLE, (wt.error, wt.result)
    assert {row["id"] for row in _rows(dsn)} == set(jobs)


def test_a_stop_with_the_database_there_releases_its_jobs_and_exits_0(
    dsn: str, make_job: Callable[..., uuid.UUID], caplog: pytest.LogCaptureFixture
) -> None:
    """The other side of the bound: with the database there, the stop releases what the grace did not see
    finish, says so of each, and exits 0."""
    caplog.set_level("INFO", logger="worker_core")
    for i in range(4):
        make_job("t.ledger", {"item": str(i), "sleep": 5.0}, idempotency_key=f"t.ledger:{i}")
    wt = WorkerThread(dsn, burst=False, concurrency=2, shutdown_grace=0.2, cancel_grace=1.0).start()
    wait_for(lambda: scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'running'") >= 2, what="jobs running")
    assert wt.stop(60) == 0
    assert scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'queued' AND attempts = 0") == 4
    messages = [r.getMessage() for r in caplog.records]
    assert sum("job released" in m for m in messages) == 4, messages
    assert not [m for m in messages if m.startswith("stopped without releasing")]


def _rows(dsn: str) -> list[dict[str, Any]]:
    from worker_core import db

    with db.connect(dsn, autocommit=True) as c:
        return c.execute("SELECT id, state FROM job_queue").fetchall()
