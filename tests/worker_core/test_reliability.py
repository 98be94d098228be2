"""Heartbeats and frozen workers: a long job keeps its lease; a frozen worker's job is reclaimed after
its visibility timeout, and when the frozen worker wakes up it cannot settle it (fencing)."""

from __future__ import annotations

import datetime as dt
import logging
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import worker_core.supervisor
import worker_core.worker
from tests.worker_core.helpers import (
    FreezingProxy,
    job,
    ledger,
    running_worker,
    scalar,
    spawn_python,
    state,
    wait_for,
)
from worker_core import db
from worker_core.clock import ServerAlignedClock, SystemClock
from worker_core.coordination import single_flight
from worker_core.locks import PostgresLocks
from worker_core.producer import enqueue, enqueue_many


def test_heartbeat_extends_the_lease_of_a_running_job(dsn: str, conn: db.Conn) -> None:
    jid = enqueue(conn, "t.slow", {"seconds": 4}, timeout_seconds=6, visibility_timeout_seconds=12).id
    with running_worker(dsn, heartbeat_interval=0.2, concurrency=1):
        first = wait_for(lambda: job(dsn, jid)["locked_until"] if state(dsn, jid) == "running" else None)
        # a later heartbeat pushed the lease end further than the claim did
        wait_for(lambda: job(dsn, jid)["locked_until"] > first + dt.timedelta(seconds=0.5), timeout=10)
        wait_for(lambda: state(dsn, jid) == "succeeded", timeout=15)
    assert job(dsn, jid)["lease_expirations"] == 0


FROZEN_WORKER = textwrap.dedent(
    """
    import faulthandler, signal, sys
    faulthandler.register(signal.SIGQUIT, all_threads=True)
    from worker_core.worker import Worker, WorkerConfig
    Worker(WorkerConfig(dsn=sys.argv[1], task_modules=("tests.worker_core.tasks",), concurrency=1,
                        poll_interval=0.1, heartbeat_interval=0.3, worker_id="frozen")).run()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("key", [None, "K"], ids=["keyless", "keyed"])
def test_a_frozen_worker_loses_its_job_and_cannot_settle_it_when_it_wakes(
    dsn: str, conn: db.Conn, tmp_path: Path, key: str | None
) -> None:
    # keyed: the frozen worker's open transaction holds the job's idempotency record. The worker that took
    # the job over waited on it for as long as the other stayed frozen (for ever), extending its own lease:
    # the server now ends a job's transaction left idle longer than the job's lease
    jid = enqueue(
        conn, "t.slow", {"seconds": 2, "ledger": True, "item": "once"}, timeout_seconds=3, visibility_timeout_seconds=9,
        idempotency_key=key,
    ).id
    frozen = spawn_python(FROZEN_WORKER, dsn, log=tmp_path / "frozen.log")
    try:
        wait_for(lambda: job(dsn, jid)["locked_by"] == "frozen" and state(dsn, jid) == "running", timeout=20)
        time.sleep(0.5)  # in its handler, which sleeps 2 s: its transaction holds the key's record by now
        frozen.send_signal(signal.SIGSTOP)
        # its lease runs out; an idle worker reclaims it, runs it alone, and it succeeds once
        wait_for(lambda: scalar(dsn, "SELECT locked_until < now() FROM job_queue WHERE id = %s", (jid,)), timeout=15)
        with running_worker(dsn, concurrency=2, heartbeat_interval=0.2):
            wait_for(lambda: state(dsn, jid) == "succeeded", timeout=20)
        row = job(dsn, jid)
        assert row["lease_expirations"] == 1 and row["attempts"] == 2
        assert [e["worker"] for e in row["errors"] if e["kind"] == "lease_expired"] == ["frozen"]
        frozen.send_signal(signal.SIGCONT)
        # the woken worker's handler finishes its write, but its settle is fenced off and rolls back
        frozen.send_signal(signal.SIGTERM)
        try:
            code: int | None = frozen.wait(30)
        except subprocess.TimeoutExpired:
            frozen.send_signal(signal.SIGQUIT)  # faulthandler: every thread's stack, into the log
            time.sleep(1)
            code = None
        assert code == 0, (tmp_path / "frozen.log").read_text()
    finally:
        if frozen.poll() is None:
            frozen.send_signal(signal.SIGCONT)
            frozen.kill()
            frozen.wait(10)
    assert [r["item"] for r in ledger(dsn)] == ["once"]
    assert state(dsn, jid) == "succeeded"


def _orphan_seen_by(busy: worker_core.worker.Worker, conn: db.Conn, orphan: object) -> None:
    """Make ``orphan`` the expired lease of a worker that died, and wait for ``busy`` to see it waiting."""
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'gone:1:dead',"
        " locked_until = now() - interval '1 minute' WHERE id = %s",
        (orphan,),
    )
    conn.commit()
    wait_for(lambda: busy._want_solo, 10, what="the busy worker to see the orphan")


def test_a_busy_worker_claims_again_once_another_healed_the_orphan_it_drained_for(dsn: str, conn: db.Conn) -> None:
    # a worker that saw an expired lease stopped claiming until its own longest job ended, long after an
    # idle worker had taken the orphan: one dead worker held up the busy part of the fleet
    slow = enqueue(conn, "t.slow", {"seconds": 20}).id
    orphan = enqueue(conn, "t.ok", {}, queue="solo").id
    conn.commit()
    with running_worker(dsn, heartbeat_interval=0.2, queues=("default", "solo")) as busy:
        wait_for(lambda: state(dsn, slow) == "running", 10, what="the long job to start")
        _orphan_seen_by(busy, conn, orphan)
        with running_worker(dsn, heartbeat_interval=0.2, queues=("solo",)):
            wait_for(lambda: state(dsn, orphan) == "succeeded", 10, what="the idle worker to heal it")
        fresh = [enqueue(conn, "t.ok", {}).id for _ in range(3)]
        conn.commit()
        wait_for(lambda: all(state(dsn, j) == "succeeded" for j in fresh), 10, what="the fresh jobs")
        assert state(dsn, slow) == "running"


def test_a_busy_worker_drains_for_solo_work_for_a_bounded_time(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nobody idle to take the orphan: the busy worker claims again after its drain (30 s, 1 s here), and
    # takes the orphan when it finds itself idle
    monkeypatch.setattr(worker_core.worker, "SOLO_DRAIN_SECONDS", 1.0)
    claims = []
    real_claim = worker_core.worker.Worker.claim
    monkeypatch.setattr(worker_core.worker.Worker, "claim", lambda w, n: claims.append(n) or real_claim(w, n))
    slow = enqueue(conn, "t.slow", {"seconds": 20}).id
    orphan = enqueue(conn, "t.ok", {}).id
    conn.commit()
    with running_worker(dsn, heartbeat_interval=0.2) as busy:
        wait_for(lambda: state(dsn, slow) == "running", 10, what="the long job to start")
        _orphan_seen_by(busy, conn, orphan)
        fresh = [enqueue(conn, "t.ok", {}).id for _ in range(3)]
        conn.commit()
        wait_for(lambda: all(state(dsn, j) == "succeeded" for j in fresh), 10, what="the fresh jobs")
        # past its drain it claims at the poll's pace (0.1 s), not again at once: it span ~2,600 claims a second
        before = len(claims)
        time.sleep(1.0)
        assert len(claims) - before < 100
        assert (state(dsn, slow), job(dsn, orphan)["locked_by"]) == ("running", "gone:1:dead")


class _SkewedClock(SystemClock):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def now(self) -> dt.datetime:
        return super().now() + dt.timedelta(seconds=self.seconds)


def _running_under(conn: db.Conn, worker: str) -> Any:
    """A job running under another worker's lease, 60 s from its end in the server's time."""
    live = enqueue(conn, "t.ok", {}).id
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = %s, started_at = now(),"
        " locked_until = clock_timestamp() + interval '60 seconds' WHERE id = %s",
        (worker, live),
    )
    return live


def test_a_worker_whose_clock_is_ahead_leaves_live_leases_alone(dsn: str, conn: db.Conn) -> None:
    # a live job of another worker, its lease 60 s from its end in the server's time: a worker whose clock was
    # two minutes ahead took it as an expired lease at once, and ran its handler a second time while the first ran
    live = _running_under(conn, "other:1:live")
    fresh = enqueue(conn, "t.ok", {}).id
    conn.commit()
    with running_worker(dsn, clock=_SkewedClock(120), heartbeat_interval=0.2) as ahead:
        wait_for(lambda: state(dsn, fresh) == "succeeded", 10, what="the fresh job")
        time.sleep(1.0)  # five beats, each of which looks for expired leases
        assert 110 < (ahead.clock_skew_seconds or 0) < 130
    assert (state(dsn, live), job(dsn, live)["locked_by"]) == ("running", "other:1:live")
    # and what it wrote is in the server's time, not two minutes ahead
    finished = "SELECT abs(extract(epoch FROM finished_at - now())) FROM job_queue WHERE id = %s"
    assert scalar(dsn, finished, (fresh,)) < 30


def test_a_worker_whose_clock_is_behind_writes_leases_others_find_live(dsn: str, conn: db.Conn) -> None:
    # two minutes behind, a worker wrote leases that ended 30 s before they began in the server's time: any
    # other worker took its running job as an orphan
    slow = enqueue(conn, "t.slow", {"seconds": 20}).id
    conn.commit()
    with running_worker(dsn, clock=_SkewedClock(-120), heartbeat_interval=0.2):
        wait_for(lambda: state(dsn, slow) == "running", 10, what="the job to start")
        left = scalar(dsn, "SELECT extract(epoch FROM locked_until - now()) FROM job_queue WHERE id = %s", (slow,))
        assert left > 30


def test_a_worker_far_from_its_database_is_aligned_too(dsn: str, conn: db.Conn) -> None:
    # 260 ms of round trip (another region): a measure to within 0.13 s of a 120 s skew was thrown away, and
    # the worker took live jobs from others as expired leases while its log said it kept the server's time
    proxy = FreezingProxy.before(dsn)
    proxy.delay = 0.13
    live = _running_under(conn, "other:1:live")
    fresh = enqueue(conn, "t.ok", {}).id
    conn.commit()
    try:
        with running_worker(proxy.dsn, clock=_SkewedClock(120), heartbeat_interval=0.5) as far:
            wait_for(lambda: state(dsn, fresh) == "succeeded", 60, what="the fresh job")
            time.sleep(1.5)
            assert isinstance(far.clock, ServerAlignedClock) and abs(far.clock.offset - 120) < 1
    finally:
        proxy.close()
    assert (state(dsn, live), job(dsn, live)["locked_by"]) == ("running", "other:1:live")


def test_a_host_clock_stepped_right_does_not_move_an_aligned_worker(dsn: str, conn: db.Conn) -> None:
    # aligned to a host two minutes ahead, then NTP steps the host's clock right: until the next measure the
    # worker's time was two minutes behind the server's, and the beat wrote its running job's lease 60 s into
    # the past, for any worker to take
    host = _SkewedClock(120)
    slow = enqueue(conn, "t.slow", {"seconds": 8}).id
    conn.commit()
    with running_worker(dsn, clock=host, heartbeat_interval=1.0) as w:
        wait_for(lambda: state(dsn, slow) == "running", 10, what="the job to start")
        assert isinstance(w.clock, ServerAlignedClock)
        wait_for(lambda: abs(w.clock.offset - 120) < 2, 10, what="the alignment")  # type: ignore[attr-defined]
        host.seconds = 0.0
        left = "SELECT extract(epoch FROM locked_until - now()) FROM job_queue WHERE id = %s"
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            assert scalar(dsn, left, (slow,)) > 0
            time.sleep(0.1)
        wait_for(lambda: w.clock.offset == 0.0, 5, what="the next measure")  # type: ignore[attr-defined]


def test_ending_a_dead_workers_leases_ends_them_in_the_servers_time(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on a host two minutes ahead, "ending" a dead worker's leases set them two minutes ahead: longer than
    # the leases it meant to end
    orphan = _running_under(conn, "other:1:dead")
    conn.commit()
    monkeypatch.setattr(worker_core.supervisor, "SYSTEM_CLOCK", _SkewedClock(120))
    worker_core.supervisor.end_dead_worker(dsn, worker_id="other:1:dead")
    assert scalar(dsn, "SELECT extract(epoch FROM locked_until - now()) FROM job_queue WHERE id = %s", (orphan,)) <= 0


def test_a_producer_whose_clock_is_off_schedules_in_the_servers_time(dsn: str, conn: db.Conn) -> None:
    # two minutes ahead, a producer delayed every job it enqueued by two minutes; two behind, it put them
    # ahead of older jobs of the same priority
    ahead, behind = _SkewedClock(120), _SkewedClock(-120)
    now_job = enqueue(conn, "t.ok", {}, clock=ahead).id
    later = enqueue(conn, "t.ok", {}, clock=behind, delay_seconds=60).id
    [many] = enqueue_many(conn, [("t.ok", {}, {"delay_seconds": 30})], clock=ahead)
    conn.commit()
    due = "SELECT extract(epoch FROM scheduled_at - now()) FROM job_queue WHERE id = %s"
    assert abs(scalar(dsn, due, (now_job,))) < 10
    assert 50 < scalar(dsn, due, (later,)) < 70
    assert 20 < scalar(dsn, due, (many.id,)) < 40
    assert abs(scalar(dsn, "SELECT extract(epoch FROM created_at - now()) FROM job_queue WHERE id = %s", (later,))) < 10


def test_lock_leases_and_single_flight_results_are_in_the_servers_time(conn: db.Conn) -> None:
    # a host two minutes behind took a lock_key lease, or stored a single_flight result, that had run out two
    # minutes before: the next caller took the lock at once, or never found the result
    behind, right = _SkewedClock(-120), SystemClock()
    assert PostgresLocks(behind).acquire(conn, "clock:k", "first", 60)
    assert not PostgresLocks(right).acquire(conn, "clock:k", "second", 60)
    calls = []
    for clock in (behind, right):
        single_flight("clock:sf", 60, lambda: calls.append(1) or 42, conn=conn, clock=clock)
    assert calls == [1]


def test_the_server_aligned_clock_moves_only_past_a_second() -> None:
    clock = ServerAlignedClock(_SkewedClock(0))
    assert not clock.measured
    clock.align(0.6, 0.001)
    assert clock.offset == 0.0 and clock.measured  # NTP-kept hosts: nothing moves
    clock.align(1.5, 1.2)
    assert clock.offset == 0.0  # a statement that waited says nothing
    clock.align(1.2, 0.5)
    assert clock.offset == 0.0  # 1.2 s give or take 0.25: not surely a second
    clock.align(1.5, 0.001)
    assert clock.offset == 1.5 and abs((SystemClock().now() - clock.now()).total_seconds() - 1.5) < 0.5
    clock.align(0.6, 0.001)
    assert clock.offset == 0.6  # once corrected, it follows down to half a second
    clock.align(0.2, 0.001)
    assert clock.offset == 0.0


def test_a_worker_whose_clock_is_off_says_so(dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    # leases are written and compared in the workers' time: a clock 45 s ahead took live jobs from other
    # workers as expired leases, and ran them a second time at once, with nothing said anywhere
    class AheadClock(SystemClock):
        def now(self) -> dt.datetime:
            return super().now() + dt.timedelta(seconds=45)

    caplog.set_level(logging.WARNING, logger="worker_core")
    with running_worker(dsn, heartbeat_interval=0.2) as fine:
        wait_for(lambda: fine.clock_skew_seconds is not None, 10, what="a beat")
    assert abs(fine.clock_skew_seconds or 0) < 5 and "clock" not in caplog.text
    with running_worker(dsn, clock=AheadClock(), heartbeat_interval=0.2) as ahead:
        wait_for(lambda: "clock is" in caplog.text, 10, what="the warning")
    assert 40 < (ahead.clock_skew_seconds or 0) < 50
    assert "s ahead of the database server's" in caplog.text and caplog.text.count("clock is") == 1
