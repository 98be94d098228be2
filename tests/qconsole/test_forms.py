"""The console's forms (the limit form behind ``l``, the payload editor behind ``E``, the reason in the question)
under what a review found: keys pressed twice, changes made meanwhile, odd input, small screens. Against a real
PostgreSQL, driven by keys."""

from __future__ import annotations

import uuid
from typing import Any

from textual import events
from textual.widgets import Input, Static, TextArea

from qconsole.screens.job_detail import JobDetailScreen
from qconsole.screens.overview import OverviewScreen
from qconsole.screens.payload_fix import PayloadFixScreen
from tests.qconsole.pilot import run_async, settle, until
from tests.qconsole.test_limits_console import detail_line, open_limit_form
from tests.qconsole.test_pilot import console, notes, screen_text
from worker_core import db, ops, stats
from worker_core.models import JobState

WIDE = (160, 30)
SIZE = (100, 30)


def dead_letter(conn: db.Conn, payload: str, queue: str = "default") -> uuid.UUID:
    return conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at, last_error,"
        " error_fingerprint) VALUES ('t.ok', %s, %s, 'dead_lettered', 5, now(), 'bad VAT id XX1',"
        " 'bad VAT id <*>') RETURNING id",
        (queue, payload),
    ).fetchone()["id"]


def limits(conn: db.Conn) -> list[tuple[str, str, int, str]]:
    return [(r["job_type"], r["queue"], r["max_running"], r["source"]) for r in stats.limits(conn)]


def burst(app: Any, *keys: tuple[str, str | None]) -> None:
    """Keys as a fast typist over SSH sends them: all queued before the first is handled."""
    assert app._driver is not None
    for key, char in keys:
        event = events.Key(key, char)
        event.set_sender(app)
        app._driver.send_message(event)


async def open_editor(pilot: Any, app: Any, job_id: uuid.UUID) -> PayloadFixScreen:
    await settle(pilot)
    app.push_screen(JobDetailScreen(job_id))
    await settle(pilot)
    await pilot.press("E")
    await until(pilot, lambda: isinstance(app.screen, PayloadFixScreen), what="the payload form")
    form = app.screen
    assert isinstance(form, PayloadFixScreen)
    return form


# ------------------------------------------------------------------------------------------- the payload editor


def test_deeply_nested_json_pasted_into_the_payload_editor_is_refused_not_a_crash(dsn: str, conn: db.Conn) -> None:
    # json.loads of a deeply nested document raises RecursionError, not ValueError: action_requeue catches only
    # ValueError, and the console (every screen of it, the on-call engineer's only view) died with a traceback
    job_id = dead_letter(conn, '{"vat_id": "XX1"}')
    app = console(dsn)
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            form = await open_editor(pilot, app, job_id)
            form.query_one("#fix-payload", TextArea).load_text('{"a": ' + "[" * 50_000 + "]" * 50_000 + "}")
            await pilot.press("ctrl+s")
            await settle(pilot)
            outcome["screen"] = app.screen
            outcome["error"] = str(form.query_one("#fix-error", Static).render())

    run_async(scenario())
    assert app.return_code in (None, 0), "the console crashed on a deeply nested payload"
    assert isinstance(outcome.get("screen"), PayloadFixScreen), outcome
    assert "Nothing changed" in outcome["error"], outcome
    assert stats.get_job(conn, job_id).state == JobState.DEAD_LETTERED


def test_a_payload_fix_from_1_to_true_is_not_refused_as_unchanged(dsn: str, conn: db.Conn) -> None:
    # the editor compares with Python's ==, where 1 == 1.0 == True: a fix of a flag stored as 1 (a handler that
    # checks `is True`), or of an amount 10 to 10.0, was refused as "The payload is unchanged"
    job_id = dead_letter(conn, '{"send_copy": 1, "order_id": "ord_1"}')
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            form = await open_editor(pilot, app, job_id)
            area = form.query_one("#fix-payload", TextArea)
            area.load_text(area.text.replace('"send_copy": 1', '"send_copy": true'))
            await pilot.press("ctrl+s")
            await settle(pilot)
            if app.screen is form:  # refused: say why
                error = str(form.query_one("#fix-error", Static).render())
                raise AssertionError(error)
            await until(pilot, lambda: "with its payload fixed" in notes(app), what="the outcome")

    run_async(scenario())
    assert stats.get_job(conn, job_id).payload == {"send_copy": True, "order_id": "ord_1"}


def test_the_payload_editor_does_not_overwrite_a_fix_someone_else_made_while_it_was_open(
    dsn: str, conn: db.Conn
) -> None:
    # two on-call engineers: bob fixed the VAT id with `qconsole requeue ID --payload`, the job ran and died
    # again (on something else). alice's editor, opened before, still holds the old payload: her ctrl+s
    # requeued the job with her text over bob's fix, unseen (the editor checks only that the job is
    # requeueable, not that its payload is still the one it showed)
    job_id = dead_letter(conn, '{"vat_id": "XX1", "street": "Main st"}')
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            form = await open_editor(pilot, app, job_id)
            # meanwhile: bob's fix, the run, the job dead again
            ops.requeue(conn, [job_id], payload={"vat_id": "DE999", "street": "Main street 1"}, reason="bob's fix",
                        actor=ops.Actor("bob"))  # fmt: skip
            conn.execute("UPDATE job_queue SET state = 'dead_lettered', finished_at = now() WHERE id = %s", (job_id,))
            area = form.query_one("#fix-payload", TextArea)
            area.load_text(area.text.replace('"XX1"', '"DE123"'))
            await pilot.press("ctrl+s")
            await settle(pilot)
            await until(pilot, lambda: "Not requeued: 1 skipped: its payload changed since it was read" in notes(app),
                        what="the refusal")  # fmt: skip

    run_async(scenario())
    # bob's fix stands (the editor says the payload changed since it opened), or at least it is not silently
    # replaced by a payload made from the one he had already corrected
    assert stats.get_job(conn, job_id).payload == {"vat_id": "DE999", "street": "Main street 1"}


def test_a_failed_requeue_from_the_editor_keeps_the_corrected_payload(dsn: str, conn: db.Conn) -> None:
    # the form is dismissed before the requeue runs: when the requeue fails (the server answers an error, the
    # connection drops), the payload the engineer corrected by hand is gone, and E opens the old one again
    job_id = dead_letter(conn, '{"vat_id": "XX1", "street": "Main st"}')
    conn.execute(
        "CREATE FUNCTION rf_fail() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " RAISE EXCEPTION 'could not extend file: No space left on device'; END $$"
    )
    conn.execute("CREATE TRIGGER rf_fail BEFORE UPDATE ON job_queue FOR EACH ROW EXECUTE FUNCTION rf_fail()")
    app = console(dsn)
    seen: dict[str, str] = {}

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            form = await open_editor(pilot, app, job_id)
            area = form.query_one("#fix-payload", TextArea)
            area.load_text(area.text.replace('"XX1"', '"DE123"').replace('"Main st"', '"Main street 1"'))
            await pilot.press("ctrl+s")
            await settle(pilot)
            await until(pilot, lambda: "No space left" in notes(app), what="the failure")
            conn.execute("DROP TRIGGER rf_fail ON job_queue")
            if isinstance(app.screen, PayloadFixScreen):
                seen["text"] = app.screen.query_one("#fix-payload", TextArea).text
                return
            await pilot.press("E")  # open it again: the corrected payload should still be there
            await until(pilot, lambda: isinstance(app.screen, PayloadFixScreen), what="the payload form")
            seen["text"] = app.screen.query_one("#fix-payload", TextArea).text

    run_async(scenario())
    assert stats.get_job(conn, job_id).state == JobState.DEAD_LETTERED
    assert '"DE123"' in seen["text"] and '"Main street 1"' in seen["text"], seen["text"]


# ----------------------------------------------------------------------------------------------- the limit form


def test_the_limit_form_does_not_silently_undo_a_hold_set_while_it_was_open(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # the form reads the type's limits once, when it opens, and applies what is typed with no second question
    # ("what it applies is exactly what it shows"). Meanwhile bob held the type from the CLI (INC: stop it now);
    # alice's form still says "Now: no limit." and her 5 silently replaced his hold
    make_job("t.ok", {}, queue="billing")
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=WIDE) as pilot:
            await settle(pilot)
            assert isinstance(app.screen, OverviewScreen)
            form = await open_limit_form(pilot)
            assert "Now: no limit." in str(form.query_one("#lim-now", Static).render())
            ops.set_limit(conn, "t.ok", 0, actor=ops.Actor("bob"), reason="INC-9 stop it now")
            await pilot.press("5", "enter")
            await settle(pilot)
            await until(pilot, lambda: "changed since it was read: no limit then, at most 0" in notes(app),
                        what="the refusal")  # fmt: skip

    run_async(scenario())
    assert limits(conn) == [("t.ok", "*", 0, "operator")], "bob's hold was replaced unseen"


def test_enter_twice_in_the_limit_form_applies_once(dsn: str, conn: db.Conn, make_job: Any) -> None:
    make_job("t.ok", {}, queue="billing")
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=WIDE) as pilot:
            await settle(pilot)
            await open_limit_form(pilot)
            burst(app, ("4", "4"), ("enter", "\r"), ("enter", "\r"))
            await settle(pilot)
            await until(pilot, lambda: "at most 4 running" in notes(app), what="the outcome")
            await pilot.pause(0.5)
            await settle(pilot)

    run_async(scenario())
    assert [e.action for e in stats.audit_log(conn)] == ["limit"]


def test_the_limit_form_at_80x24_shows_its_type_fields_and_errors_whatever_the_reasons(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # the "Now:" line gives every limit's reason in full (up to 500 characters each): with two long ones the form
    # outgrows an 80x24 terminal, its title and the type it is for are cut off the top, and at 60x20 the queue
    # and reason fields and the line that says why enter was refused are below the screen: the engineer types
    # into fields, and presses enter on refusals, that are not shown
    make_job("t.ok", {}, queue="billing")
    long = "INC-4242 " + "double charges on retried invoices, see the incident doc " * 8
    ops.set_limit(conn, "t.ok", 0, actor=ops.Actor("alice"), reason=long[:500])
    ops.set_limit(conn, "t.ok", 3, queue="billing", actor=ops.Actor("bob"), reason=("second " + long)[:500])
    shown: dict[str, str] = {}

    async def scenario(size: tuple[int, int]) -> None:
        app = console(dsn)
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            form = await open_limit_form(pilot)
            form.query_one("#lim-queue", Input).value = "bill ing"
            await pilot.press("enter")  # refused: not a queue name
            await settle(pilot)
            shown[f"{size}"] = screen_text(app)

    run_async(scenario((80, 24)))
    run_async(scenario((60, 20)))
    for size, text in shown.items():
        assert "t.ok: at most" in text, f"{size}: the form does not say which type it is for\n{text}"
        assert "Reason (kept in the audit log)" in text, f"{size}: the reason field is off the screen\n{text}"
        assert "is not a queue name" in text, f"{size}: the refusal is off the screen\n{text}"


def test_the_overview_still_says_a_type_is_limited_when_the_limits_reason_is_long(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # before today the detail line said "≤3 running (limit)" always; now it adds who set it and the whole reason,
    # and a part that does not fit is left out: with a reason of a sentence or two, the limit is not said at all
    # (only a held type's mark is cut to fit)
    make_job("t.ok", {}, queue="billing")
    reason = "INC-4242 the PDF service falls over above three concurrent renders, see the runbook"
    ops.set_limit(conn, "t.ok", 3, actor=ops.Actor("alice", "10.0.0.5"), reason=reason)
    line = detail_line(dsn, SIZE)
    assert "≤3 running" in line, line


# ------------------------------------------------------------------------------------------------- the question


def test_enter_twice_in_the_questions_reason_acts_once_and_keeps_the_console(dsn: str, conn: db.Conn) -> None:
    # as in the limit form: the second enter's Input.Submitted reaches the question after its dismiss, and dismiss
    # runs again on a screen no longer shown (the limit form's double enter popped the last screen and the console
    # died with ScreenStackError)
    from qconsole.screens.confirm import ConfirmScreen

    conn.execute("INSERT INTO job_queue (job_type, queue, payload) VALUES ('t.ok', 'billing', '{}')")
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert isinstance(app.screen, OverviewScreen)
            await pilot.press("p")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            await pilot.press("r", *"INC-9")
            burst(app, ("enter", "\r"), ("enter", "\r"))
            await settle(pilot)
            await until(pilot, lambda: "Queue 'billing' paused" in notes(app), what="the outcome")
            await pilot.pause(0.5)
            await settle(pilot)
            assert isinstance(app.screen, OverviewScreen)

    run_async(scenario())
    assert app.return_code in (None, 0)
    assert [(e.action, e.reason) for e in stats.audit_log(conn)] == [("pause", "INC-9")]


# ---------------------------------------------------------------------------------------------------- the audit


def test_the_audit_says_a_payload_fix_old_value_first(dsn: str, conn: db.Conn) -> None:
    # the audit screen prints the diff as a Python dict, keys sorted: "{'vat_id': {'new': 'DE123', 'old': 'XX1'}}"
    # reads new before old, under the job's full id repeated (its target already names it), and a fix of three
    # fields is cut off by the detail's four lines
    from qconsole.screens.audit import detail

    job_id = dead_letter(conn, '{"vat_id": "XX1", "street": "Main st"}')
    ops.requeue(conn, [job_id], payload={"vat_id": "DE123", "street": "Main st"}, reason="VAT id corrected")
    [entry] = stats.audit_log(conn)
    said = detail(entry)
    assert said.index("XX1") < said.index("DE123"), said
    assert str(job_id) not in said, said


def test_the_help_says_what_ctrl_s_does_in_the_payload_editor(dsn: str) -> None:
    # the help lists "l Limit" and "E Fix+requeue", nothing of the question's r (a reason for the audit log), of
    # enter applying the limit form at once (no question after it), nor of ctrl+s in the payload editor
    from qconsole.screens.help import HelpScreen

    app = console(dsn)
    seen: dict[str, str] = {}

    async def scenario() -> None:
        async with app.run_test(size=(120, 200)) as pilot:
            await settle(pilot)
            await pilot.press("question_mark")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help")
            import io

            import rich.console

            out = rich.console.Console(width=120, file=io.StringIO(), record=True)
            out.print(app.screen.query_one(Static).content)
            seen["text"] = out.export_text()

    run_async(scenario())
    text = seen["text"]
    assert "Fix+requeue" in text and "Limit" in text, text  # the help was read
    assert "ctrl+s" in text, text


def test_the_overview_says_held_for_a_type_held_in_every_queue_with_a_queue_limit_too(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    # alice held t.ok everywhere (limit 0 in *); billing also has its own limit 3. Both apply: nothing of t.ok
    # starts. The overview's row says "≤3" and its detail line "≤3 running (limit, set by bob...)", nothing of the
    # hold or of alice; l opens on billing's 3, and clearing it "lifts" a limit while the type stays held
    make_job("t.ok", {}, queue="billing")
    ops.set_limit(conn, "t.ok", 0, actor=ops.Actor("alice"), reason="INC-7")
    ops.set_limit(conn, "t.ok", 3, queue="billing", actor=ops.Actor("bob"), reason="pdf")
    line = detail_line(dsn, WIDE)
    assert "held" in line and "alice" in line, line
