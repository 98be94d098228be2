"""Screen logic over the fake backend (fixed data, recorded actions): what an operator's keys do."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.errors import QueryCanceled
from rich.text import Text
from textual.widgets import Log

from qconsole.backend import ActionLost
from qconsole.embedded_workers import EmbeddedWorker
from qconsole.messages import DataFetched
from qconsole.screens.confirm import ConfirmScreen
from qconsole.screens.dead_letters import DeadLettersScreen, group_key
from qconsole.screens.workers import WorkersScreen
from qconsole.widgets.table import LiveTable
from tests.qconsole.conftest import FakeBackend, FakeLauncher, fake_app
from tests.qconsole.pilot import opened, run_async, settle, until
from worker_core.models import ActionResult, DeadLetterGroup, DeadLetterGroups

SIZE = (80, 24)


def test_the_output_pane_follows_an_embedded_workers_output_as_it_grows() -> None:
    # Log.write_lines follows only a log at its end, and after clear() none was: once opened on a short
    # output, the pane stayed on old lines, and the crash's last words were never in view
    launcher = FakeLauncher()
    w = launcher.workers()[0]
    for i in range(30):
        w.output.append(f"early line {i}")
    app = fake_app(launcher=launcher)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("w")
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, WorkersScreen) and screen.selected_embedded() is w
            for i in range(150):
                w.output.append(f"later line {i}")
            w.output.append("[exited with code 13: crashed]")
            screen._paint_log()
            await settle(pilot)
            log = screen.query_one("#wk-log", Log)
            assert log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y
            # read up: a new line does not take the reader back down
            log.scroll_to(y=0, animate=False, immediate=True)
            w.output.append("one more")
            screen._paint_log()
            await settle(pilot)
            assert log.scroll_y == 0

    run_async(scenario())


def test_x_asks_before_it_stops_an_embedded_worker_and_says_what_stopping_does() -> None:
    # x stopped the worker under the cursor at once: one key from a worker running a night's jobs, asked nothing,
    # where every other action that changes what runs asks first
    launcher = FakeLauncher()
    launcher.shutdown_grace = 5.0  # type: ignore[attr-defined]  # the real launcher's (EmbeddedWorkers)
    app = fake_app(launcher=launcher)
    assert ("x", "Stop embedded") in [(b.key, b.description) for b in WorkersScreen.BINDINGS]  # type: ignore[union-attr]

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "w", WorkersScreen)
            assert screen.selected_embedded() is launcher.workers()[0]
            for no in ("n", "escape"):
                await pilot.press("x")
                await settle(pilot)
                question = app.screen
                assert isinstance(question, ConfirmScreen)
                assert question.question == "Stop embedded worker #1 (pid 4121)?"
                assert "stops claiming jobs" in question.details and "5s to finish" in question.details
                assert "back to the queue" in question.details and "not restarted" in question.details
                await pilot.press(no)
                await settle(pilot)
                assert app.screen is screen and launcher.stopped == []
            await pilot.press("x")
            await settle(pilot)
            await pilot.press("y")
            await settle(pilot)
            assert app.screen is screen and launcher.stopped == [1]
            # a crashed worker waiting to be started again: x cancels its restart, after asking too
            await pilot.press("down", "x")
            await settle(pilot)
            question = app.screen
            assert isinstance(question, ConfirmScreen)
            assert question.question == "Cancel the restart of embedded worker #2 (pid 4188)?"
            await pilot.press("n")
            await settle(pilot)
            assert launcher.stopped == [1]
            await pilot.press("x", "y")
            await settle(pilot)
            assert launcher.stopped == [1, 2]

    run_async(scenario())


class AuditedBackend(FakeBackend):
    """Records the audit entries of the embedded workers started and stopped, or fails to write them."""

    def __init__(self, fail: BaseException | None = None) -> None:
        super().__init__()
        self.fail = fail
        self.audited: list[tuple[str, dict[str, Any]]] = []

    def audit_worker(self, action: str, **fields: Any) -> ActionResult:
        self.audited.append((action, fields))
        if self.fail is not None:
            raise self.fail
        return ActionResult(action, 1, [], [], audit_id=7)


class StartingLauncher(FakeLauncher):
    """A worker it starts is running (a process of its own, as far as the console can tell)."""

    def start(self, *args: Any, **kwargs: Any) -> EmbeddedWorker:
        w = super().start(*args, **kwargs)
        w.proc = object()  # type: ignore[assignment]
        return w


def notes(app: Any) -> str:
    return "\n".join(n.message for n in app._notifications)


def test_starting_and_stopping_an_embedded_worker_is_audited() -> None:
    # requeue, kill and pause were in the audit log with who did them; a worker started or stopped from the
    # console was nowhere
    launcher = StartingLauncher()
    backend = AuditedBackend()
    app = fake_app(backend, launcher=launcher)
    worker = {"host": "web-1", "queues": [], "concurrency": 4, "tasks": ["qconsole.demo"], "restart_cancelled": False}

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "w", WorkersScreen)
            await pilot.press("s")
            await settle(pilot)
            await pilot.press("enter")  # the form's defaults: qconsole.demo, every queue, 4 slots
            await settle(pilot)
            assert launcher.started == [(("qconsole.demo",), (), 4)]
            assert backend.audited == [("worker_start", {"number": 3, "pid": 5000, **worker})]
            await pilot.press("x", "n")  # asked, and left running: nothing to audit
            await settle(pilot)
            assert launcher.stopped == [] and len(backend.audited) == 1
            await pilot.press("x", "y")
            await settle(pilot)
            assert launcher.stopped == [3]
            assert backend.audited[1:] == [("worker_stop", {"number": 3, "pid": 5000, **worker})]
            # a crashed worker's restart cancelled is a stop too
            app.screen.query_one(LiveTable).select_key("emb:2")
            await pilot.press("x", "y")
            await settle(pilot)
            assert launcher.stopped == [3, 2]
            assert backend.audited[2:] == [("worker_stop", {
                "number": 2, "pid": 4188, "host": "web-1", "queues": ["media"], "concurrency": 2,
                "tasks": ["qconsole.demo"], "restart_cancelled": True})]  # fmt: skip
            assert "audit" not in notes(app)  # written: nothing more to say

    run_async(scenario())


@pytest.mark.parametrize(
    "lost, said",
    [
        (ActionLost(psycopg.OperationalError("connection refused"), committed=False), "not in the audit log"),
        (psycopg.errors.InsufficientPrivilege("permission denied for table audit_log"), "not in the audit log"),
        (ActionLost(psycopg.OperationalError("server closed the connection"), committed=None), "check the audit log"),
    ],
    ids=["database-down", "refused", "connection-lost"],
)
def test_a_worker_starts_and_stops_though_its_audit_entry_cannot_be_written(lost: BaseException, said: str) -> None:
    launcher = StartingLauncher()
    app = fake_app(AuditedBackend(fail=lost), launcher=launcher)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "w", WorkersScreen)
            await pilot.press("s")
            await settle(pilot)
            await pilot.press("enter")
            await settle(pilot)
            assert len(launcher.started) == 1
            await until(pilot, lambda: "#3 (pid 5000) started" in notes(app), what="the failed audit said")
            start_note = next(n for n in app._notifications if "started, but" in n.message)
            assert said in start_note.message and start_note.severity == "error"
            await pilot.press("x", "y")
            await settle(pilot)
            assert launcher.stopped == [3]
            await until(pilot, lambda: "#3 (pid 5000) is stopping, but" in notes(app), what="the failed audit said")
            assert said in notes(app).split("is stopping, but")[1]

    run_async(scenario())


class SlowGroupJobs(FakeBackend):
    """Fetching a group's jobs takes a while, as over a slow link or for a large group."""

    def group_job_ids(self, group: DeadLetterGroup) -> list[uuid.UUID]:
        time.sleep(0.5)
        return super().group_job_ids(group)


def test_a_second_r_while_the_groups_jobs_are_fetched_asks_nothing_more() -> None:
    # two questions stacked, and two requeues of the same jobs: a fast-failing group ran once more
    backend = SlowGroupJobs()
    app = fake_app(backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("d")
            await settle(pilot)
            await pilot.press("r", "r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            await pilot.press("y")
            await settle(pilot)
            await pilot.pause(0.7)  # a second question would be up by now
            await settle(pilot)
            assert not isinstance(app.screen, ConfirmScreen)

    run_async(scenario())
    assert [name for name, _ in backend.calls if name == "requeue"] == ["requeue"]


class VanishingGroups(FakeBackend):
    """Groups named in ``gone`` were acted on elsewhere (the CLI, another console)."""

    def __init__(self) -> None:
        super().__init__()
        self.gone: set[str] = set()

    def dead_letter_groups(self) -> list[DeadLetterGroup]:
        return [g for g in super().dead_letter_groups() if group_key(g) not in self.gone]


def test_marks_that_vanish_on_refresh_never_hand_the_action_to_the_cursors_group() -> None:
    backend = VanishingGroups()
    app = fake_app(backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            marked = screen.current()
            assert marked is not None
            await pilot.press("space")  # marks it, the cursor moves down to read the next
            assert screen.marked == {group_key(marked)}
            backend.gone.add(group_key(marked))  # requeued from the CLI meanwhile
            screen.reload()
            await settle(pilot)
            assert screen.marked == set() and screen.current() is not None
            await pilot.press("r")
            await settle(pilot)
            assert not isinstance(app.screen, ConfirmScreen)  # before: "Requeue 2 job(s)" of the cursor's group
            await pilot.press("space", "r")  # marking again: the operator chose
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")

    run_async(scenario())
    assert not [name for name, _ in backend.calls if name == "requeue"]


def test_the_overviews_wait_column_counts_the_queued_jobs_and_rtry_the_retrying_ones() -> None:
    # "wait" was queued + retry_scheduled next to "rtry": 41 + 12 read as 53 + 12 (the CLI said queued 41)
    from qconsole.screens.overview import OverviewScreen

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            row = screen.query_one(LiveTable).get_row("default\x1femail.send")
            assert (str(row[3]).strip(), str(row[5]).strip()) == ("41", "12")

    run_async(scenario())


# ------------------------------------------------------------------ enter while a refresh lands


def test_enter_on_a_job_opens_that_job_even_if_a_refresh_moves_the_cursor_before_it_is_handled() -> None:
    # the refresh's result, posted by the read thread, reached the screen between enter and its handling: the
    # job left the list (killed by another operator), the cursor stayed at its place, on the next job, and
    # the handler opened that one, which the operator never chose
    from qconsole.screens.job_detail import JobDetailScreen
    from qconsole.screens.jobs import JobsScreen

    app = fake_app()
    seen: dict[str, uuid.UUID] = {}

    async def scenario() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "j", JobsScreen)
            table = screen.query_one(LiveTable)
            await pilot.press("down", "down")
            assert table.cursor_key is not None
            seen["pressed_on"] = target = uuid.UUID(table.cursor_key)
            table.action_select_cursor()  # what enter does: posts RowSelected naming the row
            screen.post_message(DataFetched((screen.filter, 0, [j for j in screen.jobs if j.id != target], None)))
            await settle(pilot)
            assert table.cursor_key is not None and uuid.UUID(table.cursor_key) != target  # the cursor moved
            detail = app.screen
            assert isinstance(detail, JobDetailScreen)
            seen["opened"] = detail.job_id

    run_async(scenario())
    assert seen["opened"] == seen["pressed_on"]


def test_enter_on_an_overview_row_gone_in_a_refresh_before_it_is_handled_opens_nothing_and_says_so() -> None:
    import dataclasses

    from qconsole.backend import OverviewData
    from qconsole.screens.jobs import JobsScreen
    from qconsole.screens.overview import OverviewScreen, row_key

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen) and screen.data is not None
            table = screen.query_one(LiveTable)
            await pilot.press("down")
            target = table.cursor_key
            data = screen.data
            left = [t for t in data.overview.types if row_key(t) != target]
            table.action_select_cursor()
            screen.post_message(DataFetched(OverviewData(dataclasses.replace(data.overview, types=left), data.lag)))
            await settle(pilot)
            assert table.cursor_key not in (None, target)  # on another row, which was not chosen
            assert app.screen is screen and app.current_mode == "overview"
            assert not any(isinstance(s, JobsScreen) for s in app.screen_stack)
            assert "That row is gone" in "\n".join(n.message for n in app._notifications)

    run_async(scenario())


def test_enter_on_a_dead_letter_group_gone_in_a_refresh_before_it_is_handled_opens_nothing_and_says_so() -> None:
    from qconsole.screens.job_detail import JobDetailScreen

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            table = screen.query_one(LiveTable)
            target = table.cursor_key
            left = DeadLetterGroups([g for g in screen.groups if group_key(g) != target])
            table.action_select_cursor()
            screen.post_message(DataFetched(left))  # its jobs were requeued from the CLI meanwhile
            await settle(pilot)
            assert table.cursor_key not in (None, target)
            assert app.screen is screen and not isinstance(app.screen, JobDetailScreen)
            assert "That group is gone" in "\n".join(n.message for n in app._notifications)

    run_async(scenario())


# ------------------------------------------------------------------ reads the database answers with an error


@pytest.mark.parametrize(
    ("key", "kind"),
    [("o", "OverviewScreen"), ("d", "DeadLettersScreen"), ("c", "ChartsScreen"), ("w", "WorkersScreen"),
     ("a", "AuditScreen"), ("t", "ContractsScreen"), ("j", "JobsScreen")],
)  # fmt: skip
def test_a_screen_whose_reads_the_database_refuses_says_its_data_is_stale_until_a_read_succeeds(
    key: str, kind: str
) -> None:
    # a statement timeout (behind a LOCK TABLE, say) was a toast for 8 s, then the old figures looked live
    from qconsole.widgets.chrome import OutageBanner

    backend = FakeBackend()
    app = fake_app(backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press(key)
            await settle(pilot)
            screen = app.screen
            assert type(screen).__name__ == kind
            banner = screen.query_one(OutageBanner)
            assert not banner.display
            read_at = screen.data_at  # type: ignore[attr-defined]
            backend.refuse_reads = True
            app.clock.advance(42)  # type: ignore[attr-defined]
            await pilot.press("ctrl+r")
            await settle(pilot)
            app.clock.advance(600)  # type: ignore[attr-defined]  # long past the toast: the mark stays
            await pilot.pause(1.2)  # the banner's tick: the age grows
            said = str(banner.render())
            assert banner.display and banner.has_class("-stale") and not banner.has_class("-shown")
            assert "READS FAILING" in said and "statement timeout" in said
            assert f"data from {read_at:%H:%M:%S} UTC (10m42s ago)" in said, said
            assert app.db_error is None  # not an outage: the database answered
            backend.refuse_reads = False
            await pilot.press("ctrl+r")
            await settle(pilot)
            assert not banner.display and not banner.has_class("-stale")

    run_async(scenario())


# ------------------------------------------------------------------ an action's outcome


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (psycopg.OperationalError("server closed the connection unexpectedly"),
         "requeue: outcome unknown (the connection was lost): check the audit log (a) before acting again."),
        (QueryCanceled("canceling statement due to statement timeout"),
         "requeue failed, nothing changed: QueryCanceled: canceling statement due to statement timeout"),
    ],
    ids=["connection-lost", "server-refused"],
)  # fmt: skip
def test_an_actions_failure_says_nothing_changed_only_where_the_server_answered(error: Exception, said: str) -> None:
    # a connection that died may have taken the answer to a COMMIT with it: "failed, nothing changed" was said
    # of requeues that had committed (a backend that cannot tell which says it does not know)
    class Failing(FakeBackend):
        def requeue(self, job_ids: Any, reason: str | None = None, groups: Any = None) -> Any:
            raise error

    app = fake_app(Failing())

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await opened(pilot, "d", DeadLettersScreen)
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            await pilot.press("y")
            await until(pilot, lambda: app.acting == (), what="the requeue to end")
            notes = "\n".join(n.message for n in app._notifications)
            assert said in notes, notes
            if "unknown" in said:
                assert "nothing changed" not in notes

    run_async(scenario())


def test_an_action_found_committed_after_its_answer_was_lost_clears_its_marks() -> None:
    # said "done (audit #7)" but its groups stayed marked: the next r requeued them again
    class LostButCommitted(FakeBackend):
        def requeue(self, job_ids: Any, reason: str | None = None, groups: Any = None) -> Any:
            self.calls.append(("requeue", list(job_ids)))
            lost = psycopg.OperationalError("server closed the connection unexpectedly")
            raise ActionLost(lost, committed=True, audit_id=7, changed=len(job_ids))

    app = fake_app(LostButCommitted())

    async def scenario() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            await pilot.press("space")
            await settle(pilot)
            assert screen.marked
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            await pilot.press("y")
            await until(pilot, lambda: app.acting == (), what="the requeue to end")
            await settle(pilot)
            assert "requeue done (audit #7" in "\n".join(n.message for n in app._notifications)
            assert screen.marked == set()

    run_async(scenario())


# ------------------------------------------------------------------ jobs: a search under filters


def test_a_search_that_finds_nothing_under_the_filters_says_what_they_hide_and_x_clears_them(
    dsn: str, conn: Any, make_job: Any
) -> None:
    # a running job's id pasted with state "dead" set said "0 job(s) │ state=dead_lettered search=…", and
    # nothing hinted that the filter hid it
    from qconsole.backend import DatabaseBackend
    from qconsole.screens.jobs import JobsScreen
    from tests.qconsole.test_pilot import console

    running = make_job("t.ok", {})
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, started_at = now(), locked_by = 'w-1',"
        " locked_until = now() + interval '1 minute' WHERE id = %s",
        (running,),
    )
    backend = DatabaseBackend(dsn)
    app = console(dsn, backend=backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "j", JobsScreen)
            status = screen.query_one("#jobs-status")
            screen.set_filter(state="dead_lettered", search=str(running)[:8])
            await settle(pilot)
            shown = str(status.content)
            assert "0 job(s)" in shown and "1 job matches outside the filters (▶ running): x clears them" in shown
            screen.set_filter(state="dead_lettered", search="no-such-key")
            await settle(pilot)
            assert "no job matches, with or without the filters" in str(status.content)
            screen.set_filter(state="dead_lettered", job_type="t.ok", search=str(running)[:8])
            await settle(pilot)
            await pilot.press("x")
            await settle(pilot)
            assert screen.filter.state is None and screen.filter.job_type is None
            assert screen.filter.search == str(running)[:8] and [j.id for j in screen.jobs] == [running]
            assert "1 job(s)" in str(status.content) and "outside" not in str(status.content)

    run_async(scenario())
    backend.close()


def test_the_focused_filter_control_is_plain_to_see() -> None:
    # the compact Select's focus only tinted its background 5% (color 234 -> 235): nobody saw where tab went
    from textual.color import Color
    from textual.widgets import Select

    from qconsole.screens.jobs import JobsScreen

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "j", JobsScreen)
            select = screen.query_one("#f-state", Select)
            x, y = select.region.x + 2, select.region.y

            def background() -> Color:
                style = screen.get_style_at(x, y)
                assert style.bgcolor is not None
                return Color.from_rich_color(style.bgcolor)

            blurred = background()
            select.focus()
            await settle(pilot)
            focused = background()
            assert abs(focused.brightness - blurred.brightness) > 0.1 or focused.hsl.s - blurred.hsl.s > 0.3

    run_async(scenario())


# ------------------------------------------------------------------ workers


def test_the_workers_screen_shows_running_workers_above_stopped_ones_and_says_what_claimed_counts(
    dsn: str, conn: Any
) -> None:
    # rows went by host and pid: a live worker sat below ten "■ stopped" rows, out of sight at 80x24; and its
    # "busy 9" next to "slots 4" said nothing of the prefetched jobs it counted
    from qconsole.backend import DatabaseBackend
    from tests.qconsole.test_pilot import console

    for i in range(12):
        conn.execute(
            "INSERT INTO workers (id, host, pid, concurrency, stopped_at) VALUES (%s, 'a', %s, 4, now())", (f"a:{i}", i)
        )
    conn.execute("INSERT INTO workers (id, host, pid, concurrency, in_flight) VALUES ('z:7', 'z', 7, 4, 9)")
    backend = DatabaseBackend(dsn)
    app = console(dsn, backend=backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "w", WorkersScreen)
            table = screen.query_one(LiveTable)
            first = [str(c).strip() for c in table.get_row_at(0)]
            assert first[1] == "● live" and first[2] == "z:7" and first[4:6] == ["4", "9"]
            headers = [str(c.label).strip() for c in table.columns.values()]
            assert "claimed" in headers and "busy" not in headers
            assert "prefetched" in str(screen.query_one("#wk-summary").content)
            assert "prefetch" in WorkersScreen.HELP

    run_async(scenario())
    backend.close()


# ------------------------------------------------------------------ charts

LONG_TYPE = "com.example.platform.billing.payments.providers.stripe.webhooks.pay.capture"


class LongTypeCharts(FakeBackend):
    def charts(self) -> Any:
        data = super().charts()
        data.retries[LONG_TYPE] = [3.0] * 60
        return data


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_a_long_job_type_is_cut_in_the_middle_and_every_chart_keeps_its_legend(size: tuple[int, int]) -> None:
    # plotext drops the whole legend when one label is wider than its canvas: a 72-character job type hid
    # the names of every series of "Retries per job type", even at 120x40
    from qconsole.screens.charts import ChartsScreen
    from qconsole.widgets.charts import SeriesChart
    from tests.qconsole.test_pilot import screen_text

    assert len(LONG_TYPE) > 70
    app = fake_app(LongTypeCharts())

    async def scenario() -> None:
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "c", ChartsScreen)
            text = screen_text(app)
            [legend] = [line for line in text.splitlines() if "pay.capture" in line]  # the retries chart's
            assert "com.exa" in legend and "…" in legend and "email.send" in text
            assert "default" in text and "mail" in text  # the lag chart's
            for chart in screen.query(SeriesChart):
                assert chart.size.height > 0

    run_async(scenario())


# ------------------------------------------------------------------ overview


def test_the_overviews_two_waits_have_different_names() -> None:
    # the table's "lag 16s" (the type's oldest waiting job) sat above the sparkline's "lag (s) … now 50s" (the
    # queue's average wait before start): two numbers named alike that disagreed
    from qconsole.screens.overview import OverviewScreen
    from tests.qconsole.test_pilot import screen_text

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            text = screen_text(app)
            assert "lag (s)" not in text and "wait to start (s)" in text
            headers = [str(c.label).strip() for c in screen.query_one(LiveTable).columns.values()]
            assert "lag" in headers and "oldest" in OverviewScreen.HELP

    run_async(scenario())


# ------------------------------------------------------------------ a type held by a limit of 0


def test_a_type_held_by_a_limit_of_0_is_marked_and_its_expired_leases_are_not_said_to_be_reclaimed(
    dsn: str, conn: Any, make_job: Any
) -> None:
    # `qconsole limit TYPE 0` showed nowhere on the overview ("run 1" with no worker), and the job's detail
    # said "lease EXPIRED … another worker may reclaim it", which none does under a limit of 0
    from qconsole.backend import DatabaseBackend
    from qconsole.screens.job_detail import JobDetailScreen
    from qconsole.screens.overview import OverviewScreen
    from tests.qconsole.test_pilot import console, screen_text
    from worker_core import ops

    held = make_job("t.ok", {})
    make_job("t.permanent", {})
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, started_at = now() - interval '2 minutes',"
        " locked_by = 'w-1', locked_until = now() - interval '68 seconds' WHERE id = %s",
        (held,),
    )
    ops.set_limit(conn, "t.ok", 0, actor=ops.Actor("test"))
    ops.set_limit(conn, "t.permanent", 3, actor=ops.Actor("test"))
    backend = DatabaseBackend(dsn)
    app = console(dsn, backend=backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            table = screen.query_one(LiveTable)
            assert str(table.get_row("default\x1ft.ok")[2]).strip() == "t.ok ⏸0"
            # limited, not held: no live worker runs it, which its ∅ says (a limit of 0 says why t.ok waits)
            assert str(table.get_row("default\x1ft.permanent")[2]).strip() == "t.permanent ≤3 ∅"
            assert "⏸0 held by limit 0: t.ok" in str(screen.query_one("#ov-summary").content)
            table.select_key("default\x1ft.ok")
            await settle(pilot)
            assert "⏸ held (limit 0, set by " in screen_text(app)
            app.push_screen(JobDetailScreen(held))
            await settle(pilot)
            text = " ".join(screen_text(app).split())
            assert "EXPIRED" in text and "held by a limit of 0" in text and "may reclaim" not in text

    run_async(scenario())
    backend.close()


# ------------------------------------------------------------------ audit


def test_the_audit_screen_names_a_limits_type_and_hides_the_consoles_token(dsn: str, conn: Any, make_job: Any) -> None:
    # a limit's target read "0 job(s)" (it has no jobs: its type and queue are in its detail), and the
    # console's internal console_token=… filled the detail column
    from qconsole.backend import DatabaseBackend
    from qconsole.screens.audit import AuditScreen
    from tests.qconsole.test_pilot import console, screen_text
    from worker_core import ops

    job = make_job("t.ok", {})
    conn.execute("UPDATE job_queue SET state = 'dead_lettered', finished_at = now() WHERE id = %s", (job,))
    actor = ops.Actor("alice")
    ops.set_limit(conn, "t.ok", 0, actor=actor)
    ops.set_limit(conn, "t.ok", 2, queue="default", actor=actor)
    ops.clear_limit(conn, "t.ok", actor=actor)
    ops.requeue(conn, [job], actor=actor, token="tok-5f2c9a1e77")
    backend = DatabaseBackend(dsn)
    app = console(dsn, backend=backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "a", AuditScreen)
            table = screen.query_one(LiveTable)
            rows = [[str(c).strip() for c in table.get_row_at(i)] for i in range(table.row_count)]
            assert [(r[2], r[3]) for r in rows] == [
                ("requeue", "1 job(s)"), ("unlimit", "type t.ok"), ("limit", "type t.ok @default"),
                ("limit", "type t.ok"),
            ]  # fmt: skip
            assert rows[3][4] == "max_running=0"
            screen.query_one(LiveTable).move_cursor(row=0)
            await settle(pilot)
            assert "tok-5f2c" not in screen_text(app) and "console_token" not in screen_text(app)
            assert screen.entries[0].detail["console_token"] == "tok-5f2c9a1e77"  # kept in the row

    run_async(scenario())
    backend.close()


@pytest.mark.parametrize("size", [(80, 24), (120, 36)], ids=["80x24", "120x36"])
def test_the_overviews_detail_line_puts_its_warnings_first_and_is_never_cut(size: tuple[int, int]) -> None:
    # at 80x24 the line ended "… │ lock w…": the timings and "▲ dlq over" never showed; at 120, "latency 2.2s…"
    from qconsole.screens.overview import OverviewScreen
    from tests.qconsole.test_pilot import screen_text

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            [line] = [x for x in screen_text(app).splitlines() if "email.send @ default" in x]
            assert "…" not in line and len(line.rstrip()) <= size[0]
            fields = [f.strip() for f in line.split("│")]
            assert fields[1:3] == ["▲ lag over 1m00s", "▲ dlq over 0.5/m"]
            assert "wait to start 42s" in fields
            if size[0] >= 120:
                assert "handler 350ms" in fields and "retries 6.1/m" in fields

    run_async(scenario())


def test_the_overviews_detail_line_tells_dedup_hits_from_idempotency_hits() -> None:
    # "dedup 6" added a producer's dedup hits (4) to the jobs settled by their idempotency key (2), where
    # `qconsole stats --json` has them apart
    from qconsole.screens.overview import OverviewScreen
    from tests.qconsole.test_pilot import screen_text

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            table = screen.query_one(LiveTable)
            table.move_cursor(row=table.get_row_index("default\x1finvoice.generate"))
            await settle(pilot)
            [line] = [x for x in screen_text(app).splitlines() if "invoice.generate @ default" in x]
            fields = [f.strip() for f in line.split("│")]
            assert "dedup hits 4" in fields and "idempotency hits 2" in fields, line

    run_async(scenario())


class LookAlikeGroups(FakeBackend):
    def dead_letter_groups(self) -> Any:
        def group(country: str, n: int) -> DeadLetterGroup:
            fingerprint = f"PermanentError: invalid VAT identifier <*> for the customer's country {country}"
            return DeadLetterGroup("invoice.generate", fingerprint, fingerprint, n, None, None, [], "failed")

        smtp = "TransientError: upstream <n> from smtp relay '<*>' after <n>s"
        self._read("dead_letter_groups")
        return [group("DE", 12), group("FR", 3),
                DeadLetterGroup("email.send", smtp, smtp, 5, None, None, [], "dead_lettered"),
                DeadLetterGroup("email.send", smtp, smtp, 2, None, None, [], "retry_scheduled")]  # fmt: skip


def test_dead_letter_groups_whose_errors_begin_alike_read_apart_at_80x24() -> None:
    # both groups read "PermanentError: invalid VAT i…": clipped at their ends, the part that differs was cut off
    app = fake_app(LookAlikeGroups())

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            table = screen.query_one(LiveTable)
            errors = [str(table.get_row_at(i)[-1]).strip() for i in range(table.row_count)]
            assert errors[0] != errors[1] and errors[0].endswith("country DE") and errors[1].endswith("country FR")
            assert all(e.startswith("PermanentE") for e in errors[:2])
            # one error, dead and still retrying: alike, rightly, and clipped at its end
            assert errors[2] == errors[3] == "TransientError: upstream <n> …"
            # a job type of 16 letters (the demo's invoice.generate) is whole: "invoice.gener…" at 80 columns
            assert str(table.get_row_at(0)[2]).strip() == "invoice.generate"
            assert table.virtual_size.width <= table.scrollable_content_region.width

    run_async(scenario())


def test_the_overviews_wait_column_tells_jobs_due_now_from_jobs_scheduled_later(
    dsn: str, conn: Any, make_job: Any
) -> None:
    # "wait 20" counted 20 jobs scheduled 30 days ahead, as if they waited now
    from qconsole.backend import DatabaseBackend
    from qconsole.screens.overview import OverviewScreen
    from tests.qconsole.test_pilot import console, screen_text

    for i in range(20):
        make_job("t.ok", {"n": i}, delay_seconds=30 * 86400)
    make_job("t.ok", {"n": "now"})
    backend = DatabaseBackend(dsn)
    app = console(dsn, backend=backend)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = app.screen
            assert isinstance(screen, OverviewScreen)
            row = screen.query_one(LiveTable).get_row("default\x1ft.ok")
            assert str(row[3]).strip() == "1 +20"
            assert "+20 queued for later" in screen_text(app)

    run_async(scenario())
    backend.close()


class ShrinkingGroups(FakeBackend):
    """Each group's jobs as read for the question: ``left`` of them (None: all), the rest claimed meanwhile."""

    def __init__(self, left: int | None) -> None:
        super().__init__()
        self.left = left

    def group_job_ids(self, group: DeadLetterGroup) -> list[uuid.UUID]:
        ids = super().group_job_ids(group)
        return ids if self.left is None else ids[: self.left]


def test_the_question_counts_the_jobs_it_read_and_says_how_many_moved_on_since_the_list() -> None:
    # drill: "Kill 12 job(s)" above a line that said 13: the details were the list's count, the title the jobs
    # read for the question (a retrying group loses the jobs a worker claims in between)
    backend = ShrinkingGroups(left=2)
    app = fake_app(backend)

    async def scenario() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            group = screen.current()
            assert group is not None and group.count > 2
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            question = app.screen
            assert question.question.startswith("Requeue 2 job(s)")
            assert f"     2  {group.job_type}" in question.details
            assert f"({group.count} listed: moved on since)" in question.details
            await pilot.press("n")
            await settle(pilot)
            backend.left = 0  # all of them gone by the time they are read: nothing is asked
            await pilot.press("r")
            await settle(pilot)
            assert not isinstance(app.screen, ConfirmScreen)
            assert any("Nothing left to requeue" in n.message for n in app._notifications)

    run_async(scenario())
    assert [name for name, _ in backend.calls if name == "requeue"] == []


def test_x_clears_the_filters_then_the_search_as_the_help_says() -> None:
    # x ("Clear filters") kept the search: the box still held its text and the list stayed narrowed, with no
    # key to get the whole list back but editing the box. Now x clears state, type and queue (the search kept,
    # to show what it finds outside them), and x again the search: the help says both
    from textual.widgets import Input

    from qconsole.screens.help import HelpScreen
    from qconsole.screens.jobs import JobsScreen

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "j", JobsScreen)
            box = screen.query_one("#f-search", Input)
            status = screen.query_one("#jobs-status")
            screen.set_filter(state="dead_lettered", job_type="email.send", search="upstream")
            await settle(pilot)
            assert len(screen.jobs) == 1
            await pilot.press("x")
            await settle(pilot)
            assert (screen.filter.state, screen.filter.job_type, screen.filter.search) == (None, None, "upstream")
            assert box.value == "upstream" and "x clears the search" in str(status.content)
            await pilot.press("x")
            await settle(pilot)
            assert screen.filter.search is None and box.value == ""
            assert len(screen.jobs) == len(FakeBackend().jobs) and "all jobs" in str(status.content)
            await pilot.press("question_mark")
            await settle(pilot)
            assert isinstance(app.screen, HelpScreen)
            said = " ".join(JobsScreen.HELP.split())
            assert "x clears the state, type and queue filters, the search kept" in said
            assert "x again, with none of them set, clears the search too" in said

    run_async(scenario())


@pytest.mark.parametrize("key", ["o", "j", "d", "w", "a", "t"])
def test_at_80x24_every_list_fits_the_screen_and_every_key_shown_is_whole(key: str) -> None:
    # at 80x24 the jobs list ran 4 columns past the screen (its last error cut with no mark, a scroll bar over
    # its last row), and the key line ended "^p Pal"
    from textual.widgets._footer import FooterKey

    from qconsole.widgets.keys import KeyLine

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press(key)
            await settle(pilot)
            table = app.screen.query_one(LiveTable)
            assert table.row_count and table.virtual_size.width <= table.scrollable_content_region.width, (
                table.virtual_size,
                table.scrollable_content_region,
            )
            for line in app.screen.query(KeyLine):
                keys = list(line.query(FooterKey))
                assert keys or line.scope == "screen"  # the audit log has no keys of its own
                assert all(k.region.right <= line.region.right for k in keys), [k.label for k in keys]

    run_async(scenario())


def test_a_tables_columns_narrow_again_when_its_wide_rows_are_gone() -> None:
    # a column's width only grew (Textual keeps it across clear()): the workers' table, fitted to the screen on
    # the rows it holds, ran past it once a wider row (a worker ◌ stopping) had come and gone
    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "w", WorkersScreen)
            table = screen.query_one(LiveTable)
            narrow = table.virtual_size.width
            wide = [("x", [*[Text(" " + "w" * 30)] * 7, Text(" r")])]
            table.set_rows(wide)
            await pilot.pause()
            assert table.virtual_size.width > narrow
            screen.reload()
            await settle(pilot)
            assert table.virtual_size.width == narrow

    run_async(scenario())


def test_workers_at_60x15_keep_the_title_the_summary_and_some_rows() -> None:
    # the output pane's 8 rows pushed the title bar and the summary off a 60x15 screen, and left 2 rows of table
    from textual.widgets._footer import FooterKey

    from qconsole.widgets.chrome import TitleBar
    from qconsole.widgets.keys import KeyLine

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=(60, 15)) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "w", WorkersScreen)
            assert screen.query_one(TitleBar).region.y == 0 and screen.query_one("#wk-summary").region.y == 1
            table = screen.query_one(LiveTable)
            assert table.region.height >= 4 and screen.query_one(Log).region.height >= 3
            assert screen.scroll_y == 0 and screen.virtual_size.height <= 15
            # the app's keys that fit whole, ? (which lists them all) among them, though it comes late in the line
            [line] = [k for k in screen.query(KeyLine) if k.scope == "app"]
            keys = list(line.query(FooterKey))
            assert "help" in [k.action for k in keys] and all(k.region.right <= 60 for k in keys)

    run_async(scenario())


def test_the_help_gives_each_screens_text_the_whole_width_and_lists_only_the_consoles_keys() -> None:
    # at 80x24 the help's text had 40 of its 72 columns (a column of titles, one of keys beside it), and the
    # charts and the audit log listed Textual's own screen keys as theirs (tab, "ctrl+c,super+c Copy selected")
    from textual.widgets import Static

    from qconsole.screens.help import HelpScreen

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            help_screen = await opened(pilot, "question_mark", HelpScreen)
            static = help_screen.query_one(Static)
            lines = [line.text for line in static.render_lines(static.region.reset_offset)]
            text = "\n".join(lines)
            assert "Copy selected text" not in text and "Focus Previous" not in text
            first = "An action that changes rows asks first: y does it, r"  # 52 columns: it had 40
            assert any(line.strip().startswith(first) for line in lines)

    run_async(scenario())


class NoJobsYet(FakeBackend):
    def overview(self) -> Any:
        data = super().overview()
        data.overview.types.clear()
        data.overview.queues.clear()
        return data


def test_an_empty_overview_says_no_jobs_yet_where_80_columns_show_it() -> None:
    # "no jobs yet" came after the legends, past the 80th column: an empty screen, and no word why
    from textual.widgets import Static

    app = fake_app(NoJobsYet())

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            summary = app.screen.query_one("#ov-summary", Static)
            [line] = summary.render_lines(summary.region.reset_offset)[:1]
            assert "│ no jobs yet │" in line.text, line.text

    run_async(scenario())


def test_a_job_types_long_reason_leaves_its_overrides_in_view_at_80x24() -> None:
    # the detail had 2 rows: a reason wrapped to two (the demo's are long) hid the overrides and who registered it
    from textual.widgets import Static

    app = fake_app()

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            await pilot.press("t", "down")  # image.resize: "why: a poison payload must reach dead letters ..."
            await settle(pilot)
            detail = app.screen.query_one("#contracts-detail", Static)
            shown = "\n".join(line.text for line in detail.render_lines(detail.region.reset_offset))
            assert "why: a poison payload" in shown and "dead letters after two" in shown and "crashes" in shown
            assert "overrides: max_attempts=2" in shown and "registered by web-1:4242:w0.1" in shown

    run_async(scenario())
