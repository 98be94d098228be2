"""``?``: every key of every screen, in one place."""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.console import Group, RenderableType
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
        # each section's title on a line of its own and its text across the whole box, then its keys: in three
        # columns (title, key, text) the text had 40 of the 72 columns at 80x24, a line of help per 5 words
        sections = [(title, about, _rows(bindings)) for title, about, bindings in self.sections]
        sections = [s for s in sections if s[1] or s[2]]
        sections.append(("Also", "", [("ctrl+p", "command palette: every action above, by name")]))
        key_width = max(cell_len(key) for _, _, rows in sections for key, _ in rows)
        parts: list[RenderableType] = []
        for title, about, rows in sections:
            parts.append(Text(title, style="bold underline"))
            if about:
                parts.append(Text(about, style="italic"))
            keys = Table.grid(padding=(0, 2))
            keys.add_column(style="bold", no_wrap=True, justify="right", width=key_width)
            keys.add_column()
            for key, desc in rows:
                keys.add_row(key, desc)
            parts.append(keys)
            parts.append(Text(""))
        with VerticalScroll():
            yield Static(Group(*parts[:-1]))

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).border_title = "Keys (esc closes)"

    def action_close(self) -> None:
        self.dismiss()
