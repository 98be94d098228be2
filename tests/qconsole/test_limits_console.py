"""A held type (limit 0) lifted, and a limit set, from the console (``l`` on the overview and the job types
list); who paused a queue, or held a type, and why, on the overview's detail line. Against a real PostgreSQL,
driven by keys."""

from __future__ import annotations

from typing import Any

from textual.widgets import Input, Static

from qconsole.screens.contracts import ContractsScreen
from qconsole.screens.limit import LimitScreen
from qconsole.screens.overview import OverviewScreen
from qconsole.widgets.table import LiveTable
from tests.qconsole.pilot import opened, run_async, settle, until
from tests.qconsole.test_pilot import SIZE, console, notes, overview_line
from worker_core import db, ops, stats

WIDE = (160, 30)


def limits(conn: db.Conn) -> list[tuple[str, str, int, str]]:
    return [(r["job_type"], r["queue"], r["max_running"], r["source"]) for r in stats.limits(conn)]


async def open_limit_form(pilot: Any) -> LimitScreen:
    """``l`` on the screen shown, and the limit form it opens."""
    await pilot.press("l")
    await until(pilot, lambda: isinstance(pilot.app.screen, LimitScreen), what="the limit form")
    form = pilot.app.screen
    assert isinstance(form, LimitScreen)
    return form


def detail_line(dsn: str, size: tuple[int, int], row: str = "billing\x1ft.ok") -> str:
    """The overview's detail line of ``row`` (queue, unit separator, type) on a console of ``size``."""
    app = console(dsn)
    seen: dict[str, str] = {}

    async def scenario() -> None:
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            screen.query_one(LiveTable).select_key(row)
            await settle(pilot)
            queue, job_type = row.split("\x1f")
            seen["line"] = overview_line(app, f"{job_type} @ {queue}")

    run_async(scenario())
    return seen["line"]


async def clear(pilot: Any, field: Input) -> None:
    field.focus()
    await pilot.pause()
    await pilot.press("end", *["backspace"] * (len(field.value) + 1))


def test_l_on_the_overview_lifts_a_held_type_and_says_who_held_it(dsn: str, conn: db.Conn, make_job: Any) -> None:
    # a type held with `qconsole limit T 0` could not be let go from the console: the overview said "held
    # (limit 0)", nothing of who held it or why, and the engineer had to find a shell and the CLI
    make_job("t.ok", {}, queue="billing")
    ops.set_limit(conn, "t.ok", 0, actor=ops.Actor("alice", "10.0.0.5"), reason="INC-7 double charges")
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=WIDE) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            screen.query_one(LiveTable).select_key("billing\x1ft.ok")
            await settle(pilot)
            line = overview_line(app, "t.ok @ billing")
            assert "⏸ held (limit 0, set by alice@10.0.0.5" in line and "ago: INC-7 double charges)" in line, line
            form = await open_limit_form(pilot)
            said = str(form.query_one("#lim-now", Static).render())
            assert "≤0 in every queue (set by alice@10.0.0.5" in said and "INC-7 double charges" in said, said
            assert form.query_one("#lim-max", Input).value == "0"
            assert form.query_one("#lim-queue", Input).value == "*"
            await clear(pilot, form.query_one("#lim-max", Input))
            form.query_one("#lim-reason", Input).focus()
            await pilot.press(*"refunds fixed")
            await pilot.press("enter")
            await settle(pilot)
            assert app.screen is screen
            await until(pilot, lambda: "its limit in every queue is lifted" in notes(app), what="the outcome")

    run_async(scenario())
    assert limits(conn) == []
    entry = stats.audit_log(conn)[0]
    assert (entry.action, entry.reason, entry.detail["job_type"]) == ("unlimit", "refunds fixed", "t.ok")


def test_l_sets_a_limit_in_the_rows_queue_and_refuses_what_it_cannot_do(dsn: str, conn: db.Conn, make_job: Any) -> None:
    make_job("t.ok", {}, queue="billing")
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=WIDE) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            form = await open_limit_form(pilot)
            assert "Now: no limit." in str(form.query_one("#lim-now", Static).render())
            await pilot.press("enter")  # empty: lift a limit there is none of
            await settle(pilot)
            assert app.screen is form
            assert "has no limit in every queue: nothing to lift" in str(form.query_one("#lim-error", Static).render())
            await pilot.press("3", "tab")
            await clear(pilot, form.query_one("#lim-queue", Input))
            await pilot.press(*"bill ing", "enter")
            await settle(pilot)
            assert app.screen is form and "is not a queue name" in str(form.query_one("#lim-error", Static).render())
            await clear(pilot, form.query_one("#lim-queue", Input))
            await pilot.press(*"billing", "enter")
            await settle(pilot)
            assert app.screen is screen
            await until(pilot, lambda: "t.ok: at most 3 running in queue 'billing'" in notes(app), what="the outcome")
            screen.reload()
            await settle(pilot)
            line = overview_line(app, "t.ok @ billing")
            assert "≤3 running (limit)" in line and "limit set by " in line, line
            # escape leaves it as it is
            await open_limit_form(pilot)
            assert app.screen.query_one("#lim-queue", Input).value == "billing"  # the row's queue's own limit
            await pilot.press("escape")
            await settle(pilot)
            assert "Limit cancelled: nothing changed." in notes(app)

    run_async(scenario())
    assert limits(conn) == [("t.ok", "billing", 3, "operator")]
    assert [e.action for e in stats.audit_log(conn)] == ["limit"]


def test_l_on_the_job_types_will_not_lift_a_limit_its_task_declares(dsn: str, conn: db.Conn, make_job: Any) -> None:
    # lifted, it came back with the next heartbeat of any worker running the type
    make_job("t.ok", {})
    conn.execute(
        "INSERT INTO concurrency_limits (job_type, queue, max_running, source) VALUES ('t.ok', '*', 2, 'task')"
    )
    conn.execute(
        "INSERT INTO job_type_contracts (job_type, queue, contract, reported_by, reported_at)"
        " VALUES ('t.ok', 'default', '{}', 'h:1', now())"
    )
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=WIDE) as pilot:
            await settle(pilot)
            await opened(pilot, "t", ContractsScreen)
            form = await open_limit_form(pilot)
            assert "≤2 in every queue (declared by its @task)" in str(form.query_one("#lim-now", Static).render())
            await clear(pilot, form.query_one("#lim-max", Input))
            await pilot.press("enter")
            await settle(pilot)
            assert app.screen is form and "@task declares it" in str(form.query_one("#lim-error", Static).render())
            await pilot.press("0", "enter")  # an operator's limit over it: workers leave that alone
            await settle(pilot)
            await until(pilot, lambda: "held: none of them start" in notes(app), what="the outcome")

    run_async(scenario())
    assert limits(conn) == [("t.ok", "*", 0, "operator")]


def test_the_overview_says_who_paused_a_queue_and_why(dsn: str, conn: db.Conn, make_job: Any) -> None:
    # drill: billing found paused at 3 a.m. The overview said "⏸ paused", nothing of who, since when or why, and
    # the engineer resumed it (or did not) blind
    make_job("t.ok", {}, queue="billing")
    ops.pause(conn, "billing", actor=ops.Actor("bob"), reason="INC-9 stop the double charges")

    async def scenario(size: tuple[int, int], said: str) -> None:
        app = console(dsn)
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            line = overview_line(app, "t.ok @ billing")
            assert "⏸ paused " in line and said in line, line

    run_async(scenario(WIDE, " ago by bob: INC-9 stop the double charges"))
    run_async(scenario(SIZE, " ago by bob"))  # cut at 80 columns, not left out
    [q] = [q for q in stats.queues(conn) if q.name == "billing"]
    assert (q.paused, q.changed_by, q.reason) == (True, "bob", "INC-9 stop the double charges")


def test_a_misspelt_queue_in_the_limit_form_is_refused_and_holds_nothing(
    dsn: str, conn: db.Conn, make_job: Any
) -> None:
    make_job("t.ok", {}, queue="billing")
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=WIDE) as pilot:
            await settle(pilot)
            form = await open_limit_form(pilot)
            await pilot.press("0", "tab")
            await clear(pilot, form.query_one("#lim-queue", Input))
            await pilot.press(*"biling", "enter")
            await settle(pilot)
            await until(pilot, lambda: "names queue 'biling': check its spelling" in notes(app), what="the refusal")

    run_async(scenario())
    assert limits(conn) == []
