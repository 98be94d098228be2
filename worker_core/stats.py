"""The read side: every query the console, ``qconsole stats``/``jobs``/``job`` and the metrics server run.

Cheap on a table of millions of rows: live states come through the partial indexes, rates and series
from the per-minute rollups, never from finished rows.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from worker_core.clock import SYSTEM_CLOCK, Clock, now_on
from worker_core.db import Conn
from worker_core.errors import NotFound
from worker_core.models import (
    FINAL_STATES,
    WAITING_STATES,
    AuditEntry,
    DeadLetterGroup,
    DeadLetterGroups,
    Job,
    JobState,
    Overview,
    QueueInfo,
    TypeContract,
    TypeStats,
    WorkerInfo,
    parse_timestamp,
)

# the workers' rule (is_lost): here with the rest of what the console and the CLI are shown
from worker_core.models import LOST_AFTER_SECONDS as LOST_AFTER_SECONDS
from worker_core.models import lost_after_seconds as lost_after_seconds
from worker_core.sql import queries

#: rates are averaged over this window
WINDOW_MINUTES = 15
#: the attempts chart counts the newest this many finished jobs of its window
ATTEMPTS_SAMPLE = 50_000
SERIES_MINUTES = 60


def _ago(now: dt.datetime, minutes: int) -> dt.datetime:
    return now.replace(second=0, microsecond=0) - dt.timedelta(minutes=minutes - 1)


def overview(conn: Conn, clock: Clock = SYSTEM_CLOCK, window_minutes: int = WINDOW_MINUTES) -> Overview:
    """Per queue and job type: counts by state, lag, rates; queues; live workers; hourly series."""
    now = now_on(conn, clock)
    rows: dict[tuple[str, str], dict[str, Any]] = defaultdict(dict)
    with conn.transaction():
        for r in conn.execute(queries["stats_live"], {"now": now}):
            oldest = r.pop("oldest_ready_at")
            r["oldest_waiting_seconds"] = max(0.0, (now - oldest).total_seconds()) if oldest else 0.0
            rows[(r["queue"], r["job_type"])].update(r)
        for r in conn.execute(queries["stats_dead"]):
            rows[(r["queue"], r["job_type"])].update(r)
        window = {
            (r["queue"], r["job_type"]): r
            for r in conn.execute(queries["stats_window"], {"since": _ago(now, window_minutes)})
        }
        series_rows = conn.execute(queries["stats_series"], {"since": _ago(now, SERIES_MINUTES)}).fetchall()
        queue_rows = conn.execute(queries["queues_list"]).fetchall()
        limit_rows = conn.execute(queries["limits_list"]).fetchall()
        worker_rows = workers(conn, clock)
    paused = {q["name"] for q in queue_rows if q["paused"]}
    live = [w for w in worker_rows if w.stopped_at is None and not w.lost]
    lost = [w for w in worker_rows if w.lost]
    type_limits = {(r["job_type"], r["queue"]): r["max_running"] for r in limit_rows}
    types = []
    # the window holds its full minutes and the current one so far: a rate divides by that time, not by
    # window_minutes (at 12:00:05, a steady 60/min read 56)
    covered = window_minutes - 1 + (now - now.replace(second=0, microsecond=0)).total_seconds() / 60
    per_min = 1.0 / max(covered, 1 / 60)
    for key in sorted(set(rows) | set(window)):
        r, w = rows.get(key, {}), window.get(key, {})
        started = float(w.get("started") or 0)
        types.append(
            TypeStats(
                queue=key[0],
                job_type=key[1],
                queued=int(r.get("queued", 0)),
                queued_later=int(r.get("queued_later", 0)),
                running=int(r.get("running", 0)),
                running_expired=int(r.get("running_expired", 0)),
                retry_scheduled=int(r.get("retry_scheduled", 0)),
                failed=int(r.get("failed", 0)),
                dead_lettered=int(r.get("dead_lettered", 0)),
                succeeded=int(w.get("succeeded") or 0),
                cancelled=int(w.get("cancelled") or 0),
                oldest_waiting_seconds=float(r.get("oldest_waiting_seconds", 0.0)),
                paused=key[0] in paused,
                concurrency_limit=tightest_limit(type_limits, key[1], key[0]),
                throughput_per_min=float(w.get("succeeded") or 0) * per_min,
                dlq_per_min=float(w.get("dead_lettered") or 0) * per_min,
                lease_expirations_per_min=float(w.get("lease_expirations") or 0) * per_min,
                retries_per_min=float(w.get("retried") or 0) * per_min,
                dedup_hits_per_min=float(w.get("dedup_hits") or 0) * per_min,
                enqueued=int(w.get("enqueued") or 0),
                retries=int(w.get("retried") or 0),
                timeouts=int(w.get("timeouts") or 0),
                anomalies=int(w.get("anomalies") or 0),
                lease_expirations=int(w.get("lease_expirations") or 0),
                lock_contention=int(w.get("lock_contention") or 0),
                dedup_hits=int(w.get("dedup_hits") or 0),
                idempotency_hits=int(w.get("idempotency_hits") or 0),
                latency_avg_seconds=float(w.get("latency_ms_sum") or 0) / 1000 / started if started else 0.0,
                duration_avg_seconds=float(w.get("duration_ms_sum") or 0) / 1000 / started if started else 0.0,
                live_workers=sum(1 for x in live if claims(x, key[0], key[1])),
                lost_workers=sum(1 for x in lost if claims(x, key[0], key[1])),
            )
        )
    waiting: dict[str, int] = defaultdict(int)
    running: dict[str, int] = defaultdict(int)
    for t in types:
        waiting[t.queue] += t.waiting
        running[t.queue] += t.running
    names = sorted({t.queue for t in types} | {q["name"] for q in queue_rows})
    by_name = {q["name"]: q for q in queue_rows}
    queues_info = [
        QueueInfo(
            name=n,
            paused=n in paused,
            waiting=waiting[n],
            running=running[n],
            changed_by=(by_name.get(n) or {}).get("changed_by"),
            changed_at=(by_name.get(n) or {}).get("changed_at"),
            reason=(by_name.get(n) or {}).get("reason"),
        )
        for n in names
    ]
    start = _ago(now, SERIES_MINUTES)
    throughput: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * SERIES_MINUTES)
    for r in series_rows:
        i = int((r["minute"] - start).total_seconds() // 60)
        if 0 <= i < SERIES_MINUTES:
            throughput[(r["queue"], r["job_type"])][i] += r["succeeded"]
    return Overview(
        at=now,
        types=types,
        queues=queues_info,
        workers_alive=len(live),
        window_minutes=window_minutes,
        throughput=dict(throughput),
        limits=limit_rows,
    )


def tightest_limit(limits: dict[tuple[str, str], int], job_type: str, queue: str) -> int | None:
    """The limit that holds a type back most in a queue: its own there and its every-queue one both apply (a
    type held everywhere, 0, with billing's own 3 read "≤3" in billing, where nothing of it starts)."""
    found = [n for scope in (queue, "*") if (n := limits.get((job_type, scope))) is not None]
    return min(found) if found else None


def claims(worker: WorkerInfo, queue: str, job_type: str) -> bool:
    """Whether ``worker`` claims jobs of ``job_type`` in ``queue``: the type is one of the tasks it registered,
    and the queue one of its queues (none named: every queue), as its claim filters them."""
    return job_type in (worker.tasks or ()) and (not worker.queues or queue in worker.queues)


def unserved(t: TypeStats) -> bool:
    """Jobs of the row wait, or hold a lease that expired (a dead worker's: claimable again), and no live worker
    claims its type in its queue: nothing will run them (its lag only climbs). Not said of a paused queue or a
    type held by a limit of 0, which say why they wait already."""
    return (
        t.live_workers == 0 and t.waiting + t.running_expired > 0 and not t.paused and t.concurrency_limit != 0
    )


def series(
    conn: Conn, metric: str, clock: Clock = SYSTEM_CLOCK, minutes: int = SERIES_MINUTES, by: str = "job_type"
) -> dict[str, list[float]]:
    """Per-minute values of one counter (``retried``, ``lease_expirations``, ``succeeded``...) per job type
    (or per queue), oldest first, over the last ``minutes``."""
    if metric not in ("succeeded", "failed", "dead_lettered", "retried", "lease_expirations", "started"):
        raise ValueError(f"unknown series {metric!r}")
    now = now_on(conn, clock)
    start = _ago(now, minutes)
    out: dict[str, list[float]] = defaultdict(lambda: [0.0] * minutes)
    with conn.transaction():
        for r in conn.execute(queries["stats_series"], {"since": start}):
            i = int((r["minute"] - start).total_seconds() // 60)
            if 0 <= i < minutes:
                out[r[by]][i] += r[metric]
    return dict(out)


def is_lost(
    stopped_at: dt.datetime | None,
    last_heartbeat_at: dt.datetime,
    now: dt.datetime,
    heartbeat_interval_seconds: float | None = None,
) -> bool:
    """The workers screen's rule, which the job detail uses too: a worker that did not say goodbye and whose
    heartbeat is older than lost_after_seconds (three of its intervals, LOST_AFTER_SECONDS at least) is
    lost."""
    age = (now - last_heartbeat_at).total_seconds()
    return stopped_at is None and age > lost_after_seconds(heartbeat_interval_seconds)


def workers(conn: Conn, clock: Clock = SYSTEM_CLOCK) -> list[WorkerInfo]:
    now = now_on(conn, clock)
    out = []
    for r in conn.execute(queries["workers_list"], {"since": now - dt.timedelta(minutes=10)}):
        out.append(_worker(r, now))
    return out


def queues(conn: Conn) -> list[QueueInfo]:
    return overview(conn).queues


def get_job(conn: Conn, job_id: uuid.UUID | str) -> Job:
    try:
        jid = uuid.UUID(str(job_id))
    except ValueError:
        raise NotFound(f"{job_id!r} is not a job id") from None
    row = conn.execute(queries["job_get"], {"id": jid}).fetchone()
    if row is None:
        raise NotFound(f"no job {jid}")
    return Job.from_row(row)


def job_lock(conn: Conn, job_id: uuid.UUID) -> dict[str, Any] | None:
    """The lock_key lease the job holds itself (not who holds its key: see lock_key_holder)."""
    return conn.execute(queries["job_lock"], {"id": job_id}).fetchone()


#: lock_key_holder's "held_by": this job, another job, a lease of no job (a single_flight refill, another
#: program), a lease that ran out (free: the next acquire takes it over), or no lease at all
LOCK_HELD_BY = ("this_job", "another_job", "no_job", "expired", "nobody")


def lock_key_holder(conn: Conn, job: Job, now: dt.datetime) -> dict[str, Any] | None:
    """Who holds ``job``'s lock_key in resource_locks now, whichever job that is; None if it has no lock_key.

    ``held_by`` is one of LOCK_HELD_BY; ``job_id``, ``job_type`` and ``job_state`` are the holder's (type and
    state None when its job is gone), ``expires_in_seconds`` is negative for a lease that ran out. Only the
    PostgreSQL lock backend's leases are seen: a lease taken in Redis (``--lock-backend redis://``) is not."""
    if not job.lock_key:
        return None
    row = conn.execute(queries["job_lock_key_holder"], {"key": job.lock_key}).fetchone()
    if row is None:
        return {"lock_key": job.lock_key, "held_by": "nobody", "job_id": None, "job_type": None, "job_state": None,
                "expires_at": None, "expires_in_seconds": None}  # fmt: skip
    left = (row["expires_at"] - now).total_seconds()
    if left < 0:
        held_by = "expired"
    elif row["job_id"] is None:
        held_by = "no_job"
    else:
        held_by = "this_job" if row["job_id"] == job.id else "another_job"
    return {
        "lock_key": row["lock_key"],
        "held_by": held_by,
        "job_id": row["job_id"],
        "job_type": row["holder_type"],
        "job_state": row["holder_state"],
        "expires_at": row["expires_at"],
        "expires_in_seconds": left,
    }


@dataclass(frozen=True)
class JobHolders:
    """Who holds what a job needs, beside the job in its detail (the console's, ``qconsole job``'s)."""

    #: the server's time of the read: what the expiries and the worker's state are judged against
    at: dt.datetime
    #: the lock_key lease this job holds itself, as job_lock reads it (``qconsole job --json``'s "lock")
    lock: dict[str, Any] | None
    #: who holds the job's lock_key now (lock_key_holder); None: the job has none
    lock_holder: dict[str, Any] | None
    #: the worker a running job's locked_by names, ``lost`` judged by the workers screen's rule (is_lost);
    #: None when the job is not running, or its worker has no row (pruned a day after its last heartbeat)
    worker: WorkerInfo | None
    #: a suspect: its lease expired while its worker ran other jobs too. Only claim_solo takes it (or an
    #: expired lease): an idle worker, one job at a time, to run it alone
    suspect: bool = False
    #: its current attempt runs alone (claim_solo): a lease lost now counts towards the poison-pill rule
    ran_solo: bool = False
    #: why a waiting job has not started, or a running one's expired lease is not taken back (job_waiting); None
    #: for any other job
    waiting: JobWaiting | None = None

    @property
    def worker_state(self) -> str | None:
        """The lease holder's state as the workers screen says it: live, lost or stopped; None: no worker."""
        if self.worker is None:
            return None
        return "stopped" if self.worker.stopped_at is not None else "lost" if self.worker.lost else "live"


def expired_lease_fate(job: Job, holders: JobHolders) -> str | None:
    """What the next claim does with a running job whose lease expired (None: not running, or its lease is
    live). Only claim_solo takes an expired lease, one job per idle worker at a time: ``cancelled`` (a kill was
    requested), ``dead_lettered`` without running it again (it ran alone and has no attempts left: a poison
    pill), else ``run_alone`` (one more attempt, alone: a suspect). A paused queue, or a limit on its type with no
    room (its live leases as many as it allows: a limit of 0 always), holds ``run_alone`` back until it is resumed
    or there is room (JobWaiting.lease_held_by); a kill or a poison pill ends in a paused queue too (claim_solo)."""
    if job.state is not JobState.RUNNING or job.locked_until is None or job.locked_until >= holders.at:
        return None
    if job.cancel_requested:
        return "cancelled"
    if holders.ran_solo and job.attempts >= job.max_attempts:
        return "dead_lettered"
    return "run_alone"


def _worker(row: Mapping[str, Any], now: dt.datetime) -> WorkerInfo:
    """A workers row (its times as datetimes, or as a jsonb object writes them) judged as workers() judges it."""
    fields = {k: row[k] for k in WorkerInfo.__dataclass_fields__ if k != "lost"}
    for k in ("started_at", "last_heartbeat_at", "stopped_at"):
        if isinstance(fields[k], str):
            fields[k] = parse_timestamp(fields[k])
    lost = is_lost(fields["stopped_at"], fields["last_heartbeat_at"], now, fields["heartbeat_interval_seconds"])
    return WorkerInfo(**fields, lost=lost)


def job_holders(conn: Conn, job: Job, clock: Clock = SYSTEM_CLOCK) -> JobHolders:
    """What the job detail shows beside ``job``: its own lock lease, who holds its lock_key, its worker; and for a
    job waiting, or running on an expired lease, why it is not running (job_waiting: one statement more)."""
    now = now_on(conn, clock)
    row = conn.execute(queries["job_lease_holder"], {"id": job.id}).fetchone() or {}
    worker = None
    if job.state is JobState.RUNNING and row.get("id") is not None:
        worker = _worker(row, now)
    suspect = bool(row.get("suspect"))
    lock_holder = lock_key_holder(conn, job, now)
    expired = job.state is JobState.RUNNING and job.locked_until is not None and job.locked_until < now
    return JobHolders(
        at=now,
        lock=job_lock(conn, job.id),
        lock_holder=lock_holder,
        worker=worker,
        suspect=suspect,
        ran_solo=bool(row.get("ran_solo")),
        waiting=(
            job_waiting(conn, job, now, suspect=suspect, lock_holder=lock_holder)
            if job.state in WAITING_STATES or expired
            else None
        ),
    )


#: job_waiting counts at most this many jobs ahead of a waiting one ("more than 10,000 ahead")...
AHEAD_CAP = 10_000
#: ...among at most this many waiting jobs of every queue, in the claim order (job_queue_ready_idx holds no queue)
AHEAD_SCAN = 50_000
#: why a job waits (JobWaiting.reasons), in the order an operator needs them: not due yet; its queue paused; its type
#: at a concurrency limit; its lock_key held by another (lock_key_holder: a worker that claims it gives it back, "lock
#: contention"); no live worker takes it; else the jobs ahead of it in its queue.
WAIT_REASONS = ("due_later", "queue_paused", "type_limit", "lock_key", "no_live_worker", "in_line")


@dataclass(frozen=True)
class JobWaiting:
    """Why ``job`` has not started (job_waiting), judged at ``at`` as the claims judge it."""

    at: dt.datetime
    #: when it is due, if later than ``at`` (a job enqueued for later, a retry in its backoff); None: due now
    due_at: dt.datetime | None
    #: its queue, if paused: ``queue``, ``changed_by`` (who paused it), ``changed_at``, ``reason`` (its audit entry's)
    paused: dict[str, Any] | None
    #: the limits on its type that apply in its queue (its queue's own and its every-queue one, as limits_list has
    #: them), each with ``running``: its type's running jobs the limit counts (in its queue, or in all), as
    #: claim_limited counts them, and ``running_live``: those with a live lease, as claim_solo counts them
    limits: list[dict[str, Any]]
    #: the workers not stopped that claim its type in its queue (claims), live or lost (is_lost)
    live_workers: list[WorkerInfo]
    lost_workers: list[WorkerInfo]
    #: the jobs of its queue due before it in the claim order (priority, then due time, then id), at most AHEAD_CAP
    #: + 1; None when not counted (it is not due, or a suspect, which claim_solo takes in an order of its own)
    ahead: int | None = None
    #: ``ahead`` is a floor: the walk stopped after AHEAD_SCAN waiting jobs of every queue, or past AHEAD_CAP
    ahead_more: bool = False
    #: of ``ahead``, the jobs of its type (a worker claims the types it registered, each type's limit apart: the
    #: others in its queue are ahead of it only for a worker that takes them too)
    ahead_of_type: int | None = None
    #: its lock_key is held now by another job, or a lease of no job (lock_key_holder)
    lock_held: bool = False

    @property
    def full_limits(self) -> list[dict[str, Any]]:
        """The limits with no room left for a waiting job of its type: as many running as the limit (0 holds it)."""
        return [r for r in self.limits if r["running"] >= r["max_running"]]

    @property
    def lease_held_by(self) -> list[str]:
        """What keeps a running job's expired lease from being taken back (claim_solo skips it): ``queue_paused``,
        ``type_limit`` (as many live leases of its type as a limit allows: a limit of 0 always). A kill requested
        or a poison pill ends anyway (expired_lease_fate)."""
        held = ["queue_paused"] if self.paused else []
        if any(r["running_live"] >= r["max_running"] for r in self.limits):
            held.append("type_limit")
        return held

    @property
    def reasons(self) -> list[str]:
        """Of WAIT_REASONS, those that hold the job back, in that order; ``in_line`` only when nothing else does."""
        found = [
            name
            for name, holds in (
                ("due_later", self.due_at is not None),
                ("queue_paused", self.paused is not None),
                ("type_limit", bool(self.full_limits)),
                ("lock_key", self.lock_held),
                ("no_live_worker", not self.live_workers),
            )
            if holds
        ]
        return found or (["in_line"] if self.ahead is not None else [])


def job_waiting(
    conn: Conn, job: Job, now: dt.datetime, *, suspect: bool = False, lock_holder: Mapping[str, Any] | None = None
) -> JobWaiting:
    """Why ``job`` (waiting, or running on an expired lease) is not running at ``now``: one statement (job_waiting),
    bounded (the jobs ahead of it: AHEAD_SCAN index entries at most)."""
    due = job.scheduled_at <= now
    row = conn.execute(
        queries["job_waiting"],
        {
            "job_type": job.job_type,
            "queue": job.queue,
            "now": now,
            "count_ahead": job.state in WAITING_STATES and due and not suspect,
            "priority": job.priority,
            "scheduled_at": job.scheduled_at,
            "id": job.id,
            "scan": AHEAD_SCAN,
        },
    ).fetchone()
    assert row is not None  # one row, whatever there is
    workers_ = [w for w in (_worker(r, now) for r in row["workers"]) if claims(w, job.queue, job.job_type)]
    paused = None
    if row["paused"]:
        paused = {"queue": job.queue, "changed_by": row["changed_by"], "changed_at": row["changed_at"],
                  "reason": row["pause_reason"]}  # fmt: skip
    ahead = of_type = None
    more = False
    if job.state in WAITING_STATES and due and not suspect:
        ahead, of_type = min(int(row["ahead"]), AHEAD_CAP), min(int(row["ahead_of_type"]), AHEAD_CAP)
        more = row["ahead"] > AHEAD_CAP or row["scanned"] >= AHEAD_SCAN
    limits_ = [
        {**r, "updated_at": parse_timestamp(r["updated_at"]) if isinstance(r["updated_at"], str) else r["updated_at"]}
        for r in row["limits"]
    ]
    return JobWaiting(
        at=now,
        due_at=None if due else job.scheduled_at,
        paused=paused,
        limits=limits_,
        live_workers=[w for w in workers_ if not w.lost],
        lost_workers=[w for w in workers_ if w.lost],
        ahead=ahead,
        ahead_more=more,
        ahead_of_type=of_type,
        lock_held=lock_holder is not None and lock_holder["held_by"] in ("another_job", "no_job"),
    )


_JOB_COLUMNS = sql.SQL(", ").join(sql.Identifier(c) for c in Job.__dataclass_fields__)
#: list_jobs' sources, each read newest first through an index: waiting jobs (job_queue_waiting_updated_idx),
#: running ones (as many as the workers hold: sorted), finished ones by when they finished
#: (job_queue_finished_idx; for them updated_at is finished_at). Ties (a batch settles hundreds of jobs at
#: one timestamp) are broken by id in each source as in the merge, so the first N are the same N.
#: Each source's condition is its index's predicate, written as migration 0010 writes it: the waiting jobs'
#: in a form that implies no other index's predicate (the ready index sorted by priority would do, on
#: statistics that expect no waiting job: sorting them all), and that no claim implies.
_ACTIVITY_SOURCES: tuple[tuple[tuple[JobState, ...], str, str], ...] = (
    (
        WAITING_STATES,
        "(state IN ('queued', 'retry_scheduled')) IS TRUE AND updated_at > '-infinity'",
        "updated_at DESC, id",
    ),
    ((JobState.RUNNING,), "state = 'running'", "updated_at DESC, id"),
    (FINAL_STATES, "state IN ('succeeded', 'failed', 'dead_lettered', 'cancelled')", "finished_at DESC, id"),
)


_UNSUCCESSFUL = (JobState.FAILED, JobState.DEAD_LETTERED, JobState.CANCELLED)


def list_jobs(
    conn: Conn,
    *,
    state: str | JobState | None = None,
    job_type: str | None = None,
    queue: str | None = None,
    search: str | None = None,
    limit: int = 100,
    next_first: bool = False,
    after: Job | None = None,
) -> list[Job]:
    """Jobs by filter, newest activity first. ``search`` matches an id prefix, idempotency, dedup or lock
    key, or the error text (see _search_query for how far each looks). Every value is a bound parameter.
    ``next_first`` (and no search): the waiting jobs in the order the workers claim them (priority, then
    not-before time, then id), the head of the queue first: the oldest waiting job, the one behind a lag,
    was past the newest 10,000 of a backlog.
    ``after`` (no search): the page that follows this job in the list's order, as the job was when it was
    read (its sort values, not its row now: a page stays put while the jobs on the one before it move on).
    Keyset paging, through the same indexes as the first page: page 500 costs what page 1 does."""
    query, params = list_jobs_query(
        state=state, job_type=job_type, queue=queue, search=search, limit=limit, next_first=next_first, after=after
    )
    return [Job.from_row(r) for r in conn.execute(query, params)]


def list_jobs_query(
    *,
    state: str | JobState | None = None,
    job_type: str | None = None,
    queue: str | None = None,
    search: str | None = None,
    limit: int = 100,
    next_first: bool = False,
    after: Job | None = None,
) -> tuple[sql.Composed, dict[str, Any]]:
    """list_jobs' statement and parameters. No index holds every row version by updated_at (migration
    0009): it takes the newest of each of _ACTIVITY_SOURCES, each through its index, and merges them."""
    if after is not None and search:
        raise ValueError("a search is not paged: its matches are the newest ones (refine it instead)")
    where: list[sql.Composable] = []
    params: dict[str, Any] = {"limit": max(1, min(int(limit), 10_000))}
    if state:
        params["state"] = JobState(state).value
        if JobState(state) in _UNSUCCESSFUL:
            # plainly: it walks job_queue_unsuccessful_idx (state, finished_at DESC, id), newest first
            where.append(sql.SQL("state = %(state)s"))
        else:
            # a filter only: written so that it implies no partial index's predicate (each source's does)
            where.append(sql.SQL("(state = %(state)s) IS TRUE"))
    if job_type:
        params["job_type"] = job_type
        where.append(sql.SQL("job_type = %(job_type)s"))
    if queue:
        params["queue"] = queue
        where.append(sql.SQL("queue = %(queue)s"))
    if search:
        return _search_query(search, where, params, state)
    if next_first:
        if state and JobState(state) not in WAITING_STATES:
            where.append(sql.SQL("false"))  # a finished or running job is no longer in line
        if after is not None:
            # a row comparison in the index's own order: the walk starts where the page before ended
            params.update(after_priority=after.priority, after_at=after.scheduled_at, after_id=after.id)
            where.append(sql.SQL("(priority, scheduled_at, id) > (%(after_priority)s, %(after_at)s, %(after_id)s)"))
        # through job_queue_ready_idx (its predicate, its order): the claim's walk
        query = sql.SQL(
            "SELECT {cols} FROM job_queue WHERE {where} ORDER BY priority, scheduled_at, id LIMIT %(limit)s"
        ).format(
            cols=_JOB_COLUMNS,
            where=sql.SQL(" AND ").join([sql.SQL("state IN ('queued', 'retry_scheduled')"), *where]),
        )
        return query, params
    if after is not None:
        # (updated_at DESC, id): older, or as old with a greater id. Mixed directions make no row comparison;
        # `updated_at <=` is what bounds each source's index walk, the OR only sorts out the ties
        params.update(after_at=after.updated_at, after_id=after.id)
        where.append(sql.SQL("updated_at <= %(after_at)s AND (updated_at < %(after_at)s OR id > %(after_id)s)"))
    branches = []
    for states, condition, order in _ACTIVITY_SOURCES:
        if state and JobState(state) not in states:
            continue
        bounds = where
        if after is not None and order.startswith("finished_at"):
            # the finished jobs are walked by finished_at, which their settlement wrote with updated_at (a
            # later change only moves updated_at on): finished_at <= updated_at, so this bound drops none
            bounds = [*where, sql.SQL("finished_at <= %(after_at)s")]
        branches.append(
            sql.SQL("(SELECT {cols} FROM job_queue WHERE {where} ORDER BY {order} LIMIT %(limit)s)").format(
                cols=_JOB_COLUMNS,
                where=sql.SQL(" AND ").join([sql.SQL(condition), *bounds]),
                order=sql.SQL(order),
            )
        )
    query = sql.SQL("SELECT {cols} FROM ({branches}) AS j ORDER BY updated_at DESC, id LIMIT %(limit)s").format(
        cols=_JOB_COLUMNS, branches=sql.SQL(" UNION ALL ").join(branches)
    )
    return query, params


#: a search's key and error-text matches look at this many of the newest jobs of each kind (waiting,
#: running, finished), through their indexes: a scan of every finished row (millions) for a text no index
#: holds timed out, and the table went on showing unfiltered rows. Ids and idempotency keys, which have an
#: index, are found among all jobs.
SEARCH_SCAN_ROWS = 50_000
_UUID_TEMPLATE = "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"


def id_prefix_range(search: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """The ids a prefix of a job id's text covers, as a range of the primary key; None if ``search`` is not
    such a prefix. ``"1a2b"`` covers 1a2b0000-0000-... to 1a2bffff-ffff-..."""
    text = search.strip().lower()
    if not text or len(text) > len(_UUID_TEMPLATE):
        return None
    for char, slot in zip(text, _UUID_TEMPLATE, strict=False):
        if (slot == "-") != (char == "-") or (slot != "-" and char not in "0123456789abcdef"):
            return None
    digits = text.replace("-", "")
    return uuid.UUID(digits.ljust(32, "0")), uuid.UUID(digits.ljust(32, "f"))


def _search_query(
    search: str, where: list[sql.Composable], params: dict[str, Any], state: str | JobState | None
) -> tuple[sql.Composed, dict[str, Any]]:
    """list_jobs with ``search``: an id prefix (a range of the primary key), an idempotency key (its index),
    or a dedup key, lock key or error text among the newest SEARCH_SCAN_ROWS jobs of each kind."""
    params["search"] = search
    # LIKE metacharacters in the search are literal
    escaped = search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    params["like"] = "%" + escaped + "%"
    params["scan"] = SEARCH_SCAN_ROWS
    filters = [*where] or [sql.SQL("true")]
    arms = []

    def arm(condition: str, inner: sql.Composable | None = None, order: str = "updated_at DESC, id") -> sql.Composed:
        text = "(SELECT {cols} FROM {source} WHERE {where} ORDER BY {order} LIMIT %(limit)s)"
        return sql.SQL(text).format(
            cols=_JOB_COLUMNS,
            source=inner or sql.SQL("job_queue"),
            where=sql.SQL(" AND ").join([sql.SQL(condition), *filters]),
            order=sql.SQL(order),
        )

    found = id_prefix_range(search)
    if found is not None:
        params["id_low"], params["id_high"] = found
        # in id order, through the primary key: a short prefix covers a sixteenth of the table or more,
        # which sorted by activity cost a second at 6M rows
        arms.append(arm("id BETWEEN %(id_low)s AND %(id_high)s", order="id"))
    arms.append(arm("idempotency_key = %(search)s"))
    for states, condition, order in _ACTIVITY_SOURCES:
        if state and JobState(state) not in states:
            continue
        # the newest of the kind that pass the filters (type, queue, state): a failed job older than the
        # newest 50,000 successes is still found by a search on failed jobs (job_queue_unsuccessful_idx
        # keeps that cheap; a rare type reads further)
        newest = sql.SQL("(SELECT * FROM job_queue WHERE {cond} ORDER BY {order} LIMIT %(scan)s) AS newest").format(
            cond=sql.SQL(" AND ").join([sql.SQL(condition), *where]), order=sql.SQL(order)
        )
        arms.append(arm("(dedup_key = %(search)s OR lock_key = %(search)s OR last_error ILIKE %(like)s)", newest))
    query = sql.SQL("SELECT {cols} FROM ({arms}) AS j ORDER BY updated_at DESC, id LIMIT %(limit)s").format(
        cols=_JOB_COLUMNS, arms=sql.SQL(" UNION ").join(arms)
    )
    return query, params


def dead_letter_groups(
    conn: Conn,
    *,
    job_type: str | None = None,
    states: tuple[str, ...] = ("dead_lettered",),
    limit: int | None = 200,
    max_ids: int | None = 1000,
) -> DeadLetterGroups:
    """The biggest ``limit`` groups of jobs by type, error fingerprint and state, with what there is in all;
    each with the ids of its newest ``max_ids`` jobs. None: every group, every id (`dead-letters --all`)."""
    rows = conn.execute(
        queries["dead_letter_groups"],
        {"states": list(states), "job_type": job_type, "limit": limit, "max_ids": max_ids},
    ).fetchall()
    first = rows[0] if rows else {}
    groups = [
        DeadLetterGroup(
            job_type=r["job_type"],
            fingerprint=r["fingerprint"],
            sample_error=r["sample_error"] or "",
            count=r["n"],
            first_seen=r["first_seen"],
            last_seen=r["last_seen"],
            job_ids=list(r["job_ids"] or []),
            state=r["state"],
        )
        for r in rows
    ]
    return DeadLetterGroups(
        groups,
        total_groups=int(first.get("total_groups") or 0),
        dead=int(first.get("total_dead") or 0),
        retrying=int(first.get("total_retrying") or 0),
    )


def audit_log(conn: Conn, limit: int = 100) -> list[AuditEntry]:
    return [AuditEntry(**r) for r in conn.execute(queries["audit_list"], {"limit": limit})]


def oldest_waiting(conn: Conn, clock: Clock = SYSTEM_CLOCK, by: str = "queue") -> dict[str, float]:
    """The age, in seconds, of the oldest job due and waiting now, per queue (or job type)."""
    now = now_on(conn, clock)
    out: dict[str, float] = {}
    with conn.transaction():
        for r in conn.execute(queries["stats_live"], {"now": now}):
            if r["oldest_ready_at"] is not None:
                age = max(0.0, (now - r["oldest_ready_at"]).total_seconds())
                out[r[by]] = max(out.get(r[by], 0.0), age)
    return out


def latency_series(
    conn: Conn,
    clock: Clock = SYSTEM_CLOCK,
    minutes: int = SERIES_MINUTES,
    by: str = "queue",
    waiting: Mapping[str, float] | None = None,
) -> dict[str, list[float]]:
    """Queue latency (enqueue or due time to start), averaged per minute, in seconds, per queue (or job
    type), oldest first, over the last ``minutes``. A minute in which nothing started is 0; ``waiting``
    (oldest_waiting) raises the last minute to the age of the oldest job waiting now: else a queue from
    which nothing starts (its workers dead, say) read 0 exactly when its lag was worst."""
    if by not in ("queue", "job_type"):
        raise ValueError(f"cannot group latency by {by!r}")
    start = _ago(now_on(conn, clock), minutes)
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * minutes)
    counts: dict[str, list[float]] = defaultdict(lambda: [0.0] * minutes)
    with conn.transaction():
        for r in conn.execute(queries["stats_latency_series"], {"since": start}):
            i = int((r["minute"] - start).total_seconds() // 60)
            if 0 <= i < minutes:
                sums[r[by]][i] += r["latency_ms_sum"]
                counts[r[by]][i] += r["started"]
    out = {key: [s / c / 1000.0 if c else 0.0 for s, c in zip(sums[key], counts[key], strict=True)] for key in sums}
    for key, age in (waiting or {}).items():
        series = out.setdefault(key, [0.0] * minutes)
        series[-1] = max(series[-1], age)
    return out


def attempts_distribution(
    conn: Conn, clock: Clock = SYSTEM_CLOCK, minutes: int = SERIES_MINUTES
) -> dict[str, dict[int, int]]:
    """Per job type: how many jobs that finished in the last ``minutes`` took 1, 2, 3... attempts (of the
    newest ATTEMPTS_SAMPLE of them: the chart is a distribution, and a busy hour's are millions)."""
    since = now_on(conn, clock) - dt.timedelta(minutes=minutes)
    out: dict[str, dict[int, int]] = defaultdict(dict)
    params = {"since": since, "sample": ATTEMPTS_SAMPLE}
    for r in conn.execute(queries["stats_attempts_distribution"], params):
        out[r["job_type"]][int(r["attempts"])] = int(r["n"])
    return dict(out)


def limits(conn: Conn) -> list[dict[str, Any]]:
    """Every global concurrency limit: job_type, queue ('*' for all), max_running, source ('operator' or 'task'),
    reason, updated_at, set_by (the operator, from the audit log; None for a @task's)."""
    return conn.execute(queries["limits_list"]).fetchall()


def type_contracts(conn: Conn) -> list[TypeContract]:
    """The contract of every job type as the workers that run it registered it."""
    return [
        TypeContract(
            job_type=r["job_type"],
            queue=r["queue"],
            fields={k: (v["value"], v["source"]) for k, v in r["contract"].items()},
            reason=r["reason"],
            requires_idempotency_key=r["requires_idempotency_key"],
            concurrency=r["concurrency"],
            reported_by=r["reported_by"],
            reported_at=r["reported_at"],
        )
        for r in conn.execute(queries["contracts_list"])
    ]
