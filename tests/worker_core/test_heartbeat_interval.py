"""Each worker's heartbeat interval (migration 0017): the console and the CLI judge a worker lost against its
own interval, and a job's lease is extended often enough whatever the interval.

- A worker beating every 30 s (WorkerConfig took it; only the CLI refused more than 10 s) read as lost
  between every two beats: lost meant 30 s without a beat, whatever the interval.
- A lease shorter than the interval (a 1 s timeout has a 6 s lease) ran out between two beats of a live
  worker: a job claimed ahead of the free slots (prefetched) waited behind a long one with its lease gone,
  and an idle worker would take it and run it again beside it.
"""

from __future__ import annotations

import datetime as dt
import time

import pytest

from tests.worker_core.helpers import WorkerThread, running_worker, scalar, state, wait_for
from worker_core import FixedClock, db, enqueue, stats
from worker_core.models import LOST_AFTER_SECONDS, lost_after_seconds
from worker_core.worker import MAX_HEARTBEAT_INTERVAL_SECONDS, WorkerConfig

NOW = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def test_a_heartbeat_interval_above_a_minute_is_refused() -> None:
    with pytest.raises(ValueError, match="60 s at most"):
        WorkerConfig(heartbeat_interval=MAX_HEARTBEAT_INTERVAL_SECONDS + 1)
    assert WorkerConfig(heartbeat_interval=30).heartbeat_interval == 30


def test_the_lost_threshold_is_three_intervals_and_30_s_at_least() -> None:
    assert lost_after_seconds(None) == LOST_AFTER_SECONDS == 30
    assert lost_after_seconds(2) == 30
    assert lost_after_seconds(10) == 30
    assert lost_after_seconds(20) == 60
    assert lost_after_seconds(60) == 180


def test_each_worker_is_judged_lost_against_its_own_interval(conn: db.Conn) -> None:
    clock = FixedClock(NOW)
    # name: (its interval, seconds since its last beat, lost?)
    rows = {
        "old-version": (None, 31, True),  # a worker of an earlier version: the 30 s rule
        "fast-live": (2, 29, False),
        "fast-lost": (2, 31, True),
        "slow-live": (20, 59, False),  # lost at 30 s, before 0017, between two of its beats
        "slow-lost": (20, 61, True),
    }
    for name, (interval, age, _) in rows.items():
        conn.execute(
            "INSERT INTO workers (id, host, pid, concurrency, last_heartbeat_at, heartbeat_interval_seconds)"
            " VALUES (%s, 'h', 1, 4, %s, %s)",
            (name, NOW - dt.timedelta(seconds=age), interval),
        )
    listed = {w.id: w for w in stats.workers(conn, clock)}
    assert {name: w.lost for name, w in listed.items()} == {name: lost for name, (_, _, lost) in rows.items()}
    slow = listed["slow-lost"]
    assert slow.heartbeat_interval_seconds == 20
    assert slow.lost_since == NOW - dt.timedelta(seconds=1)  # three intervals after its last beat
    # the job detail judges the worker holding a lease the same way
    job = enqueue(conn, "t.ok", {}).id
    conn.execute(
        "UPDATE job_queue SET state = 'running', locked_by = 'slow-live', locked_until = %s WHERE id = %s",
        (NOW + dt.timedelta(seconds=60), job),
    )
    holders = stats.job_holders(conn, stats.get_job(conn, job), clock)
    assert holders.worker is not None and holders.worker_state == "live"


def test_a_worker_says_its_interval_in_its_row(dsn: str) -> None:
    with running_worker(dsn, heartbeat_interval=0.7) as w:
        wait_for(lambda: scalar(dsn, "SELECT count(*) FROM workers WHERE id = %s", (w.id,)), 10, what="its row")
        said = scalar(dsn, "SELECT heartbeat_interval_seconds FROM workers WHERE id = %s", (w.id,))
    assert said == pytest.approx(0.7)


def test_a_short_lease_is_extended_between_long_beats(conn: db.Conn, dsn: str) -> None:
    # one slot, busy with a long job; a job with a 6 s lease claimed ahead of it (prefetched) waits for the
    # slot for longer than its lease, while the worker beats every 30 s
    long = enqueue(conn, "t.slow", {"seconds": 9}).id
    short = enqueue(conn, "t.ok", {}, timeout_seconds=0.5, visibility_timeout_seconds=6).id
    conn.commit()
    wt = WorkerThread(dsn, burst=False, heartbeat_interval=30, concurrency=1, prefetch=1).start()
    try:
        wait_for(lambda: state(dsn, long) == "running" and state(dsn, short) == "running", 10,
                 what="both jobs to be claimed")  # fmt: skip
        assert wt.worker.beat_period() == pytest.approx(2.0)  # a third of the shortest lease in flight
        time.sleep(7.5)  # past the short job's first lease, its slot still busy
        left = scalar(dsn, "SELECT extract(epoch FROM locked_until - now()) FROM job_queue WHERE id = %s", (short,))
        assert state(dsn, short) == "running" and left > 0, f"its lease ended {-left:.1f} s ago"
        wait_for(lambda: state(dsn, short) == "succeeded", 15, what="the short job to run")
    finally:
        assert wt.stop() == 0
    assert scalar(dsn, "SELECT lease_expirations FROM job_queue WHERE id = %s", (short,)) == 0
