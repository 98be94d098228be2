"""How the CLI prints: rich tables for people, ``--json`` for scripts. No data access here."""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qconsole.widgets.fmt import PAUSED, ago, duration, elapsed, hms, printable, stamp
from worker_core.models import (
    ActionResult,
    AuditEntry,
    DeadLetterGroup,
    Job,
    JobState,
    Overview,
    TypeContract,
    WorkerInfo,
    to_jsonable,
)
from worker_core.ops import GROUPS_KEY, WORKER_ACTIONS
from worker_core.stats import (
    AHEAD_CAP,
    AHEAD_SCAN,
    JobHolders,
    expired_lease_fate,
    unserved,
)

#: piped output is for scripts and logs: never squeeze it to 80 columns
console = Console(highlight=False, width=None if sys.stdout.isatty() else 240)


def _json(value: Any) -> None:
    print(_dumps(to_jsonable(value)))


def _dumps(value: Any) -> str:
    """JSON that every parser takes (jq, JSON.parse, json.loads(strict)): never NaN or Infinity."""
    return json.dumps(_finite(value), indent=2, sort_keys=False, default=str, allow_nan=False)


#: what a number of a payload that a float cannot hold is written as: jsonb holds any numeric exactly
#: (1e400, from another producer or a fix in SQL), Python's json reads it as Infinity, which is no JSON
OUT_OF_FLOAT_RANGE = "(a number out of float range: {})"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return OUT_OF_FLOAT_RANGE.format(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _row(table: Table, *cells: Any) -> None:
    """A row of data, never of markup: a reason like ``INC-7 [/var full]`` is printed as it is (as markup it
    would vanish, or raise), and job data reaches the terminal without its escape sequences."""
    table.add_row(*(Text(printable(str(c))) for c in cells))


def ts(value: dt.datetime | None) -> str:
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def jobs(rows: list[Job], as_json: bool, more_after: str | None = None, now: dt.datetime | None = None) -> None:
    """``more_after``: the page is full, and the next one follows this job (said on stderr: the output stays
    the rows alone for the scripts that read it). ``now``: the server's time, which says when a job waiting for
    its time (enqueued for later, a retry's backoff) is due."""
    if as_json:
        _json(rows)
    else:
        _jobs_table(rows, now)
    if more_after is not None:
        print(f"more may follow: the same command with --after {more_after}", file=sys.stderr)


def _jobs_table(rows: list[Job], now: dt.datetime | None = None) -> None:
    t = Table("id", "type", "queue", "state", "due", "attempt", "updated", "last error", box=None, pad_edge=False)
    waiting = (JobState.QUEUED, JobState.RETRY_SCHEDULED)
    for j in rows:
        _row(t,
            str(j.id),
            j.job_type,
            j.queue,
            j.state.value,
            # a job enqueued for later read as any other queued one
            f"in {duration((j.scheduled_at - now).total_seconds())}" if now is not None and j.state in waiting
            and j.scheduled_at > now else "",
            f"{j.attempts}/{j.max_attempts}",
            ts(j.updated_at),
            (j.last_error or "")[:60],
        )
    console.print(t)
    console.print(f"{len(rows)} job(s)")


#: the marks the console's overview puts on a type no live worker runs in its queue, and on a paused queue
NO_WORKER = "∅"
#: lost workers named by id in a waiting job's "workers" line, at most (the workers screen lists them all)
LOST_NAMED = 3


def _at(t: dt.datetime, now: dt.datetime) -> str:
    """A time near ``now`` as the console shows it (``14:03:12 UTC``), a farther one with its date."""
    return f"{hms(t)} UTC" if abs((t - now).total_seconds()) < 12 * 3600 else stamp(t)


def _set_by(r: dict[str, Any], now: dt.datetime) -> str:
    """Who set a limit (stats.limits' row), when and why."""
    who = "its @task" if r["source"] == "task" else (r.get("set_by") or "an operator")
    when = f" {ago(r['updated_at'], now)}" if r.get("updated_at") and r["source"] != "task" else ""
    return f"set by {who}{when}" + (f": {r['reason']}" if r.get("reason") else "")


def _scope(queue: str) -> str:
    return "every queue" if queue == "*" else f"queue {queue}"


def waiting_said(j: Job, holders: JobHolders, lock: str | None = None) -> list[tuple[str, str]]:
    """Why a waiting job has not started, the most pressing first (stats.JobWaiting.reasons), as (label, text) rows:
    the job detail's and ``qconsole job``'s. ``lock``: the caller's own "lock" row (who holds its lock_key), put at its
    place among them; [] for a job not waiting."""
    w = holders.waiting
    if w is None or j.state not in (JobState.QUEUED, JobState.RETRY_SCHEDULED):
        return []
    now = w.at
    rows: list[tuple[str, str]] = []
    if w.due_at is not None:
        what = (
            f"a retry, in its backoff after attempt {j.attempts} of {j.max_attempts} failed"
            if j.state is JobState.RETRY_SCHEDULED
            else "enqueued for later"
        )
        rows.append(("due", f"in {duration((w.due_at - now).total_seconds())} ({_at(w.due_at, now)}): {what}"))
    if w.paused is not None:
        p = w.paused
        by = f"by {p['changed_by']} " if p["changed_by"] else ""
        since = ago(p["changed_at"], now) if p["changed_at"] else "earlier"
        why = f": {p['reason']}" if p["reason"] else ""
        rows.append(("paused", f"{PAUSED} its queue {j.queue} is paused ({by}{since}{why}): no worker claims from it"
                               f" until it is resumed (qconsole resume {j.queue})"))  # fmt: skip
    for r in w.full_limits:
        if r["max_running"] == 0:
            said = (f"{PAUSED} its type is held by a limit of 0 in {_scope(r['queue'])} ({_set_by(r, now)}): no"
                    " worker starts it until the limit is raised or cleared")  # fmt: skip
        else:
            said = (f"its type is at its limit, ≤{r['max_running']} in {_scope(r['queue'])}, {r['running']} running"
                    f" now ({_set_by(r, now)}): it starts when one of them ends")  # fmt: skip
        rows.append(("limit", said))
    if lock is not None:
        contention = "; a worker that claims it gives it back (lock contention)" if w.lock_held else ""
        rows.append(("lock", lock + contention))
    if not w.live_workers:
        said = f"{NO_WORKER} no live worker takes {j.job_type} in {j.queue}"
        if w.lost_workers:
            named = ", ".join(
                f"{x.id} (last heartbeat {ago(x.last_heartbeat_at, now)})" for x in w.lost_workers[:LOST_NAMED]
            )
            more = f" and {len(w.lost_workers) - LOST_NAMED} more" if len(w.lost_workers) > LOST_NAMED else ""
            said += f"; lost: {named}{more}"
        else:
            said += f": no running worker registered {j.job_type} for {j.queue} (--tasks, --queue)"
        rows.append(("workers", said))
    if w.reasons == ["in_line"] and w.ahead is not None:
        if w.ahead == 0 and not w.ahead_more:
            said = f"next in line in {j.queue}: the next claim there takes it"
        elif w.ahead >= AHEAD_CAP:
            said = f"more than {AHEAD_CAP:,} jobs ahead of it in {j.queue}"
        else:
            floor = "at least " if w.ahead_more else ""
            said = f"{floor}{w.ahead:,} job(s) ahead of it in {j.queue}, {floor}{w.ahead_of_type:,} of them"
            said += f" {j.job_type}"
            if w.ahead_more:
                said += f" (of the first {AHEAD_SCAN:,} waiting jobs of every queue)"
        rows.append(("in line", said + "; the claim order: priority, lowest first, then due time"))
    return rows


def expired_lease_said(j: Job, holders: JobHolders) -> str | None:
    """What becomes of a running job's expired lease (stats.expired_lease_fate), and what holds it back (a paused
    queue, a limit with no room: JobWaiting.lease_held_by); None when the job is not running on an expired lease."""
    fate = expired_lease_fate(j, holders)
    if fate == "cancelled":
        return "the next claim ends it: cancelled (its kill was requested)"
    if fate == "dead_lettered":
        return ("the next claim dead-letters it without running it again: it ran alone and has no attempts left (a"
                " poison pill)")  # fmt: skip
    if fate is None:
        return None
    w = holders.waiting
    held = w.lease_held_by if w is not None else []
    said = []
    if w is not None and "queue_paused" in held:
        said.append(f"{PAUSED} its queue {j.queue} is paused: no worker reclaims it until it is resumed (qconsole"
                    f" resume {j.queue}); a kill still ends it")  # fmt: skip
    if w is not None and "type_limit" in held:
        for r in w.limits:
            if r["running_live"] < r["max_running"]:
                continue
            if r["max_running"] == 0:
                said.append(f"{PAUSED} its type is held by a limit of 0: no worker reclaims it until the limit is"
                            f" raised (qconsole limit {j.job_type} --clear)")  # fmt: skip
            else:
                said.append(f"its type's limit, ≤{r['max_running']} in {_scope(r['queue'])}, has no room"
                            f" ({r['running_live']} running on a live lease): no worker reclaims it until one ends")
    if said:
        return "; ".join(said)
    return ("only an idle worker reclaims it, and runs it alone as a suspect (claim_solo: it may be what stopped its"
            " worker): a dead worker's jobs are taken back one per idle worker at a time")  # fmt: skip


def job(j: Job, holders: JobHolders, as_json: bool) -> None:
    """The job; why it waits (stats.JobWaiting: due later, its queue paused, its type at a limit, its lock_key held,
    no live worker, the jobs ahead of it); who holds its lock_key (whichever job: a job waiting on its key was told it
    was free), and the worker holding its lease in the workers screen's terms (live, lost, stopped)."""
    now = holders.at
    w = holders.worker
    if as_json:
        out = to_jsonable(j)
        out["lock"] = to_jsonable(holders.lock) if holders.lock else None  # the lease this job holds itself
        out["lock_holder"] = to_jsonable(holders.lock_holder) if holders.lock_holder else None
        out["lease_holder"] = None
        if j.state is JobState.RUNNING and j.locked_by:
            out["lease_holder"] = {
                "worker_id": j.locked_by,
                "state": holders.worker_state or "unknown",  # unknown: no workers row (pruned)
                "last_heartbeat_at": to_jsonable(w.last_heartbeat_at) if w else None,
                "stopped_at": to_jsonable(w.stopped_at) if w and w.stopped_at else None,
                # once its lease expired: cancelled, dead_lettered or run_alone (stats.expired_lease_fate)
                "expired_lease_next": expired_lease_fate(j, holders),
                # what holds run_alone back: queue_paused, type_limit (stats.JobWaiting.lease_held_by)
                "expired_lease_held_by": holders.waiting.lease_held_by if holders.waiting else [],
            }
        out["suspect"] = holders.suspect
        out["ran_solo"] = holders.ran_solo
        out["waiting"] = None
        if holders.waiting is not None and j.state in (JobState.QUEUED, JobState.RETRY_SCHEDULED):
            out["waiting"] = {"reasons": holders.waiting.reasons, **to_jsonable(holders.waiting)}
        print(_dumps(out))
        return
    lock_said = None
    lock = holders.lock_holder
    if lock is not None:
        key, left = lock["lock_key"], lock["expires_in_seconds"]
        until = f"until {ts(lock['expires_at'])} (expires in {duration(left or 0)})"
        lock_said = {
            "nobody": f"{key} not held",
            "expired": f"{key}: its lease expired {duration(-(left or 0))} ago (free to take)",
            "this_job": f"{key} held by this job {until}",
            "no_job": f"{key} held by a lease of no job (a single_flight refill, another program) {until}",
            "another_job": f"{key} held by job {lock['job_id']}"
            + (f" ({lock['job_type']}, {lock['job_state']})" if lock["job_type"] else " (gone: pruned)")
            + f" {until}",
        }[lock["held_by"]]
    # why it waits comes right after its state (its lock among the reasons), the most pressing first
    waiting = waiting_said(j, holders, lock_said)
    t = Table(box=None, show_header=False, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    for name in (
        "id", "job_type", "queue", "state", "attempts", "max_attempts", "priority", "idempotency_key", "dedup_key",
        "lock_key", "tenant_id", "trace_id", "timeout_seconds", "visibility_timeout_seconds", "scheduled_at",
        "locked_by", "locked_until", "lease_expirations", "created_at", "started_at", "finished_at", "updated_at",
    ):  # fmt: skip
        value = getattr(j, name)
        _row(t, name, ts(value) if isinstance(value, dt.datetime) else ("-" if value is None else str(value)))
        if name == "state":
            for label, said in waiting:
                _row(t, label, said)
    _row(t, "retry_policy", json.dumps(j.retry_policy))
    if lock_said is not None and not waiting:
        _row(t, "lock", lock_said)
    if j.state is JobState.RUNNING and j.locked_by:
        if w is None:
            said = "no such worker: pruned a day after its last heartbeat"
        elif w.stopped_at is not None:
            said = f"stopped at {ts(w.stopped_at)}"
        elif w.lost:
            since = ts(w.lost_since)
            said = f"LOST since {since} (last heartbeat {duration((now - w.last_heartbeat_at).total_seconds())} ago)"
        else:
            said = f"live: heartbeat {duration((now - w.last_heartbeat_at).total_seconds())} ago"
        _row(t, "lease holder", f"{j.locked_by}: {said}")
        then = expired_lease_said(j, holders)
        if then is not None and j.locked_until is not None:
            _row(t, "lease", f"expired {duration((now - j.locked_until).total_seconds())} ago: {then}")
    if holders.suspect and j.state in (JobState.QUEUED, JobState.RETRY_SCHEDULED):
        _row(t, "claim", "a suspect: only an idle worker takes it, and runs it alone (claim_solo)")
    console.print(t)
    console.print("[bold]payload[/bold]")
    console.print(Text(printable(json.dumps(j.payload, indent=2, ensure_ascii=False))))
    if j.errors:
        e = Table("attempt", "kind", "class", "message", "worker", "at", box=None, pad_edge=False, title="errors")
        for err in j.errors:
            _row(e, str(err.attempt), err.kind, err.error_class, err.message, err.worker or "-", ts(err.at))
        console.print(e)


def overview(ov: Overview, as_json: bool) -> None:
    if as_json:
        _json(
            {
                "at": ov.at,
                "window_minutes": ov.window_minutes,
                "workers_alive": ov.workers_alive,
                "queues": ov.queues,
                "limits": ov.limits,
                "types": [{**to_jsonable(t), "waiting": t.waiting, "queued_due": t.queued_due} for t in ov.types],
            }
        )
        return
    t = Table(
        "queue", "type", "queued", "later", "running", "retry", "failed", "dead", "lag", "ok/min", "dlq/min",
        "lease exp/min", "retries", "latency", "handler",
        box=None, pad_edge=False, title=f"last {ov.window_minutes} min",
    )  # fmt: skip
    for s in ov.types:
        _row(t,
            s.queue + (" (paused)" if s.paused else ""),
            s.job_type,
            str(s.queued),
            str(s.queued_later),
            # a dead worker's jobs stay running until their lease is taken over
            f"{s.running} ({s.running_expired} expired)" if s.running_expired else str(s.running),
            str(s.retry_scheduled),
            str(s.failed),
            str(s.dead_lettered),
            duration(s.oldest_waiting_seconds),
            f"{s.throughput_per_min:.1f}",
            f"{s.dlq_per_min:.2f}",
            f"{s.lease_expirations_per_min:.2f}",
            str(s.retries),
            elapsed(s.latency_avg_seconds),
            elapsed(s.duration_avg_seconds),
        )
    console.print(t)
    console.print(f"workers alive: {ov.workers_alive}")
    for q in ov.queues:
        if q.paused:  # who paused it, since when, why: what the engineer asks before resuming it
            since = f" {duration((ov.at - q.changed_at).total_seconds())} ago" if q.changed_at else ""
            by = f" by {q.changed_by}" if q.changed_by else ""
            console.print(Text(printable(f"paused: {q.name}{since}{by}" + (f": {q.reason}" if q.reason else ""))))
    for r in ov.limits:
        if r["max_running"] == 0:  # a held type waits as a paused queue does
            scope = "every queue" if r["queue"] == "*" else r["queue"]
            origin = "its @task" if r["source"] == "task" else (r.get("set_by") or "an operator")
            console.print(Text(printable(
                f"held (limit 0): {r['job_type']} in {scope}, by {origin}" + (f": {r['reason']}" if r["reason"] else "")
            )))  # fmt: skip
    nobody = [f"{s.job_type} in {s.queue}" for s in ov.types if unserved(s)]
    if nobody:
        # their jobs wait for ever: only the lag said anything
        console.print(Text(printable(f"no live worker runs: {', '.join(nobody)}")))


def workers(rows: list[WorkerInfo], as_json: bool) -> None:
    if as_json:
        _json(rows)
        return
    t = Table("id", "host", "pid", "queues", "conc", "in flight", "last heartbeat", "status", "job types", box=None,
              pad_edge=False)  # fmt: skip
    for w in rows:
        status = "stopped" if w.stopped_at else ("LOST" if w.lost else "alive")
        _row(t,
            w.id, w.host, str(w.pid), ",".join(w.queues or ["*"]), str(w.concurrency), str(w.in_flight),
            ts(w.last_heartbeat_at), status, ",".join(w.tasks) or "-",
        )  # fmt: skip
    console.print(t)


def dead_letter_groups(groups: list[DeadLetterGroup], as_json: bool) -> None:
    if as_json:
        _json(groups)
        return
    t = Table("type", "state", "count", "first seen", "last seen", "error", box=None, pad_edge=False)
    for g in groups:
        _row(t, g.job_type, g.state, str(g.count), ts(g.first_seen), ts(g.last_seen), g.fingerprint[:70])
    console.print(t)
    total = getattr(groups, "total_groups", len(groups))
    if total > len(groups):
        console.print(f"the {len(groups)} biggest of {total} groups ({getattr(groups, 'dead', 0)} jobs in all):"
                      " --type narrows them", markup=False)  # fmt: skip


def audit(rows: list[AuditEntry], as_json: bool) -> None:
    if as_json:
        _json(rows)
        return
    t = Table("at", "user", "ssh client", "action", "target", "reason", box=None, pad_edge=False)
    for a in rows:
        _row(t, ts(a.at), a.os_user, a.ssh_client or "-", a.action, _audit_target(a), a.reason or "-")
    console.print(t)


def _audit_target(a: AuditEntry) -> str:
    """What an action was on: a limit's type, scope and number (they are in its detail), an embedded worker and
    what it ran (there is no detail column), a queue, the jobs."""
    detail = a.detail or {}
    if is_worker_entry(a):
        return f"{worker_target(a)}: {worker_detail(a)}"
    if a.action in ("limit", "unlimit") and detail.get("job_type"):
        scope = f"{detail['job_type']}@{detail.get('queue', '*')}"
        return f"{scope}={detail['max_running']}" if "max_running" in detail else scope
    target = a.queue or (f"{len(a.job_ids)} job(s)" if a.job_ids else "-")
    groups = audit_groups(a)
    return f"{target} of {groups}" if groups else target


def audit_groups(a: AuditEntry) -> str:
    """The dead-letter groups a console action was asked for (ops.GROUPS_KEY), each as ``email.send
    (dead_lettered, 43): TransientError: upstream <n>``: its type, state, jobs asked for and error fingerprint;
    "" for an action on jobs named one by one."""
    groups = (a.detail or {}).get(GROUPS_KEY)
    if not isinstance(groups, list) or not groups:
        return ""
    said = [
        f"{g.get('job_type')} ({g.get('state')}, {g.get('jobs')}): {g.get('fingerprint')}"
        for g in groups
        if isinstance(g, dict)
    ]
    return "; ".join(said) if len(said) == 1 else f"{len(said)} groups: " + "; ".join(said)


def is_worker_entry(a: AuditEntry) -> bool:
    """An embedded worker the console started or stopped (ops.audit_worker)."""
    return a.action in WORKER_ACTIONS and "number" in (a.detail or {})


def worker_target(a: AuditEntry) -> str:
    """``emb#3 pid 4121``: the worker as the console's workers screen names it, and its process."""
    detail = a.detail or {}
    pid = detail.get("pid")
    return f"emb#{detail.get('number')} pid {pid if pid is not None else '-'}"


def worker_detail(a: AuditEntry) -> str:
    """``queues=billing,mail concurrency=4 tasks=myapp.tasks host=web-1`` (``queues=*``: every queue, as the
    workers screen says), after ``restart cancelled`` for a stop that cancelled a crashed worker's restart."""
    detail = a.detail or {}
    parts = ["restart cancelled"] if detail.get("restart_cancelled") else []
    parts.append(f"queues={','.join(map(str, detail.get('queues') or [])) or '*'}")
    parts.append(f"concurrency={detail.get('concurrency', '-')}")
    parts.append(f"tasks={','.join(map(str, detail.get('tasks') or [])) or '-'}")
    if detail.get("host"):
        parts.append(f"host={detail['host']}")
    return " ".join(parts)


def action(result: ActionResult, queue: str | None = None) -> None:
    if result.action in ("pause", "resume"):
        console.print(f"{result.action}d queue {queue} (audit #{result.audit_id})")
        return
    console.print(_changed_line(result.action, result.count, result.requested, result.audit_id))
    for jid in result.skipped:
        why = result.why_skipped.get(jid, f"not in a state that allows {result.action}")
        console.print(Text(f"  skipped {jid}: {why}"))


def _changed_line(action: str, changed: int, requested: int, audit_id: int | None) -> str:
    return f"{action}: {changed} of {requested} job(s) changed (audit #{audit_id})"


def action_counted(action: str, changed: int, requested: int, audit_id: int, missing: Sequence[uuid.UUID]) -> None:
    """An action done whose answer was lost, as ``action`` says it, from its audit entry: how many jobs it changed
    (not which), and the jobs named that do not exist."""
    console.print(_changed_line(action, changed, requested, audit_id))
    for jid in missing:
        console.print(Text(f"  skipped {jid}: no such job"))


def policies(contracts: list[TypeContract], as_json: bool, source: str, queues: dict[str, Any]) -> None:
    """Each job type's effective contract; ``source`` names where the deployment defaults came from."""
    if as_json:
        _json(
            {
                "source": source,
                "queues": queues,
                "types": [
                    {
                        "job_type": c.job_type,
                        "queue": c.queue,
                        "reason": c.reason,
                        "requires_idempotency_key": c.requires_idempotency_key,
                        "concurrency": c.concurrency,
                        "reported_by": c.reported_by,
                        "reported_at": c.reported_at,
                        "fields": {k: {"value": v, "source": s} for k, (v, s) in c.fields.items()},
                    }
                    for c in contracts
                ],
            }
        )
        return
    console.print(Text(printable(f"policy: {source}")))
    for q, layer in queues.items():
        console.print(Text(printable(f"  queue {q}: {layer}")))
    t = Table("type", "queue", "attempts", "timeout", "visibility", "backoff", "base", "max delay", "jitter",
              "limit", "reason", box=None, pad_edge=False)  # fmt: skip
    for c in contracts:

        def cell(name: str, fields: dict[str, tuple[Any, str]] = c.fields) -> str:
            value, where = fields.get(name, ("-", "?"))
            return f"{value:g} ({where})" if isinstance(value, float) else f"{value} ({where})"

        _row(t, c.job_type, c.queue, cell("max_attempts"), cell("timeout_seconds"),
             cell("visibility_timeout_seconds"), cell("backoff"), cell("base_seconds"),
             cell("max_delay_seconds"), cell("jitter"), str(c.concurrency or "-"), c.reason or "-")  # fmt: skip
    console.print(t)
    if not contracts:
        console.print("no job type known: start a worker, or give --tasks MODULE")
