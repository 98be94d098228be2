"""A claim that committed but whose answer never came back (the connection broke in between).

Its jobs are running, held by this worker, which does not know of them: nothing beat for them, and they sat
out their visibility timeout, then came back as lease expirations (suspects, run alone). The worker now
looks for them on its next claim and runs them at the attempt that claim counted.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.worker_core.helpers import ledger, running_worker, scalar, wait_for
from worker_core import db, enqueue
from worker_core.worker import Worker

pytestmark = pytest.mark.timeout(120)


def _lose_answers(monkeypatch: pytest.MonkeyPatch, times: int) -> list[int]:
    """The main claim runs (and commits: an autocommit statement), then its answer is lost as a broken
    connection loses it: the rows never reach the worker."""
    real = Worker._claim_ready
    lost: list[int] = []

    def claim_then_lose(self: Worker, conn: db.Conn, limit: int, retry: bool = True) -> list[dict[str, Any]]:
        rows = real(self, conn, limit, retry)
        if rows and len(lost) < times:
            lost.append(len(rows))
            conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly (the test lost the answer)")
        return rows

    monkeypatch.setattr(Worker, "_claim_ready", claim_then_lose)
    return lost


def test_the_jobs_of_a_claim_whose_answer_was_lost_run_at_once_not_after_their_visibility_timeout(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [
        enqueue(conn, "t.ledger", {"item": f"i{i}"}, idempotency_key=f"k{i}", visibility_timeout_seconds=600).id
        for i in range(6)
    ]
    conn.commit()
    lost = _lose_answers(monkeypatch, times=2)
    with running_worker(dsn, poll_interval=0.05):
        wait_for(
            lambda: scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'succeeded'") == len(ids),
            timeout=30,  # not 600 s
            what="every job to succeed",
        )
    assert lost and sum(lost) >= 1
    rows = {
        r["id"]: r
        for r in db.connect(dsn, autocommit=True).execute(
            "SELECT id, attempts, lease_expirations, suspect, ran_solo FROM job_queue"
        )
    }
    # at the attempt the lost claim counted, no lease expiration, not taken for a suspect
    assert {(r["attempts"], r["lease_expirations"], r["suspect"], r["ran_solo"]) for r in rows.values()} == {
        (1, 0, False, False)
    }
    assert sorted(r["item"] for r in ledger(dsn)) == sorted(f"i{i}" for i in range(6))  # each effect once


def test_only_this_workers_unknown_jobs_with_a_live_lease_since_the_lost_claim_are_taken(
    dsn: str, conn: db.Conn
) -> None:
    # an expired lease is the lease path's (claim_solo), which another worker may be taking already; a job
    # another worker holds, one this worker knows of, or one started before the lost claim began is not it
    from worker_core.sql import queries

    mine, expired, theirs, known, older = (enqueue(conn, "t.ok", {"n": i}).id for i in range(5))
    cast = [
        (mine, "w1", "0", "1 minute"),
        (expired, "w1", "0", "-1 second"),
        (theirs, "w2", "0", "1 minute"),
        (known, "w1", "0", "1 minute"),
        (older, "w1", "-1 minute", "1 minute"),
    ]
    for job_id, holder, started, lease in cast:
        conn.execute(
            "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = %s,"
            " started_at = now() + %s::interval, locked_until = now() + %s::interval WHERE id = %s",
            (holder, started, lease, job_id),
        )
    at = conn.execute("SELECT now() AS now, now() - interval '1 second' AS since").fetchone()
    assert at is not None
    params = {"worker": "w1", "since": at["since"], "now": at["now"], "known": [known]}
    assert [r["id"] for r in conn.execute(queries["claimed_unheard"], params)] == [mine]
