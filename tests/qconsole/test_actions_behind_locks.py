"""The console's actions behind another session's lock on audit_log or queues (an operator's long transaction
in psql): its embedded worker's start and stop audit entry, a pause, waited up to the action's statement
timeout (10 minutes), the action frozen. They give up after ops.ACTION_LOCK_WAIT_S, saying who holds it."""

from __future__ import annotations

import os

import psycopg
import pytest

from qconsole.backend import DatabaseBackend, describe_error, is_outage
from worker_core import TableLocked


@pytest.mark.parametrize("table", ["audit_log", "queues"])
def test_a_console_action_behind_a_lock_fails_at_once_naming_the_holder(dsn: str, table: str) -> None:
    backend = DatabaseBackend(dsn)
    other = psycopg.connect(dsn)
    try:
        other.execute(f"LOCK TABLE {table}")
        pid = other.info.backend_pid
        with pytest.raises(TableLocked) as raised:
            if table == "audit_log":
                backend.audit_worker(
                    "worker_start", number=3, pid=os.getpid(), host="here", queues=["default"], concurrency=2,
                    tasks=["t"],
                )  # fmt: skip
            else:
                backend.set_paused("default", True)
        assert not is_outage(raised.value)  # the database answered: no "connection lost" banner, no lookup
        said = describe_error(raised.value, dsn)
        assert said.startswith("TableLocked: ") and f"pid {pid} (idle in transaction" in said, said
        other.rollback()
        assert backend.set_paused("default", True).action == "pause"  # the lock gone, it is done
    finally:
        other.close()
        backend.close()


def test_the_cli_behind_a_lock_exits_3_naming_the_holder(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # `qconsole limit` behind a lock on concurrency_limits waited 10 minutes (its statement timeout)
    from typer.testing import CliRunner

    from qconsole.cli import app

    monkeypatch.setenv("QCONSOLE_DSN", dsn)
    with psycopg.connect(dsn) as other:
        other.execute("LOCK TABLE concurrency_limits")
        result = CliRunner().invoke(app, ["limit", "t.ok", "2", "--unknown-type"])
        assert result.exit_code == 3, result.output
        assert f"pid {other.info.backend_pid} (idle in transaction" in result.output
        assert "the limit of 't.ok' was not done, nothing of it was written" in result.output
