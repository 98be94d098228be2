"""The UI thread's time for one refresh of a console table (LiveTable.set_rows, then the paint), no database.

A refresh of the same rows updates the cells that changed in place; other rows, or another filter, rebuild
the table (clear, then every row added again), as every refresh did before. The overview of a deployment
with 5,000 queue and type pairs spent ~1 s of the UI thread on each refresh (every 2 s), reading no key.

    bench/.venv/bin/python bench/console_table.py [--rows 500,5000] [--rounds 5]

Prints, per table size, the median milliseconds of a rebuild and of an in-place refresh where none, a tenth
or every row changed, and the ratio of each to the rebuild.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from textual.app import App, ComposeResult

from qconsole.widgets.table import LiveTable, cell

#: the overview's shape: 12 columns of short text
COLUMNS = [(f"c{i}", f"col{i}", 7) for i in range(12)]


class _TableApp(App[None]):
    def compose(self) -> ComposeResult:
        yield LiveTable(COLUMNS)


def _rows(n: int, changed: float, generation: int) -> list[tuple[str, list[Any]]]:
    """``n`` rows; the first ``changed`` share of them show ``generation`` in every cell."""
    cut = int(n * changed)
    return [(f"k{i}", [cell(f"{i % 997}.{generation if i < cut else 0}") for _ in COLUMNS]) for i in range(n)]


async def _measure(sizes: list[int], rounds: int) -> list[tuple[int, str, float]]:
    out = []
    app = _TableApp()
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.query_one(LiveTable)
        for n in sizes:
            cases: list[tuple[str, float, bool]] = [
                ("rebuild", 1.0, True),
                ("in place, none changed", 0.0, False),
                ("in place, 10% changed", 0.1, False),
                ("in place, all changed", 1.0, False),
            ]
            for name, changed, rebuild in cases:
                times = []
                table.set_rows(_rows(n, 0, 0), shows=("base", n))
                await pilot.pause()
                for generation in range(1, rounds + 1):
                    rows = _rows(n, changed, generation)
                    began = time.perf_counter()
                    # a new `shows` each time: another list, rebuilt (the cursor goes to its top)
                    table.set_rows(rows, shows=("rebuild", generation) if rebuild else ("base", n))
                    await pilot.pause()
                    times.append(time.perf_counter() - began)
                out.append((n, name, statistics.median(times) * 1000))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="500,5000", help="table sizes, comma-separated (default 500,5000)")
    p.add_argument("--rounds", type=int, default=5, help="refreshes per case, the median is printed (default 5)")
    args = p.parse_args()
    sizes = [int(x) for x in args.rows.split(",")]
    results = asyncio.run(_measure(sizes, args.rounds))
    rebuild = {n: ms for n, name, ms in results if name == "rebuild"}
    print(f"{'rows':>6}  {'refresh':<24} {'UI thread ms':>12}  {'x rebuild':>9}")
    for n, name, ms in results:
        print(f"{n:>6}  {name:<24} {ms:>12.0f}  {ms / rebuild[n]:>9.2f}")


if __name__ == "__main__":
    main()
