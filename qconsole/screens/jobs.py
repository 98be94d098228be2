"""``j`` Jobs: filtered by state, type and queue; ``/`` searches ids, keys and error text; ``enter`` opens one."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.widgets import DataTable, Input, Select, Static

from qconsole.backend import ConsoleBackend
from qconsole.screens.base import ConsoleScreen
from qconsole.widgets import fmt
from qconsole.widgets.table import LiveTable, cell, opening_table
from worker_core.models import Job, JobState

LIMIT = 200
#: a search that finds nothing under the filters is asked again without them: this many are counted
ELSEWHERE_LIMIT = 100
COLUMNS = [
    ("id", "id", None),
    ("state", "state", None),
    ("type", "job type", None),
    ("queue", "queue", None),
    ("att", "att", None),
    ("updated", "updated", None),
    ("error", "last error", None),
]


def state_shown(j: Job, now: dt.datetime) -> str:
    """Its state, and for a job waiting for a time to come (enqueued for later, a retry's backoff) when it is
    due: ``· queued in 5m00s``, ``↻ retry in 42s``. A delayed job read as any other queued one, and a lag
    that was not one was looked for."""
    label = fmt.state_label(j.state.value)
    if j.state in (JobState.QUEUED, JobState.RETRY_SCHEDULED) and j.scheduled_at > now:
        return f"{label} in {fmt.duration((j.scheduled_at - now).total_seconds())}"
    return label


@dataclass(frozen=True)
class JobFilter:
    state: str | None = None
    job_type: str | None = None
    queue: str | None = None
    search: str | None = None
    #: the waiting jobs in the order workers claim them, the head of the queue first (n)
    next_first: bool = False

    @property
    def narrowed(self) -> bool:
        """A state, type or queue is set: a search under it may hide what it would find."""
        return bool(self.state or self.job_type or self.queue)

    def describe(self) -> str:
        parts = [
            f"state={self.state}" if self.state else "",
            f"type={self.job_type}" if self.job_type else "",
            f"queue={self.queue}" if self.queue else "",
            f"search={self.search!r}" if self.search else "",
            "next to run first" if self.next_first and not self.search else "",
        ]
        return " ".join(p for p in parts if p) or "all jobs"


class JobsScreen(ConsoleScreen):
    TITLE_TEXT = "Jobs"
    HELP = (
        "Newest activity first; n: the waiting jobs in the order workers claim them (the head of the queue"
        f" first). Filters: state, type, queue; / searches ids, keys and error text. x clears the state, type"
        " and queue filters, the search kept (it then shows what it finds outside them); x again, with none of"
        f" them set, clears the search too: x x is the whole list. ] and [: the next and the previous {LIMIT}"
        " jobs of the list (a page stays where it is while the list moves on)."
    )

    BINDINGS = [
        Binding("slash", "search", "Search", key_display="/"),
        Binding("enter", "open", "Open job", show=False),  # for the help screen: the table's is shown
        Binding("escape", "leave_filters", "Table", show=False),
        Binding(
            "x",
            "clear_filters",
            "Clear filters",
            tooltip="Clear the state, type and queue filters (the search stays); with none set, the search",
        ),
        Binding("n", "next_first", "Next to run", tooltip="The waiting jobs in claim order (n again: newest first)"),
        Binding("right_square_bracket", "next_page", "Next page", key_display="]", tooltip=f"The next {LIMIT} jobs"),
        Binding("left_square_bracket", "previous_page", "Prev page", key_display="[", tooltip="The page before"),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: the last job of each page before the one shown, as it was read: the shown page is the one after
        #: the last of them (keyset paging). Another filter or order is another list: back to its first page
        self.pages: list[Job] = []
        self._filter = JobFilter()
        self.jobs: list[Job] = []
        #: the page ``self.jobs`` is (len(self.pages) when it was read): a `]` before the next page landed
        #: would take the last job of the page before it as the next anchor a second time
        self._shown_page = 0
        self._option_values: dict[str, list[str]] = {}

    @property
    def filter(self) -> JobFilter:
        return self._filter

    @filter.setter
    def filter(self, value: JobFilter) -> None:
        if value != self._filter:
            self.pages = []
        self._filter = value

    def compose_body(self) -> ComposeResult:
        with Horizontal(id="jobs-filters"):
            yield Select(
                [(f"{fmt.state_label(s.value)}", s.value) for s in JobState],
                prompt="any state",
                id="f-state",
                compact=True,
            )
            yield Select([], prompt="any type", id="f-type", compact=True)
            yield Select([], prompt="any queue", id="f-queue", compact=True)
            yield Input(placeholder="/ id, key or error text", id="f-search", compact=True)
        yield Static(id="jobs-status", classes="summary")
        yield opening_table("Open job")(COLUMNS, id="jobs-table")

    def on_mount(self) -> None:
        self.query_one("#f-search", Input).cursor_blink = self.qapp.cursor_blink
        self._sync_widgets()

        def table_unless_searching() -> None:
            # a `/` from another screen, the list shown for the first time, put the search box first: given
            # to the table after it, the letters typed a moment later ran as commands (`c` opened the charts)
            if not isinstance(self.focused, Input):
                self.set_focus(self.query_one(LiveTable))

        self.call_after_refresh(table_unless_searching)

    def on_screen_resume(self) -> None:
        pending = self.qapp.pending_job_filter
        if pending is not None:
            self.qapp.pending_job_filter = None
            self.filter = JobFilter(**pending)
            self._sync_widgets()
        super().on_screen_resume()

    # ---------------------------------------------------------------- filters

    def _options(self, select_id: str, values: list[str]) -> None:
        if self._option_values.get(select_id) == values:
            return
        widget: Select[str] = self.query_one(select_id, Select)
        keep = widget.value
        widget.set_options([(v, v) for v in values])
        self._option_values[select_id] = values
        if isinstance(keep, str) and keep in values:
            widget.value = keep

    def _refresh_options(self) -> None:
        f = self.filter
        types = sorted(set(self.qapp.known_types) | ({f.job_type} if f.job_type else set()))
        queues = sorted(set(self.qapp.known_queues) | ({f.queue} if f.queue else set()))
        self._options("#f-type", types)
        self._options("#f-queue", queues)

    def _sync_widgets(self) -> None:
        """Put ``self.filter`` into the filter widgets (Changed events that follow find nothing new)."""
        try:
            f = self.filter
            self._refresh_options()
            self.query_one("#f-state", Select).value = f.state or Select.NULL
            self.query_one("#f-type", Select).value = f.job_type or Select.NULL
            self.query_one("#f-queue", Select).value = f.queue or Select.NULL
            self.query_one("#f-search", Input).value = f.search or ""
        except NoMatches:
            pass

    def _read_widgets(self) -> JobFilter:
        def val(select_id: str) -> str | None:
            v = self.query_one(select_id, Select).value
            return v if isinstance(v, str) else None

        search = self.query_one("#f-search", Input).value.strip() or None
        return JobFilter(val("#f-state"), val("#f-type"), val("#f-queue"), search, self.filter.next_first)

    @on(Select.Changed)
    def _filter_changed(self, _event: Select.Changed) -> None:
        new = self._read_widgets()
        if new != self.filter:
            self.filter = new
            self.reload()

    @on(Input.Submitted, "#f-search")
    def _search_submitted(self, _event: Input.Submitted) -> None:
        self.filter = self._read_widgets()
        self.query_one(LiveTable).focus()
        self.reload()

    def action_search(self) -> None:
        self.query_one("#f-search", Input).focus()

    def action_leave_filters(self) -> None:
        self.query_one(LiveTable).focus()

    def action_clear_filters(self) -> None:
        """Drop the state, type and queue filters, the search kept: what it finds outside them is then shown
        (the status line's "x clears them"). With none of them set, drop the search: x x is the whole list (the
        search text stayed in its box, the list narrowed, after the "Clear filters" an operator asked for).
        The order (n) stays."""
        f = self.filter
        search = f.search if f.narrowed else None
        self.set_filter(search=search, next_first=f.next_first)

    def action_next_first(self) -> None:
        """The waiting jobs in claim order, the head of the queue first; again: newest activity first."""
        f = self.filter
        self.set_filter(
            state=f.state, job_type=f.job_type, queue=f.queue, search=f.search, next_first=not f.next_first
        )

    def action_next_page(self) -> None:
        if self.filter.search:
            self.notify(
                f"A search shows its newest {LIMIT} matches, not pages: narrow it (or the filters) to reach others",
                title="Not paged",
            )
        elif self._shown_page != len(self.pages):
            return  # the page asked for is on its way: this `]` lands on it
        elif len(self.jobs) < LIMIT:
            self.notify("This is the last page of the list", title="No next page")
        else:
            self.pages.append(self.jobs[-1])
            self.reload()

    def action_previous_page(self) -> None:
        if not self.pages:
            self.notify("This is the first page of the list", title="No page before")
        else:
            self.pages.pop()
            self.reload()

    def set_filter(self, **kwargs: Any) -> None:
        self.filter = JobFilter(**kwargs)
        self._sync_widgets()
        self.reload()

    def show_failure(self, error: str) -> None:
        """The list on screen is the last one read, maybe under another filter than the one now set: said
        on the status line, which stays until a read succeeds (the toast goes after a few seconds)."""
        super().show_failure(error)
        status = Text(no_wrap=True, overflow="ellipsis")
        status.append(" read failed: ", style="bold red")
        status.append(fmt.printable(error))
        status.append(" │ the list below is the last one read, not this filter's")
        self.query_one("#jobs-status", Static).update(status)

    # ---------------------------------------------------------------- reading

    def fetch(self, backend: ConsoleBackend) -> tuple[JobFilter, int, list[Job], list[Job] | None]:
        f, pages = self.filter, len(self.pages)
        after = self.pages[-1] if pages and not f.search else None
        jobs = backend.list_jobs(
            state=f.state,
            job_type=f.job_type,
            queue=f.queue,
            search=f.search,
            limit=LIMIT,
            next_first=f.next_first,
            after=after,
        )
        elsewhere = None
        if not jobs and f.search and f.narrowed:
            # the filters were combined with the search silently: a running job's id pasted under state
            # "dead" said "0 job(s)", as if there were no such job. The search alone tells what they hide
            elsewhere = backend.list_jobs(
                state=None, job_type=None, queue=None, search=f.search, limit=ELSEWHERE_LIMIT
            )
        return f, pages, jobs, elsewhere

    def show(self, data: tuple[JobFilter, int, list[Job], list[Job] | None]) -> None:
        f, page, jobs, elsewhere = data
        self.jobs = jobs
        self._shown_page = page
        now = self.qapp.clock.now()
        wide = self.size.width >= 100
        rows = []
        for j in jobs:
            rows.append(
                (
                    str(j.id),
                    [
                        cell(fmt.short_id(j.id)),
                        cell(state_shown(j, now)),
                        cell(fmt.clip(j.job_type, 30 if wide else 16)),
                        cell(fmt.clip(j.queue, 12 if wide else 8)),
                        cell(f"{j.attempts}/{j.max_attempts}", right=True),
                        cell(fmt.ago(j.updated_at, now).replace(" ago", ""), right=True),
                        cell(fmt.clip(j.last_error or "", 60)),
                    ],
                )
            )
        table = self.query_one(LiveTable)
        table.set_rows(table.fit_last(rows), shows=(f, page))  # the error cut to fit: its detail has it whole
        status = Text(no_wrap=True, overflow="ellipsis")
        status.append(f" {len(jobs)} job(s)", style="bold")
        status.append(self._page_hint(f, page, len(jobs)))
        if elsewhere is not None:
            status.append(" │ ")
            status.append_text(self._elsewhere(f, elsewhere))
        # short: at 80 columns a search of 200 matches left no room for more
        keys = "x clears the search" if f.search and not f.narrowed else "enter opens, / searches"
        status.append(f" │ {f.describe()} │ {keys}")
        self.query_one("#jobs-status", Static).update(status)
        # new job types or queues may have appeared
        self.qapp.known_types = sorted(set(self.qapp.known_types) | {j.job_type for j in jobs})
        self.qapp.known_queues = sorted(set(self.qapp.known_queues) | {j.queue for j in jobs})
        self._refresh_options()

    @staticmethod
    def _page_hint(f: JobFilter, page: int, n: int) -> str:
        """Where the page is in the list, and the keys that move along it."""
        if f.search:
            return f" (the newest {LIMIT} matches)" if n >= LIMIT else ""
        first = page * LIMIT + 1
        if page == 0:
            return f" (first {LIMIT}; ] next page)" if n >= LIMIT else ""
        if n == 0:
            return f" past the first {page * LIMIT} (none left there now; [ back)"
        keys = "[ back, ] next page" if n >= LIMIT else "the last; [ back"
        return f" ({first}-{first + n - 1}: {keys})"

    @staticmethod
    def _elsewhere(f: JobFilter, found: list[Job]) -> Text:
        """What a search that found nothing under the filters finds without them, and how to get there."""
        hint = Text()
        if not found:
            hint.append("no job matches, with or without the filters", style="bold")
            return hint
        n = f"{len(found)}+" if len(found) >= ELSEWHERE_LIMIT else str(len(found))
        where = []
        if f.state:
            where.append(", ".join(dict.fromkeys(fmt.state_label(j.state.value) for j in found)))
        if f.job_type and any(j.job_type != f.job_type for j in found):
            where.append("other types")
        if f.queue and any(j.queue != f.queue for j in found):
            where.append("other queues")
        said = f" ({'; '.join(where)})" if where else ""
        jobs = "1 job matches" if n == "1" else f"{n} jobs match"
        hint.append(f"{jobs} outside the filters{said}: x clears them", style="bold")
        return hint

    # ---------------------------------------------------------------- opening

    @on(DataTable.RowSelected)
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        # the job enter was pressed on, as the event names it: a refresh landing before this handler runs
        # moves the cursor (its row left the list: the cursor stays at its place, on the next job), and the
        # cursor then named another job. Opened even if it left the list: its detail says what became of it
        if event.row_key.value is not None:
            self._open(str(event.row_key.value))

    def action_open(self) -> None:
        key = self.query_one(LiveTable).cursor_key
        if key is not None:
            self._open(key)

    def _open(self, key: str) -> None:
        from qconsole.screens.job_detail import JobDetailScreen

        self.app.push_screen(JobDetailScreen(uuid.UUID(key)))
