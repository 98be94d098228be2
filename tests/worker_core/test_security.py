"""Security: the DSN's password never reaches logs or errors; filters and search are parameters."""

from __future__ import annotations

import logging
import time

import pytest

import tests.worker_core.tasks  # noqa: F401
from tests.worker_core.helpers import WorkerThread
from worker_core import db, stats
from worker_core.producer import enqueue

SECRET = "hunter2-Very-Secret"


def test_redaction_of_urls_and_keyword_dsns() -> None:
    url = f"postgresql://app:{SECRET}@db.internal:5432/jobs"
    assert SECRET not in db.redact_dsn(url) and "db.internal" in db.redact_dsn(url)
    kw = f"host=db.internal user=app password={SECRET} dbname=jobs"
    assert SECRET not in db.redact_dsn(kw) and "dbname=jobs" in db.redact_dsn(kw)
    assert db.redact(f"could not connect: password={SECRET}", kw) == "could not connect: password=***"
    # libpq takes the password from a URL's query string too
    for query in (f"postgresql://app@db.internal/jobs?password={SECRET}",
                  f"postgresql://app@db.internal/jobs?sslmode=require&password={SECRET}&connect_timeout=2",
                  f"postgresql://app@db.internal/jobs?password={SECRET}&%zz"):  # fmt: skip
        assert SECRET not in db.redact_dsn(query) and "db.internal" in db.redact_dsn(query), db.redact_dsn(query)


def test_redaction_of_short_passwords_and_of_several_urls() -> None:
    # a one-character password is masked where it stands alone, not inside every address and number
    dsn = "postgresql://u:1@127.0.0.1:1/db"
    assert db.redact('connection to server at "127.0.0.1", port 1 failed: 1', dsn) == (
        'connection to server at "127.0.0.1", port *** failed: ***'
    )
    # each URL of a message is masked, a password with an unencoded ``@`` to its last one
    text = "tried postgresql://a:b@c@h1/x then redis://:pw@r:6379/0 and postgresql://k@h2/y"
    assert db.redact(text, None) == "tried postgresql://a:***@h1/x then redis://:***@r:6379/0 and postgresql://k@h2/y"
    assert db.redact("://x:" * 3 + " ://y:z", None) == "://x:" * 3 + " ://y:z"  # no ``@``: no password


def test_a_worker_that_cannot_reach_its_database_never_logs_the_password(caplog: pytest.LogCaptureFixture) -> None:
    dsn = f"postgresql://app:{SECRET}@127.0.0.1:1/jobs?connect_timeout=1"
    caplog.set_level(logging.DEBUG)
    wt = WorkerThread(dsn, burst=False, poll_interval=0.1, heartbeat_interval=0.2).start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any("claim failed" in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    wt.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert any("claim failed" in m for m in messages), "the worker should have reported its outage"
    assert not any(SECRET in m for m in messages)
    assert wt.worker.stopping


def test_search_and_filters_are_parameters_not_sql(conn: db.Conn) -> None:
    jid = enqueue(conn, "t.ok", {}, idempotency_key="it's; DROP TABLE job_queue; --").id
    for needle in ("'; DROP TABLE job_queue; --", "%", "_", "\\", "it's; DROP TABLE job_queue; --"):
        stats.list_jobs(conn, search=needle)
        stats.list_jobs(conn, job_type=needle, queue=needle)
    assert [j.id for j in stats.list_jobs(conn, search="it's; DROP TABLE job_queue; --")] == [jid]
    assert stats.list_jobs(conn, search="%") == []  # a literal percent sign, not a wildcard
    assert conn.execute("SELECT count(*) AS n FROM job_queue").fetchone() == {"n": 1}
