"""Messages that thread workers post back to the UI: small dataclasses, handled with ``@on(...)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message

from worker_core.models import ActionResult


@dataclass
class DataFetched(Message):
    """A screen's read finished: ``data`` is what its ``fetch`` returned."""

    data: Any

    def can_replace(self, message: Message) -> bool:
        # a newer read makes an older one that is still queued worthless
        return isinstance(message, DataFetched)


@dataclass
class FetchFailed(Message):
    """A read failed. ``error`` is safe to show. ``outage``: the database could not be reached (else it
    answered with an error: a job that no longer exists, a query over its time limit, a schema not
    migrated)."""

    error: str
    outage: bool = True

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, FetchFailed)


@dataclass
class ActionDone(Message):
    """An operator action committed (and was audited)."""

    result: ActionResult
    summary: str


@dataclass
class ActionFailed(Message):
    """An operator action was refused or failed; nothing changed (the server answered with an error, or it is
    known otherwise: see ActionUnsure)."""

    action: str
    error: str


@dataclass
class ActionUnsure(Message):
    """An operator action's connection died once it was sent: the answer to its COMMIT may be what was lost.
    ``audit_id``: it committed (found by the token of its audit entry; ``changed`` the jobs it names); None:
    whether it did could not be told."""

    action: str
    error: str
    audit_id: int | None = None
    changed: int = 0


@dataclass
class ActionEnded(Message):
    """An operator action's thread is done, however it ended: posted to the app (which said it is running, and
    says its outcome), not to the screen it was asked on, which may be gone by then (a job's detail closed)."""

    action: str
    #: what came of it (None: its thread failed past the action itself)
    outcome: ActionDone | ActionFailed | ActionUnsure | None = None
    #: the screen it was asked on: told too (after_action, a read), if it is still there
    origin: Any = None


@dataclass
class GroupJobsRead(Message):
    """The jobs of the dead-letter groups an action was asked for were read (``error``: they could not be),
    for the question that names them."""

    action: str
    groups: list[Any]
    verb: str
    details: str
    ids: list[Any]
    error: str | None = None


@dataclass
class EmbeddedWorkerExited(Message):
    """An embedded worker process ended: stopped by the console, or crashed."""

    number: int
    pid: int
    #: negative: killed by that signal
    exit_code: int
    crashed: bool
    #: what the worker said of itself as it ended (a traceback's last line, its refusal), else ""; never a line
    #: it merely logged last (a job's retry), which read as the reason
    own_error: str
    restarting: bool
    #: in how many seconds it is started again, when restarting
    restart_in: float | None = None
