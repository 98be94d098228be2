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
    """The limit the form opens on: the row's queue's own if it has one, else every queue's."""
    if queue is not None and any(r["queue"] == queue for r in limits):
        return queue
    return EVERY_QUEUE


class LimitScreen(ModalScreen[LimitRequest | None]):
    DEFAULT_CSS = """
    LimitScreen {
        align: center middle;
        background: $background 60%;
    }
    LimitScreen > Vertical {
        width: 70;
        max-width: 95%;
        height: auto;
        border: thick $warning;
        background: $panel;
        padding: 0 1;
    }
    LimitScreen Label {
        margin-top: 1;
    }
    LimitScreen #lim-now {
        margin-top: 1;
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

    def compose(self) -> ComposeResult:
        scope = default_scope(self.limits, self.queue)
        current = next((r for r in self.limits if r["queue"] == scope), None)
        now = Text()
        now.append(f"{self.job_type}", style="bold")
        now.append(": at most so many of its jobs run at once, in the whole fleet; the rest wait.\n")
        if self.limits:
            now.append("Now: " + "; ".join(describe_limit(r, self.now) for r in self.limits))
        else:
            now.append("Now: no limit.")
        with Vertical():
            yield Static(now, id="lim-now")
            yield Label("At most running (0 holds them all; empty lifts the limit)")
            yield Input(
                "" if current is None else str(current["max_running"]),
                placeholder="none: type a number",
                id="lim-max",
                type="integer",
                compact=True,
            )
            yield Label("In queue (* all its queues together; a queue's own limit applies too)")
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
            self.dismiss(LimitRequest(self.job_type, queue, None, reason))
            return
        try:
            n = int(text)
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_LIMIT:
            self._refuse(f"A limit is a whole number from 0 to {MAX_LIMIT:,}.")
            return
        self.dismiss(LimitRequest(self.job_type, queue, n, reason))

    def action_cancel(self) -> None:
        self.dismiss(None)
