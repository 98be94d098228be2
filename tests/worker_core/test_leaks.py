"""What a Worker, or the fleet's metrics endpoint, leaves open when things go wrong: file descriptors, sessions
on the server and threads, counted before and after (helpers.Held), never a mock."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from psycopg.conninfo import make_conninfo

import tests.worker_core.tasks  # noqa: F401
from tests.worker_core.helpers import FreezingProxy, Held, WorkerThread, wait_for
from worker_core import NotMigrated, db, enqueue, policy
from worker_core.prometheus import FleetCollector
from worker_core.worker import EXIT_UNAVAILABLE


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_worker_refused_at_its_start_leaves_no_thread_behind(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a policy file that does not load refuses the worker (qconsole worker: exit 2) as it publishes its types'
    # contracts; its slot threads had been started before, and stayed, each waiting for a job, the Worker
    # with them: an application that tried again kept four more threads each time
    bad = tmp_path / "qconsole.toml"
    bad.write_text("[defaults]\nmax_attempts = 'many'\n")
    monkeypatch.setenv("QCONSOLE_POLICY_FILE", str(bad))
    policy.set_current(None)
    held = Held(dsn)
    for _ in range(2):
        with pytest.raises(policy.PolicyError, match="max_attempts"):
            WorkerThread(dsn).start().join(30)
    held.assert_released()


@pytest.mark.parametrize("where", ["unreachable", "not-migrated", "not-migrated-unchecked", "gone-mid-run"])
def test_a_worker_whose_database_fails_it_leaves_nothing_open(
    dsn: str, empty_dsn: str, conn: db.Conn, where: str
) -> None:
    # a worker that could not connect, found no schema, or lost its server under running jobs, then stopped:
    # each of its connections (claims, beats, completer, listener, slots) closed, no thread left
    proxy = FreezingProxy.before(dsn, hang_ups=True)
    target = {
        "unreachable": make_conninfo(dsn, host="127.0.0.1", port=_closed_port()),
        "not-migrated": empty_dsn,
        "not-migrated-unchecked": empty_dsn,
        "gone-mid-run": proxy.dsn,
    }[where]
    counted = empty_dsn if where.startswith("not-migrated") else dsn
    for _ in range(6):
        enqueue(conn, "t.slow", {"seconds": 1.0})
    held = Held(counted)
    try:
        # unchecked: as the CLI runs it, having checked the schema itself (a Worker refuses one not migrated)
        checked = where != "not-migrated-unchecked"
        wt = WorkerThread(target, burst=False, heartbeat_interval=0.2, concurrency=3, check_database=checked).start()
        if where == "not-migrated":
            with pytest.raises(NotMigrated):
                wt.join(30)
            held.assert_released()
            return
        if where == "gone-mid-run":
            wait_for(lambda: conn.execute("SELECT count(*) AS n FROM job_queue WHERE state = 'running'").fetchone()
                     == {"n": 6}, 10, what="the jobs to run")  # fmt: skip
            proxy.cut()
        time.sleep(1.5)  # claims, beats and connections fail and are tried again
        # gone mid-run, its jobs could not be released: it says so, and its exit code too (test_stop_during_outage)
        assert wt.stop(30) == (EXIT_UNAVAILABLE if where == "gone-mid-run" else 0)
        held.assert_released()
    finally:
        proxy.close()


def test_a_fleet_scrape_that_fails_closes_its_connection(dsn: str) -> None:
    # qconsole metrics: a scrape behind a lock (its statement timeout) or cut off says the database is down, and
    # its connection is closed, not left to the next scrape
    collector = FleetCollector(dsn, statement_timeout_ms=300)
    held = Held(dsn)
    up = next(iter(collector.collect()))
    assert up.name == "qconsole_database_up" and up.samples[0].value == 1
    assert len(held.sessions()) == len(held.before[1]) + 1  # kept between scrapes
    locker = db.connect(dsn)
    try:
        locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
        up = next(iter(collector.collect()))
        assert up.name == "qconsole_database_up" and up.samples[0].value == 0
    finally:
        locker.close()
    held.assert_released()
