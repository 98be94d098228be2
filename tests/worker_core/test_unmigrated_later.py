"""A worker that finds the queue's tables missing after its start (the database recreated or restored without
its migrations, or not reachable when it started, so never checked): it looped for ever, a warning per claim
and per beat. It says so once, naming the fix; a burst worker stops (exit 3), another waits and recovers."""

from __future__ import annotations

import logging

import psycopg
import pytest

from tests.worker_core.conftest import EFFECT_TABLES
from tests.worker_core.helpers import WorkerThread, running_worker, state, wait_for
from worker_core import db, enqueue
from worker_core.migrate import migrate
from worker_core.worker import EXIT_UNAVAILABLE


def _drop_the_schema(dsn: str) -> None:
    """What a restore of a dump without the queue's tables leaves: no table at all."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SET statement_timeout = '60s'")  # a lock the worker holds fails the test, not hangs it
        c.execute("DROP SCHEMA public CASCADE")
        c.execute("CREATE SCHEMA public")


def _migrate(dsn: str) -> None:
    with db.connect(dsn) as c:
        migrate(c)
        c.execute(EFFECT_TABLES)
        c.commit()


def _enqueue(dsn: str) -> str:
    with db.connect(dsn) as c:
        job_id = enqueue(c, "t.ok", {}).id
        c.commit()
    return str(job_id)


def test_a_worker_whose_tables_vanish_says_so_once_waits_and_claims_again_once_migrated(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="worker_core")
    with running_worker(dsn, heartbeat_interval=0.2, housekeeping=False) as w:
        first = _enqueue(dsn)
        wait_for(lambda: state(dsn, first) == "succeeded", 30, what="the first job run")
        _drop_the_schema(dsn)

        def said(text: str, level: int = logging.DEBUG) -> list[logging.LogRecord]:
            return [r for r in caplog.records if text in r.getMessage() and r.levelno >= level]

        wait_for(lambda: len(said("checked the database again")) >= 3, 60, what="three checks of the database")
        assert w.not_migrated is not None
        told = said("run `qconsole migrate`", logging.ERROR)
        assert len(told) == 1, [r.getMessage() for r in told]
        assert 'relation "job_queue" does not exist' in told[0].getMessage()
        # nothing else said meanwhile: neither the claims, nor the beats (every 0.2 s), nor the checks
        after = caplog.records[caplog.records.index(told[0]) + 1 :]
        assert not [r.getMessage() for r in after if r.levelno >= logging.WARNING]

        _migrate(dsn)
        second = _enqueue(dsn)
        wait_for(lambda: state(dsn, second) == "succeeded", 90, what="a job run after the migrations")
        assert len(said("the database is migrated", logging.INFO)) == 1 and w.not_migrated is None


def test_a_burst_worker_that_finds_no_tables_stops_with_why(empty_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    # not checked at its start (as when the database could not be reached then): it retried for burst_give_up
    caplog.set_level(logging.WARNING, logger="worker_core")
    wt = WorkerThread(empty_dsn, check_database=False, housekeeping=False, heartbeat_interval=30).start()
    assert wt.join(60) == EXIT_UNAVAILABLE
    assert wt.worker.gave_up is not None and "run `qconsole migrate`" in wt.worker.gave_up
    assert len([r for r in caplog.records if "qconsole migrate" in r.getMessage()]) == 1


def test_a_column_missing_that_the_start_check_cannot_see_is_retried_with_backoff_not_in_a_loop(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # migrated as far as schema_migrations says, a column dropped by hand: the check passes, the claim fails.
    # The claim was made again at once after each passing check: a connection and a check per turn, in a loop
    caplog.set_level(logging.WARNING, logger="worker_core")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("ALTER TABLE job_queue DROP COLUMN suspect CASCADE")
    with running_worker(dsn, heartbeat_interval=0.5, housekeeping=False, poll_interval=0.05) as w:
        wait_for(lambda: w._claim_failures.failures >= 3, 30, what="three claims failed")
        assert w.not_migrated is None
    tries = w._claim_failures.failures
    failed = [r.getMessage() for r in caplog.records if "claim failed" in r.getMessage()]
    assert 'column "suspect" does not exist' in failed[0] or "suspect" in failed[0], failed[0]
    assert tries < 30, f"{tries} claims failed in a row: retried at once, not with the backoff"
    # said once (the same error again and again is said again once a minute: test_outage_log)
    assert len(failed) == 1, failed
