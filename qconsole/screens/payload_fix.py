"""The form behind ``E`` on a dead, failed or cancelled job's detail: its payload to correct (a bad VAT id, a
typo in an address), then requeued with it, audited with the reason and the payload's diff (ops.requeue). What
``qconsole requeue ID --payload`` does, without copying JSON through a shell at 3 a.m."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static, TextArea

from qconsole.screens.confirm import MAX_REASON_LENGTH
from qconsole.widgets import fmt
from worker_core.envelope import check_payload
from worker_core.models import Job
from worker_core.ops import same_json


@dataclass(frozen=True)
class PayloadFix:
    payload: dict[str, Any]
    reason: str | None
    #: the payload the fix was made from: the job's is another by now (someone else's fix), it is not requeued
    made_from: dict[str, Any]
    #: the editor's text, kept until the requeue is done: a requeue that failed lost the hand-made fix
    text: str


@dataclass(frozen=True)
class PayloadDraft:
    """A fix whose requeue did not go through (the database away, a lock): the next ``E`` on the job shows it
    again, the reason typed with it too (it was lost, the payload kept)."""

    text: str
    reason: str | None


def editable(payload: dict[str, Any]) -> str:
    return json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False)


class PayloadFixScreen(ModalScreen[PayloadFix | None]):
    DEFAULT_CSS = """
    PayloadFixScreen {
        align: center middle;
        background: $background 60%;
    }
    PayloadFixScreen > Vertical {
        width: 90%;
        max-width: 110;
        height: 90%;
        border: thick $warning;
        background: $panel;
        padding: 0 1;
    }
    PayloadFixScreen TextArea {
        height: 1fr;
    }
    PayloadFixScreen Label {
        margin-top: 1;
    }
    PayloadFixScreen #fix-error {
        color: $error;
        text-style: bold;
    }
    """

    BINDINGS = [
        Binding("ctrl+s", "requeue", "Requeue with it", priority=True),
        Binding("escape", "cancel", "Cancel"),
    ]

    def __init__(self, job: Job, draft: PayloadDraft | None = None) -> None:
        """``draft``: a fix of this job whose requeue did not go through, shown instead of its payload."""
        super().__init__()
        self.job = job
        self.draft = draft
        #: applied: a second ctrl+s, once dismissed, is nothing
        self.applied = False

    def compose(self) -> ComposeResult:
        j = self.job
        head = Text()
        head.append(f"{fmt.short_id(j.id)} {fmt.printable(j.job_type)}", style="bold")
        head.append(f" ({j.state.value}, {j.attempts}/{j.max_attempts} attempts)")
        if j.last_error:
            head.append("\n" + fmt.clip(f"last error: {j.last_error}", 200))
        if self.draft is not None:
            head.append("\nyour fix from before, not applied (its requeue did not go through)", style="bold")
        with Vertical():
            yield Static(head, id="fix-job")
            text = editable(j.payload) if self.draft is None else self.draft.text
            yield TextArea(text, id="fix-payload", soft_wrap=True, show_line_numbers=True)
            yield Label("Reason (kept in the audit log, with the payload's diff)")
            reason = (self.draft.reason if self.draft else None) or ""
            yield Input(reason, placeholder="why", id="fix-reason", max_length=MAX_REASON_LENGTH, compact=True)
            yield Static("", id="fix-error")
            yield Static(
                "ctrl+s requeue with this payload (1 fresh attempt, audited) · tab next field · esc cancel",
                classes="muted",
            )

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "Fix the payload, then requeue"
        area = self.query_one("#fix-payload", TextArea)
        area.cursor_blink = getattr(self.app, "cursor_blink", True)
        self.query_one("#fix-reason", Input).cursor_blink = area.cursor_blink
        area.focus()

    def _refuse(self, why: str) -> None:
        self.query_one("#fix-error", Static).update(Text(why))

    def action_requeue(self) -> None:
        if self.applied:
            return
        text = self.query_one("#fix-payload", TextArea).text
        try:
            payload = json.loads(text)
        except ValueError as e:
            self._refuse(f"Not JSON: {e}. Nothing changed.")
            return
        except RecursionError:  # nested deeper than Python's stack: json.loads gives up (the console died of it)
            self._refuse("Not a payload: nested too deep to read. Nothing changed.")
            return
        problems: list[str] = []
        check_payload(problems, payload)
        if problems:
            self._refuse("; ".join(problems) + ". Nothing changed.")
            return
        if same_json(payload, self.job.payload):  # as JSON: 1 and true differ (Python's == has them equal)
            self._refuse("The payload is unchanged: r on the job requeues it as it is. Nothing changed.")
            return
        reason = self.query_one("#fix-reason", Input).value.strip() or None
        self.applied = True
        self.dismiss(PayloadFix(payload, reason, self.job.payload, text))

    def action_cancel(self) -> None:
        if not self.applied:
            self.applied = True
            self.dismiss(None)
