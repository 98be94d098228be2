"""Why a job is not running (stats.job_waiting, through stats.job_holders): each reason from real rows, judged as
the claims judge them (a real Worker's claim agrees), and the count of the jobs ahead bounded on a big backlog."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest

from tests.worker_core.test_claim import VIS, at, claimers  # noqa: F401 (claimers: a fixture)
from worker_core import FixedClock, db, enqueue, ops, stats
from worker_core.registry import registry
from worker_core.sql import queries

NOW = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def waiting(conn: db.Conn, job_id: uuid.UUID, clock: Any = None) -> stats.JobWaiting:
    holders = stats.job_holders(conn, stats.get_job(conn, job_id), clock or FixedClock(NOW))
    assert holders.waiting is not None
    return holders.waiting


def add(conn: db.Conn, job_type: str = "t.ok", **envelope: Any) -> uuid.UUID:
    """A job enqueued at NOW (the tests' clock: what the reads judge by, and the workers' heartbeats are set by)."""
    envelope.setdefault("clock", FixedClock(NOW))
    return enqueue(conn, job_type, {}, **envelope).id


def worker(
    conn: db.Conn, wid: str, tasks: str, queues: str | None = None, beat: float = 1, stopped: bool = False
) -> None:
    """A workers row: ``tasks`` and ``queues`` comma-separated (none: every queue), its last beat ``beat`` s ago."""
    conn.execute(
        "INSERT INTO workers (id, host, pid, queues, tasks, concurrency, last_heartbeat_at, stopped_at)"
        " VALUES (%s, 'h', 1, %s, %s, 4, %s, %s)",
        (wid, queues and queues.split(","), tasks.split(","), NOW - dt.timedelta(0, beat), NOW if stopped else None),
    )


def test_a_job_due_later_says_when_a_delayed_job_and_a_retry_in_its_backoff_are_due(conn: db.Conn) -> None:
    worker(conn, "w:1", "t.ok")
    later = add(conn, delay_seconds=3600)
    retry = add(conn)
    conn.execute(
        "UPDATE job_queue SET state = 'retry_scheduled', attempts = 1, scheduled_at = %s WHERE id = %s",
        (NOW + dt.timedelta(seconds=42), retry),
    )
    w = waiting(conn, later)
    assert (w.reasons, w.due_at, w.ahead) == (["due_later"], NOW + dt.timedelta(hours=1), None)
    w = waiting(conn, retry)
    assert (w.reasons, w.due_at) == (["due_later"], NOW + dt.timedelta(seconds=42))
    # once due, it is in line (nothing ahead of it: the delayed job is not due): its backoff no longer holds it
    conn.execute("UPDATE job_queue SET scheduled_at = %s WHERE id = %s", (NOW - dt.timedelta(seconds=1), retry))
    w = waiting(conn, retry)
    assert (w.reasons, w.due_at, w.ahead, w.ahead_more) == (["in_line"], None, 0, False)


def test_a_paused_queue_says_who_paused_it_when_and_why(conn: db.Conn) -> None:
    worker(conn, "w:1", "t.ok")
    job = add(conn, "t.ok", queue="billing")
    # at the read's (frozen) time: NOW is the module's import, minutes before this test under xdist
    ops.pause(conn, "billing", actor=ops.Actor("alice", "10.0.0.5"), reason="INC-7 double charges",
              clock=FixedClock(NOW))  # fmt: skip
    w = waiting(conn, job)
    assert w.reasons == ["queue_paused"]
    assert w.paused is not None
    assert (w.paused["changed_by"], w.paused["reason"]) == ("alice@10.0.0.5", "INC-7 double charges")
    assert w.paused["changed_at"] == NOW
    ops.resume(conn, "billing", actor=ops.Actor("bob"), reason="fixed")
    assert waiting(conn, job).reasons == ["in_line"]


def test_a_type_at_its_limit_says_the_limit_its_scope_what_runs_and_who_set_it(conn: db.Conn) -> None:
    worker(conn, "w:1", "t.ok")
    running = add(conn, "t.ok", queue="billing")
    job = add(conn, "t.ok", queue="billing")
    elsewhere = add(conn, "t.ok", queue="mail")
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'w:1', locked_until = %s WHERE id = %s",
        (NOW + dt.timedelta(minutes=5), running),
    )
    ops.set_limit(conn, "t.ok", 1, queue="billing", actor=ops.Actor("alice"), reason="the PDF service")
    w = waiting(conn, job)
    assert w.reasons == ["type_limit"]
    [limit] = w.full_limits
    assert {k: limit[k] for k in ("queue", "max_running", "running", "running_live", "source", "set_by", "reason")} == {
        "queue": "billing", "max_running": 1, "running": 1, "running_live": 1, "source": "operator", "set_by": "alice",
        "reason": "the PDF service",
    }  # fmt: skip
    assert waiting(conn, elsewhere).reasons == ["in_line"]  # billing's limit is not mail's
    # room in every queue's limit (2, 1 running), none in billing's own: both apply, billing's holds it
    ops.set_limit(conn, "t.ok", 2, actor=ops.Actor("bob"))
    w = waiting(conn, job)
    assert [r["queue"] for r in w.limits] == ["*", "billing"] and [r["queue"] for r in w.full_limits] == ["billing"]
    ops.set_limit(conn, "t.ok", 0, actor=ops.Actor("bob"), reason="INC-9")  # held everywhere
    assert [r["queue"] for r in waiting(conn, elsewhere).full_limits] == ["*"]


def test_a_lock_key_held_by_another_job_is_a_reason(conn: db.Conn) -> None:
    worker(conn, "w:1", "t.ok")
    holder = add(conn, lock_key="order:1")
    job = add(conn, lock_key="order:1")
    conn.execute(
        "INSERT INTO resource_locks (lock_key, token, job_id, expires_at) VALUES ('order:1', 't', %s, %s)",
        (holder, NOW + dt.timedelta(seconds=40)),
    )
    assert waiting(conn, job).reasons == ["lock_key"]
    conn.execute("UPDATE resource_locks SET expires_at = %s", (NOW - dt.timedelta(seconds=1),))
    assert waiting(conn, job).reasons == ["in_line"]  # a lease that ran out is free to take


def test_no_live_worker_says_where_its_workers_went(conn: db.Conn) -> None:
    job = add(conn, "sms.send", queue="mail")
    worker(conn, "other-queue", "sms.send", queues="default")
    worker(conn, "other-type", "t.ok")
    worker(conn, "stopped", "sms.send", stopped=True)
    worker(conn, "lost", "sms.send", queues="mail,default", beat=stats.LOST_AFTER_SECONDS + 5)
    w = waiting(conn, job)
    assert w.reasons == ["no_live_worker"]
    assert ([x.id for x in w.live_workers], [x.id for x in w.lost_workers]) == ([], ["lost"])
    worker(conn, "every-queue", "sms.send,t.ok")
    w = waiting(conn, job)
    assert ([x.id for x in w.live_workers], w.reasons) == (["every-queue"], ["in_line"])


def test_the_jobs_ahead_are_those_of_its_queue_due_before_it_in_the_claim_order(
    conn: db.Conn,
    claimers: Any,  # noqa: F811
) -> None:
    worker(conn, "w:1", "t.ok")
    early = NOW - dt.timedelta(minutes=10)

    def job(**envelope: Any) -> uuid.UUID:
        return add(conn, clock=FixedClock(early), **envelope)

    urgent = job(priority=-1)
    first, mine, behind = job(), job(), job()
    job(queue="mail", priority=-5)  # another queue
    # ahead, of another type: behind urgent (due a moment after it, not tied with it on (priority, due) and left to
    # the ids' order)
    other_type = add(conn, "t.flaky", clock=FixedClock(early + dt.timedelta(milliseconds=1)), priority=-1)
    job(priority=-9, delay_seconds=3600)  # first in the index, not due
    suspect = job(priority=-2)
    conn.execute("UPDATE job_queue SET suspect = true WHERE id = %s", (suspect,))  # claim_solo's, not the claim's
    # the claim order is (priority, scheduled_at, id): "first" due a second before "mine", "behind" a second after
    for jid, seconds in ((first, -1), (behind, 1)):
        conn.execute("UPDATE job_queue SET scheduled_at = %s WHERE id = %s", (early + dt.timedelta(0, seconds), jid))
    w = waiting(conn, mine)
    assert (w.reasons, w.ahead, w.ahead_of_type, w.ahead_more) == (["in_line"], 3, 2, False)  # urgent and first
    assert (waiting(conn, urgent).ahead, waiting(conn, behind).ahead) == (0, 4)
    assert waiting(conn, other_type).ahead == 1  # urgent
    assert waiting(conn, suspect).ahead is None  # a suspect: only an idle worker takes it (claim_solo)
    # the claim agrees: an idle worker takes the suspect alone (claim_solo), then the two of its type ahead of it go
    # first, and then it is next in line (for a worker that takes its type only)
    claimer = claimers(queues=("default",), registry_=registry.subset(["t.ok"]))
    assert [r["id"] for r in claimer.claim(2)] == [suspect]
    assert [r["id"] for r in claimer.claim(2)] == [urgent, first]
    w = waiting(conn, mine)
    assert (w.ahead, w.ahead_of_type) == (1, 0)


def test_the_count_ahead_is_bounded_and_says_when_it_is_a_floor(conn: db.Conn, monkeypatch: pytest.MonkeyPatch) -> None:
    worker(conn, "w:1", "t.ok")
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, scheduled_at) SELECT 't.ok', CASE WHEN g %% 2 = 0 THEN 'a' ELSE 'b'"
        " END, %s + g * interval '1 ms' FROM generate_series(1, 40) AS g",
        (NOW - dt.timedelta(hours=1),),
    )
    last = conn.execute("SELECT id FROM job_queue WHERE queue = 'a' ORDER BY scheduled_at DESC LIMIT 1").fetchone()
    assert last is not None
    w = waiting(conn, last["id"])
    assert (w.ahead, w.ahead_more) == (19, False)
    monkeypatch.setattr(stats, "AHEAD_SCAN", 10)  # 10 index entries walked, 5 of them in its queue
    w = waiting(conn, last["id"])
    assert (w.ahead, w.ahead_more) == (5, True)
    monkeypatch.setattr(stats, "AHEAD_SCAN", 1000)
    monkeypatch.setattr(stats, "AHEAD_CAP", 7)
    w = waiting(conn, last["id"])
    assert (w.ahead, w.ahead_more) == (7, True)


def test_the_count_ahead_walks_the_ready_index_at_most_ahead_scan_entries(conn: db.Conn) -> None:
    conn.execute(  # a backlog of 30,000 in two queues beside 20,000 finished jobs, its statistics fresh
        "INSERT INTO job_queue (job_type, queue, state, finished_at, scheduled_at) SELECT 't.ok',"
        " CASE WHEN g % 3 = 0 THEN 'small' ELSE 'bulk' END, CASE WHEN g % 5 < 3 THEN 'queued' ELSE 'succeeded' END,"
        " now(), now() - interval '1 hour' + g * interval '1 ms' FROM generate_series(1, 50000) AS g"
    )
    conn.execute("ANALYZE job_queue")
    row = conn.execute(
        "SELECT id FROM job_queue WHERE queue = 'small' AND state = 'queued' ORDER BY scheduled_at DESC LIMIT 1"
    ).fetchone()
    assert row is not None
    job = stats.get_job(conn, row["id"])
    params = {"job_type": "t.ok", "queue": "small", "now": NOW, "count_ahead": True, "priority": 0,
              "scheduled_at": job.scheduled_at, "id": job.id, "scan": stats.AHEAD_SCAN}  # fmt: skip
    explain = conn.execute("EXPLAIN (ANALYZE, COSTS OFF) " + queries["job_waiting"], params)
    plan = "\n".join(r["QUERY PLAN"] for r in explain)
    assert "Index Scan using job_queue_ready_idx on job_queue j " in plan and "Sort Key: j." not in plan, plan
    before = conn.execute("SELECT count(*) - 1 AS n FROM job_queue WHERE queue = 'small' AND state = 'queued'")
    before = before.fetchone()
    w = waiting(conn, job.id)
    assert before is not None and (w.ahead, w.ahead_more) == (before["n"], False)  # 30,000 walked: every one counted


def test_an_expired_lease_in_a_paused_queue_is_held_back_as_the_claim_holds_it(conn: db.Conn, claimers: Any) -> None:  # noqa: F811
    # the detail said "only an idle worker reclaims it" of a job whose queue was paused: claim_solo skips it there
    # (a kill or a poison pill still ends: expired_lease_fate says those)
    job = enqueue(conn, "t.ok", {}, clock=at(0), queue="q", timeout_seconds=5, visibility_timeout_seconds=VIS).id
    assert [r["id"] for r in claimers(clock=at(0)).claim(1)] == [job]
    ops.pause(conn, "q", actor=ops.Actor("tester"), reason="INC-3")

    def verdict() -> tuple[str | None, list[str]]:
        holders = stats.job_holders(conn, stats.get_job(conn, job), at(VIS + 1))
        assert holders.waiting is not None
        return stats.expired_lease_fate(stats.get_job(conn, job), holders), holders.waiting.lease_held_by

    assert verdict() == ("run_alone", ["queue_paused"])
    rescuer = claimers(clock=at(VIS + 1))
    rescuer._want_solo = True  # what a heartbeat that finds solo_work_waiting sets
    assert rescuer.claim(4) == []
    assert stats.get_job(conn, job).state.value == "running"
    ops.resume(conn, "q", actor=ops.Actor("tester"))
    assert verdict() == ("run_alone", [])
    ops.set_limit(conn, "t.ok", 0, actor=ops.Actor("tester"))
    assert verdict() == ("run_alone", ["type_limit"])
    ops.clear_limit(conn, "t.ok", actor=ops.Actor("tester"))
    rescuer.refresh_claim_filters()
    rescuer._want_solo = True
    assert [r["id"] for r in rescuer.claim(4)] == [job]  # resumed: taken back, to run alone


def test_the_detail_reads_one_statement_more_and_only_for_a_job_that_waits_or_holds_an_expired_lease(
    conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the console's job detail refreshes every 2 s over SSH: why it waits costs one statement, bounded, and nothing for
    # a job that runs on a live lease or has finished
    names = {text: name for name, text in queries.items()}
    ran: list[str] = []
    execute = conn.execute

    def counted(query: Any, *args: Any, **kwargs: Any) -> Any:
        ran.append(names.get(query, "other"))
        return execute(query, *args, **kwargs)

    waiting_job = add(conn, lock_key="order:1")
    running = add(conn)
    conn.execute("UPDATE job_queue SET state = 'running', locked_until = %s WHERE id = %s", (NOW, running))
    monkeypatch.setattr(conn, "execute", counted)
    for job_id, expected in (
        (waiting_job, ["job_lease_holder", "job_lock_key_holder", "job_lock", "job_waiting"]),
        (running, ["job_lease_holder", "job_lock"]),  # its lease live at NOW
    ):
        ran.clear()
        stats.job_holders(conn, stats.get_job(conn, job_id), FixedClock(NOW))
        assert ran[1:] == expected, ran  # after job_get
    ran.clear()
    stats.job_holders(conn, stats.get_job(conn, running), FixedClock(NOW + dt.timedelta(seconds=1)))
    assert ran[1:] == ["job_lease_holder", "job_lock", "job_waiting"]  # expired: what holds it back
