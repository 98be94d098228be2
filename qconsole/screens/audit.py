"""``a`` Audit log: every operator action, who did it and from where, newest first."""

from __future__ import annotations

import json
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from qconsole.backend import ConsoleBackend
from qconsole.output import audit_groups, is_worker_entry, worker_detail, worker_target
from qconsole.screens.base import ConsoleScreen
from qconsole.widgets import fmt
from qconsole.widgets.table import LiveTable, cell
from worker_core.models import AuditEntry
from worker_core.ops import GROUPS_KEY, TOKEN_KEY

COLUMNS = [
    ("at", "when (UTC)", None),
    ("who", "who", None),
    ("action", "action", None),
    ("target", "target", None),
    ("detail", "detail", None),
]
LIMIT = 200


#: what the detail column leaves out: the console's token (ops.TOKEN_KEY) is how it finds its action's entry
#: after a lost connection, no reader's business; a limit's type and queue are its target; the groups of a
#: dead-letter action are said first, in words (output.audit_groups); a payload fix's diff, in words too
HIDDEN = {TOKEN_KEY, GROUPS_KEY, "payload_diff"}
LIMIT_ACTIONS = ("limit", "unlimit")


def _is_limit(e: AuditEntry) -> bool:
    return e.action in LIMIT_ACTIONS and bool((e.detail or {}).get("job_type"))


def target(e: AuditEntry) -> str:
    # a limit touches no job: its target is its type (and queue), which read "0 job(s)"; so is a worker's start or
    # stop, whose target is the worker
    if is_worker_entry(e):
        return worker_target(e)
    if _is_limit(e):
        scope = e.detail.get("queue") or "*"
        return f"type {e.detail['job_type']}" + ("" if scope == "*" else f" @{scope}")
    if e.queue:
        return f"queue {e.queue}"
    return f"{len(e.job_ids)} job(s)"


def payload_fix_text(diffs: dict[str, Any]) -> str:
    """A payload fix, old value first: ``payload: vat_id "XX1" → "DE123", street (none) → "Main st 1"``; the
    job's id only where the fix was of several (one job's is the entry's target). It read as a Python dict, keys
    sorted: ``{'vat_id': {'new': 'DE123', 'old': 'XX1'}}``, new before old, under the job's full id."""
    if not diffs:
        return "payload replaced (unchanged)"

    def value(entry: dict[str, Any], side: str) -> str:
        if side not in entry:
            return "(none)" if side == "old" else "(removed)"
        return json.dumps(entry[side], ensure_ascii=False)

    out = []
    for job_id, diff in diffs.items():
        changes = ", ".join(f"{path} {value(e, 'old')} → {value(e, 'new')}" for path, e in diff.items())
        out.append(changes if len(diffs) == 1 else f"{job_id[:8]}: {changes}")
    return "payload: " + "; ".join(out)


def detail(e: AuditEntry) -> str:
    hidden = HIDDEN | ({"job_type", "queue"} if _is_limit(e) else set())
    if is_worker_entry(e):  # what it runs, in the order read: its number and pid are its target
        parts = [worker_detail(e)]
    else:
        parts = [f"{k}={v}" for k, v in sorted(e.detail.items()) if k != "payload" and k not in hidden]
    if "payload" in e.detail:
        parts.append(payload_fix_text(e.detail.get("payload_diff") or {}))
    if e.reason:
        parts.insert(0, f"reason: {e.reason}")
    groups = audit_groups(e)
    if groups:  # which group it was, first: what the handover asks before anything else
        parts.insert(0, f"{groups} │")
    return " ".join(parts)


class AuditScreen(ConsoleScreen):
    TITLE_TEXT = "Audit log"
    HELP = "Operator actions from the console and the CLI, with the OS user and SSH client."
    # the entry under the cursor on four lines: a dead-letter group's type and fingerprint, its reason and the
    # rest of its detail were cut after one at 80 columns
    CSS = """
    AuditScreen #audit-detail {
        height: 5;
    }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entries: list[AuditEntry] = []

    def compose_body(self) -> ComposeResult:
        yield Static(id="audit-summary", classes="summary")
        yield LiveTable(COLUMNS, id="audit-table")
        yield Static(id="audit-detail", classes="detail")

    def on_mount(self) -> None:
        self.query_one(LiveTable).focus()

    def fetch(self, backend: ConsoleBackend) -> list[AuditEntry]:
        return backend.audit_log(LIMIT)

    def show(self, data: list[AuditEntry]) -> None:
        self.entries = data
        wide = self.size.width >= 100
        rows = [
            (
                str(e.id),
                [
                    cell(fmt.stamp(e.at).replace(" UTC", "")[5 if not wide else 0 :]),
                    cell(fmt.clip(str(e.os_user) + (f"@{e.ssh_client}" if e.ssh_client else ""), 24 if wide else 14)),
                    cell(e.action, style="bold"),
                    cell(target(e)),
                    cell(fmt.clip(detail(e), 60 if wide else 24)),
                ],
            )
            for e in data
        ]
        self.query_one(LiveTable).set_rows(rows)
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f" {len(data)} entr{'y' if len(data) == 1 else 'ies'}", style="bold")
        t.append(" │ newest first │ written in the same transaction as the change")
        self.query_one("#audit-summary", Static).update(t)
        self._paint_detail()

    @on(DataTable.RowHighlighted)
    def _highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._paint_detail()

    def _paint_detail(self) -> None:
        key = self.query_one(LiveTable).cursor_key
        e = next((x for x in self.entries if str(x.id) == key), None)
        out = self.query_one("#audit-detail", Static)
        if e is None:
            out.update(Text(" no operator action recorded yet" if not self.entries else ""))
            return
        t = Text()
        t.append(f" #{e.id} {e.action}", style="bold")
        who = f" by {e.os_user}" + (f" from {e.ssh_client}" if e.ssh_client else "")
        t.append(fmt.printable(who) + f" at {fmt.stamp(e.at)}\n")
        ids = ", ".join(fmt.short_id(i) for i in e.job_ids[:8]) + (" …" if len(e.job_ids) > 8 else "")
        t.append(fmt.printable(f" {target(e)}{': ' + ids if ids else ''} │ {detail(e) or 'no detail'}"))
        out.update(t)
