"""``t`` Types: the effective contract of each job type, as the workers that run it registered it, with
where each value comes from (default, queue, type), the override's reason and the concurrency limits."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from qconsole.backend import ConsoleBackend, ContractsData
from qconsole.screens.base import ConsoleScreen
from qconsole.widgets import fmt
from qconsole.widgets.table import LiveTable, cell, opening_table
from worker_core.models import TypeContract

COLUMNS = [
    ("type", "job type", None),
    ("queue", "queue", None),
    ("attempts", "tries", None),
    ("timeout", "timeout", None),
    ("lease", "lease", None),
    ("backoff", "backoff", None),
    ("limit", "limit", None),
]
#: one letter per source, so a narrow terminal still says where a value comes from
SOURCE_MARK = {"default": "", "queue": "ᵠ", "type": "ᵗ"}


def mark(source: str) -> str:
    return SOURCE_MARK.get(source.split(":", 1)[0], "?")


def value(c: TypeContract, name: str, unit: str = "") -> str:
    if name not in c.fields:
        return "-"  # a contract registered without it (an older worker's): not a crash of the screen
    v, source = c.fields[name]
    shown = fmt.duration(float(v)) if unit == "s" else (f"{v:g}" if isinstance(v, float) else str(v))
    return shown + mark(source)


def limits_of(data: ContractsData, job_type: str) -> str:
    found = [f"{r['max_running']}" + ("" if r["queue"] == "*" else f"@{r['queue']}")
             for r in data.limits if r["job_type"] == job_type]  # fmt: skip
    return ",".join(found) or "-"


class ContractsScreen(ConsoleScreen):
    TITLE_TEXT = "Job types"
    HELP = (
        "The contract each job type runs under, as its workers registered it. A mark says where a value "
        "comes from: none = the deployment's default, ᵠ = its queue, ᵗ = the type's own @task (with a reason)."
    )

    BINDINGS = [
        Binding("enter", "open", "Its jobs", show=False),  # for the help screen: the table's is shown
        Binding("l", "limit", "Limit", tooltip="Set, change or lift the limit of the type under the cursor"),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.data = ContractsData()

    def action_open(self) -> None:
        self.query_one(LiveTable).action_select_cursor()

    def action_limit(self) -> None:
        key = self.query_one(LiveTable).cursor_key
        if key is None or not any(c.job_type == key for c in self.data.contracts):
            self.notify("No job type under the cursor.", severity="warning")
            return
        self.ask_limit(key, self.data.limits, now=self.qapp.clock.now())

    def compose_body(self) -> ComposeResult:
        yield Static(id="contracts-summary", classes="summary")
        yield opening_table("Its jobs")(COLUMNS, id="contracts-table")
        yield Static(id="contracts-detail", classes="detail")

    def on_mount(self) -> None:
        self.query_one(LiveTable).focus()

    def fetch(self, backend: ConsoleBackend) -> ContractsData:
        return backend.contracts()

    def show(self, data: ContractsData) -> None:
        self.data = data
        rows = [
            (
                c.job_type,
                [
                    cell(c.job_type, style="bold"),
                    cell(c.queue),
                    cell(value(c, "max_attempts"), right=True),
                    cell(value(c, "timeout_seconds", "s"), right=True),
                    cell(value(c, "visibility_timeout_seconds", "s"), right=True),
                    cell(value(c, "backoff")),
                    cell(limits_of(data, c.job_type), right=True),
                ],
            )
            for c in data.contracts
        ]
        self.query_one(LiveTable).set_rows(rows)
        overridden = sum(1 for c in data.contracts if any(not s.startswith("default") for _, s in c.fields.values()))
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f" {len(data.contracts)} type(s)", style="bold")
        t.append(f" │ {overridden} with overrides │ {len(data.limits)} limit(s) │ ᵠ queue ᵗ type")
        self.query_one("#contracts-summary", Static).update(t)
        self._paint_detail()

    @on(DataTable.RowSelected)
    def _open(self, event: DataTable.RowSelected) -> None:
        """enter: the jobs of that type."""
        if event.row_key.value:
            self.qapp.open_jobs(job_type=str(event.row_key.value))

    @on(DataTable.RowHighlighted)
    def _highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._paint_detail()

    def _paint_detail(self) -> None:
        key = self.query_one(LiveTable).cursor_key
        c = next((x for x in self.data.contracts if x.job_type == key), None)
        out = self.query_one("#contracts-detail", Static)
        if c is None:
            out.update(Text(" no job type registered yet: start a worker" if not self.data.contracts else ""))
            return
        t = Text(no_wrap=False)
        t.append(f" {c.job_type}", style="bold")
        t.append(f" @ {c.queue}" + (" │ idempotency key required" if c.requires_idempotency_key else ""))
        t.append(fmt.printable(f" │ why: {c.reason}") + "\n" if c.reason else " │ deployment defaults\n")
        overrides = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                     for k, (v, s) in sorted(c.fields.items()) if not s.startswith("default")]  # fmt: skip
        t.append(" overrides: " + (", ".join(overrides) or "none"))
        if c.reported_by:
            t.append(f"\n registered by {c.reported_by}")
        out.update(t)
