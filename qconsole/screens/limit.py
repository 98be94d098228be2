"""The form behind ``l`` (overview, job types): set, change or lift a job type's fleet-wide concurrency limit,
a held type (``limit 0``) included, with a reason for the audit log. It says what the type's limits are now and
who set them; what it applies is exactly what it shows, so it asks no second question."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from qconsole.screens.confirm import MAX_REASON_LENGTH
from qconsole.widgets import fmt
from worker_core.envelope import QUEUE_RE
from worker_core.ops import MAX_LIMIT

EVERY_QUEUE = "*"


@dataclass(frozen=True)
class LimitRequest:
    job_type: str
    #: a queue, or '*': every queue together
    queue: str
    #: None: lift the limit
    max_running: int | None
    reason: str | None
    #: the limit there as the form showed it (None: none): changed since, nothing is done (another operator's
    #: hold is not undone unseen)
    current: int | None


def limit_origin(row: dict[str, Any], now: dt.datetime | None = None) -> str:
    """``set by alice@10.0.0.5 5m ago: INC-42``, ``declared by its @task``."""
    if row.get("source") == "task":
        return "declared by its @task"
    by = row.get("set_by") or "an operator"
    when = f" {fmt.ago(row['updated_at'], now)}" if now is not None and row.get("updated_at") else ""
    why = f": {fmt.printable(row['reason'])}" if row.get("reason") else ""
    return f"set by {fmt.printable(by)}{when}{why}"


def describe_limit(row: dict[str, Any], now: dt.datetime | None = None) -> str:
    """``≤3 in every queue (set by alice@10.0.0.5 5m ago: INC-42)``, ``≤2 in billing (declared by its @task)``."""
    where = "every queue" if row["queue"] == EVERY_QUEUE else row["queue"]
    return f"≤{row['max_running']} in {where} ({limit_origin(row, now)})"


def default_scope(limits: Sequence[dict[str, Any]], queue: str | None) -> str:
    """The limit the form opens on: of those that apply to the row's queue (its own, every queue's), the one
    that holds back most (a type held everywhere and limited to 3 in billing opened on the 3, and lifting it
    "lifted" a limit while the type stayed held); with no queue, every queue's."""
    applying = [r for r in limits if r["queue"] == EVERY_QUEUE or (queue is not None and r["queue"] == queue)]
    if not applying:
        return EVERY_QUEUE
    return str(min(applying, key=lambda r: (r["max_running"], r["queue"] == EVERY_QUEUE))["queue"])


#: how many of a type's limits the form lists, each on a line cut to fit: it stays on an 80x24 screen
SHOWN_LIMITS = 3


class LimitScreen(ModalScreen[LimitRequest | None]):
    DEFAULT_CSS = """
    LimitScreen {
        align: center middle;
        background: $background 60%;
    }
    LimitScreen > Vertical {
        width: 90;
        max-width: 95%;
        height: auto;
        border: thick $warning;
        background: $panel;
        padding: 0 1;
    }
    LimitScreen #lim-now {
        margin-bottom: 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    LimitScreen #lim-error {
        color: $error;
        text-style: bold;
    }
    """

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(
        self,
        job_type: str,
        limits: Sequence[dict[str, Any]],
        *,
        queue: str | None = None,
        now: dt.datetime | None = None,
    ) -> None:
        """``limits``: the type's limits as read (stats.limits' rows of it); ``queue``: the row's, on the overview."""
        super().__init__()
        self.job_type = job_type
        self.limits = [r for r in limits if r["job_type"] == job_type]
        self.queue = queue
        self.now = now
        #: applied: enter twice (its second Submitted delivered once the form was dismissed) dismissed the screen
        #: below it, and the console died of an empty screen stack
        self.applied = False

    def compose(self) -> ComposeResult:
        scope = default_scope(self.limits, self.queue)
        current = next((r for r in self.limits if r["queue"] == scope), None)
        now = Text(no_wrap=True, overflow="ellipsis")
        now.append(f"{fmt.clip(self.job_type, 60)}", style="bold")
        now.append(": at most so many run at once, fleet-wide; the rest wait.")
        if not self.limits:
            now.append("\nNow: no limit.")
        for r in self.limits[:SHOWN_LIMITS]:  # a line each, cut where the form ends (reasons run long)
            now.append("\nNow: " + describe_limit(r, self.now))
        if len(self.limits) > SHOWN_LIMITS:
            now.append(f"\n… and {len(self.limits) - SHOWN_LIMITS} more (qconsole limit {self.job_type})")
        with Vertical():
            yield Static(now, id="lim-now")
            yield Label("At most running (0 holds them all; empty lifts it)")
            yield Input(
                "" if current is None else str(current["max_running"]),
                placeholder="none: type a number",
                id="lim-max",
                type="integer",
                compact=True,
            )
            yield Label("In queue (* all its queues together)")
            yield Input(scope, id="lim-queue", compact=True)
            yield Label("Reason (kept in the audit log)")
            yield Input(placeholder="why", id="lim-reason", max_length=MAX_REASON_LENGTH, compact=True)
            yield Static("", id="lim-error")
            yield Static("enter apply (audited) · tab next field · esc cancel", classes="muted")

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "Concurrency limit"
        for field in self.query(Input):
            field.cursor_blink = getattr(self.app, "cursor_blink", True)
        self.query_one("#lim-max", Input).focus()

    def _refuse(self, why: str) -> None:
        self.query_one("#lim-error", Static).update(Text(why))

    @on(Input.Submitted)
    def _submit(self, event: Input.Submitted) -> None:
        event.stop()
        if self.applied:
            return
        text = self.query_one("#lim-max", Input).value.strip()
        queue = self.query_one("#lim-queue", Input).value.strip() or EVERY_QUEUE
        reason = self.query_one("#lim-reason", Input).value.strip() or None
        if queue != EVERY_QUEUE and not QUEUE_RE.match(queue):
            self._refuse(f"{queue!r} is not a queue name.")
            return
        existing = next((r for r in self.limits if r["queue"] == queue), None)
        if not text:
            where = "every queue" if queue == EVERY_QUEUE else f"queue {queue}"
            if existing is None:
                self._refuse(f"{self.job_type} has no limit in {where}: nothing to lift.")
                return
            if existing.get("source") == "task":
                # lifted, it came back with the next heartbeat of a worker running the type
                self._refuse(
                    "Its @task declares it, and every worker running the type declares it again: give a number"
                    " instead (workers leave an operator's limit alone)."
                )
                return
            self._apply(LimitRequest(self.job_type, queue, None, reason, existing["max_running"]))
            return
        try:
            n = int(text)
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_LIMIT:
            self._refuse(f"A limit is a whole number from 0 to {MAX_LIMIT:,}.")
            return
        current = None if existing is None else existing["max_running"]
        self._apply(LimitRequest(self.job_type, queue, n, reason, current))

    def _apply(self, request: LimitRequest) -> None:
        self.applied = True
        self.dismiss(request)

    def action_cancel(self) -> None:
        if not self.applied:
            self.applied = True
            self.dismiss(None)
