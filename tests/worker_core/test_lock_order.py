"""Lock order of the statements that change many jobs at once (deadlocks, SQLSTATE 40P01).

Every multi-row statement that names jobs by id (heartbeat_jobs, settle_succeeded_many, kill_jobs, ...) was a
plain ``UPDATE ... WHERE id = ANY(...)``: it locked its rows in the order of its plan (they now lock them in
id order first: queries.sql, "Lock order"). On a table of real size
(here: 20k finished rows of ~1.5 kB, what a table of ~200k narrow rows gives too) the planner reads an array
of up to 3 ids with an Index Scan on the primary key (rows locked in uuid order) and an array of 5 or more
with a Bitmap Heap Scan (rows locked in heap order). So a statement naming a few jobs (a group of 3, a
completer batch of 2, a heartbeat of a worker with 3 in flight, an operator killing 2 jobs) and one naming
many (the heartbeat of a busy worker, a kill of a whole type's jobs) lock their common rows in opposite
orders whenever the heap order of those rows differs from their uuid order (random uuids: half the pairs).

The tests make that interleaving deterministic: a third transaction holds one row for a moment (what any
concurrent writer of that row does, e.g. an operator's kill before its commit), so that each statement is
parked between its two rows. Only the real statements of worker_core/sql/queries.sql (and ops.kill) run;
nothing of PostgreSQL is mocked.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from tests.worker_core.helpers import wait_for
from worker_core import db, ops
from worker_core.execution import array_literal
from worker_core.sql import queries

WORKER = "w-lock-order"


def _fill(conn: db.Conn) -> None:
    """A table of some size: the planner's choice between index and bitmap scans depends on it."""
    conn.execute(
        "INSERT INTO job_queue (job_type, state, finished_at, last_error) "
        "SELECT 't.noop', 'succeeded', now(), repeat('x', 1500) FROM generate_series(1, 20000)"
    )
    conn.execute("ANALYZE job_queue")


def _running(conn: db.Conn, ids: list[uuid.UUID], worker: str = WORKER) -> None:
    """Running jobs held by ``worker``, inserted one by one into a table with no free space elsewhere yet (before
    _fill): their heap order is the order of ``ids``."""
    for i in ids:
        conn.execute(
            "INSERT INTO job_queue (id, job_type, state, attempts, locked_by, locked_until, started_at) "
            "VALUES (%s, 't.noop', 'running', 1, %s, now() + interval '90 seconds', now())",
            (i, worker),
        )


def _plan(conn: db.Conn, query: str, params: dict[str, Any]) -> str:
    rows = conn.execute("EXPLAIN " + query, params).fetchall()
    return "\n".join(r["QUERY PLAN"] for r in rows)


def _waiting(admin: db.Conn, pid: int) -> bool:
    row = admin.execute("SELECT count(*) AS n FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)).fetchone()
    return bool(row and row["n"])


def _parked(admin: db.Conn, pid: Any, thread: threading.Thread, timeout: float = 5.0) -> None:
    """Until the statement of ``pid`` waits on a lock, or its thread is done (no wait: with rows locked in
    one order the interleaving cannot happen, and the statement goes through)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and thread.is_alive():
        if (pid() if callable(pid) else pid) is not None and _waiting(admin, pid() if callable(pid) else pid):
            return
        time.sleep(0.02)


class Stmt(threading.Thread):
    """One statement in a transaction of its own connection, run in a thread; keeps what it raised."""

    def __init__(self, dsn: str, query: str, params: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.conn = db.connect(dsn)
        self.pid = self.conn.info.backend_pid
        self.query, self.params = query, params
        self.error: BaseException | None = None
        self.rows: list[Any] = []

    def run(self) -> None:
        try:
            with self.conn.transaction():
                self.rows = self.conn.execute(self.query, self.params).fetchall()
        except BaseException as e:
            self.error = e
        finally:
            self.conn.close()


class Kill(threading.Thread):
    """An operator's ops.kill of ``ids`` in a thread; keeps its backend's pid and what it raised."""

    def __init__(self, dsn: str, ids: list[uuid.UUID]) -> None:
        super().__init__(daemon=True)
        self.dsn, self.ids = dsn, ids
        self.pid: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with db.connect(self.dsn) as c:
                self.pid = c.info.backend_pid
                ops.kill(c, self.ids, reason="stop this type")
        except BaseException as x:
            self.error = x


def _ids(n: int) -> list[uuid.UUID]:
    return sorted(uuid.uuid4() for _ in range(n))


def _cast() -> tuple[uuid.UUID, uuid.UUID, uuid.UUID, uuid.UUID, list[uuid.UUID]]:
    """The jobs of every scenario: A < D < B in uuid order (the order an ordered lock takes), E and 8 more."""
    a, d, b = _ids(3)
    return a, d, b, uuid.uuid4(), [uuid.uuid4() for _ in range(8)]


def _heartbeat_params(ids: list[uuid.UUID]) -> dict[str, Any]:
    return {"now": dt.datetime.now(dt.timezone.utc), "worker": WORKER, "ids": array_literal(ids)}


def _settle_params(ids: list[uuid.UUID]) -> dict[str, Any]:
    return {
        "now": dt.datetime.now(dt.timezone.utc),
        "worker": WORKER,
        "ids": array_literal(ids),
        "fences": array_literal([f"{i}/1" for i in ids]),
        "lock_wait": "30000",  # its bound (Slot._commit_group): well past the moment the third one holds a row
    }


@pytest.mark.parametrize("victim", ["heartbeat", "group_settlement"])
def test_group_settlement_and_heartbeat_do_not_deadlock(dsn: str, victim: str) -> None:
    """A group of 3 jobs settles (Slot._commit_group: settle_group, then COMMIT) while its worker's
    heartbeat extends the leases of its 12 jobs in flight (the group's 3 among them).

    uuid order A < D < B; heap order B, E, A, D, then 8 more. The settlement (3 ids, Index Scan) locks A, D,
    B; the heartbeat (12 ids, Bitmap Heap Scan) locks B, E, A, D, ...: settlement holds A and waits for B,
    heartbeat holds B and waits for A. Which one PostgreSQL aborts depends on which waited first; both are
    forced here. The group's settlement aborted: the whole group is rolled back and given back, its handlers
    run again (Slot.run_group -> _give_back_group); the heartbeat aborted: that beat is lost."""
    a, d, b, e, others = _cast()
    with db.connect(dsn, autocommit=True) as admin:
        _running(admin, [b, e, a, d, *others])
        _fill(admin)
        group = [a, d, b]  # in whatever order the worker lists them: the plan sorts them
        in_flight = [a, b, d, e, *others]
        settle_plan = _plan(admin, queries["settle_group"], _settle_params(group))
        beat_plan = _plan(admin, queries["heartbeat_jobs"], _heartbeat_params(in_flight))
        assert "Index Scan using job_queue_pkey" in settle_plan, settle_plan
        assert "Bitmap Heap Scan" in beat_plan, beat_plan

        # the row a third transaction holds for a moment: D (only the settlement is parked, and the heartbeat
        # waits last: it is the one aborted), or E (in the heartbeat's way only: the settlement is aborted)
        held = d if victim == "heartbeat" else e
        with db.connect(dsn) as third:
            third.execute("SELECT 1 FROM job_queue WHERE id = %s FOR NO KEY UPDATE", (held,))
            settle = Stmt(dsn, queries["settle_group"], _settle_params(group))
            beat = Stmt(dsn, queries["heartbeat_jobs"], _heartbeat_params(in_flight))
            first, second = (settle, beat) if victim == "heartbeat" else (beat, settle)
            first.start()
            _parked(admin, first.pid, first)  # the heartbeat waits on no row now: it skips it
            second.start()
            _parked(admin, second.pid, second)  # on the first one
            time.sleep(0.1)
            third.commit()
        settle.join(30)
        beat.join(30)

    errors = {"settlement": settle.error, "heartbeat": beat.error}
    assert not any(isinstance(x, psycopg.errors.DeadlockDetected) for x in errors.values()), errors


@pytest.mark.parametrize("victim", ["heartbeat", "kill"])
def test_operator_kill_of_many_and_heartbeat_do_not_deadlock(dsn: str, victim: str) -> None:
    """An operator kills a dozen running jobs (ops.kill: kill_jobs, Bitmap Heap Scan, heap order) while the
    worker running 3 of them beats (heartbeat_jobs with 3 ids: Index Scan, uuid order).

    uuid order A < D < B; heap order B, E, A, D, ... The kill holds B and waits for A, the heartbeat holds
    A and waits for B. The kill aborted: the operator's action fails (nothing killed, no audit row); the
    heartbeat aborted: that beat is lost (leases, lock_key leases, kills seen, the worker's row)."""
    a, d, b, e, others = _cast()
    with db.connect(dsn, autocommit=True) as admin:
        _running(admin, [b], WORKER)
        _running(admin, [e], "w-other")
        _running(admin, [a, d], WORKER)
        _running(admin, others, "w-other")
        _fill(admin)
        mine = [a, d, b]
        doomed = [b, e, a, d, *others]
        now = dt.datetime.now(dt.timezone.utc)
        kill_plan = _plan(admin, queries["kill_jobs"], {"ids": doomed, "now": now, "message": "m"})
        beat_plan = _plan(admin, queries["heartbeat_jobs"], _heartbeat_params(mine))
        assert "Bitmap Heap Scan" in kill_plan, kill_plan
        assert "Index Scan using job_queue_pkey" in beat_plan, beat_plan

        killer = Kill(dsn, doomed)

        # PostgreSQL aborts the statement whose current wait began first. D held: the heartbeat is parked
        # after A, the kill waits on A, then the heartbeat on B: the kill is aborted. E held: the kill is
        # parked after B, the heartbeat waits on B, then the kill on A: the heartbeat is aborted
        held = e if victim == "heartbeat" else d
        with db.connect(dsn) as third:
            third.execute("SELECT 1 FROM job_queue WHERE id = %s FOR NO KEY UPDATE", (held,))
            beat = Stmt(dsn, queries["heartbeat_jobs"], _heartbeat_params(mine))
            if held == d:
                beat.start()
                _parked(admin, beat.pid, beat)  # the heartbeat waits on no row now: it skips D
                killer.start()
                _parked(admin, lambda: killer.pid, killer)  # on A
            else:
                killer.start()
                pid = wait_for(lambda: killer.pid, what="the kill's statement")
                assert pid is not None
                wait_for(lambda: _waiting(admin, pid), what="the kill to wait on E")
                beat.start()
                _parked(admin, beat.pid, beat)  # on B
            time.sleep(0.1)
            third.commit()
        beat.join(30)
        killer.join(30)

    errors = {"heartbeat": beat.error, "kill": killer.error}
    assert not any(isinstance(x, psycopg.errors.DeadlockDetected) for x in errors.values()), errors


def test_operator_kill_of_many_and_a_group_settlement_do_not_deadlock(dsn: str) -> None:
    """A group of 3 settles (ids A < D < B: Index Scan, id order) while an operator kills a dozen jobs, those 3
    among them (a Bitmap Heap Scan, heap order B, E, A, D, ...). With D held a moment by a third transaction,
    the settlement holds A and waits for D; the kill took B and E and waits for A; D freed, the settlement
    waits for B: a cycle, and PostgreSQL aborted one (the group ran its handlers again, or the action
    failed). Both now lock in id order: the kill waits at A holding nothing the settlement needs."""
    a, d, b, e, others = _cast()
    with db.connect(dsn, autocommit=True) as admin:
        _running(admin, [b, e, a, d, *others])
        _fill(admin)
        group = [a, d, b]
        doomed = [b, e, a, d, *others]
        now = dt.datetime.now(dt.timezone.utc)
        settle_plan = _plan(admin, queries["settle_group"], _settle_params(group))
        assert "Index Scan using job_queue_pkey" in settle_plan
        assert "Bitmap Heap Scan" in _plan(admin, queries["kill_jobs"], {"ids": doomed, "now": now, "message": "m"})

        killer = Kill(dsn, doomed)

        with db.connect(dsn) as third:
            third.execute("SELECT 1 FROM job_queue WHERE id = %s FOR NO KEY UPDATE", (d,))
            settle = Stmt(dsn, queries["settle_group"], _settle_params(group))
            settle.start()
            wait_for(lambda: _waiting(admin, settle.pid), what="the settlement to wait on D")
            killer.start()
            _parked(admin, lambda: killer.pid, killer)  # on A
            time.sleep(0.1)
            third.commit()
        settle.join(30)
        killer.join(30)

    errors = {"settlement": settle.error, "kill": killer.error}
    assert not any(isinstance(x, psycopg.errors.DeadlockDetected) for x in errors.values()), errors
    assert settle.error is None and len(settle.rows) == 3  # settled before the kill came to them
