"""Operator actions: requeue, kill, pause and resume. Each one checks the connection may write, changes
only rows in a legal source state, and writes its audit row in the same transaction. The console's starts and
stops of its embedded workers are audited here too (audit_worker), though they change no row."""

from __future__ import annotations

import getpass
import json
import os
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from worker_core import db
from worker_core.clock import SYSTEM_CLOCK, Clock, now_on
from worker_core.db import Conn
from worker_core.envelope import DEFAULT_QUEUE, JOB_TYPE_RE, MAX_MAX_ATTEMPTS, QUEUE_RE, check_payload
from worker_core.errors import ChangedMeanwhile, EnvelopeError, NotFound, ReadOnlyError, TableLocked
from worker_core.metrics import MetricsBuffer
from worker_core.migrate import (
    LockHolder,
    Migration,
    MigrationFailed,
    OnWait,
    applied_versions,
    load_migrations,
    migrate,
)
from worker_core.models import ESCAPE_SEQUENCES, REQUEUEABLE_STATES, ActionResult, JobState
from worker_core.producer import NotMigrated
from worker_core.sql import queries

DEFAULT_REQUEUE_BUDGET = 1


@dataclass(frozen=True)
class Actor:
    """Who did it: the OS user and, over SSH, the client's address."""

    os_user: str
    ssh_client: str | None = None

    @classmethod
    def current(cls) -> Actor:
        try:
            user = getpass.getuser()
        except Exception:
            user = str(os.getuid()) if hasattr(os, "getuid") else "unknown"
        sudo = os.environ.get("SUDO_USER")
        if sudo and sudo != user:
            user = f"{sudo} (as {user})"  # who typed it, not only the service account sudo switched to
        ssh = os.environ.get("SSH_CLIENT") or os.environ.get("SSH_CONNECTION")
        return cls(os_user=user, ssh_client=ssh.split()[0] if ssh else None)

    def __str__(self) -> str:
        return f"{self.os_user}@{self.ssh_client}" if self.ssh_client else self.os_user


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def payload_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What an operator changed in a payload, by dotted path: ``{"customer.email": {"old": .., "new": ..}}``.
    A path only on one side has ``old`` or ``new`` missing."""
    a, b = _flatten(old), _flatten(new)
    diff: dict[str, dict[str, Any]] = {}
    for path in sorted(set(a) | set(b)):
        if path in a and path in b and same_json(a[path], b[path]):
            continue
        entry = {}
        if path in a:
            entry["old"] = a[path]
        if path in b:
            entry["new"] = b[path]
        diff[path] = entry
    return diff


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON: ``1``, ``1.0`` and ``true`` differ (Python's ``==`` has them equal, and a fix of a flag
    stored as 1 to ``true`` read as no change)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def ensure_writable(conn: Conn) -> None:
    """Refuse (ReadOnlyError, nothing written) on a read-only session. The console's and the CLI's own
    --read-only refuse before they get here: this one is the server's or the session's doing (a replica,
    default_transaction_read_only), and blaming a flag nobody gave sent the operator looking for it."""
    row = conn.execute(queries["is_read_only"]).fetchone()
    if row and row["ro"]:
        raise ReadOnlyError(f"operator actions are refused, nothing changed: {read_only_reason(conn)}")


def read_only_reason(conn: Conn) -> str:
    """Why a session is read-only: the server is a replica, or the session was made so."""
    row = conn.execute("SELECT pg_is_in_recovery() AS recovery").fetchone()
    if row and row["recovery"]:
        return "the server is read-only (a replica, in recovery): run it against the primary"
    return (
        "this session is read-only (default_transaction_read_only is on for this role, database or DSN, or the"
        " server is a replica): run it against the primary, as a role that may write"
    )


#: a console action's session holds the advisory lock (this class, its token's key: the two-key form, which no
#: other lock of the queue's uses) until it ends: while it lives, its transaction may still commit
ACTION_LOCK_CLASS = 0x71634143
#: the newest audit entries searched for a lost action's token
TOKEN_LOOKUP_ROWS = 10_000


def hold_action_token(conn: Conn, key: int) -> None:
    """Hold the action's token (its advisory lock) for as long as the session lives."""
    conn.execute(queries["action_token_hold"], {"class": ACTION_LOCK_CLASS, "key": key})


def action_session_ended(conn: Conn, key: int) -> bool:
    """Whether the session that held the token ended (its lock is free: taken now, by this session): nothing
    of its transaction can commit any more."""
    row = conn.execute(queries["action_token_free"], {"class": ACTION_LOCK_CLASS, "key": key}).fetchone()
    return bool(row and row["ended"])


def audit_entry_of_token(conn: Conn, token: str) -> tuple[int, int] | None:
    """The audit entry (its id, and how many jobs it names) of the action that carried ``token``, among the
    newest TOKEN_LOOKUP_ROWS: None, it did not commit."""
    params = {"rows": TOKEN_LOOKUP_ROWS, "key": TOKEN_KEY, "token": token}
    row = conn.execute(queries["audit_by_token"], params).fetchone()
    return None if row is None else (int(row["id"]), int(row["changed"]))


#: what a worker writes (claims, settles, heartbeats): a role without one of these on them cannot work
WORKER_WRITES = tuple((t, p) for t in ("job_queue", "workers") for p in ("SELECT", "INSERT", "UPDATE", "DELETE"))
#: which of WORKER_WRITES this role lacks, in one round trip (a worker checks it at every start)
_LACKING = (
    "SELECT t AS relation, p AS privilege FROM unnest(%(tables)s::text[], %(privileges)s::text[]) WITH ORDINALITY"
    " AS w(t, p, n) WHERE NOT has_table_privilege(t, p) ORDER BY n"
)


def worker_refusal(conn: Conn) -> str | None:
    """Why a worker could not claim or settle a job on this connection's server as this role, or None."""
    row = conn.execute(queries["is_read_only"]).fetchone()
    if row and row["ro"]:
        return read_only_reason(conn)
    params = {"tables": [t for t, _ in WORKER_WRITES], "privileges": [p for _, p in WORKER_WRITES]}
    missing = [f"{r['privilege']} on {r['relation']}" for r in conn.execute(_LACKING, params).fetchall()]
    if missing:
        return (
            f"this role may not write the queue's tables (it lacks {', '.join(missing)}): grant them, or run the"
            " worker as a role that has them"
        )
    return None


@dataclass(frozen=True)
class SchemaState:
    """What :func:`check_schema` found that refuses nothing: migrations applied that differ from this
    version's (``changed``: only when not refused) and those applied by a newer version (``newer``)."""

    changed: tuple[Migration, ...] = ()
    newer: tuple[int, ...] = ()


def check_schema(
    conn: Conn, *, migrate_dsn: str | None = None, on_wait: OnWait | None = None, refuse_changed: bool = True
) -> SchemaState:
    """The start check of every worker and command (``Worker.run()``, a supervisor, ``qconsole worker`` and
    the CLI before a command): the database is migrated, by this version. NotMigrated when it is not, its
    ``pending`` (and ``changed``) saying what was found: migrations pending (``migrate_dsn``: the embedded
    server's, applied here first, through a connection of their own, ``on_wait`` told of lock waits; failed,
    in its ``failed``), or applied ones that differ from this version's (``refuse_changed``: a worker's; an
    operator's command is only warned of them: in the result). psycopg's InsufficientPrivilege for a role that
    may not read worker_core_migrations."""
    migrations = load_migrations()
    done = applied_versions(conn)
    if migrate_dsn is not None and any(m.version not in done for m in migrations):
        try:
            with db.connect(migrate_dsn, application_name="qconsole-migrate") as mconn:
                migrate(mconn, on_wait=on_wait)
        except MigrationFailed as e:
            failed = NotMigrated(f"the embedded server's migrations failed: {e}")
            failed.failed = e
            raise failed from e
        done = applied_versions(conn)
    pending = tuple(m for m in migrations if m.version not in done)
    changed = tuple(m for m in migrations if m.version in done and not m.matches(done[m.version]))
    if pending or (changed and refuse_changed):
        if pending:
            message = (
                f"the database needs migrations ({', '.join(m.label for m in pending)}): run `qconsole migrate`"
                " (as the schema's owner), or check that the DSN names the queue's database"
            )
        else:
            message = (
                f"migrations {', '.join(m.label for m in changed)} differ from what this database applied: this"
                " worker_core is not the version that migrated it, and its workers refuse to start"
            )
        refused = NotMigrated(message)
        refused.pending, refused.changed = pending, changed
        raise refused
    known = {m.version for m in migrations}
    return SchemaState(changed, tuple(sorted(v for v in done if v not in known)))


#: how long an operator action waits for a lock on a table it writes besides job_queue (audit_log, queues,
#: concurrency_limits), then gives up, nothing of it done (TableLocked, naming who holds the lock). Behind an
#: operator's long transaction holding one (a LOCK TABLE, an UPDATE left uncommitted in psql), a pause, a limit,
#: the console's start or stop of a worker (its audit entry) waited up to the statement timeout (10 minutes),
#: the console's action frozen meanwhile
ACTION_LOCK_WAIT_S = 5.0

#: what an action reads besides the tables it writes (pause and limit look for the queue or type named): only
#: an ACCESS EXCLUSIVE lock on them holds it up
_ACTION_READS = ("job_queue", "job_type_contracts", "workers")


@contextmanager
def lock_wait_bounded(
    conn: Conn, what: str, writes: Sequence[str], reads: Sequence[str] = (), seconds: float = ACTION_LOCK_WAIT_S
) -> Iterator[None]:
    """Inside the caller's transaction: its statements within wait ``seconds`` at most for a lock (a savepoint
    around them); one that waits longer raises TableLocked, saying ``what`` was not done and naming the
    sessions holding locks on the tables it ``writes`` (any lock but a reader's) or ``reads`` (an ACCESS
    EXCLUSIVE one). The caller's transaction then rolls back with it: nothing of the action is written. The
    lock timeout the transaction had is put back after."""
    row = conn.execute(queries["lock_wait_bound"], {"wait": f"{round(seconds * 1000)}ms"}).fetchone()
    assert row is not None
    try:
        with conn.transaction():
            yield
    except psycopg.errors.LockNotAvailable as e:
        holders = lock_holders(conn, writes, reads)
        raise TableLocked(what, [*writes, *reads], seconds, [str(h) for h in holders]) from e
    conn.execute(queries["lock_wait_restore"], {"before": row["before"]})


def lock_holders(conn: Conn, writes: Sequence[str], reads: Sequence[str] = ()) -> list[LockHolder]:
    """The sessions whose locks a writer of ``writes`` and reader of ``reads`` may wait for, the oldest
    transaction first (queries.sql ``table_lock_holders``)."""
    rows = conn.execute(queries["table_lock_holders"], {"writes": list(writes), "reads": list(reads)}).fetchall()
    return [LockHolder(r["pid"], r["state"], r["seconds"], r["query"]) for r in rows]


def _ids(job_ids: Iterable[uuid.UUID | str]) -> list[uuid.UUID]:
    out = []
    for j in job_ids:
        try:
            out.append(j if isinstance(j, uuid.UUID) else uuid.UUID(str(j)))
        except ValueError:
            raise ValueError(f"{j!r} is not a job id") from None
    return list(dict.fromkeys(out))


#: runs of control characters (C0, DEL, C1: a newline, a tab, an escape sequence's ESC) in an operator's reason
_CONTROL_RUN = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def reason_text(reason: str | None) -> str | None:
    """An operator's reason as it is stored (audit_log, concurrency_limits, a killed job's error): one line,
    escape sequences removed, each run of other control characters one space, trimmed; None when nothing is
    left. Every display stripped them, but ``--json``, the audit table read with psql, and log lines carried a
    pasted newline or an escape sequence as typed."""
    if reason is None:
        return None
    return _CONTROL_RUN.sub(" ", ESCAPE_SEQUENCES.sub("", reason)).strip() or None


def _audit(
    conn: Conn,
    now: Any,
    actor: Actor,
    action: str,
    *,
    job_ids: list[uuid.UUID] | None = None,
    queue: str | None = None,
    reason: str | None = None,
    detail: Mapping[str, Any] | None = None,
    what: str | None = None,
) -> int:
    """The action's audit entry, in its transaction; a lock on audit_log waited for ACTION_LOCK_WAIT_S at most
    (TableLocked: ``what``, the action, was not done)."""
    with lock_wait_bounded(conn, what or f"the {action}", ("audit_log",)):
        row = conn.execute(
            queries["audit_insert"],
            {
                "now": now,
                "os_user": actor.os_user,
                "ssh_client": actor.ssh_client,
                "action": action,
                "queue": queue,
                "job_ids": job_ids or [],
                "reason": reason,
                "detail": json.dumps(dict(detail or {}), default=str),
            },
        ).fetchone()
    assert row is not None
    return int(row["id"])


#: a requeue that meets a dedup key taken meanwhile runs again (ops.requeue), at most this many times in all
REQUEUE_TRIES = 5

#: the audit detail's key of a caller's token (``token=`` of requeue, kill, set_paused): the console looks its
#: action's row up by it when the connection died before the commit's answer came (committed or not?)
TOKEN_KEY = "console_token"


def _with_token(detail: dict[str, Any], token: str | None) -> dict[str, Any]:
    if token is not None:
        detail[TOKEN_KEY] = token
    return detail


#: the audit detail's key of the dead-letter groups an action was asked for (the console's r, K, X on groups):
#: each one's job type, error fingerprint, state and how many of its jobs were asked for
GROUPS_KEY = "groups"
#: the fields of a group kept in the audit detail
GROUP_FIELDS = ("job_type", "fingerprint", "state", "jobs")


def _with_groups(detail: dict[str, Any], groups: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """``detail`` with the groups the action was asked for: "requeue 43 job(s) budget=1" did not say which
    group was replayed, and the handover could tell only by looking up every id."""
    if groups:
        detail[GROUPS_KEY] = [{k: g.get(k) for k in GROUP_FIELDS} for g in groups]
    return detail


def requeue(
    conn: Conn,
    job_ids: Iterable[uuid.UUID | str],
    *,
    actor: Actor | None = None,
    reason: str | None = None,
    budget: int = DEFAULT_REQUEUE_BUDGET,
    payload: Mapping[str, Any] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    same_payload: bool = False,
    token: str | None = None,
    groups: Sequence[Mapping[str, Any]] | None = None,
    if_payload: Mapping[str, Any] | None = None,
) -> ActionResult:
    """dead_lettered | failed | cancelled -> queued, with ``budget`` fresh attempts and the history kept.
    ``payload`` replaces the payload (a fix), recorded in the audit entry; for more than one job only with
    ``same_payload``: each would get this one, and lose its own. ``token`` (the caller's) goes into the audit
    entry's detail (TOKEN_KEY), as with kill and set_paused. ``groups``: the dead-letter groups the jobs were
    asked for as (job_type, fingerprint, state, jobs), recorded in the detail (GROUPS_KEY), as with kill and
    discard. ``if_payload``: only a job whose payload is still this one (the one a fix was made from: the
    console's editor), else it is skipped, saying so: two engineers' fixes, the second made from the payload
    the first had already corrected, replaced it unseen."""
    reason = reason_text(reason)
    ids = _ids(job_ids)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_MAX_ATTEMPTS:
        raise ValueError(f"budget must be an integer between 1 and {MAX_MAX_ATTEMPTS}")
    if payload is not None and len(ids) > 1 and not same_payload:
        # an id list with one fixed payload wrote it into every job: their own payloads were gone, but for
        # the audit entry's diff
        raise ValueError(
            f"a payload replaces the payload of each of the {len(ids)} jobs named with this same one, and their"
            " own are lost: requeue them one at a time (each with its own fix), or say that all of them get it"
            " (same_payload / --same-payload)"
        )
    if payload is not None:
        problems: list[str] = []
        check_payload(problems, payload)
        if problems:
            raise EnvelopeError(problems)
    actor = actor or Actor.current()
    now = now_on(conn, clock)
    params = {
        "ids": ids,
        "now": now,
        "budget": budget,
        "payload": json.dumps(dict(payload)) if payload is not None else None,
        "if_payload": json.dumps(dict(if_payload)) if if_payload is not None else None,
    }
    with conn.transaction():
        ensure_writable(conn)
        for tries_left in reversed(range(REQUEUE_TRIES)):
            try:
                with conn.transaction():
                    rows = conn.execute(queries["requeue_jobs"], params).fetchall()
                break
            except psycopg.errors.UniqueViolation:
                # a job taking one of these dedup keys was not committed yet when the statement looked (its
                # check cannot see it): once it has, the statement, run again, sees it and skips that job
                if not tries_left:
                    raise
        changed = [r["id"] for r in rows]
        detail: dict[str, Any] = _with_groups(_with_token({"budget": budget, "requested": len(ids)}, token), groups)
        if payload is not None:
            detail["payload"] = dict(payload)
            detail["payload_diff"] = {
                str(r["id"]): payload_diff(r["old_payload"], dict(payload))
                for r in rows
                if not same_json(r["old_payload"], dict(payload))
            }
        audit_id = _audit(conn, now, actor, "requeue", job_ids=changed, reason=reason, detail=detail)
        for q in sorted({r["queue"] for r in rows}):
            conn.execute(queries["notify_queue"], {"queue": q})
        result = _result(conn, "requeue", ids, changed, audit_id)
        if if_payload is not None and result.skipped:
            moved = conn.execute(
                queries["jobs_payload_changed"], {"ids": result.skipped, "payload": params["if_payload"]}
            )
            for r in moved:
                result.why_skipped[r["id"]] = "its payload changed since it was read (someone else's fix?)"
        return result


def _result(
    conn: Conn, action: str, ids: list[uuid.UUID], changed: list[uuid.UUID], audit_id: int
) -> ActionResult:
    """What an action on ``ids`` did: the jobs it changed, and why each other one was skipped (read in the
    action's transaction)."""
    done = set(changed)
    skipped = [i for i in ids if i not in done]
    return ActionResult(action, len(ids), changed, skipped, audit_id, _why_skipped(conn, action, skipped))


def _why_skipped(conn: Conn, action: str, skipped: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    """A skipped job's reason, said to the operator, not "changed meanwhile" (they would think someone else
    acted): no such job; for a requeue, a dead job whose dedup key a live job holds (a later run of the same
    periodic job, say); for a kill, a job already being killed (its worker stops it within a heartbeat), or
    a dead letter (a discard is what ends one); else the state it is in."""
    if not skipped:
        return {}
    rows = {r["id"]: r for r in conn.execute(queries["jobs_state_and_dedup"], {"ids": skipped})}
    out = {}
    for jid in skipped:
        row = rows.get(jid)
        if row is None:
            out[jid] = "no such job"
        elif action == "requeue" and JobState(row["state"]) in REQUEUEABLE_STATES and row["dedup_key"] is not None:
            out[jid] = "a live job (or a newer requeued one) holds its dedup key"
        elif action == "kill" and row["state"] == "running" and row["cancel_requested"]:
            out[jid] = "it is being killed already"
        elif action == "kill" and row["state"] in ("dead_lettered", "failed"):
            out[jid] = f"it is {row['state']}: discard it (it ends cancelled) or requeue it"
        else:
            out[jid] = f"it is {row['state']}"
    return out


def kill(
    conn: Conn,
    job_ids: Iterable[uuid.UUID | str],
    *,
    actor: Actor | None = None,
    reason: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
    token: str | None = None,
    groups: Sequence[Mapping[str, Any]] | None = None,
) -> ActionResult:
    """Waiting jobs -> cancelled now; running jobs are flagged and cancelled by their worker within one
    heartbeat (or by the next claim, if their worker is gone). Never retried."""
    reason = reason_text(reason)
    ids = _ids(job_ids)
    actor = actor or Actor.current()
    now = now_on(conn, clock)
    message = f"killed by {actor}" + (f": {reason}" if reason else "")
    with conn.transaction():
        ensure_writable(conn)
        rows = conn.execute(queries["kill_jobs"], {"ids": ids, "now": now, "message": message}).fetchall()
        waiting = [r["id"] for r in rows if r["cancelled"]]
        running = [r["id"] for r in rows if not r["cancelled"]]
        if waiting:
            # counted here, with the kill: no worker settles them (the running ones are counted by theirs)
            counts = MetricsBuffer(clock)
            for r in rows:
                if r["cancelled"]:
                    counts.add(r["queue"], r["job_type"], "cancelled")
            counts.flush(conn)
        changed = waiting + running
        audit_id = _audit(
            conn, now, actor, "kill", job_ids=changed, reason=reason,
            detail=_with_groups(_with_token(
                {"cancelled": len(waiting), "signalled_running": len(running), "requested": len(ids)}, token
            ), groups),
        )  # fmt: skip
        return _result(conn, "kill", ids, changed, audit_id)


def discard(
    conn: Conn,
    job_ids: Iterable[uuid.UUID | str],
    *,
    actor: Actor | None = None,
    reason: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
    token: str | None = None,
    groups: Sequence[Mapping[str, Any]] | None = None,
) -> ActionResult:
    """dead_lettered | failed -> cancelled: dead letters an operator gives up on (a payload that can never
    succeed) leave the dead-letter screen and counts, never to run again; a requeue brings one back. Their
    error history keeps what they died of, and the discard (``Discarded``, who, why)."""
    reason = reason_text(reason)
    ids = _ids(job_ids)
    actor = actor or Actor.current()
    now = now_on(conn, clock)
    message = f"discarded by {actor}" + (f": {reason}" if reason else "")
    with conn.transaction():
        ensure_writable(conn)
        rows = conn.execute(queries["discard_jobs"], {"ids": ids, "now": now, "message": message}).fetchall()
        changed = [r["id"] for r in rows]
        audit_id = _audit(
            conn, now, actor, "discard", job_ids=changed, reason=reason,
            detail=_with_groups(_with_token({"requested": len(ids)}, token), groups),
        )  # fmt: skip
        return _result(conn, "discard", ids, changed, audit_id)


def group_job_ids(conn: Conn, job_type: str, fingerprint: str, state: str = "dead_lettered") -> list[uuid.UUID]:
    """The jobs of a dead-letter group, as dead_letter_groups names it (``(no error recorded)``: none)."""
    stored = None if fingerprint == NO_ERROR_RECORDED else fingerprint
    rows = conn.execute(queries["group_ids"], {"job_type": job_type, "fingerprint": stored, "state": state})
    return [r["id"] for r in rows]


#: the fingerprint dead_letter_groups shows for jobs with none (a lease expiry before any error, say)
NO_ERROR_RECORDED = "(no error recorded)"


def set_paused(
    conn: Conn,
    queue: str,
    paused: bool,
    *,
    actor: Actor | None = None,
    reason: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
    allow_unknown: bool = False,
    token: str | None = None,
) -> ActionResult:
    """Pause or resume a queue. A queue (but ``default``) no job, worker, type or earlier pause names is refused unless
    ``allow_unknown``: "resume biling" reported success, nothing audited as wrong, while billing stayed
    paused through the incident."""
    reason = reason_text(reason)
    if not QUEUE_RE.match(queue):
        raise ValueError(f"{queue!r} is not a queue name")
    actor = actor or Actor.current()
    now = now_on(conn, clock)
    what = f"the {'pause' if paused else 'resume'} of queue {queue!r}"
    with conn.transaction(), lock_wait_bounded(conn, what, ("queues", "audit_log"), _ACTION_READS):
        ensure_writable(conn)
        found = conn.execute(queries["queue_known"], {"queue": queue}).fetchone()
        if not allow_unknown and queue != DEFAULT_QUEUE and found is not None and not found["known"]:
            now_paused = ", ".join(found["paused"]) or "none"
            raise ValueError(
                f"no job, worker or earlier pause names queue {queue!r}: check its spelling (paused now:"
                f" {now_paused}; a queue still to come: allow_unknown / --unknown-queue)"
            )
        conn.execute(queries["queue_set_paused"], {"name": queue, "paused": paused, "now": now, "actor": str(actor)})
        audit_id = _audit(
            conn, now, actor, "pause" if paused else "resume", queue=queue, reason=reason,
            detail=_with_token({}, token),
        )  # fmt: skip
        conn.execute(queries["notify_control"], {"what": "queues"})
        if not paused:
            conn.execute(queries["notify_queue"], {"queue": queue})
    return ActionResult("pause" if paused else "resume", 1, [], [], audit_id)


#: what the console audits of the embedded workers it runs (its workers screen: s starts one, x stops one)
WORKER_ACTIONS = ("worker_start", "worker_stop")


def audit_worker(
    conn: Conn,
    action: str,
    *,
    number: int,
    pid: int | None,
    queues: Sequence[str],
    concurrency: int,
    tasks: Sequence[str],
    host: str | None = None,
    restart_cancelled: bool = False,
    actor: Actor | None = None,
    reason: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
    token: str | None = None,
) -> ActionResult:
    """Record that an operator started (``worker_start``) or stopped (``worker_stop``) an embedded worker: the
    console's number of it, its process (``host``, ``pid``), its queues (none: every queue), its slots and task
    modules; ``restart_cancelled``: a stop of a worker that had crashed and was to be started again. Nothing
    else is written: the console starts or stops the worker itself, before this, and a write that fails stops
    neither. The queue column names the worker's queue when it has only one (read beside a pause of that
    queue); its queues are all in the detail. ``token`` as with requeue."""
    reason = reason_text(reason)
    if action not in WORKER_ACTIONS:
        raise ValueError(f"{action!r} is not a worker action: worker_start or worker_stop")
    actor = actor or Actor.current()
    now = now_on(conn, clock)
    detail: dict[str, Any] = {
        "number": number, "pid": pid, "host": host, "queues": list(queues), "concurrency": concurrency,
        "tasks": list(tasks),
    }  # fmt: skip
    if restart_cancelled:
        detail["restart_cancelled"] = True
    with conn.transaction():
        ensure_writable(conn)
        audit_id = _audit(
            conn, now, actor, action, queue=queues[0] if len(queues) == 1 else None, reason=reason,
            detail=_with_token(detail, token), what=f"the audit entry of embedded worker #{number}'s {action}",
        )  # fmt: skip
    return ActionResult(action, 1, [], [], audit_id)


def pause(conn: Conn, queue: str, **kwargs: Any) -> ActionResult:
    return set_paused(conn, queue, True, **kwargs)


def resume(conn: Conn, queue: str, **kwargs: Any) -> ActionResult:
    return set_paused(conn, queue, False, **kwargs)


#: the largest concurrency limit (the column is an integer)
MAX_LIMIT = 1_000_000


def set_limit(
    conn: Conn,
    job_type: str,
    max_running: int,
    *,
    queue: str = "*",
    actor: Actor | None = None,
    reason: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
    allow_unknown: bool = False,
    allow_unknown_queue: bool = False,
    token: str | None = None,
    check_current: bool = False,
    current: int | None = None,
) -> ActionResult:
    """At most ``max_running`` jobs of ``job_type`` (in ``queue``, or every queue) run at once, fleet-wide.
    0 holds them all. Workers pick the change up within a heartbeat; jobs over the limit simply wait. A type
    no worker registered and no job has is refused unless ``allow_unknown``; a queue (but ``default``) no job,
    worker, type or earlier pause names, unless ``allow_unknown_queue``, as pause refuses it. ``token`` as with
    requeue. ``check_current``: only if the limit there is still ``current`` (None: none), as read when the
    change was made (the console's form), else ChangedMeanwhile and nothing changes: a hold another operator
    set while the form was open was replaced unseen."""
    reason = reason_text(reason)
    if isinstance(max_running, bool) or not isinstance(max_running, int) or not 0 <= max_running <= MAX_LIMIT:
        raise ValueError(f"a concurrency limit must be an integer between 0 and {MAX_LIMIT}")
    if queue != "*" and not QUEUE_RE.match(queue):
        raise ValueError(f"{queue!r} is not a queue name")
    if not JOB_TYPE_RE.match(job_type):
        raise ValueError(f"{job_type!r} is not a job type name ([a-z0-9_.-]+)")
    actor = actor or Actor.current()
    now = now_on(conn, clock)
    what = f"the limit of {job_type!r}" + ("" if queue == "*" else f" in queue {queue!r}")
    with conn.transaction(), lock_wait_bounded(conn, what, ("concurrency_limits", "audit_log"), _ACTION_READS):
        ensure_writable(conn)
        known = conn.execute(queries["job_type_known"], {"job_type": job_type}).fetchone()
        if not allow_unknown and not (known and known["known"]):
            # a misspelt type would hold nothing, silently, in the middle of an incident
            raise ValueError(
                f"no worker runs job type {job_type!r} and no job of it exists: check its spelling"
                " (a limit for a type still to come: allow_unknown / --unknown-type)"
            )
        if queue not in ("*", DEFAULT_QUEUE) and not allow_unknown_queue:
            found = conn.execute(queries["queue_known"], {"queue": queue}).fetchone()
            if found is not None and not found["known"]:
                # "limit t 0 --queue biling" said "at most 0 running" and held nothing, while billing ran on
                raise ValueError(
                    f"no job, worker or earlier pause names queue {queue!r}: check its spelling"
                    " (a limit for a queue still to come: allow_unknown_queue / --unknown-queue)"
                )
        if check_current:
            _check_current_limit(conn, job_type, queue, current)
        conn.execute(
            queries["limit_set"],
            {"job_type": job_type, "queue": queue, "max_running": max_running, "source": "operator",
             "reason": reason, "now": now},
        )  # fmt: skip
        audit_id = _audit(
            conn, now, actor, "limit", queue=None if queue == "*" else queue, reason=reason,
            detail=_with_token({"job_type": job_type, "queue": queue, "max_running": max_running}, token),
        )  # fmt: skip
        conn.execute(queries["notify_control"], {"what": "limits"})
    return ActionResult("limit", 1, [], [], audit_id)


def _check_current_limit(conn: Conn, job_type: str, queue: str, current: int | None) -> None:
    """ChangedMeanwhile unless the limit of ``job_type`` in ``queue`` is ``current`` (None: none), locked."""
    row = conn.execute(queries["limit_current"], {"job_type": job_type, "queue": queue}).fetchone()
    now_max = None if row is None else row["max_running"]
    if now_max != current:
        scope = "every queue" if queue == "*" else f"queue {queue!r}"
        was = "no limit" if current is None else f"at most {current}"
        now = "no limit" if row is None else f"at most {now_max} ({row['source']}" + (
            f": {row['reason']})" if row["reason"] else ")"
        )
        raise ChangedMeanwhile(
            f"the limit of {job_type!r} in {scope} changed since it was read: {was} then, {now} now."
            " Nothing changed: read it again"
        )


def clear_limit(
    conn: Conn, job_type: str, *, queue: str = "*", actor: Actor | None = None, reason: str | None = None,
    clock: Clock = SYSTEM_CLOCK, token: str | None = None, check_current: bool = False,
    current: int | None = None,
) -> ActionResult:  # fmt: skip
    reason = reason_text(reason)
    actor = actor or Actor.current()
    now = now_on(conn, clock)
    what = f"the clearing of the limit of {job_type!r}" + ("" if queue == "*" else f" in queue {queue!r}")
    with conn.transaction(), lock_wait_bounded(conn, what, ("concurrency_limits", "audit_log")):
        ensure_writable(conn)
        if check_current:
            _check_current_limit(conn, job_type, queue, current)
        found = conn.execute(queries["limit_clear"], {"job_type": job_type, "queue": queue}).fetchone()
        if found is None:
            # a misspelt type or queue would clear nothing while the real hold stays, in an incident
            rows = conn.execute(queries["limits_list"]).fetchall()
            held = [f"{r['job_type']} in {r['queue']}" for r in rows if r["job_type"] == job_type]
            scope = "every queue ('*')" if queue == "*" else f"queue {queue!r}"
            raise NotFound(
                f"no limit on {job_type!r} in {scope}: "
                + (f"its limits are {', '.join(held)} (--queue)" if held else "the type has no limit")
            )
        if found["source"] == "task":
            # cleared, it came back with the next heartbeat of any worker running the type, while this said
            # it was lifted (the delete is rolled back with this error)
            n = found["max_running"]
            raise ValueError(
                f"the limit of {job_type!r} ({n}) is declared by its @task(concurrency={n}): every worker running "
                f"it declares it again. Set an operator limit instead (qconsole limit {job_type} N --reason ...), "
                "which workers leave alone, or remove it from the code"
            )
        audit_id = _audit(
            conn, now, actor, "unlimit", queue=None if queue == "*" else queue, reason=reason,
            detail=_with_token({"job_type": job_type, "queue": queue, "existed": found is not None}, token),
        )  # fmt: skip
        conn.execute(queries["notify_control"], {"what": "limits"})
    return ActionResult("unlimit", 1, [], [], audit_id)
