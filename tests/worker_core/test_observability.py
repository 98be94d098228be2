"""Observability: both Prometheus endpoints match the database after a known workload, and every log line
about a job carries its fields (JSON for machines)."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tests.worker_core.tasks  # noqa: F401 - registers the types, so producers use their policies
from tests.worker_core.helpers import WorkerThread, run_burst, wait_for
from worker_core import db, stats
from worker_core.logs import setup_logging
from worker_core.metrics import MetricsBuffer
from worker_core.producer import enqueue, enqueue_many
from worker_core.prometheus import WorkerExporter, serve_fleet
from worker_core.worker import Worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Scrape:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def burst_scrape(
    monkeypatch: pytest.MonkeyPatch, dsn: str, port: int, setup: Callable[[Worker], None] | None = None, **kw: Any
) -> Scrape:
    """Run a burst worker serving its metrics on ``port`` (``setup`` first, on the worker): what its endpoint
    served when the run was done, the last scrape before the endpoint closes with the worker."""
    served: Scrape = {}
    close = WorkerExporter.close

    def scrape_then_close(self: WorkerExporter) -> None:
        served.update(scrape(port))
        close(self)

    monkeypatch.setattr(WorkerExporter, "close", scrape_then_close)
    wt = WorkerThread(dsn, metrics_port=port, **kw)
    if setup is not None:
        setup(wt.worker)
    assert wt.start().join(60) == 0
    assert served, "the worker's endpoint was not closed"
    return served


def labels(job_type: str, queue: str = "default", **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"job_type": job_type, "queue": queue, **extra}.items()))


def known_workload(conn: db.Conn) -> None:
    enqueue_many(conn, [("t.ok", {}) for _ in range(3)])
    enqueue(conn, "t.flaky", {"fail_times": 1})
    enqueue(conn, "t.permanent", {})
    enqueue(conn, "t.unknown", {})  # two attempts, then dead letters
    enqueue(conn, "t.ledger", {"item": "a"}, idempotency_key="k")
    enqueue(conn, "t.ledger", {"item": "a"}, idempotency_key="k")
    enqueue(conn, "t.ok", {}, dedup_key="d")
    enqueue(conn, "t.ok", {}, dedup_key="d")  # a dedup hit


def test_worker_and_fleet_endpoints_match_the_database(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    known_workload(conn)
    enqueue(conn, "t.ok", {}, queue="later", delay_seconds=3600)  # waiting, not ready
    w = burst_scrape(monkeypatch, dsn, free_port(), concurrency=1)
    assert w[("qconsole_jobs_succeeded_total", labels("t.ok"))] == 4
    assert w[("qconsole_jobs_started_total", labels("t.flaky"))] == 2
    assert w[("qconsole_jobs_retried_total", labels("t.flaky"))] == 1
    assert w[("qconsole_jobs_failed_total", labels("t.permanent"))] == 1
    assert w[("qconsole_jobs_dead_lettered_total", labels("t.unknown"))] == 1
    assert w[("qconsole_jobs_unknown_errors_total", labels("t.unknown"))] == 2
    assert w[("qconsole_idempotency_hits_total", labels("t.ledger"))] == 1
    assert w[("qconsole_job_duration_seconds_count", labels("t.ok"))] == 4
    assert w[("qconsole_job_queue_latency_seconds_count", labels("t.flaky"))] == 2

    fleet_port = free_port()
    serve_fleet(dsn, fleet_port, "127.0.0.1")
    f = scrape(fleet_port)
    db_counts = {
        (r["job_type"], r["queue"], r["state"]): r["n"]
        for r in conn.execute("SELECT job_type, queue, state, count(*) AS n FROM job_queue GROUP BY 1, 2, 3")
    }
    for (job_type, queue, state), n in db_counts.items():
        if state in ("queued", "running", "retry_scheduled", "failed", "dead_lettered"):
            assert f[("qconsole_jobs", labels(job_type, queue, state=state))] == n
    assert f[("qconsole_jobs", labels("t.unknown", state="dead_lettered"))] == 1
    assert f[("qconsole_jobs", labels("t.ok", "later", state="queued"))] == 1
    assert f[("qconsole_oldest_waiting_job_age_seconds", labels("t.ok", "later"))] == 0  # not ready yet
    now = dt.datetime.now(dt.timezone.utc)
    covered = stats.WINDOW_MINUTES - 1 + (now.second + now.microsecond / 1e6) / 60  # full minutes + this one
    assert f[("qconsole_dead_letters_per_minute", labels("t.unknown"))] == pytest.approx(1 / covered, rel=0.01)
    assert f[("qconsole_jobs_succeeded_per_minute", labels("t.ok"))] == pytest.approx(4 / covered, rel=0.01)
    # producers count dedup hits: the worker's counter of them never moved (it is gone), the fleet's has them
    assert f[("qconsole_dedup_hits_per_minute", labels("t.ok"))] == pytest.approx(1 / covered, rel=0.01)
    assert not any(name == "qconsole_dedup_hits_total" for name, _ in w)
    assert f[("qconsole_database_up", ())] == 1
    ov = {t.job_type: t for t in stats.overview(conn).types if t.queue == "default"}
    assert ov["t.ok"].dedup_hits == 1 and ov["t.ledger"].idempotency_hits == 1
    # DESIGN's queue latency and handler duration per type, read by every surface (they reached none)
    for name, fleet_name in (("qconsole_job_queue_latency_seconds", "qconsole_queue_latency_avg_seconds"),
                             ("qconsole_job_duration_seconds", "qconsole_handler_duration_avg_seconds")):  # fmt: skip
        avg = w[(f"{name}_sum", labels("t.flaky"))] / w[(f"{name}_count", labels("t.flaky"))]
        assert f[(fleet_name, labels("t.flaky"))] == pytest.approx(avg, rel=0.01, abs=1e-4)
    assert ov["t.flaky"].latency_avg_seconds == pytest.approx(f[("qconsole_queue_latency_avg_seconds",
                                                                    labels("t.flaky"))])  # fmt: skip


def test_a_workers_endpoint_closes_with_it_and_the_next_worker_of_the_process_serves_on_its_port(
    dsn: str, conn: db.Conn
) -> None:
    # the endpoint was never shut down: its thread and listening socket outlived the worker, and the next
    # Worker on that port in the same process refused to start (exit 2, a configuration to fix)
    def served() -> Scrape:
        with contextlib.suppress(OSError):
            return scrape(port)
        return {}

    port = free_port()
    servers = {t for t in threading.enumerate() if "serve_forever" in t.name}
    for run in range(2):
        enqueue(conn, "t.ok", {})
        wt = WorkerThread(dsn, metrics_port=port, burst=False).start()
        wait_for(lambda: served().get(("qconsole_jobs_succeeded_total", labels("t.ok"))) == 1, what=f"run {run}")
        assert wt.stop() == 0
        with pytest.raises(OSError):
            scrape(port)  # closed with its worker
        assert {t for t in threading.enumerate() if "serve_forever" in t.name} == servers


def test_the_fleet_endpoint_says_the_database_is_down_when_it_stops_answering(dsn: str) -> None:
    # TCP still acknowledged: the scrape waited on the hung server (the Prometheus client timed out), and
    # qconsole_database_up 0 never came
    from tests.worker_core.helpers import FreezingProxy

    proxy = FreezingProxy.before(dsn)
    port = free_port()
    server = serve_fleet(proxy.dsn, port, "127.0.0.1", statement_timeout_ms=500)
    try:
        assert scrape(port)[("qconsole_database_up", ())] == 1
        proxy.frozen.set()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
            text = r.read().decode()
        assert "qconsole_database_up 0.0" in text
        proxy.frozen.clear()
        assert scrape(port)[("qconsole_database_up", ())] == 1  # and back
    finally:
        proxy.frozen.clear()
        server.shutdown()
        proxy.close()


def test_histograms_observe_each_job_of_a_group_not_the_groups_sum(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs sharing a transaction: their counters go to the buffer summed per group, but a histogram that
    observed the sum saw one huge latency instead of twelve small ones."""
    enqueue_many(conn, [("t.ledger", {"item": f"i{i}"}, {"idempotency_key": f"g{i}"}) for i in range(12)])

    def measured(w: Worker) -> None:
        w.observe_handler("t.ledger", 0.01)  # measured: handed out as one group

    w = burst_scrape(monkeypatch, dsn, free_port(), measured, concurrency=1, prefetch=20, group_seconds=10.0)
    assert w[("qconsole_jobs_succeeded_total", labels("t.ledger"))] == 12
    assert w[("qconsole_job_queue_latency_seconds_count", labels("t.ledger"))] == 12
    assert w[("qconsole_job_duration_seconds_count", labels("t.ledger"))] == 12
    # each job waited well under a second; a group's sum of twelve waits would land in a higher bucket
    assert w[("qconsole_job_queue_latency_seconds_bucket", labels("t.ledger", le="5.0"))] == 12


@pytest.mark.parametrize("how", ["enqueue", "enqueue_many"])
def test_a_backdated_job_waits_and_starts_from_its_enqueue_not_its_scheduled_at(
    dsn: str, conn: db.Conn, how: str
) -> None:
    # a producer may give a scheduled_at in the past (back to 1970): the console's lag and the queue latency
    # counted from it, and one job backdated to 2000 read as 26 years of waiting
    backdated = {"scheduled_at": dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)}
    if how == "enqueue":
        enqueue(conn, "t.ok", {}, **backdated)
    else:
        enqueue_many(conn, [("t.ok", {}, backdated), ("t.ok", {}, backdated)])
    conn.commit()
    t = next(t for t in stats.overview(conn).types if t.job_type == "t.ok")
    assert 0 <= t.oldest_waiting_seconds < 60
    run_burst(dsn)
    latency = conn.execute("SELECT sum(started) AS n, sum(latency_ms_sum) AS ms FROM job_metrics_minute").fetchone()
    assert latency is not None and latency["n"] == (1 if how == "enqueue" else 2)
    assert 0 <= latency["ms"] < 60_000 * latency["n"]


@pytest.mark.parametrize(
    ("job_type", "overrides"),
    [("t.ledger", {}), ("t.ledger", {"group_max": 1}), ("t.async_ok", {})],
    ids=["grouped", "alone", "async"],
)
def test_an_idempotency_hit_is_neither_a_handler_start_nor_handler_time(
    dsn: str, conn: db.Conn, job_type: str, overrides: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job settled by an idempotency hit runs no handler: it was counted as started, with a queue latency
    and a handler duration of ~0 s, and the handler's average read a quarter of its 0.5 s."""
    enqueue(conn, job_type, {"item": "a", "sleep": 0.5}, idempotency_key="k")
    run_burst(dsn, concurrency=1, **overrides)  # the one run of the handler
    sums = "SELECT sum(started) AS started, sum(latency_ms_sum) AS latency FROM job_metrics_minute"
    before = conn.execute(sums).fetchone()
    for _ in range(3):  # replays of an effect committed already
        enqueue(conn, job_type, {"item": "a", "sleep": 0.5}, idempotency_key="k")
    w = burst_scrape(monkeypatch, dsn, free_port(), concurrency=1, **overrides)
    assert w[("qconsole_idempotency_hits_total", labels(job_type))] == 3
    assert w[("qconsole_jobs_succeeded_total", labels(job_type))] == 3
    assert w.get(("qconsole_jobs_started_total", labels(job_type)), 0) == 0
    assert w.get(("qconsole_job_duration_seconds_count", labels(job_type)), 0) == 0
    assert w.get(("qconsole_job_queue_latency_seconds_count", labels(job_type)), 0) == 0
    assert conn.execute(sums).fetchone() == before and before["started"] == 1  # type: ignore[index]
    t = next(t for t in stats.overview(conn).types if t.job_type == job_type)
    assert (t.succeeded, t.idempotency_hits) == (4, 3)
    assert t.duration_avg_seconds >= 0.45  # the handler's own 0.5 s, averaged over its one run


@pytest.mark.parametrize("key", [None, "k"], ids=["no-key", "idempotency-key"])
def test_a_job_run_alone_has_its_start_written_before_its_handler_runs(
    dsn: str, conn: db.Conn, key: str | None
) -> None:
    """A suspected poison pill's start is flushed before its handler runs (the process may die in it). With
    an idempotency key, the start is counted once the key is recorded, in the job's open transaction: the
    slot's connection cannot flush it then."""
    suspect = enqueue(conn, "t.started_seen", {}, idempotency_key=key).id
    conn.execute(  # its worker died: the lease-expiry lane gives it another attempt, alone
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'gone',"
        " locked_until = now() - interval '1 minute' WHERE id = %s",
        (suspect,),
    )
    conn.commit()
    run_burst(dsn, concurrency=1)
    seen = conn.execute("SELECT item FROM ledger WHERE job_id = %s", (suspect,)).fetchall()
    assert seen == [{"item": "1"}]


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    setup_logging("json", "DEBUG", stream=stream)
    yield stream
    for h in list(root.handlers):
        if getattr(h, "_worker_core", False):
            root.removeHandler(h)
    for h in before[0]:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(before[1])


def test_every_job_log_line_carries_the_job_fields(dsn: str, conn: db.Conn, json_logs: io.StringIO) -> None:
    enqueue(conn, "t.flaky", {"fail_times": 1}, trace_id="trace-7", idempotency_key="idem-7")
    enqueue(conn, "t.permanent", {}, trace_id="trace-8")
    run_burst(dsn)
    lines = [json.loads(line) for line in json_logs.getvalue().splitlines()]
    about_jobs = [line for line in lines if "job_id" in line]
    assert len(about_jobs) >= 2
    for line in about_jobs:
        for key in ("job_id", "job_type", "queue", "attempt", "trace_id", "worker_id", "ts", "level", "msg"):
            assert key in line, (key, line)
    flaky = [line for line in about_jobs if line["job_type"] == "t.flaky"]
    assert flaky and all(line["idempotency_key"] == "idem-7" and line["trace_id"] == "trace-7" for line in flaky)


def test_a_text_log_line_stays_one_line_of_printable_text_and_json_times_are_utc(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a producer's trace_id (or a handler's error) forged log lines with its newlines and drove the terminal
    # with its escape sequences; the JSON format's times were the host's local time, labelled Z
    import logging
    import time

    from worker_core.logs import JsonFormatter, KeyValueFormatter, setup_logging

    out = io.StringIO()
    setup_logging("text", stream=out)
    try:
        forged = "t1\n12:00:01 ERROR forged job_id=FAKE\x1b[2J"
        enqueue(conn, "t.permanent", {}, trace_id=forged)
        conn.commit()
        run_burst(dsn)
    finally:
        root = logging.getLogger()
        for h in [h for h in root.handlers if getattr(h, "_worker_core", False)]:
            root.removeHandler(h)
    lines = out.getvalue().splitlines()
    assert not any("\x1b" in line for line in lines)
    assert not any(line.startswith("12:00:01") for line in lines)
    failed = [line for line in lines if "permanent error" in line]
    assert failed and all('trace_id="t1\\n12:00:01 ERROR forged job_id=FAKE\\x1b[2J"' in line for line in failed)
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        record = logging.LogRecord("x", logging.INFO, "", 0, "m", None, None)
        record.created = 0.0
        record.msecs = 0
        assert json.loads(JsonFormatter().format(record))["ts"] == "1970-01-01T00:00:00.000Z"
        assert KeyValueFormatter().format(record).startswith("19:00:00")  # people read their own time
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_count_added_as_a_float_is_flushed_as_an_integer(conn: db.Conn) -> None:
    # the table's counters are bigint: a 1.0 from an aggregate once made every later flush (and the rest
    # of every heartbeat) fail
    buffer = MetricsBuffer()
    buffer.add_many("default", "t.ok", {"started": 2.0, "succeeded": 1.0, "duration_ms_sum": 1.5})
    assert buffer.flush(conn) == 1
    row = conn.execute("SELECT started, succeeded, duration_ms_sum FROM job_metrics_minute").fetchone()
    assert row is not None and (row["started"], row["succeeded"], float(row["duration_ms_sum"])) == (2, 1, 1.5)


def test_a_flushed_metrics_buffer_keeps_nothing_of_the_queues_and_types_it_counted(conn: db.Conn) -> None:
    # MetricsBuffer.totals, read by nothing, kept an entry per (queue, job type, counter) for the life of the
    # process (and cost a dict update per counter on the hot path)
    buffer = MetricsBuffer()
    for i in range(50):
        buffer.add(f"q{i}", "t.ok", "started")
        buffer.add_many(f"q{i}", "t.ok", {"succeeded": 1, "duration_ms_sum": 2.0})
    assert buffer.flush(conn) == 50
    assert conn.execute("SELECT sum(succeeded) AS n FROM job_metrics_minute").fetchone() == {"n": 50}
    kept = {k: len(v) for k, v in vars(buffer).items() if isinstance(v, (dict, list)) and k != "observers"}
    assert kept == {"_rows": 0, "_unknown": 0}


def test_a_flush_whose_commit_reply_is_lost_is_counted_once(dsn: str, conn: db.Conn) -> None:
    # the counts were put back and flushed again: the server had committed them, and every rate and chart
    # of that minute read double
    from tests.worker_core.helpers import FreezingProxy, running_worker, scalar, wait_for

    proxy = FreezingProxy.before(dsn)
    proxy.lose_commit_after = b"latency_ms_sum float8"  # the flush's statement
    try:
        with running_worker(proxy.dsn, heartbeat_interval=0.3):
            for i in range(50):
                enqueue(conn, "t.ok", {"i": i})
            conn.commit()
            done = "SELECT count(*) FROM job_queue WHERE state = 'succeeded'"
            wait_for(lambda: scalar(dsn, done) == 50 and proxy.commits_lost == 1, 30, what="a flush's reply lost")
            time.sleep(1.0)  # the next beats flush again
    finally:
        proxy.close()
    counted = "SELECT sum(succeeded) FROM job_metrics_minute WHERE job_type = 't.ok'"
    assert scalar(dsn, counted) == 50


def test_a_lost_flush_the_server_cannot_tell_about_blocks_no_later_flush(conn: db.Conn) -> None:
    # after a failover to a replica behind the old primary, the lost flush's transaction id is "in the
    # future": asking raised at every flush, and no count was ever written again
    from worker_core.metrics import MetricsBuffer

    buffer = MetricsBuffer()
    buffer.add("default", "t.ok", "succeeded", 5)
    lost = buffer.take()
    ahead = int(conn.execute("SELECT pg_current_xact_id()::text AS x").fetchone()["x"]) + 1_000_000  # type: ignore[index]
    buffer._unknown.append((str(ahead), lost))  # as flush() keeps a flush whose COMMIT went unanswered
    buffer.add("default", "t.ok", "succeeded", 3)
    buffer.flush(conn)
    conn.commit()
    row = conn.execute("SELECT sum(succeeded) AS n FROM job_metrics_minute").fetchone()
    assert row == {"n": 8}  # not known to have committed there: counted
