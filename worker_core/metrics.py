"""The minimum metrics per (queue, job type), counted in memory by each worker and flushed into the
per-minute table ``job_metrics_minute`` on every heartbeat: one upsert per minute, queue and type, so
the hot path never touches a shared counter row."""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections import defaultdict
from typing import Any

import psycopg

from worker_core.clock import SYSTEM_CLOCK, Clock
from worker_core.db import Conn
from worker_core.sql import queries

COUNTERS = (
    "started",
    "succeeded",
    "failed",
    "dead_lettered",
    "retried",
    "timeouts",
    "anomalies",
    "lock_contention",
    "dedup_hits",
    "idempotency_hits",
    "lease_expirations",
    "cancelled",
)
SUMS = ("latency_ms_sum", "duration_ms_sum")

Key = tuple[dt.datetime, str, str]


class MetricsBuffer:
    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._rows: dict[Key, dict[str, float]] = defaultdict(lambda: dict.fromkeys(COUNTERS + SUMS, 0))
        self.observers: list[Any] = []
        #: flushes whose COMMIT went unanswered, by transaction id (flush)
        self._unknown: list[tuple[str, dict[Key, dict[str, float]]]] = []

    def add(self, queue: str, job_type: str, name: str, value: float = 1) -> None:
        minute = self.clock.now().replace(second=0, microsecond=0)
        with self._lock:
            self._rows[(minute, queue, job_type)][name] += value
        for obs in self.observers:
            obs(queue, job_type, name, value)

    def add_many(
        self, queue: str, job_type: str, values: dict[str, float], samples: list[dict[str, float]] | None = None
    ) -> None:
        """Several counters of one job at once: one clock read and one lock, on the hot path. ``values``
        may be the sums of several jobs (a group's): then ``samples`` holds each job's own, which is what
        the observers (the worker's histograms) see."""
        minute = self.clock.now().replace(second=0, microsecond=0)
        with self._lock:
            row = self._rows[(minute, queue, job_type)]
            for name, value in values.items():
                row[name] += value
        if self.observers:
            for obs in self.observers:
                for one in samples if samples is not None else (values,):
                    for name, value in one.items():
                        obs(queue, job_type, name, value)

    def take(self) -> dict[Key, dict[str, float]]:
        with self._lock:
            rows, self._rows = self._rows, defaultdict(lambda: dict.fromkeys(COUNTERS + SUMS, 0))
        return dict(rows)

    def put_back(self, rows: dict[Key, dict[str, float]]) -> None:
        with self._lock:
            for key, values in rows.items():
                for name, v in values.items():
                    self._rows[key][name] += v

    def flush(self, conn: Conn) -> int:
        """Write what was counted since the last flush. On failure the counts are kept for the next one,
        unless the failure hid a commit: a flush whose COMMIT's reply was lost (the connection broke after
        the server committed) is asked about by the next one (``pg_xact_status``), and counted once. Put
        back blindly, it was counted twice: a heartbeat's worth of rates and charts doubled."""
        self._settle_unknown(conn)
        rows = self.take()
        if not rows:
            return 0
        # counters are integers in the table: a float count (1.0) must not fail every later flush
        payload = [
            {
                "minute": k[0].isoformat(),
                "queue": k[1],
                "job_type": k[2],
                **{n: int(x) if n in COUNTERS else x for n, x in v.items()},
            }
            for k, v in sorted(rows.items())
        ]
        xid: str | None = None
        try:
            with conn.transaction():
                written = conn.execute(queries["metrics_flush"], {"rows": json.dumps(payload)}).fetchone()
                xid = written["xid"] if written else None
        except Exception:
            if xid is None:
                self.put_back(rows)  # failed before its COMMIT: nothing of it committed
            else:
                with self._lock:
                    self._unknown.append((xid, rows))
            raise
        return len(rows)

    def _settle_unknown(self, conn: Conn) -> None:
        """The flushes whose COMMIT went unanswered: dropped if they committed, put back if not."""
        with self._lock:
            unknown, self._unknown = self._unknown, []
        still: list[tuple[str, dict[Key, dict[str, float]]]] = []
        try:
            while unknown:
                xid, rows = unknown[0]
                try:
                    with conn.transaction():
                        found = conn.execute(queries["xact_status"], {"xid": xid}).fetchone()
                    status = found["status"] if found else None
                except psycopg.errors.InvalidParameterValue:
                    # "in the future": another server's (a failover to a replica behind it): not committed here
                    status = None
                if status == "in progress":  # its server process is still ending it: asked again next time
                    still.append(unknown[0])
                elif status != "committed":  # aborted, too old to be known, or unknown here: not counted
                    self.put_back(rows)
                unknown.pop(0)
        except psycopg.Error:
            pass  # asked again at the next flush; this one goes on (failing, if the connection is gone)
        finally:
            with self._lock:
                self._unknown = still + unknown + self._unknown
