"""The supervisor ends its dead workers' leases and records their stops: bounded behind locks (tried again
later, never waited for), and for every worker that exited without recording its own."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import psycopg
import pytest

from tests.worker_core.helpers import TASKS, config, in_thread, job, running_as, scalar, state, wait_for
from worker_core import db, enqueue
from worker_core.supervisor import Supervisor, end_dead_worker

# --------------------------------------------------------------------- ending a dead worker, bounded


def test_ending_a_dead_workers_leases_behind_a_table_lock_gives_up_soon_and_still_records_its_stop(
    conn: db.Conn, dsn: str, locker: Callable[[str], None]
) -> None:
    # it connected with no statement or lock timeout: behind a LOCK TABLE job_queue it waited for the whole
    # lock, and the supervisor with it (no restart, no other child watched meanwhile)
    j = enqueue(conn, "t.ok", {}).id
    running_as(dsn, j, "dead")
    locker("job_queue")
    began = time.monotonic()
    t, out = in_thread(lambda: end_dead_worker(dsn, worker_id="dead"))
    t.join(15)
    try:
        assert not t.is_alive(), "it waited behind the lock on job_queue"
        assert isinstance(out[0], psycopg.errors.LockNotAvailable), out
        assert time.monotonic() - began < 10
        # the workers row is not behind that lock: its stop is recorded at once
        assert scalar(dsn, "SELECT stopped_at IS NOT NULL FROM workers WHERE id = 'dead'") is True
    finally:
        locker("")
        t.join(30)
    assert end_dead_worker(dsn, worker_id="dead") == [str(j)]  # tried again once the lock is gone


def test_a_supervisor_behind_a_table_lock_restarts_its_dead_worker_and_ends_its_leases_later(
    conn: db.Conn, dsn: str, locker: Callable[[str], None]
) -> None:
    j = enqueue(conn, "t.slow", {"seconds": 60}, visibility_timeout_seconds=600).id
    conn.commit()
    sup = Supervisor(config(dsn, burst=False, task_modules=TASKS, shutdown_grace=1), processes=1)
    t, out = in_thread(sup.run)
    try:
        wait_for(lambda: state(dsn, j) == "running", 30, what="the job to start")
        proc, dead = sup.children[0]
        assert job(dsn, j)["locked_by"] == dead
        locker("job_queue")
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        # not held up behind the lock: the dead worker is restarted, and its stop recorded, meanwhile
        wait_for(lambda: sup.restarts == 1, 15, what="the dead worker to be restarted behind the lock")
        wait_for(
            lambda: scalar(dsn, "SELECT stopped_at IS NOT NULL FROM workers WHERE id = %s", (dead,)),
            10,
            what="its stop to be recorded",
        )
        assert sup._unended, "its leases could not be ended behind the lock: to be tried again"
        locker("")
        # tried again once the lock is gone: its job's lease ends (any worker may take it at once)
        wait_for(
            lambda: (r := job(dsn, j))["locked_by"] != dead or r["locked_until"] is None or not sup._unended,
            40,
            what="the dead worker's lease to be ended",
        )
        assert not sup._unended
    finally:
        locker("")
        sup.stop()
        t.join(60)
    assert out == [0]


@pytest.fixture
def stop_records_fail(conn: db.Conn) -> None:
    """A worker's own stop record fails (as behind a lock on workers, or with the connection lost), whatever
    it tries: a trigger refuses it from a worker's connection (application_name qconsole-worker), not from
    the supervisor's."""
    conn.execute(
        "CREATE FUNCTION refuse_own_stop() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " IF current_setting('application_name') = 'qconsole-worker' THEN"
        "  RAISE EXCEPTION 'the stop record failed (test)'; END IF; RETURN NEW; END $$"
    )
    conn.execute(
        "CREATE TRIGGER refuse_own_stop BEFORE UPDATE ON workers FOR EACH ROW"
        " WHEN (NEW.stopped_at IS NOT NULL AND OLD.stopped_at IS NULL) EXECUTE FUNCTION refuse_own_stop()"
    )
    conn.commit()


def not_stopped(dsn: str) -> list[str]:
    with db.connect(dsn, autocommit=True) as c:
        return [r["id"] for r in c.execute("SELECT id FROM workers WHERE stopped_at IS NULL").fetchall()]


def test_a_burst_worker_that_exited_without_recording_its_stop_is_marked_stopped(
    conn: db.Conn, dsn: str, stop_records_fail: None
) -> None:
    # the supervisor recorded the stop of a child that exited non-zero only: one that ended its burst (exit 0)
    # with its own record failed read as lost in the console for a day
    j = enqueue(conn, "t.ok", {}).id
    conn.commit()
    sup = Supervisor(config(dsn, task_modules=TASKS), processes=1)
    t, out = in_thread(sup.run)
    t.join(90)
    assert out == [0] and state(dsn, j) == "succeeded"
    assert scalar(dsn, "SELECT count(*) FROM workers") == 1
    assert not_stopped(dsn) == []


def test_workers_that_exited_0_at_the_supervisors_stop_without_recording_it_are_marked_stopped(
    dsn: str, stop_records_fail: None
) -> None:
    sup = Supervisor(config(dsn, burst=False, task_modules=TASKS, shutdown_grace=1), processes=2)
    t, out = in_thread(sup.run)
    try:
        wait_for(lambda: len(not_stopped(dsn)) == 2, 60, what="both workers to beat")
    finally:
        sup.stop()
        t.join(90)
    assert out == [0]
    assert all(p.exitcode == 0 for p, _ in sup.children.values())  # clean exits, their own records failed
    assert not_stopped(dsn) == []


