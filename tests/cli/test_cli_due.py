"""`qconsole jobs` says when a job waiting for its time (enqueued for later, a retry's backoff) is due."""

from __future__ import annotations

from typing import Any

from tests.cli.test_cli import cli  # noqa: F401  (the fixture)
from worker_core import db


def test_jobs_says_when_a_delayed_job_is_due(cli: Any, conn: db.Conn) -> None:  # noqa: F811
    # a job enqueued for in an hour read "queued" as any other (the reviewer's "no scheduled-time column")
    later = cli("enqueue", "t.ok", "--delay", "3600").stdout.split()[-1]
    now = cli("enqueue", "t.ok").stdout.split()[-1]
    out = cli("jobs").stdout
    header = out.splitlines()[0].split()
    assert header[:5] == ["id", "type", "queue", "state", "due"], header
    [row_later] = [line for line in out.splitlines() if line.startswith(later)]
    [row_now] = [line for line in out.splitlines() if line.startswith(now)]
    assert "queued  in 59m" in row_later or "queued  in 1h00m" in row_later, row_later
    assert " in " not in row_now, row_now
