"""Time-series and bar charts over textual-plotext (each widget owns its own plotext figure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from textual_plotext import PlotextPlot

from qconsole.widgets import fmt

#: distinct markers, so series stay apart without color (NO_COLOR)
MARKERS = ("•", "x", "+", "o", "*", "#")
MAX_SERIES = len(MARKERS)
#: plotext draws the legend only if its longest label fits in the canvas, whole: the canvas is the plot's
#: width less its y ticks, and the legend's marker and margins take 5 more (11 to 13 in all, measured)
LEGEND_MARGIN = 16
#: nor does it draw it with more labels than the canvas has rows (the plot's height less 4)
LEGEND_ROWS_MARGIN = 4


def short_label(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters, cut in the middle, keeping more of its end, where job types
    differ: ``com.example.billing.payments.pay.capture`` at 19 is ``com.exa…pay.capture``."""
    return fmt.clip_middle(name, width)


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

    _series: Mapping[str, Sequence[float]] = {}

    def draw_empty(self) -> None:
        self.set_series({})

    def on_resize(self) -> None:
        # the labels are cut to the width the chart has: drawn again at its new one
        self.set_series(self._series)

    def set_series(self, series: Mapping[str, Sequence[float]]) -> None:
        self._series = series
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        # plotext drops the whole legend when one label is wider than the canvas (a 72-character job type
        # hid every series' name even at 120x40) or when there are more labels than rows: cut to fit
        width, height = self.size
        label_width = max(8, width - LEGEND_MARGIN) if width else 24
        rows = max(1, height - LEGEND_ROWS_MARGIN) if height else MAX_SERIES
        shown = top_series(series, min(MAX_SERIES, rows))
        total = len(top_series(series, len(series)))
        self.border_subtitle = f"top {len(shown)} of {total}" if len(shown) < total else ""
        for i, (name, values) in enumerate(shown):
            xs = list(range(-len(values) + 1, 1))
            plt.plot(xs, list(values), label=short_label(name, label_width), marker=MARKERS[i % len(MARKERS)])
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
