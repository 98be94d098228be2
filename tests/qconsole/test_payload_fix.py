"""``E`` on a dead letter's detail: its payload corrected in the console, then the job requeued with it, audited
with the reason and the payload's diff. Against a real PostgreSQL, driven by keys."""

from __future__ import annotations

from typing import Any

from textual.widgets import Input, Static, TextArea

from qconsole.screens.job_detail import JobDetailScreen
from qconsole.screens.payload_fix import PayloadFixScreen
from tests.qconsole.pilot import run_async, settle, until
from tests.qconsole.test_pilot import console, notes
from worker_core import db, stats
from worker_core.models import JobState

SIZE = (100, 30)


def dead_letter(conn: db.Conn, payload: str) -> Any:
    return conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at, last_error,"
        " error_fingerprint) VALUES ('t.ok', 'default', %s, 'dead_lettered', 5, now(), 'bad VAT id XX1',"
        " 'bad VAT id <*>') RETURNING id",
        (payload,),
    ).fetchone()["id"]


async def open_fix_form(pilot: Any, job_id: Any) -> PayloadFixScreen:
    """The job's detail opened, then ``E``: its payload form."""
    app = pilot.app
    await settle(pilot)
    app.push_screen(JobDetailScreen(job_id))
    await settle(pilot)
    await pilot.press("E")
    await until(pilot, lambda: isinstance(app.screen, PayloadFixScreen), what="the payload form")
    return app.screen


def test_e_fixes_a_dead_letters_payload_and_requeues_it(dsn: str, conn: db.Conn) -> None:
    # a bad payload could be fixed only with `qconsole requeue ID --payload '{...}'`: the JSON copied through a
    # shell, quoted by hand, at 3 a.m.
    job_id = dead_letter(conn, '{"order_id": "ord_1", "vat_id": "XX1"}')
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            form = await open_fix_form(pilot, job_id)
            area = form.query_one("#fix-payload", TextArea)
            assert '"vat_id": "XX1"' in area.text
            error = form.query_one("#fix-error", Static)
            await pilot.press("ctrl+s")  # unchanged: nothing to fix
            await settle(pilot)
            assert app.screen is form and "unchanged" in str(error.render())
            area.move_cursor((0, 0))
            await pilot.press("x")  # not JSON any more
            await pilot.press("ctrl+s")
            await settle(pilot)
            assert app.screen is form and "Not JSON" in str(error.render())
            area.load_text('["not", "an object"]')
            await pilot.press("ctrl+s")
            await settle(pilot)
            assert app.screen is form and "payload must be a JSON object" in str(error.render())
            area.load_text(area.text.replace('["not", "an object"]', '{"order_id": "ord_1", "vat_id": "DE123"}'))
            await pilot.press("tab")
            await pilot.press(*"VAT id corrected")
            await pilot.press("ctrl+s")
            await settle(pilot)
            await until(pilot, lambda: "with its payload fixed" in notes(app), what="the outcome")

    run_async(scenario())
    job = stats.get_job(conn, job_id)
    assert job.state == JobState.QUEUED and job.payload == {"order_id": "ord_1", "vat_id": "DE123"}
    entry = stats.audit_log(conn)[0]
    assert entry.action == "requeue" and entry.reason == "VAT id corrected"
    assert entry.detail["payload_diff"][str(job_id)]  # the diff is kept


def test_e_is_offered_only_for_a_job_a_requeue_takes_and_esc_changes_nothing(dsn: str, conn: db.Conn) -> None:
    job_id = dead_letter(conn, '{"vat_id": "XX1"}')
    waiting = conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload) VALUES ('t.ok', 'default', '{}') RETURNING id"
    ).fetchone()["id"]
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            app.push_screen(JobDetailScreen(waiting))
            await settle(pilot)
            await pilot.press("E")
            await settle(pilot)
            assert isinstance(app.screen, JobDetailScreen)  # a waiting job: nothing to fix and requeue
            app.pop_screen()
            app.push_screen(JobDetailScreen(job_id))
            await settle(pilot)
            await pilot.press("E")
            await until(pilot, lambda: isinstance(app.screen, PayloadFixScreen), what="the payload form")
            await pilot.press("escape")
            await settle(pilot)
            assert isinstance(app.screen, JobDetailScreen)
            assert "Requeue cancelled: nothing changed." in notes(app)

    run_async(scenario())
    assert stats.get_job(conn, job_id).state == JobState.DEAD_LETTERED
    assert stats.audit_log(conn) == []


def test_a_fix_whose_requeue_failed_is_shown_again_with_its_reason(dsn: str, conn: db.Conn) -> None:
    # the requeue behind another session's lock on audit_log fails (TableLocked, after 5 s): the next E showed
    # the fixed payload again, but the reason typed with it was gone
    job_id = dead_letter(conn, '{"order_id": "ord_1", "vat_id": "XX1"}')
    blocker = db.connect(dsn)
    blocker.execute("LOCK TABLE audit_log IN SHARE MODE")  # reads go on, an audit entry waits
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            area = (await open_fix_form(pilot, job_id)).query_one("#fix-payload", TextArea)
            area.load_text(area.text.replace("XX1", "DE123"))
            await pilot.press("tab", *"VAT id corrected", "ctrl+s")
            await until(pilot, lambda: "audit_log" in notes(app), timeout=30, what="the requeue to fail")
            blocker.rollback()
            await pilot.press("E")
            await until(pilot, lambda: isinstance(app.screen, PayloadFixScreen), what="the payload form again")
            form = app.screen
            assert '"vat_id": "DE123"' in form.query_one("#fix-payload", TextArea).text
            assert form.query_one("#fix-reason", Input).value == "VAT id corrected"
            await pilot.press("ctrl+s")
            await until(pilot, lambda: "with its payload fixed" in notes(app), what="the outcome")

    try:
        run_async(scenario())
    finally:
        blocker.close()
    entry = stats.audit_log(conn)[0]
    assert entry.action == "requeue" and entry.reason == "VAT id corrected"
    assert stats.get_job(conn, job_id).payload == {"order_id": "ord_1", "vat_id": "DE123"}
