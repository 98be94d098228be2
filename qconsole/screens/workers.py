"""``w`` Workers: every live worker, and the embedded ones this console started (``s`` start, ``x`` stop)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Log, Static

from qconsole.backend import ActionLost, ActionsAborted, ConsoleBackend, describe_error, is_outage
from qconsole.embedded_workers import EmbeddedWorker
from qconsole.screens.base import ACTION_GROUP, ConsoleScreen
from qconsole.widgets import fmt
from qconsole.widgets.table import LiveTable, cell
from worker_core.models import WorkerInfo

if TYPE_CHECKING:
    from qconsole.app import QConsoleApp

COLUMNS = [
    ("src", "src", None),
    ("state", "state", None),
    ("worker", "host:pid", None),
    ("queues", "queues", None),
    ("conc", "slots", None),
    ("busy", "claimed", None),
    ("beat", "heartbeat", None),
    ("types", "runs", None),
]
LOG_LINES = 200


def db_state(w: WorkerInfo) -> str:
    if w.stopped_at is not None:
        return "■ stopped"
    if w.lost:
        return "✗ LOST"
    return "● live"


def runs(w: WorkerInfo) -> str:
    """The job types a worker registered (``workers.tasks``): what it claims, in its queues."""
    return ",".join(w.tasks) or "-"


class WorkersScreen(ConsoleScreen):
    TITLE_TEXT = "Workers"
    HELP = (
        "Workers and their heartbeats, running ones first; a worker whose heartbeat stopped is LOST. slots: jobs"
        " it runs at once; claimed: jobs it holds leased, running in its slots or prefetched to start next (up"
        " to slots + prefetch, 2 x slots by default, more for groups of fast jobs). runs: the job types it"
        " registered (all of the selected worker's below the table). s/x start/stop embedded ones."
    )

    BINDINGS = [
        Binding("s", "start_worker", "Start embedded"),
        Binding("x", "stop_worker", "Stop embedded"),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.db_workers: list[WorkerInfo] = []
        self.embedded: list[EmbeddedWorker] = []
        self._log_state: tuple[Any, ...] = ()
        #: the embedded worker whose output the pane shows
        self._log_number: int | None = None

    def compose_body(self) -> ComposeResult:
        yield Static(id="wk-summary", classes="summary")
        yield LiveTable(COLUMNS, id="wk-table")
        yield Static(id="wk-log-title", classes="detail-title")
        yield Log(id="wk-log", max_lines=2000)

    def on_mount(self) -> None:
        self.query_one(LiveTable).focus()

    def on_screen_resume(self) -> None:
        # (Textual runs ConsoleScreen's handler too, which reads): the crashes the title bar counted are in view
        self.qapp.crashes_seen()

    def fetch(self, backend: ConsoleBackend) -> list[WorkerInfo]:
        return backend.workers()

    def show(self, data: list[WorkerInfo]) -> None:
        self.db_workers = data
        self._paint()

    def _paint(self) -> None:
        launcher = self.qapp.launcher
        self.embedded = launcher.workers() if launcher is not None else []
        now = self.qapp.clock.now()
        by_pid = {(w.host, w.pid): w for w in self.db_workers}
        rows: list[tuple[str, list[Text]]] = []
        #: running workers first, then the ones that ended: a live worker sat below ten stopped rows
        ended: list[tuple[str, list[Text]]] = []
        matched: set[str] = set()
        for e in self.embedded:
            info = by_pid.get((e.host, e.pid)) if e.pid is not None and e.running else None
            if info is not None:
                matched.add(info.id)
            if e.running:
                state = db_state(info) if info else "○ starting"
                if e.stopping:
                    state = "◌ stopping"
            else:
                state = "☠ crashed" if "crashed" in e.status else "■ stopped"
            (rows if e.running or e.restart_pending else ended).append(
                (
                    f"emb:{e.number}",
                    [
                        cell(f"emb#{e.number}", style="bold"),
                        cell(state),
                        cell(fmt.clip(f"{e.host}:{e.pid or '-'}", 24)),
                        cell(fmt.clip(",".join(e.queues) or "*", 16)),
                        cell(e.concurrency, right=True),
                        cell(info.in_flight if info else "-", right=True),
                        cell(fmt.ago(info.last_heartbeat_at, now) if info else "-", right=True),
                        cell(runs(info) if info else "-"),
                    ],
                )
            )
        for w in self.db_workers:
            if w.id in matched:
                continue
            (rows if w.stopped_at is None else ended).append(
                (
                    f"db:{w.id}",
                    [
                        cell(""),
                        cell(db_state(w), style="bold" if w.lost else ""),
                        cell(fmt.clip(f"{w.host}:{w.pid}", 24)),
                        cell(fmt.clip(",".join(w.queues) if w.queues else "*", 16)),
                        cell(w.concurrency, right=True),
                        cell(w.in_flight, right=True),
                        cell(fmt.ago(w.last_heartbeat_at, now), right=True),
                        cell(runs(w)),
                    ],
                )
            )
        table = self.query_one(LiveTable)
        # the job types (the last column) cut to fit: the selected worker's are said in full below the table
        table.set_rows(table.fit_last(rows + ended))
        live = sum(1 for w in self.db_workers if w.stopped_at is None and not w.lost)
        lost = sum(1 for w in self.db_workers if w.lost)
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f" {live} live", style="bold")
        t.append(f" │ {lost} lost" + (" ✗" if lost else ""))
        t.append(f" │ {sum(1 for e in self.embedded if e.running)} embedded running")
        crashed = sum(e.crashes for e in self.embedded)
        if crashed:
            t.append(f" │ ☠ {crashed} embedded crash(es)", style="bold")
        t.append(" │ claimed: running + prefetched jobs")
        self.query_one("#wk-summary", Static).update(t)
        self._paint_log()

    def info_of(self, e: EmbeddedWorker) -> WorkerInfo | None:
        """The worker row of a running embedded worker (its process's), once it has registered."""
        if e.pid is None or not e.running:
            return None
        return next((w for w in self.db_workers if (w.host, w.pid) == (e.host, e.pid)), None)

    def selected_db(self) -> WorkerInfo | None:
        """The worker (not an embedded one of this console's) under the cursor."""
        key = self.query_one(LiveTable).cursor_key
        if key is None or not key.startswith("db:"):
            return None
        return next((w for w in self.db_workers if w.id == key[3:]), None)

    def selected_embedded(self) -> EmbeddedWorker | None:
        key = self.query_one(LiveTable).cursor_key
        if key is None or not key.startswith("emb:"):
            return None
        number = int(key[4:])
        return next((e for e in self.embedded if e.number == number), None)

    @on(DataTable.RowHighlighted)
    def _highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._paint_log()

    def _paint_log(self) -> None:
        e = self.selected_embedded()
        title = self.query_one("#wk-log-title", Static)
        log = self.query_one("#wk-log", Log)
        if e is None:
            w = self.selected_db()
            # what the worker runs, all of it (the table's column is cut at 80 columns): the first thing to
            # look up when a type's jobs wait and nothing runs them
            said = (w.id, runs(w), tuple(w.queues or ())) if w is not None else None
            state: tuple[Any, ...] = (None, said)
            if state != self._log_state:
                self._log_state = state
                line = Text(no_wrap=True, overflow="ellipsis")
                if w is not None:
                    line.append(f" {w.host}:{w.pid} runs {runs(w)}", style="bold")
                    line.append(f" in {','.join(w.queues) if w.queues else 'every queue'} │ ")
                line.append("output: select an embedded worker (emb#) to read its output")
                title.update(line)
                log.clear()
            return
        lines = e.tail(LOG_LINES)
        info = self.info_of(e)
        state = (e.number, len(e.output), lines[-1] if lines else "", e.status, runs(info) if info else None)
        if state == self._log_state:
            return
        self._log_state = state
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(f" output of emb#{e.number}", style="bold")
        head.append(f" │ {e.status} │ tasks {','.join(e.tasks)}")
        if info is not None:
            head.append(f" │ runs {runs(info)}")
        if e.restarts:
            head.append(f" │ restarted {e.restarts} time(s)")
        if e.log_path is not None:
            head.append(f" │ {e.log_path}")
        title.update(head)
        # at its end (or another worker's output): it stays at the end, where a crash's last words are.
        # Log.write_lines follows only a log already at its end, and after clear() none is (its scroll
        # offset outlives its lines): the pane stayed on lines minutes old
        follow = log.is_vertical_scroll_end or log.line_count == 0 or self._log_number != e.number
        self._log_number = e.number
        y = log.scroll_y
        log.auto_scroll = False  # a reader who scrolled up stays where they read
        log.clear()
        log.write_lines(lines)
        if follow:
            log.scroll_end(animate=False, immediate=True, x_axis=False)
        else:
            log.scroll_to(y=y, animate=False, immediate=True)

    # ---------------------------------------------------------------- actions

    def action_start_worker(self) -> None:
        if self.qapp.read_only:
            self.qapp.refuse_read_only("start a worker")
            return
        launcher = self.qapp.launcher
        if launcher is None:
            self.notify("Embedded workers are not available in this console.", severity="warning")
            return
        from qconsole.screens.start_worker import StartWorkerScreen, WorkerRequest

        def started(request: WorkerRequest | None) -> None:
            if request is None:
                return
            try:
                w = launcher.start(request.tasks, request.queues, request.concurrency)
            except Exception as e:
                self.notify(f"Could not start a worker: {e}", severity="error", markup=False)
                return
            self.notify(
                f"Started embedded worker #{w.number} (pid {w.pid}): {','.join(w.tasks)}"
                f" on {','.join(w.queues) or 'every queue'}.",
                markup=False,
            )
            self._paint()
            self.query_one(LiveTable).select_key(f"emb:{w.number}")
            self.reload()
            if w.pid is not None:  # else it could not be started at all (its crash is said)
                self._audit("worker_start", w)

        self.app.push_screen(
            StartWorkerScreen(",".join(self.qapp.default_tasks), "", self.qapp.default_concurrency), started
        )

    def action_stop_worker(self) -> None:
        if self.qapp.read_only:
            self.qapp.refuse_read_only("stop a worker")
            return
        e = self.selected_embedded()
        launcher = self.qapp.launcher
        if e is None or launcher is None:
            self.notify("Select an embedded worker (emb#) to stop it.", severity="warning")
            return
        if e.restart_pending:
            question = f"Cancel the restart of embedded worker #{e.number} (pid {e.pid})?"
            details = (
                f"It crashed (exit {e.exit_code}) and is to be started again after a pause. Its process has"
                " ended: y and it is not started again."
            )
        elif not e.running:
            self.notify(f"Embedded worker #{e.number} is not running ({e.status}).", severity="warning")
            return
        elif e.stopping:
            self.notify(f"Embedded worker #{e.number} (pid {e.pid}) is stopping already.", markup=False)
            return
        else:
            question = f"Stop embedded worker #{e.number} (pid {e.pid})?"
            details = stop_details(getattr(launcher, "shutdown_grace", None))
        from qconsole.screens.confirm import ConfirmScreen

        question_screen = ConfirmScreen(question, details, action="stop worker")

        def answered(yes: bool | None) -> None:
            if not yes:
                self.notify(f"Stop cancelled: embedded worker #{e.number} is left as it is.", markup=False)
                return
            # as it is now, not as it was asked about: it may have crashed, or been started again, meanwhile
            restart_cancelled = e.restart_pending
            if restart_cancelled:
                launcher.stop(e.number)
                self.notify(f"Embedded worker #{e.number}: its restart is cancelled.", markup=False)
            elif e.running and not e.stopping:
                launcher.stop(e.number)
                self.notify(
                    f"Stopping embedded worker #{e.number} (pid {e.pid}): it finishes or releases its jobs.",
                    markup=False,
                )
            else:
                self.notify(f"Embedded worker #{e.number} ended meanwhile ({e.status}): nothing to stop.",
                            severity="warning", markup=False)  # fmt: skip
                return
            self._paint()
            self._audit("worker_stop", e, restart_cancelled=restart_cancelled, reason=question_screen.reason)

        self.app.push_screen(question_screen, answered)

    def _audit(
        self, action: str, e: EmbeddedWorker, *, restart_cancelled: bool = False, reason: str | None = None
    ) -> None:
        """The start or stop just done, written to the audit log off the UI thread (the worker is what it is as
        it was started or asked to stop: a restart later runs another pid), with the reason the operator gave."""
        fields: dict[str, Any] = {
            "number": e.number, "pid": e.pid, "host": e.host, "queues": list(e.queues),
            "concurrency": e.concurrency, "tasks": list(e.tasks), "restart_cancelled": restart_cancelled,
        }  # fmt: skip
        if reason:
            fields["reason"] = reason
        self._write_audit(self.qapp, action, fields)

    @work(thread=True, exit_on_error=False, group=ACTION_GROUP, description="embedded worker: its audit entry")
    def _write_audit(self, app: QConsoleApp, action: str, fields: dict[str, Any]) -> None:
        """Written, it says nothing more (the start or stop was said). Not written (the database down, a role
        that may not write the audit log), or not known to be: said (app.notify is thread-safe), as an action's
        failure is; the worker started, or stops, all the same."""
        if action == "worker_start":
            done = "started"
        else:
            done = "is not restarted" if fields["restart_cancelled"] else "is stopping"
        what = f"Embedded worker #{fields['number']} (pid {fields['pid']}) {done}, but"
        dsn = getattr(app.backend, "dsn", None)
        unsure = False
        try:
            app.backend.audit_worker(action, **fields)
            return
        except ActionsAborted:
            return  # the console quits: nobody to tell
        except ActionLost as lost:  # its connection died: the backend told whether it committed
            if lost.committed:
                return
            error = describe_error(lost.cause, dsn)
            if lost.note:
                error += f" ({lost.note})"
            unsure = lost.committed is None
        except Exception as exc:
            error = describe_error(exc, dsn)
            unsure = is_outage(exc)  # a backend that cannot tell: the answer to its COMMIT may be what was lost
        if unsure:
            app.notify(
                f"{what} whether the audit log has it is unknown (the connection was lost): check the audit log (a)."
                f" {error}",
                title=action, severity="error", timeout=30, markup=False,
            )  # fmt: skip
        else:
            app.notify(f"{what} this is not in the audit log: {error}", title=action, severity="error", timeout=10,
                       markup=False)  # fmt: skip


def stop_details(grace: float | None) -> str:
    """What stopping an embedded worker does (EmbeddedWorkers.stop: a graceful stop, the worker's own shutdown):
    ``grace`` is its shutdown grace, None where the launcher does not say."""
    within = f"get {fmt.duration(grace)} to finish" if grace is not None else "get its shutdown grace to finish"
    return (
        "It stops claiming jobs. Those it claimed and has not started go back to the queue at once; its running"
        f" jobs {within}, then are told to stop and go back to the queue, their attempt not counted (a job whose"
        " handler will not stop waits for its lease to run out). It is not restarted."
    )
