"""The form behind ``s``: which task modules and queues an embedded worker runs, and how many slots."""

from __future__ import annotations

from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static


@dataclass(frozen=True)
class WorkerRequest:
    tasks: tuple[str, ...]
    queues: tuple[str, ...]
    concurrency: int


def _split(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.replace(" ", ",").split(",") if p.strip())


class StartWorkerScreen(ModalScreen[WorkerRequest | None]):
    DEFAULT_CSS = """
    StartWorkerScreen {
        align: center middle;
        background: $background 60%;
    }
    StartWorkerScreen > Vertical {
        width: 66;
        max-width: 95%;
        height: auto;
        border: thick $primary;
        background: $panel;
        padding: 0 1;
    }
    StartWorkerScreen Label {
        margin-top: 1;
    }
    StartWorkerScreen #sw-error {
        color: $error;
        text-style: bold;
    }
    """

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, tasks: str = "", queues: str = "", concurrency: int = 4) -> None:
        super().__init__()
        self.defaults = (tasks, queues, concurrency)

    def compose(self) -> ComposeResult:
        tasks, queues, concurrency = self.defaults
        with Vertical():
            yield Label("Task modules (comma-separated, importable here)")
            yield Input(tasks, placeholder="e.g. myapp.tasks", id="sw-tasks", compact=True)
            yield Label("Queues (comma-separated; empty: every queue)")
            yield Input(queues, placeholder="e.g. default,mail", id="sw-queues", compact=True)
            yield Label("Concurrency (slots)")
            yield Input(str(concurrency), id="sw-concurrency", type="integer", compact=True)
            yield Static("", id="sw-error")
            yield Static("enter start · tab next field · esc cancel", classes="muted")

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "Start an embedded worker"
        for field in self.query(Input):
            field.cursor_blink = getattr(self.app, "cursor_blink", True)
        self.query_one("#sw-tasks", Input).focus()

    @on(Input.Submitted)
    def _submit(self, _event: Input.Submitted) -> None:
        tasks = _split(self.query_one("#sw-tasks", Input).value)
        queues = _split(self.query_one("#sw-queues", Input).value)
        try:
            concurrency = int(self.query_one("#sw-concurrency", Input).value or "0")
        except ValueError:
            concurrency = 0
        error = self.query_one("#sw-error", Static)
        if not tasks:
            error.update("Give at least one task module.")
            return
        if not 1 <= concurrency <= 512:
            error.update("Concurrency must be between 1 and 512.")
            return
        self.dismiss(WorkerRequest(tasks, queues, concurrency))

    def action_cancel(self) -> None:
        self.dismiss(None)
