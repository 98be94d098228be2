"""The confirmation every row-changing action (and the stop of an embedded worker) goes through: says what it
touches, waits for ``y``."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static


class ConfirmScreen(ModalScreen[bool]):
    """``dismiss(True)`` on ``y``; ``n`` or ``escape`` dismiss with False."""

    DEFAULT_CSS = """
    ConfirmScreen {
        align: center middle;
        background: $background 60%;
    }
    ConfirmScreen > Vertical {
        width: 64;
        max-width: 95%;
        height: auto;
        border: thick $warning;
        background: $panel;
        padding: 0 1;
    }
    ConfirmScreen #confirm-question {
        text-style: bold;
        margin-bottom: 1;
    }
    ConfirmScreen #confirm-keys {
        margin-top: 1;
        color: $text-muted;
    }
    """

    BINDINGS = [
        Binding("y", "answer(True)", "Yes, do it"),
        Binding("n", "answer(False)", "No"),
        Binding("escape", "answer(False)", "Cancel", show=False),
    ]

    def __init__(self, question: str, details: str = "", *, action: str = "confirm") -> None:
        super().__init__()
        self.question = question
        self.details = details
        self.action_name = action

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(self.question), id="confirm-question")
            if self.details:
                yield Static(Text(self.details), id="confirm-details")
            keys = Text()
            keys.append("y", style="bold reverse")
            keys.append(f" {self.action_name}   ")
            keys.append("n", style="bold reverse")
            keys.append(" / ")
            keys.append("esc", style="bold reverse")
            keys.append(" cancel")
            yield Static(keys, id="confirm-keys")

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "Confirm"

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
