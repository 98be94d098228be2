"""Migrations: from zero, again (nothing changes), refused when an applied file changed, safe when two
processes migrate at once, and shipped inside the wheel."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.worker_core.helpers import ROOT, subprocess_env
from worker_core import db
from worker_core.migrate import (
    MigrationFailed,
    changed_migrations,
    load_migrations,
    migrate,
    migrations_dir,
    pending_migrations,
)

REPO_MIGRATIONS = ROOT / "migrations"

JOB_QUEUE_COLUMNS = {
    "id", "job_type", "queue", "payload", "state", "priority", "attempts", "max_attempts", "scheduled_at",
    "locked_until", "locked_by", "idempotency_key", "dedup_key", "lock_key", "timeout_seconds",
    "visibility_timeout_seconds", "retry_policy", "tenant_id", "trace_id", "last_error", "errors",
    "created_at", "started_at", "finished_at", "updated_at",
}  # fmt: skip
STATES = ("queued", "running", "retry_scheduled", "succeeded", "failed", "dead_lettered", "cancelled")


def schema_dump(conn: db.Conn) -> dict[str, list[Any]]:
    """Everything a migration could change: columns, indexes, constraints, triggers, functions, the record."""
    q = {
        "columns": """SELECT table_name, column_name, data_type, column_default, is_nullable
                      FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 2""",
        "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1",
        "constraints": """SELECT conrelid::regclass::text AS tbl, conname, pg_get_constraintdef(oid) AS def
                          FROM pg_constraint WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2""",
        "triggers": "SELECT tgname, pg_get_triggerdef(oid) AS def FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1",
        "functions": """SELECT proname, md5(prosrc) AS src FROM pg_proc
                        WHERE pronamespace = 'public'::regnamespace ORDER BY 1""",
        "comments": """SELECT c.relname, d.description FROM pg_description d JOIN pg_class c ON c.oid = d.objoid
                       WHERE c.relnamespace = 'public'::regnamespace ORDER BY 1, 2""",
        "record": "SELECT version, name, checksum, applied_at FROM worker_core_migrations ORDER BY version",
    }
    return {name: conn.execute(sql).fetchall() for name, sql in q.items()}  # type: ignore[arg-type]


def test_from_zero_applies_every_file_and_builds_the_contract(empty_dsn: str) -> None:
    files = sorted(p.name for p in REPO_MIGRATIONS.glob("*.sql"))
    assert files, "no migration files"
    with db.connect(empty_dsn) as conn:
        assert [f"{m.version:04d}_{m.name}.sql" for m in pending_migrations(conn)] == files
        applied = migrate(conn)
        conn.commit()  # inside the caller's transaction, migrate() commits with it
        assert [f"{m.version:04d}_{m.name}.sql" for m in applied] == files
        record = conn.execute("SELECT version, name, checksum FROM worker_core_migrations ORDER BY version").fetchall()
        assert [(r["version"], r["name"], r["checksum"]) for r in record] == [
            (m.version, m.name, m.checksum) for m in load_migrations()
        ]
        assert pending_migrations(conn) == []

        cols = {r["column_name"] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'job_queue'")}  # fmt: skip
        assert cols >= JOB_QUEUE_COLUMNS
        tables = {r["t"] for r in conn.execute("SELECT tablename AS t FROM pg_tables WHERE schemaname = 'public'")}
        assert {"job_queue", "processed_keys", "queues", "audit_log", "worker_core_migrations"} <= tables
        # the states of DESIGN.md, and nothing else
        for s in STATES:
            conn.execute("SAVEPOINT s")
            conn.execute("INSERT INTO job_queue (job_type, state) VALUES ('t.ok', %s)", (s,))
            conn.execute("ROLLBACK TO SAVEPOINT s")
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO job_queue (job_type, state) VALUES ('t.ok', 'paused')")
        conn.rollback()
        indexes = {r["indexname"]: r["indexdef"] for r in conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'job_queue'")}  # fmt: skip
        dedup = [d for d in indexes.values() if "UNIQUE" in d and "dedup_key" in d]
        assert dedup and "WHERE" in dedup[0], "dedup_key needs a partial unique index among live jobs"
        assert any("WHERE" in d and "'queued'" in d and "priority" in d for d in indexes.values())
        trig = conn.execute("SELECT count(*) AS n FROM pg_trigger WHERE tgname = 'job_queue_notify_insert'")
        assert trig.fetchone() == {"n": 1}


def test_second_run_applies_nothing_and_changes_nothing(empty_dsn: str) -> None:
    with db.connect(empty_dsn) as conn:
        assert migrate(conn)
        before = schema_dump(conn)
        conn.commit()
    with db.connect(empty_dsn) as conn:
        assert migrate(conn) == []
        conn.commit()
        assert schema_dump(conn) == before


def test_an_applied_migration_that_changed_is_refused(empty_dsn: str, tmp_path: Path) -> None:
    folder = tmp_path / "migrations"
    shutil.copytree(REPO_MIGRATIONS, folder)
    with db.connect(empty_dsn) as conn:
        migrate(conn, folder)
        before = schema_dump(conn)
        first = sorted(folder.glob("*.sql"))[0]
        first.write_text(first.read_text() + "\nCREATE TABLE sneaky (id int);\n")
        with pytest.raises(RuntimeError, match="changed after it was applied"):
            migrate(conn, folder)
        conn.rollback()
        assert schema_dump(conn) == before


OLD_FORMS = sorted((Path(__file__).parent / "old_migrations").glob("*.sql"))


@pytest.mark.parametrize("old", OLD_FORMS, ids=[p.name.split(".")[1] for p in OLD_FORMS])
def test_a_database_migrated_by_an_earlier_form_of_0009_is_upgraded(empty_dsn: str, tmp_path: Path, old: Path) -> None:
    # 0009 was edited in place (commits 7a7871b, d4f85ae, 8374408), then put back to a form of its own:
    # a database that applied one of the earlier forms failed the checksum for ever (exit 3, workers
    # refused to start). The old code applied the file of its day and recorded that file's checksum.
    folder = tmp_path / "migrations"
    folder.mkdir()
    for f in REPO_MIGRATIONS.glob("*.sql"):
        if int(f.name[:4]) < 9:
            shutil.copy(f, folder / f.name)
    shutil.copy(old, folder / "0009_waiting_activity_index.sql")
    with db.connect(empty_dsn) as conn:
        assert [m.version for m in migrate(conn, folder)][-1] == 9
        assert changed_migrations(conn) == []  # commands said it differed; workers refused to start
        applied = migrate(conn)
        assert [m.version for m in applied] == [m.version for m in load_migrations() if m.version > 9]
        assert changed_migrations(conn) == [] and pending_migrations(conn) == []
        index = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'job_queue_waiting_updated_idx'"
        ).fetchone()
        assert index is not None and "updated_at DESC, id" in index["indexdef"]  # 0010 rebuilt it
        conn.commit()


def test_a_new_file_is_applied_forward_and_a_failing_one_leaves_no_trace(empty_dsn: str, tmp_path: Path) -> None:
    folder = tmp_path / "migrations"
    shutil.copytree(REPO_MIGRATIONS, folder)
    with db.connect(empty_dsn) as conn:
        migrate(conn, folder)
        (folder / "9001_extra.sql").write_text("CREATE TABLE extra_thing (id int);\n")
        assert [m.version for m in migrate(conn, folder)] == [9001]
        (folder / "9002_broken.sql").write_text("CREATE TABLE half_done (id int);\nSELECT 1/0;\n")
        with pytest.raises(MigrationFailed) as failed:
            migrate(conn, folder)
        assert isinstance(failed.value.error, psycopg.errors.DivisionByZero)
        assert failed.value.migration.version == 9002 and failed.value.applied == []
        conn.rollback()
        assert conn.execute("SELECT to_regclass('half_done') AS t").fetchone() == {"t": None}
        assert conn.execute("SELECT max(version) AS v FROM worker_core_migrations").fetchone() == {"v": 9001}


def test_each_migration_commits_by_itself(empty_dsn: str, tmp_path: Path) -> None:
    # all in one transaction, a late failure undid the earlier ones, and the first's table locks were held
    # until the last committed (every claim and console read waited for the whole upgrade)
    folder = tmp_path / "migrations"
    shutil.copytree(REPO_MIGRATIONS, folder)
    with db.connect(empty_dsn) as conn:
        migrate(conn, folder)
        (folder / "9001_extra.sql").write_text("CREATE TABLE extra_thing (id int);\n")
        (folder / "9002_broken.sql").write_text("SELECT 1/0;\n")
        with pytest.raises(MigrationFailed) as failed:
            migrate(conn, folder)
        assert isinstance(failed.value.error, psycopg.errors.DivisionByZero)
        assert [m.version for m in failed.value.applied] == [9001]  # committed before it failed
        assert conn.execute("SELECT max(version) AS v FROM worker_core_migrations").fetchone() == {"v": 9001}
        conn.rollback()
        locks = "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        assert conn.execute(locks).fetchone() == {"n": 0}  # the migration lock went with the failure


@pytest.mark.parametrize("in_callers_transaction", [False, True], ids=["own", "callers"])
def test_a_statement_timeout_of_the_role_does_not_cancel_a_migration(
    empty_dsn: str, tmp_path: Path, in_callers_transaction: bool
) -> None:
    # a role's statement_timeout (ALTER ROLE ... SET, or the DSN's options) cancelled a long index build
    # halfway, and migrate said it had lost the database
    folder = tmp_path / "migrations"
    shutil.copytree(REPO_MIGRATIONS, folder)
    (folder / "9001_slow.sql").write_text("SELECT pg_sleep(0.5);\n")
    dsn = psycopg.conninfo.make_conninfo(empty_dsn, options="-c statement_timeout=100")
    with db.connect(dsn) as conn:
        if in_callers_transaction:
            conn.execute("SELECT 1")
        assert [m.version for m in migrate(conn, folder)][-1] == 9001
        conn.commit()
        assert conn.execute("SHOW statement_timeout").fetchone() == {"statement_timeout": "100ms"}  # as it was


def test_a_migration_waits_for_its_locks_without_holding_the_queue_up(dsn: str, tmp_path: Path) -> None:
    # queued for its lock behind a transaction that read job_queue (a pg_dump, a producer's), the migration
    # had every claim, settlement and enqueue queue behind it for as long as that transaction lasted
    folder = tmp_path / "migrations"
    shutil.copytree(REPO_MIGRATIONS, folder)
    (folder / "9001_column.sql").write_text("ALTER TABLE job_queue ADD COLUMN extra int;\n")
    waits: list[tuple[str, list[int]]] = []
    waited = threading.Event()
    outcome: list[Any] = []

    def on_wait(mig: Any, holders: list[Any], retry_in: float) -> None:
        waits.append((mig.label, [h.pid for h in holders]))
        waited.set()

    def run() -> None:
        try:
            with db.connect(dsn) as conn:
                outcome.append(migrate(conn, folder, lock_timeout=0.2, on_wait=on_wait))
        except BaseException as e:
            outcome.append(e)

    with db.connect(dsn) as reader, db.connect(dsn, autocommit=True) as producer:
        reader.execute("SELECT count(*) FROM job_queue")  # its transaction stays open
        reader_pid = reader.info.backend_pid
        migrating = threading.Thread(target=run)
        migrating.start()
        try:
            assert waited.wait(30), outcome
            # the queue goes on meanwhile (before, this insert queued behind the migration, for ever)
            producer.execute("SET lock_timeout = '20s'")
            producer.execute("INSERT INTO job_queue (job_type) VALUES ('t.ok')")
        finally:
            reader.rollback()
            migrating.join(60)
    assert [m.version for m in outcome[0]] == [9001], outcome
    assert waits[0] == ("9001_column", [reader_pid])


def test_a_migration_that_never_gets_its_locks_gives_up_and_names_who_holds_them(dsn: str, tmp_path: Path) -> None:
    folder = tmp_path / "migrations"
    shutil.copytree(REPO_MIGRATIONS, folder)
    (folder / "9001_column.sql").write_text("ALTER TABLE job_queue ADD COLUMN extra int;\n")
    with db.connect(dsn) as reader, db.connect(dsn) as conn:
        reader.execute("SELECT count(*) FROM job_queue")
        with pytest.raises(MigrationFailed) as failed:
            migrate(conn, folder, lock_wait=0.5, lock_timeout=0.1, on_wait=lambda *_: None)
        assert isinstance(failed.value.error, psycopg.errors.LockNotAvailable)
        assert [h.pid for h in failed.value.holders] == [reader.info.backend_pid]
        assert failed.value.holders[0].state == "idle in transaction"
        reader.rollback()
        last = max(m.version for m in load_migrations())
        assert conn.execute("SELECT max(version) AS v FROM worker_core_migrations").fetchone() == {"v": last}
        locks = "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        assert conn.execute(locks).fetchone() == {"n": 0}


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_concurrent_migrate_is_serialised_by_the_advisory_lock(empty_dsn: str, isolation: str) -> None:
    # a server (or role) whose default isolation is repeatable read: the waiters' snapshots must not date
    # from before the first one committed (they would apply everything again)
    level = isolation.replace(" ", "\\ ")
    dsn = psycopg.conninfo.make_conninfo(empty_dsn, options=f"-c default_transaction_isolation={level}")
    n = 4
    barrier = threading.Barrier(n)
    results: list[list[int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            with db.connect(dsn) as conn:
                barrier.wait(timeout=10)
                applied = migrate(conn)
                conn.commit()
            with lock:
                results.append([m.version for m in applied])
        except BaseException as e:
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    everything = [m.version for m in load_migrations()]
    assert sorted(results) == sorted([everything] + [[]] * (n - 1))
    with db.connect(empty_dsn) as conn:
        rows = conn.execute("SELECT version FROM worker_core_migrations ORDER BY version").fetchall()
        assert [r["version"] for r in rows] == everything


def test_checkout_finds_the_top_level_migrations() -> None:
    assert {m.name for m in load_migrations()} == {
        p.name.split("_", 1)[1][:-4] for p in REPO_MIGRATIONS.glob("*.sql")
    }
    assert Path(str(migrations_dir())).resolve() in (REPO_MIGRATIONS.resolve(), ROOT / "worker_core" / "migrations")


@pytest.mark.slow
def test_migrations_ship_in_the_wheel_and_migrate_from_it(tmp_path: Path, empty_dsn: str) -> None:
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)]
    if importlib.util.find_spec("hatchling") is not None:
        cmd.insert(4, "--no-build-isolation")  # no download needed
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out.glob("qconsole-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for f in sorted(REPO_MIGRATIONS.glob("*.sql")):
            inside = f"worker_core/migrations/{f.name}"
            assert inside in names, f"{inside} is not in the wheel"
            assert zf.read(inside) == f.read_bytes()
        assert "worker_core/sql/queries.sql" in names
        assert "worker_core/migrations/0001_init.sql" in names

    # installed from the wheel (nothing of the checkout on the path), it finds and applies its migrations
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    code = (
        "import sys, worker_core\n"
        "from worker_core import db\n"
        "from worker_core.migrate import migrate, migrations_dir\n"
        "assert str(migrations_dir()).startswith(sys.argv[2]), migrations_dir()\n"
        "with db.connect(sys.argv[1]) as c:\n"
        "    print(','.join(f'{m.version:04d}_{m.name}' for m in migrate(c)))\n"
        "    c.commit()\n"
    )
    env = subprocess_env()
    env["PYTHONPATH"] = str(site)
    run = subprocess.run(
        [sys.executable, "-c", code, empty_dsn, str(site)], cwd=str(tmp_path), env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == ",".join(p.stem for p in sorted(REPO_MIGRATIONS.glob("*.sql")))


def test_a_migration_waits_for_the_migration_lock_under_lock_wait_and_says_who_holds_it(
    dsn: str, tmp_path: Path
) -> None:
    # pg_advisory_lock with no lock timeout: a migrate behind another was silent for as long as that one waited,
    # and behind a session that kept the lock (a `qconsole migrate` suspended with Ctrl-Z) it hung for ever
    from worker_core.migrate import LOCK_KEY

    folder = tmp_path / "migrations"
    shutil.copytree(REPO_MIGRATIONS, folder)
    (folder / "9001_column.sql").write_text("ALTER TABLE job_queue ADD COLUMN extra int;\n")
    waits: list[tuple[str, list[int], bool]] = []

    def on_wait(mig: Any, holders: list[Any], wait: float) -> None:
        waits.append((mig.label, [h.pid for h in holders], all(h.migration_lock for h in holders)))

    with db.connect(dsn, autocommit=True) as holder, db.connect(dsn) as conn:
        holder.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))
        guard = threading.Timer(60, holder.close)  # before: it waited for ever; then it would have applied 9001
        guard.start()
        try:
            with pytest.raises(MigrationFailed) as failed:
                migrate(conn, folder, lock_wait=0.5, on_wait=on_wait)
        finally:
            guard.cancel()
        pid = holder.info.backend_pid
        assert failed.value.migration_lock and isinstance(failed.value.error, psycopg.errors.LockNotAvailable)
        assert [h.pid for h in failed.value.holders] == [pid] and failed.value.migration.label == "9001_column"
        assert waits and waits[0] == ("9001_column", [pid], True), waits
        assert conn.execute("SELECT max(version) AS v FROM worker_core_migrations").fetchone() != {"v": 9001}
        conn.rollback()
        # released while it waits: it takes the lock then, and applies what is missing
        waited = threading.Event()
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(migrate(conn, folder, on_wait=lambda *_: waited.set()))
            except BaseException as e:
                outcome.append(e)

        migrating = threading.Thread(target=run)
        migrating.start()
        try:
            assert waited.wait(30), outcome
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))
            migrating.join(60)
        assert [m.version for m in outcome[0]] == [9001], outcome
