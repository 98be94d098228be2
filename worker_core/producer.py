"""Producing jobs: ``enqueue`` and ``enqueue_many`` (``aenqueue`` and ``aenqueue_many`` on a psycopg
AsyncConnection) run inside the caller's transaction, so a job exists if and only if the business write
that made it commits (transactional enqueue).

Each is written once, as the steps it takes: a generator that yields the statements it runs and is sent
their rows back (``_Steps``). A driver per kind of connection runs them (``_run``, ``_arun``), so the
validation, the contract's resolution, the dedup look-ups and their retries are one piece of code for both.

A job's defaults (attempts, timeouts, retry policy) are resolved, field by field, from: the deployment's
defaults < its queue's layer < its type's own overrides < the fields given at enqueue. The type's overrides
come from its ``@task`` when this process imports it, else from the contract its workers registered
(job_type_contracts). The deployment's defaults and queue layers come from this process's policy file when
it has one (worker_core.policy), else from the policy its workers registered (deployment_policy, migration
0016), else the built-in ones. Both registrations are read at most once a minute per database.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from typing_extensions import Unpack

from worker_core import policy
from worker_core.clock import SYSTEM_CLOCK, Clock, statement_now
from worker_core.db import AnyConn, Conn, dict_cursor
from worker_core.envelope import (
    DEFAULT_QUEUE,
    DEFAULT_VISIBILITY_MARGIN_SECONDS,
    JOB_TYPE_RE,
    Envelope,
    EnvelopeFields,
    TypeDefaults,
    build_envelope,
)
from worker_core.errors import EnvelopeError
from worker_core.models import EnqueueResult
from worker_core.registry import Registry
from worker_core.registry import registry as default_registry
from worker_core.retry import RetryPolicy
from worker_core.sql import queries

if TYPE_CHECKING:
    from worker_core.migrate import Migration, MigrationFailed

T = TypeVar("T")
#: a psycopg AsyncConnection of the application's, whatever its row factory
AnyAsyncConn = psycopg.AsyncConnection[Any]


class NotMigrated(psycopg.ProgrammingError):
    """The producer's statements name a table (or a column) the database does not have: it is not migrated
    for this version of worker_core. A psycopg error still, for callers that handle those. Raised too by the
    start checks (worker_core.ops.check_schema), which say what they found in its fields."""

    #: the migrations of this version the database has not applied
    pending: tuple[Migration, ...] = ()
    #: those it applied that differ from this version's (another version migrated it)
    changed: tuple[Migration, ...] = ()
    #: the embedded server's migrations, applied by the check, failed: how
    failed: MigrationFailed | None = None


# ------------------------------------------------------------------------------------------ the contract


@dataclass(frozen=True)
class Registered:
    """A type's contract as its workers registered it (job_type_contracts), for a producer without its @task."""

    #: the envelope's defaults in the type's own queue, as the workers resolved them
    own: TypeDefaults
    #: the fields the type sets itself (source ``type:...``), to resolve the type in another queue
    type_layer: policy.Layer | None

    def defaults(self, queue: str | None = None, deployment: policy.DeploymentPolicy | None = None) -> TypeDefaults:
        """In its own queue, as registered; in another, that queue's layer of ``deployment`` (this process's
        policy by default) under the type's own overrides."""
        if queue is None or queue == self.own.queue:
            return self.own
        deployment = deployment or policy.current()
        return deployment.type_defaults(queue, self.type_layer, self.own.requires_idempotency_key)


class RegisteredContracts(dict[str, Registered]):
    """The contracts the workers registered for the types a producer has no @task for, and the deployment's
    policy the producer resolves its jobs under (``deployment``): its own, else the workers' (see the
    module's docstring)."""

    def __init__(self, contracts: Mapping[str, Registered], deployment: policy.DeploymentPolicy) -> None:
        super().__init__(contracts)
        self.deployment = deployment


def prepare(
    job_type: Any,
    payload: Any,
    envelope: Mapping[str, Any],
    registry: Registry | None = None,
    registered: Mapping[str, Registered] | None = None,
) -> Envelope:
    """Validate one message with the defaults of its type: the local registry's @task if the producer
    imported it, else the contract the workers registered for the type (``registered``), else the
    deployment's policy for the queue. The deployment's layers are ``registered.deployment`` when
    ``registered`` comes from registered_defaults, else this process's policy (worker_core.policy).

    A job sent to another queue than its type's (``queue=...``) takes that queue's layer under the type's
    own overrides: the queue's layer sits between the deployment's defaults and the type's."""
    queue = envelope.get("queue")
    queue = queue if isinstance(queue, str) and queue else None  # a malformed one is refused below
    deployment = registered.deployment if isinstance(registered, RegisteredContracts) else policy.current()
    task = (registry or default_registry).get(job_type) if isinstance(job_type, str) else None
    if task is not None:
        defaults = deployment.type_defaults(queue or task.queue, task.layer(), task.requires_idempotency_key)
    elif registered and isinstance(job_type, str) and job_type in registered:
        defaults = registered[job_type].defaults(queue, deployment)
    else:
        defaults = deployment.type_defaults(queue or DEFAULT_QUEUE)
    return build_envelope(job_type, payload, envelope, defaults)


#: (database, job_type) -> (monotonic expiry, the registered contract or None): one look-up per type and minute
_registered_cache: dict[tuple[str, str], tuple[float, Registered | None]] = {}
#: database -> (monotonic expiry, the policy its workers registered or None), for a process without its own
_policy_cache: dict[str, tuple[float, policy.DeploymentPolicy | None]] = {}
REGISTERED_TTL_SECONDS = 60.0

log = logging.getLogger("worker_core.producer")
#: (database, job_type) of the types this process was warned of (see registered_defaults), once each
_warned_unregistered: set[tuple[str, str]] = set()
WARNED_MAX = 10_000


def registered_defaults(
    conn: AnyConn, job_types: Iterable[str], registry: Registry | None = None, *, warn: bool = False
) -> RegisteredContracts:
    """The contracts the workers registered (job_type_contracts) for the types this process has no @task for,
    so a producer that never imports the handlers still enqueues under the handlers' contract; with the
    deployment's policy to resolve the rest under (RegisteredContracts.deployment).

    ``warn``: a type with neither is logged, once per process and database: its jobs take the deployment's
    defaults (timeout, attempts, no idempotency key required), not its @task's, and nothing said so (the
    CLI's enqueue did; a producer's library call was silent)."""
    return _run(conn, "registered_defaults", lambda database: _resolve(database, job_types, registry, warn))


def _database(conn: AnyConn | AnyAsyncConn) -> str:
    return f"{conn.info.host}:{conn.info.port}/{conn.info.dbname}"


def _resolve(
    database: str, job_types: Iterable[Any], registry: Registry | None, warn: bool
) -> _Steps[RegisteredContracts]:
    local = registry or default_registry
    now = time.monotonic()
    # only well-formed types are looked up: a malformed one is refused by the validation that follows
    wanted = {t for t in job_types if isinstance(t, str) and JOB_TYPE_RE.match(t) and t not in local}
    missing = [t for t in wanted if _registered_cache.get((database, t), (0.0, None))[0] < now]
    if missing:
        rows = yield _Statement("contracts_for_types", {"job_types": missing})
        found = {r["job_type"]: r for r in rows}
        for t in missing:
            row = found.get(t)
            _registered_cache[(database, t)] = (
                now + REGISTERED_TTL_SECONDS,
                _registered_from_contract(row) if row else None,
            )
    out = {}
    for t in wanted:
        d = _registered_cache.get((database, t), (0.0, None))[1]
        if d is not None:
            out[t] = d
        elif warn and (database, t) not in _warned_unregistered and len(_warned_unregistered) < WARNED_MAX:
            _warned_unregistered.add((database, t))
            log.warning(
                "job type %r has no @task in this process and no worker has registered it on %s yet: its jobs"
                " take the deployment's defaults (timeout, attempts; no idempotency key required), not its"
                " @task's, until a worker of it starts (or this process imports its task module)",
                t,
                database,
            )
    deployment = yield from _deployment(database)
    return RegisteredContracts(out, deployment)


def _deployment(database: str) -> _Steps[policy.DeploymentPolicy]:
    """This process's policy when it has a policy file (or an embedder set one), else the one its workers
    registered on ``database`` (their file's defaults and queue layers, under this process's QCONSOLE_<FIELD>
    variables), else the built-in one."""
    own = policy.current()
    if own.source != "built-in":  # what policy.load names a policy without a file
        return own
    now = time.monotonic()
    expiry, found = _policy_cache.get(database, (0.0, None))
    if expiry < now:
        rows = yield _Statement("deployment_policy_get", {})
        try:
            found = _registered_policy(rows[0]) if rows else None
        except policy.PolicyError as e:
            # a newer worker's field, or this process's QCONSOLE_<FIELD> against it: said, not every enqueue refused
            log.warning("the policy the workers registered on %s does not apply here, the built-in one does: %s",
                        database, e)  # fmt: skip
            found = None
        _policy_cache[database] = (now + REGISTERED_TTL_SECONDS, found)
    return found or own


def _registered_policy(row: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> policy.DeploymentPolicy:
    """The registered policy, under this process's QCONSOLE_<FIELD> variables (``environ``: os.environ)."""
    at = row["reported_at"].isoformat(timespec="seconds")
    source = f"the workers' policy ({row['source']}, registered by {row['reported_by']} at {at})"
    return policy.from_mapping({"defaults": row["defaults"], "queues": row["queues"]}, source, environ)


def registered_policy(conn: Conn) -> policy.DeploymentPolicy | None:
    """The policy the workers registered (deployment_policy, migration 0016), or None; read now, not cached
    (``qconsole policies``). Its ``source`` names their file, the worker that registered it and when."""
    row = conn.execute(queries["deployment_policy_get"]).fetchone()
    if row is None:
        return None
    try:
        return _registered_policy(row, environ={})  # as they registered it
    except policy.PolicyError as e:  # a newer worker's field: said in its place
        return policy.from_mapping({}, f"the workers' policy, which does not read here: {e}", environ={})


def publish_policy(conn: Conn, reported_by: str, now: dt.datetime) -> str | None:
    """Register this process's policy as the deployment's (a worker, with its types' contracts), for the
    producers that have no policy file. Returns the one it replaced, said, when that one differed."""
    own = policy.current()
    defaults = {k: v for k, v in own.defaults.values.items() if v is not None}
    queues = {
        q: {**layer.values, "reason": layer.reason} if layer.reason else layer.values for q, layer in own.queues.items()
    }
    row = conn.execute(
        queries["deployment_policy_upsert"],
        {"defaults": json.dumps(defaults), "queues": json.dumps(queues), "source": own.source,
         "worker": reported_by, "now": now},
    ).fetchone()  # fmt: skip
    before = row["replaced"] if row else None
    if before is None or [before["defaults"], before["queues"]] == json.loads(json.dumps([defaults, queues])):
        return None
    return f"{before['source']}, registered by {before['reported_by']} at {before['reported_at']}"


def _registered_from_contract(row: Mapping[str, Any]) -> Registered:
    c = {k: v["value"] for k, v in row["contract"].items()}
    own = TypeDefaults(
        queue=row["queue"],
        max_attempts=int(c["max_attempts"]),
        timeout_seconds=float(c["timeout_seconds"]),
        visibility_timeout_seconds=float(c["visibility_timeout_seconds"]),
        retry_policy=RetryPolicy(
            backoff=c["backoff"], base_seconds=c["base_seconds"], max_delay_seconds=c["max_delay_seconds"],
            jitter=c["jitter"],
        ),
        requires_idempotency_key=bool(row["requires_idempotency_key"]),
    )  # fmt: skip
    layer_name = f"type:{row['job_type']}"
    overrides = {k: v["value"] for k, v in row["contract"].items() if v.get("source") == layer_name}
    derived = overrides.get("timeout_seconds", -1.0) + DEFAULT_VISIBILITY_MARGIN_SECONDS
    if overrides.get("visibility_timeout_seconds") == derived:
        # derived from the type's timeout (the contract names the timeout's source for it), not set by the
        # type: in another queue, that queue's own visibility timeout applies (as it does for a local @task)
        del overrides["visibility_timeout_seconds"]
    return Registered(own, policy.Layer(layer_name, overrides, "registered") if overrides else None)


# ------------------------------------------------------------------------------------------ the steps


@dataclass(frozen=True)
class _Statement:
    """A statement of queries.sql the steps run; its rows are sent back (none for one that returns none)."""

    name: str
    params: Mapping[str, Any]


class _Write:
    """What follows writes: in the caller's transaction (see _own_transaction)."""


_WRITE = _Write()
_Rows = list[dict[str, Any]]
_Steps = Generator["_Statement | _Write", _Rows, T]


def _own_transaction(conn: AnyConn | AnyAsyncConn) -> bool:
    """Whether the writes take a transaction of their own: on an autocommit connection (a transaction), inside
    the caller's open one (a savepoint).

    On a non-autocommit connection with no transaction open yet, psycopg's ``transaction()`` would BEGIN
    and COMMIT by itself, so an enqueue made before the business write would commit without it: there,
    the first statement opens the caller's transaction and the caller commits or rolls back.
    """
    return conn.autocommit or conn.info.transaction_status != TransactionStatus.IDLE


def _check_kind(conn: Any, api: str, asynchronous: bool) -> None:
    """A connection of the other kind is said, with the function that takes it: ``enqueue(aconn, ...)``
    failed inside psycopg (``'_AsyncGeneratorContextManager' object does not support the context manager
    protocol``)."""
    if asynchronous == isinstance(conn, psycopg.AsyncConnection):
        return
    if asynchronous:
        raise TypeError(
            f"worker_core.{api} takes a psycopg.AsyncConnection, not a {type(conn).__name__}: on a"
            f" psycopg.Connection, call worker_core.{api.removeprefix('a')}"
        )
    twin = (
        f": in async code, use `await worker_core.a{api}(aconn, ...)`, which enqueues in the caller's async"
        f" transaction as {api} does"
    )
    raise TypeError(
        f"worker_core.{api} takes a psycopg.Connection, not an AsyncConnection{twin if 'enqueue' in api else ''}"
    )


@contextlib.contextmanager
def _schema_checked() -> Iterator[None]:
    """A table or column the producer's statements name is missing: the database is not migrated (psycopg
    said ``UndefinedTable: relation "job_type_contracts" does not exist``, naming an internal table and not
    the step forgotten)."""
    try:
        yield
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn) as e:
        what = (e.diag.message_primary or str(e)).strip()
        raise NotMigrated(
            f"the database is not migrated for this version of worker_core ({what}): run `qconsole migrate`"
            " (as the schema's owner), or check that the connection names the queue's database"
        ) from e


def _run(conn: AnyConn, api: str, make: Callable[[str], _Steps[T]]) -> T:
    """Run the steps ``make`` gives (for the connection's database) on a psycopg Connection."""
    _check_kind(conn, api, asynchronous=False)
    steps, cur = make(_database(conn)), dict_cursor(conn)
    with _schema_checked(), contextlib.ExitStack() as writing:
        try:
            step = next(steps)
            while True:
                if isinstance(step, _Write):
                    if _own_transaction(conn):
                        writing.enter_context(conn.transaction())
                    step = steps.send([])
                else:
                    ran = cur.execute(queries[step.name], step.params)
                    step = steps.send(ran.fetchall() if ran.description else [])
        except StopIteration as done:
            return done.value


async def _arun(aconn: AnyAsyncConn, api: str, make: Callable[[str], _Steps[T]]) -> T:
    """_run's twin on a psycopg AsyncConnection: the same steps, awaited."""
    _check_kind(aconn, api, asynchronous=True)
    steps, cur = make(_database(aconn)), aconn.cursor(row_factory=dict_row)
    with _schema_checked():
        async with contextlib.AsyncExitStack() as writing:
            try:
                step = next(steps)
                while True:
                    if not isinstance(step, _Write):
                        ran = await cur.execute(queries[step.name], step.params)
                        step = steps.send(await ran.fetchall() if ran.description else [])
                        continue
                    if _own_transaction(aconn):
                        await writing.enter_async_context(aconn.transaction())
                    step = steps.send([])
            except StopIteration as done:
                return done.value


def _count_dedup_hits(now: dt.datetime | None, hits: Mapping[tuple[str, str], int]) -> _Steps[None]:
    rows = [{"queue": q, "job_type": t, "n": n} for (q, t), n in sorted(hits.items()) if n]
    if rows:
        yield _Statement("count_dedup_hits", {"now": now, "rows": json.dumps(rows)})


def _params(env: Envelope) -> dict[str, Any]:
    return {
        "job_type": env.job_type,
        "queue": env.queue,
        "payload": env.payload_json,
        "priority": env.priority,
        "max_attempts": env.max_attempts,
        # an absolute time as given (one already past is stored as the statement's "now": due now, its queue
        # latency counted from its enqueue); else the delay after the statement's "now": the server's clock,
        # since a producer's host may be off (one two minutes ahead delayed every job it enqueued by two minutes)
        "scheduled_at": env.scheduled_at,
        "delay": float(env.delay_seconds),
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
    conn: AnyConn,
    job_type: str,
    payload: Mapping[str, Any] | None = None,
    *,
    clock: Clock = SYSTEM_CLOCK,
    registry: Registry | None = None,
    **envelope: Unpack[EnvelopeFields],
) -> EnqueueResult:
    """Insert one job in the caller's transaction.

    Returns the new job's id, or ``created=False`` with the id of the live job that already holds the
    same ``dedup_key``. Raises EnvelopeError (nothing written) when the envelope breaks the contract,
    NotMigrated on a database ``qconsole migrate`` has not brought up to date, and TypeError on an
    AsyncConnection (use ``aenqueue``).
    """
    return _run(conn, "enqueue", lambda database: _one(database, job_type, payload, envelope, clock, registry))


async def aenqueue(
    aconn: AnyAsyncConn,
    job_type: str,
    payload: Mapping[str, Any] | None = None,
    *,
    clock: Clock = SYSTEM_CLOCK,
    registry: Registry | None = None,
    **envelope: Unpack[EnvelopeFields],
) -> EnqueueResult:
    """``enqueue`` on a psycopg AsyncConnection, in the caller's async transaction: ``async with
    aconn.transaction(): ...; await worker_core.aenqueue(aconn, "invoice.generate", {...})``."""
    make = lambda database: _one(database, job_type, payload, envelope, clock, registry)  # noqa: E731
    return await _arun(aconn, "aenqueue", make)


def _one(
    database: str,
    job_type: Any,
    payload: Mapping[str, Any] | None,
    envelope: Mapping[str, Any],
    clock: Clock,
    registry: Registry | None,
) -> _Steps[EnqueueResult]:
    registered = yield from _resolve(database, [job_type], registry, warn=True)
    env = prepare(job_type, {} if payload is None else payload, envelope, registry, registered)
    now = statement_now(clock)
    params = {**_params(env), "now": now}
    yield _WRITE
    for _ in range(5):
        inserted = yield _Statement("insert_job", params)
        if inserted:
            return EnqueueResult(inserted[0]["id"], True)
        found = yield _Statement("live_by_dedup_keys", {"keys": [env.dedup_key]})
        if found:
            yield from _count_dedup_hits(now, {(env.queue, env.job_type): 1})
            return EnqueueResult(found[0]["id"], False)
        # the holder finished between our insert and our look-up: try again
    raise RuntimeError(f"could not enqueue {job_type}: dedup key {env.dedup_key!r} kept changing hands")


def _in_key_order(envs: list[Envelope]) -> list[Envelope]:
    """Jobs with a dedup key first, in key order, then the others as given. Each insert holds its key's
    index entry until the caller commits: two producers whose batches share keys in different orders
    waited for each other, and PostgreSQL aborted one of them (its business write with it). In one order
    for every producer, the later one waits for the earlier's commit instead. Stable: of two jobs with
    the same key, the first given is the one inserted."""
    return sorted(envs, key=lambda e: (e.dedup_key is None, e.dedup_key or ""))


def _malformed_item(item: Any) -> str | None:
    """What is wrong with the shape of one of enqueue_many's items, if anything: its envelope is validated
    only once its shape is right (an IndexError, an unhashable type or a ``None`` for fields raised from the
    middle of the validation, not the EnvelopeError listing every job's problems)."""
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
        shape = f"a {type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list)) else type(item).__name__
        return f"must be (job_type, payload) or (job_type, payload, envelope_fields), not {shape}"
    if not isinstance(item[0], str):
        return f"job_type must be a string, not {type(item[0]).__name__}"
    if len(item) == 3 and not isinstance(item[2], Mapping):
        return f"envelope fields must be a mapping, not {type(item[2]).__name__}"
    return None


Jobs = Iterable[tuple[str, Mapping[str, Any]] | tuple[str, Mapping[str, Any], Mapping[str, Any]]]


def enqueue_many(
    conn: AnyConn, jobs: Jobs, *, clock: Clock = SYSTEM_CLOCK, registry: Registry | None = None
) -> list[EnqueueResult]:
    """Insert many jobs in one statement, in the caller's transaction.

    ``jobs`` yields ``(job_type, payload)`` or ``(job_type, payload, envelope_fields)``. Every envelope is
    validated before anything is written; results come back in input order. A job whose dedup key is
    held by a live job (or by an earlier job of the same batch) is reported with that job's id.
    """
    items = list(jobs)
    return _run(conn, "enqueue_many", lambda database: _many(database, items, clock, registry))


async def aenqueue_many(
    aconn: AnyAsyncConn, jobs: Jobs, *, clock: Clock = SYSTEM_CLOCK, registry: Registry | None = None
) -> list[EnqueueResult]:
    """``enqueue_many`` on a psycopg AsyncConnection, in the caller's async transaction."""
    items = list(jobs)
    return await _arun(aconn, "aenqueue_many", lambda database: _many(database, items, clock, registry))


def _many(database: str, items: list[Any], clock: Clock, registry: Registry | None) -> _Steps[list[EnqueueResult]]:
    malformed = {i: wrong for i, item in enumerate(items) if (wrong := _malformed_item(item)) is not None}
    well_formed = [item for i, item in enumerate(items) if i not in malformed]
    registered = yield from _resolve(database, {item[0] for item in well_formed}, registry, warn=True)
    envs: list[Envelope] = []
    problems: list[str] = []
    for i, item in enumerate(items):
        if i in malformed:
            problems.append(f"job {i}: {malformed[i]}")
            continue
        job_type, payload = item[0], item[1]
        fields: Mapping[str, Any] = item[2] if len(item) > 2 else {}
        try:
            envs.append(prepare(job_type, payload, fields, registry, registered))
        except ValueError as e:
            problems.append(f"job {i}: {e}")
    if problems:
        raise EnvelopeError(problems)
    if not envs:
        return []
    now = statement_now(clock)
    yield _WRITE
    inserted = yield _Statement("insert_jobs_many", _columns(envs, now))
    by_key = {r["dedup_key"]: r["id"] for r in inserted if r["dedup_key"] is not None}
    for _ in range(5):
        missing = list(dict.fromkeys(e.dedup_key for e in envs if e.dedup_key and e.dedup_key not in by_key))
        if missing:
            for r in (yield _Statement("live_by_dedup_keys", {"keys": missing})):
                by_key.setdefault(r["dedup_key"], r["id"])
        # a holder that finished between our insert and our look-up: those jobs are inserted again
        gone = {k for k in missing if k not in by_key}
        if not gone:
            break
        firsts = {e.dedup_key: e for e in reversed(envs) if e.dedup_key in gone}
        more = yield _Statement("insert_jobs_many", _columns(list(firsts.values()), now))
        inserted += more
        by_key.update({r["dedup_key"]: r["id"] for r in more})
    else:
        raise RuntimeError(f"could not enqueue: dedup keys {sorted(gone)!r} kept changing hands")
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
    yield from _count_dedup_hits(now, hits)
    return out


def _columns(envs: list[Envelope], now: dt.datetime | None) -> dict[str, Any]:
    """insert_jobs_many's parameters: a column of values per field, in key order (_in_key_order)."""
    rows = [_params(env) for env in _in_key_order(envs)]
    return {**{name: [r[name] for r in rows] for name in rows[0]}, "now": now}
