"""Every console action, driven by keys through Pilot, against a real PostgreSQL.

Plain ``def`` tests that run their scenario on a fresh event loop (no async test plugin), and leave a
new current loop behind so that later ``snap_compare`` calls still find one (Textual#5788).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import rich.console
from psycopg.conninfo import make_conninfo
from textual.widgets import Static

import tests.worker_core.tasks
from qconsole.app import QConsoleApp, make_app
from qconsole.backend import DatabaseBackend
from qconsole.embedded_workers import EmbeddedWorkers
from qconsole.screens.audit import AuditScreen
from qconsole.screens.confirm import ConfirmScreen
from qconsole.screens.dead_letters import DeadLettersScreen
from qconsole.screens.job_detail import JobDetailScreen
from qconsole.screens.limit import LimitScreen
from qconsole.screens.overview import OverviewScreen
from qconsole.screens.start_worker import StartWorkerScreen
from qconsole.screens.workers import WorkersScreen
from qconsole.widgets.chrome import OutageBanner
from qconsole.widgets.table import LiveTable
from tests.qconsole.pilot import opened, run_as_the_console, run_async, settle, title_of, type_fast, until
from worker_core import RetryPolicy, db, ops, stats
from worker_core.errors import ReadOnlyError
from worker_core.models import JobState
from worker_core.worker import Worker, WorkerConfig

TASKS = "tests.worker_core.tasks"
REPO = Path(__file__).resolve().parents[2]
SIZE = (80, 24)


def console(dsn: str, **kwargs: Any) -> QConsoleApp:
    kwargs.setdefault("refresh_seconds", None)
    kwargs.setdefault("cursor_blink", False)
    backend = kwargs.pop("backend", None) or DatabaseBackend(dsn, read_only=kwargs.pop("read_only", False))
    return make_app(backend, **kwargs)


def run_worker_until(dsn: str, done: Callable[[], bool], timeout: float = 30.0) -> None:
    """An in-process worker on the test tasks (in a thread, so it installs no signal handlers)."""
    w = Worker(WorkerConfig(dsn=dsn, task_modules=(TASKS,), concurrency=4, poll_interval=0.05, heartbeat_interval=0.2))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    try:
        while not done():
            assert time.monotonic() < deadline, "the worker did not get there in time"
            time.sleep(0.05)
    finally:
        w.stop()
        t.join(30)
    assert not t.is_alive()


def states(conn: db.Conn, ids: list[uuid.UUID]) -> list[JobState]:
    return [stats.get_job(conn, i).state for i in ids]


def notes(app: QConsoleApp) -> str:
    return "\n".join(n.message for n in app._notifications)


# ------------------------------------------------------------------------------------------------ actions


def test_requeue_a_dead_letter_group_with_keys(dsn: str, conn: db.Conn, make_job: Callable[..., uuid.UUID]) -> None:
    dead = [make_job("t.unknown", {"key": f"customer_{i}"}) for i in range(3)]
    failed = make_job("t.permanent", {"invoice": "inv_9"})
    run_worker_until(dsn, lambda: states(conn, [*dead, failed]).count(JobState.QUEUED) == 0 and all(
        s in (JobState.DEAD_LETTERED, JobState.FAILED) for s in states(conn, [*dead, failed])))  # fmt: skip
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            group = screen.current()
            assert group is not None and group.job_type == "t.unknown" and group.count == 3
            await pilot.press("r")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen)
            assert "Requeue 3 job(s) in 1 group(s)" in app.screen.question
            await pilot.press("y")
            await settle(pilot)
            assert "Requeued 3 job(s)" in notes(app)

    run_async(scenario())
    assert states(conn, dead) == [JobState.QUEUED] * 3
    assert stats.get_job(conn, failed).state == JobState.FAILED
    entry = stats.audit_log(conn)[0]
    assert entry.action == "requeue" and set(entry.job_ids) == set(dead)
    assert entry.os_user == ops.Actor.current().os_user


def test_discard_a_dead_letter_group_and_kill_points_to_it(dsn: str, conn: db.Conn) -> None:
    # dead letters that could never succeed could not be cleared from this screen: K said "already dead or
    # failed: requeue them instead", and nothing else would take them
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at, last_error,"
        " error_fingerprint) SELECT 't.ok', 'default', '{}', 'dead_lettered', 1, now(), 'bad VAT id',"
        " 'bad VAT id' FROM generate_series(1, 3)"
    )
    conn.commit()
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            assert screen.current() is not None
            await pilot.press("K")
            await settle(pilot)
            assert "discard (X)" in notes(app)
            await pilot.press("X")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen)
            assert "Discard 3 job(s) in 1 group(s)" in app.screen.question
            await pilot.press("y")
            await settle(pilot)
            assert "Discarded 3 job(s)" in notes(app)

    run_async(scenario())
    rows = conn.execute("SELECT state FROM job_queue").fetchall()
    assert [r["state"] for r in rows] == ["cancelled"] * 3
    assert stats.audit_log(conn)[0].action == "discard"


def test_a_group_action_that_takes_long_is_said_to_run_and_the_screens_read_on_meanwhile(
    dsn: str, conn: db.Conn
) -> None:
    # actions ran on the reading connection under the read bound: a long one was cancelled (nothing said it
    # was running meanwhile), and every screen's read waited behind it
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error, error_fingerprint)"
        " SELECT 't.ok', 'default', '{}', 'dead_lettered', now(), 'boom', 'boom' FROM generate_series(1, 3)"
    )
    conn.commit()
    app = console(dsn)
    locker = db.connect(dsn)  # holds the group's rows: the requeue waits for them as long as the test says

    async def scenario() -> None:
        async with app.run_test(size=(120, 24)) as pilot:
            await settle(pilot)
            await pilot.press("d", "r")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen)
            locker.execute("SELECT id FROM job_queue FOR UPDATE").fetchall()
            await pilot.press("y")
            await until(pilot, lambda: "⟳ requeue" in title_of(app), what="the title bar saying the requeue runs")
            screen = app.screen
            assert isinstance(screen, DeadLettersScreen)
            screen.data_at = None
            screen.reload()
            await until(pilot, lambda: screen.data_at is not None, what="a read while the action waits")
            assert "⟳ requeue" in title_of(app) and "under way" in notes(app) and "Requeued" not in notes(app)
            locker.rollback()
            await until(pilot, lambda: "Requeued 3 job(s)" in notes(app), what="the requeue's outcome")
            await until(pilot, lambda: "⟳" not in title_of(app), what="the title bar without it")

    try:
        run_async(scenario())
    finally:
        locker.close()
    assert states(conn, [r["id"] for r in conn.execute("SELECT id FROM job_queue")]) == [JobState.QUEUED] * 3


def test_an_actions_in_progress_notice_goes_when_its_outcome_is_said(dsn: str, conn: db.Conn) -> None:
    # "Requeue under way…" stayed up next to "Requeued 3 job(s). (audit #1)", as if another one were running
    conn.execute(DEAD_GROUP)
    conn.commit()
    app = console(dsn)
    locker = db.connect(dsn)  # holds the group's rows: the requeue waits for them as long as the test says

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("d", "r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the requeue's question")
            locker.execute("SELECT id FROM job_queue FOR UPDATE").fetchall()
            await pilot.press("y")
            await until(pilot, lambda: app.acting == ("requeue",), what="the requeue running")
            assert "Requeue under way…" in notes(app)
            app.notify("Requeue under way…")  # another's, still running: only one goes
            locker.rollback()
            await until(pilot, lambda: "Requeued 3 job(s)" in notes(app), what="the requeue's outcome")
            assert notes(app).count("Requeue under way…") == 1

    try:
        run_async(scenario())
    finally:
        locker.close()


def console_sessions(conn: db.Conn) -> int:
    """The console's sessions the server still has (an action's ends only once the server notices its client
    went away)."""
    row = conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = 'qconsole-console'"
        " AND datname = current_database()"
    ).fetchone()
    return int(row["n"]) if row else 0


def waiting_for_locks(conn: db.Conn) -> int:
    row = conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = 'qconsole-console'"
        " AND datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()
    return int(row["n"]) if row else 0


def test_quitting_while_actions_wait_exits_and_rolls_them_back(dsn: str, conn: db.Conn) -> None:
    # the console quit (a blank screen) but stayed alive for as long as the action waited, then the requeue
    # committed and the pause queued behind it ran, after the operator had quit (the pause now runs alongside
    # the requeue: here it waits too, for the queues table)
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error, error_fingerprint)"
        " SELECT 't.ok', 'default', '{}', 'dead_lettered', now(), 'boom', 'boom' FROM generate_series(1, 200)"
    )
    app = console(dsn)
    locker = db.connect(dsn)  # holds the group's rows: the requeue waits for them as long as the test says
    quit_pressed: list[bool] = []

    async def scenario() -> None:
        async with app.run_test(size=(120, 24)) as pilot:
            await settle(pilot)
            await pilot.press("d", "r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the requeue's question")
            locker.execute("SELECT id FROM job_queue FOR UPDATE").fetchall()
            await pilot.press("y")
            await until(pilot, lambda: app.acting == ("requeue",), what="the requeue running")
            await pilot.press("o")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen), what="the overview")
            overview = app.screen
            assert isinstance(overview, OverviewScreen)
            await until(pilot, lambda: overview.selected() is not None, what="the overview's rows")
            await pilot.press("p")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the pause's question")
            locker.execute("LOCK TABLE queues IN SHARE MODE")  # the pause's write waits, the reads do not
            await pilot.press("y")
            await until(pilot, lambda: app.acting == ("requeue", "pause"), what="the pause asked for")
            await until(pilot, lambda: waiting_for_locks(conn) == 2, what="both actions waiting")
            quit_pressed.append(True)
            await pilot.press("q")

    try:
        exited = run_as_the_console(scenario())
        assert quit_pressed, "the scenario did not get to q"
        assert exited, "the console did not exit while the action waited"
        assert app.return_code == 0
        app.backend.close()  # as run_console does once the app returned
        locker.rollback()
        # the requeue's session ends once the server notices its client is gone
        deadline = time.monotonic() + 30
        while console_sessions(conn):
            assert time.monotonic() < deadline, "the console's sessions did not end"
            time.sleep(0.1)
    finally:
        locker.close()
    assert states(conn, [r["id"] for r in conn.execute("SELECT id FROM job_queue")]) == [JobState.DEAD_LETTERED] * 200
    assert not any(q.paused for q in stats.overview(conn).queues)
    assert stats.audit_log(conn) == []


def test_q_exits_at_once_while_a_read_waits_on_a_server_that_stopped_answering(dsn: str) -> None:
    # a hung host (TCP still up): q blanked the screen, but the terminal came back only once the read in
    # flight reached its deadline, 10 s later (asyncio.run joins the read's thread before it returns)
    from tests.worker_core.helpers import FreezingProxy

    proxy = FreezingProxy.before(dsn)
    backend = DatabaseBackend(proxy.dsn)  # the defaults, as run_console builds it: call deadline 10 s
    app = console(dsn, backend=backend)
    pressed: list[float] = []

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            proxy.frozen.set()  # the server stops answering
            await pilot.press("ctrl+r")  # a read now waits on it
            await pilot.pause(0.5)
            pressed.append(time.monotonic())
            await pilot.press("q")

    try:
        exited = run_as_the_console(scenario(), within=30)
        took = time.monotonic() - pressed[0]
        backend.close()  # as run_console does once the app returned
    finally:
        proxy.frozen.clear()
        proxy.close()
    assert exited
    assert took < 3, f"q took {took:.1f}s to give the terminal back"


DEAD_GROUP = (
    "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error, error_fingerprint)"
    " SELECT 't.ok', 'default', '{}', 'dead_lettered', now(), 'boom', 'boom' FROM generate_series(1, 3)"
)


def test_a_requeue_whose_commit_answer_is_lost_is_said_done_with_its_audit_entry(dsn: str, conn: db.Conn) -> None:
    # the server committed, and the connection died before its answer came: the console said "requeue failed,
    # nothing changed" of jobs it had requeued, and the operator requeued them again
    from tests.worker_core.helpers import FreezingProxy

    conn.execute(DEAD_GROUP)
    conn.commit()
    proxy = FreezingProxy.before(dsn)
    app = console(dsn, backend=DatabaseBackend(proxy.dsn))

    async def scenario() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot)
            await opened(pilot, "d", DeadLettersScreen)
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            proxy.lose_commit_after = b"UPDATE job_queue j SET"  # the requeue's statement
            await pilot.press("y")
            await until(pilot, lambda: app.acting == (), what="the requeue to end")
            await settle(pilot)

    try:
        run_async(scenario())
    finally:
        app.backend.close()
        proxy.close()
    assert proxy.commits_lost == 1
    conn.rollback()
    assert {r["state"] for r in conn.execute("SELECT state FROM job_queue")} == {JobState.QUEUED.value}
    [entry] = stats.audit_log(conn)
    said = notes(app)
    assert f"requeue done (audit #{entry.id}, 3 job(s)): its answer was lost with the connection" in said, said
    assert "nothing changed" not in said and "unknown" not in said


def test_an_action_whose_session_ended_before_it_committed_is_said_to_have_changed_nothing(
    dsn: str, conn: db.Conn
) -> None:
    # the connection died too, but the console told, on a new one, that its session had ended without committing
    conn.execute(DEAD_GROUP)
    conn.commit()
    app = console(dsn)
    locker = db.connect(dsn)  # holds the group's rows: the requeue waits for them

    async def scenario() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot)
            await opened(pilot, "d", DeadLettersScreen)
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            locker.execute("SELECT id FROM job_queue FOR UPDATE").fetchall()
            await pilot.press("y")
            await until(pilot, lambda: waiting_for_locks(conn) == 1, what="the requeue waiting")
            conn.execute(  # an operator's pg_terminate_backend, a failover
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'qconsole-console'"
                " AND datname = current_database() AND wait_event_type = 'Lock'"
            )
            await until(pilot, lambda: app.acting == (), what="the requeue to end")
            locker.rollback()

    try:
        run_async(scenario())
    finally:
        locker.close()
        app.backend.close()
    said = notes(app)
    assert "requeue failed, nothing changed:" in said and "(the connection was lost before it committed)" in said
    assert {r["state"] for r in conn.execute("SELECT state FROM job_queue")} == {JobState.DEAD_LETTERED.value}
    assert stats.audit_log(conn) == []


def test_an_action_whose_outcome_cannot_be_told_is_said_unknown_not_failed(dsn: str, conn: db.Conn) -> None:
    # the server stopped answering while the requeue waited (a hung host behind TCP that still acknowledges): its
    # session lives on, and it may still commit, so neither "done" nor "nothing changed" is known
    from tests.worker_core.helpers import FreezingProxy

    conn.execute(DEAD_GROUP)
    conn.commit()
    proxy = FreezingProxy.before(dsn)
    backend = DatabaseBackend(proxy.dsn)
    backend.action_deadline_s = 1.0  # the default is minutes long: a group's requeue may take that long
    backend.lost_settle_s = 1.0
    app = console(dsn, backend=backend)
    locker = db.connect(dsn)

    async def scenario() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot)
            await opened(pilot, "d", DeadLettersScreen)
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            locker.execute("SELECT id FROM job_queue FOR UPDATE").fetchall()
            await pilot.press("y")
            await until(pilot, lambda: app.acting == (), what="the requeue to end")

    try:
        run_async(scenario())
        said = notes(app)
        assert "requeue: outcome unknown (the connection was lost): check the audit log (a) before acting again" in said
        assert "nothing changed" not in said and "done" not in said
    finally:
        locker.rollback()
        locker.close()
        backend.close()
        conn.execute(  # its session, behind the proxy, would wait for its client for ever
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'qconsole-console'"
            " AND datname = current_database()"
        )
        proxy.close()


@pytest.mark.parametrize("ends", ["killed", "failed"])
def test_an_action_whose_screen_was_closed_meanwhile_still_says_its_outcome_and_clears_the_title(
    dsn: str, conn: db.Conn, make_job: Any, ends: str
) -> None:
    # K, y, esc on a job's detail: the title bar said `⟳ kill…` for good and the outcome was never said (the
    # action's thread reached the app through its screen, gone by then), a failure's as a success's
    j = make_job("t.ok", {})
    app = console(dsn)
    locker = db.connect(dsn)  # holds the job's row: the kill waits for it as long as the test says

    async def scenario() -> None:
        async with app.run_test(size=(120, 24)) as pilot:
            await settle(pilot)
            app.push_screen(JobDetailScreen(j))
            await settle(pilot)
            detail = app.screen
            assert isinstance(detail, JobDetailScreen) and detail.job is not None
            locker.execute("SELECT id FROM job_queue FOR UPDATE").fetchall()
            await pilot.press("K")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the kill's question")
            await pilot.press("y")
            await until(pilot, lambda: app.acting == ("kill",), what="the kill running")
            await pilot.press("escape")
            await until(pilot, lambda: app.screen is not detail and not detail.is_attached, what="the detail closed")
            if ends == "failed":  # the kill's session is ended (an operator's pg_terminate_backend, a failover)
                ended = conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'qconsole-console'"
                    " AND datname = current_database() AND wait_event_type = 'Lock'"
                ).fetchall()
                assert len(ended) == 1
            locker.rollback()
            outcome = "Killed 1 job(s)" if ends == "killed" else "kill failed, nothing changed"
            await until(pilot, lambda: outcome in notes(app), what="the kill's outcome")
            await until(pilot, lambda: "⟳" not in title_of(app), what="the title bar without it")
            assert app.acting == ()

    try:
        run_async(scenario())
    finally:
        locker.close()
    assert states(conn, [j]) == [JobState.CANCELLED if ends == "killed" else JobState.QUEUED]


def test_a_second_action_is_asked_and_runs_at_once_while_another_waits(dsn: str, conn: db.Conn) -> None:
    # every action, and the read of a group's jobs before its question, waited behind the one running: r on
    # another group showed nothing (its question came minutes later, over whatever screen was shown then),
    # and a pause, containment, waited behind a long requeue
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error, error_fingerprint)"
        " SELECT 't.ok', 'default', '{}', 'dead_lettered', now(), f, f"
        " FROM (VALUES ('boom'), ('boom'), ('boom'), ('bang'), ('bang')) AS v(f)"
    )
    app = console(dsn)
    locker = db.connect(dsn)  # holds the first group's rows: its requeue waits for them

    async def scenario() -> None:
        async with app.run_test(size=(120, 24)) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            first = screen.current()
            assert first is not None and first.fingerprint == "boom"
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the first requeue's question")
            locker.execute("SELECT id FROM job_queue WHERE error_fingerprint = 'boom' FOR UPDATE").fetchall()
            await pilot.press("y")
            await until(pilot, lambda: app.acting == ("requeue",), what="the first requeue running")
            await pilot.press("down")
            second = screen.current()
            assert second is not None and second.fingerprint == "bang"
            await pilot.press("r")
            await until(
                pilot,
                lambda: isinstance(app.screen, ConfirmScreen) and "Requeue 2 job(s)" in app.screen.question,
                what="the second requeue's question, while the first waits",
            )
            await pilot.press("y")
            await until(pilot, lambda: "Requeued 2 job(s)" in notes(app), what="the second requeue's outcome")
            await pilot.press("o")
            overview = app.screen
            assert isinstance(overview, OverviewScreen)
            await until(pilot, lambda: overview.selected() is not None, what="the overview's rows")
            await pilot.press("p")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the pause's question")
            await pilot.press("y")
            await until(pilot, lambda: "Queue 'default' paused" in notes(app), what="the pause, the requeue waiting")
            assert app.acting == ("requeue",) and "Requeued 3" not in notes(app)
            locker.rollback()
            await until(pilot, lambda: "Requeued 3 job(s)" in notes(app), what="the first requeue's outcome")
            await until(pilot, lambda: app.acting == (), what="the title bar without it")

    try:
        run_async(scenario())
    finally:
        locker.close()
    assert states(conn, [r["id"] for r in conn.execute("SELECT id FROM job_queue")]) == [JobState.QUEUED] * 5
    assert any(q.paused for q in stats.overview(conn).queues if q.name == "default")
    assert sorted(e.action for e in stats.audit_log(conn)) == ["pause", "requeue", "requeue"]


def test_a_groups_question_is_never_asked_over_another_screen(dsn: str, conn: db.Conn) -> None:
    # the jobs of the group were read slowly; meanwhile the operator went to the overview, and the question
    # popped up there (where a `y` meant for something else would answer it)
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error, error_fingerprint)"
        " SELECT 't.ok', 'default', '{}', 'dead_lettered', now(), 'boom', 'boom' FROM generate_series(1, 3)"
    )
    app = console(dsn)
    locker = db.connect(dsn)  # holds the table: the read of the group's jobs waits for it

    async def scenario() -> None:
        async with app.run_test(size=(120, 24)) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
            await pilot.press("r")
            assert screen.fetching
            await pilot.press("r")
            assert "Still reading the jobs" in notes(app)
            await pilot.press("o")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen), what="the overview")
            locker.rollback()
            await until(pilot, lambda: "Requeue not asked" in notes(app), what="the question dropped")
            await settle(pilot)
            assert isinstance(app.screen, OverviewScreen)
            assert not any(isinstance(s, ConfirmScreen) for s in app.screen_stack)
            await pilot.press("d")
            await until(pilot, lambda: app.screen is screen, what="the dead letters again")
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question, asked again")
            await pilot.press("n")

    try:
        run_async(scenario())
    finally:
        locker.close()
    assert states(conn, [r["id"] for r in conn.execute("SELECT id FROM job_queue")]) == [JobState.DEAD_LETTERED] * 3


def test_a_group_action_acts_on_the_jobs_it_asked_about_not_on_those_that_joined_since(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    dead = [make_job("t.unknown", {"key": "k"}) for _ in range(2)]
    run_worker_until(dsn, lambda: states(conn, dead) == [JobState.DEAD_LETTERED] * 2)
    app = console(dsn)
    late: list[uuid.UUID] = []

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("d", "r")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen)
            assert "Requeue 2 job(s) in 1 group(s)" in app.screen.question
            # while the operator reads the question, a third job fails the same way
            late.append(make_job("t.unknown", {"key": "k"}))
            run_worker_until(dsn, lambda: states(conn, late) == [JobState.DEAD_LETTERED])
            await pilot.press("y")
            await settle(pilot)
            assert "Requeued 2 job(s)" in notes(app)

    run_async(scenario())
    assert states(conn, dead) == [JobState.QUEUED] * 2
    assert states(conn, late) == [JobState.DEAD_LETTERED]
    assert set(stats.audit_log(conn)[0].job_ids) == set(dead)


HOSTILE = "boom\x1b[2J\x1b]0;pwned\x07\x1b]52;c;aGk=\x07\x9b31m\x08 done"


def test_job_data_never_reaches_the_terminal_as_escape_sequences(dsn: str, conn: db.Conn, make_job: Any) -> None:
    # an error message, a key and a payload holding escape sequences (a handler that logged its input, a
    # hostile client): written as they are, they would clear the screen, retitle it, set the clipboard
    j = make_job("t.unknown", {"note": HOSTILE}, idempotency_key="k" + HOSTILE)
    conn.execute(
        "UPDATE job_queue SET state = 'dead_lettered', last_error = %(e)s, finished_at = now(),"
        " errors = jsonb_build_array(jsonb_build_object('attempt', 1, 'kind', 'unknown', 'class', 'ValueError',"
        " 'message', %(e)s::text, 'worker', 'w', 'at', now())) WHERE id = %(id)s",
        {"e": HOSTILE, "id": j},
    )
    conn.commit()
    app = console(dsn)
    screens: list[str] = []

    async def scenario() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            await settle(pilot)
            for key in ("j", "d"):
                await pilot.press(key)
                await settle(pilot)
                screens.append(app.export_screenshot())
            app.push_screen(JobDetailScreen(j))
            await settle(pilot)
            screens.append(app.export_screenshot())

    run_async(scenario())
    assert "boom" in screens[-1] and "done" in screens[-1]
    for svg in screens:
        assert not any(c in svg for c in "\x1b\x07\x9b\x08")  # (the payload shows them escaped, as JSON does)


def test_a_job_gone_while_its_detail_is_open_is_said_so_not_taken_for_an_outage(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    j = make_job("t.ok", {})
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            app.push_screen(JobDetailScreen(j))
            await settle(pilot)
            conn.execute("DELETE FROM job_queue WHERE id = %s", (j,))  # retention pruned it, say
            conn.commit()
            app.screen.reload()  # type: ignore[attr-defined]
            await settle(pilot)
            assert not app.screen.query_one(OutageBanner).has_class("-shown")
            assert app.db_error is None
            assert "not found" in str(app.screen.query_one("#job-body").render()).lower()

    run_async(scenario())


def test_a_large_payload_and_many_errors_are_shown_clipped_and_made_once(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # a 94 kB payload took 3.5 s to show and stalled the console for seconds on every refresh (277 kB: 23 s);
    # so did 200 attempts' long errors
    items = [{"sku": f"SKU-{i:05d}", "qty": i % 7, "note": "x" * 10} for i in range(3000)]
    j = make_job("t.ok", {"items": items})
    errors = [{"attempt": i, "kind": "transient", "class": "Boom", "message": "m" * 2000, "worker": "w",
               "at": "2026-11-30T12:00:00+00:00"} for i in range(1, 201)]  # fmt: skip
    conn.execute("UPDATE job_queue SET errors = %s::jsonb WHERE id = %s", (json.dumps(errors), j))
    conn.commit()
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = JobDetailScreen(j)
            app.push_screen(screen)
            await settle(pilot)
            out = rich.console.Console(width=400, file=io.StringIO(), record=True)
            out.print(screen.query_one("#job-body", Static).content)
            body = out.export_text()
            assert f"characters in all: qconsole job {j} --json" in body
            assert f"180 earlier attempt(s): qconsole job {j}" in body
            assert len(body) < 60_000, len(body)
            made = screen._heavy
            screen.reload()
            await settle(pilot)
            assert screen._heavy is made  # the job did not change: not made again

    run_async(scenario())


def test_cancelling_the_confirmation_changes_nothing(dsn: str, conn: db.Conn, make_job: Any) -> None:
    dead = [make_job("t.unknown", {"key": "k"}) for _ in range(2)]
    run_worker_until(dsn, lambda: states(conn, dead) == [JobState.DEAD_LETTERED] * 2)
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("d", "r")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("n")
            await settle(pilot)
            assert not isinstance(app.screen, ConfirmScreen)

    run_async(scenario())
    assert states(conn, dead) == [JobState.DEAD_LETTERED] * 2
    assert stats.audit_log(conn) == []


def test_the_dead_letters_screen_says_it_shows_the_top_groups_and_counts_them_all(dsn: str, conn: db.Conn) -> None:
    # it showed the 200 biggest groups, summed only those, and said nothing of the rest
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error, error_fingerprint)"
        " SELECT 't.ok', 'default', '{}', 'dead_lettered', now(), 'E' || (g % 250), 'E' || (g % 250)"
        " FROM generate_series(1, 1000) g"
    )
    conn.commit()
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=(120, 24)) as pilot:
            await settle(pilot)
            await pilot.press("d")
            await settle(pilot)
            assert isinstance(app.screen, DeadLettersScreen)
            summary = str(app.screen.query_one("#dl-summary", Static).render())
            assert "top 200 of 250 groups │ 1000 dead/failed │ 0 retrying" in summary, summary

    run_async(scenario())


def test_kill_a_group_of_retrying_jobs(dsn: str, conn: db.Conn, make_job: Any) -> None:
    slow_retry = RetryPolicy(backoff="fixed", base_seconds=600, max_delay_seconds=600, jitter=0)
    retrying = [make_job("t.flaky", {"fail_times": 99}, retry_policy=slow_retry) for _ in range(2)]
    run_worker_until(dsn, lambda: states(conn, retrying) == [JobState.RETRY_SCHEDULED] * 2)
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            group = screen.current()
            assert group is not None and group.state == "retry_scheduled" and group.count == 2
            await pilot.press("space")  # mark it: K acts on the marked groups
            await pilot.press("K")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen)
            assert "Kill 2 job(s)" in app.screen.question
            await pilot.press("y")
            await settle(pilot)
            assert "Killed 2 job(s)" in notes(app)

    run_async(scenario())
    assert states(conn, retrying) == [JobState.CANCELLED] * 2
    assert stats.audit_log(conn)[0].action == "kill"


def test_a_dead_letter_group_action_from_the_console_is_audited_with_its_type_fingerprint_and_state(
    dsn: str, conn: db.Conn
) -> None:
    # drill 1, "check the audit log says what you did": a console requeue of a dead-letter group was audited as
    # "requeue 43 job(s)", detail "budget=1 requested=43": no job type, no error fingerprint. The handover at
    # 8 a.m. could not tell which group was replayed without looking up every id
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at, last_error,"
        " error_fingerprint) SELECT 'email.send', 'mail', '{}', 'dead_lettered', 4, now(),"
        " 'upstream 503 from smtp relay', 'TransientError: upstream <n>' FROM generate_series(1, 3)"
    )
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at, last_error,"
        " error_fingerprint) SELECT 'image.resize', 'media', '{}', 'failed', 1, now(), 'not a PNG',"
        " 'PermanentError: not a PNG' FROM generate_series(1, 2)"
    )
    smtp = {"job_type": "email.send", "fingerprint": "TransientError: upstream <n>", "state": "dead_lettered"}
    png = {"job_type": "image.resize", "fingerprint": "PermanentError: not a PNG", "state": "failed"}
    app = console(dsn)
    shown: dict[str, str] = {}

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            assert screen.current() is not None and screen.current().job_type == "email.send"  # type: ignore[union-attr]
            await opened(pilot, "r", ConfirmScreen)
            await pilot.press("y")
            await settle(pilot)
            assert "Requeued 3 job(s)" in notes(app)
            await opened(pilot, "X", ConfirmScreen)  # the group left (the requeued one is queued now)
            await pilot.press("y")
            await settle(pilot)
            await opened(pilot, "a", AuditScreen)
            shown["audit"] = " ".join(screen_text(app).split())

    run_async(scenario())
    discard, requeue = stats.audit_log(conn)[:2]
    assert (requeue.action, len(requeue.job_ids)) == ("requeue", 3)
    # the keys it had, and the group it acted on
    assert requeue.detail["budget"] == 1 and requeue.detail["requested"] == 3
    assert requeue.detail[ops.GROUPS_KEY] == [{**smtp, "jobs": 3}]
    assert (discard.action, len(discard.job_ids)) == ("discard", 2)
    assert discard.detail[ops.GROUPS_KEY] == [{**png, "jobs": 2}]
    # the entry under the cursor (the discard), in words
    assert "image.resize (failed, 2): PermanentError: not a PNG" in shown["audit"], shown["audit"]
    assert "requeue 3 job(s) email.send (dead_letter" in shown["audit"], shown["audit"]  # its detail column


def test_marked_groups_are_all_named_in_the_audit_of_their_kill(dsn: str, conn: db.Conn) -> None:
    for job_type, error in (("t.flaky", "TransientError: upstream <n>"), ("t.slow", "JobTimeout: ran past <n>s")):
        conn.execute(
            "INSERT INTO job_queue (job_type, queue, payload, state, attempts, scheduled_at, last_error,"
            " error_fingerprint) SELECT %s, 'default', '{}', 'retry_scheduled', 1, now() + interval '1 hour',"
            " %s, %s FROM generate_series(1, 2)",
            (job_type, error, error),
        )
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "d", DeadLettersScreen)
            await pilot.press("space", "space")  # the cursor moves down as it marks
            await opened(pilot, "K", ConfirmScreen)
            await pilot.press("y")
            await settle(pilot)
            assert "Killed 4 job(s)" in notes(app)

    run_async(scenario())
    entry = stats.audit_log(conn)[0]
    assert entry.action == "kill" and entry.detail["cancelled"] == 4
    assert sorted((g["job_type"], g["fingerprint"], g["state"], g["jobs"]) for g in entry.detail[ops.GROUPS_KEY]) == [
        ("t.flaky", "TransientError: upstream <n>", "retry_scheduled", 2),
        ("t.slow", "JobTimeout: ran past <n>s", "retry_scheduled", 2),
    ]


def test_pause_and_resume_a_queue(dsn: str, conn: db.Conn, make_job: Any) -> None:
    make_job("t.ok", {}, queue="mail")
    app = console(dsn)

    def paused() -> bool:
        return any(q.paused for q in stats.overview(conn).queues if q.name == "mail")

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert isinstance(app.screen, OverviewScreen)
            await pilot.press("p")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen) and "Pause queue 'mail'" in app.screen.question
            await pilot.press("y")
            await settle(pilot)
            assert paused()
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            row = screen.selected()
            assert row is not None and row.paused
            await pilot.press("p")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen) and "Resume queue 'mail'" in app.screen.question
            await pilot.press("y")
            await settle(pilot)
            assert not paused()

    run_async(scenario())
    assert [e.action for e in stats.audit_log(conn)] == ["resume", "pause"]


def test_the_palette_offers_resume_only_for_a_paused_queue_and_pause_only_for_a_running_one(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # ctrl+p offered "Resume queue default" for a queue that was not paused, and confirming it audited a no-op
    from textual.command import CommandPalette

    from qconsole.commands import ConsoleCommands

    make_job("t.ok", {})
    make_job("t.ok", {}, queue="mail")
    ops.pause(conn, "mail", actor=ops.Actor("tester"), reason="relay down")

    async def scenario() -> None:
        app = console(dsn)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            offered = [text for text, _, _ in ConsoleCommands(app.screen).commands()]
            assert "Pause queue default" in offered and "Resume queue mail" in offered
            assert "Resume queue default" not in offered and "Pause queue mail" not in offered
            await pilot.press("ctrl+p")
            await settle(pilot)
            assert isinstance(app.screen, CommandPalette)
            await pilot.press(*"Resume queue mail", "enter")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the resume's question")
            assert isinstance(app.screen, ConfirmScreen) and "Resume queue 'mail'" in app.screen.question
            await pilot.press("y")
            await settle(pilot)
            app.screen.reload()  # type: ignore[attr-defined]
            await settle(pilot)
            offered = [text for text, _, _ in ConsoleCommands(app.screen).commands()]
            assert "Pause queue mail" in offered and "Resume queue mail" not in offered
            # asked on what the overview read, found in that state already: said, never asked nor audited
            app.request_pause("mail", False)
            await settle(pilot)
            assert not isinstance(app.screen, ConfirmScreen) and "is not paused: nothing to resume" in notes(app)

    run_async(scenario())
    assert [(e.action, e.queue) for e in stats.audit_log(conn)] == [("resume", "mail"), ("pause", "mail")]


def test_read_only_refuses_every_action(dsn: str, conn: db.Conn, make_job: Any) -> None:
    dead = [make_job("t.unknown", {"key": "k"})]
    make_job("t.ok", {}, queue="mail")
    run_worker_until(dsn, lambda: states(conn, dead) == [JobState.DEAD_LETTERED])
    backend = DatabaseBackend(dsn, read_only=True)
    app = console(dsn, backend=backend, launcher=EmbeddedWorkers(dsn))

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            for keys in (("o", "p"), ("o", "l"), ("t", "l"), ("d", "r"), ("d", "K"), ("w", "s")):
                await pilot.press(*keys)
                await settle(pilot)
                assert not isinstance(app.screen, (ConfirmScreen, StartWorkerScreen, LimitScreen)), keys
            assert notes(app).count("Read-only mode") == 6

    run_async(scenario())
    assert states(conn, dead) == [JobState.DEAD_LETTERED]
    assert stats.audit_log(conn) == []
    backend.close()
    # and the server side refuses too: the console's transactions are read-only (on a backend like the one the
    # console had: that one reads no more once its console quit)
    again = DatabaseBackend(dsn, read_only=True)
    with pytest.raises(ReadOnlyError):
        again._call(lambda c: ops.requeue(c, dead))
    again.close()


# ------------------------------------------------------------------------------------------------ why it waits


def overview_line(app: QConsoleApp, text: str) -> str:
    [line] = [x for x in screen_text(app).splitlines() if text in x]
    return line


def test_the_overview_says_no_live_worker_runs_a_type_whose_jobs_wait(dsn: str, conn: db.Conn, make_job: Any) -> None:
    # drill 2, "lag is climbing": jobs of a type no live worker registered wait for ever. The overview showed the
    # lag (▲) and nothing else, the workers screen never said which types a worker runs
    conn.execute(
        "INSERT INTO workers (id, host, pid, queues, tasks, concurrency) VALUES ('h:1:a', 'h', 1, NULL, '{t.ok}', 4)"
    )
    make_job("sms.send", {"to": "+1555"}, queue="mail")
    make_job("t.ok", {}, queue="mail")
    ops.pause(conn, "held", actor=ops.Actor("test"), allow_unknown=True)
    make_job("sms.send", {}, queue="held")  # a pause says why it waits already
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            table = screen.query_one(LiveTable)
            assert str(table.get_row("mail\x1fsms.send")[2]).strip() == "sms.send ∅"
            assert str(table.get_row("mail\x1ft.ok")[2]).strip() == "t.ok"
            assert str(table.get_row("held\x1fsms.send")[2]).strip() == "sms.send"
            assert "∅ no live worker runs: sms.send" in overview_line(app, "workers alive 1")
            table.select_key("mail\x1fsms.send")
            await settle(pilot)
            fields = [f.strip() for f in overview_line(app, "sms.send @ mail").split("│")]
            assert fields[1] == "∅ no live worker runs sms.send in mail", fields  # first: it explains the lag
            table.select_key("held\x1fsms.send")
            await settle(pilot)
            assert "no live worker" not in overview_line(app, "sms.send @ held")
            # what the worker runs, on the workers screen
            workers = await opened(pilot, "w", WorkersScreen)
            [row] = lines_with(screen_text(app), "● live")
            assert row.split()[-1] == "t.ok", row  # its runs column
            workers.query_one(LiveTable).select_key("db:h:1:a")
            await settle(pilot)
            assert "h:1 runs t.ok in every queue" in screen_text(app)
            # its heartbeat stops: no worker is alive at all, and every waiting type is said
            conn.execute("UPDATE workers SET last_heartbeat_at = now() - interval '5 minutes'")
            await opened(pilot, "o", OverviewScreen)
            screen.reload()
            await settle(pilot)
            assert str(table.get_row("mail\x1ft.ok")[2]).strip() == "t.ok ∅"
            table.select_key("mail\x1ft.ok")
            await settle(pilot)
            fields = [f.strip() for f in overview_line(app, "t.ok @ mail").split("│")]
            assert fields[1:3] == ["∅ no live worker at all", "its worker is lost (w)"], fields

    run_async(scenario())


def test_the_overview_says_how_many_running_jobs_hold_an_expired_lease(dsn: str, conn: db.Conn, make_job: Any) -> None:
    # drill: a worker kill -9'd; "reports report.build run 8" looked healthy long after its leases expired
    ids = [make_job("report.build", {"n": i}, queue="reports") for i in range(9)]
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, started_at = now() - interval '10 minutes',"
        " locked_by = 'h:9:dead', locked_until = now() - interval '5 minutes' WHERE id = ANY(%s)",
        (ids[:8],),
    )
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            row = [str(c).strip() for c in screen.query_one(LiveTable).get_row("reports\x1freport.build")]
            assert (row[2], row[3], row[4]) == ("report.build ∅", "1", "8✗"), row
            fields = [f.strip() for f in overview_line(app, "report.build @ reports").split("│")]
            # no worker is alive to take the expired leases over
            assert fields[1:3] == ["∅ no live worker at all", "✗ 8 of 8 leases expired"], fields

    run_async(scenario())


# ------------------------------------------------------------------------------------------------ outage


def test_outage_banner_then_recovery(dsn: str, conn: db.Conn) -> None:
    backend = DatabaseBackend(dsn)
    app = console(dsn, backend=backend, refresh_seconds=0.2)
    unreachable = make_conninfo(dsn, host="127.0.0.1", port=1)

    def banner_shown() -> bool:
        return app.screen.query_one(OutageBanner).has_class("-shown")

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.last_ok is not None, what="a first read")
            assert not banner_shown()
            # the server ends the console's session: the next read fails, the one after reconnects
            killed = conn.execute(
                "SELECT pg_terminate_backend(pid) AS ok FROM pg_stat_activity"
                " WHERE application_name = 'qconsole-console' AND datname = current_database()"
            ).fetchall()
            assert killed and all(r["ok"] for r in killed)
            await until(pilot, lambda: app.db_error is not None, what="the banner")
            assert banner_shown()
            await until(pilot, lambda: app.db_error is None, what="recovery after a terminated session")
            assert not banner_shown()
            # now the server is unreachable for a while: the banner stays, with the age of the data
            last_good = app.last_ok
            backend.switch_dsn(unreachable)
            await until(pilot, lambda: app.db_error is not None, what="the banner")
            banner = app.screen.query_one(OutageBanner)
            assert "DATABASE UNREACHABLE" in str(banner.render())
            await pilot.press("j")  # keys still work during the outage
            await pilot.pause(2.5)
            assert app.last_ok == last_good and app.db_error is not None
            assert app.screen.query_one(OutageBanner).has_class("-shown")
            backend.switch_dsn(dsn)
            await until(pilot, lambda: app.db_error is None, timeout=15, what="recovery")
            assert not app.screen.query_one(OutageBanner).has_class("-shown")

    run_async(scenario())
    backend.close()


def test_the_banner_gives_the_age_of_the_data_on_the_screen_shown(dsn: str) -> None:
    # the age was the last read of any screen: back on the overview during an outage, the banner claimed
    # the jobs screen's newer read for the overview's older counts
    backend = DatabaseBackend(dsn)
    app = console(dsn, backend=backend)

    async def scenario() -> None:
        async with app.run_test(size=(120, 24)) as pilot:
            await settle(pilot)
            overview_at = app.screen.data_at  # type: ignore[attr-defined]
            assert overview_at is not None
            await pilot.pause(1.1)
            await pilot.press("j")
            await settle(pilot)
            assert app.screen.data_at > overview_at  # type: ignore[attr-defined]
            backend.switch_dsn(make_conninfo(dsn, host="127.0.0.1", port=1))
            app.screen.reload()  # type: ignore[attr-defined]
            await until(pilot, lambda: app.db_error is not None, what="the outage")
            await pilot.press("o")
            await settle(pilot)
            banner = str(app.screen.query_one(OutageBanner).render())
            assert f"data from {overview_at:%H:%M:%S} UTC" in banner, banner

    run_async(scenario())
    backend.close()


def test_n_lists_the_waiting_jobs_head_of_the_queue_first(dsn: str, conn: db.Conn) -> None:
    # newest activity first only: in a backlog, the head of the queue (the job behind a lag) was out of reach
    from textual.widgets import Static

    from qconsole.screens.jobs import JobsScreen
    from qconsole.widgets.table import LiveTable
    from worker_core.producer import enqueue

    head = enqueue(conn, "t.ok", {}, priority=-5).id
    tail = [enqueue(conn, "t.ok", {"i": i}).id for i in range(3)]  # newer: first in the default order
    conn.commit()
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "j", JobsScreen)
            table = screen.query_one(LiveTable)
            assert table.cursor_key != str(head)
            await pilot.press("n")
            await settle(pilot)
            assert "next to run first" in str(screen.query_one("#jobs-status", Static).content)
            assert [j.id for j in screen.jobs] == [head, *tail]
            await pilot.press("n")  # again: newest activity first
            await settle(pilot)
            assert screen.jobs[0].id == tail[-1]

    run_async(scenario())


def test_a_jobs_read_that_fails_says_so_on_the_status_line_until_one_succeeds(dsn: str, conn: db.Conn) -> None:
    """A search the database refuses (a statement timeout): the toast goes after a few seconds and the table
    went on showing the unfiltered list while the search box held the search, as if it had matched."""
    import psycopg
    from textual.widgets import Static

    from qconsole.screens.jobs import JobsScreen
    from worker_core.producer import enqueue

    enqueue(conn, "t.ok", {}, delay_seconds=3600)

    class TimingOut(DatabaseBackend):
        def list_jobs(self, **kw: Any) -> Any:
            if kw.get("search"):
                raise psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
            return super().list_jobs(**kw)

    backend = TimingOut(dsn)
    app = console(dsn, backend=backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "j", JobsScreen)
            status = screen.query_one("#jobs-status", Static)
            assert "1 job(s)" in str(status.content)
            screen.set_filter(search="nothing like it")
            await settle(pilot)
            shown = str(status.content)
            assert "read failed" in shown and "statement timeout" in shown and "not this filter's" in shown
            screen.set_filter()
            await settle(pilot)
            assert "1 job(s)" in str(status.content) and "read failed" not in str(status.content)

    run_async(scenario())
    backend.close()


def test_the_overview_says_its_figures_are_stale_while_a_table_lock_times_its_reads_out(
    dsn: str, conn: db.Conn
) -> None:
    # LOCK TABLE job_queue (a migration's ALTER TABLE, a pg_dump waiting): each read timed out, a toast said
    # it once for 8 s, then the overview went on showing the figures read before the lock as if they were live
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, scheduled_at)"
        " SELECT 't.ok', 'default', '{}', now() - interval '5 minutes' FROM generate_series(1, 3)"
    )
    conn.commit()
    backend = DatabaseBackend(dsn, statement_timeout_ms=300)
    app = console(dsn, backend=backend, refresh_seconds=0.2)
    locker = db.connect(dsn)

    async def scenario() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            await until(pilot, lambda: screen.selected() is not None, what="rows")
            banner = screen.query_one(OutageBanner)
            assert not banner.display
            locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
            await until(pilot, lambda: banner.has_class("-stale"), what="the stale mark")
            read_at = screen.data_at  # the last read before the lock
            assert read_at is not None
            await pilot.pause(1.5)  # read after read fails: the mark stays, the data's time with it
            said = str(banner.render())
            assert banner.display and "READS FAILING" in said and "statement timeout" in said, said
            assert f"data from {read_at:%H:%M:%S} UTC" in said and screen.data_at == read_at
            assert app.db_error is None  # the database answered: no outage
            locker.rollback()
            await until(pilot, lambda: not banner.display, what="the mark cleared by a read that succeeds")
            assert screen.data_at is not None and screen.data_at > read_at

    try:
        run_async(scenario())
    finally:
        locker.rollback()
        locker.close()
        backend.close()


def test_reads_never_overlap(dsn: str) -> None:
    """A slow database must not stack reads: the next one starts only when the last one finished."""
    backend = DatabaseBackend(dsn)
    active = 0
    most = 0
    lock = threading.Lock()
    real = backend.overview

    def slow_overview() -> Any:
        nonlocal active, most
        with lock:
            active += 1
            most = max(most, active)
        try:
            time.sleep(0.3)
            return real()
        finally:
            with lock:
                active -= 1

    backend.overview = slow_overview  # type: ignore[method-assign]
    app = console(dsn, backend=backend, refresh_seconds=0.05)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            for _ in range(5):
                await pilot.press("ctrl+r")
                await pilot.pause(0.2)
            await pilot.pause(1.0)

    run_async(scenario())
    assert most == 1
    backend.close()


# ------------------------------------------------------------------------------------------------ embedded workers


def test_start_and_stop_an_embedded_worker_that_crashes_and_restarts(
    dsn: str, conn: db.Conn, make_job: Any, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    launcher = EmbeddedWorkers(dsn, log_dir=tmp_path, shutdown_grace=1.0, env=env)
    app = console(dsn, launcher=launcher, default_tasks=(TASKS,), default_concurrency=2)
    job = make_job("t.ok", {})

    def registered() -> bool:
        pids = {w.pid for w in stats.workers(conn) if w.stopped_at is None}
        return any(e.pid in pids for e in launcher.workers())

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("w")
            await settle(pilot)
            await pilot.press("s")
            await settle(pilot)
            assert isinstance(app.screen, StartWorkerScreen)
            await pilot.press("enter")  # the form comes filled in with the default task modules
            await settle(pilot)
            assert isinstance(app.screen, WorkersScreen)
            [w] = launcher.workers()
            assert w.tasks == (TASKS,) and w.concurrency == 2 and w.running
            await until(pilot, registered, what="the embedded worker's heartbeat")
            await until(pilot, lambda: stats.get_job(conn, job).state == JobState.SUCCEEDED, what="the job to run")
            # a handler that kills its process: the crash is shown, the worker restarts, the UI keeps going
            first_pid = w.pid
            crash = make_job("t.crash", {})
            await until(pilot, lambda: w.crashes >= 1, what="the crash")
            # shown on the workers screen (its exit reloads it), not in a notice over it, nor counted as unseen
            summary = app.screen.query_one("#wk-summary", Static)
            await until(pilot, lambda: "☠ 1 embedded crash(es)" in str(summary.content), what="the crash shown")
            assert "crashed" not in notes(app) and app.crashes_unseen == 0
            # the dead process's lease on the job ended with it, and its row says stopped, not lost
            await until(pilot, lambda: any("ended the leases of 1 jobs" in line for line in w.output), what="leases")
            [dead] = [x for x in stats.workers(conn) if x.pid == first_pid]
            assert dead.stopped_at is not None
            j = stats.get_job(conn, crash)  # its lease ended, or the restarted worker took it back already
            assert j.lease_expirations >= 1 or j.locked_until < dt.datetime.now(dt.timezone.utc), j
            await pilot.press("a", "w")  # still responsive
            # so the restarted worker runs it again at once, alone, and dies again: its last attempt. The
            # next claim dead-letters it without running it (a poison pill)
            await until(pilot, lambda: stats.get_job(conn, crash).state == JobState.DEAD_LETTERED, what="poison pill")
            assert w.crashes == 2
            await until(pilot, lambda: w.running and w.restarts >= 2, what="the restart")
            await until(pilot, registered, what="the restarted worker's heartbeat")
            app.screen.reload()
            await settle(pilot)
            assert app.screen.selected_embedded() is w  # type: ignore[attr-defined]
            await pilot.press("x")
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen) and f"(pid {w.pid})" in app.screen.question
            assert w.running  # asked first
            await pilot.press("y")
            await until(pilot, lambda: not w.running, what="the worker to stop")
            assert w.exit_code == 0 and w.stopping
            assert any("worker starting" in line for line in w.output)
            assert w.log_path is not None and w.log_path.exists()

    run_async(scenario())
    launcher.stop_all(timeout=5)
    assert all(not e.running for e in launcher.workers())


#: a worker that idles until the console stops it (STOP_SIGNAL), then exits 0 as a real one does
IDLE_WORKER = """
import os, signal, sys, time
os.write(int(sys.argv[sys.argv.index("--status-fd") + 1]), b"started\\n")
signal.signal(signal.SIGUSR2, lambda *_: sys.exit(0))
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_an_embedded_worker_started_and_stopped_from_the_console_is_in_the_audit_log(
    dsn: str, conn: db.Conn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # requeue, kill and pause were audited with who did them; a worker started or stopped from the console was not
    from qconsole.widgets.table import LiveTable

    monkeypatch.setenv("SSH_CLIENT", "203.0.113.9 40000 22")
    launcher = EmbeddedWorkers(dsn, command=[sys.executable, "-c", IDLE_WORKER], log_dir=tmp_path)
    app = console(dsn, launcher=launcher, default_tasks=(TASKS,), default_concurrency=3)

    def actions() -> list[str]:
        return [e.action for e in stats.audit_log(conn)]

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "w", WorkersScreen)
            await pilot.press("s")
            await settle(pilot)
            assert isinstance(app.screen, StartWorkerScreen)
            await pilot.press("tab", *"billing,mail", "enter")
            await settle(pilot)
            [w] = launcher.workers()
            await until(pilot, lambda: "ready" in w.output, what="the worker up")
            await until(pilot, lambda: actions() == ["worker_start"], what="the start's audit entry")
            await pilot.press("x", "y")
            await until(pilot, lambda: not w.running, what="the worker to stop")
            await until(pilot, lambda: actions() == ["worker_stop", "worker_start"], what="the stop's audit entry")
            assert w.exit_code == 0 and "audit" not in notes(app)
            # the audit screen says which worker, and what it ran: it read "0 job(s)", and its detail was Python lists
            audit = await opened(pilot, "a", AuditScreen)
            table = audit.query_one(LiveTable)
            rows = [[str(c).strip() for c in table.get_row_at(i)] for i in range(table.row_count)]
            target = f"emb#1 pid {w.pid}"
            assert [r[2:4] for r in rows] == [["worker_stop", target], ["worker_start", target]]
            assert all(r[4].startswith("queues=billing,mail") for r in rows), rows  # clipped at 80 columns
            pane = str(audit.query_one("#audit-detail", Static).content)
            assert "worker_stop by " in pane and "from 203.0.113.9" in pane
            assert f"{target} │ queues=billing,mail concurrency=3 tasks={TASKS} host={w.host}" in pane, pane

    try:
        run_async(scenario())
    finally:
        launcher.stop_all(timeout=5)
    [w] = launcher.workers()
    stop, start = stats.audit_log(conn)
    for e in (start, stop):
        assert (e.os_user, e.ssh_client) == (ops.Actor.current().os_user, "203.0.113.9")
        assert e.queue is None and e.job_ids == []  # two queues: both in the detail
        assert e.detail["number"] == 1 and e.detail["pid"] == w.pid and e.detail["concurrency"] == 3
        assert e.detail["queues"] == ["billing", "mail"] and e.detail["tasks"] == [TASKS]
        assert e.detail["host"] == w.host and ops.TOKEN_KEY in e.detail


def test_an_embedded_worker_starts_and_stops_while_the_database_is_down_and_says_it_is_not_audited(
    dsn: str, tmp_path: Path
) -> None:
    launcher = EmbeddedWorkers(dsn, command=[sys.executable, "-c", IDLE_WORKER], log_dir=tmp_path)
    backend = DatabaseBackend(make_conninfo(dsn, host="127.0.0.1", port=1))
    app = console(dsn, backend=backend, launcher=launcher, default_tasks=(TASKS,))

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "w", WorkersScreen)
            await pilot.press("s")
            await settle(pilot)
            await pilot.press("enter")
            await settle(pilot)
            [w] = launcher.workers()
            await until(pilot, lambda: "ready" in w.output, what="the worker up, though its start is not audited")
            await until(pilot, lambda: "started, but" in notes(app), what="the failed audit said")
            assert "not in the audit log" in notes(app) and "Connection refused" in notes(app)
            await pilot.press("x", "y")
            await until(pilot, lambda: not w.running, what="the worker to stop, though its stop is not audited")
            await until(pilot, lambda: "is stopping, but" in notes(app), what="the failed audit said")
            assert w.exit_code == 0

    try:
        run_async(scenario())
    finally:
        launcher.stop_all(timeout=5)
        backend.close()


#: a worker that crashes as soon as it started: killed by SIGKILL (``--tasks kill``), or by an uncaught exception
#: with a long message (``--tasks raise``); both log a job's retry first, as a busy worker does
CRASHING_WORKER = """
import os, signal, sys
os.write(int(sys.argv[sys.argv.index("--status-fd") + 1]), b"started\\n")
print("23:21:00 WARNING worker_core.worker retry_scheduled (transient error): pdf renderer busy", flush=True)
if sys.argv[sys.argv.index("--tasks") + 1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
raise RuntimeError("cannot open /var/lib/app/state.db: permission denied " + "x" * 200)
"""


def test_a_crashing_embedded_worker_is_counted_in_the_title_bar_not_said_over_the_data(
    dsn: str, tmp_path: Path
) -> None:
    # a notice of 3 rows over the right half of the screen came with each crash (in the demo, two for each poison
    # payload, one per worker), over the figures the console was opened to read. A crash the launcher heals
    # (it restarts the worker) is counted in the title bar until the workers screen shows it; one it does not
    # heal is said, with what the worker said of itself (not a job's log line it happened to write last)
    from textual.widgets._toast import Toast

    launcher = EmbeddedWorkers(dsn, command=[sys.executable, "-c", CRASHING_WORKER], log_dir=tmp_path)
    app = console(dsn, launcher=launcher)
    said: list[str] = []
    real_notify = app.notify

    def notify(message: str, **kwargs: Any) -> None:
        said.append(message)
        real_notify(message, **kwargs)

    app.notify = notify  # type: ignore[method-assign]

    def crash_notices(number: int) -> list[str]:
        return [m for m in said if m.startswith(f"Embedded worker #{number} crashed")]

    async def scenario() -> None:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await settle(pilot)
            killed = launcher.start(["kill"])
            await until(pilot, lambda: app.crashes_unseen >= 3, what="three crashes counted")
            await pilot.pause(0.2)
            n = app.crashes_unseen
            assert f"│ ☠ {n} crashes (w) │ data " in title_of(app)
            assert crash_notices(1) == [] and not list(app.screen.query(Toast))
            await pilot.press("w")
            await settle(pilot)
            assert app.crashes_unseen == 0 and "☠" not in title_of(app)
            launcher.stop(killed.number)
            await pilot.press("o")
            await settle(pilot)
            # one that is not started again needs an operator: said, in a short notice, cut to fit
            launcher.start(["raise"], restart=False)
            await until(pilot, lambda: bool(crash_notices(2)), what="the second worker's crash notice")
            await pilot.pause(0.2)
            first, reason = crash_notices(2)[0].split("\n")
            assert first == "Embedded worker #2 crashed (exit 1), not restarted (w)"
            assert reason.startswith("RuntimeError: cannot open /var/lib/app/state.db: permission denied xxx")
            assert len(reason) == 72 and reason.endswith("…")
            assert not any("pdf renderer" in m for m in said)
            toasts = list(app.screen.query(Toast))  # rare (a worker given up on): its two lines, wrapped at 80 columns
            assert len(toasts) == 1 and toasts[0].outer_size.height <= 7, [t.outer_size for t in toasts]
            assert "☠ 1 crash (w)" in title_of(app)

    try:
        run_async(scenario())
    finally:
        launcher.stop_all(timeout=5)


#: a worker whose job does not stop: it ignores the console's stop
STUBBORN_WORKER = """
import os, signal, sys, time
os.write(int(sys.argv[sys.argv.index("--status-fd") + 1]), b"started\\n")
signal.signal(signal.SIGUSR2, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(120)
"""


def test_quitting_says_at_once_that_it_stops_the_embedded_workers_and_q_again_kills_them(
    dsn: str, tmp_path: Path
) -> None:
    # after q the UI stayed live for seconds (up to 15) with nothing said of what it waited for, and a second q
    # only started another wait
    launcher = EmbeddedWorkers(dsn, command=[sys.executable, "-c", STUBBORN_WORKER], log_dir=tmp_path)
    app = console(dsn, launcher=launcher)
    took: list[float] = []

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            w = launcher.start(["stubborn"])
            await until(pilot, lambda: "ready" in w.output, what="the worker up")
            await pilot.press("q")
            await pilot.pause(0.2)
            assert notes(app) == (
                "Stopping 1 embedded worker: their running jobs finish or are released (up to 15s)."
                " q again: kill them now."
            )
            assert "⟳ quitting…" in title_of(app) and w.running
            await pilot.pause(1.0)
            assert w.running  # it waits for it
            pressed = time.monotonic()
            await pilot.press("q")
            while w.proc is not None and w.proc.poll() is None and time.monotonic() - pressed < 20:
                await asyncio.sleep(0.05)
            took.append(time.monotonic() - pressed)
            while app.return_code is None and time.monotonic() - pressed < 20:
                await asyncio.sleep(0.05)

    try:
        exited = run_as_the_console(scenario(), within=40)
    finally:
        launcher.stop_all(timeout=5)
    assert exited and app.return_code == 0
    assert took and took[0] < 5, f"q again took {took[0]:.1f}s to end the worker"
    assert any("killed" in line for line in launcher.workers()[0].output)


def test_job_types_screen_shows_what_the_workers_registered(dsn: str) -> None:
    from qconsole.screens.contracts import ContractsScreen
    from qconsole.screens.jobs import JobsScreen
    from qconsole.widgets.table import LiveTable

    Worker(WorkerConfig(dsn=dsn, task_modules=(TASKS,), burst=True, poll_interval=0.05)).run()  # registers, exits
    with db.connect(dsn, autocommit=True) as conn:
        ops.set_limit(conn, "t.crash", 1, reason="one crash at a time", actor=ops.Actor("tester"))

    async def scenario() -> None:
        app = console(dsn)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "t", ContractsScreen)
            crash = next(c for c in screen.data.contracts if c.job_type == "t.crash")
            assert crash.fields["max_attempts"] == (2, "type:t.crash")
            assert crash.reason == "tests need fast, bounded retries"
            table = screen.query_one(LiveTable)
            assert table.row_count == len(tests.worker_core.tasks.worker_core.registry.job_types())
            while table.cursor_key != "t.crash":
                await pilot.press("down")
            assert "1" in str(table.get_row("t.crash")[-1])  # its limit
            await pilot.press("enter")  # drill into its jobs
            await settle(pilot)
            assert isinstance(app.screen, JobsScreen)
            assert app.screen.filter.job_type == "t.crash"

    run_async(scenario())


def test_an_audit_reason_reaches_the_screen_without_its_escape_sequences(dsn: str, conn: db.Conn) -> None:
    from textual.widgets import Static

    from qconsole.screens.audit import AuditScreen

    ops.pause(conn, "default", actor=ops.Actor("tester"), reason="INC\x1b]0;pwned\x07-7 \x1b[2J")

    async def scenario() -> None:
        app = console(dsn)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("a")
            await settle(pilot)
            assert isinstance(app.screen, AuditScreen)
            shown = str(app.screen.query_one("#audit-detail", Static).content)
            assert "INC-7" in shown and "\x1b" not in shown and "pwned" not in shown

    run_async(scenario())


def screen_text(app: QConsoleApp) -> str:
    """The screen as a terminal shows it, as plain text (what is left when there is no color)."""
    width, height = app.size
    out = rich.console.Console(
        width=width, height=height, file=io.StringIO(), record=True, legacy_windows=False, safe_box=False
    )
    out.print(app.screen._compositor.render_update(full=True))
    return out.export_text()


def lines_with(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if word in line]


def test_with_no_color_symbols_carry_every_mark(
    dsn: str, conn: db.Conn, make_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README: readable with NO_COLOR, ``▲`` over a threshold, ``⏸`` paused, ``✗`` lost, ``☠`` dead."""
    dead, failed = make_job("t.unknown", {}), make_job("t.permanent", {})
    run_worker_until(dsn, lambda: states(conn, [dead, failed]) == [JobState.DEAD_LETTERED, JobState.FAILED])
    # the worker that ran them died without saying goodbye
    conn.execute("UPDATE workers SET stopped_at = NULL, last_heartbeat_at = now() - interval '5 minutes'")
    waiting = make_job("t.ok", {}, queue="mail")
    conn.execute("UPDATE job_queue SET scheduled_at = now() - interval '5 minutes' WHERE id = %s", (waiting,))
    ops.pause(conn, "mail", actor=ops.Actor("tester"), reason="relay down")
    monkeypatch.setenv("NO_COLOR", "1")
    app = console(dsn)
    assert app.no_color  # Textual took it: a terminal gets the console without color
    shown: dict[str, str] = {}

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            shown["o"] = screen_text(app)
            for key in ("j", "w"):
                await pilot.press(key)
                await settle(pilot)
                shown[key] = screen_text(app)

    run_async(scenario())
    [mail] = [line for line in lines_with(shown["o"], "t.ok") if "mail" in line]
    assert "⏸" in mail and mail.count("▲") == 2, shown["o"]  # the row, and its lag of 5 minutes
    [other] = lines_with(shown["o"], "t.unknown")
    assert "⏸" not in other and "▲" not in other, shown["o"]
    assert "☠ dead" in lines_with(shown["j"], "t.unknown")[0], shown["j"]
    assert "✗ failed" in lines_with(shown["j"], "t.permanent")[0], shown["j"]
    assert len(lines_with(shown["w"], "✗ LOST")) == 1, shown["w"]


def test_the_cursor_stays_in_place_when_its_row_disappears(dsn: str, conn: db.Conn) -> None:
    """Another operator acts on the job under the cursor: it jumped to the top row, where the next `enter`
    opened a job nobody was looking at."""
    from qconsole.screens.jobs import JobsScreen
    from qconsole.widgets.table import LiveTable
    from worker_core.producer import enqueue

    for i in range(6):
        enqueue(conn, "t.ok", {"n": i}, delay_seconds=3600)

    async def scenario() -> None:
        app = console(dsn)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("j")
            await settle(pilot)
            assert isinstance(app.screen, JobsScreen)
            table = app.screen.query_one(LiveTable)
            for _ in range(3):
                await pilot.press("down")
            gone = table.cursor_key
            assert table.cursor_row == 3 and gone is not None
            conn.execute("DELETE FROM job_queue WHERE id = %s", (gone,))
            app.screen.reload()
            await settle(pilot)
            assert table.row_count == 5 and table.cursor_key != gone
            assert table.cursor_row == 3  # where it was, on the next row
            app.screen.set_filter(job_type="t.ok")  # another list: its top, not row 3 of it
            await settle(pilot)
            assert table.row_count == 5 and table.cursor_row == 0

    run_async(scenario())


def test_drilling_into_jobs_shows_the_list_even_where_a_job_detail_was_left_open(dsn: str, conn: db.Conn) -> None:
    """`j`, `enter` on a job, then `t` and `enter` on a type: the jobs mode came back with that old job's
    detail on top, and the type's filter waited unused until Esc."""
    from qconsole.screens.contracts import ContractsScreen
    from qconsole.screens.jobs import JobsScreen
    from qconsole.widgets.table import LiveTable

    Worker(WorkerConfig(dsn=dsn, task_modules=(TASKS,), burst=True, poll_interval=0.05)).run()  # registers
    ops.set_limit(conn, "t.crash", 0, reason="keep it queued", actor=ops.Actor("tester"))
    from worker_core.producer import enqueue

    enqueue(conn, "t.crash", {})
    enqueue(conn, "t.ok", {}, queue="elsewhere", delay_seconds=3600)

    async def scenario() -> None:
        app = console(dsn)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("j")
            await settle(pilot)
            await pilot.press("enter")
            await settle(pilot)
            assert isinstance(app.screen, JobDetailScreen)
            await pilot.press("t")
            await settle(pilot)
            assert isinstance(app.screen, ContractsScreen)
            table = app.screen.query_one(LiveTable)
            while table.cursor_key != "t.crash":
                await pilot.press("down")
            await pilot.press("enter")
            await settle(pilot)
            assert isinstance(app.screen, JobsScreen), app.screen
            assert app.screen.filter.job_type == "t.crash"

    run_async(scenario())


def test_a_screens_key_lands_on_its_list_closing_a_job_detail_on_the_way(dsn: str, conn: db.Conn) -> None:
    # `j` brought back the job detail left open minutes earlier, not the list; on the detail, `j` did nothing
    from qconsole.screens.jobs import JobsScreen

    conn.execute(DEAD_GROUP)

    async def scenario() -> None:
        app = console(dsn)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "j", JobsScreen)
            await opened(pilot, "enter", JobDetailScreen)
            await opened(pilot, "o", OverviewScreen)
            await opened(pilot, "j", JobsScreen)  # the list, not that old detail
            assert len(app.screen_stack) == 1
            await opened(pilot, "enter", JobDetailScreen)
            await opened(pilot, "j", JobsScreen)  # on the detail itself
            dead = await opened(pilot, "d", DeadLettersScreen)
            assert dead.current() is not None
            await opened(pilot, "e", JobDetailScreen)  # a group's sample job
            await opened(pilot, "j", JobsScreen)
            await opened(pilot, "d", DeadLettersScreen)  # its detail closed on the way
            await opened(pilot, "e", JobDetailScreen)
            await opened(pilot, "d", DeadLettersScreen)
            assert len(app.screen_stack) == 1

    run_async(scenario())


def test_slash_then_a_pause_still_types_into_the_search_of_a_list_shown_for_the_first_time(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # seen in the demo: `/` from the dead letters, the jobs list never shown yet, and a second later
    # "invoice": the list's on_mount gave its table the focus after the box got it, and `o` then `c` ran as
    # keys (the charts opened)
    from textual.widgets import Input

    from qconsole.screens.jobs import JobsScreen

    make_job("t.ok", {})
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "d", DeadLettersScreen)
            await pilot.press("slash")
            await asyncio.sleep(1.0)  # a person's pause before typing
            await pilot.pause()
            for ch in "invoice":
                await pilot.press(ch)
            await settle(pilot)
            assert isinstance(app.screen, JobsScreen), app.screen
            assert app.screen.query_one("#f-search", Input).value == "invoice"

    run_async(scenario())


def test_slash_on_a_job_detail_types_into_the_jobs_search_never_into_commands(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # the detail had no `/`: typing `/12aba48e` ran its letters as keys, and `a` opened the audit log (an `r`
    # then a `y` in the text would have requeued the job)
    from textual.widgets import Input

    from qconsole.screens.jobs import JobsScreen
    from qconsole.widgets.table import LiveTable

    wanted = uuid.UUID("12aba48e-0000-4000-8000-00000000d00d")
    conn.execute("UPDATE job_queue SET id = %s WHERE id = %s", (wanted, make_job("t.ok", {})))
    other = make_job("t.ok", {})

    async def scenario() -> None:
        app = console(dsn)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            # first from the overview, the jobs list never shown yet (its on_mount focuses its table)
            await type_fast(pilot, "/12aba")
            assert isinstance(app.screen, JobsScreen), app.screen
            box = app.screen.query_one("#f-search", Input)
            assert box.value == "12aba" and app.screen.focused is box
            await pilot.press("4", "c", "d")  # typed on at a human pace: still the box's
            assert isinstance(app.screen, JobsScreen) and box.value == "12aba4cd"
            await pilot.press("escape")
            # then from a job's detail
            jobs = app.screen
            await opened(pilot, "enter", JobDetailScreen)
            await type_fast(pilot, "/12aba48e")
            assert app.screen is jobs and app.screen.focused is box, app.screen
            assert box.value == "12aba48e"
            await pilot.press("enter")
            await settle(pilot)
            assert jobs.filter.search == "12aba48e"
            assert [j.id for j in jobs.jobs] == [wanted] and jobs.query_one(LiveTable).row_count == 1
            # and on the list itself, its table focused (a paste of `/12aba` there opened the audit log too)
            assert jobs.focused is jobs.query_one(LiveTable)
            await type_fast(pilot, "/12aba4")
            assert app.screen is jobs and box.value == "12aba4"
            assert app.acting == () and "requeue" not in notes(app).lower()

    run_async(scenario())
    assert stats.audit_log(conn) == [] and other


def test_requeue_and_kill_on_a_job_detail_still_ask_first(dsn: str, conn: db.Conn, make_job: Any) -> None:
    # a stray `r` or `K` (typed text landing on the detail) must never act without its `y`
    from qconsole.screens.jobs import JobsScreen

    job = make_job("t.ok", {})

    async def scenario() -> None:
        app = console(dsn)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "j", JobsScreen)
            detail = await opened(pilot, "enter", JobDetailScreen)
            question = await opened(pilot, "K", ConfirmScreen)
            assert "Kill job" in question.question
            await opened(pilot, "n", JobDetailScreen)
            conn.execute("UPDATE job_queue SET state = 'dead_lettered', finished_at = now() WHERE id = %s", (job,))
            detail.reload()
            await settle(pilot)
            question = await opened(pilot, "r", ConfirmScreen)
            assert "Requeue job" in question.question
            await opened(pilot, "escape", JobDetailScreen)
            assert app.acting == ()

    run_async(scenario())
    assert stats.get_job(conn, job).state == JobState.DEAD_LETTERED and stats.audit_log(conn) == []


def test_a_waiting_jobs_detail_names_the_job_that_holds_its_lock_key(dsn: str, conn: db.Conn, make_job: Any) -> None:
    # "why isn't the head of the queue running?": the job waits on its lock_key, which another job holds. The
    # detail looked the lock up by *this* job's id and said "rep:1 (not held now)", the opposite of the truth,
    # at the one moment the operator needs to know who holds it (qconsole job ID said nothing either)
    from qconsole.screens.jobs import JobsScreen

    holder = make_job("t.ok", {"holder": True}, lock_key="rep:1")
    waiter = make_job("t.ok", {"waiter": True}, lock_key="rep:1")
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, started_at = now(), locked_by = 'w1',"
        " locked_until = now() + interval '5 minutes' WHERE id = %s",
        (holder,),
    )
    conn.execute(
        "INSERT INTO resource_locks (lock_key, token, job_id, expires_at)"
        " VALUES ('rep:1', 'tok', %s, now() + interval '5 minutes')",
        (holder,),
    )
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            jobs = await opened(pilot, "j", JobsScreen)
            await pilot.press("n")  # the waiting jobs, head of the queue first: only the waiter
            await settle(pilot)
            assert [j.id for j in jobs.jobs] == [waiter]
            detail = await opened(pilot, "enter", JobDetailScreen)
            assert detail.job_id == waiter
            text = " ".join(screen_text(app).split())
            assert "not held" not in text, text
            assert f"rep:1 held by job {str(holder)[:8]} (t.ok, running) until" in text, text
            assert "(expires in 4m5" in text and "this job waits for it" in text, text
            # the holder's own detail says it holds it
            app.pop_screen()
            await settle(pilot)
            app.push_screen(JobDetailScreen(holder))
            await settle(pilot)
            assert "rep:1 held by this job until" in " ".join(screen_text(app).split())
            # a lease that ran out is free to take, whoever it was
            conn.execute("UPDATE resource_locks SET expires_at = now() - interval '12 seconds'")
            app.screen.reload()  # type: ignore[attr-defined]
            await settle(pilot)
            assert "rep:1: its lease expired 12s ago (free to take)" in " ".join(screen_text(app).split())

    run_async(scenario())


@pytest.mark.parametrize("worker", ["lost", "stopped", "live"])
def test_a_running_jobs_detail_says_its_workers_state_and_who_reclaims_an_expired_lease(
    dsn: str, conn: db.Conn, make_job: Any, worker: str
) -> None:
    # a dead worker's jobs looked healthy: "held by vm:29289:30c326" without a word of that worker being LOST
    # (its heartbeat stale) or stopped, then "another worker may reclaim it", not that only an idle worker
    # takes an expired lease, to run it alone: why a dead worker's backlog drains one job at a time
    beat = {"lost": "2 minutes", "stopped": "3 minutes", "live": "0 seconds"}[worker]
    conn.execute(
        "INSERT INTO workers (id, host, pid, queues, tasks, concurrency, started_at, last_heartbeat_at, stopped_at)"
        " VALUES ('vm:29289:30c326', 'vm', 29289, NULL, '{t.ok}', 4, now() - interval '1 hour',"
        " now() - %(beat)s::interval, CASE WHEN %(stopped)s THEN now() - %(beat)s::interval END)",
        {"beat": beat, "stopped": worker == "stopped"},
    )
    expired = make_job("t.ok", {"n": 1})
    live = make_job("t.ok", {"n": 2})
    for job, lease in ((expired, "-14 seconds"), (live, "2 minutes")):
        conn.execute(
            "UPDATE job_queue SET state = 'running', attempts = 1, started_at = now() - interval '5 minutes',"
            " locked_by = 'vm:29289:30c326', locked_until = now() + %s::interval WHERE id = %s",
            (lease, job),
        )
    app = console(dsn)
    said = {  # as the workers screen says it, and when
        "lost": r"vm:29289:30c326, ✗ LOST since \d\d:\d\d:\d\d UTC \(last heartbeat 2m0\ds ago\)",
        "stopped": r"vm:29289:30c326, ■ stopped 3m0\ds ago",
        "live": r"vm:29289:30c326, ● live",
    }[worker]

    async def scenario() -> None:
        async with app.run_test(size=(160, 30)) as pilot:
            await settle(pilot)
            app.push_screen(JobDetailScreen(expired))
            await settle(pilot)
            text = " ".join(screen_text(app).split())
            assert re.search(rf"EXPIRED 1\ds ago \(held by {said}\): only an idle worker", text), text
            assert "only an idle worker reclaims it, and runs it alone as a suspect (claim_solo" in text, text
            assert "one per idle worker at a time" in text, text
            app.pop_screen()
            await settle(pilot)
            app.push_screen(JobDetailScreen(live))
            await settle(pilot)
            text = " ".join(screen_text(app).split())
            assert re.search(rf"lease ends in 1m5\ds \(\d\d:\d\d:\d\d UTC\), held by {said}", text), text
            assert "EXPIRED" not in text, text

    run_async(scenario())


def test_a_dead_letters_detail_offers_requeue_and_discard_and_x_discards_it_after_asking(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # a dead-lettered job's detail offered "r Requeue  K Kill": K answered "Nothing to kill", and X, the
    # discard the dead letters screen has, did nothing
    dead = make_job("t.ok", {"vat": "bad"})
    running = make_job("t.ok", {"n": 1})
    conn.execute("UPDATE job_queue SET state = 'dead_lettered', attempts = 1, finished_at = now() WHERE id = %s",
                 (dead,))  # fmt: skip
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, started_at = now(), locked_by = 'w1',"
        " locked_until = now() + interval '5 minutes' WHERE id = %s",
        (running,),
    )
    app = console(dsn)

    def keys_offered() -> str:
        return screen_text(app).splitlines()[-2]  # the screen's key line, above the app's

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            app.push_screen(JobDetailScreen(running))
            await settle(pilot)
            offered = keys_offered()
            assert "Kill" in offered and "Requeue" not in offered and "Discard" not in offered, offered
            await pilot.press("X")  # not offered: nothing asked
            await settle(pilot)
            assert isinstance(app.screen, JobDetailScreen)
            app.pop_screen()
            await settle(pilot)
            detail = JobDetailScreen(dead)
            app.push_screen(detail)
            await settle(pilot)
            offered = keys_offered()
            assert "Requeue" in offered and "Discard" in offered and "Kill" not in offered, offered
            await pilot.press("K")  # not offered: nothing asked, nothing said
            await settle(pilot)
            assert app.screen is detail and "Nothing to kill" not in notes(app)
            question = await opened(pilot, "X", ConfirmScreen)
            assert f"Discard job {str(dead)[:8]} (t.ok)?" == question.question
            assert "dead_lettered -> cancelled" in question.details
            await opened(pilot, "n", JobDetailScreen)
            assert stats.get_job(conn, dead).state == JobState.DEAD_LETTERED and stats.audit_log(conn) == []
            await opened(pilot, "X", ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: "Discarded 1 job(s)." in notes(app), what="the discard")
            await settle(pilot)
            offered = keys_offered()
            assert "Requeue" in offered and "Discard" not in offered, offered  # cancelled: only a requeue

    run_async(scenario())
    assert stats.get_job(conn, dead).state == JobState.CANCELLED
    entry = stats.audit_log(conn)[0]
    assert entry.action == "discard" and entry.job_ids == [dead]
    assert entry.os_user == ops.Actor.current().os_user


CONSOLE_PROCESS = """
import sys, time
from pathlib import Path
from qconsole.embedded_workers import EmbeddedWorkers
launcher = EmbeddedWorkers(sys.argv[1], log_dir=Path(sys.argv[2]), shutdown_grace=1.0)
w = launcher.start(["tests.worker_core.tasks"])
print(w.pid, flush=True)
time.sleep(600)
"""


def test_embedded_workers_stop_when_their_console_is_killed(dsn: str, conn: db.Conn, tmp_path: Path) -> None:
    # a console killed outright (SIGKILL, the OOM killer) runs no cleanup: its workers must still stop, not
    # go on claiming with no console to reach them
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(tmp_path / "console.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", CONSOLE_PROCESS, dsn, str(tmp_path)], env=env, stdout=out,
                                stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "console.out").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker_pid = int((tmp_path / "console.out").read_text().split()[0])
        deadline = time.monotonic() + 20
        while not [w for w in stats.workers(conn) if w.pid == worker_pid] and time.monotonic() < deadline:
            time.sleep(0.05)  # it is up: it beat
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 20
        while psutil.pid_exists(worker_pid) and psutil.Process(worker_pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the embedded worker outlived its console"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    [row] = [w for w in stats.workers(conn) if w.pid == worker_pid]
    assert row.stopped_at is not None  # a graceful stop


def test_a_worker_stopped_while_it_was_being_restarted_stays_stopped(dsn: str, tmp_path: Path) -> None:
    # `x` landing between the restart's last check and its new process: the new process forgot the stop
    # (it was reset as the process started) and ran on
    launcher = EmbeddedWorkers(dsn, log_dir=tmp_path, shutdown_grace=1.0,
                               env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        w = launcher.start([TASKS])
        first = w.proc
        assert first is not None
        w.stopping = True  # the stop, as `x` sets it, just before the restart's Popen
        launcher._spawn(w)
        assert w.proc is not first and w.proc is not None
        w.proc.wait(30)  # stopped at once, gracefully
        assert w.stopping
    finally:
        launcher.stop_all()


def test_reads_refused_by_a_lock_timeout_are_stale_data_not_an_unreachable_database(dsn: str, conn: db.Conn) -> None:
    # a DBA's lock_timeout behind a LOCK TABLE: the server answers every read (55P03), yet the console said
    # DATABASE UNREACHABLE, went offline and reconnected on every read
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload) SELECT 't.ok', 'default', '{}' FROM generate_series(1, 3)"
    )
    conn.execute(f"ALTER DATABASE \"{conn.info.dbname}\" SET lock_timeout = '200ms'")
    conn.commit()
    backend = DatabaseBackend(dsn)
    app = console(dsn, backend=backend, refresh_seconds=0.2)
    locker = db.connect(dsn)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            await until(pilot, lambda: screen.selected() is not None, what="rows")
            banner = screen.query_one(OutageBanner)
            locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
            await until(pilot, lambda: banner.display, what="a banner")
            await pilot.pause(1.0)
            seen["said"], seen["db_error"] = str(banner.render()), app.db_error
            locker.rollback()
            await until(pilot, lambda: not banner.display, what="the banner to go")

    try:
        run_async(scenario())
    finally:
        locker.rollback()
        locker.close()
        backend.close()
    assert "READS FAILING" in seen["said"] and "UNREACHABLE" not in seen["said"] and seen["db_error"] is None
