"""Housekeeping, done by whichever worker wins ``pg_try_advisory_xact_lock`` for it (no coordinator):
prune finished jobs by age (separate ages for succeeded and for failed/dead-lettered/cancelled),
expired idempotency records and resource leases, and gone workers; roll up "jobs in" per minute into
``job_metrics_minute`` so charts and rates outlive the rows, and fold in the producers' dedup hits."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from worker_core.clock import SYSTEM_CLOCK, Clock, now_on
from worker_core.db import Conn
from worker_core.sql import queries

#: housekeeping advisory lock key ("qc-house")
HOUSEKEEPING_LOCK = 0x71632D686F757365
#: producers' transactions younger than this may still commit rows with an older created_at
ROLLUP_LAG = dt.timedelta(minutes=2)


#: a longer retention would not fit a timestamp once subtracted from "now" (inf and nan are refused too)
MAX_RETENTION_SECONDS = 100 * 365 * 86400.0
MIN_ROLLUPS_SECONDS = 3600.0


@dataclass(frozen=True)
class Retention:
    succeeded_seconds: float = 86400.0
    #: failed, dead_lettered and cancelled: kept longer, operators may still requeue them
    failed_seconds: float = 14 * 86400.0
    #: the per-minute counters (job_metrics_minute), which the console reads for its last hour: a row per
    #: minute, queue and type, kept for weeks of history (they grew for ever)
    rollups_seconds: float = 90 * 86400.0
    batch: int = 5000
    #: per kind (jobs, idempotency records) and round; a round also stops at ``round_seconds``. Either
    #: way, more past retention means the next round runs soon (HousekeepingReport.more)
    max_batches: int = 200
    round_seconds: float = 20.0

    def __post_init__(self) -> None:
        # refused here, at start, with a clear error: in housekeeping it raised in every round, and the
        # round's other work (the rollup, the expired keys) was rolled back with it
        for name in ("succeeded_seconds", "failed_seconds", "rollups_seconds"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_RETENTION_SECONDS:  # False for nan
                raise ValueError(f"retention {name} must be between 0 and {MAX_RETENTION_SECONDS:g}, not {value!r}")
        if self.rollups_seconds < MIN_ROLLUPS_SECONDS:
            # the console's series read the last hour of them, its rates and the fleet's DLQ rate 15 minutes
            raise ValueError(
                f"the per-minute counters must be kept at least an hour (the console and the metrics read them),"
                f" not {self.rollups_seconds:g}s"
            )
        if not (self.batch >= 1 and self.max_batches >= 1 and 0 < self.round_seconds <= 3600):
            raise ValueError("retention batch and max_batches must be at least 1, round_seconds in (0, 3600]")


@dataclass(frozen=True)
class HousekeepingReport:
    pruned_jobs: int
    enqueued_rolled_up_until: dt.datetime | None
    analyzed: bool = False
    #: the round stopped at its batch or time budget with more past retention: run the next one soon
    more: bool = False


def _minute(t: dt.datetime) -> dt.datetime:
    return t.replace(second=0, microsecond=0)


def rollup_enqueued(conn: Conn, now: dt.datetime) -> dt.datetime:
    upto = _minute(now - ROLLUP_LAG)
    row = conn.execute(queries["housekeeping_watermark"], {"name": "enqueued"}).fetchone()
    since = row["watermark"] if row else None
    if since is None:
        oldest = conn.execute(queries["oldest_created_at"]).fetchone()
        since = _minute(oldest["at"]) if oldest and oldest["at"] else upto
    if since >= upto:
        return since
    conn.execute(queries["rollup_enqueued"], {"since": since, "upto": upto})
    conn.execute(queries["housekeeping_set_watermark"], {"name": "enqueued", "watermark": upto, "now": now})
    return upto


#: how long housekeeping's ANALYZE waits for its lock before it leaves it to the next round
ANALYZE_LOCK_TIMEOUT_MS = 1000


def analyze_if_stale(conn: Conn, threshold: int = 1000) -> bool:
    """ANALYZE job_queue when it never was, or changed by more than the rows its last ANALYZE saw: a queue
    table goes from empty to thousands of rows in a second, long before autovacuum looks at it. (Compared
    with its live rows, which an insert-only burst raises as much as its changes, a burst into a table
    analyzed empty was never caught.) In a transaction of its own that waits ANALYZE_LOCK_TIMEOUT_MS at most
    for the table's lock: a VACUUM of job_queue (an operator's, autovacuum's anti-wraparound one) holds it
    for minutes; the round went on waiting, up to its statement timeout, then failed, its rollup with it,
    and the next one did the same. False: not stale, or left to a later round."""
    with conn.transaction():  # the caller's transactions are its own: none is left open here
        row = conn.execute(queries["job_queue_stats_age"]).fetchone()
    if row is None or not (row["never"] or row["modified"] > max(threshold, row["analyzed_rows"])):
        return False
    try:
        with conn.transaction():
            conn.execute(f"SET LOCAL lock_timeout = {ANALYZE_LOCK_TIMEOUT_MS}")
            conn.execute(queries["analyze_job_queue"])
    except psycopg.errors.LockNotAvailable:
        return False
    return True


def _in_batches(
    conn: Conn, query: str, params: dict[str, Any], retention: Retention, deadline: float
) -> tuple[int, bool]:
    """Run a pruning statement batch after batch, each committed on its own (its row locks go with it), until
    a batch comes back short, or the round's budget of batches or time is spent. Returns the rows deleted,
    and whether more may be left."""
    total = 0
    for _ in range(retention.max_batches):
        with conn.transaction():
            n = conn.execute(query, {**params, "limit": retention.batch}).rowcount
        total += n
        if n < retention.batch:
            return total, False
        if time.monotonic() >= deadline:
            break
    return total, True


def prune_finished(
    conn: Conn, now: dt.datetime, retention: Retention, counted_until: dt.datetime, deadline: float
) -> tuple[int, bool]:
    """Finished jobs past their retention, never one created after ``counted_until``: "jobs in" is rolled up
    from job_queue, and a job pruned before its minute was counted would be missing from it for ever."""
    total, more = 0, False
    for states, age in (
        (["succeeded"], retention.succeeded_seconds),
        (["failed", "dead_lettered", "cancelled"], retention.failed_seconds),
    ):
        # each batch goes on from the last one's newest finished_at: the index walked holds every finished
        # state, and a batch from the start read past every dead letter older than the cut-off again (1M of
        # them: ~300 ms a batch of 5,000, and the round's budget went on re-reading them)
        after = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
        params = {"states": states, "before": now - dt.timedelta(seconds=age), "counted_until": counted_until}
        left = True
        for _ in range(retention.max_batches):
            with conn.transaction():
                rows = conn.execute(queries["prune_finished"], {**params, "after": after, "limit": retention.batch})
                ends = [r["finished_at"] for r in rows.fetchall()]
            total += len(ends)
            if len(ends) < retention.batch:
                left = False
                break
            after = max(ends)
            if time.monotonic() >= deadline:
                break
        more = more or left
    return total, more


def prune_rollups(conn: Conn, now: dt.datetime, retention: Retention, deadline: float) -> tuple[int, bool]:
    """Per-minute counters older than their retention, in batches as prune_finished."""
    before = now - dt.timedelta(seconds=retention.rollups_seconds)
    return _in_batches(conn, queries["prune_rollups"], {"before": before}, retention, deadline)


def prune_processed_keys(conn: Conn, now: dt.datetime, retention: Retention, deadline: float) -> tuple[int, bool]:
    """Expired idempotency records, in batches as prune_finished: a burst of keyed jobs expires all at
    once a retention later."""
    return _in_batches(conn, queries["prune_processed_keys"], {"now": now}, retention, deadline)


#: how long the housekeeping winner's session may sit idle (in a transaction, or between batches)
HOUSEKEEPING_IDLE_MS = 60_000


def bound_idle(conn: Conn) -> None:
    """A housekeeping winner that froze (SIGSTOP, a paused VM, a partition the server cannot see) held the
    lock, and in a batch that batch's rows, for as long as it stayed frozen: no worker pruned, rolled up
    or folded meanwhile. The server ends its session after a minute idle, in a transaction or (from
    PostgreSQL 14) between batches; a round never idles that long."""
    with conn.transaction():
        conn.execute(f"SET idle_in_transaction_session_timeout = {int(HOUSEKEEPING_IDLE_MS)}")
        if conn.info.server_version >= 140000:
            conn.execute(f"SET idle_session_timeout = {int(HOUSEKEEPING_IDLE_MS)}")


def _unlock(conn: Conn) -> None:
    """The session's housekeeping lock, released; if that fails, the connection is closed, which releases
    it too: held by a connection that lives on (the heartbeat's), it would stop every worker's rounds."""
    try:
        with conn.transaction():
            conn.execute(queries["housekeeping_unlock"], {"key": HOUSEKEEPING_LOCK})
    except Exception:
        conn.close()


def housekeeping(
    conn: Conn, clock: Clock = SYSTEM_CLOCK, retention: Retention | None = None
) -> HousekeepingReport | None:
    """One round, if this caller wins the lock (else None). Rolls up before it prunes, so no job is
    deleted before it was counted. The lock is the session's, so that each batch of deletions commits on
    its own: at thousands of jobs a second, a round of one transaction capped at a few batches fell behind
    for good, and held every row it deleted locked until its end."""
    retention = retention or Retention()
    now = now_on(conn, clock)
    with conn.transaction():
        won = conn.execute(queries["try_housekeeping_lock"], {"key": HOUSEKEEPING_LOCK}).fetchone()
    if not won or not won["won"]:
        return None
    try:
        deadline = time.monotonic() + retention.round_seconds
        # each in a short transaction of its own: the expired lock_key leases this deletes stayed locked, and
        # every job taking one of those keys waited, for as long as the ANALYZE after it waited on a VACUUM
        with conn.transaction():
            conn.execute(queries["prune_resource_locks"], {"now": now})
            conn.execute(queries["prune_single_flight"], {"now": now})
            conn.execute(queries["workers_prune"], {"before": now - dt.timedelta(days=1)})
        analyzed = analyze_if_stale(conn)
        with conn.transaction():
            until = rollup_enqueued(conn, now)
            conn.execute(queries["fold_dedup_hits"])
        _, keys_left = prune_processed_keys(conn, now, retention, deadline)
        pruned, jobs_left = prune_finished(conn, now, retention, until, deadline)
        _, rollups_left = prune_rollups(conn, now, retention, deadline)
    finally:
        _unlock(conn)
    return HousekeepingReport(
        pruned_jobs=pruned,
        enqueued_rolled_up_until=until,
        analyzed=analyzed,
        more=keys_left or jobs_left or rollups_left,
    )
