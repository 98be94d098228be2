"""Retention and rollups: finished jobs pruned by age by whoever wins the lock; per-minute history
(jobs in, outcomes, dedup hits) survives the rows."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from typing import Any

from worker_core import db, stats
from worker_core.clock import FixedClock
from worker_core.maintenance import Retention, housekeeping, prune_finished
from worker_core.producer import enqueue, enqueue_many
from worker_core.sql import queries

T0 = dt.datetime(2026, 11, 28, 9, 0, tzinfo=dt.timezone.utc)


def _finish(conn: db.Conn, state: str, finished_at: dt.datetime) -> None:
    conn.execute("UPDATE job_queue SET state = %s, finished_at = %s WHERE state = 'queued'", (state, finished_at))


def test_prunes_finished_jobs_by_age_and_keeps_live_ones(conn: db.Conn) -> None:
    clock = FixedClock(T0)
    enqueue_many(conn, [("t.ok", {"i": i}) for i in range(3)], clock=clock)
    _finish(conn, "succeeded", T0)
    enqueue_many(conn, [("t.ok", {"i": i}) for i in range(2)], clock=clock)
    _finish(conn, "dead_lettered", T0)
    live = enqueue(conn, "t.ok", {}, clock=clock).id

    clock.set(T0 + dt.timedelta(hours=25))
    report = housekeeping(conn, clock, Retention(succeeded_seconds=86400, failed_seconds=7 * 86400))
    assert report is not None and report.pruned_jobs == 3
    states = {r["state"] for r in conn.execute("SELECT state FROM job_queue")}
    assert states == {"dead_lettered", "queued"}

    clock.set(T0 + dt.timedelta(days=8))
    report = housekeeping(conn, clock, Retention(succeeded_seconds=86400, failed_seconds=7 * 86400))
    assert report is not None and report.pruned_jobs == 2
    assert [r["id"] for r in conn.execute("SELECT id FROM job_queue")] == [live]


def test_jobs_in_survive_retention_and_are_counted_once(conn: db.Conn) -> None:
    clock = FixedClock(T0)
    enqueue_many(conn, [("t.ok", {"i": i}) for i in range(4)], clock=clock)
    clock.set(T0 + dt.timedelta(minutes=1))
    enqueue(conn, "t.ok", {}, clock=clock)
    _finish(conn, "succeeded", T0 + dt.timedelta(minutes=1))

    clock.set(T0 + dt.timedelta(days=2))
    for _ in range(2):  # a second round (a restarted worker) must not count again
        assert housekeeping(conn, clock) is not None
    assert conn.execute("SELECT count(*) AS n FROM job_queue").fetchone() == {"n": 0}
    rows = conn.execute("SELECT minute, enqueued FROM job_metrics_minute ORDER BY minute").fetchall()
    assert [(r["minute"], r["enqueued"]) for r in rows] == [(T0, 4), (T0 + dt.timedelta(minutes=1), 1)]


def test_a_round_prunes_batch_after_batch_and_says_when_more_is_left(dsn: str, conn: db.Conn) -> None:
    # a round was one transaction capped at 20 batches of 5,000: above ~1,700 finished jobs a second, retention
    # fell behind for good (one round a minute), and every deleted row stayed locked until the round's end
    clock = FixedClock(T0)
    enqueue_many(conn, [("t.ok", {"i": i}) for i in range(7)], clock=clock)
    _finish(conn, "succeeded", T0)
    conn.commit()
    clock.set(T0 + dt.timedelta(days=2))
    small = Retention(batch=2, max_batches=2)
    with db.connect(dsn) as hk:
        first = housekeeping(hk, clock, small)
        assert first is not None and (first.pruned_jobs, first.more) == (4, True)
        # each batch committed as it went, and the lock was let go with the round
        assert conn.execute("SELECT count(*) AS n FROM job_queue").fetchone() == {"n": 3}
        conn.commit()
        with db.connect(dsn) as other:
            second = housekeeping(other, clock, small)
        assert second is not None and (second.pruned_jobs, second.more) == (3, False)


def test_a_job_is_never_pruned_before_its_minute_is_counted_in_jobs_in(conn: db.Conn) -> None:
    # "jobs in" is rolled up from job_queue up to two minutes ago: with a retention shorter than that, the
    # round deleted jobs before it counted them
    clock = FixedClock(T0)
    enqueue_many(conn, [("t.ok", {"i": i}) for i in range(3)], clock=clock)
    _finish(conn, "succeeded", T0)
    clock.set(T0 + dt.timedelta(minutes=5))
    enqueue_many(conn, [("t.ok", {"i": i}) for i in range(10)], clock=clock)
    _finish(conn, "succeeded", T0 + dt.timedelta(minutes=5))
    clock.set(T0 + dt.timedelta(minutes=5, seconds=30))
    report = housekeeping(conn, clock, Retention(succeeded_seconds=0))
    assert report is not None and report.pruned_jobs == 3  # the 10 are not counted yet: they stay
    clock.set(T0 + dt.timedelta(minutes=10))
    report = housekeeping(conn, clock, Retention(succeeded_seconds=0))
    assert report is not None and report.pruned_jobs == 10
    rows = conn.execute("SELECT minute, enqueued FROM job_metrics_minute ORDER BY minute").fetchall()
    assert [(r["minute"], r["enqueued"]) for r in rows] == [(T0, 3), (T0 + dt.timedelta(minutes=5), 10)]


def test_only_one_housekeeper_at_a_time(dsn: str) -> None:
    with db.connect(dsn) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (0x71632D686F757365,))
        results: list[object] = []

        def other() -> None:
            with db.connect(dsn) as conn:
                results.append(housekeeping(conn))

        t = threading.Thread(target=other)
        t.start()
        t.join(10)
        assert results == [None]


def test_dedup_hits_are_counted_for_the_window(conn: db.Conn) -> None:
    enqueue(conn, "t.ok", {}, dedup_key="same")
    assert not enqueue(conn, "t.ok", {}, dedup_key="same").created
    results = enqueue_many(conn, [("t.ok", {}, {"dedup_key": "same"}), ("t.ok", {}, {"dedup_key": "other"})])
    assert [r.created for r in results] == [False, True]
    by_type = {t.job_type: t for t in stats.overview(conn).types}
    assert by_type["t.ok"].dedup_hits == 2


def test_a_dedup_hit_in_an_open_transaction_holds_no_other_producer_or_worker(dsn: str, conn: db.Conn) -> None:
    # counted by an upsert of job_metrics_minute's (minute, queue, type) row in the producer's transaction,
    # a hit held that row until the business transaction ended: the other producers' hits of that type and
    # the workers' metrics flushes waited for it, and two producers hitting two types in opposite order
    # deadlocked
    from worker_core.metrics import MetricsBuffer

    enqueue(conn, "t.ok", {}, dedup_key="same")
    conn.commit()
    with db.connect(dsn) as first, db.connect(dsn) as second:
        assert not enqueue(first, "t.ok", {}, dedup_key="same").created  # its transaction stays open
        second.execute("SET lock_timeout = '1s'")
        assert not enqueue(second, "t.ok", {}, dedup_key="same").created
        second.commit()
        buffer = MetricsBuffer()
        buffer.add_many("default", "t.ok", {"started": 1, "succeeded": 1})
        second.execute("SET lock_timeout = '1s'")
        buffer.flush(second)
        second.commit()
        first.commit()
    by_type = {t.job_type: t for t in stats.overview(conn).types}
    assert by_type["t.ok"].dedup_hits == 2 and by_type["t.ok"].succeeded == 1


def test_dedup_hits_are_folded_into_the_rollups_once(conn: db.Conn) -> None:
    clock = FixedClock(T0)
    enqueue(conn, "t.ok", {}, dedup_key="same", clock=clock)
    for _ in range(3):
        enqueue(conn, "t.ok", {}, dedup_key="same", clock=clock)
    conn.commit()
    assert {t.job_type: t.dedup_hits for t in stats.overview(conn, clock=clock).types}["t.ok"] == 3
    for _ in range(2):
        assert housekeeping(conn, clock) is not None
        conn.commit()
        assert {t.job_type: t.dedup_hits for t in stats.overview(conn, clock=clock).types}["t.ok"] == 3
    assert conn.execute("SELECT count(*) AS n FROM dedup_hit_counts").fetchone() == {"n": 0}
    row = conn.execute("SELECT minute, dedup_hits FROM job_metrics_minute WHERE dedup_hits > 0").fetchone()
    assert row == {"minute": T0, "dedup_hits": 3}


def test_expired_idempotency_records_go_in_batches_but_not_while_a_job_may_still_run_with_the_key(
    conn: db.Conn,
) -> None:
    clock = FixedClock(T0)
    keys = [f"k{i}" for i in range(7)]
    conn.execute(
        "INSERT INTO processed_keys (idempotency_key, job_id, job_type, processed_at, expires_at)"
        " SELECT k, gen_random_uuid(), 't.ok', %s, %s FROM unnest(%s::text[]) k",
        (T0, T0 + dt.timedelta(days=7), keys),
    )
    # a duplicate of k0 still waits (scheduled far ahead), one of k1 was dead-lettered (requeueable), one
    # of k2 succeeded long ago (the record's own job, say)
    enqueue(conn, "t.ok", {}, idempotency_key="k0", clock=clock)
    enqueue(conn, "t.ok", {}, idempotency_key="k1", clock=clock)
    conn.execute("UPDATE job_queue SET state = 'dead_lettered', finished_at = %s WHERE idempotency_key = 'k1'", (T0,))
    enqueue(conn, "t.ok", {}, idempotency_key="k2", clock=clock)
    conn.execute("UPDATE job_queue SET state = 'succeeded', finished_at = %s WHERE idempotency_key = 'k2'", (T0,))
    clock.set(T0 + dt.timedelta(days=7, seconds=1))
    report = housekeeping(conn, clock, Retention(failed_seconds=30 * 86400, batch=2, max_batches=2))
    assert report is not None and report.more
    left = sorted(r["idempotency_key"] for r in conn.execute("SELECT idempotency_key FROM processed_keys"))
    assert left == ["k0", "k1", "k6"]  # 2 batches of 2 went, k6 waits for the next round
    assert housekeeping(conn, clock, Retention(failed_seconds=30 * 86400, batch=2, max_batches=2)) is not None
    left = sorted(r["idempotency_key"] for r in conn.execute("SELECT idempotency_key FROM processed_keys"))
    assert left == ["k0", "k1"]


def test_per_minute_counters_are_kept_for_their_retention_only(conn: db.Conn) -> None:
    # a row per minute, queue and type, for ever: two years of a hundred types were 100 million rows
    rows = [(T0 - dt.timedelta(days=d), "default", "t.ok") for d in (200, 100, 31, 1)]
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO job_metrics_minute (minute, queue, job_type, succeeded) VALUES (%s, %s, %s, 1)",
                        rows)  # fmt: skip
    housekeeping(conn, FixedClock(T0), Retention(rollups_seconds=90 * 86400, batch=1))
    kept = [r["minute"] for r in conn.execute("SELECT minute FROM job_metrics_minute ORDER BY minute")]
    assert kept == [T0 - dt.timedelta(days=31), T0 - dt.timedelta(days=1)]


def test_the_counters_retention_is_at_least_the_hour_the_console_reads() -> None:
    # 0 ("keep for ever" to many tools) deleted even the current minute's counters, at every round
    import pytest

    for seconds in (0, 1800):
        with pytest.raises(ValueError, match="at least an hour"):
            Retention(rollups_seconds=seconds)


def test_a_burst_into_a_table_analyzed_empty_is_analyzed(conn: db.Conn) -> None:
    # compared with its live rows, which an insert-only burst raises as much as its changes, it never was
    from tests.worker_core.helpers import wait_for
    from worker_core.maintenance import analyze_if_stale

    conn.execute("ALTER TABLE job_queue SET (autovacuum_enabled = false)")  # housekeeping's own decision
    conn.commit()
    assert analyze_if_stale(conn)  # never analyzed: now, empty
    conn.commit()
    for first in range(0, 5000, 1000):
        enqueue_many(conn, [("t.ok", {"i": i}) for i in range(first, first + 1000)])
        conn.commit()
    wait_for(lambda: analyze_if_stale(conn), 15, what="the burst to be analyzed")


def test_a_frozen_housekeeping_winner_lets_go_of_the_lock(dsn: str, conn: db.Conn, monkeypatch: Any) -> None:
    # a winner that froze (SIGSTOP, a paused VM) held the lock as long as it stayed frozen: no round ran
    from tests.worker_core.helpers import FreezingProxy, wait_for
    from worker_core import maintenance
    from worker_core.maintenance import HOUSEKEEPING_LOCK
    from worker_core.sql import queries

    monkeypatch.setattr(maintenance, "HOUSEKEEPING_IDLE_MS", 1000)
    proxy = FreezingProxy.before(dsn)
    try:
        winner = db.connect(proxy.dsn)
        maintenance.bound_idle(winner)
        with winner.transaction():
            won = winner.execute(queries["try_housekeeping_lock"], {"key": HOUSEKEEPING_LOCK}).fetchone()
        assert won == {"won": True}
        assert housekeeping(conn, FixedClock(T0)) is None  # held
        proxy.frozen.set()  # frozen between two batches, its session lock held
        wait_for(lambda: housekeeping(conn, FixedClock(T0)) is not None, 15, what="the lock let go of")
    finally:
        proxy.frozen.clear()
        proxy.close()


def test_a_vacuum_of_the_queue_table_holds_up_neither_lock_keys_nor_the_round(dsn: str, conn: db.Conn) -> None:
    # the round's ANALYZE ran in the transaction that deleted the expired lock_key leases: while it waited on a
    # VACUUM of job_queue (an operator's, autovacuum's anti-wraparound one), every job taking one of those keys
    # waited too, then the round failed at its statement timeout, its rollup with it, and the next did the same
    enqueue_many(conn, [("t.ok", {"i": i}) for i in range(1500)])  # the statistics are stale: ANALYZE is due
    conn.execute(
        "INSERT INTO resource_locks (lock_key, token, job_id, expires_at)"
        " VALUES ('order:1', 'old', gen_random_uuid(), now() - interval '1 minute')"
    )
    conn.commit()
    vacuum = db.connect(dsn)
    vacuum.execute("LOCK TABLE job_queue IN SHARE UPDATE EXCLUSIVE MODE")  # what a VACUUM holds
    reports: list[Any] = []
    try:
        with db.connect(dsn) as hk:
            round_ = threading.Thread(target=lambda: reports.append(housekeeping(hk)), daemon=True)
            round_.start()
            with db.connect(dsn, autocommit=True) as slot:
                slot.execute("SET lock_timeout = '5s'")
                taken = slot.execute(
                    queries["lock_acquire"],
                    {"key": "order:1", "token": "new", "now": None, "ttl": 30, "job_id": uuid.uuid4()},
                ).fetchone()
            assert taken is not None
            round_.join(15)
    finally:
        vacuum.rollback()
        vacuum.close()
    [report] = reports
    assert report is not None and not report.analyzed and report.enqueued_rolled_up_until is not None


def test_each_prune_batch_goes_on_from_the_last_and_reads_past_the_dead_letters_once(conn: db.Conn) -> None:
    # the index the prune walks holds every finished state: each batch of 5,000 succeeded jobs read from the
    # start past every dead letter older than the cut-off (kept 14 days), 1M of them ~300 ms a batch
    conn.execute(
        "INSERT INTO job_queue (job_type, state, attempts, created_at, finished_at, updated_at)"
        " SELECT 't.x', 'dead_lettered', 5, now() - interval '10 days' + i * interval '1 second',"
        " now() - interval '10 days' + i * interval '1 second', now() FROM generate_series(1, 20000) i"
    )
    conn.execute(
        "INSERT INTO job_queue (job_type, state, attempts, created_at, finished_at, updated_at)"
        " SELECT 't.x', 'succeeded', 1, now() - interval '30 hours', now() - interval '30 hours' + i * interval '1 ms',"
        " now() FROM generate_series(1, 2500) i"
    )
    conn.execute("ANALYZE job_queue")
    conn.commit()
    now = conn.execute("SELECT now() AS n").fetchone()["n"]
    sent: list[dict[str, Any]] = []

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(conn, name)

        def execute(self, query: Any, params: Any = None) -> Any:
            if query is queries["prune_finished"]:
                sent.append(dict(params))
            return conn.execute(query, params)

    retention = Retention(batch=1000)
    pruned, more = prune_finished(Recording(), now, retention, now - dt.timedelta(minutes=2), float("inf"))  # type: ignore[arg-type]
    assert (pruned, more) == (2500, False)
    succeeded = [p for p in sent if p["states"] == ["succeeded"]]
    assert len(succeeded) == 3 and succeeded[0]["after"] < succeeded[1]["after"] < succeeded[2]["after"]
    # a batch that goes on from where the last stopped reads none of the dead letters before it
    plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + queries["prune_finished"], succeeded[2]).fetchone()
    conn.rollback()

    def removed(node: dict[str, Any]) -> int:
        return int(node.get("Rows Removed by Filter", 0)) + sum(removed(n) for n in node.get("Plans", []))

    assert removed(plan["QUERY PLAN"][0]["Plan"]) < 1000
