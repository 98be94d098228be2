"""Console fixtures: a fake backend with fixed data (ids, times, order), a fixed clock, still cursors."""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from psycopg.errors import QueryCanceled

from qconsole.app import QConsoleApp, make_app
from qconsole.backend import ChartData, ContractsData, OverviewData
from qconsole.embedded_workers import EmbeddedWorker
from worker_core.clock import FixedClock
from worker_core.errors import NotFound, ReadOnlyError
from worker_core.models import (
    ActionResult,
    AttemptError,
    AuditEntry,
    DeadLetterGroup,
    Job,
    JobState,
    Overview,
    QueueInfo,
    TypeContract,
    TypeStats,
    WorkerInfo,
)
from worker_core.stats import JobHolders

T0 = dt.datetime(2025, 3, 14, 9, 26, 53, tzinfo=dt.timezone.utc)
UTC = dt.timezone.utc


def jid(n: int) -> uuid.UUID:
    """Stable, distinct-looking job ids."""
    return uuid.UUID(hashlib.md5(f"job-{n}".encode()).hexdigest(), version=4)


def ago(seconds: float) -> dt.datetime:
    return T0 - dt.timedelta(seconds=seconds)


def wave(n: int, base: float, amp: float, period: int = 11) -> list[float]:
    """A deterministic, lively series."""
    return [max(0.0, base + amp * (((i * 7) % period) - period / 2) / period) for i in range(n)]


def make_fake_job(n: int, job_type: str, state: JobState, **kw: Any) -> Job:
    errors = kw.pop("errors", [])
    fields: dict[str, Any] = dict(
        id=jid(n),
        job_type=job_type,
        queue="default",
        payload={"order_id": f"ord_{n}", "amount_cents": 1299 * n, "lines": [{"sku": "A-1", "qty": 2}]},
        state=state,
        priority=0,
        attempts=len(errors),
        max_attempts=5,
        scheduled_at=ago(600 + n),
        locked_until=None,
        locked_by=None,
        idempotency_key=f"{job_type}:ord_{n}",
        dedup_key=None,
        lock_key=None,
        timeout_seconds=30.0,
        visibility_timeout_seconds=45.0,
        retry_policy={"backoff": "exponential", "base_seconds": 1.0, "max_delay_seconds": 60.0, "jitter": 0.1},
        tenant_id="acme",
        trace_id=f"trace-{n:04d}",
        last_error=f"{errors[-1].error_class}: {errors[-1].message}" if errors else None,
        errors=errors,
        lease_expirations=0,
        cancel_requested=False,
        created_at=ago(900 + n),
        started_at=None,
        finished_at=None,
        updated_at=ago(30 * n),
    )
    fields.update(kw)
    return Job(**fields)


def _errors(n: int, cls: str, msg: str, kind: str = "transient") -> list[AttemptError]:
    return [AttemptError(i, kind, cls, msg, f"web-1:41{i}:ab12c{i}", ago(400 - 60 * i)) for i in range(1, n + 1)]


class FakeBackend:
    """Fixed data for pictures and UI logic; actions are recorded, not applied."""

    def __init__(self, read_only: bool = False) -> None:
        self.read_only = read_only
        self.fail_reads = False
        self.refuse_reads = False
        self.calls: list[tuple[str, Any]] = []
        self.jobs = [
            make_fake_job(
                1, "email.send", JobState.DEAD_LETTERED,
                errors=_errors(5, "TransientError", "upstream 503 from smtp relay 'mx3' after 30s"),
                finished_at=ago(120),
            ),
            make_fake_job(
                2, "invoice.generate", JobState.RUNNING,
                errors=[], attempts=1, locked_by="web-1:4121:ab12cd", locked_until=T0 + dt.timedelta(seconds=37),
                started_at=ago(8), lock_key="order:ord_2",
            ),
            make_fake_job(
                3, "report.build", JobState.RETRY_SCHEDULED,
                errors=_errors(2, "JobTimeout", "handler ran past its timeout of 30s", "timeout"),
            ),
            make_fake_job(4, "email.send", JobState.QUEUED, queue="mail"),
            make_fake_job(
                5, "image.resize", JobState.FAILED,
                errors=_errors(1, "PermanentError", "image 'img_5.png' is not a PNG", "permanent"),
                finished_at=ago(300),
            ),
            make_fake_job(6, "invoice.generate", JobState.SUCCEEDED, attempts=1, finished_at=ago(45)),
        ]  # fmt: skip

    @property
    def description(self) -> str:
        return "postgresql://ops@db.internal:5432/jobs"

    def _read(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        if self.fail_reads:
            raise ConnectionError("connection to server at 10.0.0.5, port 5432 failed: Connection refused")
        if self.refuse_reads:  # the server answers with an error: reachable, the data shown stale
            raise QueryCanceled("canceling statement due to statement timeout")

    def overview(self) -> OverviewData:
        self._read("overview")
        types = [
            TypeStats("default", "email.send", queued=41, running=4, retry_scheduled=12, dead_lettered=23,
                      oldest_waiting_seconds=185, throughput_per_min=18.4, dlq_per_min=1.3,
                      lease_expirations_per_min=0.0, retries_per_min=6.1, retries=92, timeouts=3, anomalies=1,
                      latency_avg_seconds=41.5, duration_avg_seconds=0.35, live_workers=1),
            TypeStats("default", "invoice.generate", queued=3, running=2, throughput_per_min=9.7, concurrency_limit=2,
                      oldest_waiting_seconds=2, retries_per_min=0.2, retries=3, dedup_hits=4, idempotency_hits=2,
                      live_workers=1),
            TypeStats("default", "report.build", queued=1, running=2, retry_scheduled=1, failed=0,
                      oldest_waiting_seconds=12, throughput_per_min=0.8, lease_expirations_per_min=0.4,
                      lease_expirations=6, timeouts=2, live_workers=1),
            TypeStats("mail", "email.send", queued=120, paused=True, oldest_waiting_seconds=940, live_workers=1),
            # its only worker (web-2:77) is lost: its job still "runs" on an expired lease, the new ones wait
            TypeStats("media", "image.resize", queued=3, running=1, failed=4, dead_lettered=2,
                      oldest_waiting_seconds=95, throughput_per_min=2.2, dlq_per_min=0.13,
                      lease_expirations_per_min=0.27, live_workers=0, lost_workers=1, running_expired=1),
        ]  # fmt: skip
        queues = [
            QueueInfo("default", False, 74, 8),
            QueueInfo("mail", True, 120, 0, changed_by="alice", changed_at=ago(1200), reason="INC-7 smtp relay down"),
            QueueInfo("media", False, 3, 1),
        ]
        ov = Overview(
            at=T0,
            types=types,
            queues=queues,
            workers_alive=3,
            window_minutes=15,
            throughput={
                ("default", "email.send"): wave(60, 18, 14),
                ("default", "invoice.generate"): wave(60, 10, 6, 7),
                ("default", "report.build"): wave(60, 1, 2, 5),
                ("media", "image.resize"): wave(60, 2, 3, 13),
            },
            limits=[
                {"job_type": "invoice.generate", "queue": "*", "max_running": 2, "source": "task", "reason": None,
                 "updated_at": ago(45), "set_by": None},
                {"job_type": "email.send", "queue": "mail", "max_running": 10, "source": "operator",
                 "reason": "smtp relay rate limit", "updated_at": ago(900), "set_by": "bob@10.0.0.7"},
            ],
        )  # fmt: skip
        lag = {"default": wave(60, 40, 80, 9), "mail": [float(i * 16) for i in range(60)], "media": wave(60, 1, 2)}
        return OverviewData(ov, lag)

    def charts(self) -> ChartData:
        self._read("charts")
        return ChartData(
            retries={"email.send": wave(60, 6, 10), "report.build": wave(60, 1, 2, 7), "invoice.generate": [0.0] * 60},
            lease_expirations={"report.build": wave(60, 0.4, 1.5, 13), "image.resize": wave(60, 0.2, 1, 5)},
            lag={"default": wave(60, 40, 80, 9), "mail": [float(i * 16) for i in range(60)]},
            attempts={"email.send": {1: 420, 2: 96, 3: 31, 4: 12, 5: 23}, "invoice.generate": {1: 580, 2: 4}},
        )

    def list_jobs(
        self,
        *,
        state: str | None,
        job_type: str | None,
        queue: str | None,
        search: str | None,
        limit: int,
        next_first: bool = False,
        after: Job | None = None,
    ) -> list[Job]:
        self._read("list_jobs", dict(state=state, job_type=job_type, queue=queue, search=search))
        out = [
            j
            for j in self.jobs
            if (not state or j.state.value == state)
            and (not job_type or j.job_type == job_type)
            and (not queue or j.queue == queue)
            and (not search or search in str(j.id) or search in (j.last_error or ""))
        ]
        if next_first and not search:
            out = sorted((j for j in out if j.state.value in ("queued", "retry_scheduled")),
                         key=lambda j: (j.priority, j.scheduled_at, j.id.int))  # fmt: skip
            if after is not None:
                out = [j for j in out if (j.priority, j.scheduled_at, j.id.int)
                       > (after.priority, after.scheduled_at, after.id.int)]  # fmt: skip
        elif after is not None:
            out = [j for j in out if (j.updated_at, -j.id.int) < (after.updated_at, -after.id.int)]
        return out[:limit]

    def get_job(self, job_id: uuid.UUID) -> tuple[Job, JobHolders]:
        """A job holds its own lock_key for 37 s; a running one's worker is its row in workers()."""
        self._read("get_job", job_id)
        for j in self.jobs:
            if j.id == job_id:
                lock = holder = None
                if j.lock_key:
                    lock = {"lock_key": j.lock_key, "token": "5f2c9a1e77", "job_id": j.id,
                            "expires_at": T0 + dt.timedelta(seconds=37)}  # fmt: skip
                    holder = {"lock_key": j.lock_key, "held_by": "this_job", "job_id": j.id, "job_type": j.job_type,
                              "job_state": j.state.value, "expires_at": T0 + dt.timedelta(seconds=37),
                              "expires_in_seconds": 37.0}  # fmt: skip
                worker = None
                if j.state is JobState.RUNNING:
                    worker = next((w for w in self.workers() if w.id == j.locked_by), None)
                return j, JobHolders(at=T0, lock=lock, lock_holder=holder, worker=worker)
        raise NotFound(f"no job {job_id}")

    def dead_letter_groups(self) -> list[DeadLetterGroup]:
        self._read("dead_letter_groups")
        return [
            DeadLetterGroup("email.send", "TransientError: upstream <n> from smtp relay '<*>' after <n>s",
                            "TransientError: upstream 503 from smtp relay 'mx3' after 30s", 23, ago(3000), ago(120),
                            [jid(1)], "dead_lettered"),
            DeadLetterGroup("image.resize", "PermanentError: image '<*>' is not a PNG",
                            "PermanentError: image 'img_5.png' is not a PNG", 4, ago(5000), ago(300), [jid(5)],
                            "failed"),
            DeadLetterGroup("report.build", "JobTimeout: handler ran past its timeout of <n>s",
                            "JobTimeout: handler ran past its timeout of 30s", 1, ago(700), ago(340), [jid(3)],
                            "retry_scheduled"),
            DeadLetterGroup("image.resize", "LeaseExpired: lease expired: worker <*> died or froze",
                            "LeaseExpired: lease expired: worker web-2:77:ffe01a died or froze", 2, ago(9000),
                            ago(4000), [jid(7), jid(8)], "dead_lettered"),
        ]  # fmt: skip

    def group_job_ids(self, group: DeadLetterGroup) -> list[uuid.UUID]:
        """All the group's jobs: its sample ids, then made-up ones up to its count."""
        self._read("group_job_ids", group.fingerprint)
        more = (uuid.uuid5(uuid.NAMESPACE_OID, f"{group.fingerprint}/{i}") for i in range(group.count))
        return [*group.job_ids, *more][: group.count]

    def workers(self) -> list[WorkerInfo]:
        self._read("workers")
        return [
            WorkerInfo("web-1:4121:ab12cd", "web-1", 4121, None, ["email.send", "invoice.generate"], 8, 5,
                       ago(7200), ago(1), None),
            WorkerInfo("web-2:77:ffe01a", "web-2", 77, ["media"], ["image.resize"], 2, 1, ago(9000), ago(95),
                       None, lost=True),
            WorkerInfo("batch-1:310:9c0d11", "batch-1", 310, ["default", "mail"], ["report.build"], 4, 2,
                       ago(600), ago(2), None),
            WorkerInfo("batch-1:290:77aa01", "batch-1", 290, ["default"], ["report.build"], 4, 0,
                       ago(8000), ago(700), ago(700)),
        ]  # fmt: skip

    def audit_log(self, limit: int = 200) -> list[AuditEntry]:
        self._read("audit_log")
        return [
            AuditEntry(3, ago(60), "alice", "10.1.2.3", "requeue", None, [jid(1), jid(9)], "smtp relay fixed",
                       {"budget": 1, "requested": 2, "groups": [
                           {"job_type": "email.send", "state": "dead_lettered", "jobs": 2,
                            "fingerprint": "TransientError: upstream <n> from smtp relay '<*>' after <n>s"}]}),
            AuditEntry(2, ago(1200), "alice", "10.1.2.3", "pause", "mail", [], "relay down", {}),
            AuditEntry(1, ago(86000), "bob", None, "kill", None, [jid(3)], None,
                       {"cancelled": 1, "signalled_running": 0, "requested": 1}),
        ][:limit]  # fmt: skip

    def contracts(self) -> ContractsData:
        self._read("contracts")

        def fields(**over: Any) -> dict[str, tuple[Any, str]]:
            base: dict[str, tuple[Any, str]] = {
                "max_attempts": (5, "default"), "timeout_seconds": (60.0, "default"),
                "visibility_timeout_seconds": (90.0, "default"), "backoff": ("exponential", "default"),
                "base_seconds": (2.0, "default"), "max_delay_seconds": (600.0, "default"), "jitter": (0.2, "default"),
            }  # fmt: skip
            base.update(over)
            return base

        return ContractsData(
            contracts=[
                TypeContract("email.send", "default", fields(max_attempts=(8, "queue:default")), None, True, None,
                             "web-1:4242:w0.1", ago(30)),
                TypeContract("image.resize", "media", fields(max_attempts=(2, "type:image.resize"),
                             timeout_seconds=(4.0, "type:image.resize"), visibility_timeout_seconds=(10.0,
                             "type:image.resize")), "a poison payload must reach dead letters after two crashes",
                             False, None, "web-1:4242:w0.1", ago(30)),
                TypeContract("invoice.generate", "default", fields(timeout_seconds=(10.0, "type:invoice.generate"),
                             visibility_timeout_seconds=(40.0, "type:invoice.generate")), "invoices are quick", True,
                             2, "web-2:777:w1.1", ago(45)),
                TypeContract("report.build", "default", fields(), None, False, None, "web-2:777:w1.1", ago(45)),
            ],
            limits=[
                {"job_type": "invoice.generate", "queue": "*", "max_running": 2, "source": "task", "reason": None},
                {"job_type": "email.send", "queue": "default", "max_running": 10, "source": "operator",
                 "reason": "smtp relay rate limit"},
            ],
        )  # fmt: skip

    def _act(self, name: str, ids: Sequence[uuid.UUID], groups: Sequence[Mapping[str, Any]] | None) -> ActionResult:
        self.calls.append((name, list(ids)))
        if groups is not None:
            self.calls.append((f"{name}_groups", [dict(g) for g in groups]))
        if self.read_only:
            raise ReadOnlyError("read-only mode: operator actions are refused")
        return ActionResult(name, len(ids), list(ids), [], audit_id=4)

    def requeue(
        self,
        job_ids: Sequence[uuid.UUID],
        reason: str | None = None,
        groups: Sequence[Mapping[str, Any]] | None = None,
        payload: Mapping[str, Any] | None = None,
        if_payload: Mapping[str, Any] | None = None,
    ) -> ActionResult:
        return self._act("requeue", job_ids, groups)

    def kill(
        self, job_ids: Sequence[uuid.UUID], reason: str | None = None, groups: Sequence[Mapping[str, Any]] | None = None
    ) -> ActionResult:
        return self._act("kill", job_ids, groups)

    def discard(
        self, job_ids: Sequence[uuid.UUID], reason: str | None = None, groups: Sequence[Mapping[str, Any]] | None = None
    ) -> ActionResult:
        return self._act("discard", job_ids, groups)

    def set_paused(self, queue: str, paused: bool, reason: str | None = None) -> ActionResult:
        self.calls.append(("set_paused", (queue, paused)))
        return ActionResult("pause" if paused else "resume", 1, [], [], audit_id=5)

    def set_limit(
        self, job_type: str, max_running: int, queue: str = "*", reason: str | None = None, *, current: int | None
    ) -> ActionResult:
        self.calls.append(("set_limit", (job_type, max_running, queue, reason)))
        return ActionResult("limit", 1, [], [], audit_id=7)

    def clear_limit(
        self, job_type: str, queue: str = "*", reason: str | None = None, *, current: int | None
    ) -> ActionResult:
        self.calls.append(("clear_limit", (job_type, queue, reason)))
        return ActionResult("unlimit", 1, [], [], audit_id=8)

    def audit_worker(self, action: str, **detail: Any) -> ActionResult:
        self.calls.append(("audit_worker", (action, detail)))
        return ActionResult(action, 0, [], [], audit_id=6)

    def abort_actions(self) -> None:
        self.calls.append(("abort_actions", None))

    def abort_reads(self) -> None:
        self.calls.append(("abort_reads", None))

    def close(self) -> None:
        pass


class FakeLauncher:
    """Embedded workers without processes: one running, one that crashed."""

    def __init__(self) -> None:
        running = EmbeddedWorker(1, ("qconsole.demo",), (), 4, host="web-1", pid=4121, started_at=ago(7200))
        running.exit_code = None
        running.proc = object()  # type: ignore[assignment]
        running.log_path = Path("/home/oncall/.local/state/qconsole/log/workers/worker-1.log")
        for line in [
            "$ python -m qconsole worker --tasks qconsole.demo --concurrency 4",
            "09:24:01 INFO worker_core.worker worker starting: queues=* types=email.send,invoice.generate",
            "09:26:40 WARNING worker_core.worker retry_scheduled (transient error): TransientError: upstream 503",
            "09:26:51 INFO worker_core.worker succeeded job_id=00000000-0000-4000-8000-000000000002",
        ]:
            running.output.append(line)
        crashed = EmbeddedWorker(2, ("qconsole.demo",), ("media",), 2, host="web-1", pid=4188, exit_code=13, crashes=1)
        crashed.output.append("[exited with code 13: crashed]")
        self._workers = [running, crashed]
        self.started: list[tuple[Any, ...]] = []
        self.stopped: list[int] = []
        self.on_exit: Callable[[EmbeddedWorker, bool], None] | None = None

    def start(
        self, tasks: Sequence[str], queues: Sequence[str] = (), concurrency: int = 4, restart: bool = True
    ) -> EmbeddedWorker:
        self.started.append((tuple(tasks), tuple(queues), concurrency))
        w = EmbeddedWorker(len(self._workers) + 1, tuple(tasks), tuple(queues), concurrency, host="web-1", pid=5000)
        self._workers.append(w)
        return w

    def stop(self, number: int) -> None:
        self.stopped.append(number)

    def stop_all(self, timeout: float | None = None) -> None:
        pass

    def workers(self) -> list[EmbeddedWorker]:
        return list(self._workers)

    def set_on_exit(self, callback: Callable[[EmbeddedWorker, bool], None] | None) -> None:
        self.on_exit = callback


@pytest.fixture
def fake_backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def clock() -> FixedClock:
    return FixedClock(T0)


def fake_app(backend: FakeBackend | None = None, **kwargs: Any) -> QConsoleApp:
    kwargs.setdefault("clock", FixedClock(T0))
    kwargs.setdefault("refresh_seconds", None)
    kwargs.setdefault("theme", "textual-dark")
    kwargs.setdefault("cursor_blink", False)
    kwargs.setdefault("launcher", FakeLauncher())
    kwargs.setdefault("default_tasks", ("qconsole.demo",))
    return make_app(backend or FakeBackend(), **kwargs)
