"""`qconsole worker --burst` behind a lock on job_queue: it gives up after --burst-give-up, exit 3 (the CLI's
code for a database it cannot use), under --processes too; a real lock, held by another session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker_core import db, enqueue

ROOT = Path(__file__).resolve().parents[2]


def _worker(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("QCONSOLE_DSN", "DATABASE_URL")}
    env.update(QCONSOLE_DSN=dsn, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "qconsole", "worker", "--tasks", "tests.worker_core.tasks", "--burst",
            "--poll-interval", "0.1", "--heartbeat", "0.3", *args]  # fmt: skip
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_burst_worker_behind_a_lock_exits_3_once_its_claims_failed_for_its_bound(
    dsn: str, conn: db.Conn, processes: str
) -> None:
    # a DBA's lock_timeout (the claims fail at once with 55P03, not after 30 s) and a session holding a SHARE
    # lock (a CREATE INDEX without CONCURRENTLY): each claim failed and was tried again for ever, the burst
    # never exited; under --processes the supervisor would have restarted a child that gave up, for ever
    job = enqueue(conn, "t.ok", {}).id
    conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET lock_timeout = '100ms'")
    with db.connect(dsn) as locker:
        locker.execute("LOCK TABLE job_queue IN SHARE MODE")
        began = time.monotonic()
        done = _worker(dsn, "--burst-give-up", "1s", "--processes", processes)
        assert done.returncode == 3, done.stderr
        assert time.monotonic() - began >= 1
        assert "burst: giving up, no claim has gone through for" in done.stderr, done.stderr
        assert "lock timeout" in done.stderr and f"job_queue is locked by pid {locker.info.backend_pid}" in done.stderr
        if processes == "2":
            assert done.stderr.count("gave up its burst: not restarted") == 2, done.stderr
            assert "restarting" not in done.stderr, done.stderr
        locker.rollback()
    assert conn.execute("SELECT state FROM job_queue WHERE id = %s", (job,)).fetchone() == {"state": "queued"}
    done = _worker(dsn, "--burst-give-up", "1s")  # the lock gone: the burst drains and exits 0
    assert done.returncode == 0, done.stderr
    assert conn.execute("SELECT state FROM job_queue WHERE id = %s", (job,)).fetchone() == {"state": "succeeded"}


def test_burst_give_up_must_be_a_duration(dsn: str) -> None:
    done = _worker(dsn, "--burst-give-up", "soon")
    assert done.returncode == 2 and "--burst-give-up: 'soon' is not a duration" in done.stderr, done.stderr
