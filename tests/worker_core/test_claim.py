"""The claim (Worker.claim on real Worker instances, each with its own connection; nothing is run):
concurrency, order, what is not claimable, and the lease-expiry lane (rescue, poison pill, kill)."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.worker_core.helpers import TASKS
from worker_core import FixedClock, db, enqueue, enqueue_many, ops
from worker_core.clock import SYSTEM_CLOCK, Clock
from worker_core.registry import registry
from worker_core.sql import queries
from worker_core.worker import Worker, WorkerConfig

T0 = dt.datetime(2030, 6, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
VIS = 40.0  # the visibility timeout of the jobs below


def at(seconds: float) -> FixedClock:
    return FixedClock(T0 + dt.timedelta(seconds=seconds))


@pytest.fixture
def claimers(dsn: str) -> Iterator[Any]:
    """``claimer(clock=..., **config)``: a Worker used only for its claim; connections closed afterwards."""
    made: list[Worker] = []

    def make(clock: Clock = SYSTEM_CLOCK, registry_: Any = None, **overrides: Any) -> Worker:
        cfg = WorkerConfig(dsn=dsn, task_modules=TASKS, worker_id=f"claimer-{len(made)}", **overrides)
        w = Worker(cfg, registry=registry_, clock=clock)
        made.append(w)
        return w

    yield make
    for w in made:
        if w._claim_conn is not None:
            w._claim_conn.close()


def row(conn: db.Conn, job_id: uuid.UUID) -> dict[str, Any]:
    r = conn.execute("SELECT * FROM job_queue WHERE id = %s", (job_id,)).fetchone()
    assert r is not None
    return r


def counted(conn: db.Conn, w: Worker, name: str) -> int:
    """One counter of t.ok jobs as the worker's heartbeat writes it (its buffer flushed to job_metrics_minute)."""
    w.metrics.flush(conn)
    sql = f"SELECT coalesce(sum({name}), 0) AS n FROM job_metrics_minute WHERE job_type = 't.ok'"  # noqa: S608
    return int(conn.execute(sql).fetchone()["n"])  # type: ignore[index]


def seed(conn: db.Conn, n: int, clock: Clock = SYSTEM_CLOCK, **fields: Any) -> list[uuid.UUID]:
    results = enqueue_many(conn, [("t.ok", {"n": i}, fields) for i in range(n)], clock=clock)
    return [r.id for r in results]


def claim_in_threads(workers: list[Worker], limit: int) -> list[list[uuid.UUID]]:
    """Each worker claims until it gets nothing; all start together. Returns each one's claimed ids."""
    barrier = threading.Barrier(len(workers))
    claimed: list[list[uuid.UUID]] = [[] for _ in workers]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            workers[i]._conn_for_claims()  # connect before the barrier, so the claims really overlap
            barrier.wait(timeout=30)
            while True:
                rows = workers[i].claim(limit)
                if not rows:
                    return
                claimed[i].extend(r["id"] for r in rows)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a claimer did not finish"
    assert errors == []
    return claimed


def test_concurrent_claimers_claim_every_job_exactly_once(conn: db.Conn, claimers: Any) -> None:
    ids = seed(conn, 500)
    workers = [claimers() for _ in range(8)]
    claimed = claim_in_threads(workers, limit=7)
    everything = [i for c in claimed for i in c]
    dupes = [i for i, n in Counter(everything).items() if n > 1]
    assert dupes == []
    assert set(everything) == set(ids) and len(everything) == 500
    # every claimer's rows are held by that claimer, at attempt 1
    holders = {r["id"]: r for r in conn.execute("SELECT id, state, locked_by, attempts FROM job_queue")}
    for w, mine in zip(workers, claimed, strict=True):
        for i in mine:
            assert holders[i] == {"id": i, "state": "running", "locked_by": w.id, "attempts": 1}
    assert sum(1 for c in claimed if c) >= 2, "the claims did not overlap at all"


def test_concurrent_rescuers_take_every_expired_lease_exactly_once(conn: db.Conn, claimers: Any) -> None:
    ids = seed(conn, 60, clock=at(0), timeout_seconds=5, visibility_timeout_seconds=VIS)
    dead = claimers(clock=at(0))
    assert len(dead.claim(100)) == 60
    rescuers = [claimers(clock=at(VIS + 1)) for _ in range(8)]
    claimed = claim_in_threads(rescuers, limit=5)
    everything = [i for c in claimed for i in c]
    assert sorted(everything) == sorted(ids)  # each once
    rows = conn.execute("SELECT state, attempts, lease_expirations, locked_by FROM job_queue").fetchall()
    assert {(r["state"], r["attempts"], r["lease_expirations"]) for r in rows} == {("running", 2, 1)}
    assert {r["locked_by"] for r in rows} <= {w.id for w in rescuers}


def test_claim_order_is_priority_then_scheduled_at_and_respects_the_limit(conn: db.Conn, claimers: Any) -> None:
    def job(priority: int, at_s: float) -> uuid.UUID:
        return enqueue(conn, "t.ok", {}, priority=priority, clock=at(at_s)).id

    later_low = job(0, 5)
    urgent = job(-10, 9)
    early_low = job(0, 1)
    background = job(100, 0)
    w = claimers(clock=at(10))
    first = w.claim(2)
    assert [r["id"] for r in first] == [urgent, early_low]  # lower priority value first, then oldest
    assert [r["id"] for r in w.claim(10)] == [later_low, background]
    assert w.claim(10) == []


def test_a_paused_queue_is_not_claimed_until_resumed(conn: db.Conn, claimers: Any) -> None:
    slow = enqueue(conn, "t.ok", {}, queue="slow").id
    fast = enqueue(conn, "t.ok", {}, queue="fast").id
    ops.pause(conn, "slow", actor=ops.Actor("tester"))
    w = claimers()
    assert [r["id"] for r in w.claim(10)] == [fast]
    assert w.claim(10) == []
    assert row(conn, slow)["state"] == "queued"
    ops.resume(conn, "slow", actor=ops.Actor("tester"))
    w.refresh_claim_filters()  # what its listener does when the resume's notification arrives
    assert [r["id"] for r in w.claim(10)] == [slow]


def test_a_worker_claims_only_its_queues_and_registered_types(conn: db.Conn, claimers: Any) -> None:
    mine = enqueue(conn, "t.ok", {}, queue="billing").id
    other_queue = enqueue(conn, "t.ok", {}, queue="reports").id
    unregistered = enqueue(conn, "nobody.handles-this", {}, queue="billing").id
    not_in_subset = enqueue(conn, "t.flaky", {}, queue="billing").id
    w = claimers(queues=("billing",), registry_=registry.subset(["t.ok"]))
    assert [r["id"] for r in w.claim(10)] == [mine]
    assert w.claim(10) == []
    for j in (other_queue, unregistered, not_in_subset):
        assert row(conn, j)["state"] == "queued"
    everyone = claimers()
    assert {r["id"] for r in everyone.claim(10)} == {other_queue, not_in_subset}  # never the unregistered type
    assert row(conn, unregistered)["state"] == "queued"


def test_a_job_scheduled_in_the_future_is_not_claimed_before_its_time(conn: db.Conn, claimers: Any) -> None:
    j = enqueue(conn, "t.ok", {}, delay_seconds=60, clock=at(0)).id
    assert claimers(clock=at(59.999)).claim(10) == []
    assert row(conn, j)["state"] == "queued"
    assert [r["id"] for r in claimers(clock=at(60)).claim(10)] == [j]


def test_lease_expiry_rescue(conn: db.Conn, claimers: Any) -> None:
    j = enqueue(conn, "t.ok", {}, clock=at(0), timeout_seconds=5, visibility_timeout_seconds=VIS).id
    first = claimers(clock=at(0))
    assert [r["id"] for r in first.claim(1)] == [j]
    assert row(conn, j)["locked_until"] == T0 + dt.timedelta(seconds=VIS)

    assert claimers(clock=at(VIS - 0.001)).claim(10) == []  # the lease still holds
    rescuer = claimers(clock=at(VIS + 1))
    rows = rescuer.claim(10)
    assert [r["id"] for r in rows] == [j] and rows[0]["reclaimed"]
    r = row(conn, j)
    assert r["state"] == "running" and r["locked_by"] == rescuer.id
    assert r["attempts"] == 2 and r["lease_expirations"] == 1
    assert r["locked_until"] == T0 + dt.timedelta(seconds=2 * VIS + 1)
    (err,) = r["errors"]
    assert err["kind"] == "lease_expired" and err["worker"] == first.id and err["attempt"] == 1
    assert first.id in r["last_error"]
    assert counted(conn, rescuer, "lease_expirations") == 1


def test_poison_pill_is_dead_lettered_by_the_claim_without_running_again(conn: db.Conn, claimers: Any) -> None:
    """A lease lost while the job ran alone, with no attempts left, proves the job killed its process."""
    j = enqueue(conn, "t.ok", {}, clock=at(0), max_attempts=1, timeout_seconds=5, visibility_timeout_seconds=VIS).id
    assert [r["id"] for r in claimers(clock=at(0)).claim(4)] == [j]  # ran with others: not proof of guilt

    # its lease expires: it gets one attempt alone (the lost one, shared, is given back)
    solo = claimers(clock=at(VIS + 1)).claim(4)
    assert [(r["id"], r["ran_solo"]) for r in solo] == [(j, True)]
    r = row(conn, j)
    assert (r["state"], r["attempts"], r["max_attempts"]) == ("running", 2, 2)

    # it dies again, alone, with no attempts left: the claim dead-letters it and does not hand it out
    judge = claimers(clock=at(3 * VIS))
    assert judge.claim(4) == []
    r = row(conn, j)
    assert r["state"] == "dead_lettered" and r["attempts"] == 2 and r["lease_expirations"] == 2
    assert r["finished_at"] == T0 + dt.timedelta(seconds=3 * VIS) and r["locked_until"] is None
    assert [e["kind"] for e in r["errors"]] == ["lease_expired", "lease_expired"]
    assert "running this job alone" in r["errors"][-1]["message"]
    assert counted(conn, judge, "dead_lettered") == 1
    assert claimers(clock=at(10 * VIS)).claim(4) == []  # and it stays there


def test_expired_lease_with_attempts_left_is_reclaimed_not_dead_lettered(conn: db.Conn, claimers: Any) -> None:
    j = enqueue(conn, "t.ok", {}, clock=at(0), max_attempts=3, timeout_seconds=5, visibility_timeout_seconds=VIS).id
    claimers(clock=at(0)).claim(1)
    assert [r["id"] for r in claimers(clock=at(VIS + 1)).claim(1)] == [j]
    assert [r["id"] for r in claimers(clock=at(3 * VIS)).claim(1)] == [j]  # alone, attempt 3 of 3: runs
    r = row(conn, j)
    assert (r["state"], r["attempts"], r["lease_expirations"]) == ("running", 3, 2)


def test_kill_flag_and_expired_lease_end_cancelled(conn: db.Conn, claimers: Any) -> None:
    j = enqueue(conn, "t.ok", {}, clock=at(0), timeout_seconds=5, visibility_timeout_seconds=VIS).id
    claimers(clock=at(0)).claim(1)
    result = ops.kill(conn, [j], actor=ops.Actor("tester"), reason="runaway")
    assert result.changed == [j]
    assert row(conn, j)["cancel_requested"] and row(conn, j)["state"] == "running"  # its worker would see it
    # ... but the worker is gone: the next claim finishes the kill, without running it
    rescuer = claimers(clock=at(VIS + 1))
    assert rescuer.claim(4) == []
    r = row(conn, j)
    assert r["state"] == "cancelled" and r["attempts"] == 1 and not r["cancel_requested"]
    assert r["finished_at"] == T0 + dt.timedelta(seconds=VIS + 1)
    assert counted(conn, rescuer, "cancelled") == 1


def test_a_kill_or_a_poison_pill_ends_in_a_paused_queue_too(conn: db.Conn, claimers: Any) -> None:
    # the pause holds what would run again, not the end of a killed job whose worker is gone, nor a poison
    # pill's dead letter: the kill was accepted ("1 of 1 changed") and the job stayed running, holding its
    # dedup key, until someone resumed the queue
    killed = enqueue(conn, "t.ok", {}, clock=at(0), queue="q", timeout_seconds=5, visibility_timeout_seconds=VIS).id
    pill = enqueue(
        conn, "t.ok", {}, clock=at(0), queue="q", max_attempts=1, timeout_seconds=5, visibility_timeout_seconds=VIS
    ).id
    dropped = enqueue(
        conn, "t.ok", {}, clock=at(0), queue="q", max_attempts=3, timeout_seconds=5, visibility_timeout_seconds=VIS
    ).id
    claimers(clock=at(0)).claim(3)
    conn.execute("UPDATE job_queue SET ran_solo = true WHERE id = %s", (pill,))
    ops.kill(conn, [killed], actor=ops.Actor("tester"))
    ops.pause(conn, "q", actor=ops.Actor("tester"))
    rescuer = claimers(clock=at(VIS + 1))
    solo_waiting = conn.execute(queries["solo_work_waiting"], rescuer._claim_params(1)).fetchone()
    assert solo_waiting == {"waiting": True}
    for _ in range(3):
        rescuer._want_solo = True  # what a heartbeat that finds solo_work_waiting sets
        assert rescuer.claim(4) == []
    assert {j: row(conn, j)["state"] for j in (killed, pill, dropped)} == {
        killed: "cancelled", pill: "dead_lettered", dropped: "running"  # the pause holds the one that would run
    }
    solo_waiting = conn.execute(queries["solo_work_waiting"], rescuer._claim_params(1)).fetchone()
    assert solo_waiting == {"waiting": False}


def test_a_limit_of_zero_holds_expired_leases_and_suspects_too(conn: db.Conn, claimers: Any) -> None:
    """`limit T 0` holds T in the solo lane too: an expired lease or a suspect of T is the job most likely
    to crash processes, during the incident the hold contains. A kill still ends there."""
    held = enqueue(conn, "t.ok", {}, clock=at(0), max_attempts=3, timeout_seconds=5, visibility_timeout_seconds=VIS).id
    killed = enqueue(conn, "t.ok", {}, clock=at(0), timeout_seconds=5, visibility_timeout_seconds=VIS).id
    claimers(clock=at(0)).claim(2)
    ops.kill(conn, [killed], actor=ops.Actor("tester"))
    ops.set_limit(conn, "t.ok", 0, reason="incident")
    waiting = claimers(clock=at(VIS + 1))
    assert waiting.claim(4) == []
    assert row(conn, killed)["state"] == "cancelled"  # the kill's end is not held
    assert waiting.claim(4) == []
    r = row(conn, held)
    assert (r["state"], r["attempts"], r["lease_expirations"]) == ("running", 1, 0)  # not reclaimed
    solo_waiting = conn.execute(queries["solo_work_waiting"], waiting._claim_params(1)).fetchone()
    assert solo_waiting == {"waiting": False}  # nor does it make the worker drain for it, beat after beat
    ops.clear_limit(conn, "t.ok")
    freed = claimers(clock=at(VIS + 2))
    assert [(r["id"], r["ran_solo"]) for r in freed.claim(4)] == [(held, True)]


def test_queues_under_one_types_cap_take_turns(conn: db.Conn, claimers: Any) -> None:
    """`limit T 2` and `limit T 5 --queue bulk`: the type-wide room went, claim after claim, to the first
    scope with a backlog (bulk's own pass came first), and the default queue's jobs starved."""
    enqueue_many(conn, [("t.ok", {}, {"queue": "default", "priority": 0}) for _ in range(5)])
    enqueue_many(conn, [("t.ok", {}, {"queue": "bulk", "priority": 10}) for _ in range(30)])
    ops.set_limit(conn, "t.ok", 2, reason="type cap", actor=ops.Actor("tester"))
    ops.set_limit(conn, "t.ok", 5, queue="bulk", reason="bulk cap", actor=ops.Actor("tester"))
    w = claimers()
    claimed: list[str] = []
    for _ in range(4):
        rows = w.claim(4)
        assert len(rows) == 2  # the type's cap, every time
        claimed += [r["queue"] for r in rows]
        conn.execute("UPDATE job_queue SET state = 'succeeded', finished_at = now() WHERE state = 'running'")
    assert Counter(claimed) == {"default": 4, "bulk": 4}


FINISHED_OTHER_TYPES = """
INSERT INTO job_queue (job_type, queue, payload, state, attempts, max_attempts, scheduled_at, finished_at)
SELECT 'other.type' || (g %% 4), 'default', '{}', 'succeeded', 1, 5, now() - interval '1 day', now()
FROM generate_series(1, %(n)s) AS g
"""


def test_a_batch_claim_walks_the_ready_index_in_order_when_the_backlog_is_one_type_among_many(
    conn: db.Conn, claimers: Any
) -> None:
    # a backlog of one type in a table of finished jobs of other types: taken as independent, the state
    # and type predicates make the planner expect a handful of rows, read the backlog through another index
    # and sort all of it on every claim. The joint statistics of migration 0008 keep it on the ready index.
    conn.execute(FINISHED_OTHER_TYPES, {"n": 200_000})
    seed(conn, 5000)
    conn.execute("ANALYZE job_queue")
    w = claimers()
    explain = "EXPLAIN " + queries["claim"]  # the plan only: nothing is claimed
    plan = "\n".join(r["QUERY PLAN"] for r in w._conn_for_claims().execute(explain, w._claim_params(96)))
    assert "job_queue_ready_idx" in plan and "Sort" not in plan, plan
    # and the generic plan the worker runs, planned once with its filters
    plan = generic_claim_plan(w, 96)
    assert "job_queue_ready_idx" in plan and "Sort" not in plan and "$1" in plan, plan


def test_no_claim_can_read_the_indexes_of_waiting_jobs_for_the_console(conn: db.Conn, claimers: Any) -> None:
    # job_queue_waiting_updated_idx covers the ready jobs too, by updated_at: a claim planned on stale
    # statistics took it (narrower than the ready index), read every ready job and sorted them. Its
    # predicate has a term no claim implies. Without the other indexes a claim could use, a plan that
    # may use it would.
    seed(conn, 50)
    w = claimers()
    claim_conn = w._conn_for_claims()
    claim_conn.autocommit = False
    try:
        claim_conn.execute("DROP INDEX job_queue_ready_idx")
        claim_conn.execute("SET LOCAL enable_seqscan = off")
        explain = "EXPLAIN " + queries["claim"]
        plan = "\n".join(r["QUERY PLAN"] for r in claim_conn.execute(explain, w._claim_params(96)))
        # nor the index of the waiting jobs' counts (migration 0011), whose predicate is written alike
        assert "job_queue_waiting_updated_idx" not in plan and "job_queue_waiting_idx" not in plan, plan
    finally:
        claim_conn.rollback()
        claim_conn.autocommit = True


def test_the_generic_claim_finds_its_rows_by_id_in_a_deep_backlog(conn: db.Conn, claimers: Any) -> None:
    # a plan that cannot know the LIMIT expects thousands of ready rows: joined to the table, it would
    # hash all of it on every claim (35 ms at 100,000 jobs instead of 2)
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, scheduled_at, created_at, updated_at) "
        "SELECT 't.ok', 'default', '{}', now(), now(), now() FROM generate_series(1, 40000)"
    )
    conn.execute("ANALYZE job_queue")
    plan = generic_claim_plan(claimers(), 96)
    assert "Seq Scan" not in plan and "Hash" not in plan, plan


def generic_claim_plan(w: Worker, limit: int) -> str:
    """The plan of the worker's prepared claim as it runs it (claims one job to prepare it)."""
    conn = w._conn_for_claims()
    w.claim(1)
    with conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        rows = conn.execute(f"EXPLAIN EXECUTE worker_core_claim(now(), {int(limit)})", prepare=False)
        return "\n".join(r["QUERY PLAN"] for r in rows)


def test_the_claim_is_planned_once_then_runs_its_generic_plan_with_the_filters_written_in(
    conn: db.Conn, claimers: Any
) -> None:
    seed(conn, 6)
    enqueue(conn, "t.ok", {}, queue="slow")
    ops.pause(conn, "slow", actor=ops.Actor("tester"))
    w = claimers()
    # a value neither the claim's nor a server default: the claim's own settings must not outlive it
    w._conn_for_claims().execute("SET synchronous_commit = remote_write")
    for _ in range(3):
        assert len(w.claim(2)) == 2
    stmt = w._conn_for_claims().execute(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements WHERE name = 'worker_core_claim'"
    ).fetchone()
    assert stmt is not None and (stmt["generic_plans"], stmt["custom_plans"]) == (3, 0)
    assert "'{slow}'" in stmt["statement"] and w.id in stmt["statement"]  # the paused queue, the lease holder
    # the settings are the claim's own: the connection's other statements are planned per call and commit
    # as the session says
    settings = w._conn_for_claims().execute(
        "SELECT current_setting('plan_cache_mode') AS plan, current_setting('synchronous_commit') AS sync"
    ).fetchone()
    assert settings == {"plan": "force_custom_plan", "sync": "remote_write"}


def test_an_idle_workers_claim_skips_the_wal_flush_and_a_claim_through_a_backlog_waits_for_it(
    conn: db.Conn, claimers: Any
) -> None:
    seed(conn, 3)
    w = claimers()
    sent: list[bytes] = []
    claim_conn = w._conn_for_claims()
    execute = claim_conn.execute

    def spy(query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(query if isinstance(query, bytes) else b"")
        return execute(query, *args, **kwargs)

    claim_conn.execute = spy  # type: ignore[method-assign]
    assert len(w.claim(1)) == 1  # a fresh worker is idle
    w._backlog = True  # what the claim loop sets after a full batch
    assert len(w.claim(1)) == 1
    runs = [q for q in sent if b"EXECUTE worker_core_claim" in q]
    assert [b"'synchronous_commit', 'off'" in q for q in runs] == [True, False]
    assert b"'synchronous_commit', 'on'" in runs[1]


def test_the_claim_survives_a_rollback_on_its_connection(conn: db.Conn, claimers: Any) -> None:
    # psycopg deallocates every prepared statement of a connection after a ROLLBACK there
    ids = seed(conn, 2)
    w = claimers()
    first = [r["id"] for r in w.claim(1)]
    with w._conn_for_claims().transaction(force_rollback=True):
        w._conn_for_claims().execute("SELECT 1")
    assert sorted(first + [r["id"] for r in w.claim(1)]) == sorted(ids)


def test_settling_and_heartbeats_find_the_running_jobs_by_id_not_through_the_running_index(
    conn: db.Conn, claimers: Any
) -> None:
    # between vacuums the running index is mostly dead entries of jobs settled since, which its statistics
    # do not count: a batch settlement that read it took 76 ms for 450 jobs in a 40,000-job drain
    from worker_core.execution import Execution, array_literal, settle_many_params

    conn.execute(FINISHED_OTHER_TYPES, {"n": 5000})
    seed(conn, 60)
    conn.execute("ANALYZE job_queue")  # nothing running, as far as the planner knows
    w = claimers()
    claimed = w.claim(50)
    batch = [Execution(job=r, ctx=None) for r in claimed]  # type: ignore[arg-type]
    params = settle_many_params(w, batch)
    beat = {"ids": array_literal([r["id"] for r in claimed]), "worker": w.id, "now": w.clock.now()}
    one = {"id": claimed[0]["id"], "attempt": claimed[0]["attempts"], "worker": w.id, "now": w.clock.now(),
           "state": "failed", "scheduled_at": w.clock.now(), "error": "{}", "last_error": "x", "fingerprint": "x"}
    singles = [(name, one) for name in ("settle_succeeded", "settle_error", "release_job")]
    group = {**params, "lock_wait": "5000"}
    for name, args in [("settle_succeeded_many", params), ("settle_group", group), ("heartbeat_jobs", beat), *singles]:
        plan = "\n".join(r["QUERY PLAN"] for r in conn.execute("EXPLAIN " + queries[name], args))
        assert "job_queue_pkey" in plan and "job_queue_running_idx" not in plan, plan
    # still fenced per job: one whose attempt moved on is not settled
    batch[0].job = {**batch[0].job, "attempts": batch[0].job["attempts"] + 1}
    settled = conn.execute(queries["settle_succeeded_many"], settle_many_params(w, batch)).fetchall()
    assert {r["id"] for r in settled} == {r["id"] for r in claimed[1:]}
    assert row(conn, claimed[0]["id"])["state"] == "running"


def test_a_groups_settlement_bounds_its_own_wait_and_puts_the_transactions_lock_timeout_back(
    dsn: str, conn: db.Conn, claimers: Any
) -> None:
    # the bound is the settlement's: a handler's SET LOCAL lock_timeout (for its deferred triggers) holds at the
    # COMMIT after it, and a session without one has none after it
    from worker_core.execution import Execution, settle_many_params

    seed(conn, 3)
    w = claimers()
    batch = [Execution(job=r, ctx=None) for r in w.claim(3)]  # type: ignore[arg-type]
    params = {**settle_many_params(w, batch[:2]), "lock_wait": "300"}
    with db.connect(dsn) as slot:
        slot.execute("SET LOCAL lock_timeout = '7s'")
        assert len(slot.execute(queries["settle_group"], params).fetchall()) == 2
        assert slot.execute("SHOW lock_timeout").fetchone() == {"lock_timeout": "7s"}
        slot.rollback()
        with db.connect(dsn) as operator:
            operator.execute("SELECT 1 FROM job_queue WHERE id = %s FOR UPDATE", (batch[1].job["id"],))
            started = time.monotonic()
            with pytest.raises(psycopg.errors.LockNotAvailable):
                slot.execute(queries["settle_group"], params)
            assert time.monotonic() - started < 5
            slot.rollback()
        params = {**settle_many_params(w, batch[2:]), "lock_wait": "300"}
        assert len(slot.execute(queries["settle_group"], params).fetchall()) == 1
        assert slot.execute("SHOW lock_timeout").fetchone() == {"lock_timeout": "0"}


def test_a_limited_types_job_is_not_claimed_behind_the_whole_unlimited_backlog(conn: db.Conn, claimers: Any) -> None:
    # the limited lane got the room the main claim left: none through a backlog, whatever the priorities
    seed(conn, 300, priority=100)
    urgent = enqueue(conn, "t.flaky", {}, priority=-100).id
    ops.set_limit(conn, "t.flaky", 5, reason="at most 5 at once")
    conn.commit()
    claimed = claimers().claim(10)
    assert claimed[0]["id"] == urgent and len(claimed) == 10


def test_idle_workers_reclaiming_together_keep_a_limit(dsn: str, conn: db.Conn, claimers: Any) -> None:
    # claim_solo checked the limit in its own snapshot, with no lock: after a crash, idle workers reclaimed
    # one job each at the same moment, three running under a limit of 1
    lease = {"timeout_seconds": 5, "visibility_timeout_seconds": VIS}
    ids = [enqueue(conn, "t.ok", {}, clock=at(0), **lease).id for _ in range(3)]
    conn.commit()
    assert len(claimers(clock=at(0)).claim(3)) == 3  # a worker that then dies
    ops.set_limit(conn, "t.ok", 1, reason="one at a time")
    conn.commit()
    rescuers = [claimers(clock=at(VIS + 1)) for _ in range(3)]
    for w in rescuers:
        w._refresh_claim_filters(w._conn_for_claims())
        w._want_solo = True  # what a heartbeat that finds solo_work_waiting sets
    barrier = threading.Barrier(3)

    def claim(w: Worker) -> None:
        barrier.wait()
        w.claim(4)

    threads = [threading.Thread(target=claim, args=(w,)) for w in rescuers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    live = "SELECT count(*) AS n FROM job_queue WHERE state = 'running' AND locked_until > %s AND id = ANY(%s)"
    assert conn.execute(live, (at(VIS + 1).now(), ids)).fetchone() == {"n": 1}
