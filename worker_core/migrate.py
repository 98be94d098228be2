"""Forward-only migrations: ``NNNN_name.sql`` applied in order, each in its own transaction, recorded in
``worker_core_migrations``, all under one advisory lock so two processes never migrate at once."""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

import psycopg
from psycopg import sql

from worker_core.db import Conn

MIGRATION_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
#: the advisory lock's key: "qconsole" in ASCII, as a bigint
LOCK_KEY = 0x71636F6E736F6C

#: Checksums of earlier forms of a migration, accepted as applied. 0009 was edited in place (commits
#: 7a7871b, d4f85ae and 8374408), then put back to a form of its own (7783b20): a database that applied an
#: earlier form failed the checksum for ever, and its workers refused to start. Each of those forms drops
#: job_queue_updated_idx and builds job_queue_waiting_updated_idx, which 0010 drops and builds again in its
#: final form, so the schema after 0010 is the same whichever form ran. A form is added here only when
#: what it did is undone or redone by a later migration.
EARLIER_CHECKSUMS: dict[int, frozenset[str]] = {
    9: frozenset({
        "69c9b07905a7dff02dfe11cf9a461ddad7e79b8870ee6c97b5998d99be857b73",  # 7a7871b
        "8a617e12e55fd36b6b9344e3493e9d2b955f26b689e9924022b36a91baea4807",  # d4f85ae
        "8fa871a4ba1b1c61d028dc2e174c2ddbe3f795068bac16adaa8a7ca013391c88",  # 8374408
    }),
}  # fmt: skip


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    def matches(self, applied_checksum: str) -> bool:
        """Whether what a database applied under this version is this file (or an accepted earlier form)."""
        return applied_checksum == self.checksum or applied_checksum in EARLIER_CHECKSUMS.get(self.version, ())


class MigrationFailed(Exception):
    """A migration the server refused, or could not finish: it rolled back, nothing of it stays. ``applied``:
    those this run applied before it, each committed by itself (none inside a transaction of the caller's,
    which undid them with it); ``error``: the server's error, also the ``__cause__``."""

    def __init__(self, migration: Migration, applied: list[Migration], error: psycopg.Error) -> None:
        super().__init__(f"{migration.label}: {str(error).strip()}")
        self.migration = migration
        self.applied = applied
        self.error = error
        #: when it never got its locks (error: LockNotAvailable), the sessions that held them last
        self.holders: list[LockHolder] = []
        #: the lock it never got was the migration lock (another session migrating, or one that kept it), not
        #: a lock on a table
        self.migration_lock = False


def migrations_dir() -> Traversable:
    """Inside the wheel the files live at worker_core/migrations; in a checkout, at the top-level migrations/."""
    packaged = resources.files("worker_core").joinpath("migrations")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "migrations"


def load_migrations(folder: Traversable | None = None) -> list[Migration]:
    folder = folder or migrations_dir()
    found = []
    for entry in folder.iterdir():
        m = MIGRATION_RE.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"two migrations share a version number: {versions}")
    return found


def applied_versions(conn: Conn) -> dict[int, str]:
    if not _record_exists(conn):
        return {}
    return {r["version"]: r["checksum"] for r in conn.execute("SELECT version, checksum FROM worker_core_migrations")}


@dataclass(frozen=True)
class LockHolder:
    """A session holding a lock on a table a migration needs: what it is doing, and since when."""

    pid: int
    state: str | None
    transaction_seconds: float | None  #: how long its transaction has been open
    query: str | None  #: the start of its last statement
    #: it holds the migration lock (it migrates, or kept the lock: a `qconsole migrate` suspended with Ctrl-Z),
    #: not a lock on a table
    migration_lock: bool = False

    def __str__(self) -> str:
        since = f", its transaction open {self.transaction_seconds:.0f} s" if self.transaction_seconds else ""
        return f"pid {self.pid} ({self.state or 'unknown'}{since}): {self.query or ''}".rstrip(": ")


OnWait = Callable[[Migration, list[LockHolder], float], None]
log = logging.getLogger(__name__)


def _log_wait(mig: Migration, holders: list[LockHolder], retry_in: float) -> None:
    held = "; ".join(map(str, holders)) or "sessions gone since"
    if any(h.migration_lock for h in holders):
        log.warning("migration %s waits for the migration lock, held by %s; said again in %.0f s", mig.label, held,
                    retry_in)  # fmt: skip
    else:
        log.warning("migration %s waits for locks held by %s; trying again in %.0f s", mig.label, held, retry_in)


class _Waiter:
    """Between the tries of a migration that did not get its locks within lock_timeout: who holds them (said
    through on_wait), then a wait that doubles, up to 15 s, until the deadline (then MigrationFailed)."""

    def __init__(self, lock_wait: float, lock_timeout: float, on_wait: OnWait | None) -> None:
        self.deadline = time.monotonic() + lock_wait
        self.lock_timeout = lock_timeout
        self.on_wait = on_wait or _log_wait
        self.tries = 0

    def settings(self, conn: Conn) -> None:
        """For this transaction: no statement timeout (a role's cancelled a long index build halfway), and
        a lock timeout: waiting for a lock behind a long transaction (a pg_dump, a producer's), the
        migration had every claim, settlement and enqueue wait behind it for as long."""
        timeout = max(0.05, min(self.lock_timeout, self.deadline - time.monotonic()))
        conn.execute(
            "SELECT set_config('statement_timeout', '0', true), set_config('lock_timeout', %s, true)",
            (f"{int(timeout * 1000)}ms",),
        )

    def wait(self, conn: Conn, failed: MigrationFailed) -> None:
        """Return after the wait, or raise ``failed`` (the holders said) when it is not a lock timeout or the
        deadline has come."""
        if not isinstance(failed.error, psycopg.errors.LockNotAvailable) or conn.broken or conn.closed:
            raise failed
        failed.holders = lock_holders(conn, failed.migration)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise failed
        retry_in = min(2.0**self.tries, 15.0, left)
        self.tries += 1
        self.on_wait(failed.migration, failed.holders, retry_in)
        time.sleep(retry_in)

    def wait_for_migration_lock(self, conn: Conn, mig: Migration) -> float:
        """Say who holds the migration lock, and return how long to wait for it before saying so again; or
        raise MigrationFailed (LockNotAvailable, ``migration_lock``) when the deadline has come."""
        holders = migration_lock_holders(conn)
        left = self.deadline - time.monotonic()
        if left <= 0:
            error = psycopg.errors.LockNotAvailable("another session holds the migration lock")
            failed = MigrationFailed(mig, [], error)
            failed.__cause__ = error
            failed.holders = holders
            failed.migration_lock = True
            raise failed
        wait = min(2.0**self.tries, 15.0, left)
        self.tries += 1
        self.on_wait(mig, holders, wait)
        return wait

    def done(self) -> None:
        self.tries = 0  # the next migration starts its own backoff


def migrate(
    conn: Conn,
    folder: Traversable | None = None,
    *,
    lock_wait: float = 600.0,
    lock_timeout: float = 2.0,
    on_wait: OnWait | None = None,
) -> list[Migration]:
    """Apply what is missing; return what was applied. A second run applies nothing, and writes nothing.

    Each migration commits by itself, under a session advisory lock held for the whole run (two processes
    never migrate at once, and one applies everything). In one transaction, a late migration that failed
    undid the earlier ones, and the ACCESS EXCLUSIVE locks of the first (0009-0011 drop and build indexes of
    job_queue) were held until the last committed: every claim and every console read waited for all of
    them. Inside a transaction of the caller's, everything goes in it (each migration in a savepoint).

    A migration waits at most ``lock_timeout`` seconds for its locks: queued behind a long transaction that
    read job_queue, it had every claim, settlement and enqueue queue behind it for as long. It gives up,
    tells ``on_wait`` (the migration, who holds the locks, the seconds before the next try; by default a
    warning logged), waits, and tries again until ``lock_wait`` seconds have passed. No statement timeout
    holds (a role's, or the DSN's, cancelled a long index build halfway). The migration lock is waited for
    under the same ``lock_wait``, who holds it told to ``on_wait`` (holders whose ``migration_lock`` is set).
    A migration that fails, or never got its locks (or the migration lock), raises MigrationFailed."""
    pending = load_migrations(folder)
    waiter = _Waiter(lock_wait, lock_timeout, on_wait)
    if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        with conn.transaction():
            old = conn.execute(
                "SELECT current_setting('statement_timeout') AS s, current_setting('lock_timeout') AS l"
            ).fetchone()
            conn.execute("SELECT set_config('statement_timeout', '0', true), set_config('lock_timeout', '0', true)")
            _take_migration_lock(conn, pending, waiter, xact=True)  # nothing missing any more: _apply does nothing
            try:
                in_callers = _apply(conn, pending, everything=True, waiter=waiter)
            except MigrationFailed as e:
                e.applied = []  # undone with the caller's transaction (to this savepoint)
                raise
            if old:
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, true), set_config('lock_timeout', %s, true)",
                    (old["s"], old["l"]),
                )
            return in_callers
    with conn.transaction():
        if not _missing(conn, pending):
            return []  # nothing written: a role that may not create, or a replica, is told it is up to date
    if not _take_migration_lock(conn, pending, waiter, xact=False):
        return []  # the session that held the lock applied them all
    applied: list[Migration] = []
    try:
        while True:
            try:
                with conn.transaction():
                    # before any statement takes a snapshot: under a repeatable-read default, the snapshot of
                    # a process that waited for the lock would predate the migrations the holder applied, and
                    # it would apply them again ("already exists")
                    conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    waiter.settings(conn)
                    step = _apply(conn, pending, everything=False)
            except MigrationFailed as e:
                e.applied = applied
                waiter.wait(conn, e)  # out of the transaction: it holds no lock while it waits
                continue
            if not step:
                return applied
            applied += step
            waiter.done()
    finally:
        if not conn.broken and not conn.closed:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))


def _take_migration_lock(conn: Conn, pending: list[Migration], waiter: _Waiter, *, xact: bool) -> bool:
    """The migration lock: a session lock (it outlives the commits of the migrations), or with ``xact`` one of
    the caller's transaction. Waiting for it holds nobody up, but it is waited for under the waiter's deadline
    (--lock-wait), who holds it said through on_wait: a migrate behind another was silent for as long as that
    one waited, and behind a session that kept the lock (a migrate suspended with Ctrl-Z) it hung for ever,
    silently. Tried at once, then waited for in the lock's queue (taken as soon as it is released) for a
    while that doubles up to 15 s, each wait said. False, nothing taken, when nothing is missing any more
    (the holder applied it all)."""
    kind = "xact_lock" if xact else "lock"
    wait = 0.0
    while True:
        try:
            with conn.transaction():  # a savepoint inside the caller's transaction: a lock timeout undoes it only
                timeout = f"{max(1, int(wait * 1000))}ms"
                conn.execute(
                    "SELECT set_config('statement_timeout', '0', true), set_config('lock_timeout', %s, true)",
                    (timeout,),
                )
                if wait:
                    conn.execute(f"SELECT pg_advisory_{kind}(%s)", (LOCK_KEY,))  # kind: a constant
                    taken = True
                else:
                    row = conn.execute(f"SELECT pg_try_advisory_{kind}(%s) AS taken", (LOCK_KEY,)).fetchone()
                    taken = bool(row and row["taken"])
        except psycopg.errors.LockNotAvailable:
            taken = False
        if taken:
            waiter.done()
            return True
        with conn.transaction():
            missing = _missing(conn, pending)
        if not missing:
            return False
        wait = waiter.wait_for_migration_lock(conn, missing[0])


def migration_lock_holders(conn: Conn) -> list[LockHolder]:
    """The session holding the migration lock in this database (another process's ``migrate``)."""
    with conn.transaction():
        rows = conn.execute(
            """SELECT a.pid, a.state, extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS seconds,
                      left(regexp_replace(a.query, '[[:space:]]+', ' ', 'g'), 80) AS query
               FROM pg_stat_activity a
               WHERE a.pid <> pg_backend_pid() AND a.pid IN (
                   SELECT l.pid FROM pg_locks l
                   WHERE l.locktype = 'advisory' AND l.granted AND l.classid::int8 = %s AND l.objid::int8 = %s
                     AND l.objsubid = 1
                     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))
               ORDER BY a.pid""",
            (LOCK_KEY >> 32, LOCK_KEY & 0xFFFFFFFF),
        ).fetchall()
    return [LockHolder(r["pid"], r["state"], r["seconds"], r["query"], migration_lock=True) for r in rows]


def _apply(
    conn: Conn, pending: list[Migration], *, everything: bool, waiter: _Waiter | None = None
) -> list[Migration]:
    """The missing migrations (or only the first of them), under the migration lock. With a waiter, one
    that did not get its locks is tried again in its savepoint."""
    missing = _missing(conn, pending)
    if missing and not _record_exists(conn):
        # only when there is none: PostgreSQL checks the privilege to create before whether the table
        # exists, and CREATE TABLE IF NOT EXISTS failed for a role that may not create
        conn.execute(
            """CREATE TABLE worker_core_migrations (
                   version integer PRIMARY KEY,
                   name text NOT NULL,
                   checksum text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
    applied: list[Migration] = []
    for mig in missing:
        while True:
            try:
                with conn.transaction():
                    if waiter:
                        waiter.settings(conn)
                    conn.execute(sql.SQL(mig.sql))  # trusted file shipped with the package
                    conn.execute(
                        "INSERT INTO worker_core_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                        (mig.version, mig.name, mig.checksum),
                    )
            except psycopg.Error as e:
                failed = MigrationFailed(mig, applied, e)
                failed.__cause__ = e
                if waiter is None:
                    raise failed from e
                waiter.wait(conn, failed)
                continue
            break
        applied.append(mig)
        if waiter:
            waiter.done()
        if not everything:
            break
    return applied


def lock_holders(conn: Conn, mig: Migration) -> list[LockHolder]:
    """The sessions holding a lock on a table ``mig`` names (or on an index's table), the oldest transaction
    first: the one to wait for, or to end."""
    words = sorted(set(re.findall(r"[a-z_][a-z0-9_$]*", re.sub(r"--[^\n]*", "", mig.sql.lower()))))
    with conn.transaction():
        rows = conn.execute(
            """WITH named AS (
                   SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE c.relname = ANY(%s) AND n.nspname = ANY(current_schemas(false))),
               tables AS (
                   SELECT oid FROM named
                   UNION SELECT i.indrelid FROM pg_index i JOIN named ON named.oid = i.indexrelid)
               SELECT a.pid, a.state, extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS seconds,
                      left(regexp_replace(a.query, '[[:space:]]+', ' ', 'g'), 80) AS query
               FROM pg_stat_activity a
               WHERE a.pid <> pg_backend_pid() AND a.pid IN (
                   SELECT l.pid FROM pg_locks l WHERE l.granted AND l.relation IN (SELECT oid FROM tables))
               ORDER BY a.xact_start NULLS LAST, a.pid
               LIMIT 5""",
            (words,),
        ).fetchall()
    return [LockHolder(r["pid"], r["state"], r["seconds"], r["query"]) for r in rows]


def _record_exists(conn: Conn) -> bool:
    row = conn.execute("SELECT to_regclass('worker_core_migrations') AS t").fetchone()
    return bool(row and row["t"] is not None)


def _missing(conn: Conn, migrations: list[Migration]) -> list[Migration]:
    """Those not applied yet; an applied one whose file changed is refused (RuntimeError)."""
    done = applied_versions(conn)
    for mig in migrations:
        if mig.version in done and not mig.matches(done[mig.version]):
            raise RuntimeError(
                f"migration {mig.label} changed after it was applied; "
                "migrations are forward-only: add a new one instead"
            )
    return [m for m in migrations if m.version not in done]


def pending_migrations(conn: Conn) -> list[Migration]:
    done = applied_versions(conn)
    return [m for m in load_migrations() if m.version not in done]


def changed_migrations(conn: Conn) -> list[Migration]:
    """Applied migrations whose file differs from what was applied (this code is not the schema's)."""
    done = applied_versions(conn)
    return [m for m in load_migrations() if m.version in done and not m.matches(done[m.version])]


def unknown_migrations(conn: Conn) -> list[int]:
    """Versions applied to this database that this code does not have: a newer version migrated it."""
    known = {m.version for m in load_migrations()}
    return sorted(v for v in applied_versions(conn) if v not in known)
