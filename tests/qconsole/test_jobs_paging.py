"""The jobs list, page by page (``]`` and ``[``), against a real PostgreSQL: a backlog's middle in reach."""

from __future__ import annotations

from textual.widgets import Input, Static

from qconsole.screens.jobs import LIMIT, JobsScreen
from qconsole.widgets.table import LiveTable
from tests.qconsole.pilot import opened, run_async, settle
from tests.qconsole.test_pilot import SIZE, console, notes
from worker_core import db, stats
from worker_core.producer import enqueue

NEXT, BACK = "right_square_bracket", "left_square_bracket"


def test_next_and_previous_pages_walk_the_whole_list(dsn: str, conn: db.Conn) -> None:
    # the list read the newest 200 only: in a backlog of 450 the 250 oldest, those behind the lag, were out
    # of the console's reach
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, updated_at)"
        " SELECT 't.ok', 'default', '{}', now() - i * interval '1 second' FROM generate_series(1, 450) AS i"
    )
    conn.commit()
    whole = [j.id for j in stats.list_jobs(conn, limit=1000)]
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "j", JobsScreen)
            table = screen.query_one(LiveTable)

            def status() -> str:
                return str(screen.query_one("#jobs-status", Static).content)

            assert [j.id for j in screen.jobs] == whole[:LIMIT] and "] next page" in status()
            table.move_cursor(row=5)
            await pilot.press(NEXT)
            await settle(pilot)
            assert [j.id for j in screen.jobs] == whole[LIMIT : 2 * LIMIT]
            assert f"({LIMIT + 1}-{2 * LIMIT}: [ back, ] next page)" in status()
            assert table.cursor_row == 0  # another page: its top, not row 5 of it
            # new jobs arrive at the head of the list: the page shown stays the one after the page before
            enqueue(conn, "t.ok", {"new": True})
            conn.commit()
            screen.reload()
            await settle(pilot)
            assert [j.id for j in screen.jobs] == whole[LIMIT : 2 * LIMIT]
            await pilot.press(NEXT)
            await settle(pilot)
            assert [j.id for j in screen.jobs] == whole[2 * LIMIT :]
            assert f"({2 * LIMIT + 1}-450: the last; [ back)" in status()
            await pilot.press(NEXT)
            await settle(pilot)
            assert "last page" in notes(app) and [j.id for j in screen.jobs] == whole[2 * LIMIT :]
            await pilot.press(BACK, BACK)
            await settle(pilot)
            assert screen.jobs[0].id != whole[0] and screen.jobs[1].id == whole[0]  # the new job came first
            await pilot.press(BACK)
            await settle(pilot)
            assert "first page" in notes(app)
            # another order is another list: its first page
            await pilot.press(NEXT, "n")
            await settle(pilot)
            assert screen.pages == [] and "next to run first" in status()
            assert [j.id for j in screen.jobs] == [j.id for j in stats.list_jobs(conn, next_first=True, limit=LIMIT)]

    run_async(scenario())


def test_a_search_is_not_paged_and_says_so(dsn: str, conn: db.Conn) -> None:
    ids = [enqueue(conn, "t.ok", {"i": i}).id for i in range(3)]
    conn.commit()
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "j", JobsScreen)
            await pilot.press("slash")
            screen.query_one("#f-search", Input).value = str(ids[0])[:8]
            await pilot.press("enter")
            await settle(pilot)
            assert [j.id for j in screen.jobs] == [ids[0]]
            await pilot.press(NEXT)
            await settle(pilot)
            assert "not pages" in notes(app) and screen.pages == []

    run_async(scenario())
