"""A CLI action whose connection is lost once it was sent: done, not done, or unknown, said as such.

The answer to its COMMIT lost (the connection cut right after the server committed), `requeue`, `kill` and
`enqueue` said only `error: database error: ...`, exit 3, of an action that was done and audited: a runbook ran
`enqueue` again (a second job) or `requeue` again (the job run a second time). Each CLI action that writes now
looks itself up on a new connection, as the console does (its audit entry by its token; an enqueue, its job).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from tests.cli.test_cli import cli  # noqa: F401  (the fixture)
from tests.worker_core.helpers import ROOT, FreezingProxy, in_thread, subprocess_env
from worker_core import db, ops


def _dead(conn: db.Conn, *jobs: uuid.UUID) -> None:
    conn.execute("UPDATE job_queue SET state = 'failed', attempts = 1 WHERE id = ANY(%s)", (list(jobs),))


def _audited(conn: db.Conn, marker: str) -> list[dict[str, Any]]:
    return conn.execute("SELECT id, action FROM audit_log WHERE reason = %s", (marker,)).fetchall()


def _state(conn: db.Conn, job: uuid.UUID) -> str:
    row = conn.execute("SELECT state FROM job_queue WHERE id = %s", (job,)).fetchone()
    assert row is not None
    return str(row["state"])


class _GoneOnceLost(threading.Event):
    """The proxy's ``down``: set from the moment the answer to the COMMIT was lost (new connections refused)."""

    def __init__(self, proxy: FreezingProxy) -> None:
        super().__init__()
        self.proxy = proxy

    def is_set(self) -> bool:
        return super().is_set() or self.proxy.commits_lost > 0


@contextmanager
def _commit_answer_lost(dsn: str, marker: str, gone_after: bool = False) -> Iterator[FreezingProxy]:
    """A proxy in front of ``dsn`` that loses the answer to the COMMIT of the transaction that sends ``marker``
    (the server committed), once; ``gone_after``: refusing new connections from then on."""
    proxy = FreezingProxy.before(dsn, hang_ups=True)
    if gone_after:
        proxy.down = _GoneOnceLost(proxy)
    proxy.lose_commit_after = marker.encode()
    try:
        yield proxy
    finally:
        proxy.cut()
        proxy.close()
    assert proxy.commits_lost == 1


#: each CLI action that writes: its arguments (the marker, in the statement before its COMMIT), what the test
#: sets up first, what it checks was done, and what stdout says of it as of a success
ACTIONS = ["requeue", "requeue_group", "kill", "discard", "pause", "resume", "limit", "unlimit", "enqueue"]


def _arrange(action: str, conn: db.Conn, make_job: Any, marker: str) -> tuple[list[str], Any]:
    """The command's arguments, and a check of its effect (given its stdout) that it was done."""
    jobs = [make_job("t.ok") for _ in range(2 if action == "requeue_group" else 1)]
    ids = [str(j) for j in jobs]
    if action in ("requeue", "requeue_group", "discard"):
        _dead(conn, *jobs)
    if action == "resume":
        ops.set_paused(conn, "default", True)
    if action == "unlimit":
        ops.set_limit(conn, "t.ok", 2)
    if action in ("requeue", "requeue_group", "kill", "discard"):
        name = action.removesuffix("_group")
        after = {"requeue": "queued", "kill": "cancelled", "discard": "cancelled"}[name]

        def jobs_moved(out: str) -> None:
            assert [_state(conn, j) for j in jobs] == [after] * len(jobs)
            assert f"{name}: {len(jobs)} of {len(jobs)} job(s) changed (audit #" in out, out

        return [name, *ids, "--reason", marker], jobs_moved
    if action in ("pause", "resume"):

        def paused(out: str) -> None:
            row = conn.execute("SELECT paused FROM queues WHERE name = 'default'").fetchone()
            assert row is not None and row["paused"] is (action == "pause")
            assert f"{action}d queue default (audit #" in out, out

        return [action, "default", "--reason", marker], paused
    if action in ("limit", "unlimit"):

        def limited(out: str) -> None:
            rows = conn.execute("SELECT max_running FROM concurrency_limits WHERE job_type = 't.ok'").fetchall()
            assert [r["max_running"] for r in rows] == ([3] if action == "limit" else [])
            said = "t.ok in *: at most 3 running" if action == "limit" else "cleared the limit of t.ok in *"
            assert said in out, out

        args = ["3"] if action == "limit" else ["--clear"]
        return ["limit", "t.ok", *args, "--reason", marker], limited

    def enqueued(out: str) -> None:
        rows = conn.execute("SELECT id FROM job_queue WHERE payload->>'m' = %s", (marker,)).fetchall()
        assert [str(r["id"]) for r in rows] == [out.strip()]

    return ["enqueue", "t.ok", "--payload", f'{{"m": "{marker}"}}'], enqueued


@pytest.mark.parametrize("action", ACTIONS)
def test_an_action_whose_commit_answer_is_lost_says_it_was_done(
    cli: Any, dsn: str, conn: db.Conn, make_job: Any, action: str  # noqa: F811
) -> None:
    marker = f"lost-{uuid.uuid4().hex[:8]}"
    args, was_done = _arrange(action, conn, make_job, marker)
    with _commit_answer_lost(dsn, marker) as proxy:
        r = cli(args[0], "--dsn", proxy.dsn, *args[1:])  # exit 0: done
    was_done(r.stdout)
    said = " ".join(r.stderr.split())
    assert "database error" not in said and "Traceback" not in said
    assert "the answer to its commit was lost with the connection" in said, said
    if action == "enqueue":
        assert f"enqueue done (job {r.stdout.strip()})" in said, said
    else:
        audited = _audited(conn, marker)
        assert len(audited) == 1
        assert f"done (audit #{audited[0]['id']}" in said, said


def test_a_requeue_whose_answer_is_lost_names_the_jobs_that_do_not_exist(
    cli: Any, dsn: str, conn: db.Conn, make_job: Any  # noqa: F811
) -> None:
    # done, its answer lost: a job named that does not exist is said, exit 1, as when the answer comes
    job, nobody = make_job("t.ok"), uuid.uuid4()
    _dead(conn, job)
    marker = f"lost-{uuid.uuid4().hex[:8]}"
    with _commit_answer_lost(dsn, marker) as proxy:
        r = cli("requeue", "--dsn", proxy.dsn, str(job), str(nobody), "--reason", marker, code=1)
    assert _state(conn, job) == "queued"
    assert "requeue: 1 of 2 job(s) changed (audit #" in r.stdout
    assert f"skipped {nobody}: no such job" in r.stdout


@pytest.mark.parametrize("action", ["requeue", "pause", "enqueue"])
def test_an_action_that_cannot_be_looked_up_says_its_outcome_is_unknown(
    cli: Any, dsn: str, conn: db.Conn, make_job: Any, action: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    from qconsole import cli as cli_module

    monkeypatch.setattr(cli_module, "LOST_LOOKUP_S", 1.0)
    marker = f"lost-{uuid.uuid4().hex[:8]}"
    args, _ = _arrange(action, conn, make_job, marker)
    with _commit_answer_lost(dsn, marker, gone_after=True) as proxy:
        r = cli(args[0], "--dsn", proxy.dsn, *args[1:], code=5)  # the outcome unknown
    said = " ".join(r.stderr.split())
    assert "error: database error: " in said and "Traceback" not in said
    assert f"the outcome of the {args[0]} is UNKNOWN" in said and "check before running it again" in said, said
    assert "could not be asked again" in said, said
    if action == "enqueue":
        rows = conn.execute("SELECT id FROM job_queue WHERE payload->>'m' = %s", (marker,)).fetchall()
        assert len(rows) == 1  # it was done: the job to look for is named
        assert f"`qconsole job {rows[0]['id']}`" in said and "--dedup-key" in said, said
    else:
        assert "`qconsole audit`" in said, said
        assert len(_audited(conn, marker)) == 1


def _terminate_when_waiting(conn: db.Conn, stop: threading.Event) -> None:
    """Ends the CLI's session (its backend, in this test's database) once it waits for a row lock."""
    dbname = conn.info.dbname
    while not stop.is_set():
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = 'qconsole-cli'"
            " AND wait_event_type = 'Lock'",
            (dbname,),
        ).fetchone()
        if row is not None:
            conn.execute("SELECT pg_terminate_backend(%s)", (row["pid"],))
            return
        time.sleep(0.05)


@pytest.mark.parametrize("action", ["kill", "requeue"])
def test_an_action_whose_session_ended_before_its_commit_says_nothing_changed(
    cli: Any, dsn: str, conn: db.Conn, make_job: Any, action: str  # noqa: F811
) -> None:
    job = make_job("t.ok")
    if action == "requeue":
        _dead(conn, job)
    marker = f"lost-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM job_queue WHERE id = %s FOR UPDATE", (job,))
        with db.connect(dsn, autocommit=True) as watcher:
            stop = threading.Event()
            thread, _ = in_thread(lambda: _terminate_when_waiting(watcher, stop))
            try:
                r = cli(action, str(job), "--reason", marker, code=3)
            finally:
                stop.set()
                thread.join()
        holder.rollback()
    said = " ".join(r.stderr.split())
    assert "error: database error: " in said and "Traceback" not in said
    assert f"not done: nothing changed (the connection was lost before the {action} committed" in said, said
    assert _state(conn, job) == ("failed" if action == "requeue" else "queued")
    assert _audited(conn, marker) == []


@pytest.mark.parametrize("action", ["requeue", "kill", "enqueue"])
def test_a_cli_action_whose_commit_answer_is_lost_does_not_just_say_database_error(
    dsn: str, conn: db.Conn, make_job: Any, action: str
) -> None:
    # the review's drill (the database goes away), as an operator runs it: `python -m qconsole`, its process
    marker = f"review-{uuid.uuid4().hex[:8]}"
    args, was_done = _arrange(action, conn, make_job, marker)
    with _commit_answer_lost(dsn, marker) as proxy:
        r = subprocess.run(
            [sys.executable, "-m", "qconsole", args[0], "--dsn", proxy.dsn, *args[1:]],
            cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert r.returncode == 0, r.stderr
    was_done(r.stdout)  # it was done: the job moved and the action is audited (the job was enqueued)
    said = r.stderr.lower()
    assert "traceback" not in said and "database error" not in said
    assert "done (" in said, f"exit {r.returncode}, and all it says of an action that was done: {r.stderr!r}"
