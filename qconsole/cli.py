"""The ``qconsole`` command: the console (no subcommand), and every operation as a subcommand.

Parsing only: each command calls one worker_core function and prints its result (qconsole.output).
Exit codes: 0 ok, 1 not found or operation refused, 2 bad input (nothing written), 3 database unreachable, 4
(``worker --processes``) its processes kept dying at start, 5 the outcome of a write is unknown (its connection was
lost as it committed, and the database could not be asked after).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import secrets
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn, TypeVar

import psycopg
import typer

from qconsole import output
from worker_core import db, ops, stats
from worker_core.clock import SYSTEM_CLOCK, now_on
from worker_core.envelope import DEFAULT_QUEUE, QUEUE_RE
from worker_core.errors import EnvelopeError, NotFound, ReadOnlyError, TableLocked
from worker_core.migrate import (
    LockHolder,
    Migration,
    MigrationFailed,
    unknown_migrations,
)
from worker_core.migrate import migrate as run_migrations
from worker_core.models import ActionResult, DeadLetterGroups, EnqueueResult, Job, JobState
from worker_core.producer import NotMigrated
from worker_core.sql import queries

app = typer.Typer(
    name="qconsole",
    help="A PostgreSQL job queue with autonomous workers, and its incident console.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

T = TypeVar("T")

DsnOpt = Annotated[
    str | None,
    typer.Option(
        "--dsn",
        help="PostgreSQL DSN (else $QCONSOLE_DSN, $DATABASE_URL, else the embedded server, which a command that only"
        " reads never creates).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
ReasonOpt = Annotated[str | None, typer.Option("--reason", help="Why: recorded in the audit log.")]


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


#: ``--dsn``, ``--read-only`` and ``--statement-timeout`` given before the subcommand (``qconsole --dsn X kill
#: ...``): they hold for it, as they would for the console. Set by the callback on every run.
_ROOT: dict[str, Any] = {"dsn": None, "read_only": False, "command": None, "statement_timeout_s": None}

#: how long one statement of a command may run, unless ``--statement-timeout`` says otherwise: a command that
#: reads (``stats``, ``jobs``...) 60 s, one that writes (``requeue`` of a large group, ``enqueue``...) 10
#: minutes, as the console's actions. A `qconsole stats --json` run by cron behind a table lock (a migration
#: of another tool, a ``VACUUM FULL``) or against a hung server waited for ever, and the runs piled up.
READ_TIMEOUT_S = 60.0
WRITE_TIMEOUT_S = 600.0
MAX_STATEMENT_TIMEOUT_S = 2_147_483.0  # PostgreSQL's limit (2^31 - 1 ms)


def _dsn(dsn: str | None) -> str | None:
    """The subcommand's own ``--dsn``, else the one given before it."""
    return dsn if dsn is not None else _ROOT["dsn"]


def _refuse_if_read_only(command: str) -> None:
    if _ROOT["read_only"]:
        fail(f"read-only mode: `qconsole {command}` changes the database and is refused (drop --read-only)", 1)


@contextmanager
def connect(
    dsn: str | None, *, read_only: bool = False, autocommit: bool = True, for_workers: bool = False
) -> Iterator[db.Conn]:
    """A connection with a clear error when the database is unreachable or not migrated. ``for_workers``:
    a schema whose applied migrations differ from this code's is refused (exit 3), not only warned of."""
    if not read_only:
        _refuse_if_read_only(_ROOT["command"] or "this command")
    configured = db.configured_dsn(_dsn(dsn))
    target = _target(configured, create=not read_only)
    timeout_s = _ROOT["statement_timeout_s"]
    if timeout_s is None:
        timeout_s = READ_TIMEOUT_S if read_only else WRITE_TIMEOUT_S
    try:
        conn = db.connect(
            target,
            application_name="qconsole-cli",
            autocommit=autocommit,
            read_only=read_only,
            tolerant_json=True,
            statement_timeout_ms=int(timeout_s * 1000) or None,
        )
    except psycopg.Error as e:  # unreachable, or a DSN libpq cannot parse (its error quotes it)
        fail(f"cannot connect to {db.redact_dsn(target)}: {db.redact(str(e).strip(), target)}", 3)
    # a server that stopped answering while TCP still acknowledges (hung, stopped, a proxy in front of a
    # dead one) is noticed by neither keepalives nor its own statement timeout: the command gives up after
    # twice its statement timeout and 10 s more in all (its statements together), whatever it was doing
    # (db.Deadline)
    deadline = db.Deadline(conn, 2 * timeout_s + 10) if timeout_s else None
    _ROOT["deadline"] = deadline
    _ROOT["target"] = target  # where an action whose answer was lost is looked up (_look_up)
    try:
        with deadline or contextlib.nullcontext():
            try:
                _check_schema(conn, target, configured, for_workers)
            except psycopg.errors.InsufficientPrivilege as e:
                # a role granted nothing (or not SELECT) on the queue's tables: a traceback from every command
                fail(
                    f"this role cannot read the queue's tables: {db.redact(str(e).strip(), target)}; grant it"
                    " SELECT on them (and INSERT, UPDATE, DELETE to act or run workers), or use the schema"
                    " owner's role",
                    1,
                )
            yield conn
    except psycopg.OperationalError as e:  # outside guarded(): the schema check, a command's own reads
        _database_error(e)
    finally:
        _ROOT["deadline"] = None
        conn.close()


def _target(configured: str | None, *, create: bool) -> str:
    """The DSN to connect to: the one configured, else the embedded server's, said on stderr once per command
    (stdout stays the command's: --json). ``create``: a command that writes may make a new, empty embedded
    server; one that only reads is refused instead (exit 3), nothing made: with no DSN (sudo drops the
    environment), every command silently made one and read "nothing queued, no dead letters" from it, exit 0."""
    if configured is not None:
        return configured
    from worker_core.embedded import NoEmbeddedServer, created_here, data_directory, start_embedded

    try:
        uri = start_embedded(create=create)
    except NoEmbeddedServer as e:
        fail(
            f"no database named (--dsn, QCONSOLE_DSN or DATABASE_URL; sudo drops the environment) and no embedded"
            f" server in {e.pgdata}: this command only reads, and a new, empty server would have nothing to show."
            " Point it at your database with --dsn or QCONSOLE_DSN (`qconsole migrate` makes the embedded server)",
            3,
        )
    except RuntimeError as e:  # the embedded server cannot start (EmbeddedUnavailable): the message says what to do
        fail(str(e), 3)
    if not _ROOT.get("embedded_said"):
        _ROOT["embedded_said"] = True
        where = data_directory(uri)
        what = (
            f"a new, empty embedded PostgreSQL server was created in {where}"
            if created_here(uri)
            else f"using the embedded PostgreSQL server in {where}"
        )
        typer.echo(
            f"note: no --dsn, QCONSOLE_DSN or DATABASE_URL given: {what} (--dsn or QCONSOLE_DSN points qconsole at"
            " another database)",
            err=True,
        )
    return uri


def _database_error(e: psycopg.OperationalError) -> NoReturn:
    """Exit 3 with what went wrong: the server stopped answering, a statement ran past its timeout, or the
    connection failed."""
    deadline = _ROOT.get("deadline")
    if deadline is not None and deadline.expired:
        fail(
            f"the command ran past {deadline.seconds:g} s in all, waiting on the database (a hung or overloaded"
            " server?); nothing is known of what its last statement did: check before running it again",
            3,
        )
    if isinstance(e, psycopg.errors.QueryCanceled):
        fail(
            f"a statement ran past the statement timeout and was cancelled, nothing of it was written: {e}".strip()
            + " (waiting on a lock? see pg_stat_activity; --statement-timeout before the command sets another)",
            3,
        )
    fail(f"database error: {e}".strip(), 3)


def _check_schema(conn: db.Conn, target: str, configured: str | None, for_workers: bool) -> None:
    """Migrations pending (applied here on the embedded server), changed, or newer than this code's: the start
    check of worker_core (ops.check_schema), said the CLI's way."""
    # the embedded server is ours: its schema is brought up to date (a first `qconsole stats` too)
    ours = configured is None and not _ROOT["read_only"]
    try:
        state = ops.check_schema(
            conn, migrate_dsn=target if ours else None, on_wait=_say_lock_wait, refuse_changed=for_workers
        )
    except NotMigrated as e:
        if e.failed is not None:
            _migration_failed(e.failed, target)
        if e.pending:
            fail(_pending_said(e.pending), 3)
        fail(f"{_changed_said(e.changed)} that migrated it: its workers refuse to start", 3)
    if state.changed:
        # workers refuse to start on such a schema (forward-only); an operator's command is only warned
        said = _changed_said(state.changed)
        typer.echo(f"warning: {said} that migrated it (workers of it refuse to start)", err=True)
    _say_newer(state.newer)


def _pending_said(pending: Sequence[Migration]) -> str:
    return f"the database needs migrations ({', '.join(m.label for m in pending)}): run `qconsole migrate`"


def _changed_said(changed: Sequence[Migration]) -> str:
    names = ", ".join(m.label for m in changed)
    return f"migrations {names} differ from what this database applied: this qconsole is not the version"


def guarded(fn: Callable[[], T]) -> T:
    """Turn the library's errors into clear messages and exit codes."""
    try:
        return fn()
    except EnvelopeError as e:
        _envelope_refused(e.problems)
    except (ValueError, typer.BadParameter) as e:
        fail(str(e), 2)
    except NotFound as e:
        fail(str(e), 1)
    except TableLocked as e:  # behind another session's lock, as a statement timeout is: exit 3
        fail(str(e), 3)
    except ReadOnlyError as e:
        fail(str(e), 1)
    except psycopg.OperationalError as e:
        _database_error(e)
    except psycopg.DataError as e:
        fail(f"invalid value: {str(e).strip()}", 2)
    except REFUSED as e:
        # a role that may only read, a replica: refused, as --read-only refuses (nothing was written)
        fail(f"refused by the database, nothing changed: {str(e).strip()}", 1)


#: what the database says to a role that may not write, or to a replica (exit 1, as --read-only is refused)
REFUSED = (psycopg.errors.InsufficientPrivilege, psycopg.errors.ReadOnlySqlTransaction)


# ------------------------------------------------------------------------------------------------ a lost answer

#: the exit code of a write whose outcome is unknown: its connection was lost as it committed, and the database
#: could not be asked afterwards whether it was done (3 is left to what did not write, or is known not to have:
#: a script that runs a command again on 3 must not run this one again before it has looked; 4 is `worker
#: --processes` giving up, worker_core.supervisor.EXIT_GAVE_UP)
EXIT_UNKNOWN = 5
#: how long, in all, a command whose action lost its connection tries to reach the database again and to see the
#: action's session end (nothing of it can commit any more) before it says that the outcome is unknown
LOST_LOOKUP_S = 10.0


class _AnswerLost(Exception):
    """The connection of an action died once the action was sent: its COMMIT may have gone through."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Lost:
    """An action whose connection died once it was sent, looked up on a new connection: ``done`` True (``found``:
    what the look-up found of it), False (its session ended without committing it), None (it could not be told:
    ``why``)."""

    error: BaseException
    done: bool | None
    found: Any = None
    why: str = ""


def _answer_lost(e: BaseException) -> bool:
    """The session was lost (the server went away, the session was ended, the socket died): not an answer of the
    server (a statement timeout, a lock timeout), nor the command's own deadline (_database_error says that one)."""
    from qconsole.backend import is_outage

    deadline = _ROOT.get("deadline")
    return is_outage(e) and not (deadline is not None and deadline.expired)


def _sent(conn: db.Conn, key: int, fn: Callable[[], T]) -> T | _AnswerLost:
    """``fn()`` on ``conn`` once its session holds the action's token ``key`` (an advisory lock held until the
    session ends: once it is free, nothing of the action can commit any more), the errors said as guarded() says
    them, but a connection lost once it was sent: returned."""
    guarded(lambda: ops.hold_action_token(conn, key))  # an outage here: nothing was sent, said as ever

    def run() -> T:
        try:
            return fn()
        except (psycopg.OperationalError, psycopg.InterfaceError) as e:
            if _answer_lost(e):
                raise _AnswerLost(e) from e
            raise

    try:
        return guarded(run)
    except _AnswerLost as lost:
        return lost


def _new_token() -> tuple[str, int]:
    """An action's token (written into its audit entry: how it is found after its answer was lost), and the key
    of the advisory lock its session holds (as the console's)."""
    token = secrets.token_hex(8)
    return token, int.from_bytes(bytes.fromhex(token)[:4], "big", signed=True)


def _told(conn: db.Conn, fn: Callable[[str], T], find: Callable[[db.Conn, str], Any]) -> T | Lost:
    """An operator action ``fn`` (given the token its audit entry carries), told as the console tells it: when its
    connection dies once it was sent, whether it committed is looked up on a new connection (``find``: what the
    token finds of it, None for nothing). It said "database error", exit 3, of a requeue that had committed (the
    answer to its COMMIT lost), and the operator ran it again."""
    token, key = _new_token()
    result = _sent(conn, key, lambda: fn(token))
    if isinstance(result, _AnswerLost):
        return _look_up(conn, result.error, key, lambda c: find(c, token))
    return result


def _look_up(conn: db.Conn, error: BaseException, key: int, find: Callable[[db.Conn], Any]) -> Lost:
    """Whether the action whose connection died committed, asked on a new connection once its session has ended
    (its token's lock free), trying for LOST_LOOKUP_S in all: ``find`` says what it finds of it (None: nothing)."""
    with contextlib.suppress(Exception):
        conn.close()  # its end reaches the server at once
    target = str(_ROOT["target"])
    until = time.monotonic() + LOST_LOOKUP_S
    why = "the database could not be reached again"
    while (left := until - time.monotonic()) > 0:
        try:
            with db.connect(
                target, application_name="qconsole-cli", autocommit=True, connect_timeout=max(2, int(left) + 1),
                statement_timeout_ms=5000,
            ) as lookup, db.Deadline(lookup, left + 5):  # fmt: skip
                while not ops.action_session_ended(lookup, key):
                    if time.monotonic() >= until:
                        return Lost(error, None, why="its session is still alive on the server: it may yet commit")
                    time.sleep(0.2)
                found = find(lookup)
                return Lost(error, found is not None, found)
        except psycopg.Error as e:
            said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            why = f"the database could not be asked again ({db.redact(said, target)})"
            time.sleep(max(0.0, min(0.5, until - time.monotonic())))
    return Lost(error, None, why=why)


def _first_line(error: BaseException) -> str:
    said = str(error).strip()
    return db.redact(said.splitlines()[0] if said else type(error).__name__, _ROOT.get("target"))


def _say_done(lost: Lost, what: str) -> None:
    """The note of an action done whose answer was lost (stdout says what it says of a success)."""
    typer.echo(
        f"note: {what}: the answer to its commit was lost with the connection ({_first_line(lost.error)}); it was"
        " looked up on a new connection",
        err=True,
    )


def _say_not_done(lost: Lost, action: str, nothing: str = "nothing changed", how: str = "") -> NoReturn:
    """An action whose connection died before it committed: exit 3, as a database error, said to be safe to run
    again."""
    how = how or "its session ended without it, as a new connection saw"
    fail(
        f"database error: {lost.error}".strip()
        + f"\nnot done: {nothing} (the connection was lost before the {action} committed: {how}); it can be run"
        " again",
        3,
    )


def _say_unknown(lost: Lost, action: str, check: str) -> NoReturn:
    """An action whose connection died as it committed, that could not be looked up: exit EXIT_UNKNOWN."""
    fail(
        f"database error: {lost.error}".strip()
        + f"\nthe outcome of the {action} is UNKNOWN: its connection was lost as it committed, and {lost.why}."
        + f" It may have been done: check before running it again ({check})",
        EXIT_UNKNOWN,
    )


def _job_ids(job_ids: Sequence[str]) -> list[uuid.UUID]:
    """The jobs named, as the action read them (it refused any that is not an id before it was sent)."""
    return list(dict.fromkeys(uuid.UUID(str(j)) for j in job_ids))


def _jobs_action(
    conn: db.Conn, action: str, job_ids: Sequence[str], fn: Callable[[str], ActionResult]
) -> ActionResult | None:
    """A requeue, kill or discard of ``job_ids``, told (_told). Its answer lost: done, what the action prints, from
    its audit entry (how many jobs it changed, not which; a job named that does not exist said skipped, exit 1, as
    ever) and None; not done, exit 3; unknown, exit EXIT_UNKNOWN."""

    def find(c: db.Conn, token: str) -> tuple[tuple[int, int], list[uuid.UUID]] | None:
        entry = ops.audit_entry_of_token(c, token)
        if entry is None:
            return None
        ids = _job_ids(job_ids)
        there = {r["id"] for r in c.execute(queries["jobs_state_and_dedup"], {"ids": ids})}
        return entry, [i for i in ids if i not in there]

    told = _told(conn, fn, find)
    if not isinstance(told, Lost):
        return told
    if told.done is None:
        _say_unknown(told, action, "`qconsole audit` lists it if it was done; `qconsole job ID` shows a job's state")
    if not told.done:
        _say_not_done(told, action)
    (audit_id, changed), missing = told.found
    requested = len(_job_ids(job_ids))
    _say_done(told, f"{action} done (audit #{audit_id}, {changed} job(s))")
    output.action_counted(action, changed, requested, audit_id, missing)
    if missing or not changed:
        raise typer.Exit(1)  # as _exit_for_skipped
    return None


def _enqueue_told(conn: db.Conn, make: Callable[[], EnqueueResult]) -> EnqueueResult:
    """An enqueue (``make``) in a transaction of its own, its job's id known before its COMMIT is sent (the job's
    insert answers with it), told when its connection dies: before the commit, nothing was enqueued (exit 3);
    at the commit, the job is looked for on a new connection: there, its id is printed as ever (a retry on
    "database error" made a second job); not there, exit 3; unknown, exit EXIT_UNKNOWN with the job to look
    for."""
    _, key = _new_token()
    made: list[EnqueueResult] = []

    def enqueue_it() -> EnqueueResult:
        with conn.transaction():  # the producer's writes in a savepoint of it
            made.append(make())
        return made[0]

    result = _sent(conn, key, enqueue_it)
    if not isinstance(result, _AnswerLost):
        return result
    if not made:  # lost before the COMMIT was sent: the server rolls it back
        _say_not_done(Lost(result.error, False), "enqueue", "nothing was enqueued", "its commit was never sent")
    job = made[0]

    def find(c: db.Conn) -> EnqueueResult | None:
        return job if c.execute(queries["jobs_state_and_dedup"], {"ids": [job.id]}).fetchone() else None

    told = _look_up(conn, result.error, key, find)
    if told.done is None:
        _say_unknown(
            told, "enqueue", f"`qconsole job {job.id}` shows the job if it was made, says `no such job` if not; a"
            " second run makes a second job, unless it has a --dedup-key (a live job holding the key is not made"
            " twice): with it, and an --idempotency-key for its effect, running it again is safe",
        )  # fmt: skip
    if not told.done:
        _say_not_done(told, "enqueue", "nothing was enqueued")
    _say_done(told, f"enqueue done (job {job.id})" if job.created else f"enqueue done (duplicate of {job.id})")
    return job


def _audited_action(conn: db.Conn, action: str, fn: Callable[[str], ActionResult], check: str) -> ActionResult:
    """A pause, resume or limit, told (_told): its answer lost, its result from its audit entry when it was done;
    not done, exit 3; unknown, exit EXIT_UNKNOWN (``check`` says how to check)."""
    told = _told(conn, fn, ops.audit_entry_of_token)
    if not isinstance(told, Lost):
        return told
    if told.done is None:
        _say_unknown(told, action, f"`qconsole audit` lists it if it was done; {check}")
    if not told.done:
        _say_not_done(told, action)
    audit_id = told.found[0]
    _say_done(told, f"{action} done (audit #{audit_id})")
    return ActionResult(action, 1, [], [], audit_id)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION_SECONDS = 100 * 365 * 86400.0


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``24h``, ``7d``, ``500ms`` -> seconds."""
    text = text.strip().lower()
    unit: float | None
    if text.endswith("ms"):
        unit, number = 0.001, text[:-2]
    else:
        unit = _UNITS.get(text[-1:])
        number = text[:-1] if unit else text
    try:
        value = float(number) * (unit or 1)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a duration like 90s, 15m, 24h or 7d") from None
    if not 0 <= value <= MAX_DURATION_SECONDS:  # False for nan
        raise typer.BadParameter(f"{text!r}: a duration must be between 0 and 100 years")
    return value


def _seconds(flag: str, text: str | None, problems: list[str]) -> float | None:
    """A flag of seconds: a plain number as it is (the envelope judges it: "delay_seconds must not be
    negative"), or a duration like the other flags take (``90s``, ``15m``, ``2h``: `--delay 90s` was "Input
    should be a valid number"); what is neither is one of ``problems``."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_duration(text)
    except typer.BadParameter as e:
        problems.append(f"{flag}: {e}")
        return None


def _warn_if_newer(conn: db.Conn) -> None:
    _say_newer(unknown_migrations(conn))


def _say_newer(newer: Sequence[int]) -> None:
    """Said, not refused: during a rolling upgrade the new version migrates first, and the old one's workers
    keep running on the schema (migrations only add to it)."""
    if newer:
        versions = ", ".join(f"{v:04d}" for v in newer)
        typer.echo(
            f"warning: this database has migrations this qconsole does not know ({versions}): a newer version"
            " migrated it; upgrade this one",
            err=True,
        )


def _import_tasks(modules: Sequence[str]) -> None:
    """The task modules, or exit 2 with why: one that does not import, or an @task the registry refuses (a
    job type name it does not take, concurrency below 1, a timeout not under its visibility timeout, a type
    registered twice) or the deployment's policy refuses (an override without a reason). The worker's
    processes (``--processes``) and the console's embedded workers take that exit 2, before the worker
    says it started, for a configuration refusal: not restarted."""
    from worker_core.registry import import_task_modules

    _load_policy()  # its errors are the policy file's, not an @task's that happens to read it first
    try:
        import_task_modules(modules)
    except ImportError as e:  # the task module, or one it imports (a dependency not installed): which one said
        fail(f"cannot import task module {_failing_module(e, modules)}: {e}", 2)
    except ValueError as e:  # EnvelopeError and PolicyError among them
        fail(f"a task module's @task is refused: {e}", 2)
    except Exception as e:  # a SyntaxError, a KeyError of a setting it reads at import...: a traceback, exit 1
        fail(f"cannot import task module {_failing_module(e, modules)}: {type(e).__name__}: {e}", 2)


def _load_policy() -> None:
    """The deployment's policy (worker_core.policy), or exit 2 naming the file and the table (or the variable)
    with the value it refuses. Loaded by the first @task imported, a bad value in it was said as "a task
    module's @task is refused"."""
    from worker_core import policy

    try:
        policy.current()
    except policy.PolicyError as e:
        fail(f"the deployment's policy is refused: {e}", 2)


def _failing_module(error: BaseException, modules: Sequence[str]) -> str:
    """The task module (of those named, imported in order) whose import raised ``error``: the first not in
    sys.modules (a failed import leaves none), else the file the error points at."""
    for name in (m.strip() for m in modules):
        if name and name not in sys.modules:
            return repr(name)
    filename = getattr(error, "filename", None)
    return repr(filename) if filename else ", ".join(repr(m.strip()) for m in modules if m.strip())


def parse_json_object(text: str, what: str) -> dict[str, Any]:
    value, problem = _json_object(text, what)
    if value is None:
        fail(problem, 2)
    return value


def _json_object(text: str, what: str) -> tuple[dict[str, Any] | None, str]:
    """The JSON object ``text`` holds, or None and what is wrong with it."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError: a decode error, or an integer of 4,300+ digits
        return None, f"{what} is not valid JSON: {str(e) if isinstance(e, ValueError) else 'nested too deep'}"
    if not isinstance(value, dict):
        return None, f"{what} must be a JSON object, not {type(value).__name__}"
    return value, ""


# ------------------------------------------------------------------------------------------------ console


@app.callback(invoke_without_command=True)
def console(
    ctx: typer.Context,
    dsn: DsnOpt = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="Refuse every action.")] = False,
    refresh: Annotated[float, typer.Option("--refresh", min=0.2, help="Seconds between refreshes.")] = 2.0,
    theme: Annotated[str | None, typer.Option("--theme", help="Textual theme, e.g. textual-dark.")] = None,
    statement_timeout: Annotated[
        str | None,
        typer.Option(
            "--statement-timeout",
            help="How long one statement of a command may run (90s, 15m; 0: no limit). Default: 60s for a"
            " command that reads, 10m for one that writes.",
        ),
    ] = None,
) -> None:
    """Open the incident console (with no subcommand)."""
    if theme is not None:
        _check_theme(theme)
    timeout_s = None
    if statement_timeout is not None:
        try:
            timeout_s = parse_duration(statement_timeout)
        except typer.BadParameter as e:
            fail(f"--statement-timeout: {e}", 2)
        if not (timeout_s == 0 or 0.001 <= timeout_s <= MAX_STATEMENT_TIMEOUT_S):
            fail("--statement-timeout: between 1 ms and 24 days, or 0 for no limit", 2)
    _ROOT.update(
        dsn=dsn, read_only=read_only, command=ctx.invoked_subcommand, statement_timeout_s=timeout_s, embedded_said=False
    )
    if ctx.invoked_subcommand is not None:
        return
    from qconsole.app import run_console

    _schema_ready_for_console(dsn, read_only)
    raise typer.Exit(run_console(dsn, read_only, refresh, theme))


def _check_theme(theme: str) -> None:
    """A theme Textual does not have is bad input (exit 2), said before connecting, a subcommand's run too: the
    console opened in its default theme, with a notice seen once it was open, and `qconsole --theme x stats`
    ran as if it were fine."""
    from textual.theme import BUILTIN_THEMES

    if theme not in BUILTIN_THEMES:
        fail(f"unknown theme {theme!r}: one of {', '.join(sorted(BUILTIN_THEMES))}", 2)


def _schema_ready_for_console(dsn: str | None, read_only: bool) -> None:
    """Migrations pending are said before the console opens (exit 3), as every command says them: the console
    showed ``UndefinedTable: relation "job_queue" does not exist`` as a read failure, refresh after refresh.
    A server that cannot be reached now is left to the console, which says so and retries."""
    configured = db.configured_dsn(_dsn(dsn))
    if configured is None:
        with connect(dsn, read_only=read_only):  # the embedded server: migrated here, if need be
            return
    target = db.resolve_dsn(configured)
    try:
        with db.connect(target, application_name="qconsole-cli", connect_timeout=3) as conn:
            ops.check_schema(conn, refuse_changed=False)
    except NotMigrated as e:
        fail(_pending_said(e.pending), 3)
    except psycopg.ProgrammingError as e:  # a DSN libpq cannot parse: the console could never connect
        fail(f"cannot connect to {db.redact_dsn(target)}: {db.redact(str(e).strip(), target)}", 3)
    except psycopg.OperationalError:
        return


@app.command()
def demo(
    refresh: Annotated[float, typer.Option("--refresh", min=0.2)] = 1.0,
    workers: Annotated[int, typer.Option("--workers", min=0, help="Embedded workers to start.")] = 2,
    dsn: Annotated[
        str | None,
        typer.Option("--dsn", help="Run it on this database (it writes demo jobs); QCONSOLE_DSN is ignored."),
    ] = None,
) -> None:
    """The console over the embedded PostgreSQL, with workers and a live demo workload."""
    from qconsole.demo import demo_dsn, run_demo

    _refuse_if_read_only("demo")
    typer.echo("qconsole demo: starting PostgreSQL and migrating…")
    try:
        target = demo_dsn(_dsn(dsn))
    except RuntimeError as e:  # the embedded server cannot start (EmbeddedUnavailable): the message says what to do
        fail(str(e), 3)
    _migrate_or_exit(target)  # as `qconsole migrate` says it, and exits
    raise typer.Exit(run_demo(target, refresh, workers))


# ------------------------------------------------------------------------------------------------ schema


@app.command()
def migrate(
    dsn: DsnOpt = None,
    lock_wait: Annotated[
        str, typer.Option("--lock-wait", help="How long to keep trying for a migration's locks (90s, 15m).")
    ] = "10m",
) -> None:
    """Apply the migrations that are missing (under an advisory lock); a second run changes nothing.

    A migration waits at most 2 s at a time for the locks it needs (the queue waits behind it meanwhile),
    then says who holds them and tries again, until --lock-wait has passed."""
    _refuse_if_read_only("migrate")
    try:
        wait = parse_duration(lock_wait)
    except typer.BadParameter as e:
        fail(f"--lock-wait: {e}", 2)
    target = _target(db.configured_dsn(_dsn(dsn)), create=True)
    applied = _migrate_or_exit(target, wait, lock_wait)
    if applied:
        for m in applied:
            typer.echo(f"applied {m.version:04d}_{m.name}")
    else:
        typer.echo("up to date")
    with contextlib.suppress(psycopg.Error), db.connect(target, application_name="qconsole-migrate") as conn:
        _warn_if_newer(conn)


def _migrate_or_exit(target: str, wait: float = 600.0, lock_wait: str = "10m") -> list[Migration]:
    """The migrations applied to ``target``, or exit with what went wrong (`qconsole migrate`, the demo)."""
    try:
        conn = db.connect(target, application_name="qconsole-migrate")
    except psycopg.Error as e:  # unreachable, or a DSN libpq cannot parse (its error quotes it)
        fail(f"cannot connect to {db.redact_dsn(target)}: {db.redact(str(e).strip(), target)}", 3)
    try:
        with conn:
            return run_migrations(conn, lock_wait=wait, on_wait=_say_lock_wait)
    except MigrationFailed as e:
        _migration_failed(e, target, lock_wait)
    except psycopg.OperationalError as e:
        fail(f"lost the database while migrating: {db.redact(str(e).strip(), target)}", 3)
    except RuntimeError as e:  # an applied migration that changed: forward-only
        fail(str(e), 3)
    except REFUSED as e:  # creating worker_core_migrations, before the first migration
        _cannot_migrate("", e, db.redact(str(e).strip(), target))
    except psycopg.Error as e:  # a migration the server refused: it rolled back, nothing of it stays
        fail(f"migration failed, nothing of it was applied: {db.redact(str(e).strip(), target)}", 3)


def _say_lock_wait(mig: Migration, holders: list[LockHolder], retry_in: float) -> None:
    held = "".join(f"\n  {h}" for h in holders) or " sessions gone since"
    if any(h.migration_lock for h in holders):
        typer.echo(
            f"{mig.label} waits for the migration lock, held by another session (migrating, or one that kept it: a"
            f" `qconsole migrate` suspended with Ctrl-Z?):{held}\nstill waiting, said again in {retry_in:.0f} s",
            err=True,
        )
        return
    typer.echo(f"{mig.label} waits for locks on its tables, held by:{held}\ntrying again in {retry_in:.0f} s", err=True)


def _cannot_migrate(label: str, error: psycopg.Error, said: str) -> NoReturn:
    """Refused by the server, exit 1: a read-only one (a replica), or a role that may not change the schema."""
    if isinstance(error, psycopg.errors.ReadOnlySqlTransaction):
        fail(
            f"cannot migrate{label} here: the server (or this session) is read-only, a replica perhaps; run"
            f" `qconsole migrate` on the primary ({said})",
            1,
        )
    fail(f"this role cannot migrate{label}: run it as the schema's owner ({said})", 1)


def _migration_failed(e: MigrationFailed, target: str, lock_wait: str = "10m") -> NoReturn:
    """Which migration failed and why, and those applied before it (committed: they stay)."""
    for m in e.applied:
        typer.echo(f"applied {m.label}")
    error = db.redact(str(e.error).strip(), target)
    before = ", ".join(m.label for m in e.applied) or "none"
    if isinstance(e.error, REFUSED):
        _cannot_migrate(f" {e.migration.label}", e.error, error)
    held = "".join(f"\n  {h}" for h in e.holders) or " sessions gone since"
    if e.migration_lock:
        why = (
            f"migration {e.migration.label} did not get the migration lock within --lock-wait {lock_wait}, nothing"
            f" of it was applied. It was held by:{held}\n"
            "end that session (a `qconsole migrate` suspended with Ctrl-Z?), or run `qconsole migrate` again when"
            " it is done"
        )
    elif isinstance(e.error, psycopg.errors.LockNotAvailable):
        why = (
            f"migration {e.migration.label} did not get its locks within --lock-wait {lock_wait}, nothing of it"
            f" was applied (each try held the queue up 2 s at most). They were held by:{held}\n"
            "end those transactions, or run `qconsole migrate` again when they are done"
        )
    elif isinstance(e.error, psycopg.errors.QueryCanceled):
        why = f"migration {e.migration.label} was cancelled, nothing of it was applied: {error}"
    elif isinstance(e.error, psycopg.OperationalError):
        why = f"lost the database while migrating {e.migration.label}: {error}"
    else:
        why = f"migration {e.migration.label} failed, nothing of it was applied: {error}"
    fail(f"{why}\napplied before it: {before}", 3)


# ------------------------------------------------------------------------------------------------ producing


@app.command()
def enqueue(
    job_type: Annotated[str, typer.Argument(help="e.g. invoice.generate")],
    payload: Annotated[str, typer.Option("--payload", help="A JSON object.")] = "{}",
    queue: Annotated[str | None, typer.Option("--queue")] = None,
    idempotency_key: Annotated[str | None, typer.Option("--idempotency-key")] = None,
    dedup_key: Annotated[str | None, typer.Option("--dedup-key")] = None,
    lock_key: Annotated[str | None, typer.Option("--lock-key")] = None,
    priority: Annotated[int | None, typer.Option("--priority", help="Lower runs first.")] = None,
    delay: Annotated[str | None, typer.Option("--delay", help="Before it may run: seconds, or 90s, 15m, 2h.")] = None,
    scheduled_at: Annotated[
        str | None,
        typer.Option("--scheduled-at", help="When it may run: ISO 8601 with its time zone (2026-12-01T02:00:00Z)."),
    ] = None,
    max_attempts: Annotated[int | None, typer.Option("--max-attempts")] = None,
    timeout: Annotated[str | None, typer.Option("--timeout", help="Execution timeout: seconds, or 90s, 15m.")] = None,
    visibility_timeout: Annotated[
        str | None, typer.Option("--visibility-timeout", help="Lease: seconds, or 90s, 15m.")
    ] = None,
    retry_policy: Annotated[str | None, typer.Option("--retry-policy", help="JSON: backoff, base_seconds...")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant")] = None,
    trace_id: Annotated[str | None, typer.Option("--trace-id")] = None,
    tasks: Annotated[str | None, typer.Option("--tasks", help="Modules whose @task defaults apply.")] = None,
    dsn: DsnOpt = None,
) -> None:
    """Enqueue one job; prints its id, or `duplicate of <id>` when a live job holds the dedup key."""
    from worker_core.producer import enqueue as enqueue_job

    # what the flags' own parsing refuses is listed with what the envelope's validation refuses of the rest: a
    # bad --payload or --scheduled-at exited at once, and hid a --max-attempts 0 given beside it
    problems: list[str] = []
    body, problem = _json_object(payload, "--payload")
    problems += [problem] if body is None else []
    at, problem = _parse_scheduled_at(scheduled_at) if scheduled_at is not None else (None, "")
    problems += [problem] if problem else []
    if problem and delay:  # said by the validation of a time it could read
        problems.append("give --scheduled-at or --delay, not both")
    policy_json, problem = _json_object(retry_policy, "--retry-policy") if retry_policy else (None, "")
    problems += [problem] if problem else []
    delay_s = _seconds("--delay", delay, problems)
    timeout_s = _seconds("--timeout", timeout, problems)
    visibility_s = _seconds("--visibility-timeout", visibility_timeout, problems)
    given = {
        "queue": queue,
        "idempotency_key": idempotency_key,
        "dedup_key": dedup_key,
        "lock_key": lock_key,
        "priority": priority,
        "delay_seconds": delay_s,
        "scheduled_at": at,
        "max_attempts": max_attempts,
        "timeout_seconds": timeout_s,
        "visibility_timeout_seconds": visibility_s,
        "retry_policy": policy_json,
        "tenant_id": tenant,
        "trace_id": trace_id,
    }
    envelope: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if tasks:
        _import_tasks(tasks.split(","))
    # validated by enqueue_job, under the contract the type's workers registered (read from the database),
    # before it writes anything: checked here before connecting, the envelope was judged under the
    # deployment's defaults, and a valid one refused (a lease shorter than the default timeout, say)
    try:
        with connect(dsn) as conn:
            guarded(lambda: _warn_if_unregistered(conn, job_type, queue))  # a database error there: its exit code
            with _without_producer_warnings():  # said above, in the CLI's words (--tasks)
                if problems:
                    _envelope_refused(problems + guarded(lambda: _envelope_problems(conn, job_type, body, envelope)))
                result = _enqueue_told(conn, lambda: enqueue_job(conn, job_type, body, **envelope))
    except typer.Exit as e:
        if problems and e.exit_code == 3:  # the database said why above: bad input all the same, exit 2
            _envelope_refused(problems, "the other fields were not checked: they are judged under the type's"
                                        " contract, which is read from the database")  # fmt: skip
        raise
    typer.echo(str(result.id) if result.created else f"duplicate of {result.id}")


def _envelope_problems(
    conn: db.Conn, job_type: str, payload: dict[str, Any] | None, envelope: dict[str, Any]
) -> list[str]:
    """What the validation refuses of an envelope, as enqueue judges it, writing nothing (a payload the flag
    could not read left out: its own problem is said)."""
    from worker_core.producer import prepare, registered_defaults

    try:
        prepare(job_type, payload or {}, envelope, registered=registered_defaults(conn, [job_type]))
    except EnvelopeError as e:
        return e.problems
    return []


def _envelope_refused(problems: Sequence[str], note: str = "") -> NoReturn:
    lines = "\n".join(f"  - {p}" for p in problems)
    fail(f"invalid job envelope, nothing was written:\n{lines}" + (f"\n  ({note})" if note else ""), 2)


def _parse_scheduled_at(text: str) -> tuple[dt.datetime | None, str]:
    """--scheduled-at: an ISO 8601 time with its zone (a bare local time would be read in this host's zone,
    which a runbook run from another host would get wrong), or None and what is wrong with it (bad input)."""
    try:
        at = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None, f"--scheduled-at: {text!r} is not an ISO 8601 time (2026-12-01T02:00:00Z)"
    if at.tzinfo is None:
        return None, f"--scheduled-at: {text!r} has no time zone: add Z (UTC) or an offset such as +01:00"
    return at, ""


@contextmanager
def _without_producer_warnings() -> Iterator[None]:
    producer_log = logging.getLogger("worker_core.producer")
    quiet = logging.Filter("(none)")  # a filter that passes no record of this logger's
    producer_log.addFilter(quiet)
    try:
        yield
    finally:
        producer_log.removeFilter(quiet)


def _warn_if_unregistered(conn: db.Conn, job_type: str, queue: str | None) -> None:
    """A type no worker has registered yet, and no --tasks: the deployment's defaults apply, not its @task's
    (its queue, its attempts, whether it requires an idempotency key). Said, not refused: a type may be
    enqueued before its workers are deployed, on purpose."""
    from worker_core.producer import registered_defaults
    from worker_core.registry import registry

    if job_type in registry or job_type in registered_defaults(conn, [job_type]):
        return
    where = f"queue {queue!r}" if queue else "queue 'default' (no --queue)"
    typer.echo(
        f"warning: no worker has registered job type {job_type!r} yet and --tasks was not given: the job goes to"
        f" {where} under the deployment's defaults, not its @task's (pass --tasks MODULE, or start a worker of"
        " it first)",
        err=True,
    )


# ------------------------------------------------------------------------------------------------ running


def _stop_on_stdin_eof(supervised: bool) -> None:
    """The console's embedded workers: their standard input is a pipe the console holds and never writes
    to. However the console ends (SIGKILL and the OOM killer included, which run no cleanup), the pipe
    closes, and the worker stops as on a signal: an orphan would go on claiming, out of everyone's reach.
    A worker takes SUPERVISOR_STOP (a graceful stop that never counts as a second signal); a supervisor
    SIGTERM, which it passes on as that."""
    import signal as signal_mod
    import threading

    from worker_core.signals import SUPERVISOR_STOP

    def watch() -> None:
        # the file descriptor, not sys.stdin: a daemon thread inside the buffered reader holds its lock, and
        # the interpreter aborts at exit when it cannot take it
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os.kill(os.getpid(), signal_mod.SIGTERM if supervised else SUPERVISOR_STOP)

    threading.Thread(target=watch, name="stdin-lifeline", daemon=True).start()


def _tell(status_fd: int | None, what: bytes) -> None:
    """The console's embedded workers: ``started`` once its arguments are taken (the worker runs), and
    ``refused`` when the worker refused its configuration after that (a metrics port taken). An exit code 2
    alone is no proof of a refusal: a payload (or a C library) may exit(2), a crash to restart from."""
    if status_fd is not None:
        with contextlib.suppress(OSError):
            os.write(status_fd, what + b"\n")


def _warn_of_new_queues(conn: db.Conn, queues: Sequence[str]) -> None:
    """A --queue no job, worker, pause or registered type names yet: a typo works nothing, silently. Said,
    not refused: a worker may be started before the first job of its queue is enqueued."""
    from worker_core.registry import registry

    own = {t.contract().queue for t in registry}
    for q in dict.fromkeys(queues):
        if q == DEFAULT_QUEUE or q in own:
            continue
        found = conn.execute(queries["queue_known"], {"queue": q}).fetchone()
        if found is not None and not found["known"]:
            typer.echo(
                f"warning: no job, worker, pause or task names queue {q!r} yet: check its spelling (the worker"
                " starts, and works it once jobs come)",
                err=True,
            )


@app.command()
def worker(
    tasks: Annotated[str, typer.Option("--tasks", help="MODULE[,MODULE]: modules with @task handlers.")],
    queue: Annotated[list[str] | None, typer.Option("--queue", help="Queue to work (repeat); default: all.")] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, max=512)] = 4,
    processes: Annotated[int, typer.Option("--processes", min=1, max=128)] = 1,
    burst: Annotated[bool, typer.Option("--burst", help="Exit once nothing is ready or running.")] = False,
    burst_give_up: Annotated[
        str,
        typer.Option(
            "--burst-give-up",
            help="With --burst: exit 3 once claims have failed this long (behind a lock, the database gone).",
        ),
    ] = "2m",
    group: Annotated[
        int,
        typer.Option(
            "--group",
            min=1,
            max=64,
            help="Sync jobs a slot may commit in one transaction, each in its own savepoint (1: one per job).",
        ),
    ] = 32,
    lock_backend: Annotated[
        str | None, typer.Option("--lock-backend", help="postgres (default) or redis://host:port/db")
    ] = None,
    shutdown_grace: Annotated[float, typer.Option("--shutdown-grace", min=0)] = 10.0,
    poll_interval: Annotated[float, typer.Option("--poll-interval", min=0.05)] = 1.0,
    heartbeat: Annotated[
        float, typer.Option("--heartbeat", min=0.1, help="Heartbeat interval, seconds (60 at most).")
    ] = 2.0,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", min=0, max=65535, help="Serve Prometheus metrics (process i: port + i)."),
    ] = None,
    retention_succeeded: Annotated[
        str, typer.Option("--retention-succeeded", help="Prune succeeded jobs older than this (e.g. 24h).")
    ] = "24h",
    retention_failed: Annotated[
        str, typer.Option("--retention-failed", help="Prune failed/dead-lettered/cancelled jobs older than this.")
    ] = "14d",
    retention_metrics: Annotated[
        str, typer.Option("--retention-metrics", help="Prune per-minute counters older than this (1h at least).")
    ] = "90d",
    housekeeping: Annotated[
        bool,
        typer.Option(
            "--housekeeping/--no-housekeeping",
            help="Take part in housekeeping: its winner prunes with its own --retention-* for the whole fleet.",
        ),
    ] = True,
    log_format: Annotated[str, typer.Option("--log-format", help="text or json")] = "text",
    log_level: Annotated[str, typer.Option("--log-level")] = "INFO",
    stop_on_stdin_eof: Annotated[
        bool,
        typer.Option("--stop-on-stdin-eof", hidden=True, help="Stop gracefully once standard input closes."),
    ] = False,
    status_fd: Annotated[
        int | None,
        typer.Option("--status-fd", hidden=True, help="Write started, then refused if so, to this descriptor."),
    ] = None,
    dsn: DsnOpt = None,
) -> None:
    """Run a worker: claim, execute, retry, dead-letter and heal, agreeing with others only through rows."""
    from worker_core.logs import setup_logging
    from worker_core.maintenance import Retention
    from worker_core.supervisor import run_supervised
    from worker_core.worker import EXIT_CONFIG, MAX_HEARTBEAT_INTERVAL_SECONDS, WorkerConfig, run_worker

    if log_format not in ("text", "json"):
        fail("--log-format must be text or json", 2)
    if not isinstance(logging.getLevelName(log_level.upper()), int):
        fail(f"--log-level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, not {log_level!r}", 2)
    if metrics_port and metrics_port + processes - 1 > 65535:  # process i serves port + i
        last = metrics_port + processes - 1
        fail(f"--metrics-port {metrics_port} with --processes {processes}: process {processes - 1} would serve"
             f" port {last}, past 65535", 2)  # fmt: skip
    if heartbeat > MAX_HEARTBEAT_INTERVAL_SECONDS:
        # before anything starts (WorkerConfig refuses it too, with a traceback's words)
        fail(f"--heartbeat {heartbeat:g}: {MAX_HEARTBEAT_INTERVAL_SECONDS:g} s at most: a worker reads as lost only"
             " after three intervals, and its metrics reach the console once an interval", 2)  # fmt: skip
    try:
        give_up = parse_duration(burst_give_up)
    except typer.BadParameter as e:
        fail(f"--burst-give-up: {e}", 2)
    setup_logging(log_format, log_level)
    bad_queue = next((q for q in queue or () if not QUEUE_RE.match(q)), None)
    if bad_queue is not None:
        fail(f"--queue {bad_queue!r} is not a queue name (letters, digits, _ . : -)", 2)
    modules = tuple(m.strip() for m in tasks.split(",") if m.strip())
    _import_tasks(modules)
    with connect(dsn, for_workers=True) as conn:
        # reachable and migrated, by this version, before any process starts; and writable: a worker on a
        # replica or as a role that may only read claimed nothing and said so once a second, for ever
        # (--burst too), and --processes and the console's workers read its end as a crash to restart
        refusal = guarded(lambda: ops.worker_refusal(conn))
        if refusal:
            fail(f"the worker cannot run here: {refusal}", 1)
        _warn_of_new_queues(conn, queue or ())
    try:
        retention = Retention(
            succeeded_seconds=parse_duration(retention_succeeded),
            failed_seconds=parse_duration(retention_failed),
            rollups_seconds=parse_duration(retention_metrics),
        )
    except ValueError as e:
        fail(str(e), 2)
    config = WorkerConfig(
        dsn=db.configured_dsn(_dsn(dsn)),
        task_modules=modules,
        queues=tuple(queue) if queue else None,
        concurrency=concurrency,
        group_max=group,
        burst=burst,
        burst_give_up=give_up,
        lock_backend=lock_backend,
        shutdown_grace=shutdown_grace,
        poll_interval=poll_interval,
        heartbeat_interval=heartbeat,
        metrics_port=metrics_port,
        retention=retention,
        housekeeping=housekeeping,
        check_database=False,  # checked above, with the CLI's own messages and exit codes: not again
    )
    if stop_on_stdin_eof:
        _stop_on_stdin_eof(supervised=processes > 1)
    _tell(status_fd, b"started")
    try:
        code = run_supervised(config, processes, log_format, log_level) if processes > 1 else run_worker(config)
    except ValueError as e:
        _tell(status_fd, b"refused")
        fail(str(e), 2)
    if code == EXIT_CONFIG:
        _tell(status_fd, b"refused")
    _ROOT["worker_ran"] = True  # main() ends the process: see worker_core.supervisor.exit_process
    raise typer.Exit(code)


@app.command()
def metrics(
    port: Annotated[
        int, typer.Option("--port", min=1, max=65535, help="Port of the fleet-wide Prometheus endpoint.")
    ] = 9464,
    addr: Annotated[str, typer.Option("--addr")] = "0.0.0.0",
    dsn: DsnOpt = None,
) -> None:
    """Serve fleet-wide gauges read from the database (lag, counts by state, DLQ and lease rates)."""
    import threading

    from worker_core.prometheus import serve_fleet

    with connect(dsn, read_only=True):
        pass
    try:
        serve_fleet(db.resolve_dsn(_dsn(dsn)), port, addr)
    except (OSError, OverflowError) as e:  # the port is taken or out of range, or the address is not this host's
        fail(f"cannot serve metrics on {addr}:{port}: {getattr(e, 'strerror', None) or e}", 2)
    typer.echo(f"serving fleet metrics on http://{addr}:{port}/metrics")
    threading.Event().wait()


# ------------------------------------------------------------------------------------------------ reading


@app.command()
def jobs(
    state: Annotated[str | None, typer.Option("--state", help="|".join(s.value for s in JobState))] = None,
    job_type: Annotated[str | None, typer.Option("--type")] = None,
    queue: Annotated[str | None, typer.Option("--queue")] = None,
    search: Annotated[str | None, typer.Option("--search", help="Id prefix, key or error text.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10000)] = 50,
    next_first: Annotated[
        bool, typer.Option("--next", help="The waiting jobs in the order workers claim them, the next first.")
    ] = False,
    after: Annotated[
        str | None,
        typer.Option(
            "--after",
            metavar="JOB_ID",
            help="The page after this job in the list's order (the last id of the page before; not with --search).",
        ),
    ] = None,
    as_json: JsonOpt = False,
    dsn: DsnOpt = None,
) -> None:
    """List jobs by state, type and queue, newest activity first (--next: the head of the queue first).

    A full page says how to read the next one: the same command with --after and the last id shown."""
    if state is not None and state not in {s.value for s in JobState}:
        fail(f"unknown state {state!r}: one of {', '.join(s.value for s in JobState)}", 2)
    if next_first and search:
        fail("--next lists the waiting jobs in claim order: not with --search", 2)
    if after is not None and search:
        fail("a search is not paged (--after): its matches are the newest ones; narrow it instead", 2)
    after_id = None
    if after is not None:
        try:
            after_id = uuid.UUID(after)
        except ValueError:
            fail(f"--after {after!r} is not a job id", 2)
    with connect(dsn, read_only=True) as conn:

        def read() -> tuple[list[Job], dt.datetime]:
            anchor = stats.get_job(conn, after_id) if after_id is not None else None
            return stats.list_jobs(
                conn,
                state=state,
                job_type=job_type,
                queue=queue,
                search=search,
                limit=limit,
                next_first=next_first,
                after=anchor,
            ), now_on(conn, SYSTEM_CLOCK)

        rows, now = guarded(read)
    more_after = str(rows[-1].id) if len(rows) >= limit and not search else None
    output.jobs(rows, as_json, more_after=more_after, now=now)


@app.command()
def job(job_id: Annotated[str, typer.Argument()], as_json: JsonOpt = False, dsn: DsnOpt = None) -> None:
    """One job: envelope, payload and every attempt's error; who holds its lock key, the state of its worker."""
    try:
        uuid.UUID(job_id)
    except ValueError:
        fail(f"{job_id!r} is not a job id", 2)  # bad input, as kill and requeue say it (not found: 1)
    with connect(dsn, read_only=True) as conn:
        found = guarded(lambda: stats.get_job(conn, job_id))
        holders = guarded(lambda: stats.job_holders(conn, found))
    output.job(found, holders, as_json)


@app.command("stats")
def stats_cmd(as_json: JsonOpt = False, dsn: DsnOpt = None) -> None:
    """Per queue and job type: counts by state, lag, DLQ rate, lease expirations, retries, throughput.
    The queued column counts every queued job; later, those of them scheduled for later (not due yet)."""
    with connect(dsn, read_only=True) as conn:
        ov = guarded(lambda: stats.overview(conn))
    output.overview(ov, as_json)


@app.command()
def workers(as_json: JsonOpt = False, dsn: DsnOpt = None) -> None:
    """Live workers and their heartbeats."""
    with connect(dsn, read_only=True) as conn:
        rows = guarded(lambda: stats.workers(conn))
    output.workers(rows, as_json)


@app.command("dead-letters")
def dead_letters(
    job_type: Annotated[str | None, typer.Option("--type")] = None,
    state: Annotated[
        list[str] | None,
        typer.Option("--state", help="dead_lettered, failed or retry_scheduled (repeat); default: the first two."),
    ] = None,
    as_json: JsonOpt = False,
    every: Annotated[
        bool, typer.Option("--all", help="Every group and every job id (else the 200 biggest, 1000 ids each).")
    ] = False,
    dsn: DsnOpt = None,
) -> None:
    """Dead letters and failed jobs (what requeue takes), grouped by job type, error fingerprint and state."""
    states = tuple(state or GROUPED_STATES[:2])
    unknown = [s for s in states if s not in GROUPED_STATES]
    if unknown:
        fail(f"unknown state {unknown[0]!r}: one of {', '.join(GROUPED_STATES)}", 2)
    with connect(dsn, read_only=True) as conn:
        limits: dict[str, Any] = {"limit": None, "max_ids": None} if every else {}
        groups = guarded(lambda: stats.dead_letter_groups(conn, job_type=job_type, states=states, **limits))
    output.dead_letter_groups(groups, as_json)
    if as_json:
        _warn_if_subset(groups)


def _warn_if_subset(groups: DeadLetterGroups) -> None:
    """--json is what a script requeues from: a subset of the groups or of a group's ids, said on stderr (the
    JSON keeps its shape, scripts read it)."""
    groups_left = groups.total_groups - len(groups)
    ids_left = sum(max(0, g.count - len(g.job_ids)) for g in groups)
    if groups_left or ids_left:
        left = ([f"{groups_left} group(s)"] if groups_left else []) + (
            [f"{ids_left} job id(s) of the groups listed"] if ids_left else []
        )
        typer.echo(f"warning: this is a subset, left out: {' and '.join(left)}; --all lists every one", err=True)


#: the states dead-letters groups (the console's d screen shows all three)
GROUPED_STATES = ("dead_lettered", "failed", "retry_scheduled")


@app.command()
def audit(
    limit: Annotated[int, typer.Option("--limit", min=1, max=10000)] = 50, as_json: JsonOpt = False, dsn: DsnOpt = None
) -> None:
    """Operator actions: who, from where, what, why."""
    with connect(dsn, read_only=True) as conn:
        rows = guarded(lambda: stats.audit_log(conn, limit))
    output.audit(rows, as_json)


# ------------------------------------------------------------------------------------------------ operating


@app.command()
def requeue(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids (dead_lettered, failed or cancelled).")],
    reason: ReasonOpt = None,
    budget: Annotated[int, typer.Option("--budget", min=1, help="Fresh attempts to give.")] = 1,
    payload: Annotated[
        str | None, typer.Option("--payload", help="Replace the payload (a fix): JSON. One job, or --same-payload.")
    ] = None,
    same_payload: Annotated[
        bool, typer.Option("--same-payload", help="Write --payload into every job named (each loses its own).")
    ] = False,
    dsn: DsnOpt = None,
) -> None:
    """Put jobs back to queued with a fresh budget; the history stays."""
    if payload is not None and not payload.strip():
        # a runbook's "$FIXED" that was never set: the job was requeued with its old payload, exit 0
        fail("--payload is empty (an unset variable?): give the JSON object to write, or leave --payload out", 2)
    if same_payload and payload is None:
        fail("--same-payload writes --payload into every job named: give --payload too", 2)
    new_payload = parse_json_object(payload, "--payload") if payload is not None else None
    with connect(dsn) as conn:
        result = _jobs_action(
            conn, "requeue", job_ids, lambda token: ops.requeue(
                conn, job_ids, reason=reason, budget=budget, payload=new_payload, same_payload=same_payload,
                token=token,
            ),
        )  # fmt: skip
    _say_action(result)


@app.command()
def kill(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids (queued, retry_scheduled or running).")],
    reason: ReasonOpt = None,
    dsn: DsnOpt = None,
) -> None:
    """Cancel jobs; a running one is stopped by its worker within a heartbeat. Never retried."""
    with connect(dsn) as conn:
        result = _jobs_action(conn, "kill", job_ids, lambda token: ops.kill(conn, job_ids, reason=reason, token=token))
    _say_action(result)


@app.command()
def discard(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids (dead_lettered or failed).")],
    reason: ReasonOpt = None,
    dsn: DsnOpt = None,
) -> None:
    """Give up on dead letters: cancelled, off the dead-letter list, never run again (requeue undoes it)."""
    with connect(dsn) as conn:
        result = _jobs_action(
            conn, "discard", job_ids, lambda token: ops.discard(conn, job_ids, reason=reason, token=token)
        )
    _say_action(result)


def _say_action(result: ActionResult | None) -> None:
    """What a requeue, kill or discard did, and its exit code (None: said already, its answer lost)."""
    if result is not None:
        output.action(result)
        _exit_for_skipped(result)


def _exit_for_skipped(result: ActionResult) -> None:
    """Exit 1 (not found or refused) when a job named does not exist, or when nothing changed: a script
    that requeues or kills must not read success from a command that did nothing."""
    if "no such job" in result.why_skipped.values() or (result.skipped and not result.changed):
        raise typer.Exit(1)


UnknownQueueOpt = Annotated[
    bool, typer.Option("--unknown-queue", help="Allow a queue no job, worker or earlier pause names yet.")
]


@app.command()
def pause(
    queue: Annotated[str, typer.Argument()],
    reason: ReasonOpt = None,
    unknown_queue: UnknownQueueOpt = False,
    dsn: DsnOpt = None,
) -> None:
    """Workers stop claiming from QUEUE and give back what they claimed but have not started (running jobs
    finish)."""
    _set_paused(queue, True, reason, unknown_queue, dsn)


@app.command()
def resume(
    queue: Annotated[str, typer.Argument()],
    reason: ReasonOpt = None,
    unknown_queue: UnknownQueueOpt = False,
    dsn: DsnOpt = None,
) -> None:
    """Workers claim from QUEUE again."""
    _set_paused(queue, False, reason, unknown_queue, dsn)


def _set_paused(queue: str, paused: bool, reason: str | None, unknown_queue: bool, dsn: str | None) -> None:
    with connect(dsn) as conn:
        result = _audited_action(
            conn, "pause" if paused else "resume",
            lambda token: ops.set_paused(conn, queue, paused, reason=reason, allow_unknown=unknown_queue, token=token),
            "`qconsole stats` shows whether the queue is paused",
        )  # fmt: skip
    output.action(result, queue)


@app.command()
def policies(
    tasks: Annotated[
        str | None, typer.Option("--tasks", help="MODULE[,MODULE]: show these @task types as this process sees them.")
    ] = None,
    as_json: JsonOpt = False,
    dsn: DsnOpt = None,
) -> None:
    """The effective contract of each job type, and where each value comes from (default, queue, type).

    Without --tasks: as the running workers registered it (read from the database)."""
    from worker_core import policy
    from worker_core.registry import registry

    _load_policy()
    deployment = policy.current()
    if tasks:
        _import_tasks(tasks.split(","))  # exit 2 for a module that does not import, or an @task refused
    queues = {q: {"values": layer.values, "reason": layer.reason} for q, layer in deployment.queues.items()}
    if tasks:
        output.policies([t.contract() for t in registry], as_json, deployment.source, queues)
        return
    from worker_core.producer import registered_policy

    with connect(dsn, read_only=True) as conn:
        contracts = guarded(lambda: stats.type_contracts(conn))
        # the deployment's defaults and queue layers the workers registered: what a producer without a policy
        # file of its own enqueues under (a queue no type of it names showed nowhere)
        found = guarded(lambda: registered_policy(conn))
    source = found.source if found else "the workers' registrations (no worker has registered its policy yet)"
    layers = found.queues if found else {}
    queues = {q: {"values": layer.values, "reason": layer.reason} for q, layer in layers.items()}
    output.policies(contracts, as_json, source, queues)


@app.command()
def limit(
    job_type: Annotated[str, typer.Argument()],
    max_running: Annotated[int | None, typer.Argument(help="At most this many run at once (0 holds them).")] = None,
    queue: Annotated[
        str, typer.Option("--queue", help="Only in this queue ('*': all its queues together; both limits apply).")
    ] = "*",
    clear: Annotated[bool, typer.Option("--clear", help="Remove the limit.")] = False,
    unknown_type: Annotated[
        bool, typer.Option("--unknown-type", help="Allow a type no worker runs yet and no job has.")
    ] = False,
    unknown_queue: UnknownQueueOpt = False,
    reason: ReasonOpt = None,
    dsn: DsnOpt = None,
) -> None:
    """Set (or --clear) a fleet-wide concurrency limit for a job type; with no number, list the limits."""
    if clear and max_running is not None:
        # `limit T 5 --clear` (a stray --clear) removed the limit, and said so, instead of setting it to 5
        fail(f"--clear removes the limit: give {max_running} or --clear, not both (nothing changed)", 2)
    with connect(dsn, read_only=max_running is None and not clear) as conn:
        if clear:
            _audited_action(
                conn, "unlimit", lambda token: ops.clear_limit(conn, job_type, queue=queue, reason=reason, token=token),
                f"`qconsole limit {job_type}` lists its limits",
            )  # fmt: skip
            typer.echo(f"cleared the limit of {job_type} in {queue}")
        elif max_running is None:
            rows = [row for row in guarded(lambda: stats.limits(conn)) if row["job_type"] == job_type]
            for row in rows:
                typer.echo(f"{row['job_type']} {row['queue']} {row['max_running']} ({row['source']})")
            if not rows:
                # it printed nothing, exit 0, for a type without a limit and for a misspelt one alike
                known = guarded(lambda: conn.execute(queries["job_type_known"], {"job_type": job_type}).fetchone())
                if not (known and known["known"]):
                    fail(f"no worker has registered job type {job_type!r} and no job has it: check its spelling", 1)
                typer.echo(f"no limit on {job_type}")
        else:
            n, allow, allow_queue = max_running, unknown_type, unknown_queue
            _audited_action(
                conn, "limit", lambda token: ops.set_limit(
                    conn, job_type, n, queue=queue, reason=reason, allow_unknown=allow, allow_unknown_queue=allow_queue,
                    token=token,
                ), f"`qconsole limit {job_type}` lists its limits",
            )  # fmt: skip
            typer.echo(f"{job_type} in {queue}: at most {max_running} running")


def _undecodable_argument(argv: Sequence[str]) -> str | None:
    """The first argument that is not UTF-8 text (Python keeps its bytes as surrogates): an error at the
    first write, "'utf-8' codec can't encode character '\\udcff' in position 19", said nothing of which."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return None


def main() -> None:
    bad = _undecodable_argument(sys.argv[1:])
    if bad is not None:
        print(f"error: an argument is not UTF-8 text, nothing was done: {bad}", file=sys.stderr)
        sys.exit(2)
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit as e:
        if _ROOT.get("worker_ran"):
            # a worker that ran and stopped: a thread a handler left blocking (asyncio.to_thread) is not
            # waited for, the interpreter's exit would join it unbounded
            from worker_core.supervisor import exit_process

            exit_process(e.code if isinstance(e.code, int) else 1)
        raise


if __name__ == "__main__":
    main()
