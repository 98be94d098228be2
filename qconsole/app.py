"""The incident console: a thin App that registers the screens (one mode per key), the keys and the
palette, holds the shared state (backend, clock, outage status) and owns the embedded workers' lifecycle.

Build it with :func:`make_app` (tests inject a fake backend and a fixed clock); :func:`run_console` is what
``qconsole`` (no subcommand) calls.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from textual import on, work
from textual.app import App
from textual.binding import Binding, BindingType
from textual.reactive import reactive
from textual.widgets import Input, TextArea

from qconsole.backend import ConsoleBackend, DatabaseBackend
from qconsole.commands import ConsoleCommands
from qconsole.embedded_workers import EmbeddedWorker, EmbeddedWorkers, WorkerLauncher
from qconsole.messages import ActionDone, ActionEnded, ActionFailed, ActionUnsure, EmbeddedWorkerExited
from qconsole.screens.audit import AuditScreen
from qconsole.screens.base import ConsoleScreen
from qconsole.screens.charts import ChartsScreen
from qconsole.screens.contracts import ContractsScreen
from qconsole.screens.dead_letters import DeadLettersScreen
from qconsole.screens.help import HelpScreen
from qconsole.screens.job_detail import JobDetailScreen
from qconsole.screens.jobs import JobsScreen
from qconsole.screens.overview import OverviewScreen
from qconsole.screens.payload_fix import PayloadDraft
from qconsole.screens.workers import WorkersScreen
from qconsole.widgets import fmt
from worker_core import db
from worker_core.clock import SYSTEM_CLOCK, Clock

DEFAULT_THEME = "textual-dark"
#: task modules the start-worker form proposes (comma-separated), e.g. "myapp.tasks"
TASKS_ENV = "QCONSOLE_TASKS"


@dataclass(frozen=True)
class Thresholds:
    """Over these, an overview row is marked ▲ (and colored)."""

    lag_seconds: float = 60.0
    dlq_per_min: float = 0.5


class QConsoleApp(App[int]):
    TITLE = "qconsole"
    CSS_PATH = "app.tcss"
    COMMANDS = App.COMMANDS | {ConsoleCommands}
    MODES = {
        "overview": OverviewScreen,
        "jobs": JobsScreen,
        "dead_letters": DeadLettersScreen,
        "charts": ChartsScreen,
        "workers": WorkersScreen,
        "audit": AuditScreen,
        "contracts": ContractsScreen,
    }
    BINDINGS = [
        Binding("o", "show('overview')", "Overview", tooltip="Queues and job types at a glance", id="overview"),
        Binding("j", "show('jobs')", "Jobs", tooltip="Jobs by state, type and queue; / searches", id="jobs"),
        Binding("d", "show('dead_letters')", "Dead", tooltip="Dead letters grouped by error", id="dead-letters"),
        Binding("c", "show('charts')", "Charts", tooltip="Retries, attempts, leases and lag over time", id="charts"),
        Binding("w", "show('workers')", "Workers", tooltip="Workers; start and stop embedded ones", id="workers"),
        Binding("a", "show('audit')", "Audit", tooltip="Who did what, when", id="audit"),
        Binding("t", "show('contracts')", "Types", tooltip="Each job type's contract and limits", id="contracts"),
        # typed text goes to the jobs' search box, never to commands: on a job's detail `/12aba48e` ran its
        # letters as keys (a: the audit log; c, d: screens; an r, then a y, a requeue). A priority binding, so
        # the box has the focus before the keys typed after it are handed to a widget (see check_action)
        Binding("slash", "search_jobs", "Search jobs", key_display="/", show=False, priority=True, id="search"),
        Binding("question_mark", "help", "Help", key_display="?", tooltip="Every key", id="help"),
        Binding("q", "quit", "Quit", tooltip="Quit (stops embedded workers)", id="quit"),
        Binding("ctrl+p", "command_palette", "Palette", id="palette"),
        Binding("ctrl+r", "reload", "Refresh now", show=False, id="reload"),
    ]

    #: the last read error, while the database is unreachable; None when reads work
    db_error: reactive[str | None] = reactive(None)
    #: when the data on screen was read (clock time)
    last_ok: reactive[dt.datetime | None] = reactive(None)
    #: the confirmed actions still running (the title bar says them: a group's may take a while)
    acting: reactive[tuple[str, ...]] = reactive(())
    #: embedded workers' crashes since the workers screen was last shown (the title bar counts them)
    crashes_unseen: reactive[int] = reactive(0)

    def __init__(
        self,
        backend: ConsoleBackend,
        *,
        clock: Clock = SYSTEM_CLOCK,
        refresh_seconds: float | None = 2.0,
        theme: str | None = None,
        read_only: bool = False,
        launcher: WorkerLauncher | None = None,
        default_tasks: Sequence[str] = (),
        default_concurrency: int = 4,
        thresholds: Thresholds = Thresholds(),
        cursor_blink: bool = True,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.clock = clock
        self.refresh_seconds = refresh_seconds
        self.read_only = read_only
        self.launcher = launcher
        self.default_tasks = tuple(default_tasks)
        self.default_concurrency = default_concurrency
        self.thresholds = thresholds
        self.cursor_blink = cursor_blink
        self.known_queues: list[str] = []
        self.known_types: list[str] = []
        #: per job, a payload fix (E on its detail) whose requeue did not go through, and its reason: E shows
        #: them again (a failed requeue lost a fix made by hand)
        self.payload_drafts: dict[uuid.UUID, PayloadDraft] = {}
        self.pending_job_filter: dict[str, Any] | None = None
        #: q was pressed, and the embedded workers are being stopped
        self._quitting = False
        self._requested_theme = theme or DEFAULT_THEME

    # ---------------------------------------------------------------- lifecycle

    def on_mount(self) -> None:
        try:
            self.theme = self._requested_theme
        except Exception:
            self.theme = DEFAULT_THEME
            self.notify(f"Unknown theme {self._requested_theme!r}: using {DEFAULT_THEME}.", severity="warning")
        if self.launcher is not None:
            self.launcher.set_on_exit(self._embedded_exited)
        self.switch_mode("overview")

    def on_unmount(self) -> None:
        # however the console ends: an action still running would hold its exit up (asyncio.run joins the
        # thread it runs in) and then commit, and one whose thread starts now would run after the quit; a read
        # waiting on a server that stopped answering held it up too, until its deadline (10 s)
        self.backend.abort_actions()
        self.backend.abort_reads()
        if self.launcher is not None:
            self.launcher.set_on_exit(None)
            self.launcher.stop_all()

    async def action_quit(self) -> None:
        # the actions running are rolled back, and none starts any more (README: quitting meanwhile rolls
        # them back); before anything else, so the console exits at once
        self.backend.abort_actions()
        running = [w for w in self.launcher.workers() if w.running] if self.launcher is not None else []
        if not running:
            self.exit(0)
            return
        n = len(running)
        workers = f"{n} embedded worker{'s' if n != 1 else ''}"
        if self._quitting:
            # q again: not another stop of up to 15 s, nor a wait for this one: kill them now
            self.notify(f"Killing {workers} now: their jobs' leases end, other workers take them.", markup=False)
            self._kill_workers()
            return
        self._quitting = True
        # said at once, where it is seen: the UI stayed live for seconds after q, saying nothing (or under a pile of
        # other notices)
        self.clear_notifications()
        self.note_acting("quitting")
        limit = getattr(self.launcher, "stop_timeout", None)
        within = f" (up to {fmt.duration(limit)})" if isinstance(limit, (int, float)) else ""
        self.notify(
            f"Stopping {workers}: their running jobs finish or are released{within}. q again: kill them now.",
            title="quitting",
            timeout=60,
            markup=False,
        )
        self._stop_workers_and_exit()

    @work(thread=True, exit_on_error=False, group="console-shutdown")
    def _stop_workers_and_exit(self) -> None:
        if self.launcher is not None:
            self.launcher.stop_all()
        self.call_from_thread(self.exit, 0)

    @work(thread=True, exit_on_error=False, group="console-shutdown")
    def _kill_workers(self) -> None:
        # the stop under way (_stop_workers_and_exit) sees them gone, and exits
        if self.launcher is not None:
            self.launcher.stop_all(timeout=0)

    # ---------------------------------------------------------------- shared state

    def note_ok(self) -> None:
        self.last_ok = self.clock.now()
        self.db_error = None

    def note_failed(self, error: str) -> None:
        self.db_error = error

    def note_acting(self, name: str) -> None:
        self.acting = (*self.acting, name)

    @on(ActionEnded)
    def _action_ended(self, message: ActionEnded) -> None:
        left = list(self.acting)
        if message.action in left:
            left.remove(message.action)
        self.acting = tuple(left)
        # "Requeue under way…" stayed up beside "Requeued 20 job(s). (audit #2)"
        self._dismiss_notice(f"{message.action.capitalize()} under way…")
        if message.outcome is None:
            return
        self.say_outcome(message.outcome)
        screen = message.origin
        if isinstance(screen, ConsoleScreen) and screen.is_attached:  # not closed meanwhile
            screen.acted(message.outcome)

    def _dismiss_notice(self, text: str) -> None:
        """Take back the oldest notification that says ``text``, if it is still shown. Textual has no public
        way to take back one (``notify`` returns nothing, ``clear_notifications`` takes them all): this goes
        through what a toast does when clicked (``_unnotify``)."""
        for notification in list(self._notifications):
            if notification.message == text:
                self._unnotify(notification)
                return

    def say_outcome(self, outcome: ActionDone | ActionFailed | ActionUnsure) -> None:
        """An action's outcome, on whatever screen is shown now."""
        if isinstance(outcome, ActionDone):
            audit = f" (audit #{outcome.result.audit_id})" if outcome.result.audit_id is not None else ""
            self.notify(outcome.summary + audit, title=outcome.result.action, markup=False)
        elif isinstance(outcome, ActionUnsure):
            # its connection died once it was sent: "failed, nothing changed" was said of a requeue that had
            # committed (the answer to its COMMIT lost), and the operator did it again
            if outcome.audit_id is not None:
                jobs = f", {outcome.changed} job(s)" if outcome.action in ("requeue", "kill") else ""
                self.notify(
                    f"{outcome.action} done (audit #{outcome.audit_id}{jobs}): its answer was lost with the"
                    f" connection ({outcome.error}).",
                    title=outcome.action,
                    severity="warning",
                    timeout=10,
                    markup=False,
                )
            else:
                self.notify(
                    f"{outcome.action}: outcome unknown (the connection was lost): check the audit log (a) before"
                    f" acting again. {outcome.error}",
                    severity="error",
                    timeout=30,
                    markup=False,
                )
        else:
            self.notify(
                f"{outcome.action} failed, nothing changed: {outcome.error}", severity="error", timeout=10, markup=False
            )

    def refuse_read_only(self, what: str) -> None:
        self.notify(
            f"Read-only mode: {what} refused, nothing changed. Restart without --read-only to act.",
            severity="error",
            timeout=8,
            markup=False,
        )

    # ---------------------------------------------------------------- navigation

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "search_jobs":
            # a "/" typed into a text box is text (a search for "a/b", a task module's path), and over a
            # question or a form (modal) it is no key of the console's
            return not self.screen.is_modal and not isinstance(self.focused, (Input, TextArea))
        return True

    async def action_show(self, mode: str) -> None:
        """A screen's key lands on that screen's list: a job's detail open over it (or left open there
        earlier) is closed on the way. Only switching modes brought that old detail back minutes later, and on
        the detail itself `j` did nothing."""
        await self._to_list(mode)

    async def _to_list(self, mode: str) -> None:
        if self.current_mode != mode:
            await self.switch_mode(mode)
        # a question (modal) is left where it is: it waits for its answer
        while len(self.screen_stack) > 1 and not self.screen.is_modal:
            await self.pop_screen()

    async def action_search_jobs(self) -> None:
        """``/`` anywhere: the jobs list with its search box focused, so what is typed next is searched."""
        await self._to_list("jobs")
        screen = self.screen
        if not isinstance(screen, JobsScreen):
            return
        box = screen.query_one("#f-search", Input)
        # now, not through Widget.focus (a callback queued behind the keys typed meanwhile: they went to the
        # table and ran as commands)
        screen.set_focus(box)

        def keep_typing_there() -> None:
            # a list shown for the first time focuses its table from on_mount by such a callback, run once the
            # keys typed so far went to the box: the box gets it back, its text not selected (the next key
            # replaced it), unless the search was submitted meanwhile (enter: the table is where it goes)
            submitted = (box.value.strip() or None) == screen.filter.search
            if screen.is_current and screen.focused is not box and not submitted:
                screen.set_focus(box, from_app_focus=True)

        self.call_later(keep_typing_there)

    def action_reload(self) -> None:
        screen = self.screen
        if isinstance(screen, ConsoleScreen):
            screen.reload()

    def action_help(self) -> None:
        everywhere = (
            "An action that changes rows asks first: y does it, r gives a reason for the audit log first (enter then"
            " does it), n or esc cancels. A form (a limit, a payload fix) says what it does: enter (ctrl+s in the"
            " payload editor) applies it, with no question after."
        )
        sections: list[tuple[str, str, list[BindingType]]] = [("Everywhere", everywhere, list(self.BINDINGS))]
        for cls in (*self.MODES.values(), JobDetailScreen):
            if isinstance(cls, type) and issubclass(cls, ConsoleScreen):
                # its own keys: the charts and the audit log, which have none, listed Textual's Screen keys
                # (tab, shift+tab, "ctrl+c,super+c Copy selected text") as theirs
                sections.append((cls.TITLE_TEXT, cls.HELP, list(cls.__dict__.get("BINDINGS", []))))
        self.push_screen(HelpScreen(sections))

    def open_jobs(self, **filters: Any) -> None:
        """The jobs screen with these filters (state, job_type, queue, search)."""
        if self.current_mode == "jobs":
            while len(self.screen_stack) > 1:
                self.pop_screen()
            screen = self.screen_stack[0]
            if isinstance(screen, JobsScreen):
                screen.set_filter(**filters)
            return
        self.pending_job_filter = filters
        self.call_next(self._open_job_list)

    async def _open_job_list(self) -> None:
        """To the jobs mode's list itself: a job detail left open on top of it would come back instead, the
        filter waiting unused until Esc. Popping down to the list applies it (JobsScreen.on_screen_resume)."""
        await self._to_list("jobs")

    def queues_paused(self) -> dict[str, bool]:
        """Whether each queue is paused, as the overview last read it (empty before its first read)."""
        try:
            stack = self.get_screen_stack("overview")
        except KeyError:
            return {}
        screen = stack[0] if stack else None
        if isinstance(screen, OverviewScreen) and screen.data is not None:
            return {q.name: q.paused for q in screen.data.overview.queues}
        return {}

    def request_pause(self, queue: str, pause: bool) -> None:
        """Pause or resume a queue (with confirmation), from the command palette."""

        def ask() -> None:
            screen = self.screen
            if not isinstance(screen, OverviewScreen):
                return
            # the palette offered it on what the overview had read; a queue found in that state already is
            # said so, not asked about (a confirmed resume of a running queue audited a no-op)
            if self.queues_paused().get(queue) is pause:
                said = "is paused already: nothing to pause" if pause else "is not paused: nothing to resume"
                self.notify(f"Queue '{queue}' {said}.", severity="warning", markup=False)
                return
            screen.request_pause(queue, pause)

        if self.current_mode != "overview":
            self.switch_mode("overview")
        self.call_after_refresh(ask)

    # ---------------------------------------------------------------- embedded workers

    def _embedded_exited(self, w: EmbeddedWorker, restarting: bool) -> None:
        """Runs on the launcher's reader thread: hand over to the UI without waiting."""
        crashed = (w.exit_code or 0) != 0 and not w.stopping
        code = w.exit_code or 0
        own = own_error(w.output, code) if crashed else ""
        again = restart_delay(w.streak) if restarting else None
        self.post_message(EmbeddedWorkerExited(w.number, w.pid or 0, code, crashed, own, restarting, again))

    @on(EmbeddedWorkerExited)
    def _show_embedded_exit(self, m: EmbeddedWorkerExited) -> None:
        """A crash the launcher heals (it starts the worker again) is counted in the title bar (``☠ 3 crashes
        (w)``) until the workers screen, which shows every crash and its output, is opened: no notice. A notice
        of 3 rows over the right half of the screen came with each crash, two for each poison payload of the
        demo (one per worker), hiding the figures it was opened to read; as a k9s user reads an error in its
        header line and a Sidekiq user in its counters, not in a window over the table. A worker that is not
        started again needs an operator: that one is said in a notice, with what it said of itself."""
        screen = self.screen
        if isinstance(screen, WorkersScreen):
            screen.reload()
        if not m.crashed:
            self.notify(f"Embedded worker #{m.number} (pid {m.pid}) stopped.", markup=False)
            return
        if not isinstance(screen, WorkersScreen):  # there, the crash is on the screen already
            self.crashes_unseen += 1
        if m.restarting:
            return
        text = f"Embedded worker #{m.number} crashed ({exit_description(m.exit_code)}), not restarted (w)"
        if m.own_error:
            text += f"\n{fmt.clip(m.own_error, 72)}"
        self.notify(text, severity="error", timeout=8, markup=False)

    def crashes_seen(self) -> None:
        """The workers screen is shown: the crashes counted in the title bar are in view there."""
        self.crashes_unseen = 0


#: a traceback's last line: the exception's (qualified) name, and its message if any
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:: .*)?$")


def own_error(output: Iterable[str], exit_code: int) -> str:
    """What a worker that exited by itself (``exit_code`` > 0) said of itself as it ended, among its last
    run's ``output``: its refusal (``error: ...``) or an uncaught exception's traceback's last line; else "".
    A process killed by a signal said nothing of why, and a log line it wrote last (a job's retry) is none."""
    if exit_code <= 0:
        return ""
    lines: list[str] = []
    for line in reversed(list(output)):
        if line.startswith("$ "):  # the command that started this run: what comes before is another run's
            break
        if line.strip() and not line.startswith("["):  # the console's own notes: [exited with code 1]
            lines.append(line)
    if not lines:
        return ""
    last = lines[0].strip()
    if last.startswith("error: "):
        return last
    if not _EXCEPTION_LINE.match(last):
        return ""
    for line in lines[1:]:
        if line.startswith("Traceback (most recent call last):"):
            return last
        if not line.startswith(" "):  # a traceback's frames are indented: this is something else
            return ""
    return ""


def exit_description(code: int) -> str:
    """``exit 13``; ``exit -9, killed by SIGKILL``."""
    if code >= 0:
        return f"exit {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"exit {code}, killed by {name}"


def restart_delay(streak: int) -> float:
    """The launcher's backoff before it starts a crashed worker again (EmbeddedWorkers._read): 1s, 2s, 4s...
    up to 30s, with its crashes in a row."""
    return min(30.0, 2.0 ** min(max(streak, 1) - 1, 5))


def make_app(
    backend: ConsoleBackend,
    *,
    clock: Clock = SYSTEM_CLOCK,
    refresh_seconds: float | None = 2.0,
    theme: str | None = None,
    read_only: bool | None = None,
    launcher: WorkerLauncher | None = None,
    default_tasks: Sequence[str] = (),
    default_concurrency: int = 4,
    thresholds: Thresholds | None = None,
    cursor_blink: bool = True,
) -> QConsoleApp:
    """The console over ``backend``. ``refresh_seconds=None`` switches polling off (tests);
    ``read_only`` defaults to the backend's."""
    return QConsoleApp(
        backend,
        clock=clock,
        refresh_seconds=refresh_seconds,
        theme=theme,
        read_only=backend.read_only if read_only is None else read_only,
        launcher=launcher,
        default_tasks=default_tasks,
        default_concurrency=default_concurrency,
        thresholds=thresholds or Thresholds(),
        cursor_blink=cursor_blink,
    )


def _default_tasks() -> tuple[str, ...]:
    return tuple(t.strip() for t in os.environ.get(TASKS_ENV, "").split(",") if t.strip())


def console_launcher(dsn: str) -> EmbeddedWorkers:
    """The launcher of the workers an operator starts from the console (s). They take no part in
    housekeeping: its winner prunes the whole fleet's finished jobs with its own retention, and a worker
    started here has the defaults (14 days of dead letters where the fleet keeps 90, say)."""
    return EmbeddedWorkers(dsn, extra_args=["--no-housekeeping"])


def run_console(
    dsn: str | None,
    read_only: bool,
    refresh: float,
    theme: str | None,
    *,
    launcher: EmbeddedWorkers | None = None,
    default_tasks: Sequence[str] | None = None,
) -> int:
    """Open the console on ``dsn`` (else $QCONSOLE_DSN, $DATABASE_URL, else the embedded server).
    Returns the exit code. Embedded workers it started are stopped before it returns."""
    resolved = db.resolve_dsn(dsn)
    backend = DatabaseBackend(resolved, read_only=read_only)
    own_launcher = launcher is None and not read_only
    if own_launcher:
        launcher = console_launcher(resolved)
    app = make_app(
        backend,
        clock=backend.clock,  # the server's time, as the backend measures it: ages and lags on screen
        refresh_seconds=refresh,
        theme=theme,
        read_only=read_only,
        launcher=launcher,
        default_tasks=_default_tasks() if default_tasks is None else default_tasks,
    )
    try:
        code = app.run()
    finally:
        if launcher is not None:
            launcher.stop_all()
        backend.close()
    return int(code or 0)
