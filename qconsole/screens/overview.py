"""``o`` Overview: per queue and job type, counts by state, lag, rates; sparklines of the last hour."""

from __future__ import annotations

from typing import Any

from rich.style import Style
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Label, Sparkline, Static

from qconsole.backend import ConsoleBackend, OverviewData
from qconsole.screens.base import ConsoleScreen
from qconsole.screens.limit import limit_origin
from qconsole.widgets import fmt
from qconsole.widgets.table import LiveTable, cell, opening_table
from worker_core.models import TypeStats
from worker_core.stats import unserved

#: a row whose jobs wait with no live worker that claims its type in its queue: nothing will run them
NO_WORKER = "∅"
#: after the count of running jobs when some of them hold a lease that expired (their worker died or froze);
#: how many, on the detail line
EXPIRED = "✗"

COLUMNS = [
    ("mark", "", 2),
    ("queue", "queue", None),
    ("type", "job type", None),
    ("wait", "wait", None),
    ("run", "run", None),
    ("retry", "rtry", None),
    ("fail", "fail", None),
    ("dead", "dead", None),
    ("lag", "lag", None),
    ("ok", "ok/m", None),
    ("dlq", "dlq/m", None),
    ("exp", "exp/m", None),
]


def row_key(t: TypeStats) -> str:
    return f"{t.queue}\x1f{t.job_type}"


class OverviewScreen(ConsoleScreen):
    TITLE_TEXT = "Overview"
    HELP = (
        "Per queue and job type. wait: queued jobs due now (+N: scheduled later). lag: the age of the type's"
        " oldest job due and waiting. ▲ marks lag or DLQ rate over its threshold; ⏸ a paused queue; ⏸0 a type"
        " held by a limit of 0, ≤N one limited to N running; ∅ a type whose jobs wait (or hold expired"
        " leases) and no live worker runs it in that queue; run N✗: some of them hold a lease that expired"
        " (their worker died or froze). Sparklines: the type's jobs done per minute; the queue's average wait"
        " to start (its last point: the oldest waiting job's age). l opens the type's limit form: enter applies"
        " it (a number, 0 holds the type, empty lifts the limit)."
    )

    BINDINGS = [
        Binding("p", "toggle_pause", "Pause/resume", tooltip="Pause or resume the queue under the cursor"),
        Binding("l", "limit", "Limit", tooltip="Set, change or lift the limit of the type under the cursor"),
        # for the help screen; the footer shows the table's (opening_table)
        Binding("enter", "drill", "Its jobs", show=False),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.data: OverviewData | None = None

    def compose_body(self) -> ComposeResult:
        yield Static(id="ov-summary", classes="summary")
        yield opening_table("Its jobs")(COLUMNS, id="ov-table")
        with Vertical(id="ov-detail"):
            yield Static(id="ov-detail-title", classes="detail-title")
            with Horizontal(classes="spark-row"):
                yield Label("done/min", classes="spark-label")
                yield Sparkline([], id="ov-spark-done", classes="spark")
                yield Label(id="ov-spark-done-val", classes="spark-value")
            with Horizontal(classes="spark-row"):
                # not "lag (s)": the table's lag is the type's oldest waiting job, this the queue's average wait
                # before start: side by side, "lag 16s" and "lag (s) … now 50s" disagreed
                yield Label("wait to start (s)", classes="spark-label")
                yield Sparkline([], id="ov-spark-lag", classes="spark")
                yield Label(id="ov-spark-lag-val", classes="spark-value")

    def on_mount(self) -> None:
        self.query_one(LiveTable).focus()

    def fetch(self, backend: ConsoleBackend) -> OverviewData:
        return backend.overview()

    # ---------------------------------------------------------------- thresholds

    def over_lag(self, t: TypeStats) -> bool:
        return t.oldest_waiting_seconds > self.qapp.thresholds.lag_seconds

    def over_dlq(self, t: TypeStats) -> bool:
        return t.dlq_per_min > self.qapp.thresholds.dlq_per_min

    # ---------------------------------------------------------------- painting

    def show(self, data: OverviewData) -> None:
        self.data = data
        ov = data.overview
        self.qapp.known_queues = [q.name for q in ov.queues]
        self.qapp.known_types = sorted({t.job_type for t in ov.types})
        warn = Style(color=self.app.theme_variables.get("warning"), bold=True)
        wide = self.size.width >= 100
        rows = []
        for t in ov.types:
            lag_bad, dlq_bad = self.over_lag(t), self.over_dlq(t)
            bad = lag_bad or dlq_bad
            st = warn if bad else ""
            queue = fmt.clip(t.queue, 16 if wide else 8) + (f" {fmt.PAUSED}" if t.paused else "")
            # its jobs wait for a worker that does not exist: only the lag said anything, climbing
            nobody = unserved(t)
            marks = (f" {fmt.limit_mark(t.concurrency_limit)}" if t.concurrency_limit is not None else "") + (
                f" {NO_WORKER}" if nobody else ""
            )
            rows.append(
                (
                    row_key(t),
                    [
                        cell(fmt.WARN if bad else fmt.OK, style=st),
                        cell(queue, style=st),
                        # a limit of 0 held the type with nothing to say so: "run 4" for a minute, no worker
                        cell(fmt.clip(t.job_type, 30 if wide else 16) + marks, style=warn if nobody else st),
                        # due now, and those scheduled later apart: "wait 20" counted jobs due in 30 days
                        cell(
                            fmt.count(t.queued_due) + (f" +{fmt.count(t.queued_later)}" if t.queued_later else ""),
                            right=True,
                        ),  # retrying ones have their own column
                        # a dead worker's jobs stay running until their lease is taken over: "run 8" for an hour
                        cell(
                            fmt.count(t.running) + (EXPIRED if t.running_expired else ""),
                            right=True,
                            style=warn if t.running_expired else "",
                        ),
                        cell(fmt.count(t.retry_scheduled), right=True),
                        cell(fmt.count(t.failed), right=True),
                        cell(fmt.count(t.dead_lettered), right=True),
                        cell(
                            (fmt.duration(t.oldest_waiting_seconds) if t.oldest_waiting_seconds else "-")
                            + (fmt.WARN if lag_bad else ""),
                            right=True,
                            style=warn if lag_bad else "",
                        ),
                        cell(fmt.rate(t.throughput_per_min), right=True),
                        cell(
                            fmt.rate(t.dlq_per_min) + (fmt.WARN if dlq_bad else ""),
                            right=True,
                            style=warn if dlq_bad else "",
                        ),
                        cell(fmt.rate(t.lease_expirations_per_min), right=True),
                    ],
                )
            )
        table = self.query_one(LiveTable)
        table.set_rows(rows)
        self._paint_summary()
        self._paint_detail()

    def _paint_summary(self) -> None:
        if self.data is None:
            return
        ov = self.data.overview
        th = self.qapp.thresholds
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f" workers alive {ov.workers_alive}", style="bold")
        nobody = sorted({x.job_type for x in ov.types if unserved(x)})
        if nobody:
            t.append(f" │ {NO_WORKER} no live worker runs: {', '.join(nobody)}", style="bold")
        paused = [q.name for q in ov.queues if q.paused]
        t.append(f" │ queues {len(ov.queues)}")
        if paused:
            t.append(f" ({fmt.PAUSED} {', '.join(paused)})", style="bold")
        held = sorted({x.job_type for x in ov.types if x.concurrency_limit == 0})
        if held:
            t.append(f" │ {fmt.PAUSED}0 held by limit 0: {', '.join(held)}", style="bold")
        if not ov.types:  # before the legends: last, it was cut at 80 columns, the screen empty with no word why
            t.append(" │ no jobs yet", style="bold")
        t.append(f" │ rates/min over {ov.window_minutes}m")
        t.append(f" │ {fmt.WARN} lag>{fmt.duration(th.lag_seconds)} or dlq>{th.dlq_per_min:g}/m")
        self.query_one("#ov-summary", Static).update(t)

    def selected(self) -> TypeStats | None:
        return self._row(self.query_one(LiveTable).cursor_key)

    def _row(self, key: str | None) -> TypeStats | None:
        if self.data is None or key is None:
            return None
        for t in self.data.overview.types:
            if row_key(t) == key:
                return t
        return None

    @on(DataTable.RowHighlighted)
    def _highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._paint_detail()

    def _paint_detail(self) -> None:
        t = self.selected()
        title = self.query_one("#ov-detail-title", Static)
        done = self.query_one("#ov-spark-done", Sparkline)
        lag = self.query_one("#ov-spark-lag", Sparkline)
        if t is None or self.data is None:
            title.update(Text(" no row selected"))
            done.data, lag.data = [], []
            return
        title.update(self._detail_line(t, self.size.width or 80))
        throughput = self.data.overview.throughput.get((t.queue, t.job_type), [])
        lag_series = self.data.lag.get(t.queue, [])
        done.data = throughput
        lag.data = lag_series
        self.query_one("#ov-spark-done-val", Label).update(
            f"max {fmt.rate(max(throughput, default=0))} now {fmt.rate(throughput[-1] if throughput else 0)}"
        )
        self.query_one("#ov-spark-lag-val", Label).update(
            f"max {fmt.duration(max(lag_series, default=0))} now {fmt.duration(lag_series[-1] if lag_series else 0)}"
        )

    def _detail_line(self, t: TypeStats, width: int) -> Text:
        """The row's type and queue, its warnings, then its figures by use, as many as fit in ``width``: cut at
        the screen's edge, "… │ lock w…" at 80 columns, the timings and "▲ dlq over" never showed."""
        th = self.qapp.thresholds
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f" {fmt.clip(t.job_type, max(16, width // 3))} @ {fmt.clip(t.queue, 16)}", style="bold")
        bold = "bold"
        parts: list[tuple[str, str]] = []
        if unserved(t):
            # first: what explains the lag. The names in full where they fit, else the row's own at the start
            if self.data is not None and self.data.overview.workers_alive == 0:
                parts.append((f"{NO_WORKER} no live worker at all", bold))
            else:
                said = f"{NO_WORKER} no live worker runs {t.job_type} in {t.queue}"
                if len(said) + 3 > width - line.cell_len:
                    said = f"{NO_WORKER} no live worker runs it here"
                parts.append((said, bold))
            if t.lost_workers:  # where its workers went
                lost = "its worker is lost" if t.lost_workers == 1 else f"its {t.lost_workers} workers are lost"
                parts.append((f"{lost} (w)", bold))
        if t.running_expired:
            parts.append((f"{EXPIRED} {t.running_expired} of {t.running} leases expired", bold))
        if self.over_lag(t):
            parts.append((f"{fmt.WARN} lag over {fmt.duration(th.lag_seconds)}", bold))
        if self.over_dlq(t):
            parts.append((f"{fmt.WARN} dlq over {th.dlq_per_min:g}/m", bold))
        if t.paused:
            parts.append((self._paused_by(t.queue), bold))
        limit = self._limit_of(t) if t.concurrency_limit is not None else None
        origin = limit_origin(limit, self.data.overview.at if self.data else None) if limit is not None else ""
        if t.concurrency_limit == 0:  # it explains the wait: who held it and why, first
            parts.append((f"{fmt.PAUSED} held (limit 0" + (f", {origin})" if origin else ")"), bold))
        elif t.concurrency_limit is not None:
            parts.append((f"≤{t.concurrency_limit} running (limit)", ""))
        if t.queued_later:
            parts.append((f"+{t.queued_later} queued for later", ""))
        # over the window, per job started: its wait before start (due to start) and its handler's time
        if t.latency_avg_seconds or t.duration_avg_seconds:  # both 0: nothing started in the window
            parts.append((f"wait to start {fmt.elapsed(t.latency_avg_seconds)}", ""))
            parts.append((f"handler {fmt.elapsed(t.duration_avg_seconds)}", ""))
        parts.append((f"retries {fmt.rate(t.retries_per_min)}/m", ""))
        optional = [
            ("timeouts", t.timeouts),
            ("anomalies", t.anomalies),
            ("lease exp", t.lease_expirations),
            ("lock waits", t.lock_contention),
            # apart, as `qconsole stats --json` has them: an enqueue collapsed into a live job, and a job settled
            # by its idempotency key without running its handler ("dedup" counted both)
            ("dedup hits", t.dedup_hits),
            ("idempotency hits", t.idempotency_hits),
        ]
        parts.extend((f"{name} {n}", "") for name, n in optional if n)  # a zero says nothing: left out
        if origin and t.concurrency_limit:  # a limit that holds nothing back entirely: whose, last (cut to fit)
            parts.append((f"limit {origin}", ""))
        room = width - line.cell_len
        for text, style in parts:
            if len(text) + 3 > room and text.startswith((fmt.PAUSED, "limit ")) and room > 3 + 12:
                # who paused it, or held or limited the type, and why: cut where the screen ends, not left out
                # (it is what the engineer asks before resuming); the rest of it is in `qconsole stats` and on `l`
                text = fmt.clip(text, room - 3)
            if len(text) + 3 > room:
                continue  # a later, shorter one may fit
            line.append(" │ ")
            line.append(text, style=style)
            room -= len(text) + 3
        return line

    def _paused_by(self, queue: str) -> str:
        """``⏸ paused 12m ago by alice@10.0.0.5: INC-42 billing double-charges``: the on-call engineer who finds
        a queue paused asks who, since when and why before resuming it."""
        info = next((q for q in self.data.overview.queues if q.name == queue), None) if self.data else None
        said = f"{fmt.PAUSED} paused"
        if info is None or self.data is None:
            return said
        if info.changed_at is not None:
            said += f" {fmt.ago(info.changed_at, self.data.overview.at)}"
        if info.changed_by:
            said += f" by {fmt.printable(info.changed_by)}"
        if info.reason:
            said += f": {fmt.printable(info.reason)}"
        return said

    def _limit_of(self, t: TypeStats) -> dict[str, Any] | None:
        """The limit row the overview's mark shows: of the type's own in this queue and its every-queue one
        (both apply), the one that holds it back most."""
        if self.data is None:
            return None
        rows = [r for r in self.data.overview.limits if r["job_type"] == t.job_type and r["queue"] in (t.queue, "*")]
        return min(rows, key=lambda r: (r["max_running"], r["queue"] == "*"), default=None)

    def on_resize(self) -> None:
        self._paint_detail()

    # ---------------------------------------------------------------- actions

    @on(DataTable.RowSelected)
    def _selected(self, event: DataTable.RowSelected) -> None:
        # the row enter was pressed on, as the event names it, not the cursor: a refresh landing before this
        # handler runs may have moved it (its row gone, the cursor stays at its place, on another row)
        key = None if event.row_key.value is None else str(event.row_key.value)
        t = self._row(key)
        if t is None:
            self.notify("That row is gone (the overview was refreshed meanwhile): nothing opened.",
                        severity="warning", markup=False)  # fmt: skip
            return
        self.qapp.open_jobs(job_type=t.job_type, queue=t.queue)

    def action_drill(self) -> None:
        t = self.selected()
        if t is not None:
            self.qapp.open_jobs(job_type=t.job_type, queue=t.queue)

    def action_toggle_pause(self) -> None:
        t = self.selected()
        if t is None or self.data is None:
            self.notify("No queue under the cursor.", severity="warning")
            return
        self.request_pause(t.queue, not t.paused)

    def action_limit(self) -> None:
        t = self.selected()
        if t is None or self.data is None:
            self.notify("No job type under the cursor.", severity="warning")
            return
        self.ask_limit(t.job_type, self.data.overview.limits, queue=t.queue, now=self.data.overview.at)

    def request_pause(self, queue: str, pause: bool) -> None:
        waiting = 0
        if self.data is not None:
            waiting = sum(q.waiting for q in self.data.overview.queues if q.name == queue)
        verb = "pause" if pause else "resume"
        if pause:
            question = f"Pause queue '{queue}'?"
            details = (
                f"Workers stop claiming its {waiting} waiting job(s); running jobs finish.\n"
                "Touches 1 queue, no job rows. Recorded in the audit log."
            )
        else:
            question = f"Resume queue '{queue}'?"
            details = (
                f"Its {waiting} waiting job(s) become claimable again.\nTouches 1 queue. Recorded in the audit log."
            )
        self.act(
            verb,
            question,
            details,
            lambda b, why: b.set_paused(queue, pause, why),
            lambda r: f"Queue '{queue}' {'paused' if pause else 'resumed'}.",
            touches=1,
        )
