"""What every console screen shares: reading off the UI thread without overlap, and confirmed actions.

A screen implements ``fetch(backend)`` (runs in a thread worker, may block) and ``show(data)`` (runs on
the UI thread). The next read is scheduled with ``set_timer`` only when the previous one finished, so a
slow database never stacks reads; a failed read shows the banner (the outage's, or, for an error the database
answered with, one that says the data shown is stale and how old it is) and is retried the same way.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

from textual import on, work
from textual.app import ComposeResult
from textual.screen import Screen
from textual.timer import Timer
from textual.worker import Worker, WorkerState

from qconsole.backend import ActionLost, ConsoleBackend, describe_error, is_outage
from qconsole.messages import ActionDone, ActionEnded, ActionFailed, ActionUnsure, DataFetched, FetchFailed
from qconsole.widgets.chrome import OutageBanner, TitleBar
from qconsole.widgets.keys import KeyLine
from worker_core.models import ActionResult

if TYPE_CHECKING:
    from qconsole.app import QConsoleApp

READ_GROUP = "console-read"
ACTION_GROUP = "console-action"
#: while the database is unreachable, retry no faster than this
OUTAGE_RETRY_SECONDS = 2.0


class ConsoleScreen(Screen[None]):
    """A screen of the console: title bar, outage banner, body, footer."""

    TITLE_TEXT: ClassVar[str] = ""
    HELP: ClassVar[str] = ""
    #: while its reads fail with an error the database answered with, the banner says the data shown is
    #: stale (a screen that shows the error in place of its data says it there instead)
    MARKS_STALE_DATA: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._timer: Timer | None = None
        self._reading = False
        self._again = False
        self._active = False

    @property
    def qapp(self) -> QConsoleApp:
        return cast("QConsoleApp", self.app)

    def compose(self) -> ComposeResult:
        yield TitleBar(self.TITLE_TEXT)
        yield OutageBanner()
        yield from self.compose_body()
        yield KeyLine("screen")
        yield KeyLine("app")

    def compose_body(self) -> ComposeResult:
        yield from ()

    # ---------------------------------------------------------------- reading

    def fetch(self, backend: ConsoleBackend) -> Any:
        """Runs in a thread worker: read what the screen shows."""
        return None

    def show(self, data: Any) -> None:
        """Runs on the UI thread with what ``fetch`` returned."""

    def on_screen_resume(self) -> None:
        self._active = True
        self.reload()

    def on_screen_suspend(self) -> None:
        self._active = False
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer = None

    def reload(self) -> None:
        """Read now, unless a read is running (then read again as soon as it finishes)."""
        self._cancel_timer()
        if self._reading:
            self._again = True
            return
        self._reading = True
        self._read()

    @work(thread=True, exclusive=True, exit_on_error=False, group=READ_GROUP, description="console read")
    def _read(self) -> None:
        backend = self.qapp.backend
        try:
            data = self.fetch(backend)
        except Exception as e:
            self.post_message(FetchFailed(self.describe(e), outage=is_outage(e)))
            return
        self.post_message(DataFetched(data))

    #: when this screen's data was read (the title bar and the outage banner say it: another screen's read
    #: is no age of what this one shows)
    data_at: dt.datetime | None = None

    #: the error of this screen's last read, if the database answered it with one (a statement timeout behind a
    #: table lock, say): the banner says the data shown is stale until a read succeeds
    read_error: str | None = None

    @on(DataFetched)
    def _fetched(self, message: DataFetched) -> None:
        message.stop()
        self._last_failure = None
        if self.read_error is not None:
            self.read_error = None
            self.query_one(OutageBanner).repaint()
        self.data_at = self.qapp.clock.now()
        self.qapp.note_ok()
        self.query_one(TitleBar).repaint()  # the age it gives is this screen's (note_ok repaints on change)
        self.show(message.data)

    @on(FetchFailed)
    def _failed(self, message: FetchFailed) -> None:
        message.stop()
        if message.outage:
            self.qapp.note_failed(message.error)
            return
        # the figures on screen are the last ones read: a toast said it for 8 s, then they looked live for as
        # long as the reads failed (a lock held for minutes): the banner says it until a read succeeds
        if self.MARKS_STALE_DATA:
            self.read_error = message.error
        self.qapp.db_error = None  # it answered: reachable
        self.query_one(OutageBanner).repaint()
        if message.error != self._last_failure:
            self._last_failure = message.error
            self.show_failure(message.error)

    _last_failure: str | None = None

    def show_failure(self, error: str) -> None:
        """A read the database answered with an error: said once (it repeats every refresh)."""
        self.notify(error, title="read failed", severity="error", timeout=8, markup=False)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group != READ_GROUP:
            return
        if event.state not in (WorkerState.SUCCESS, WorkerState.ERROR, WorkerState.CANCELLED):
            return
        self._reading = False
        if self._again:
            self._again = False
            self.reload()
            return
        interval = self.qapp.refresh_seconds
        if interval is None or not self._active:
            return
        if self.qapp.db_error is not None:
            interval = max(interval, OUTAGE_RETRY_SECONDS)
        self._timer = self.set_timer(interval, self.reload, name="console-refresh")

    # ---------------------------------------------------------------- acting

    def describe(self, e: BaseException) -> str:
        """An error in one line, without the password of the backend's DSN (whole, or the pieces an error
        of libpq's quotes of it)."""
        return describe_error(e, getattr(self.qapp.backend, "dsn", None))

    def act(
        self,
        name: str,
        question: str,
        details: str,
        fn: Callable[[ConsoleBackend, str | None], ActionResult],
        summary: Callable[[ActionResult], str],
        touches: int,
    ) -> None:
        """Refuse in read-only mode; else ask for confirmation, then run ``fn`` in a thread worker, with the
        reason the operator gave in the question (None: none) for its audit entry."""
        if self.qapp.read_only:
            self.qapp.refuse_read_only(name)
            return
        if touches <= 0:
            self.notify(f"Nothing to {name}: {details}", severity="warning", markup=False)
            return
        from qconsole.screens.confirm import ConfirmScreen

        question_screen = ConfirmScreen(question, details, action=name)

        def answered(yes: bool | None) -> None:
            if yes:
                reason = question_screen.reason
                self.start_action(name, lambda b: fn(b, reason), summary)
            else:
                self.notify(f"{name.capitalize()} cancelled: nothing changed.", markup=False)

        self.app.push_screen(question_screen, answered)

    def ask_limit(
        self, job_type: str, limits: list[dict[str, Any]], *, queue: str | None = None, now: dt.datetime | None = None
    ) -> None:
        """``l``: the form that sets, changes or lifts ``job_type``'s concurrency limit (``queue``: the row's),
        then the change, audited with the reason it was given."""
        if self.qapp.read_only:
            self.qapp.refuse_read_only("a limit")
            return
        from qconsole.screens.limit import EVERY_QUEUE, LimitRequest, LimitScreen

        def answered(req: LimitRequest | None) -> None:
            if req is None:
                self.notify("Limit cancelled: nothing changed.", markup=False)
                return
            where = "every queue" if req.queue == EVERY_QUEUE else f"queue '{req.queue}'"
            n = req.max_running
            if n is None:
                self.start_action(
                    "lift limit",
                    lambda b: b.clear_limit(req.job_type, req.queue, req.reason, current=req.current),
                    lambda r: f"{req.job_type}: its limit in {where} is lifted.",
                )
            else:
                held = " (held: none of them start)" if n == 0 else ""
                self.start_action(
                    "limit",
                    lambda b: b.set_limit(req.job_type, n, req.queue, req.reason, current=req.current),
                    lambda r: f"{req.job_type}: at most {n} running in {where}{held}.",
                )

        self.app.push_screen(LimitScreen(job_type, limits, queue=queue, now=now), answered)

    def start_action(
        self, name: str, fn: Callable[[ConsoleBackend], ActionResult], summary: Callable[[ActionResult], str]
    ) -> None:
        """Run an action the operator has confirmed (the question of ``act``, or a form that says what it does)
        in a thread worker; its outcome is said whatever screen is shown by then."""
        # a group's action may take a while: the title bar says it runs until it is done, and the console goes
        # on meanwhile (the action runs in a thread, on a connection of its own)
        app = self.qapp  # here, on the UI thread: the thread reaches the app through it, not the screen
        app.note_acting(name)
        self.notify(f"{name.capitalize()} under way…", markup=False)
        self._act(app, name, fn, summary)

    @work(thread=True, exit_on_error=False, group=ACTION_GROUP, description="console action")
    def _act(
        self,
        app: QConsoleApp,
        name: str,
        fn: Callable[[ConsoleBackend], ActionResult],
        summary: Callable[[ActionResult], str],
    ) -> None:
        # the outcome goes to the app, whatever became of this screen meanwhile (closed, its app unreachable
        # through it): the title bar's mark always clears, and the outcome is always said
        outcome: ActionDone | ActionFailed | ActionUnsure | None = None
        dsn = getattr(app.backend, "dsn", None)
        try:
            try:
                result = fn(app.backend)
            except ActionLost as e:  # the connection died: the backend told whether it committed
                error = describe_error(e.cause, dsn)
                if e.committed is False:
                    outcome = ActionFailed(name, f"{error} ({e.note})" if e.note else error)
                else:
                    outcome = ActionUnsure(name, error, e.audit_id if e.committed else None, e.changed)
            except Exception as e:
                # an outage once the action may have been sent (a backend that cannot tell): the answer to its
                # COMMIT may be what was lost, so "nothing changed" would be a guess; else the server answered
                # with an error, and rolled it back
                error = describe_error(e, dsn)
                outcome = ActionUnsure(name, error) if is_outage(e) else ActionFailed(name, error)
            else:
                outcome = ActionDone(result, summary(result))
        finally:
            app.post_message(ActionEnded(name, outcome, self))

    def acted(self, outcome: ActionDone | ActionFailed | ActionUnsure) -> None:
        """An action asked on this screen ended (the app said its outcome): clear marks, read again."""
        if isinstance(outcome, ActionDone):
            self.after_action(outcome.result)
        elif isinstance(outcome, ActionUnsure) and outcome.audit_id is not None:
            # found committed after its answer was lost: its marks go as for any done action (kept, a group
            # that went on growing under the same fingerprint was requeued again by the next r)
            self.after_action(None)
        self.reload()

    def after_action(self, result: ActionResult | None) -> None:
        """Hook: clear marks and the like (``result`` None: an action found committed after its answer was
        lost, whose details are in its audit entry)."""
