"""A dead-letter group's count (stats.dead_letter_groups, the console's row) and the jobs its action reads
(ops.group_job_ids, the console's question): the same filters, so read together they agree; read apart, a
retrying group loses the jobs a worker claims in between (its retries come due), which is what the console's
kill question counting 12 of a row's 13 was."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.worker_core.helpers import TASKS
from worker_core import db, enqueue, ops, stats
from worker_core.registry import Registry
from worker_core.worker import Worker, WorkerConfig

#: the states the console's dead-letters screen lists (qconsole.backend.DEAD_LETTER_STATES)
SCREEN_STATES = ("dead_lettered", "failed", "retry_scheduled")


def _jobs(conn: db.Conn, n: int, job_type: str, state: str, fingerprint: str | None, due_in: float = 3600) -> list[Any]:
    # an empty registry: another test's @task of the same name (with its own contract) is not this one's
    ids = [enqueue(conn, job_type, {"i": i}, registry=Registry()).id for i in range(n)]
    conn.execute(
        "UPDATE job_queue SET state = %s, error_fingerprint = %s, last_error = %s, attempts = 1,"
        " finished_at = CASE WHEN %s = 'retry_scheduled' THEN NULL ELSE now() END,"
        " scheduled_at = now() + %s * interval '1 second' WHERE id = ANY(%s)",
        (state, fingerprint, fingerprint, state, due_in, ids),
    )
    return ids


def test_every_dead_letter_group_counts_exactly_the_jobs_its_action_reads(conn: db.Conn) -> None:
    # groups the same fingerprint splits by state and by type, and the jobs with no error recorded
    _jobs(conn, 13, "dlq.mail", "retry_scheduled", "TransientError: upstream <n>")
    _jobs(conn, 4, "dlq.mail", "dead_lettered", "TransientError: upstream <n>")
    _jobs(conn, 3, "dlq.mail", "failed", "TransientError: upstream <n>")
    _jobs(conn, 2, "dlq.sms", "retry_scheduled", "TransientError: upstream <n>")
    _jobs(conn, 5, "dlq.mail", "dead_lettered", None)
    _jobs(conn, 2, "dlq.mail", "retry_scheduled", None)
    groups = stats.dead_letter_groups(conn, states=SCREEN_STATES)
    assert len(groups) == 6 and groups.retrying == 17 and groups.dead == 12
    for g in groups:
        read = ops.group_job_ids(conn, g.job_type, g.fingerprint, g.state)
        assert (len(read), sorted(read)) == (g.count, sorted(g.job_ids)), g


@pytest.fixture
def claimer(dsn: str) -> Iterator[Worker]:
    """A Worker used only for its claim (nothing is run)."""
    w = Worker(WorkerConfig(dsn=dsn, task_modules=TASKS, worker_id="claimer"))
    yield w
    if w._claim_conn is not None:
        w._claim_conn.close()


def test_a_retrying_group_loses_the_jobs_claimed_between_its_row_and_its_question(
    conn: db.Conn, claimer: Worker
) -> None:
    # the row is read (13), a retry comes due and a worker claims it (running: no longer retry_scheduled),
    # the question reads the group's jobs (12). Not a filter of one read the other lacks: read again, the
    # row says 12 too. The question's title counts what it acts on; its details still listed the row's 13
    _jobs(conn, 12, "t.ok", "retry_scheduled", "TransientError: upstream <n>")
    [due] = _jobs(conn, 1, "t.ok", "retry_scheduled", "TransientError: upstream <n>", due_in=-1)
    [row] = stats.dead_letter_groups(conn, states=SCREEN_STATES)
    assert (row.state, row.count) == ("retry_scheduled", 13)
    claimed = claimer.claim(10)
    assert [r["id"] for r in claimed] == [due]
    asked = ops.group_job_ids(conn, row.job_type, row.fingerprint, row.state)
    assert len(asked) == 12 and due not in asked
    [again] = stats.dead_letter_groups(conn, states=SCREEN_STATES)
    assert again.count == 12 and sorted(again.job_ids) == sorted(asked)


def test_a_group_counts_its_jobs_beyond_the_ids_it_lists_and_its_action_reads_them_all(conn: db.Conn) -> None:
    # dead_letter_groups lists the newest max_ids ids of a group, its count is of every job: the action
    # reads them all (ops.group_job_ids has no limit)
    ids = _jobs(conn, 13, "t.ok", "retry_scheduled", "TransientError: upstream <n>")
    [g] = stats.dead_letter_groups(conn, states=SCREEN_STATES, max_ids=5)
    assert (g.count, len(g.job_ids)) == (13, 5)
    assert sorted(ops.group_job_ids(conn, g.job_type, g.fingerprint, g.state)) == sorted(ids)
