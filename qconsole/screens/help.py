"""``?``: every key of every screen, in one place."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


def _rows(bindings: list[BindingType]) -> list[tuple[str, str]]:
    out = []
    for b in bindings:
        if isinstance(b, Binding) and b.description:
            out.append((b.key_display or b.key, b.description))
    return out


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
        background: $background 60%;
    }
    HelpScreen > VerticalScroll {
        width: 76;
        max-width: 100%;
        height: auto;
        max-height: 100%;
        border: thick $primary;
        background: $panel;
        padding: 0 1;
    }
    """

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("question_mark", "close", "Close", key_display="?", show=False),
        Binding("q", "close", "Close", show=False),
    ]

    def __init__(self, sections: list[tuple[str, str, list[BindingType]]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sections = sections

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(no_wrap=True)
        table.add_column(style="bold", no_wrap=True, justify="right")
        table.add_column()
        for title, about, bindings in self.sections:
            rows = _rows(bindings)
            if not rows and not about:
                continue
            table.add_row(Text(title, style="bold underline"), "", Text(about, style="italic"))
            for key, desc in rows:
                table.add_row("", key, desc)
        table.add_row("", "", "")
        table.add_row(Text("Also", style="bold underline"), "ctrl+p", "command palette: every action above, by name")
        with VerticalScroll():
            yield Static(table)

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).border_title = "Keys (esc closes)"

    def action_close(self) -> None:
        self.dismiss()
