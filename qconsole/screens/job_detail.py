"""Job detail: envelope, payload as pretty JSON, every attempt's error, timestamps, lease and lock."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from rich.console import Group, RenderableType
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from qconsole.backend import ConsoleBackend
from qconsole.output import expired_lease_said, waiting_said
from qconsole.screens.base import ConsoleScreen
from qconsole.screens.workers import db_state
from qconsole.widgets import fmt
from worker_core.models import KILLABLE_STATES, REQUEUEABLE_STATES, ActionResult, Job, JobState
from worker_core.stats import JobHolders

#: what the detail shows of a job, at most (the CLI's `qconsole job ID` shows it all)
MAX_PAYLOAD_LINES = 200
MAX_PAYLOAD_CHARS = 20_000
MAX_ERRORS_SHOWN = 20
MAX_ERROR_CHARS = 1_000


#: dead letters and failed jobs an operator gives up on: discarded to cancelled (ops.discard, as the dead
#: letters screen's X)
DISCARDABLE_STATES = (JobState.DEAD_LETTERED, JobState.FAILED)


def _t(text: str, **kwargs: Any) -> Text:
    """Text of job data: escape sequences and control characters never reach the terminal."""
    return Text(fmt.printable(text), **kwargs)


def _cut(text: str, limit: int) -> str:
    """At most ``limit`` characters, lines kept (fmt.clip makes one line)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _kv(rows: list[tuple[str, Any]]) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for k, v in rows:
        table.add_row(k, v if isinstance(v, Text) else _t("-" if v is None or v == "" else str(v)))
    return table


def _section(title: str) -> Text:
    return _t(f"── {title} ", style="bold")


def _until(expires_at: Any, left: float) -> str:
    return f"until {fmt.hms(expires_at)} UTC (expires in {fmt.duration(left)})"


def lock_said(job: Job, holder: dict[str, Any]) -> str:
    """Who holds the job's lock_key (stats.lock_key_holder), whichever job that is."""
    key, held_by, left = holder["lock_key"], holder["held_by"], holder["expires_in_seconds"]
    if held_by == "nobody":
        return f"{key} not held"
    if held_by == "expired":
        return f"{key}: its lease expired {fmt.duration(-left)} ago (free to take)"
    if held_by == "this_job":
        return f"{key} held by this job {_until(holder['expires_at'], left)}"
    if held_by == "no_job":
        who = "a lease of no job (a single_flight refill, another program)"
    else:
        what = f"{holder['job_type']}, {holder['job_state']}" if holder["job_type"] else "gone: pruned"
        who = f"job {fmt.short_id(holder['job_id'])} ({what})"
    waits = ": this job waits for it" if job.state in (JobState.QUEUED, JobState.RETRY_SCHEDULED) else ""
    return f"{key} held by {who} {_until(holder['expires_at'], left)}{waits}"


def worker_said(job: Job, holders: JobHolders) -> str:
    """The worker holding the job's lease, as the workers screen says it (db_state, stats.is_lost): live, LOST
    since its heartbeat went stale, or stopped."""
    w, now = holders.worker, holders.at
    if w is None:
        return f"{job.locked_by} (no such worker: pruned a day after its last heartbeat)"
    if w.stopped_at is not None:
        return f"{job.locked_by}, {db_state(w)} {fmt.ago(w.stopped_at, now)}"
    if w.lost:
        since = w.lost_since
        beat = fmt.ago(w.last_heartbeat_at, now)
        return f"{job.locked_by}, {db_state(w)} since {fmt.hms(since)} UTC (last heartbeat {beat})"
    return f"{job.locked_by}, {db_state(w)}"


class JobDetailScreen(ConsoleScreen):
    TITLE_TEXT = "Job"
    HELP = (
        "One job: envelope, payload, every attempt's error, lease and lock. E opens a dead, failed or cancelled"
        " job's payload in an editor: ctrl+s requeues it with the corrected payload, esc cancels."
    )
    #: a failed read's error replaces the job on screen (show_failure): nothing stale is left to mark
    MARKS_STALE_DATA = False

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("r", "requeue", "Requeue"),
        Binding("K", "kill", "Kill"),
        Binding("X", "discard", "Discard"),
        Binding("E", "fix_payload", "Fix+requeue", tooltip="Correct its payload, then requeue it with that"),
    ]

    #: the states each action takes: the key line offers only the actions that apply to the job as shown
    #: (a dead letter's offered K, which answered "Nothing to kill", and not X, which it takes)
    ACTION_STATES: dict[str, tuple[JobState, ...]] = {
        "requeue": REQUEUEABLE_STATES,
        "kill": KILLABLE_STATES,
        "discard": DISCARDABLE_STATES,
        "fix_payload": REQUEUEABLE_STATES,
    }

    def __init__(self, job_id: uuid.UUID, note: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job_id = job_id
        self.note = note
        self.job: Job | None = None

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="job-scroll"):
            yield Static(_t(f" loading job {self.job_id}…"), id="job-body")

    def on_mount(self) -> None:
        self.query_one("#job-scroll").focus()

    def fetch(self, backend: ConsoleBackend) -> tuple[Job, JobHolders]:
        """One call: the job and who holds what it needs, with why it waits or what holds its expired lease back
        (stats.job_holders: a paused queue, a limit, no live worker...), under the reads' statement timeout."""
        return backend.get_job(self.job_id)

    def show(self, data: tuple[Job, JobHolders]) -> None:
        job, holders = data
        self.job = job
        self.query_one("#job-body", Static).update(self.render_job(job, holders))
        self.refresh_bindings()  # the keys its state takes (check_action)

    #: the errors and the payload as last rendered, and the job version they are of (see _heavy_parts)
    _heavy: tuple[tuple[Any, ...], list[RenderableType]] | None = None

    def _heavy_parts(self, job: Job) -> list[RenderableType]:
        """The errors table and the payload, clipped (a payload of 277 kB took 23 s to show, and stalled the
        whole console for seconds on every refresh), and made again only when the job changed."""
        version = (job.updated_at, len(job.errors), self.app.current_theme.dark)
        if self._heavy is not None and self._heavy[0] == version:
            return self._heavy[1]
        parts: list[RenderableType] = []
        if job.errors:
            table = Table(box=None, padding=(0, 1), show_edge=False, expand=True)
            table.add_column("#", justify="right", no_wrap=True)
            table.add_column("kind", no_wrap=True)
            table.add_column("error", ratio=1, overflow="fold")
            table.add_column("worker / when", no_wrap=False, max_width=28)
            shown = job.errors[-MAX_ERRORS_SHOWN:]
            if len(shown) < len(job.errors):
                more = len(job.errors) - len(shown)
                table.add_row("", "", _t(f"… {more} earlier attempt(s): qconsole job {job.id}", style="italic"), "")
            for e in shown:
                message = _cut(f"{e.error_class}: {e.message}", MAX_ERROR_CHARS)
                table.add_row(str(e.attempt), e.kind, _t(message), _t(f"{e.worker or '-'}\n{fmt.hms(e.at)} UTC"))
            parts.append(table)
        else:
            parts.append(_t("none"))
        parts.append(_section("payload"))
        theme = "ansi_dark" if self.app.current_theme.dark else "ansi_light"
        text = fmt.pretty_json(job.payload)
        lines = text.splitlines()
        if len(lines) > MAX_PAYLOAD_LINES or len(text) > MAX_PAYLOAD_CHARS:
            kept = _cut("\n".join(lines[:MAX_PAYLOAD_LINES]), MAX_PAYLOAD_CHARS)
            parts.append(_t(kept))
            parts.append(_t(f"… {len(text):,} characters in all: qconsole job {job.id} --json", style="italic"))
        else:
            parts.append(Syntax(text, "json", theme=theme, background_color="default"))
        self._heavy = (version, parts)
        return parts

    def show_failure(self, error: str) -> None:
        self.job = None  # nothing to act on
        self.refresh_bindings()
        if error.startswith("NotFound"):
            error = f"job {self.job_id} not found: retention pruned it, or it never existed"
        self.query_one("#job-body", Static).update(_t(f" {error}", style="bold"))

    def render_job(self, job: Job, holders: JobHolders) -> RenderableType:
        now = self.qapp.clock.now()
        parts: list[RenderableType] = []
        head = Text()
        head.append(f"{fmt.state_label(job.state.value)}", style="bold reverse")
        head.append(f"  {job.job_type} @ {job.queue}  attempt {job.attempts}/{job.max_attempts}", style="bold")
        if job.cancel_requested:
            head.append("  kill requested", style="bold")
        parts.append(head)
        if self.note:
            parts.append(_t(self.note, style="italic"))

        # what matters during an incident comes first: why it waits (the most pressing reason first), or its lease
        # and lock; then why it failed, what it carried
        rows: list[tuple[str, Any]] = []
        if job.state.value == "running" and job.locked_until is not None:
            rows.append(("lease", self._lease_said(job, holders, now)))
        lock = lock_said(job, holders.lock_holder) if holders.lock_holder is not None else None
        waiting = waiting_said(job, holders, lock)
        for i, (label, said) in enumerate(waiting):
            rows.append((label, _t(said, style="bold" if i == 0 else "")))
        if lock is not None and not waiting:
            rows.append(("lock", _t(lock)))
        if holders.suspect and job.state in (JobState.QUEUED, JobState.RETRY_SCHEDULED):
            rows.append(("claim", _t(
                "a suspect (its lease expired while its worker ran other jobs too): only an idle"
                " worker takes it, and runs it alone (claim_solo)"
            )))  # fmt: skip
        if rows:
            parts.append(_section("why it waits" if waiting else "lease and lock"))
            parts.append(_kv(rows))

        parts.append(_section(f"errors ({len(job.errors)} attempt(s) failed)"))
        parts.extend(self._heavy_parts(job))
        parts.append(_section("envelope"))
        rp = job.retry_policy or {}
        parts.append(
            _kv(
                [
                    ("id", str(job.id)),
                    ("type / queue", f"{job.job_type} / {job.queue}"),
                    ("priority", job.priority),
                    ("idempotency key", job.idempotency_key),
                    ("dedup key", job.dedup_key or (job.released_dedup_key and
                                                   f"{job.released_dedup_key} (released by the kill)")),
                    ("lock key", job.lock_key),
                    ("timeout", f"{job.timeout_seconds:g}s, lease {job.visibility_timeout_seconds:g}s"),
                    ("retry policy", " ".join(f"{k}={v}" for k, v in sorted(rp.items())) or "-"),
                    ("tenant / trace", f"{job.tenant_id or '-'} / {job.trace_id or '-'}"),
                    ("lease expirations", job.lease_expirations),
                ]
            )
        )
        parts.append(_section("timestamps (UTC)"))

        def when(t: Any) -> str:
            return "-" if t is None else f"{fmt.stamp(t)}  ({fmt.ago(t, now)})"

        parts.append(
            _kv(
                [
                    ("created", when(job.created_at)),
                    ("scheduled", when(job.scheduled_at)),
                    ("started", when(job.started_at)),
                    ("finished", when(job.finished_at)),
                    ("updated", when(job.updated_at)),
                ]
            )
        )
        return Group(*parts)

    def _lease_said(self, job: Job, holders: JobHolders, now: dt.datetime) -> Text:
        """When the lease ends, the worker holding it as the workers screen judges it, and, once it expired,
        what the next claim does with the job (output.expired_lease_said): only claim_solo takes an expired lease
        (an idle worker, one job at a time, run alone), which is why a dead worker's jobs drain slowly, and not
        in a paused queue, nor past a limit with no room."""
        left = (fmt.utc(job.locked_until) - now).total_seconds()  # type: ignore[operator]
        holder = worker_said(job, holders)
        alone = "; runs alone (a suspect)" if holders.ran_solo else ""
        if left >= 0:
            return _t(f"ends in {fmt.duration(left)} ({fmt.hms(job.locked_until)} UTC), held by {holder}{alone}")
        then = expired_lease_said(job, holders) or "the next claim takes it back"
        return _t(f"EXPIRED {fmt.duration(-left)} ago (held by {holder}): {then}", style="bold")

    # ---------------------------------------------------------------- actions

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        states = self.ACTION_STATES.get(action)
        if states is None:
            return True
        return self.job is not None and self.job.state in states

    def action_back(self) -> None:
        self.dismiss()

    def action_requeue(self) -> None:
        job = self.job
        if job is None:
            return
        ok = job.state in REQUEUEABLE_STATES
        self.act(
            "requeue",
            f"Requeue job {fmt.short_id(job.id)} ({job.job_type})?",
            f"Touches 1 job: {job.state.value} -> queued with 1 fresh attempt." if ok
            else f"it is {job.state.value}; only dead-lettered, failed or cancelled jobs can be requeued.",
            lambda b, why: b.requeue([job.id], why),
            lambda r: f"Requeued {r.count} job(s)." + (f" {r.skipped_summary()}." if r.skipped else ""),
            touches=1 if ok else 0,
        )  # fmt: skip

    def action_fix_payload(self) -> None:
        """``E``: the payload to correct, then the job requeued with it (no second question: the form says what
        ctrl+s does), audited with the reason and the payload's diff."""
        job = self.job
        if job is None or job.state not in REQUEUEABLE_STATES:
            return
        if self.qapp.read_only:
            self.qapp.refuse_read_only("requeue")
            return
        from qconsole.screens.payload_fix import PayloadDraft, PayloadFix, PayloadFixScreen

        drafts = self.qapp.payload_drafts

        def answered(fix: PayloadFix | None) -> None:
            if fix is None:
                drafts.pop(job.id, None)
                self.notify("Requeue cancelled: nothing changed.", markup=False)
                return
            drafts[job.id] = PayloadDraft(fix.text, fix.reason)  # until the requeue is done: failed, E shows it again

            def done(r: ActionResult) -> str:
                drafts.pop(job.id, None)
                if r.count:
                    return f"Requeued job {fmt.short_id(job.id)} with its payload fixed."
                return f"Not requeued: {r.skipped_summary()}. E shows it as it is now."

            def run(b: ConsoleBackend) -> ActionResult:
                return b.requeue([job.id], fix.reason, payload=fix.payload, if_payload=fix.made_from)

            self.start_action("requeue", run, done)

        self.app.push_screen(PayloadFixScreen(job, drafts.get(job.id)), answered)

    def action_kill(self) -> None:
        job = self.job
        if job is None:
            return
        ok = job.state in KILLABLE_STATES and not job.cancel_requested
        how = "its worker stops it within a heartbeat" if job.state.value == "running" else "now"
        self.act(
            "kill",
            f"Kill job {fmt.short_id(job.id)} ({job.job_type})?",
            f"Touches 1 job: {job.state.value} -> cancelled ({how}). Never retried." if ok
            else "a kill is already requested: its worker stops it within a heartbeat." if job.cancel_requested
            and job.state in KILLABLE_STATES
            else f"it is {job.state.value}; only waiting or running jobs can be killed.",
            lambda b, why: b.kill([job.id], why),
            lambda r: f"Killed {r.count} job(s)." + (" It changed state meanwhile: skipped." if r.skipped else ""),
            touches=1 if ok else 0,
        )  # fmt: skip

    def action_discard(self) -> None:
        job = self.job
        if job is None:
            return
        ok = job.state in DISCARDABLE_STATES
        self.act(
            "discard",
            f"Discard job {fmt.short_id(job.id)} ({job.job_type})?",
            f"Touches 1 job: {job.state.value} -> cancelled: off the dead letters, never run again; its history"
            " keeps what it died of, and a requeue (r) brings it back." if ok
            else f"it is {job.state.value}; only dead-lettered or failed jobs can be discarded.",
            lambda b, why: b.discard([job.id], why),
            lambda r: f"Discarded {r.count} job(s)." + (" It changed state meanwhile: skipped." if r.skipped else ""),
            touches=1 if ok else 0,
        )  # fmt: skip
