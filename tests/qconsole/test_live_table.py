"""The console's tables (LiveTable): a refresh of the same rows updates the cells that changed, in place.

Clearing the table and adding every row again cost the UI thread ~1 s a refresh at 5,000 rows (an overview
of that many queue and type pairs), during which no key was read; bench/console_table.py measures it."""

from __future__ import annotations

import asyncio
from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.widgets.data_table import ColumnKey

from qconsole.widgets.table import LiveTable, cell

COLUMNS = [("name", "name", 8), ("count", "count", None)]


class _TableApp(App[None]):
    def compose(self) -> ComposeResult:
        yield LiveTable(COLUMNS)


def _rows(counts: dict[str, int], warn: str = "") -> list[tuple[str, list[Text]]]:
    return [(k, [cell(k), cell(n, right=True, style="bold red" if k == warn else "")]) for k, n in counts.items()]


def _run(check: Any) -> None:
    async def main() -> None:
        app = _TableApp()
        async with app.run_test(size=(40, 10)) as pilot:
            await check(app.query_one(LiveTable), pilot)

    asyncio.run(main())


def test_the_same_rows_are_updated_in_place_and_show_what_changed() -> None:
    async def check(table: LiveTable, pilot: Any) -> None:
        table.set_rows(_rows({"a": 1, "b": 2, "c": 3}))
        await pilot.pause()
        table.move_cursor(row=2)
        keys = list(table.rows)
        # a count changed; another turned to a warning with the same number (Text == ignores the style)
        table.set_rows(_rows({"a": 10, "b": 2, "c": 3}, warn="b"))
        await pilot.pause()
        assert list(table.rows) == keys and all(a is b for a, b in zip(table.rows, keys, strict=True))
        assert [c.plain for c in table.get_row("a")] == [" a", " 10"]
        assert str(table.get_row("b")[1].style) == "bold red"
        assert table.cursor_key == "c"
        # the warning gone again
        table.set_rows(_rows({"a": 10, "b": 2, "c": 3}))
        assert str(table.get_row("b")[1].style) == ""

    _run(check)


def test_other_rows_or_another_order_rebuild_the_table_keeping_the_cursor_on_its_row() -> None:
    async def check(table: LiveTable, pilot: Any) -> None:
        table.set_rows(_rows({"a": 1, "b": 2, "c": 3}))
        await pilot.pause()
        table.move_cursor(row=1)
        table.set_rows(_rows({"c": 3, "b": 2, "a": 1}))  # another order
        await pilot.pause()
        assert [str(k.value) for k in table.rows] == ["c", "b", "a"] and table.cursor_key == "b"
        table.set_rows(_rows({"c": 3, "b": 2}))  # a row gone
        await pilot.pause()
        assert [str(k.value) for k in table.rows] == ["c", "b"] and table.cursor_key == "b"
        assert [c.plain for c in table.get_row("c")] == [" c", " 3"]
        table.clear()
        table.set_rows(_rows({"c": 4, "b": 2}))  # cleared by a screen meanwhile: added again, not updated
        assert [c.plain for c in table.get_row("c")] == [" c", " 4"]

    _run(check)


def test_a_value_wider_than_its_column_has_been_widens_it_at_once() -> None:
    # a content-sized column is measured before the rows are drawn: the DataTable measured it when idle,
    # after a first paint whose lines it kept at the header's width ("defa…" for "default")
    async def check(table: LiveTable, pilot: Any) -> None:
        table.set_rows(_rows({"a": 1}))
        await pilot.pause()
        column = table.columns[ColumnKey("count")]
        assert column.content_width == len(" count")
        table.set_rows(_rows({"a": 1234567890}))
        await pilot.pause()
        assert column.content_width == len(" 1234567890")
        assert "1234567890" in _screen(pilot)
        table.set_rows(_rows({"a": 7}))  # narrower again: the column keeps its width, it does not jump
        await pilot.pause()
        assert column.content_width == len(" 1234567890")

    _run(check)


def _screen(pilot: Any) -> str:
    return "".join(pilot.app.export_screenshot().split())
