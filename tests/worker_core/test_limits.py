"""Global concurrency limits per job type, enforced by the claim in PostgreSQL with no coordinator."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker_core.helpers import ROOT, run_burst, running_worker, scalar, subprocess_env, wait_for
from worker_core import db, ops, stats
from worker_core.producer import enqueue, enqueue_many

TASK_MODULES = "tests.worker_core.tasks_contract,tests.worker_core.tasks"
PEAK = """
SELECT coalesce(max(n), 0) FROM (
    SELECT (SELECT count(*) FROM intervals b WHERE b.started <= a.started AND b.ended > a.started) AS n
    FROM intervals a) s
"""


@pytest.mark.slow
def test_four_processes_never_run_more_than_the_limit(dsn: str, conn: db.Conn, tmp_path: Path) -> None:
    enqueue_many(conn, [("t.limited", {"seconds": 0.15}) for _ in range(40)])
    enqueue_many(conn, [("t.ok", {}) for _ in range(40)])  # unlimited work flows beside it
    log = open(tmp_path / "workers.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "qconsole", "worker", "--tasks", TASK_MODULES,
         "--processes", "4", "--concurrency", "4", "--poll-interval", "0.05", "--heartbeat", "0.2", "--burst"],
        cwd=ROOT, env={**subprocess_env(), "QCONSOLE_DSN": dsn}, stdout=log, stderr=log,
    )  # fmt: skip
    try:
        assert proc.wait(120) == 0, (tmp_path / "workers.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert scalar(dsn, "SELECT count(*) FROM intervals") == 40
    assert scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'succeeded'") == 80
    assert scalar(dsn, PEAK) <= 2
    assert scalar(dsn, PEAK) == 2, "with 16 slots and 40 jobs the limit should have been reached"
    by_type = {t.job_type: t for t in stats.overview(conn).types}
    assert by_type["t.limited"].concurrency_limit == 2


def test_jobs_over_the_limit_wait_and_an_operator_can_throttle_a_queue(dsn: str, conn: db.Conn) -> None:
    enqueue_many(conn, [("t.limited", {"seconds": 0.05}, {"queue": "slow"}) for _ in range(6)])
    ops.set_limit(conn, "t.limited", 1, queue="slow", reason="upstream rate limit")
    worker = run_burst(dsn, task_modules=("tests.worker_core.tasks_contract",), concurrency=4)
    assert scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'succeeded'") == 6
    assert scalar(dsn, PEAK) == 1
    # waiting for the limit is neither a failure nor a retry
    assert scalar(dsn, "SELECT max(attempts) FROM job_queue") == 1
    assert worker.claimed_total == 6
    limits = {(r["job_type"], r["queue"]): r for r in stats.limits(conn)}
    assert limits[("t.limited", "slow")]["max_running"] == 1
    assert limits[("t.limited", "slow")]["source"] == "operator"
    assert stats.audit_log(conn, 1)[0].action == "limit"
    ops.clear_limit(conn, "t.limited", queue="slow")
    assert ("t.limited", "slow") not in {(r["job_type"], r["queue"]) for r in stats.limits(conn)}


def test_a_limit_of_zero_holds_every_job_of_the_type(dsn: str, conn: db.Conn) -> None:
    held = enqueue(conn, "t.ok", {}).id
    other = enqueue(conn, "t.flaky", {"fail_times": 0}).id
    ops.set_limit(conn, "t.ok", 0, reason="incident: stop this type")
    with running_worker(dsn):
        wait_for(lambda: scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (other,)) == "succeeded")
    assert scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (held,)) == "queued"


@pytest.mark.parametrize("scope", ["*", "bulk"])
def test_a_burst_worker_ends_when_what_is_left_is_held_by_a_limit_of_zero(
    dsn: str, conn: db.Conn, scope: str
) -> None:
    # it counted the held jobs as work still to do, and never exited (a cron or CI run hung)
    held = enqueue(conn, "t.ok", {}, queue="bulk").id
    other = enqueue(conn, "t.ok", {}).id
    ops.set_limit(conn, "t.ok", 0, queue=scope, reason="incident")
    conn.commit()
    run_burst(dsn, timeout=30)
    states = "SELECT state FROM job_queue WHERE id = %s"
    assert scalar(dsn, states, (held,)) == "queued"
    assert scalar(dsn, states, (other,)) == ("queued" if scope == "*" else "succeeded")


def test_a_burst_worker_ends_when_an_expired_lease_is_held_by_a_limit_of_zero(dsn: str, conn: db.Conn) -> None:
    # the job of a worker that died: the limit holds it running (claim_solo leaves it), so the burst waited
    dropped = enqueue(conn, "t.ok", {}).id
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'gone',"
        " locked_until = now() - interval '1 minute' WHERE id = %s",
        (dropped,),
    )
    ops.set_limit(conn, "t.ok", 0, reason="hold t.ok, its expired leases included")
    conn.commit()
    run_burst(dsn, timeout=30)
    assert scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (dropped,)) == "running"


def test_a_types_limit_caps_its_queues_own_limits_too(dsn: str, conn: db.Conn) -> None:
    """`limit T 1` and `limit T 3 --queue slow`: both apply, so never more than one runs anywhere."""
    enqueue_many(conn, [("t.limited", {"seconds": 0.05}, {"queue": q}) for q in ("slow", "default") * 3])
    ops.set_limit(conn, "t.limited", 1, reason="the type's own cap")
    ops.set_limit(conn, "t.limited", 3, queue="slow", reason="a looser queue")
    run_burst(dsn, task_modules=("tests.worker_core.tasks_contract",), concurrency=4)
    assert scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'succeeded'") == 6
    assert scalar(dsn, PEAK) == 1


def test_a_limit_of_zero_holds_the_type_in_a_queue_with_its_own_limit(dsn: str, conn: db.Conn) -> None:
    """The runbook's `limit T 0` holds the type everywhere, also where a queue has a limit of its own."""
    held = enqueue(conn, "t.ok", {}, queue="bulk").id
    other = enqueue(conn, "t.flaky", {"fail_times": 0}, queue="bulk").id
    ops.set_limit(conn, "t.ok", 5, queue="bulk", reason="bulk may run five")
    ops.set_limit(conn, "t.ok", 0, reason="incident: stop this type")
    with running_worker(dsn, queues=("bulk",)):
        wait_for(lambda: scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (other,)) == "succeeded")
    assert scalar(dsn, "SELECT state FROM job_queue WHERE id = %s", (held,)) == "queued"


def test_a_limit_on_a_misspelt_type_is_refused_not_silently_ineffective(conn: db.Conn) -> None:
    # in an incident, `limit invoice.generte 0` must not look like it held anything
    enqueue(conn, "t.ok", {})
    with pytest.raises(ValueError, match="check its spelling"):
        ops.set_limit(conn, "t.okk", 0, reason="incident")
    with pytest.raises(ValueError, match="not a job type name"):
        ops.set_limit(conn, "T.Ok", 0, reason="incident")
    with pytest.raises(ValueError, match="between 0 and"):
        ops.set_limit(conn, "t.ok", 3_000_000_000)
    assert stats.limits(conn) == [] and stats.audit_log(conn) == []
    ops.set_limit(conn, "t.ok", 0, reason="incident")  # a type with jobs
    ops.set_limit(conn, "t.coming", 2, reason="before its first deploy", allow_unknown=True)
    assert {r["job_type"] for r in stats.limits(conn)} == {"t.ok", "t.coming"}


def test_a_limit_the_code_no_longer_declares_is_dropped_by_the_workers(dsn: str, conn: db.Conn) -> None:
    # an earlier version had @task("t.ok", concurrency=1): the row stayed, and held the type for ever
    conn.execute(
        "INSERT INTO concurrency_limits (job_type, queue, max_running, source, reason)"
        " VALUES ('t.ok', '*', 1, 'task', '@task(concurrency=...)'), ('t.ok', 'bulk', 2, 'operator', 'incident')"
    )
    conn.commit()
    run_burst(dsn)
    rows = conn.execute("SELECT queue, source FROM concurrency_limits WHERE job_type = 't.ok'").fetchall()
    assert rows == [{"queue": "bulk", "source": "operator"}]  # the operator's stays


def test_clearing_a_limit_its_task_declares_is_refused_with_what_to_do(dsn: str, conn: db.Conn) -> None:
    run_burst(dsn, task_modules=("tests.worker_core.tasks_contract",))  # declares t.limited's limit
    with pytest.raises(ValueError, match="declared by its @task"):
        ops.clear_limit(conn, "t.limited", reason="lift it")
    assert [r["job_type"] for r in stats.limits(conn)] == ["t.limited"]  # still there: it said so


@pytest.mark.parametrize("before, after", [(None, 0), (4, 1)], ids=["held", "lowered"])
def test_a_limit_of_zero_or_lowered_gives_back_the_jobs_a_worker_claimed_but_has_not_started(
    dsn: str, conn: db.Conn, before: int | None, after: int
) -> None:
    # the runbook's other "contain it": a pause gave its prefetched jobs back, a hold let them all start;
    # so did a limit lowered from 4 to 1 to protect a struggling downstream: four ran at once
    ids = [enqueue(conn, "t.slow", {"seconds": 6.0}).id for _ in range(4)]
    if before is not None:
        ops.set_limit(conn, "t.slow", before, reason="normal")
    conn.commit()
    states = "SELECT state FROM job_queue WHERE id = ANY(%s)"
    with running_worker(dsn, concurrency=1, prefetch=3, heartbeat_interval=0.2, shutdown_grace=0):
        wait_for(lambda: [r["state"] for r in conn.execute(states, (ids,))].count("running") == 4, 10,
                 what="a claim of all four")  # fmt: skip
        ops.set_limit(conn, "t.slow", after, reason="INC: hold it")
        conn.commit()
        wait_for(lambda: [r["state"] for r in conn.execute(states, (ids,))].count("queued") == 3, 4,
                 what="three given back")  # fmt: skip
        # within the new limit: the one running holds the room, none of the three is claimed again
        assert [r["state"] for r in conn.execute(states, (ids,))].count("running") == 1
        assert scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'queued' AND attempts = 0") == 3
