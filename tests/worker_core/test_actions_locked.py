"""Another session's long transaction holding a lock on audit_log, queues or concurrency_limits: an operator's
action waited up to its statement timeout (10 minutes in the console and the CLI), frozen. Now the action
gives up after ops.ACTION_LOCK_WAIT_S saying who holds the lock, nothing of it written."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from worker_core import TableLocked, db, enqueue, ops


@pytest.fixture
def holder(dsn: str) -> Iterator[Callable[[str], int]]:
    """``holder(sql)``: runs it in a transaction of a second session, left open until the test ends; its pid."""
    conn = psycopg.connect(dsn)

    def hold(statement: str) -> int:
        conn.execute(statement)
        return conn.info.backend_pid

    yield hold
    conn.close()


def _audit_rows(conn: db.Conn) -> int:
    row = conn.execute("SELECT count(*) AS n FROM audit_log").fetchone()
    assert row is not None
    return int(row["n"])


def _paused(conn: db.Conn) -> list[str]:
    return [r["name"] for r in conn.execute("SELECT name FROM queues WHERE paused")]


ACTIONS: dict[str, Callable[[db.Conn], Any]] = {
    "pause": lambda c: ops.pause(c, "default"),
    "limit": lambda c: ops.set_limit(c, "t.ok", 2, allow_unknown=True),
    "worker_start": lambda c: ops.audit_worker(
        c, "worker_start", number=1, pid=os.getpid(), queues=["default"], concurrency=2, tasks=["t"]
    ),
}


@pytest.mark.parametrize(
    ("action", "table"),
    [("pause", "audit_log"), ("pause", "queues"), ("limit", "concurrency_limits"), ("worker_start", "audit_log")],
)
def test_an_action_behind_a_table_lock_gives_up_naming_its_holder(
    conn: db.Conn, holder: Callable[[str], int], action: str, table: str
) -> None:
    before = _audit_rows(conn)
    pid = holder(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    with pytest.raises(TableLocked) as raised:
        ACTIONS[action](conn)
    said = str(raised.value)
    assert f"pid {pid} (idle in transaction" in said and f"LOCK TABLE {table}" in said, said
    assert "was not done, nothing of it was written" in said
    assert not conn.info.transaction_status  # rolled back: the connection is idle, usable
    holder("ROLLBACK")
    assert _audit_rows(conn) == before
    assert not _paused(conn) and not conn.execute("SELECT 1 FROM concurrency_limits").fetchall()
    ACTIONS[action](conn)  # once the lock is gone, it is done
    assert _audit_rows(conn) == before + 1


def test_a_pause_behind_a_row_another_transaction_changed_gives_up_naming_it(
    conn: db.Conn, holder: Callable[[str], int]
) -> None:
    # an operator's UPDATE left uncommitted in psql: a row lock, no table lock
    ops.pause(conn, "default")
    pid = holder("UPDATE queues SET changed_by = 'dba' WHERE name = 'default'")
    with pytest.raises(TableLocked) as raised:
        ops.resume(conn, "default")
    said = str(raised.value)
    assert f"pid {pid} (idle in transaction" in said and "UPDATE queues SET changed_by" in said, said
    assert _paused(conn) == ["default"]


def test_a_requeue_behind_a_lock_on_the_audit_log_is_rolled_back_whole(
    conn: db.Conn, holder: Callable[[str], int]
) -> None:
    job_id = enqueue(conn, "t.ok", {}).id
    ops.kill(conn, [job_id])
    pid = holder("LOCK TABLE audit_log IN SHARE MODE")  # readers pass, writers wait
    with pytest.raises(TableLocked, match=rf"the requeue was not done.*pid {pid}"):
        ops.requeue(conn, [job_id])
    row = conn.execute("SELECT state FROM job_queue WHERE id = %s", (job_id,)).fetchone()
    assert row is not None and row["state"] == "cancelled"
