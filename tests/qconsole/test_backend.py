"""The console's database adapter and the worker_core reads behind its charts, against PostgreSQL."""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

import tests.worker_core.tasks  # noqa: F401  (registers the test types, so enqueue applies their defaults)
from qconsole.backend import APPLICATION_NAME, ActionsAborted, DatabaseBackend, is_outage
from qconsole.embedded_workers import EmbeddedWorkers
from tests.worker_core.helpers import scalar, wait_for
from worker_core import db, stats
from worker_core.clock import FixedClock, SystemClock
from worker_core.errors import ReadOnlyError
from worker_core.models import JobState
from worker_core.worker import Worker, WorkerConfig

T0 = dt.datetime(2025, 3, 14, 9, 30, 20, tzinfo=dt.timezone.utc)


def _rollup(conn: db.Conn, minute: dt.datetime, queue: str, job_type: str, **counts: float) -> None:
    # the rollups as workers flush them (worker_core.metrics)
    from worker_core.sql import queries

    row = {"minute": minute.isoformat(), "queue": queue, "job_type": job_type}
    for name in ("started", "succeeded", "failed", "dead_lettered", "retried", "timeouts", "anomalies",
                 "lock_contention", "dedup_hits", "idempotency_hits", "lease_expirations", "cancelled",
                 "latency_ms_sum", "duration_ms_sum"):  # fmt: skip
        row[name] = counts.get(name, 0)
    conn.execute(queries["metrics_flush"], {"rows": json.dumps([row])})


def test_latency_series_averages_per_minute(conn: db.Conn) -> None:
    now = T0.replace(second=0)
    _rollup(conn, now - dt.timedelta(minutes=2), "default", "a", started=4, latency_ms_sum=8000)
    _rollup(conn, now - dt.timedelta(minutes=2), "default", "b", started=1, latency_ms_sum=12000)
    _rollup(conn, now, "mail", "a", started=2, latency_ms_sum=1000)
    _rollup(conn, now - dt.timedelta(minutes=90), "default", "a", started=1, latency_ms_sum=99_000)  # too old
    series = stats.latency_series(conn, FixedClock(T0))
    assert set(series) == {"default", "mail"}
    assert len(series["default"]) == stats.SERIES_MINUTES
    assert series["default"][-3] == pytest.approx(20.0 / 5)  # (8 s + 12 s) / 5 starts
    assert series["default"][-1] == 0.0
    assert series["mail"][-1] == pytest.approx(0.5)
    by_type = stats.latency_series(conn, FixedClock(T0), by="job_type")
    assert by_type["b"][-3] == pytest.approx(12.0)
    with pytest.raises(ValueError):
        stats.latency_series(conn, by="tenant")


def test_the_lag_series_ends_at_the_oldest_waiting_job_when_nothing_starts(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # every worker of the queue dead: nothing starts, and the lag chart read 0 ("now 0s") next to 8 minutes
    jid = make_job("t.ok", {}, queue="mail")
    conn.execute("UPDATE job_queue SET scheduled_at = now() - interval '8 minutes' WHERE id = %s", (jid,))
    conn.commit()
    backend = DatabaseBackend(dsn)
    try:
        for lag in (backend.overview().lag, backend.charts().lag):
            assert lag["mail"][-1] == pytest.approx(480, abs=30)
            assert lag["mail"][:-1] == [0.0] * (stats.SERIES_MINUTES - 1)
    finally:
        backend.close()


class _AheadClock(SystemClock):
    """The system's clock on a host two minutes ahead of the database server's."""

    def now(self) -> dt.datetime:
        return super().now() + dt.timedelta(seconds=120)


def test_a_console_on_a_host_whose_clock_is_off_reads_and_acts_in_the_servers_time(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # two minutes ahead, the console read every lag two minutes long and requeued jobs for two minutes later
    waiting = make_job("t.ok", {}, queue="mail")
    dead = make_job("t.ok", {})
    conn.execute("UPDATE job_queue SET scheduled_at = now() - interval '30 seconds' WHERE id = %s", (waiting,))
    conn.execute("UPDATE job_queue SET state = 'dead_lettered', finished_at = now() WHERE id = %s", (dead,))
    conn.commit()
    due = "SELECT extract(epoch FROM scheduled_at - now()) FROM job_queue WHERE id = %s"
    backend = DatabaseBackend(dsn, clock=_AheadClock())
    try:
        # an action before any read (nothing measured yet) reads the server's clock
        backend.requeue([dead])
        assert abs(scalar(dsn, due, (dead,))) < 10
        conn.execute("UPDATE job_queue SET state = 'dead_lettered', finished_at = now() WHERE id = %s", (dead,))
        conn.commit()
        assert backend.overview().lag["mail"][-1] == pytest.approx(30, abs=10)
        backend.requeue([dead])
    finally:
        backend.close()
    assert abs(scalar(dsn, due, (dead,))) < 10
    # a one-shot command (the CLI's) reads the server's clock instead
    assert stats.oldest_waiting(conn, _AheadClock())["mail"] == pytest.approx(30, abs=10)


def test_attempts_distribution_counts_finished_jobs(dsn: str, conn: db.Conn, make_job: Any) -> None:
    ok = [make_job("t.ok", {}) for _ in range(3)]
    flaky = [make_job("t.flaky", {"fail_times": 2}) for _ in range(2)]
    w = Worker(WorkerConfig(dsn=dsn, task_modules=("tests.worker_core.tasks",), burst=True, poll_interval=0.05))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    t.join(60)
    assert all(stats.get_job(conn, j).state == JobState.SUCCEEDED for j in ok + flaky)
    dist = stats.attempts_distribution(conn)
    assert dist == {"t.ok": {1: 3}, "t.flaky": {3: 2}}
    assert stats.attempts_distribution(conn, FixedClock(dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2))) == {}


def test_backend_session_is_named_bounded_and_reconnects(dsn: str, conn: db.Conn) -> None:
    backend = DatabaseBackend(dsn)
    backend.overview()
    row = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND datname = current_database()",
        (APPLICATION_NAME,),
    ).fetchone()
    assert row is not None
    timeout = backend._call(lambda c: c.execute("SHOW statement_timeout").fetchone())
    assert timeout is not None and timeout["statement_timeout"] == "3s"
    conn.execute("SELECT pg_terminate_backend(%s)", (row["pid"],))
    with pytest.raises(Exception):  # noqa: B017  (whatever psycopg raises for a terminated session)
        backend.workers()
    assert backend.workers() == []  # reconnected by itself
    backend.close()


def test_read_only_backend_refuses_and_reads(dsn: str, make_job: Any) -> None:
    job = make_job("t.ok", {})
    backend = DatabaseBackend(dsn, read_only=True)
    assert backend.get_job(job)[0].id == job
    with pytest.raises(ReadOnlyError):
        backend.kill([job])
    assert backend._call(lambda c: c.execute("SHOW default_transaction_read_only").fetchone()) == {
        "default_transaction_read_only": "on"
    }
    backend.close()


def test_no_action_starts_once_the_console_quit(dsn: str, conn: db.Conn, make_job: Any) -> None:
    # an action asked for while another ran when the console quit ran after the quit (its thread went on)
    j = make_job("t.ok", {}, queue="mail")
    backend = DatabaseBackend(dsn)
    backend.abort_actions()
    with pytest.raises(ActionsAborted):
        backend.set_paused("mail", True)
    with pytest.raises(ActionsAborted):
        backend.kill([j])
    backend.close()
    assert not any(q.paused for q in stats.overview(conn).queues)
    assert stats.get_job(conn, j).state == JobState.QUEUED
    assert stats.audit_log(conn) == []


def test_embedded_worker_that_cannot_start_is_reported(tmp_path: Any) -> None:
    launcher = EmbeddedWorkers("postgresql://unused", command=["/nonexistent/python"], log_dir=tmp_path)
    seen: list[Any] = []
    launcher.set_on_exit(lambda w, restarting: seen.append((w.number, w.exit_code, restarting)))
    w = launcher.start(["x.tasks"])
    assert not w.running and w.exit_code == 127 and seen == [(1, 127, False)]
    assert "could not start" in w.output[-1]


def test_embedded_worker_crash_is_reported_and_restarted(tmp_path: Any) -> None:
    """A worker command that dies at once: reported from the reader thread, restarted with backoff."""
    launcher = EmbeddedWorkers(
        "postgresql://unused", command=["sh", "-c", "echo boom; exit 3", "worker"], log_dir=tmp_path
    )
    events: list[tuple[int | None, bool]] = []
    launcher.set_on_exit(lambda w, restarting: events.append((w.exit_code, restarting)))
    w = launcher.start(["x.tasks"])
    deadline = time.monotonic() + 10
    while w.restarts < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.restarts >= 1 and events[0] == (3, True)
    assert "boom" in list(w.output)
    launcher.stop_all(timeout=2)
    assert not w.running
    assert (tmp_path / w.log_path.name).read_text().count("boom") >= 1  # type: ignore[union-attr]


def test_embedded_worker_output_never_drives_the_terminal(tmp_path: Any) -> None:
    launcher = EmbeddedWorkers(
        "postgresql://unused", command=["sh", "-c", r"printf 'a\033[2Jb\033]0;t\007c\n'", "worker"], log_dir=tmp_path
    )
    w = launcher.start(["x.tasks"], restart=False)
    deadline = time.monotonic() + 10
    while w.running and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.stop_all(timeout=2)
    assert "abc" in list(w.output)
    assert "\x1b" in (tmp_path / w.log_path.name).read_text()  # type: ignore[union-attr]  # the log file keeps it


def test_an_embedded_worker_whose_log_file_cannot_be_written_is_still_read_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a full disk (or a quota, or a file size limit) under the log: the reader thread died at the first
    # failed write, nothing drained the pipe any more, and the worker blocked on its next log line once the
    # pipe was full, holding its jobs (its heartbeat went on) for as long as the console stayed open.
    # /dev/full: every write fails with ENOSPC
    import qconsole.embedded_workers as ew

    monkeypatch.setattr(ew, "open_private_log", lambda path: open("/dev/full", "a", encoding="utf-8"))  # noqa: SIM115
    monkeypatch.setattr(ew, "OUTPUT_LINES", 100_000)  # the note stays in sight
    launcher = EmbeddedWorkers(
        "postgresql://unused", command=["sh", "-c", "yes chatty | head -n 30000; echo done", "worker"],
        log_dir=tmp_path,
    )  # fmt: skip
    w = launcher.start(["x.tasks"], restart=False)
    try:
        wait_for(lambda: w.exit_code is not None, 30, what="the worker to write all its output and exit")
    finally:
        launcher.stop_all(timeout=2)
    assert w.exit_code == 0 and "done" in w.output
    assert sum("no longer written" in line for line in w.output) == 1


def test_ended_embedded_workers_keep_no_pipes_and_only_the_newest_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the console kept both pipes of every worker it ever started (~500 starts reached the limit of 1,024
    # descriptors, and then its connections to the database failed), and every record with its output
    import qconsole.embedded_workers as ew

    monkeypatch.setattr(ew, "KEEP_ENDED", 4)
    launcher = EmbeddedWorkers("postgresql://unused", command=["sh", "-c", "echo hi", "worker"], log_dir=tmp_path)
    try:
        fds = len(os.listdir("/proc/self/fd"))
        started = []
        for _ in range(10):
            started.append(launcher.start(["x.tasks"], restart=False))
            wait_for(lambda: started[-1].exit_code is not None, 10, what="the worker to exit")
        time.sleep(0.2)  # the last reader thread closes its log and status pipe after it set exit_code
        assert len(os.listdir("/proc/self/fd")) - fds <= 2  # 20 before
        assert [w.number for w in launcher.workers()] == [6, 7, 8, 9, 10]  # 4 ended, and the newest
    finally:
        launcher.stop_all(timeout=2)


def test_an_embedded_worker_that_refuses_its_configuration_is_not_restarted(tmp_path: Any) -> None:
    # a misspelt task module: `qconsole worker` exits 2; starting it again would change nothing
    launcher = EmbeddedWorkers(
        "postgresql://unused", command=["sh", "-c", "echo 'cannot import task module: x'; exit 2", "worker"],
        log_dir=tmp_path,
    )  # fmt: skip
    events: list[tuple[int | None, bool]] = []
    launcher.set_on_exit(lambda w, restarting: events.append((w.exit_code, restarting)))
    w = launcher.start(["x.tasks"])
    deadline = time.monotonic() + 10
    while not events and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # past the first restart's backoff (1 s)
    assert events == [(2, False)] and w.restarts == 0 and not w.restart_pending
    assert w.status == "crashed (exit 2)" and "not restarted" in w.output[-1]
    launcher.stop_all(timeout=2)


def test_an_embedded_worker_whose_job_exits_with_2_is_restarted(
    dsn: str, conn: db.Conn, make_job: Any, tmp_path: Path
) -> None:
    # 2 is what `qconsole worker` exits with when it refuses its arguments, and what a payload (or a C
    # library) calling exit(2) exits with: such a crash was taken for a refusal, the worker not restarted
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    launcher = EmbeddedWorkers(dsn, log_dir=tmp_path, shutdown_grace=1.0, env=env)
    doomed = make_job("t.exit_code", {"code": 2})
    w = launcher.start(["tests.worker_core.tasks"], concurrency=1)
    try:
        wait_for(lambda: w.crashes >= 1, 60, what="the job to end its worker")
        wait_for(lambda: w.restarts >= 1 and w.running, 30, what="the restart")
        assert "not restarted" not in "\n".join(w.output)
        # restarted, it runs the job again (its lease ended at once), alone: its last attempt
        wait_for(lambda: stats.get_job(conn, doomed).state == JobState.DEAD_LETTERED, 60, what="a poison pill")
    finally:
        launcher.stop_all(timeout=10)


def test_an_embedded_worker_whose_metrics_port_is_taken_says_it_refused_and_is_not_restarted(
    dsn: str, tmp_path: Path
) -> None:
    # refused once it runs (its arguments were taken): it says so on its status pipe
    import socket

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        launcher = EmbeddedWorkers(dsn, log_dir=tmp_path, env=env, extra_args=["--metrics-port", str(port)])
        w = launcher.start(["tests.worker_core.tasks"])
        try:
            wait_for(lambda: any("not restarted" in line for line in w.output), 60, what="the worker to refuse")
        finally:
            launcher.stop_all(timeout=10)
    assert (w.exit_code, w.restarts, w.restart_pending) == (2, 0, False)


def test_an_embedded_worker_on_a_read_only_database_says_it_refused_and_is_not_restarted(
    dsn: str, tmp_path: Path
) -> None:
    # `qconsole worker` refuses a read-only server (a replica) with exit 1 before it starts: the console took
    # that for a crash, and started it again every 30 s for ever
    from psycopg.conninfo import make_conninfo

    launcher = _real_launcher(make_conninfo(dsn, options="-c default_transaction_read_only=on"), tmp_path)
    w = launcher.start(["tests.worker_core.tasks"])
    try:
        wait_for(lambda: any("not restarted" in line for line in w.output), 60, what="the worker to refuse")
        time.sleep(1.5)  # past the first restart's backoff (1 s)
    finally:
        launcher.stop_all(timeout=10)
    assert (w.exit_code, w.restarts, w.restart_pending) == (1, 0, False)
    assert any("read-only" in line for line in w.output)


def _real_launcher(dsn: str, tmp_path: Path, **kwargs: Any) -> EmbeddedWorkers:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    return EmbeddedWorkers(dsn, log_dir=tmp_path, env=env, **kwargs)


def test_the_console_quitting_gives_its_workers_their_whole_stop(
    dsn: str, conn: db.Conn, make_job: Any, tmp_path: Path
) -> None:
    # the console waited 5 or 8 s for its workers, whatever their grace (5 s), the cancel grace and its
    # margin after it for a job that does not stop: a worker whose stop took longer was SIGKILLed on the
    # way, the job left running under a dead worker's lease, a suspect. The wait comes from their budget
    launcher = _real_launcher(dsn, tmp_path, shutdown_grace=8.5)
    slow = make_job("t.slow", {"seconds": 60})  # runs until the end of the grace, then is released
    w = launcher.start(["tests.worker_core.tasks"], concurrency=1)
    try:
        wait_for(lambda: stats.get_job(conn, slow).state == JobState.RUNNING, 60, what="the job to start")
    finally:
        launcher.stop_all()  # as the console does when it quits
    assert w.exit_code == 0, "\n".join(w.output)  # it stopped by itself, never killed
    assert stats.get_job(conn, slow).state == JobState.QUEUED  # released, its attempt given back


def test_a_worker_stopped_then_stopped_again_with_the_console_keeps_its_grace(
    dsn: str, conn: db.Conn, make_job: Any, tmp_path: Path
) -> None:
    # `x` on a worker, then `q`: the console sent it a second SIGTERM, which a worker takes for "release now":
    # its running job was released and ran again (what it did outside ctx.tx, twice)
    launcher = _real_launcher(dsn, tmp_path, shutdown_grace=30.0)
    slow = make_job("t.slow", {"seconds": 2})
    w = launcher.start(["tests.worker_core.tasks"], concurrency=1)
    try:
        wait_for(lambda: stats.get_job(conn, slow).state == JobState.RUNNING, 60, what="the job to start")
        assert w.pid is not None
        group = os.getpgid(w.pid)
        launcher.stop(w.number)
        wait_for(lambda: any("stopping" in line for line in w.output), 10, what="the worker to stop")
    finally:
        launcher.stop_all()
    assert w.exit_code == 0, "\n".join(w.output)
    done = stats.get_job(conn, slow)
    assert (done.state, done.attempts) == (JobState.SUCCEEDED, 1)  # finished within its grace, once
    # a session of its own: a terminal's SIGHUP (an SSH connection dropped) or Ctrl-C was a first signal to
    # it, and the console's stop on top of it a second. The console stops it itself, on every way out
    # (and its standard input, a pipe the console holds, stops it when the console dies)
    assert group == w.pid


def test_a_worker_the_console_had_to_kill_has_its_leases_ended_before_the_console_exits(
    dsn: str, conn: db.Conn, make_job: Any, tmp_path: Path
) -> None:
    # the leases of a worker killed at the end of the stop were ended by its reader thread, a daemon thread
    # that dies with the console's interpreter: they were left to run out
    launcher = _real_launcher(dsn, tmp_path, shutdown_grace=30.0)
    slow = make_job("t.slow", {"seconds": 60}, visibility_timeout_seconds=300)
    w = launcher.start(["tests.worker_core.tasks"], concurrency=1)
    try:
        wait_for(lambda: stats.get_job(conn, slow).state == JobState.RUNNING, 60, what="the job to start")
    finally:
        launcher.stop_all(timeout=0.5)
    assert w.exit_code == -9
    # at once, not when a reader thread gets to it
    row = conn.execute("SELECT locked_until <= now() AS ended FROM job_queue WHERE id = %s", (slow,)).fetchone()
    assert row is not None and row["ended"]
    assert all(x.stopped_at is not None for x in stats.workers(conn) if x.pid == w.pid)


def test_stopping_an_embedded_worker_that_waits_to_restart_cancels_the_restart(tmp_path: Any) -> None:
    launcher = EmbeddedWorkers("postgresql://unused", command=["sh", "-c", "exit 3", "worker"], log_dir=tmp_path)
    w = launcher.start(["x.tasks"])
    deadline = time.monotonic() + 10
    while not w.restart_pending and time.monotonic() < deadline:
        time.sleep(0.02)
    assert w.restart_pending
    launcher.stop(w.number)
    time.sleep(1.5)  # past the backoff
    assert w.restarts == 0 and not w.restart_pending and not w.running
    launcher.stop_all(timeout=2)


def test_closing_the_backend_does_not_wait_for_a_read_the_server_never_answers(dsn: str) -> None:
    # quitting the console while a read hangs (a vanished host: no reply, no error for half a minute) must
    # not hang with it; the read ends too, with an error, and its thread is free
    backend = DatabaseBackend(dsn, statement_timeout_ms=60_000)
    outcome: list[str] = []

    def hung_read() -> None:
        try:
            backend._call(lambda c: c.execute("SELECT pg_sleep(30)"))
            outcome.append("answered")
        except Exception as e:
            outcome.append(type(e).__name__)

    reader = threading.Thread(target=hung_read, daemon=True)
    reader.start()
    sleeping = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s"
        " AND state = 'active' AND query = 'SELECT pg_sleep(30)'"
    )
    wait_for(lambda: scalar(dsn, sleeping, (APPLICATION_NAME,)) == 1, 10, what="the read to wait for the server")
    closer = threading.Thread(target=backend.close, daemon=True)
    closer.start()
    closer.join(10)
    reader.join(10)
    assert not closer.is_alive() and not reader.is_alive()
    assert outcome == ["OperationalError"]


def test_a_read_waiting_on_a_hung_server_is_woken_at_once_when_the_console_quits_and_none_starts_after(
    dsn: str,
) -> None:
    # the console unmounted, but a read waited on the server until its deadline (10 s), and asyncio.run, which
    # joins the thread it runs in, held the exit up that long: abort_reads fails it at once, returning at once
    from qconsole.backend import ReadsAborted
    from tests.worker_core.helpers import FreezingProxy

    proxy = FreezingProxy.before(dsn)
    backend = DatabaseBackend(proxy.dsn)  # the defaults: call deadline 10 s
    failures: list[BaseException] = []

    def read() -> None:
        try:
            backend.overview()
        except Exception as e:
            failures.append(e)

    try:
        backend.overview()
        proxy.frozen.set()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(0.5)  # the read waits on the server
        assert reader.is_alive()
        t0 = time.monotonic()
        backend.abort_reads()
        assert time.monotonic() - t0 < 0.5  # on the UI thread: it waits for nothing
        reader.join(3)
        assert not reader.is_alive(), "the read still waited on the hung server"
        assert isinstance(failures[0], ReadsAborted)
        with pytest.raises(ReadsAborted):
            backend.workers()  # none starts any more
        proxy.frozen.clear()
        backend.close()  # after it, as run_console does once the app returned: it waits for nothing either
        backend.close()  # nor twice
    finally:
        proxy.frozen.clear()
        proxy.close()


@pytest.mark.parametrize(
    "payload",
    ["'{\"n\": ' || repeat('9', 5000) || '}'", "'{\"a\": ' || repeat('[', 3000) || repeat(']', 3000) || '}'"],
    ids=["long", "deep"],
)
def test_a_payload_python_cannot_decode_hides_no_list(dsn: str, conn: db.Conn, make_job: Any, payload: str) -> None:
    # written by another producer than ours: decoded with json.loads, it failed every list the job was in
    # (its queue's, its type's, the failed ones') until retention pruned it, and its own detail
    ok = make_job("t.ok", {})
    bad = make_job("t.ok", {})
    conn.execute(f"UPDATE job_queue SET payload = ({payload})::jsonb WHERE id = %s", (bad,))  # noqa: S608
    conn.commit()
    backend = DatabaseBackend(dsn)
    try:
        listed = {j.id: j for j in backend.list_jobs(state=None, job_type="t.ok", queue=None, search=None, limit=50)}
        assert set(listed) == {ok, bad}
        assert list(listed[bad].payload) == [db.UNDECODABLE]
        assert backend.get_job(bad)[0].payload[db.UNDECODABLE]
    finally:
        backend.close()


def test_a_server_that_stops_answering_is_taken_for_an_outage_not_waited_for(dsn: str) -> None:
    # TCP still acknowledged, so neither keepalives nor the server's statement timeout ended the read: the
    # console's data froze and no banner came, for as long as the server stayed hung
    from qconsole.backend import is_outage
    from tests.worker_core.helpers import FreezingProxy

    proxy = FreezingProxy.before(dsn)
    backend = DatabaseBackend(proxy.dsn, call_deadline_s=2.0)
    failures: list[BaseException] = []

    def read() -> None:
        try:
            backend.overview()
        except Exception as e:
            failures.append(e)

    try:
        backend.overview()
        proxy.frozen.set()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(60)  # a bound for the test itself: without the deadline, the read never ends
        proxy.frozen.clear()
        assert failures, "the read waited on the hung server"
        assert is_outage(failures[0]) and "did not answer within 2s" in str(failures[0])
        assert backend.workers() == []  # a new connection, and the console goes on
    finally:
        proxy.frozen.clear()
        backend.close()
        proxy.close()


def test_embedded_workers_logs_are_private_and_never_followed_through_a_link(tmp_path: Path) -> None:
    # they went to /tmp/qconsole-workers-<uid>, a name another local user could make first and point its
    # files anywhere (the console appended to them), readable by everyone (errors, keys, tenants)
    from qconsole.embedded_workers import open_private_log

    assert not str(EmbeddedWorkers("postgresql://unused").log_dir).startswith(tempfile.gettempdir())
    folder = tmp_path / "workers"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with open_private_log(folder / "worker-1.log") as log:
        log.write("line\n")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "worker-1.log").stat().st_mode) == 0o600
    victim = tmp_path / "victim"
    victim.write_text("not the console's\n")
    (folder / "worker-2.log").symlink_to(victim)
    with pytest.raises(OSError):
        open_private_log(folder / "worker-2.log")
    assert victim.read_text() == "not the console's\n"
    if os.getuid() == 0:  # a directory another user made first
        os.chown(folder, 65534, 65534)
        with pytest.raises(PermissionError):
            open_private_log(folder / "worker-3.log")


def test_a_console_with_no_home_directory_starts_its_workers_and_shows_their_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # no HOME and a uid without a passwd entry (a container): platformdirs raised, and the console died
    # with a traceback before it opened
    import platformdirs

    def no_home(*_: Any, **__: Any) -> Path:
        raise RuntimeError("could not determine the home directory for '~/.local/state'")

    monkeypatch.setattr(platformdirs, "user_log_path", no_home)
    launcher = EmbeddedWorkers("postgresql://unused", command=["sh", "-c", "echo hello", "worker"])
    assert launcher.log_dir is None
    w = launcher.start(["x.tasks"], restart=False)
    deadline = time.monotonic() + 10
    while w.exit_code is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "hello" in w.output and w.log_path is None


def test_a_dead_letter_group_too_big_for_the_read_bound_is_requeued_and_reads_stay_bounded(
    dsn: str, conn: db.Conn
) -> None:
    # the console's actions ran on its reading connection, under the read bound (3 s): `r` on a group of
    # 150,000 dead letters was cancelled after ~4.5 s, every time, and nothing was requeued
    import psycopg

    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error, error_fingerprint)"
        " SELECT 't.ok', 'default', '{}', 'dead_lettered', now(), 'boom', 'boom' FROM generate_series(1, 20000)"
    )
    backend = DatabaseBackend(dsn, statement_timeout_ms=20)  # lowered so that this group is too big for it
    try:
        [group] = stats.dead_letter_groups(conn)
        ids = backend.group_job_ids(group)
        assert len(ids) == 20000
        result = backend.requeue(ids)
        assert len(result.changed) == 20000 and not result.skipped
        left = conn.execute("SELECT state, count(*) AS n FROM job_queue GROUP BY state").fetchall()
        assert left == [{"state": "queued", "n": 20000}]
        with pytest.raises(psycopg.errors.QueryCanceled):
            backend._call(lambda c: c.execute("SELECT pg_sleep(1)"))  # a read still has its bound
    finally:
        backend.close()


def test_an_action_the_server_refuses_with_a_lock_timeout_is_a_plain_failure_on_a_live_connection(
    dsn: str, conn: db.Conn
) -> None:
    # a DBA's lock_timeout behind a worker's row locks: the server answered 55P03, an OperationalError, which
    # was taken for a lost connection ("the connection was lost before it committed", an audit lookup)
    ids = [
        r["id"]
        for r in conn.execute(
            "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error, error_fingerprint)"
            " SELECT 't.ok', 'default', '{}', 'dead_lettered', now(), 'boom', 'boom' FROM generate_series(1, 3)"
            " RETURNING id"
        ).fetchall()
    ]
    conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET lock_timeout = '300ms'")
    conn.commit()
    locker = db.connect(dsn)
    locker.execute("SELECT id FROM job_queue FOR UPDATE").fetchall()
    backend = DatabaseBackend(dsn)
    try:
        backend.overview()
        with pytest.raises(psycopg.errors.LockNotAvailable):
            backend.requeue(ids)
        read_on = backend._conn
        with pytest.raises(psycopg.errors.LockNotAvailable):
            backend._call(lambda c: c.execute("SELECT id FROM job_queue FOR UPDATE").fetchall())
        assert backend._conn is read_on and read_on is not None  # the connection is fine: kept
    finally:
        locker.rollback()
        locker.close()
        backend.close()
    assert not is_outage(psycopg.errors.LockNotAvailable()) and is_outage(psycopg.OperationalError("gone"))
