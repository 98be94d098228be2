"""A DataTable that is refreshed in place: rows are replaced, the cursor stays on the same row key."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable
from textual.widgets.data_table import Column, ColumnKey

from qconsole.widgets import fmt


def cell(value: Any, *, right: bool = False, style: str | Style = "") -> Text:
    """A table cell as plain Text (never markup: job data may hold brackets), with a one-space gutter."""
    text = Text(" " + fmt.printable(str(value)), style=style, no_wrap=True, overflow="ellipsis")
    if right:
        text.justify = "right"
    return text


def _same_cell(a: Any, b: Any) -> bool:
    """Whether a cell shows the same: Text's == compares the text and its spans, not its style or justification
    (a count that turned to a warning, the same number, would have kept its plain style)."""
    if isinstance(a, Text) and isinstance(b, Text):
        return a.plain == b.plain and a.style == b.style and a.justify == b.justify and a.spans == b.spans
    return type(a) is type(b) and bool(a == b)


def _width(value: Any) -> int:
    """The cells a value takes in a row: its longest line (a cell is one line high)."""
    text = value.plain if isinstance(value, Text) else str(value)
    return max(cell_len(line) for line in text.split("\n"))


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
        #: the cells of each row shown, by key, in the order shown (set_rows)
        self._cells: dict[str, list[Any]] = {}

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
        one, and the cursor goes to its top, not to the place it had in the old one. The same rows in the
        same order are updated in place (_update_in_place)."""
        new = [(key, list(cells)) for key, cells in rows]
        same_list = shows == self._shows
        self._shows = shows
        if same_list and self._update_in_place(new):
            return
        keep = self.cursor_key if same_list else None
        old_index = self.cursor_row if same_list else 0
        scroll_y = self.scroll_y if same_list else 0
        self.clear()
        self._fit_columns([cells for _, cells in new])
        index = None
        for i, (key, cells) in enumerate(new):
            self.add_row(*cells, key=key)
            self._cells[key] = cells
            if key == keep:
                index = i
        if index is None:
            index = min(max(old_index, 0), max(self.row_count - 1, 0))
        if self.row_count:
            self.move_cursor(row=index, animate=False, scroll=False)
            self.scroll_to(y=scroll_y, animate=False)

    def _update_in_place(self, rows: list[tuple[str, list[Any]]]) -> bool:
        """The same rows in the same order: only the cells that changed are updated, and the cursor and the
        scroll stay as they are. Clearing the table and adding every row again cost the UI thread ~1 s a
        refresh at 5,000 rows (an overview of that many queue and type pairs), reading no key meanwhile
        (bench/console_table.py). False, with nothing changed, for other rows, another order, or a cell wider
        than its column has been: the table is rebuilt then, its columns measured first (_fit_columns)."""
        n = len(self._column_spec)
        shown = [(k, len(c)) for k, c in self._cells.items()]
        if [(k, len(c)) for k, c in rows] != shown or any(length != n for _, length in shown):
            return False
        changed = [
            (key, i, after)
            for key, cells in rows
            for i, (before, after) in enumerate(zip(self._cells[key], cells, strict=True))
            if not _same_cell(before, after)
        ]
        auto = self._auto_columns()
        if any(i in auto and _width(after) > auto[i].content_width for _, i, after in changed):
            return False
        for key, i, after in changed:
            self.update_cell(key, self._column_spec[i][0], after)
            self._cells[key][i] = after
        return True

    def _auto_columns(self) -> dict[int, Column]:
        """The columns sized to their content (no width given), by position."""
        return {i: self.columns[ColumnKey(key)] for i, (key, _, width) in enumerate(self._column_spec) if width is None}

    def _fit_columns(self, rows: list[list[Any]]) -> None:
        """The content-sized columns set now to their widest cell (or their label), before anything is drawn.
        The DataTable measures them when it is next idle, after a paint whose lines it keeps (its caches do not
        know the widths): a table drawn with its header's widths kept them until its next change. And it only
        ever widens them (its clear() keeps them): a table fitted to the screen (fit_last) overflowed it by
        what a row gone meanwhile had needed. Between two rebuilds (_update_in_place) a column only widens:
        it does not jump back and forth as its values change length."""
        for i, column in self._auto_columns().items():
            widest = max((_width(cells[i]) for cells in rows if i < len(cells)), default=0)
            column.content_width = max(column.label.cell_len, widest)

    def clear(self, columns: bool = False) -> LiveTable:
        self._cells = {}
        super().clear(columns)
        return self

    def room_for_last(self, rows: Sequence[tuple[str, Sequence[Text]]], least: int = 12) -> int:
        """The columns the last column has, gutter included, beside the others' as ``rows`` fill them (at least
        ``least``)."""
        widths = [len(label) + 1 for _, label, _ in self._column_spec[:-1]]
        for _, cells in rows:
            widths = [max(n, c.cell_len) for n, c in zip(widths, cells, strict=False)]
        return max(least, (self.size.width or self.app.size.width) - sum(widths) - 1)  # 1: the scroll bar

    def fit_last(self, rows: list[tuple[str, list[Text]]], least: int = 12) -> list[tuple[str, list[Text]]]:
        """The rows with their last column (cells made by :func:`cell`) cut to the width the other columns leave,
        at least ``least``: a table wider than the screen hid its right end at 80 columns (the rest of the line
        off screen, a horizontal scroll bar over the last row)."""
        room = self.room_for_last(rows, least)
        out = []
        for key, cells in rows:
            last = cells[-1]
            if last.cell_len > room:
                last = cell(fmt.clip(last.plain[1:], room - 1), style=last.style)
            out.append((key, [*cells[:-1], last]))
        return out

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
