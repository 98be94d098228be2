"""``c`` Charts: retries per job type, attempts distribution, lease expirations and wait to start over time."""

from __future__ import annotations

from collections import Counter

from textual.app import ComposeResult
from textual.containers import Grid

from qconsole.backend import ChartData, ConsoleBackend
from qconsole.screens.base import ConsoleScreen
from qconsole.widgets.charts import BarChart, SeriesChart


class ChartsScreen(ConsoleScreen):
    TITLE_TEXT = "Charts"
    HELP = "The last hour, per minute, from the workers' rollups."

    def compose_body(self) -> ComposeResult:
        with Grid(id="charts-grid"):
            yield SeriesChart("Retries per job type", "retries/min", id="chart-retries")
            yield BarChart("Attempts per finished job", "attempts taken (jobs finished in the last hour)",
                           id="chart-attempts")  # fmt: skip
            yield SeriesChart("Lease expirations per job type", "expirations/min", id="chart-leases")
            yield SeriesChart("Wait to start per queue", "avg wait before start, seconds", id="chart-lag")

    def fetch(self, backend: ConsoleBackend) -> ChartData:
        return backend.charts()

    def show(self, data: ChartData) -> None:
        self.query_one("#chart-retries", SeriesChart).set_series(data.retries)
        self.query_one("#chart-leases", SeriesChart).set_series(data.lease_expirations)
        self.query_one("#chart-lag", SeriesChart).set_series(data.lag)
        total: Counter[int] = Counter()
        for per_type in data.attempts.values():
            total.update(per_type)
        bars = {str(k): float(total[k]) for k in sorted(total)}
        self.query_one("#chart-attempts", BarChart).set_bars(bars)
