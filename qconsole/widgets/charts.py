"""Time-series and bar charts over textual-plotext (each widget owns its own plotext figure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from textual_plotext import PlotextPlot

#: distinct markers, so series stay apart without color (NO_COLOR)
MARKERS = ("•", "x", "+", "o", "*", "#")
MAX_SERIES = len(MARKERS)


def top_series(series: Mapping[str, Sequence[float]], n: int = MAX_SERIES) -> list[tuple[str, Sequence[float]]]:
    """The ``n`` series with the largest totals, biggest first; all-zero series left out."""
    ranked = sorted(((k, v) for k, v in series.items() if any(v)), key=lambda kv: (-sum(kv[1]), kv[0]))
    return ranked[:n]


class _Chart(PlotextPlot):
    """A titled, bordered plotext figure that draws its empty state once mounted."""

    DEFAULT_CSS = """
    _Chart {
        height: 1fr;
        width: 1fr;
        border: round $panel-lighten-2;
    }
    """

    def __init__(self, title: str, unit: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.chart_title = title
        self.unit = unit

    def on_mount(self) -> None:
        super().on_mount()
        self.border_title = self.chart_title
        self.draw_empty()

    def draw_empty(self) -> None:
        raise NotImplementedError


class SeriesChart(_Chart):
    """Per-minute lines over the last hour, one per key, x in minutes before now."""

    def draw_empty(self) -> None:
        self.set_series({})

    def set_series(self, series: Mapping[str, Sequence[float]]) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        shown = top_series(series)
        for i, (name, values) in enumerate(shown):
            xs = list(range(-len(values) + 1, 1))
            plt.plot(xs, list(values), label=name, marker=MARKERS[i % len(MARKERS)])
        if not shown:
            plt.plot([-59, 0], [0, 0], marker=" ")
            plt.title("no data in the last hour")
        plt.xticks([-60, -45, -30, -15, 0], ["-60m", "-45m", "-30m", "-15m", "now"])
        plt.xlabel(self.unit)
        self.refresh()


class BarChart(_Chart):
    """Counts per category."""

    def draw_empty(self) -> None:
        self.set_bars({})

    def set_bars(self, bars: Mapping[str, float]) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        if bars:
            plt.bar(list(bars), list(bars.values()), marker="█")
        else:
            plt.bar(["-"], [0])
            plt.title("no finished jobs in the last hour")
        plt.xlabel(self.unit)
        self.refresh()
