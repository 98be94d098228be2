"""Forward-only migrations: ``NNNN_name.sql`` applied in order, each in its own transaction, recorded in
``worker_core_migrations``, all under one advisory lock so two processes never migrate at once."""

from __future__ import annotations

import hashlib
import re
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


def migrate(conn: Conn, folder: Traversable | None = None) -> list[Migration]:
    """Apply what is missing; return what was applied. A second run applies nothing.

    Each migration commits by itself, under a session advisory lock held for the whole run (two processes
    never migrate at once, and one applies everything). In one transaction, a late migration that failed
    undid the earlier ones, and the ACCESS EXCLUSIVE locks of the first (0009-0011 drop and build indexes of
    job_queue) were held until the last committed: every claim and every console read waited for all of
    them. Inside a transaction of the caller's, everything goes in it (each migration in a savepoint).

    No statement timeout holds while migrating (a role's, or the DSN's, cancelled a long index build
    halfway). A migration that fails raises MigrationFailed."""
    pending = load_migrations(folder)
    if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        with conn.transaction():
            old = conn.execute("SELECT current_setting('statement_timeout') AS t").fetchone()
            conn.execute("SELECT set_config('statement_timeout', '0', true)")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            try:
                in_callers = _apply(conn, pending, everything=True)
            except MigrationFailed as e:
                e.applied = []  # undone with the caller's transaction (to this savepoint)
                raise
            conn.execute("SELECT set_config('statement_timeout', %s, true)", (old["t"] if old else "0",))
            return in_callers
    with conn.transaction():
        if not _missing(conn, pending):
            return []  # nothing written: a role that may not create, or a replica, is told it is up to date
    with conn.transaction():
        conn.execute("SET LOCAL statement_timeout = 0")  # waiting for another process's migrations
        conn.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))  # a session lock: it outlives this commit
    applied: list[Migration] = []
    try:
        while True:
            try:
                with conn.transaction():
                    # before any statement takes a snapshot: under a repeatable-read default, the snapshot of
                    # a process that waited for the lock would predate the migrations the holder applied, and
                    # it would apply them again ("already exists")
                    conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    conn.execute("SET LOCAL statement_timeout = 0")
                    step = _apply(conn, pending, everything=False)
            except MigrationFailed as e:
                e.applied = applied
                raise
            if not step:
                return applied
            applied += step
    finally:
        if not conn.broken and not conn.closed:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))


def _apply(conn: Conn, pending: list[Migration], *, everything: bool) -> list[Migration]:
    """The missing migrations (or only the first of them), under the migration lock."""
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
        try:
            with conn.transaction():
                conn.execute(sql.SQL(mig.sql))  # trusted file shipped with the package
                conn.execute(
                    "INSERT INTO worker_core_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                    (mig.version, mig.name, mig.checksum),
                )
        except psycopg.Error as e:
            raise MigrationFailed(mig, applied, e) from e
        applied.append(mig)
        if not everything:
            break
    return applied


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
