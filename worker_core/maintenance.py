"""Housekeeping, done by whichever worker wins ``pg_try_advisory_xact_lock`` for it (no coordinator):
prune finished jobs by age (separate ages for succeeded and for failed/dead-lettered/cancelled),
expired idempotency records and resource leases, and gone workers; roll up "jobs in" per minute into
``job_metrics_minute`` so charts and rates outlive the rows, and fold in the producers' dedup hits."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from worker_core.clock import SYSTEM_CLOCK, Clock
from worker_core.db import Conn
from worker_core.sql import queries

#: housekeeping advisory lock key ("qc-house")
HOUSEKEEPING_LOCK = 0x71632D686F757365
#: producers' transactions younger than this may still commit rows with an older created_at
ROLLUP_LAG = dt.timedelta(minutes=2)


#: a longer retention would not fit a timestamp once subtracted from "now" (inf and nan are refused too)
MAX_RETENTION_SECONDS = 100 * 365 * 86400.0


@dataclass(frozen=True)
class Retention:
    succeeded_seconds: float = 86400.0
    #: failed, dead_lettered and cancelled: kept longer, operators may still requeue them
    failed_seconds: float = 14 * 86400.0
    batch: int = 5000
    max_batches: int = 20

    def __post_init__(self) -> None:
        # refused here, at start, with a clear error: in housekeeping it raised in every round, and the
        # round's other work (the rollup, the expired keys) was rolled back with it
        for name in ("succeeded_seconds", "failed_seconds"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_RETENTION_SECONDS:  # False for nan
                raise ValueError(f"retention {name} must be between 0 and {MAX_RETENTION_SECONDS:g}, not {value!r}")


@dataclass(frozen=True)
class HousekeepingReport:
    pruned_jobs: int
    enqueued_rolled_up_until: dt.datetime | None
    analyzed: bool = False


def _minute(t: dt.datetime) -> dt.datetime:
    return t.replace(second=0, microsecond=0)


def rollup_enqueued(conn: Conn, now: dt.datetime) -> dt.datetime | None:
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


def analyze_if_stale(conn: Conn, threshold: int = 1000) -> bool:
    """ANALYZE job_queue when it never was, or changed by more than its own size since: a queue table goes
    from empty to thousands of rows in a second, long before autovacuum looks at it."""
    row = conn.execute(queries["job_queue_stats_age"]).fetchone()
    if row is None or not (row["never"] or row["modified"] > max(threshold, row["live"])):
        return False
    conn.execute(queries["analyze_job_queue"])
    return True


def prune_finished(conn: Conn, now: dt.datetime, retention: Retention) -> int:
    total = 0
    for states, age in (
        (["succeeded"], retention.succeeded_seconds),
        (["failed", "dead_lettered", "cancelled"], retention.failed_seconds),
    ):
        before = now - dt.timedelta(seconds=age)
        for _ in range(retention.max_batches):
            n = conn.execute(
                queries["prune_finished"], {"states": states, "before": before, "limit": retention.batch}
            ).rowcount
            total += n
            if n < retention.batch:
                break
    return total


def prune_processed_keys(conn: Conn, now: dt.datetime, retention: Retention) -> int:
    """Expired idempotency records, in batches as prune_finished: a burst of keyed jobs expires all at
    once a retention later."""
    total = 0
    for _ in range(retention.max_batches):
        n = conn.execute(queries["prune_processed_keys"], {"now": now, "limit": retention.batch}).rowcount
        total += n
        if n < retention.batch:
            break
    return total


def housekeeping(
    conn: Conn, clock: Clock = SYSTEM_CLOCK, retention: Retention | None = None
) -> HousekeepingReport | None:
    """One round, if this caller wins the lock (else None). Rolls up before it prunes, so no job is
    deleted before it was counted."""
    retention = retention or Retention()
    now = clock.now()
    with conn.transaction():
        won = conn.execute(queries["try_housekeeping_lock"], {"key": HOUSEKEEPING_LOCK}).fetchone()
        if not won or not won["won"]:
            return None
        prune_processed_keys(conn, now, retention)
        conn.execute(queries["prune_resource_locks"], {"now": now})
        conn.execute(queries["prune_single_flight"], {"now": now})
        conn.execute(queries["workers_prune"], {"before": now - dt.timedelta(days=1)})
        analyzed = analyze_if_stale(conn)
        until = rollup_enqueued(conn, now)
        conn.execute(queries["fold_dedup_hits"])
        pruned = prune_finished(conn, now, retention)
    return HousekeepingReport(pruned_jobs=pruned, enqueued_rolled_up_until=until, analyzed=analyzed)
