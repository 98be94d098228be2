"""A worker's claims read queues and concurrency_limits for their filters (paused queues, limits) after a pause,
resume or limit is notified: behind another session's lock on one, each claim waited out its statement timeout
(30 s) and failed, claim after claim, for as long as the lock was held. Now it claims on with the filters it
read last, saying who holds the lock."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from tests.worker_core.helpers import running_worker, state, wait_for
from worker_core import db, enqueue


def _pid_of(dsn: str, statement: str) -> int:
    with db.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT pid FROM pg_stat_activity WHERE query = %s AND pid <> pg_backend_pid()", (statement,)
        ).fetchone()
    assert row is not None, f"no session ran {statement!r}"
    return int(row["pid"])


def test_a_worker_claims_on_while_queues_is_locked(
    dsn: str, conn: db.Conn, locker: Callable[[str], None], caplog: pytest.LogCaptureFixture
) -> None:
    # a pause notified while queues is locked: every claim re-read the filters, waited 30 s and failed
    caplog.set_level(logging.WARNING, logger="worker_core")
    with running_worker(dsn, heartbeat_interval=30, housekeeping=False) as w:
        first = enqueue(conn, "t.ok", {}).id
        wait_for(lambda: state(dsn, first) == "succeeded", 30, what="a first claim")
        locker("queues")
        pid = _pid_of(dsn, "LOCK TABLE queues IN ACCESS EXCLUSIVE MODE")
        conn.execute("SELECT pg_notify('worker_core_control', 'queues')")  # what a pause elsewhere sends
        wait_for(lambda: [r for r in caplog.records if f"pid {pid}" in r.getMessage()], 60, what="the lock said")
        second = enqueue(conn, "t.ok", {}).id
        wait_for(lambda: state(dsn, second) == "succeeded", 60, what="a claim while queues is locked")
        assert w.claimed_total >= 2
    said = [r.getMessage() for r in caplog.records if "claim filters" in r.getMessage()]
    assert len(said) == 1 and "Claiming meanwhile with those read" in said[0], said


def test_a_worker_starting_behind_a_lock_on_queues_claims_once_it_is_released(
    dsn: str, conn: db.Conn, locker: Callable[[str], None], caplog: pytest.LogCaptureFixture
) -> None:
    # no filters read yet: it may not claim (a paused queue's jobs), and says why
    caplog.set_level(logging.WARNING, logger="worker_core")
    job_id = enqueue(conn, "t.ok", {}).id
    locker("queues")
    pid = _pid_of(dsn, "LOCK TABLE queues IN ACCESS EXCLUSIVE MODE")
    with running_worker(dsn, heartbeat_interval=30, housekeeping=False, check_database=False):
        wait_for(lambda: [r for r in caplog.records if f"pid {pid}" in r.getMessage()], 60, what="the lock said")
        assert state(dsn, job_id) == "queued"
        locker("")
        wait_for(lambda: state(dsn, job_id) == "succeeded", 60, what="a claim once queues is free")


def test_a_worker_with_a_limited_type_claims_the_others_while_concurrency_limits_is_locked(
    dsn: str, conn: db.Conn, locker: Callable[[str], None], caplog: pytest.LogCaptureFixture
) -> None:
    # the limited types' claims come first, and read concurrency_limits: behind the lock, every claim failed
    from worker_core import ops

    caplog.set_level(logging.WARNING, logger="worker_core")
    ops.set_limit(conn, "t.ledger", 1, allow_unknown=True)
    with running_worker(dsn, heartbeat_interval=30, housekeeping=False):
        limited = enqueue(conn, "t.ledger", {"item": "a"}, idempotency_key="a").id
        wait_for(lambda: state(dsn, limited) == "succeeded", 30, what="the limits read, a limited job run")
        locker("concurrency_limits")
        pid = _pid_of(dsn, "LOCK TABLE concurrency_limits IN ACCESS EXCLUSIVE MODE")
        held = enqueue(conn, "t.ledger", {"item": "b"}, idempotency_key="b").id
        other = enqueue(conn, "t.ok", {}).id
        wait_for(lambda: state(dsn, other) == "succeeded", 60, what="an unlimited job run behind the lock")
        wait_for(lambda: [r for r in caplog.records if f"pid {pid}" in r.getMessage()], 60, what="the lock said")
        assert state(dsn, held) == "queued"  # its limit cannot be read: it waits
        locker("")
        wait_for(lambda: state(dsn, held) == "succeeded", 60, what="the limited job run once the lock is gone")
