"""enqueue on a database not migrated says to run `qconsole migrate`, as every CLI command does, instead of
psycopg's ``UndefinedTable: relation "job_type_contracts" does not exist``."""

from __future__ import annotations

import shutil
from pathlib import Path

import psycopg
import pytest

import tests.worker_core.tasks  # noqa: F401 - the t.* types
import worker_core
from worker_core import db, enqueue, enqueue_many, policy, producer
from worker_core.migrate import migrate, migrations_dir
from worker_core.registry import Registry


@pytest.mark.parametrize("registry", [Registry(), None], ids=["type-not-imported", "type-imported"])
def test_enqueue_on_an_unmigrated_database_says_to_migrate(empty_dsn: str, registry: Registry | None) -> None:
    """The CLI says ``the database needs migrations (...): run `qconsole migrate``` (exit 3); the producer API,
    the one an application calls first, raised psycopg's ``UndefinedTable: relation "job_type_contracts" does
    not exist`` (``"job_queue"`` for a type it imports), naming an internal table and not the forgotten step."""
    with db.connect(empty_dsn) as conn:
        with pytest.raises(worker_core.NotMigrated) as raised:
            enqueue(conn, "t.ok", {}, registry=registry)
        conn.rollback()
        with pytest.raises(worker_core.NotMigrated):
            enqueue_many(conn, [("t.ok", {})], registry=registry)
        conn.rollback()
    said = str(raised.value)
    assert "run `qconsole migrate`" in said and "does not exist" in said, said
    assert isinstance(raised.value, psycopg.Error)  # a caller's `except psycopg.Error` still handles it
    assert isinstance(raised.value.__cause__, psycopg.errors.UndefinedTable)


def test_a_producer_upgraded_before_the_migration_that_it_needs_says_to_migrate(
    empty_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database at 0015: a producer without a policy file reads the workers' policy (0016)."""
    folder = tmp_path / "migrations"
    shutil.copytree(Path(str(migrations_dir())), folder)
    for newer in folder.glob("0016_*.sql"):
        newer.unlink()
    with db.connect(empty_dsn) as conn:
        migrate(conn, folder)
        conn.commit()
    monkeypatch.delenv("QCONSOLE_POLICY_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    policy.set_current(None)
    producer._policy_cache.clear()
    with db.connect(empty_dsn, autocommit=True) as conn:
        with pytest.raises(worker_core.NotMigrated, match=r"deployment_policy.*qconsole migrate"):
            enqueue(conn, "t.ok", {})
        assert conn.execute("SELECT count(*) AS n FROM job_queue").fetchone() == {"n": 0}
