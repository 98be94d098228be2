"""``d`` Dead letters: grouped by job type and error fingerprint. ``space`` marks, ``r`` requeues, ``K`` kills,
``X`` discards.

Groups of dead-lettered and failed jobs are what an operator requeues once the cause is fixed, or discards
(cancelled, off this screen, never run again) when they can never succeed; groups of jobs still retrying
with the same error are what an operator kills (cancelled, never retried) when the cause will not go away.
Each acts on the marked groups, or the group under the cursor.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from qconsole.backend import GROUP_READ_LOCK_WAIT_S, ConsoleBackend, describe_error
from qconsole.messages import ActionFailed, GroupJobsRead
from qconsole.screens.base import ACTION_GROUP, ConsoleScreen
from qconsole.widgets import fmt
from qconsole.widgets.table import LiveTable, cell
from worker_core.models import KILLABLE_STATES, REQUEUEABLE_STATES, ActionResult, DeadLetterGroup, DeadLetterGroups

if TYPE_CHECKING:
    from qconsole.app import QConsoleApp

MARK = "●"
COLUMNS = [
    ("mark", "", 2),
    ("state", "state", None),
    ("type", "job type", None),
    ("n", "jobs", None),
    ("first", "first", None),
    ("last", "last", None),
    ("error", "error fingerprint", None),
]
REQUEUEABLE = {s.value for s in REQUEUEABLE_STATES}
KILLABLE = {s.value for s in KILLABLE_STATES}
PAST = {"requeue": "Requeued", "kill": "Killed", "discard": "Discarded"}
KEYS = {"requeue": "r", "kill": "K", "discard": "X"}
#: the SQLSTATE of a lock_timeout
LOCK_NOT_AVAILABLE = "55P03"


def _nothing(backend: ConsoleBackend, reason: str | None) -> ActionResult:
    raise AssertionError("not asked: nothing to act on")


def _no_summary(result: ActionResult) -> str:
    return ""


def group_key(g: DeadLetterGroup) -> str:
    return f"{g.state}\x1f{g.job_type}\x1f{g.fingerprint}"


def audit_groups(groups: list[DeadLetterGroup]) -> list[dict[str, Any]]:
    """The groups an action was asked for, as its audit entry records them (ops.GROUP_FIELDS)."""
    return [{"job_type": g.job_type, "fingerprint": g.fingerprint, "state": g.state, "jobs": g.count} for g in groups]


class DeadLettersScreen(ConsoleScreen):
    TITLE_TEXT = "Dead letters"
    HELP = "Dead-lettered, failed and still-retrying jobs, grouped by type and error fingerprint."

    BINDINGS = [
        Binding("space", "mark", "Mark"),
        Binding("r", "requeue", "Requeue"),
        Binding("K", "kill", "Kill"),
        Binding("X", "discard", "Discard"),
        Binding("e", "show_error", "Error+payload"),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.groups: list[DeadLetterGroup] = []
        self.marked: set[str] = set()
        #: the groups marked are all gone (acted on elsewhere): r/K act on nothing until a group is marked
        #: again, never on the cursor's group in their place
        self.marks_gone = False
        #: the jobs of the groups are being fetched before the question: a second r/K asks nothing more
        self.fetching = False

    def compose_body(self) -> ComposeResult:
        yield Static(id="dl-summary", classes="summary")
        yield LiveTable(COLUMNS, id="dl-table")
        yield Static(id="dl-detail", classes="detail")

    def on_mount(self) -> None:
        self.query_one(LiveTable).focus()

    def fetch(self, backend: ConsoleBackend) -> list[DeadLetterGroup]:
        return backend.dead_letter_groups()

    def show(self, data: list[DeadLetterGroup]) -> None:
        self.groups = data
        keys = {group_key(g) for g in data}
        gone = self.marked - keys
        if gone:
            self.marked &= keys
            self.marks_gone = not self.marked
            left = f"{len(self.marked)} still marked" if self.marked else "r/K act on nothing until you mark again"
            self.notify(
                f"{len(gone)} marked group(s) are gone (requeued, killed or pruned elsewhere): {left}.",
                severity="warning",
                markup=False,
            )
        self._paint()

    def _paint(self) -> None:
        now = self.qapp.clock.now()
        wide = self.size.width >= 100
        rows = []
        for g in self.groups:
            key = group_key(g)
            rows.append(
                (
                    key,
                    [
                        cell(MARK if key in self.marked else " ", style="bold"),
                        cell(fmt.state_label(g.state)),
                        cell(fmt.clip(g.job_type, 28 if wide else 16)),  # as the overview: invoice.generate whole
                        cell(g.count, right=True),
                        cell(fmt.ago(g.first_seen, now).replace(" ago", ""), right=True),
                        cell(fmt.ago(g.last_seen, now).replace(" ago", ""), right=True),
                    ],
                )
            )
        table = self.query_one(LiveTable)
        # the errors in the room the other columns leave (at 80 columns a long type and 5-digit counts ran the
        # table past the screen). Clipped at their ends, two groups of "PermanentError: invalid VAT id <*> for DE"
        # and "… for FR" both read "PermanentError: invalid VAT i…": those that would read alike are cut in the middle
        width = min(70 if wide else 30, table.room_for_last(rows, least=20) - 1)
        errors = fmt.clip_apart([g.fingerprint for g in self.groups], width)
        table.set_rows([(key, [*cells, cell(error)]) for (key, cells), error in zip(rows, errors, strict=True)])
        self._paint_summary()
        self._paint_detail()

    def _paint_summary(self) -> None:
        t = Text(no_wrap=True, overflow="ellipsis")
        groups = self.groups
        if isinstance(groups, DeadLetterGroups):  # what there is in all, not only the groups shown
            total, dead, retrying = groups.total_groups, groups.dead, groups.retrying
        else:
            total = len(groups)
            dead = sum(g.count for g in groups if g.state in REQUEUEABLE)
            retrying = sum(g.count for g in groups if g.state not in REQUEUEABLE)
        shown = f" top {len(groups)} of {total} groups" if total > len(groups) else f" {total} group(s)"
        t.append(shown, style="bold")
        t.append(f" │ {dead} dead/failed │ {retrying} retrying")
        marked = self.targets() if self.marked else []
        if marked:
            t.append(f" │ {MARK} {len(marked)} marked ({sum(g.count for g in marked)} jobs)", style="bold")
        else:
            t.append(" │ space marks; r/K act on marks or cursor")
        self.query_one("#dl-summary", Static).update(t)

    def current(self) -> DeadLetterGroup | None:
        return self._group(self.query_one(LiveTable).cursor_key)

    def _group(self, key: str | None) -> DeadLetterGroup | None:
        return next((g for g in self.groups if group_key(g) == key), None)

    @on(DataTable.RowHighlighted)
    def _highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._paint_detail()

    def _paint_detail(self) -> None:
        g = self.current()
        detail = self.query_one("#dl-detail", Static)
        if g is None:
            detail.update(Text(" no dead letters" if not self.groups else ""))
            return
        now = self.qapp.clock.now()
        t = Text()
        t.append(f" {g.job_type}", style="bold")
        t.append(f" · {g.count} {g.state} · first {fmt.stamp(g.first_seen)} · last {fmt.ago(g.last_seen, now)}\n")
        t.append(" latest: ", style="bold")
        t.append(fmt.clip(g.sample_error, 400))
        detail.update(t)

    # ---------------------------------------------------------------- marking and acting

    def targets(self) -> list[DeadLetterGroup]:
        """The marked groups, or the group under the cursor."""
        if self.marked:
            return [g for g in self.groups if group_key(g) in self.marked]
        g = self.current()
        return [g] if g is not None else []

    def action_mark(self) -> None:
        g = self.current()
        if g is None:
            return
        key = group_key(g)
        self.marked ^= {key}
        self.marks_gone = False
        self._paint()
        table = self.query_one(LiveTable)
        if table.cursor_row < table.row_count - 1:
            table.move_cursor(row=table.cursor_row + 1)

    def after_action(self, result: ActionResult | None) -> None:
        self.marked.clear()
        self.marks_gone = False

    @staticmethod
    def _describe(groups: list[DeadLetterGroup], listed: list[DeadLetterGroup] | None = None) -> str:
        """A line per group (five at most): its jobs, as read for the question when ``listed`` (the groups as
        the screen listed them) is given, with how many it listed where that differs: a retrying group loses the
        jobs a worker claims meanwhile, and "Kill 12 job(s)" above a line that said 13 contradicted itself."""
        lines = []
        for i, g in enumerate(groups[:5]):
            line = f"{g.count:>6}  " + fmt.clip(f"{g.job_type}: {g.fingerprint}", 50)
            if listed is not None and listed[i].count != g.count:
                line += f" ({listed[i].count} listed: moved on since)"
            lines.append(line)
        if len(groups) > 5:
            lines.append(f"  ... and {len(groups) - 5} more group(s)")
        return "\n".join(lines)

    def _run_on_groups(self, name: str, allowed: set[str], verb: str, why_not: str, outcome: str) -> None:
        if self.fetching:  # the first press's question is on its way
            self.notify("Still reading the jobs of the group(s), for the question…", markup=False)
            return
        if self.marks_gone and not self.marked:
            self.notify(
                f"The group(s) you marked are gone: nothing to {name}. Mark again with space.",
                severity="warning",
                markup=False,
            )
            return
        targets = self.targets()
        if not targets:
            self.notify("No group under the cursor.", severity="warning")
            return
        ok = [g for g in targets if g.state in allowed]
        skipped = [g for g in targets if g.state not in allowed]
        notes = outcome
        if skipped:
            notes += f"\nSkipped: {len(skipped)} group(s) ({sum(g.count for g in skipped)} jobs) {why_not}."
        if not ok or self.qapp.read_only:
            # act() refuses (read-only) or says there is nothing to do
            details = self._describe(ok) + "\n" + notes if ok else f"the selected group(s) {why_not}"
            self.act(name, "", details, _nothing, _no_summary, 0)
            return
        # the jobs are fetched before the question, which names exactly them: a job that joins a group while
        # the operator reads it is not acted on unasked
        self.fetching = True
        # said at once: behind a lock the read may take seconds, and a key that did nothing visible was pressed
        # again, or the question came long after it was forgotten
        self.notify(self._reading_notice(ok), markup=False, timeout=30)
        self._fetch_then_ask(self.qapp, name, ok, verb, notes)

    @staticmethod
    def _reading_notice(groups: list[DeadLetterGroup]) -> str:
        return f"Reading the jobs of {len(groups)} group(s), to ask…"

    @work(thread=True, exit_on_error=False, group=ACTION_GROUP, description="dead letters: the jobs of the groups")
    def _fetch_then_ask(
        self, app: QConsoleApp, name: str, groups: list[DeadLetterGroup], verb: str, notes: str
    ) -> None:
        # on a connection of its own, whatever action runs meanwhile (DatabaseBackend.group_job_ids); a message,
        # not a call waiting for the UI thread: this thread never waits for an app that is quitting
        try:
            each = [(g, app.backend.group_job_ids(g)) for g in groups]
        except Exception as e:
            error = describe_error(e, getattr(app.backend, "dsn", None))
            if getattr(e, "sqlstate", None) == LOCK_NOT_AVAILABLE:
                error = (
                    f"their jobs could not be read: a lock on the jobs table held the read up over"
                    f" {GROUP_READ_LOCK_WAIT_S:g}s (a migration, VACUUM FULL or LOCK TABLE? pg_locks says who)."
                    f" Nothing changed; {KEYS[name]} asks again. ({error})"
                )
            self.post_message(GroupJobsRead(name, groups, verb, notes, [], error))
            return
        ids = list(dict.fromkeys(i for _, group_ids in each for i in group_ids))
        # each group with the count of its jobs as read now, which the audit entry says (audit_groups)
        read = [dataclasses.replace(g, count=len(group_ids)) for g, group_ids in each]
        details = self._describe(read, listed=groups) + "\n" + notes
        self.post_message(GroupJobsRead(name, read, verb, details, ids))

    @on(GroupJobsRead)
    def _ask(self, message: GroupJobsRead) -> None:
        message.stop()
        self.fetching = False  # from here the question is on the screen: it takes the keys
        self.qapp._dismiss_notice(self._reading_notice(message.groups))
        name, groups, verb, details, ids = message.action, message.groups, message.verb, message.details, message.ids
        if message.error is not None:
            self.qapp.say_outcome(ActionFailed(name, message.error))
            self.reload()
            return
        if not ids:
            self.notify(
                f"Nothing left to {name}: the jobs of the group(s) moved on since they were listed (a retry"
                " claimed, a job settled). Nothing changed.",
                severity="warning",
                markup=False,
            )
            self.reload()
            return
        if self.app.screen is not self:
            # the operator went elsewhere meanwhile: the question is asked on the screen it was asked for or
            # not at all (over another screen, a `y` meant for that one would answer it)
            key = KEYS[name]
            self.notify(
                f"{name.capitalize()} not asked: you left the dead letters while their jobs were read."
                f" Nothing changed; {key} there asks again.",
                severity="warning",
                markup=False,
            )
            return

        # the audit entry says which groups these were: "requeue 43 job(s) budget=1" did not, and the handover
        # could tell only by looking up every id
        said = audit_groups(groups)

        def run(backend: ConsoleBackend, reason: str | None) -> ActionResult:
            if name == "requeue":
                return backend.requeue(ids, reason, groups=said)
            if name == "kill":
                return backend.kill(ids, reason, groups=said)
            return backend.discard(ids, reason, groups=said)

        self.act(
            name,
            f"{verb} {len(ids)} job(s) in {len(groups)} group(s)?",
            details,
            run,
            lambda r: (
                f"{PAST[name]} {r.count} job(s)." + (f" {r.skipped_summary()}." if r.skipped else "")
            ),
            touches=len(ids),
        )

    def action_requeue(self) -> None:
        self._run_on_groups(
            "requeue",
            REQUEUEABLE,
            "Requeue",
            "are still retrying: kill them instead",
            "Back to queued with 1 fresh attempt each; their error history is kept.",
        )

    def action_kill(self) -> None:
        self._run_on_groups(
            "kill",
            KILLABLE,
            "Kill",
            "are already dead or failed: requeue (r) or discard (X) them instead",
            "Cancelled now and never retried; a running one stops within a heartbeat.",
        )

    def action_discard(self) -> None:
        self._run_on_groups(
            "discard",
            REQUEUEABLE - {"cancelled"},
            "Discard",
            "are still retrying: kill (K) them instead",
            "Cancelled: off the dead letters, never run again; their history keeps what they died of, and a"
            " requeue (qconsole requeue ID) brings one back.",
        )

    @on(DataTable.RowSelected)
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        # the group enter was pressed on, as the event names it, not the cursor: a refresh landing before this
        # handler runs may have moved it (the group requeued meanwhile, the cursor on the next one)
        g = self._group(None if event.row_key.value is None else str(event.row_key.value))
        if g is None:
            self.notify("That group is gone (its jobs were requeued, killed or pruned meanwhile): nothing opened.",
                        severity="warning", markup=False)  # fmt: skip
            return
        self._show_error(g)

    def action_show_error(self) -> None:
        g = self.current()
        if g is not None:
            self._show_error(g)

    def _show_error(self, g: DeadLetterGroup) -> None:
        if not g.job_ids:
            return
        from qconsole.screens.job_detail import JobDetailScreen

        note = f"Latest of {g.count} {g.state} job(s) in group: {g.fingerprint}"
        self.app.push_screen(JobDetailScreen(g.job_ids[0], note=note))
