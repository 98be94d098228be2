"""Job detail: envelope, payload as pretty JSON, every attempt's error, timestamps, lease and lock."""

from __future__ import annotations

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
from qconsole.screens.base import ConsoleScreen
from qconsole.widgets import fmt
from worker_core.models import KILLABLE_STATES, REQUEUEABLE_STATES, Job

#: what the detail shows of a job, at most (the CLI's `qconsole job ID` shows it all)
MAX_PAYLOAD_LINES = 200
MAX_PAYLOAD_CHARS = 20_000
MAX_ERRORS_SHOWN = 20
MAX_ERROR_CHARS = 1_000


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


def type_limit(limits: list[dict[str, Any]], job_type: str, queue: str) -> int | None:
    """The concurrency limit that holds ``job_type`` in ``queue``: its queue's, else its every-queue one."""
    found = {(r["job_type"], r["queue"]): r["max_running"] for r in limits}
    limit = found.get((job_type, queue), found.get((job_type, "*")))
    return None if limit is None else int(limit)


class JobDetailScreen(ConsoleScreen):
    TITLE_TEXT = "Job"
    HELP = "One job: envelope, payload, every attempt's error, lease and lock."
    #: a failed read's error replaces the job on screen (show_failure): nothing stale is left to mark
    MARKS_STALE_DATA = False

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("r", "requeue", "Requeue"),
        Binding("K", "kill", "Kill"),
    ]

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

    def fetch(self, backend: ConsoleBackend) -> tuple[Job, dict[str, Any] | None, int | None]:
        job, lock = backend.get_job(self.job_id)
        limit = None
        if self._lease_expired(job):
            # under a limit of 0 no worker reclaims it: "another worker may reclaim it" was wrong then
            limit = type_limit(backend.contracts().limits, job.job_type, job.queue)
        return job, lock, limit

    def _lease_expired(self, job: Job) -> bool:
        if job.state.value != "running" or job.locked_until is None:
            return False
        return fmt.utc(job.locked_until) < self.qapp.clock.now()  # type: ignore[operator]

    def show(self, data: tuple[Job, dict[str, Any] | None, int | None]) -> None:
        job, lock, limit = data
        self.job = job
        self.query_one("#job-body", Static).update(self.render_job(job, lock, limit))

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
        if error.startswith("NotFound"):
            error = f"job {self.job_id} not found: retention pruned it, or it never existed"
        self.query_one("#job-body", Static).update(_t(f" {error}", style="bold"))

    def render_job(self, job: Job, lock: dict[str, Any] | None, limit: int | None = None) -> RenderableType:
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

        # what matters during an incident comes first: lease and lock, why it failed, what it carried
        lease: Text | str = "-"
        if job.state.value == "running" and job.locked_until is not None:
            left = (fmt.utc(job.locked_until) - now).total_seconds()  # type: ignore[operator]
            if left >= 0:
                lease = _t(f"ends in {fmt.duration(left)} ({fmt.hms(job.locked_until)} UTC), held by {job.locked_by}")
            elif limit == 0:
                lease = _t(
                    f"EXPIRED {fmt.duration(-left)} ago (held by {job.locked_by}): {fmt.PAUSED} its type is held by"
                    f" a limit of 0: no worker reclaims it until the limit is raised (qconsole limit"
                    f" {job.job_type} --clear)",
                    style="bold",
                )
            else:
                lease = _t(
                    f"EXPIRED {fmt.duration(-left)} ago (held by {job.locked_by}): another worker may reclaim it",
                    style="bold",
                )
        lock_text: Text | str = "-"
        if lock:
            lock_text = _t(
                f"{lock['lock_key']} held, expires {fmt.ago(lock['expires_at'], now)} (token {str(lock['token'])[:8]})"
            )
        elif job.lock_key:
            lock_text = _t(f"{job.lock_key} (not held now)")
        if job.state.value == "running" or job.lock_key:
            parts.append(_section("lease and lock"))
            parts.append(_kv([("lease", lease), ("lock", lock_text)]))

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

    # ---------------------------------------------------------------- actions

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
            lambda b: b.requeue([job.id]),
            lambda r: f"Requeued {r.count} job(s)." + (f" {r.skipped_summary()}." if r.skipped else ""),
            touches=1 if ok else 0,
        )  # fmt: skip

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
            lambda b: b.kill([job.id]),
            lambda r: f"Killed {r.count} job(s)." + (" It changed state meanwhile: skipped." if r.skipped else ""),
            touches=1 if ok else 0,
        )  # fmt: skip
