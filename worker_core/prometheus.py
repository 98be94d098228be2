"""Prometheus endpoints.

- A worker's own counters and histograms (``qconsole worker --metrics-port N``): what this process did,
  fed by the same MetricsBuffer that writes the per-minute rollups.
- Fleet-wide gauges read from the database on each scrape (``qconsole metrics --port N``): lag, oldest
  age, counts by state, DLQ and lease-expiration rates, live workers. One scrape target covers every
  worker, and it reads through worker_core.stats like the console does.

Names follow Prometheus conventions: ``qconsole_`` prefix, ``_total`` for counters, base units (seconds).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from worker_core import db, stats
from worker_core.metrics import MetricsBuffer

LABELS = ("queue", "job_type")

#: MetricsBuffer counter name -> (metric name, help)
COUNTER_METRICS = {
    "started": ("qconsole_jobs_started_total", "Jobs whose handler started (attempts; an idempotency hit runs none)."),
    "succeeded": ("qconsole_jobs_succeeded_total", "Jobs settled succeeded (idempotency hits included)."),
    "failed": ("qconsole_jobs_failed_total", "Jobs failed by a permanent error."),
    "dead_lettered": ("qconsole_jobs_dead_lettered_total", "Jobs moved to dead letters."),
    "retried": ("qconsole_jobs_retried_total", "Attempts that failed and were scheduled again."),
    "timeouts": ("qconsole_jobs_timeouts_total", "Attempts that ran past their timeout."),
    "anomalies": ("qconsole_jobs_unknown_errors_total", "Attempts that raised an unclassified error."),
    "lock_contention": ("qconsole_lock_contention_total", "Claims rescheduled because their lock_key was held."),
    "idempotency_hits": ("qconsole_idempotency_hits_total", "Jobs settled without running: key already done."),
    "lease_expirations": ("qconsole_lease_expirations_total", "Jobs reclaimed after their lease ran out."),
    "cancelled": ("qconsole_jobs_cancelled_total", "Jobs cancelled by an operator."),
}
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class WorkerExporter:
    """Per-worker counters and histograms, observed as the worker counts."""

    def __init__(self, buffer: MetricsBuffer, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.counters = {
            key: Counter(name.removesuffix("_total"), doc, LABELS, registry=self.registry)
            for key, (name, doc) in COUNTER_METRICS.items()
        }
        self.latency = Histogram(
            "qconsole_job_queue_latency_seconds",
            "Time from when a job was due to when its attempt started.",
            LABELS,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "qconsole_job_duration_seconds",
            "Handler duration per attempt (not of idempotency hits, which run none).",
            LABELS,
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        buffer.observers.append(self.observe)

    def observe(self, queue: str, job_type: str, name: str, value: float) -> None:
        if name == "latency_ms_sum":
            self.latency.labels(queue, job_type).observe(value / 1000)
        elif name == "duration_ms_sum":
            self.duration.labels(queue, job_type).observe(value / 1000)
        elif name in self.counters:
            self.counters[name].labels(queue, job_type).inc(value)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve on ``port`` until ``close()``."""
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return self._server

    _server: Any = None
    _thread: threading.Thread | None = None

    def close(self) -> None:
        """Stop serving and free the port: the worker's endpoint outlived it (its thread and listening
        socket), and the next Worker on that port in the same process refused to start."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(5)


class FleetCollector(Collector):
    """Gauges read from the database at scrape time, through the same functions as the console."""

    def __init__(self, dsn: str, statement_timeout_ms: int = 5000) -> None:
        self.dsn = dsn
        self.statement_timeout_ms = statement_timeout_ms
        self._lock = threading.Lock()
        self._conn: db.Conn | None = None

    def _connection(self) -> db.Conn:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = db.connect(
                self.dsn,
                application_name="qconsole-metrics",
                autocommit=True,
                read_only=True,
                jit=False,
                statement_timeout_ms=self.statement_timeout_ms,
            )
        return self._conn

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("qconsole_database_up", "1 when the last scrape could read the database.")
        seconds = 2 * self.statement_timeout_ms / 1000 + 2
        # a server that stopped answering: the read is cut off (db.Deadline) and this scrape, and those that
        # came meanwhile, say the database is down (they hung, and qconsole_database_up 0 never came)
        if not self._lock.acquire(timeout=seconds + 1):
            up.add_metric([], 0)
            yield up
            return
        try:
            conn = self._connection()
            with db.Deadline(conn, seconds):
                ov = stats.overview(conn)
        except psycopg.Error:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            up.add_metric([], 0)
            yield up
            return
        finally:
            self._lock.release()
        up.add_metric([], 1)
        yield up
        jobs = GaugeMetricFamily(
            "qconsole_jobs", "Jobs by state (live states, failed and dead letters).", labels=[*LABELS, "state"]
        )
        lag = GaugeMetricFamily(
            "qconsole_oldest_waiting_job_age_seconds", "Queue lag: age of the oldest ready job.", labels=list(LABELS)
        )
        dlq = GaugeMetricFamily(
            "qconsole_dead_letters_per_minute", "Dead-letter transitions per minute.", labels=list(LABELS)
        )
        lease = GaugeMetricFamily(
            "qconsole_lease_expirations_per_minute", "Lease expirations per minute.", labels=list(LABELS)
        )
        tput = GaugeMetricFamily(
            "qconsole_jobs_succeeded_per_minute", "Throughput: succeeded per minute.", labels=list(LABELS)
        )
        retries = GaugeMetricFamily("qconsole_retries_per_minute", "Retries scheduled per minute.", labels=list(LABELS))
        dedup = GaugeMetricFamily(
            "qconsole_dedup_hits_per_minute",
            "Messages collapsed into a live job by their dedup key, per minute (producers count them).",
            labels=list(LABELS),
        )
        latency = GaugeMetricFamily(
            "qconsole_queue_latency_avg_seconds",
            "Queue latency (due to start) of the jobs started in the window, on average.",
            labels=list(LABELS),
        )
        duration = GaugeMetricFamily(
            "qconsole_handler_duration_avg_seconds",
            "Handler duration of the jobs started in the window, on average.",
            labels=list(LABELS),
        )
        for t in ov.types:
            key = [t.queue, t.job_type]
            latency.add_metric(key, t.latency_avg_seconds)
            duration.add_metric(key, t.duration_avg_seconds)
            for state in ("queued", "running", "retry_scheduled", "failed", "dead_lettered"):
                jobs.add_metric([*key, state], getattr(t, state))
            lag.add_metric(key, t.oldest_waiting_seconds)
            dlq.add_metric(key, t.dlq_per_min)
            lease.add_metric(key, t.lease_expirations_per_min)
            tput.add_metric(key, t.throughput_per_min)
            retries.add_metric(key, t.retries_per_min)
            dedup.add_metric(key, t.dedup_hits_per_min)
        workers = GaugeMetricFamily("qconsole_workers_alive", "Workers with a recent heartbeat.")
        workers.add_metric([], ov.workers_alive)
        paused = GaugeMetricFamily("qconsole_queue_paused", "1 when an operator paused the queue.", labels=["queue"])
        for q in ov.queues:
            paused.add_metric([q.name], 1 if q.paused else 0)
        yield from (jobs, lag, dlq, lease, tput, retries, dedup, latency, duration, workers, paused)


def serve_fleet(dsn: str, port: int, addr: str = "0.0.0.0", statement_timeout_ms: int = 5000) -> Any:
    registry = CollectorRegistry()
    registry.register(FleetCollector(dsn, statement_timeout_ms))
    server, _ = start_http_server(port, addr, registry=registry)
    return server
