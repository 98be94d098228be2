"""The reason an operator gives in the console's question (``r``), kept in the audit log with the action; and a
key typed before the question showed, which answers nothing. Against a real PostgreSQL, driven by keys."""

from __future__ import annotations

import uuid

from textual import events

from qconsole.screens.confirm import ConfirmScreen
from qconsole.screens.dead_letters import DeadLettersScreen
from qconsole.screens.overview import OverviewScreen
from tests.qconsole.conftest import FakeBackend, fake_app
from tests.qconsole.pilot import opened, run_async, settle, until
from tests.qconsole.test_pilot import SIZE, console, notes
from worker_core import db, stats
from worker_core.models import JobState


def dead_letters(conn: db.Conn, n: int) -> list[uuid.UUID]:
    rows = conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at, last_error,"
        " error_fingerprint) SELECT 't.ok', 'default', '{}', 'dead_lettered', 1, now(), 'bad VAT id',"
        " 'bad VAT id' FROM generate_series(1, %s) RETURNING id",
        (n,),
    ).fetchall()
    return [r["id"] for r in rows]


def test_a_reason_typed_in_the_question_is_in_the_audit_entry(dsn: str, conn: db.Conn) -> None:
    # the console never asked why: `qconsole requeue --reason` kept one, the console's actions none, and the
    # handover read "requeue 3 job(s)" with nothing of the incident it was for
    dead = dead_letters(conn, 3)
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "d", DeadLettersScreen)
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            await pilot.press("r")  # a reason first
            await pilot.press(*"VAT service fixed, INC-42 yes")  # y and n are letters of it, not answers
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("enter")
            await settle(pilot)
            await until(pilot, lambda: "Requeued 3 job(s)" in notes(app), what="the outcome")

    run_async(scenario())
    assert [stats.get_job(conn, i).state for i in dead] == [JobState.QUEUED] * 3
    entry = stats.audit_log(conn)[0]
    assert entry.action == "requeue" and entry.reason == "VAT service fixed, INC-42 yes"


def test_esc_in_the_reason_goes_back_to_the_question_and_y_then_acts_without_one(dsn: str, conn: db.Conn) -> None:
    conn.execute("INSERT INTO job_queue (job_type, queue, payload) VALUES ('t.ok', 'billing', '{}')")
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert isinstance(app.screen, OverviewScreen)
            await pilot.press("p")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            question = app.screen
            await pilot.press("r", *"half typed", "escape")
            await settle(pilot)
            assert app.screen is question and not question.has_class("reasoning")
            await pilot.press("y")
            await settle(pilot)
            await until(pilot, lambda: "Queue 'billing' paused" in notes(app), what="the outcome")

    run_async(scenario())
    entry = stats.audit_log(conn)[0]
    assert entry.action == "pause" and entry.queue == "billing" and entry.reason is None


def test_a_key_typed_before_the_question_showed_answers_nothing() -> None:
    # over a slow link keys arrive in a burst: "Ky" (or a y meant for something else, typed ahead) killed the
    # job before the question that says what a kill does was ever on the screen
    backend = FakeBackend()
    app = fake_app(backend=backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert isinstance(app.screen, OverviewScreen)
            early = events.Key("y", "y")  # stamped now: typed before p was handled
            await pilot.press("p")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            early.set_sender(app)
            app.post_message(early)
            await settle(pilot)
            assert isinstance(app.screen, ConfirmScreen), "the early y answered the question"
            assert not [c for c in backend.calls if c[0] == "set_paused"]
            await pilot.press("y")  # typed once it is shown: answers
            await settle(pilot)
            assert not isinstance(app.screen, ConfirmScreen)
            assert [c for c in backend.calls if c[0] == "set_paused"]

    run_async(scenario())
