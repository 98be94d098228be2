"""Producing jobs: ``enqueue`` and ``enqueue_many`` run inside the caller's transaction, so a job exists
if and only if the business write that made it commits (transactional enqueue)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Iterable, Mapping
from typing import Any

from psycopg.pq import TransactionStatus

from worker_core import policy
from worker_core.clock import SYSTEM_CLOCK, Clock
from worker_core.db import Conn
from worker_core.envelope import DEFAULT_QUEUE, Envelope, build_envelope
from worker_core.models import EnqueueResult
from worker_core.registry import Registry
from worker_core.registry import registry as default_registry
from worker_core.sql import queries


def prepare(job_type: Any, payload: Any, envelope: Mapping[str, Any], registry: Registry | None = None) -> Envelope:
    """Validate one message with the defaults of its type: the local registry's @task if the producer
    imported it, else the deployment's policy for the queue (worker_core.policy)."""
    task = (registry or default_registry).get(job_type) if isinstance(job_type, str) else None
    if task is not None:
        defaults = task.defaults()
    else:
        queue = envelope.get("queue", DEFAULT_QUEUE)
        defaults = policy.current().type_defaults(queue if isinstance(queue, str) else DEFAULT_QUEUE)
    return build_envelope(job_type, payload, envelope, defaults)


def _in_callers_transaction(conn: Conn) -> contextlib.AbstractContextManager[Any]:
    """A transaction of its own on an autocommit connection, a savepoint inside the caller's open one.

    On a non-autocommit connection with no transaction open yet, psycopg's ``transaction()`` would BEGIN
    and COMMIT by itself, so an enqueue made before the business write would commit without it: there,
    the first statement opens the caller's transaction and the caller commits or rolls back.
    """
    if conn.autocommit or conn.info.transaction_status != TransactionStatus.IDLE:
        return conn.transaction()
    return contextlib.nullcontext()


def _count_dedup_hits(conn: Conn, now: dt.datetime, hits: Mapping[tuple[str, str], int]) -> None:
    rows = [{"queue": q, "job_type": t, "n": n} for (q, t), n in sorted(hits.items()) if n]
    if rows:
        conn.execute(queries["count_dedup_hits"], {"now": now, "rows": json.dumps(rows)})


def _params(env: Envelope, now: dt.datetime) -> dict[str, Any]:
    scheduled = env.scheduled_at or now + dt.timedelta(seconds=env.delay_seconds)
    return {
        "job_type": env.job_type,
        "queue": env.queue,
        "payload": env.payload_json,
        "priority": env.priority,
        "max_attempts": env.max_attempts,
        "scheduled_at": scheduled,
        "idempotency_key": env.idempotency_key,
        "dedup_key": env.dedup_key,
        "lock_key": env.lock_key,
        "timeout_seconds": env.timeout_seconds,
        "visibility_timeout_seconds": env.visibility_timeout_seconds,
        "retry_policy": json.dumps(env.retry_policy.to_json()),
        "tenant_id": env.tenant_id,
        "trace_id": env.trace_id,
    }


def enqueue(
    conn: Conn,
    job_type: str,
    payload: Mapping[str, Any] | None = None,
    *,
    clock: Clock = SYSTEM_CLOCK,
    registry: Registry | None = None,
    **envelope: Any,
) -> EnqueueResult:
    """Insert one job in the caller's transaction.

    Returns the new job's id, or ``created=False`` with the id of the live job that already holds the
    same ``dedup_key``. Raises EnvelopeError (nothing written) when the envelope breaks the contract.
    """
    env = prepare(job_type, {} if payload is None else payload, envelope, registry)
    now = clock.now()
    params = {**_params(env, now), "now": now}
    with _in_callers_transaction(conn):
        for _ in range(5):
            row = conn.execute(queries["insert_job"], params).fetchone()
            if row:
                return EnqueueResult(row["id"], True)
            found = conn.execute(queries["live_by_dedup_keys"], {"keys": [env.dedup_key]}).fetchone()
            if found:
                _count_dedup_hits(conn, now, {(env.queue, env.job_type): 1})
                return EnqueueResult(found["id"], False)
            # the holder finished between our insert and our look-up: try again
    raise RuntimeError(f"could not enqueue {job_type}: dedup key {env.dedup_key!r} kept changing hands")


def enqueue_many(
    conn: Conn,
    jobs: Iterable[tuple[str, Mapping[str, Any]] | tuple[str, Mapping[str, Any], Mapping[str, Any]]],
    *,
    clock: Clock = SYSTEM_CLOCK,
    registry: Registry | None = None,
) -> list[EnqueueResult]:
    """Insert many jobs in one statement, in the caller's transaction.

    ``jobs`` yields ``(job_type, payload)`` or ``(job_type, payload, envelope_fields)``. Every envelope is
    validated before anything is written; results come back in input order. A job whose dedup key is
    held by a live job (or by an earlier job of the same batch) is reported with that job's id.
    """
    envs: list[Envelope] = []
    problems: list[str] = []
    for i, item in enumerate(jobs):
        job_type, payload = item[0], item[1]
        fields: Mapping[str, Any] = item[2] if len(item) > 2 else {}
        try:
            envs.append(prepare(job_type, payload, fields, registry))
        except ValueError as e:
            problems.append(f"job {i}: {e}")
    if problems:
        from worker_core.errors import EnvelopeError

        raise EnvelopeError(problems)
    if not envs:
        return []
    now = clock.now()
    rows = [_params(env, now) for env in envs]
    columns = {name: [r[name] for r in rows] for name in rows[0]}
    with _in_callers_transaction(conn):
        inserted = conn.execute(queries["insert_jobs_many"], {**columns, "now": now}).fetchall()
        by_key = {r["dedup_key"]: r["id"] for r in inserted if r["dedup_key"] is not None}
        missing = [e.dedup_key for e in envs if e.dedup_key is not None and e.dedup_key not in by_key]
        if missing:
            for r in conn.execute(queries["live_by_dedup_keys"], {"keys": missing}):
                by_key.setdefault(r["dedup_key"], r["id"])
    # rows without a dedup key come back in insertion order (one statement, one unnest)
    plain = iter([r["id"] for r in inserted if r["dedup_key"] is None])
    out: list[EnqueueResult] = []
    seen: set[str] = set()
    inserted_keys = {r["dedup_key"] for r in inserted if r["dedup_key"] is not None}
    for env in envs:
        if env.dedup_key is None:
            out.append(EnqueueResult(next(plain), True))
        else:
            first = env.dedup_key in inserted_keys and env.dedup_key not in seen
            seen.add(env.dedup_key)
            out.append(EnqueueResult(by_key[env.dedup_key], first))
    hits: dict[tuple[str, str], int] = {}
    for env, result in zip(envs, out, strict=True):
        if not result.created:
            hits[(env.queue, env.job_type)] = hits.get((env.queue, env.job_type), 0) + 1
    if hits:
        with _in_callers_transaction(conn):
            _count_dedup_hits(conn, now, hits)
    return out
