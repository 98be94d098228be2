"""The contract's data: states, jobs and what the read side returns. Frozen dataclasses, no SQL."""

from __future__ import annotations

import datetime as dt
import enum
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class JobState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    RETRY_SCHEDULED = "retry_scheduled"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


LIVE_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.RETRY_SCHEDULED)
WAITING_STATES = (JobState.QUEUED, JobState.RETRY_SCHEDULED)
FINAL_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.DEAD_LETTERED, JobState.CANCELLED)
#: states an operator may requeue from
REQUEUEABLE_STATES = (JobState.DEAD_LETTERED, JobState.FAILED, JobState.CANCELLED)
#: states an operator may kill (-> cancelled)
KILLABLE_STATES = (JobState.QUEUED, JobState.RETRY_SCHEDULED, JobState.RUNNING)

#: the only legal transitions (DESIGN.md); tests walk this table
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RETRY_SCHEDULED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {
            JobState.SUCCEEDED,
            JobState.RETRY_SCHEDULED,
            JobState.FAILED,
            JobState.DEAD_LETTERED,
            JobState.CANCELLED,
            JobState.RUNNING,  # lease expired, claimed again
            JobState.QUEUED,  # released on shutdown or lock contention, attempt given back
        }
    ),
    JobState.DEAD_LETTERED: frozenset({JobState.QUEUED, JobState.CANCELLED}),  # requeued, or discarded
    JobState.FAILED: frozenset({JobState.QUEUED, JobState.CANCELLED}),
    JobState.CANCELLED: frozenset({JobState.QUEUED}),
    JobState.SUCCEEDED: frozenset(),
}


@dataclass(frozen=True)
class AttemptError:
    attempt: int
    kind: str  # transient | permanent | unknown | timeout | lease_expired | cancelled | crash
    error_class: str
    message: str
    worker: str | None
    at: dt.datetime | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AttemptError:
        at = d.get("at")
        return cls(
            attempt=int(d.get("attempt", 0)),
            kind=str(d.get("kind", "unknown")),
            error_class=str(d.get("class", "")),
            message=str(d.get("message", "")),
            worker=d.get("worker"),
            at=parse_timestamp(at) if isinstance(at, str) else at,
        )


_ISO = re.compile(r"^(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2})(?:\.(\d+))?(Z|[+-]\d{2}(?::?\d{2}){0,2})?$")


def parse_timestamp(text: str) -> dt.datetime | None:
    """A time as PostgreSQL writes it into JSON (``jsonb_build_object('at', now())``): it trims the
    fraction's trailing zeros (``...:25.1+00:00``) and writes ``+00`` without minutes, which Python 3.10's
    fromisoformat refuses; one such error made every read of its job fail. Unreadable text: None."""
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        pass
    m = _ISO.match(text.strip())
    if not m:
        return None
    base, fraction, zone = m.groups()
    zone = {None: "", "Z": "+00:00"}.get(zone, zone)
    if zone:  # +05, +0553, +05:53:28 (a historical local mean time) -> +HH:MM[:SS]
        digits = zone[1:].replace(":", "")
        zone = zone[0] + ":".join(digits[i : i + 2] for i in range(0, len(digits), 2))
        if len(digits) == 2:
            zone += ":00"
    try:
        return dt.datetime.fromisoformat(base + ("." + (fraction + "000000")[:6] if fraction else "") + zone)
    except ValueError:
        return None


@dataclass(frozen=True)
class Job:
    id: uuid.UUID
    job_type: str
    queue: str
    payload: dict[str, Any]
    state: JobState
    priority: int
    attempts: int
    max_attempts: int
    scheduled_at: dt.datetime
    locked_until: dt.datetime | None
    locked_by: str | None
    idempotency_key: str | None
    dedup_key: str | None
    lock_key: str | None
    timeout_seconds: float
    visibility_timeout_seconds: float
    retry_policy: dict[str, Any]
    tenant_id: str | None
    trace_id: str | None
    last_error: str | None
    errors: list[AttemptError]
    lease_expirations: int
    cancel_requested: bool
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    updated_at: dt.datetime
    #: the dedup key a kill released while the job ran (a requeue restores it)
    released_dedup_key: str | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Job:
        names = cls.__dataclass_fields__
        data = {k: v for k, v in row.items() if k in names}
        data["state"] = JobState(row["state"])
        data["errors"] = [AttemptError.from_json(e) for e in row.get("errors") or []]
        return cls(**data)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            out[name] = _jsonable(getattr(self, name))
        return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, (dt.datetime, dt.date)):
        return v.isoformat()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if hasattr(v, "__dataclass_fields__"):
        return {k: _jsonable(getattr(v, k)) for k in v.__dataclass_fields__}
    return v


def to_jsonable(v: Any) -> Any:
    """Dataclasses, datetimes, uuids and enums to plain JSON values (for --json output)."""
    return _jsonable(v)


@dataclass(frozen=True)
class EnqueueResult:
    id: uuid.UUID
    #: False when a live job already held the dedup key: ``id`` is then that job's id
    created: bool

    @property
    def duplicate_of(self) -> uuid.UUID | None:
        return None if self.created else self.id


@dataclass(frozen=True)
class TypeStats:
    """One row of the overview: a (queue, job_type) pair."""

    queue: str
    job_type: str
    queued: int = 0
    running: int = 0
    retry_scheduled: int = 0
    #: of ``queued``, the jobs scheduled later (not due yet)
    queued_later: int = 0
    succeeded: int = 0
    failed: int = 0
    dead_lettered: int = 0
    cancelled: int = 0
    #: age in seconds of the oldest job that is ready and waiting (queue lag)
    oldest_waiting_seconds: float = 0.0
    paused: bool = False
    #: the global concurrency limit of the type in this queue, if any
    concurrency_limit: int | None = None
    # rates over the recent window, per minute
    throughput_per_min: float = 0.0
    dlq_per_min: float = 0.0
    lease_expirations_per_min: float = 0.0
    retries_per_min: float = 0.0
    dedup_hits_per_min: float = 0.0
    #: over the window: jobs in (rolled up with a lag of about two minutes), retries, timeouts,
    #: anomalies (unknown errors)
    enqueued: int = 0
    retries: int = 0
    timeouts: int = 0
    anomalies: int = 0
    lease_expirations: int = 0
    lock_contention: int = 0
    dedup_hits: int = 0
    idempotency_hits: int = 0
    #: over the window, per job started: queue latency (due to start) and handler duration, in seconds
    latency_avg_seconds: float = 0.0
    duration_avg_seconds: float = 0.0
    #: the live workers (not lost, not stopped: stats.is_lost) that claim this type in this
    #: queue (it is in their tasks, the queue in their queues or they take every queue); None: not known.
    #: 0 with jobs waiting: nothing will run them (stats.unserved)
    live_workers: int | None = None
    #: the lost workers (heartbeat stopped, no goodbye) that did claim it: where its workers went
    lost_workers: int = 0
    #: of ``running``, the jobs whose lease has expired: their worker died or froze (a live worker of the type
    #: takes them over; until then they only look like they run)
    running_expired: int = 0

    @property
    def waiting(self) -> int:
        return self.queued + self.retry_scheduled

    @property
    def queued_due(self) -> int:
        """The queued jobs due now (the others are scheduled later)."""
        return self.queued - self.queued_later


@dataclass(frozen=True)
class QueueInfo:
    name: str
    paused: bool
    waiting: int
    running: int
    changed_by: str | None = None
    changed_at: dt.datetime | None = None
    #: the reason given with the last pause or resume (its audit entry's)
    reason: str | None = None


#: terminal escape sequences: CSI (colors, cursor moves, clearing the screen), OSC (window titles, the
#: clipboard), and the short two-character ones. What the console strips from job data (qconsole's
#: fmt.printable), and what an operator's reason is stored without (ops.reason_text)
ESCAPE_SEQUENCES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]|\x9b[0-?]*[ -/]*[@-~]"
)


#: a worker whose heartbeat is older than this (and that did not say goodbye) is lost, whatever its interval
LOST_AFTER_SECONDS = 30.0
#: ... and one whose heartbeat is older than this many of its own intervals: one beat may fail, or give up on a
#: lock (worker.BEAT_LOCK_WAIT_MAX_SECONDS), while the worker lives
LOST_AFTER_BEATS = 3


def lost_after_seconds(heartbeat_interval_seconds: float | None) -> float:
    """How long a worker's row may go unbeaten before the console and the CLI say it is lost: three of its
    heartbeat intervals, LOST_AFTER_SECONDS at least (a worker of an earlier version, whose row does not say
    its interval: LOST_AFTER_SECONDS). Judged against the worker's own interval: at a fixed 30 s, a worker
    beating every 30 s read as lost between every two beats."""
    if not heartbeat_interval_seconds:
        return LOST_AFTER_SECONDS
    return max(LOST_AFTER_SECONDS, LOST_AFTER_BEATS * float(heartbeat_interval_seconds))


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    host: str
    pid: int
    queues: list[str] | None
    tasks: list[str]
    concurrency: int
    in_flight: int
    started_at: dt.datetime
    last_heartbeat_at: dt.datetime
    stopped_at: dt.datetime | None
    #: how often it beats its row (migration 0017); None: a worker of an earlier version
    heartbeat_interval_seconds: float | None = None
    #: the heartbeat stopped for longer than its lost threshold (lost_after_seconds), and the worker did not
    #: say goodbye
    lost: bool = False

    @property
    def lost_after_seconds(self) -> float:
        """How long its row may go unbeaten before it reads as lost (lost_after_seconds)."""
        return lost_after_seconds(self.heartbeat_interval_seconds)

    @property
    def lost_since(self) -> dt.datetime:
        """When it became lost, or will if it is not beaten before."""
        return self.last_heartbeat_at + dt.timedelta(seconds=self.lost_after_seconds)


@dataclass(frozen=True)
class SeriesPoint:
    minute: dt.datetime
    value: float


@dataclass(frozen=True)
class Overview:
    """Everything the console's overview and ``qconsole stats`` show, read in one go."""

    at: dt.datetime
    types: list[TypeStats]
    queues: list[QueueInfo]
    workers_alive: int
    window_minutes: int
    #: per (queue, job_type): per-minute series over the last hour
    throughput: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    #: every concurrency limit, as stats.limits reads them (who set an operator's, and why)
    limits: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class DeadLetterGroup:
    job_type: str
    fingerprint: str
    sample_error: str
    count: int
    first_seen: dt.datetime
    last_seen: dt.datetime
    job_ids: list[uuid.UUID]
    state: str = "dead_lettered"


class DeadLetterGroups(list[DeadLetterGroup]):
    """The biggest groups (stats.dead_letter_groups' ``limit``), and what there is in all: a screen that sums
    only the groups it shows undercounts, and says nothing of those it does not."""

    def __init__(
        self, groups: Iterable[DeadLetterGroup] = (), *, total_groups: int = 0, dead: int = 0, retrying: int = 0
    ) -> None:
        super().__init__(groups)
        self.total_groups = max(total_groups, len(self))
        #: jobs dead-lettered or failed, and waiting for a retry, in every group
        self.dead = dead
        self.retrying = retrying


@dataclass(frozen=True)
class AuditEntry:
    id: int
    at: dt.datetime
    os_user: str
    ssh_client: str | None
    action: str
    queue: str | None
    job_ids: list[uuid.UUID]
    reason: str | None
    detail: dict[str, Any]


@dataclass(frozen=True)
class ActionResult:
    """What an operator action changed."""

    action: str
    requested: int
    changed: list[uuid.UUID]
    skipped: list[uuid.UUID]
    audit_id: int | None = None
    #: why each skipped job was skipped, where the action can tell (``it is running``, a dedup key held)
    why_skipped: dict[uuid.UUID, str] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.changed)

    def skipped_summary(self) -> str:
        """``2 skipped: it is running (1); a live job holds its dedup key (1)``, or the plain count."""
        if not self.skipped:
            return ""
        reasons: dict[str, int] = {}
        for jid in self.skipped:
            why = self.why_skipped.get(jid, "it changed state meanwhile")
            reasons[why] = reasons.get(why, 0) + 1
        listed = "; ".join(f"{why} ({n})" if len(self.skipped) > 1 else why for why, n in reasons.items())
        return f"{len(self.skipped)} skipped: {listed}"


@dataclass(frozen=True)
class TypeContract:
    """The effective contract of a job type: ``fields`` maps each policy field to (value, source), source
    being ``default``, ``queue:<name>`` or ``type:<job_type>``."""

    job_type: str
    queue: str
    fields: dict[str, tuple[Any, str]]
    reason: str | None = None
    requires_idempotency_key: bool = False
    concurrency: int | None = None
    reported_by: str | None = None
    reported_at: dt.datetime | None = None
