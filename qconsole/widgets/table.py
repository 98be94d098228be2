"""A DataTable that is refreshed in place: rows are replaced, the cursor stays on the same row key."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable

from qconsole.widgets import fmt


def cell(value: Any, *, right: bool = False, style: str | Style = "") -> Text:
    """A table cell as plain Text (never markup: job data may hold brackets), with a one-space gutter."""
    text = Text(" " + fmt.printable(str(value)), style=style, no_wrap=True, overflow="ellipsis")
    if right:
        text.justify = "right"
    return text


class LiveTable(DataTable[Any]):
    """A row-cursor table whose columns have one space of gutter and whose rows are swapped on refresh."""

    # not in the footer: a table whose rows open something says what (opening_table); on the workers and
    # audit screens "⏎ Open" was shown, and did nothing
    BINDINGS = [Binding("enter", "select_cursor", "Open", show=False)]

    DEFAULT_CSS = """
    LiveTable {
        height: 1fr;
        scrollbar-size-vertical: 1;
    }
    LiveTable > .datatable--header {
        text-style: bold;
    }
    """

    def __init__(self, columns: Sequence[tuple[str, str, int | None]], **kwargs: Any) -> None:
        """``columns``: (key, label, width or None for automatic)."""
        kwargs.setdefault("cursor_type", "row")
        kwargs.setdefault("zebra_stripes", False)
        kwargs.setdefault("cell_padding", 0)
        super().__init__(**kwargs)
        self._column_spec = list(columns)
        #: what the rows show (set_rows)
        self._shows: Any = None

    def on_mount(self) -> None:
        for key, label, width in self._column_spec:
            self.add_column(Text(" " + label), key=key, width=width)

    @property
    def cursor_key(self) -> str | None:
        if self.row_count == 0:
            return None
        try:
            row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        except Exception:
            return None
        return None if row_key.value is None else str(row_key.value)

    def set_rows(self, rows: Iterable[tuple[str, Sequence[Any]]], shows: Any = None) -> None:
        """Replace the rows; the cursor stays on its row's key, or, where that row is gone (another operator
        acted on it), at the same place: not at the top, where the next ``enter`` would open a row nobody
        was looking at. ``shows`` says what the rows are (a filter): when it changes, the list is another
        one, and the cursor goes to its top, not to the place it had in the old one."""
        same_list = shows == self._shows
        self._shows = shows
        keep = self.cursor_key if same_list else None
        old_index = self.cursor_row if same_list else 0
        scroll_y = self.scroll_y if same_list else 0
        self.clear()
        index = None
        for i, (key, cells) in enumerate(rows):
            self.add_row(*cells, key=key)
            if key == keep:
                index = i
        if index is None:
            index = min(max(old_index, 0), max(self.row_count - 1, 0))
        if self.row_count:
            self.move_cursor(row=index, animate=False, scroll=False)
            self.scroll_to(y=scroll_y, animate=False)

    def select_key(self, key: str) -> None:
        """Put the cursor on the row with this key, if there is one."""
        try:
            index = self.get_row_index(key)
        except Exception:
            return
        self.move_cursor(row=index)


def opening_table(label: str) -> type[LiveTable]:
    """A LiveTable whose rows open something (its screen handles RowSelected), named by ``label`` in the
    footer. The table's own binding is the one shown: a screen's binding of enter is shadowed by it."""
    return type("LiveTable", (LiveTable,), {"BINDINGS": [Binding("enter", "select_cursor", label)]})
