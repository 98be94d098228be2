"""What keeps the worker fast without weakening the contract: a prefetch buffer (a job killed while it
waits there never starts), batched settlement of jobs with no transactional effect, groups of jobs sharing
one commit (each in its own savepoint), and planner statistics refreshed by housekeeping after a burst."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from tests.worker_core.helpers import (
    WorkerThread,
    config,
    job,
    ledger,
    metric,
    run_burst,
    run_worker_until,
    running_worker,
    state,
    wait_for,
)
from worker_core import db, ops
from worker_core.errors import TransientError
from worker_core.execution import (
    MAX_RETRY_IN_SECONDS,
    OUTAGE_PAUSE,
    UNRECORD_GROUP_KEYS,
    JobConnection,
    Slot,
    _retry_in,
    fill,
)
from worker_core.maintenance import analyze_if_stale
from worker_core.producer import enqueue, enqueue_many
from worker_core.sql import queries
from worker_core.worker import Worker


def test_a_job_killed_in_the_prefetch_buffer_never_starts(dsn: str, conn: db.Conn) -> None:
    blocker = enqueue(conn, "t.slow", {"seconds": 1.5}, priority=0).id
    waiting = enqueue(conn, "t.ok", {"ledger": True, "item": "must-not-run"}, priority=1).id
    with running_worker(dsn, concurrency=1, prefetch=1, heartbeat_interval=0.1) as worker:
        wait_for(lambda: state(dsn, blocker) == "running" and state(dsn, waiting) == "running", timeout=10)
        assert waiting in worker._in_flight  # claimed ahead, waiting for the busy slot
        ops.kill(conn, [waiting])
        wait_for(lambda: state(dsn, waiting) == "cancelled", timeout=10)
        wait_for(lambda: state(dsn, blocker) == "succeeded", timeout=10)
    assert ledger(dsn) == []


def test_successes_without_effects_settle_in_batches(dsn: str, conn: db.Conn) -> None:
    enqueue_many(conn, [("t.ok", {}) for _ in range(60)])
    enqueue_many(conn, [("t.ok", {"ledger": True, "item": f"e{i}"}) for i in range(5)])
    enqueue(conn, "t.ledger", {"item": "k"}, idempotency_key="k")
    worker = run_burst(dsn, concurrency=4)
    assert conn.execute("SELECT count(*) AS n FROM job_queue WHERE state = 'succeeded'").fetchone() == {"n": 66}
    # the 60 that never touched ctx.tx went through the completer; the 6 with effects committed their own
    assert worker.completer.flushed == 60
    assert sorted(r["item"] for r in ledger(dsn)) == [*(f"e{i}" for i in range(5)), "k"]


def test_async_successes_without_effects_settle_in_batches_too(dsn: str, conn: db.Conn) -> None:
    enqueue_many(conn, [("t.async_plain", {}) for _ in range(20)])
    enqueue_many(conn, [("t.async_ok", {"item": f"a{i}"}) for i in range(2)])
    worker = run_burst(dsn, concurrency=2)
    assert conn.execute("SELECT count(*) AS n FROM job_queue WHERE state = 'succeeded'").fetchone() == {"n": 22}
    assert worker.completer.flushed == 20  # the two that wrote through ctx.tx committed their own
    assert sorted(r["item"] for r in ledger(dsn)) == ["a0", "a1"]


def test_a_batched_success_is_counted_only_once_its_settlement_went_through(dsn: str, conn: db.Conn) -> None:
    """A job another worker took over while its handler ran: the completer's fenced settlement refuses
    it, and this worker does not count it a success (the taker counts its own run)."""
    taken = enqueue(conn, "t.slow", {"seconds": 1.0}).id
    kept = enqueue(conn, "t.ok", {}).id
    with running_worker(dsn, concurrency=2, heartbeat_interval=30.0) as worker:
        wait_for(lambda: state(dsn, taken) == "running", timeout=10)
        # as a rescuer would after a lease ran out: the row is no longer this worker's
        conn.execute("UPDATE job_queue SET locked_by = 'rescuer' WHERE id = %s", (taken,))
        wait_for(lambda: state(dsn, kept) == "succeeded" and not worker._in_flight, timeout=10)
        wait_for(lambda: worker.completer.pending() == 0, timeout=10)
    assert state(dsn, taken) == "running"  # still the rescuer's
    assert metric(dsn, "succeeded", "t.slow") == 0
    assert metric(dsn, "succeeded", "t.ok") == 1


def test_the_rows_a_blocked_completer_batch_holds_keep_their_leases(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the jobs waiting for the completer had their leases extended by no beat: with its settlement waiting on
    # the row an operator held, they ran out and the jobs ran again. Then, with beats that skip locked rows,
    # the rows its own waiting statement held were skipped, and once it failed an idle worker's claim took
    # them ("lease expired: worker ... died or froze")
    from worker_core.completer import Completer

    monkeypatch.setattr(db, "OWN_STATEMENT_TIMEOUT_MS", 8000)  # a waiting statement fails within the hold
    lease = {"timeout_seconds": 0.5, "visibility_timeout_seconds": 6}
    ids = [enqueue(conn, "t.ok", {"i": i}, **lease).id for i in range(4)]
    operator = db.connect(dsn)
    flush = Completer._flush
    holding: list[uuid.UUID] = []

    def behind_the_operator(self: Completer, batch: list[Any]) -> list[Any]:
        if not holding:
            wait_for(lambda: len(batch) + len(self._pending) >= 4, 10, what="all four done")
            while self._pending:
                batch.append(self._pending.popleft())  # the same list as self._flushing
            holding.append(max(ex.job["id"] for ex in batch))  # the last row its ordered lock comes to
            operator.execute("SELECT 1 FROM job_queue WHERE id = %s FOR UPDATE", (holding[0],))
        return flush(self, batch)

    monkeypatch.setattr(Completer, "_flush", behind_the_operator)
    other = Worker(config(dsn, burst=False))  # another worker of the fleet, idle: its claim_solo, polled
    reclaimed: list[dict[str, Any]] = []
    try:
        with running_worker(dsn, concurrency=4, heartbeat_interval=0.3) as w:
            wait_for(lambda: holding, 10, what="the completer to come to the held row")
            # past their 6 s leases the operator lets go (its row's lease ran out under its lock: who takes
            # it?), while the poll goes on
            letting_go = threading.Timer(9, lambda: (operator.rollback(), operator.close()))
            letting_go.start()
            start = time.monotonic()
            with db.connect(dsn, autocommit=True) as c:
                while time.monotonic() - start < 11:
                    reclaimed += c.execute(queries["claim_solo"], other._claim_params(1)).fetchall()
                    time.sleep(0.005)
            letting_go.join()
            wait_for(lambda: all(state(dsn, j) == "succeeded" for j in ids) and not w.completer.pending(), 20,
                     what="all settled")  # fmt: skip
    finally:
        operator.close()
    # the operator's own row: its lease ran out under the lock, and when the lock goes, whichever claim comes
    # first may take it (README, "Leases")
    others = [job(dsn, j) for j in ids if j != holding[0]]
    assert {r["id"] for r in reclaimed} <= {holding[0]}
    assert [(r["attempts"], r["lease_expirations"]) for r in others] == [(1, 0)] * 3, [r["last_error"] for r in others]


def test_a_drain_never_parks_the_claimer_on_a_completer_that_settles(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the claimer stopped whenever max_in_flight jobs waited for the completer: in a plain drain of no-op
    # jobs it holds hundreds between two flushes, and the claimer, parked on that, left the slots idle
    for _ in range(4):
        enqueue_many(conn, [("t.ok", {}) for _ in range(2500)])
    parked: list[int] = []
    full = Worker._completer_full

    def watched(self: Worker) -> bool:
        if answer := full(self):
            parked.append(self.completer.pending())
        return answer

    monkeypatch.setattr(Worker, "_completer_full", watched)
    run_burst(dsn, timeout=120, concurrency=4)
    assert parked == [], f"the claimer was parked on the completer {len(parked)} times (max {max(parked)})"


def test_a_worker_whose_completer_cannot_settle_stops_claiming(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the jobs waiting for the completer are out of the in-flight set: while it could not settle (the
    # database refusing its statement) and claims went through, the worker claimed and ran on, and they grew
    # without limit
    from worker_core.completer import Completer

    flush = Completer._flush
    refusing = threading.Event()
    refusing.set()

    def refused(self: Completer, batch: list[Any]) -> list[Any]:
        if refusing.is_set():
            raise psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
        return flush(self, batch)

    monkeypatch.setattr(Completer, "_flush", refused)
    with running_worker(dsn, concurrency=2, prefetch=0, group_max=1) as w:
        assert w.max_in_flight == 8
        # the worker learns it cannot settle from its completer's first failed flush; what it claimed before that
        # (as many jobs as it ran in a flush's time, more on a slow machine) is not what is bounded here
        enqueue_many(conn, [("t.ok", {"i": -1})])
        wait_for(lambda: w.completer.failing, 10, what="the completer's first failure")
        enqueue_many(conn, [("t.ok", {"i": i}) for i in range(40)])
        wait_for(lambda: w.completer.pending() >= 8, 10, what="the completer to fill up")
        time.sleep(1)
        # a claim's worth past the bound at most (the one that filled it)
        assert w.completer.pending() <= 2 * w.max_in_flight and not w._in_flight
        refusing.clear()  # it settles again: the claimer goes on
        wait_for(lambda: conn.execute("SELECT count(*) AS n FROM job_queue WHERE state = 'succeeded'").fetchone()
                 == {"n": 41}, 20, what="all settled")  # fmt: skip


def test_housekeeping_analyzes_a_queue_table_after_a_burst(conn: db.Conn) -> None:
    enqueue_many(conn, [("t.ok", {}) for _ in range(3000)])
    assert analyze_if_stale(conn) is True
    assert analyze_if_stale(conn) is False  # fresh now


# one claim, handed to the one slot as one group: room for all the jobs in the prefetch buffer, and a group
# window that these handlers fill only by the dozen
ONE_GROUP: dict[str, Any] = {"concurrency": 1, "prefetch": 20, "group_seconds": 10.0}


def run_grouped(dsn: str, **overrides: Any) -> Worker:
    """A burst worker that has measured its handlers already: their jobs are handed out in groups."""
    wt = WorkerThread(dsn, **{**ONE_GROUP, **overrides})
    for job_type in ("t.ledger", "t.stubborn"):
        wt.worker.observe_handler(job_type, 0.01)
    assert wt.start().join(60) == 0
    return wt.worker


def finished(conn: db.Conn, ids: list[uuid.UUID]) -> list[Any]:
    rows = conn.execute("SELECT id, finished_at FROM job_queue WHERE id = ANY(%s)", (ids,)).fetchall()
    at = {r["id"]: r["finished_at"] for r in rows}
    return [at[i] for i in ids]


def test_a_group_commits_together_and_a_failure_rolls_back_only_its_own_job(dsn: str, conn: db.Conn) -> None:
    # job 3 writes its ledger row, then fails on its first attempt: that write must vanish, the others' stay
    ids = [
        enqueue(conn, "t.ledger", {"item": f"i{i}", "fail_after_write": 1 if i == 3 else 0}, idempotency_key=f"g{i}").id
        for i in range(8)
    ]
    run_grouped(dsn)
    for i, j in enumerate(ids):
        row = job(dsn, j)
        assert (row["state"], row["attempts"]) == ("succeeded", 2 if i == 3 else 1)
    assert sorted((r["item"], r["attempt"]) for r in ledger(dsn)) == [
        (f"i{i}", 2 if i == 3 else 1) for i in range(8)
    ]
    # the seven that succeeded at once were settled by one statement in one transaction
    others = [j for i, j in enumerate(ids) if i != 3]
    assert len(set(finished(conn, others))) == 1
    assert job(dsn, ids[3])["finished_at"] > finished(conn, others)[0]
    keys = conn.execute("SELECT idempotency_key, job_id FROM processed_keys ORDER BY 1").fetchall()
    assert [(k["idempotency_key"], k["job_id"]) for k in keys] == [(f"g{i}", j) for i, j in enumerate(ids)]


def test_a_key_processed_earlier_in_the_same_group_is_a_hit(dsn: str, conn: db.Conn) -> None:
    first = enqueue(conn, "t.ledger", {"item": "once"}, idempotency_key="same", priority=0).id
    again = enqueue(conn, "t.ledger", {"item": "twice"}, idempotency_key="same", priority=1).id
    run_grouped(dsn)
    assert state(dsn, first) == state(dsn, again) == "succeeded"
    assert [r["item"] for r in ledger(dsn)] == ["once"]
    assert finished(conn, [first])[0] == finished(conn, [again])[0]  # one group


def processed(conn: db.Conn) -> dict[str, Any]:
    rows = conn.execute("SELECT idempotency_key, job_id, processed_at FROM processed_keys").fetchall()
    return {r["idempotency_key"]: r for r in rows}


def test_a_group_records_its_keys_in_one_statement_and_finds_the_processed_ones(dsn: str, conn: db.Conn) -> None:
    earlier = enqueue(conn, "t.ledger", {"item": "earlier"}, idempotency_key="done").id
    run_grouped(dsn)
    ids = [enqueue(conn, "t.ledger", {"item": f"i{i}"}, idempotency_key=f"b{i}", priority=i).id for i in range(4)]
    again = enqueue(conn, "t.ledger", {"item": "again"}, idempotency_key="done", priority=9).id
    run_grouped(dsn)
    assert all(state(dsn, j) == "succeeded" for j in [*ids, again])
    assert sorted(r["item"] for r in ledger(dsn)) == ["earlier", "i0", "i1", "i2", "i3"]  # "again" was a hit
    keys = processed(conn)
    assert keys["done"]["job_id"] == earlier
    assert [keys[f"b{i}"]["job_id"] for i in range(4)] == ids
    # one statement, one clock reading: a record per job would each have read the clock
    assert len({keys[f"b{i}"]["processed_at"] for i in range(4)}) == 1


def test_a_key_twice_in_a_group_whose_first_job_fails_goes_to_the_second(dsn: str, conn: db.Conn) -> None:
    # the group's statement records x for the first job; it fails, so its record goes with its rollback and
    # the second job with x records it and runs; the first job's retry is then a hit
    first = enqueue(conn, "t.ledger", {"item": "x-first", "fail_after_write": 1}, idempotency_key="x", priority=0).id
    other = enqueue(conn, "t.ledger", {"item": "y"}, idempotency_key="y", priority=1).id
    second = enqueue(conn, "t.ledger", {"item": "x-second"}, idempotency_key="x", priority=2).id
    run_grouped(dsn)
    assert sorted((r["item"], r["attempt"]) for r in ledger(dsn)) == [("x-second", 1), ("y", 1)]
    assert (job(dsn, first)["state"], job(dsn, first)["attempts"]) == ("succeeded", 2)
    assert state(dsn, other) == state(dsn, second) == "succeeded"
    assert processed(conn)["x"]["job_id"] == second


def test_a_grouped_job_killed_before_it_began_leaves_no_idempotency_record(dsn: str, conn: db.Conn) -> None:
    # the group's first statement recorded all three keys; the second job is killed while the first runs
    payloads = [{"item": "k0", "sleep": 0.6}, {"item": "k1"}, {"item": "k2"}]
    ids = [enqueue(conn, "t.ledger", p, idempotency_key=f"k{i}", priority=i).id for i, p in enumerate(payloads)]
    w = Worker(config(dsn))
    executions = [w._dispatch(r) for r in w.claim(10)]
    assert [ex.job["id"] for ex in executions] == ids
    # as the heartbeat does when an operator kills it
    killer = threading.Timer(0.2, executions[1].ctx.cancel, args=("killed",))
    killer.start()
    Slot(w, 0).run_group(executions)
    killer.join()
    assert [state(dsn, j) for j in ids] == ["succeeded", "cancelled", "succeeded"]
    assert sorted(processed(conn)) == ["k0", "k2"]
    assert sorted(r["item"] for r in ledger(dsn)) == ["k0", "k2"]


@pytest.mark.parametrize("lock_key", [None, "hit-lock"], ids=["grouped", "alone"])
def test_an_idempotency_hit_does_not_count_as_handler_time(dsn: str, conn: db.Conn, lock_key: str | None) -> None:
    # a hit runs no handler: counted at ~0 s it would make a slow type look fast, and its jobs fill groups
    enqueue(conn, "t.ledger", {"item": "first"}, idempotency_key="hk")
    run_grouped(dsn)
    again = enqueue(conn, "t.ledger", {"item": "again"}, idempotency_key="hk", lock_key=lock_key).id
    w = run_grouped(dsn)
    assert state(dsn, again) == "succeeded" and [r["item"] for r in ledger(dsn)] == ["first"]
    assert w._handler_seconds["t.ledger"] == 0.01  # as run_grouped measured it: nothing ran


def test_grouping_can_be_turned_off(dsn: str, conn: db.Conn) -> None:
    ids = [enqueue(conn, "t.ledger", {"item": f"i{i}"}, idempotency_key=f"n{i}").id for i in range(4)]
    run_grouped(dsn, group_max=1)
    assert len(set(finished(conn, ids))) == 4  # a transaction per job


def test_a_stuck_handler_in_a_group_gives_back_the_uncommitted_jobs_before_it(dsn: str, conn: db.Conn) -> None:
    # the first job's effect waits for the group's commit when the second job's handler hangs past its
    # timeout: the watchdog abandons the slot, and that effect runs again rather than being lost
    done = enqueue(conn, "t.ledger", {"item": "before"}, idempotency_key="before", priority=0).id
    stuck = enqueue(conn, "t.stubborn", {"seconds": 2.5, "item": "late"}, priority=1).id
    w = run_grouped(dsn, cancel_grace=0.2)
    assert w.zombies == 1
    assert job(dsn, stuck)["state"] == "dead_lettered"
    row = job(dsn, done)
    assert (row["state"], row["attempts"]) == ("succeeded", 1)  # given back without counting an attempt
    assert [r["item"] for r in ledger(dsn)] == ["before"]


def test_jobs_are_handed_out_in_groups_that_fit_the_window_of_their_measured_handler_time(dsn: str) -> None:
    w = Worker(config(dsn, group_seconds=0.02, group_max=8))
    w.observe_handler("t.ok", 0.001)  # 20 fit the window: groups of group_max
    w.observe_handler("t.slow", 0.015)  # one fits
    rows = [("t.ok", None)] * 10 + [("t.slow", None)] * 2 + [("t.ledger", None)] * 2 + [("t.ok", "lock")] * 2
    w._hand_out([
        w._dispatch({"id": uuid.uuid4(), "job_type": t, "lock_key": lock, "ran_solo": False, "queue": "default",
                     "attempts": 1, "max_attempts": 3, "idempotency_key": None, "trace_id": None,
                     "tenant_id": None})
        for t, lock in rows
    ])  # fmt: skip
    groups = []
    while not w._jobs.empty():
        group = w._jobs.get()
        assert group is not None
        groups.append([ex.job["job_type"] + ("+lock" if ex.job["lock_key"] else "") for ex in group])
    # two fast jobs and a slow one share the window; a type not measured yet (t.ledger) counts as slow; a
    # lock_key job runs alone
    assert groups == [["t.ok"] * 8, ["t.ok", "t.ok", "t.slow"], ["t.slow"], ["t.ledger"], ["t.ledger"],
                      ["t.ok+lock"], ["t.ok+lock"]]  # fmt: skip


def test_a_job_claimed_again_before_its_last_run_left_the_in_flight_set_stays_tracked(dsn: str) -> None:
    # given back by a group (released), then claimed at once by this worker, before the group's _leave:
    # that _leave popped the job by id, the new run with it: no heartbeat, no kill, no wait at shutdown
    w = Worker(config(dsn))
    row = {"id": uuid.uuid4(), "job_type": "t.ok", "lock_key": None, "ran_solo": False, "queue": "default",
           "attempts": 1, "max_attempts": 3, "idempotency_key": None, "trace_id": None, "tenant_id": None}  # fmt: skip
    first = w._dispatch(dict(row))
    again = w._dispatch({**row, "attempts": 2})
    w._done_many([first])  # the old run's leave
    assert w._in_flight == {row["id"]: again}
    assert w._load == pytest.approx(again.load)
    w._done_many([again])
    assert w._in_flight == {} and w._load == 0.0


def test_by_default_a_handler_slowed_by_a_busy_process_is_still_grouped_and_a_network_call_is_not(dsn: str) -> None:
    # wall times include the waits for the GIL and the server: a 30 µs handler measures ~3 ms in a loaded
    # process; a budget that split those into groups of six made more commits, hence more load
    w = Worker(config(dsn))
    w.observe_handler("t.ok", 0.003)
    w.observe_handler("t.slow", 0.15)
    w._hand_out([
        w._dispatch({"id": uuid.uuid4(), "job_type": t, "lock_key": None, "ran_solo": False, "queue": "default",
                     "attempts": 1, "max_attempts": 3, "idempotency_key": None, "trace_id": None,
                     "tenant_id": None})
        for t in ["t.ok"] * 40 + ["t.slow"] * 2
    ])  # fmt: skip
    sizes = []
    while not w._jobs.empty():
        group = w._jobs.get()
        assert group is not None
        sizes.append((group[0].job["job_type"], len(group)))
    assert sizes == [("t.ok", 32), ("t.ok", 8), ("t.slow", 1), ("t.slow", 1)]


def _row(job_type: str, lock_key: str | None = None) -> dict[str, Any]:
    return {"id": uuid.uuid4(), "job_type": job_type, "lock_key": lock_key, "ran_solo": False, "queue": "default",
            "attempts": 1, "max_attempts": 3, "idempotency_key": None, "trace_id": None, "tenant_id": None}  # fmt: skip


def test_a_job_of_a_measured_fast_type_is_a_fraction_of_a_slot(dsn: str) -> None:
    w = Worker(config(dsn, group_seconds=0.1, group_max=20))
    w.observe_handler("t.ok", 0.01)  # ten fit the window
    w.observe_handler("t.slow", 0.5)
    w.observe_handler("t.async_ok", 0.0001)
    assert w.job_load(_row("t.ok")) == pytest.approx(1 / 10)
    assert w.job_load(_row("t.slow")) == 1.0
    assert w.job_load(_row("t.ledger")) == 1.0  # not measured yet: as slow
    assert w.job_load(_row("t.ok", lock_key="k")) == 1.0  # runs alone
    assert w.job_load(_row("t.async_ok")) == 1.0  # async handlers run alone
    instant = Worker(config(dsn, group_seconds=0.1, group_max=20))
    instant.observe_handler("t.ok", 0.0)
    assert instant.job_load(_row("t.ok")) == pytest.approx(1 / 20)  # at most group_max
    ungrouped = Worker(config(dsn, group_max=1))
    ungrouped.observe_handler("t.ok", 0.0001)
    assert ungrouped.job_load(_row("t.ok")) == 1.0


def test_a_worker_with_one_slot_and_no_prefetch_still_runs_fast_jobs_in_whole_groups(dsn: str, conn: db.Conn) -> None:
    # counted in jobs, one slot and no prefetch meant one job per claim and per transaction; counted in slot
    # loads, the slot's load is a whole group of them
    ids = [enqueue(conn, "t.ledger", {"item": f"i{i}"}, idempotency_key=f"w{i}").id for i in range(40)]
    wt = WorkerThread(dsn, concurrency=1, prefetch=0, group_seconds=10.0, group_max=10)
    wt.worker.observe_handler("t.ledger", 0.01)
    assert wt.start().join(60) == 0
    w = wt.worker
    assert all(state(dsn, j) == "succeeded" for j in ids)
    assert len(ledger(dsn)) == 40
    # the first claim takes one job (nothing claimed yet says how many make a load), then a group at a time
    assert w.claims <= 6 and w.groups <= 6, (w.claims, w.groups)
    assert not w._in_flight and w._load == 0.0


def test_slow_jobs_are_never_claimed_beyond_the_slots_and_the_prefetch(dsn: str, conn: db.Conn) -> None:
    # grouped fast jobs may fill max_in_flight; jobs that run one per slot still count one each, so a worker
    # does not hold slow jobs that other workers could run
    enqueue_many(conn, [("t.slow", {"seconds": 0.3}) for _ in range(12)])
    with running_worker(dsn, concurrency=2, prefetch=2) as w:
        wait_for(lambda: w.claimed_total >= 4, timeout=10)
        held = []
        for _ in range(20):
            held.append(len(w._in_flight))
            time.sleep(0.05)
        assert max(held) <= 4
        assert w.max_in_flight >= 32  # what grouped fast jobs could have filled


def test_slots_that_cannot_connect_give_their_jobs_back_and_the_worker_carries_on(dsn: str, conn: db.Conn) -> None:
    # a role allowed the worker's four own connections (claims, heartbeat, listener, completer) and none for
    # its slots (housekeeping's later rounds take one for a moment): jobs that need a slot's transaction
    # are given back, not leaked; jobs that need none succeed
    role = f"qc_limited_{uuid.uuid4().hex[:8]}"
    conn.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 4")
    conn.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
    conn.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
    try:
        limited = psycopg.conninfo.make_conninfo(dsn, user=role)
        effects = [
            enqueue(conn, "t.ledger", {"item": f"e{i}"}, idempotency_key=f"c{i}", timeout_seconds=0.5,
                    visibility_timeout_seconds=6).id
            for i in range(3)
        ]  # fmt: skip
        plain = [enqueue(conn, "t.ok", {}).id for _ in range(3)]
        with running_worker(limited, concurrency=2, heartbeat_interval=0.2) as w:
            for j in plain:
                wait_for(lambda j=j: state(dsn, j) == "succeeded", timeout=20, what="the jobs without effects")
            wait_for(lambda: w.claimed_total >= 3 + len(plain) and not w._in_flight, timeout=20, what="no leak")
            conn.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")  # the connections come back
            for j in effects:
                wait_for(lambda j=j: state(dsn, j) == "succeeded", timeout=30, what="the given-back jobs")
        assert sorted(r["item"] for r in ledger(dsn)) == ["e0", "e1", "e2"]
    finally:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


def test_a_handler_that_commits_ctx_tx_itself_fails_and_commits_nothing(dsn: str, conn: db.Conn) -> None:
    # its transaction holds the job's idempotency record (in a group, the records of the jobs after it
    # too): only the worker ends it, with the settlement
    alone = enqueue(conn, "t.self_commit", {"item": "alone"}).id
    keyed = enqueue(conn, "t.self_commit", {"item": "keyed"}, idempotency_key="sc").id
    run_burst(dsn)
    for j in (alone, keyed):
        row = job(dsn, j)
        assert row["state"] == "failed" and "must not commit ctx.tx" in row["last_error"], row["last_error"]
    assert ledger(dsn) == []
    assert conn.execute("SELECT count(*) AS n FROM processed_keys").fetchone() == {"n": 0}


@pytest.mark.parametrize("how", ["commit", "COMMIT", "ROLLBACK"])
@pytest.mark.parametrize("then", [None, "raise"], ids=["then-return", "then-raise"])
def test_an_async_handler_that_ends_ctx_tx_itself_fails(dsn: str, conn: db.Conn, how: str, then: str | None) -> None:
    # as for sync handlers: commit() refuses, and nothing commits; a COMMIT statement cannot be stopped,
    # so what it committed (the record and the effect before it) stays, and the job fails for good: a retry
    # would be a hit, and what the handler wrote after it would be lost without a word
    j = enqueue(conn, "t.async_self_end", {"item": "a", "how": how, "then": then}, idempotency_key="ak").id
    run_burst(dsn)
    row = job(dsn, j)
    assert (row["state"], row["attempts"]) == ("failed", 1), row["last_error"]
    items = [r["item"] for r in ledger(dsn)]
    keys = {r["idempotency_key"]: r["job_id"] for r in conn.execute("SELECT * FROM processed_keys")}
    if how == "commit":
        assert "must not commit ctx.tx" in row["last_error"]
        assert (items, keys) == ([], {})
    else:
        assert "ended ctx.tx's transaction itself" in row["last_error"]
        assert (items, keys) == ((["a"], {"ak": j}) if how == "COMMIT" else ([], {}))


@pytest.mark.parametrize("then", [None, "raise"], ids=["then-return", "then-raise"])
def test_a_handler_alone_in_its_transaction_that_commits_with_a_statement_fails(
    dsn: str, conn: db.Conn, then: str | None
) -> None:
    # not grouped (group_max 1): the same verdict as in a group
    j = enqueue(conn, "t.raw_commit", {"item": "s", "then": then}, idempotency_key="sk").id
    run_burst(dsn, group_max=1)
    row = job(dsn, j)
    assert (row["state"], row["attempts"]) == ("failed", 1), row["last_error"]
    assert "ended ctx.tx's transaction itself" in row["last_error"]
    assert [r["item"] for r in ledger(dsn)] == ["s"]


@pytest.mark.parametrize("how", ["grouped", "alone", "async"])
def test_a_handler_that_swallows_a_database_error_fails_its_job(dsn: str, conn: db.Conn, how: str) -> None:
    # its transaction is aborted: nothing of it can commit, and the job fails (it used to go back to the
    # queue without counting an attempt when alone, for ever: the settlement's error looked like an outage)
    job_type = "t.async_swallow" if how == "async" else "t.swallow"
    j = enqueue(conn, job_type, {"item": "s"}).id
    if how == "grouped":
        _run_measured(dsn, (job_type,))
    else:
        run_burst(dsn, timeout=30, group_max=1 if how == "alone" else 32)
    row = job(dsn, j)
    assert (row["state"], row["attempts"]) == ("dead_lettered", 2), row["last_error"]
    assert "swallowed a database error" in row["last_error"]
    assert ledger(dsn) == []


@pytest.mark.parametrize("job_type", ["t.autocommit", "t.async_autocommit"])
def test_a_handler_may_not_switch_ctx_tx_to_autocommit(dsn: str, conn: db.Conn, job_type: str) -> None:
    # each of its statements would commit on its own, and so would the next jobs' on that connection
    j = enqueue(conn, job_type, {"item": "a"}).id
    after = enqueue(conn, "t.ledger", {"item": "next", "fail_after_write": 1}, idempotency_key="n").id
    run_burst(dsn, group_max=1, concurrency=1)
    row = job(dsn, j)
    assert row["state"] == "failed" and "autocommit" in row["last_error"], row["last_error"]
    # the next job on the slot's connection failed once after writing: that write was rolled back
    assert job(dsn, after)["attempts"] == 2
    assert [(r["item"], r["attempt"]) for r in ledger(dsn)] == [("next", 2)]


@pytest.mark.parametrize("how", ["grouped", "alone", "async"])
def test_a_transaction_block_in_a_handler_is_nested_in_the_jobs_transaction(
    dsn: str, conn: db.Conn, how: str
) -> None:
    # with no idempotency key, nothing of the job's had begun its transaction when the handler opened the
    # block: psycopg made it a transaction of its own, committed at its end, before the job failed
    job_type = "t.async_tx_block" if how == "async" else "t.tx_block"
    j = enqueue(conn, job_type, {"item": "b", "fail_times": 1}).id
    if how == "grouped":
        _run_measured(dsn, (job_type,))
    else:
        run_burst(dsn, group_max=1 if how == "alone" else 32)
    assert (job(dsn, j)["state"], job(dsn, j)["attempts"]) == ("succeeded", 2)
    assert [(r["item"], r["attempt"]) for r in ledger(dsn)] == [("b", 2)]


def _run_measured(dsn: str, job_types: tuple[str, ...], **overrides: Any) -> Worker:
    wt = WorkerThread(dsn, **{**ONE_GROUP, "cancel_grace": 0.2, **overrides})
    for job_type in job_types:
        wt.worker.observe_handler(job_type, 0.01)
    assert wt.start().join(60) == 0
    return wt.worker


@pytest.mark.parametrize("then", [None, "select", "raise"], ids=["commit", "commit-then-select", "commit-then-raise"])
def test_a_grouped_handler_that_commits_with_a_statement_fails_and_the_next_jobs_records_go(
    dsn: str, conn: db.Conn, then: str | None
) -> None:
    # the group's first statement recorded the three keys; the second handler COMMITs them with its own
    # effect (and may go on in a new transaction); the third job then hangs and is dead-lettered: its
    # record must not stay behind (a requeue of it would be a hit, settled without ever running)
    jobs = [
        ("t.ledger", {"item": "r0"}),
        ("t.raw_commit", {"item": "r1", "then": then}),
        ("t.stubborn", {"item": "r2"}),
    ]
    ids = [enqueue(conn, t, p, idempotency_key=f"r{i}", priority=i).id for i, (t, p) in enumerate(jobs)]
    _run_measured(dsn, ("t.ledger", "t.raw_commit", "t.stubborn"))
    # r0's effect committed with the COMMIT: given back, it is a hit; r1 fails; r2 ran in a group of its own
    assert [state(dsn, j) for j in ids] == ["succeeded", "failed", "dead_lettered"]
    assert "ended ctx.tx's transaction itself" in job(dsn, ids[1])["last_error"]
    assert sorted(r["item"] for r in ledger(dsn)) == ["r0", "r1"]
    owners = {r["idempotency_key"]: r["job_id"] for r in conn.execute("SELECT * FROM processed_keys")}
    assert owners == {"r0": ids[0], "r1": ids[1]}


def test_records_a_commit_left_behind_when_the_database_went_away_are_not_taken_for_processed_keys(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as above, r1's COMMIT commits the record the group wrote for r2, not begun yet; the database goes away
    # exactly when the worker deletes it: r2 must still run, not be settled as a hit of its own record
    jobs = [("t.ledger", {"item": "r0"}), ("t.raw_commit", {"item": "r1"}), ("t.ledger", {"item": "r2"})]
    ids = [enqueue(conn, t, p, idempotency_key=f"r{i}", priority=i).id for i, (t, p) in enumerate(jobs)]
    unrecord = fill(UNRECORD_GROUP_KEYS, {b"ids": b""}).split(b"ANY(")[0]
    raw, failed = Slot._raw, []

    def outage_at_unrecord(self: Slot, sql: bytes, *args: Any) -> int:
        if sql.startswith(unrecord) and not failed:
            failed.append(sql)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return raw(self, sql, *args)

    monkeypatch.setattr(Slot, "_raw", outage_at_unrecord)
    _run_measured(dsn, ("t.ledger", "t.raw_commit"))
    assert failed
    assert [state(dsn, j) for j in ids] == ["succeeded", "failed", "succeeded"]
    assert sorted(r["item"] for r in ledger(dsn)) == ["r0", "r1", "r2"]
    assert metric(dsn, "idempotency_hits") == 1  # r0's, given back after the COMMIT took its effect
    owners = {r["idempotency_key"]: r["job_id"] for r in conn.execute("SELECT * FROM processed_keys")}
    assert owners == {"r0": ids[0], "r1": ids[1], "r2": ids[2]}


def test_a_grouped_handler_that_rolls_back_with_a_statement_fails_and_the_jobs_before_it_run_again(
    dsn: str, conn: db.Conn
) -> None:
    jobs = [
        ("t.ledger", {"item": "k0"}),
        ("t.raw_commit", {"item": "k1", "end": "ROLLBACK"}),
        ("t.ledger", {"item": "k2"}),
    ]
    ids = [enqueue(conn, t, p, idempotency_key=f"k{i}", priority=i).id for i, (t, p) in enumerate(jobs)]
    _run_measured(dsn, ("t.ledger", "t.raw_commit"))
    assert [state(dsn, j) for j in ids] == ["succeeded", "failed", "succeeded"]
    # k0's effect went with the ROLLBACK: it ran again, once, without counting an attempt
    assert sorted((r["item"], r["attempt"]) for r in ledger(dsn)) == [("k0", 1), ("k2", 1)]
    owners = {r["idempotency_key"]: r["job_id"] for r in conn.execute("SELECT * FROM processed_keys")}
    assert owners == {"k0": ids[0], "k2": ids[2]}


def test_a_job_recorded_in_its_savepoint_after_psycopg_dropped_the_sessions_prepared_statements(
    dsn: str, conn: db.Conn, caplog: pytest.LogCaptureFixture
) -> None:
    # one keyed job at a time, each a group of its own (its record written in its savepoint's round trip).
    # After five, psycopg has prepared the statements it ran five times; the sixth job fails, its group's
    # transaction is rolled back through psycopg, which then deallocates every prepared statement of the
    # session, ours included: the jobs after it must not fail on that (their groups were given back)
    caplog.set_level(logging.WARNING, logger="worker_core")
    with running_worker(dsn, concurrency=1) as w:
        for i in range(8):
            j = enqueue(conn, "t.ledger", {"item": f"p{i}", "fail_after_write": int(i == 5)},
                        idempotency_key=f"p{i}").id  # fmt: skip
            conn.commit()
            wait_for(lambda j=j: state(dsn, j) == "succeeded", what=f"job {i} to succeed")  # type: ignore[misc]
    assert not [r.getMessage() for r in caplog.records if "database error" in r.getMessage()]
    assert w.groups == 9  # one per attempt: none given back
    assert sorted(r["item"] for r in ledger(dsn)) == [f"p{i}" for i in range(8)]


def test_a_slot_that_cannot_reach_the_database_does_not_spin_on_the_jobs_it_gives_back(
    dsn: str, conn: db.Conn, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the slots' connections fail for 1.5 s (the claims still work): the group's jobs, given back to the
    # slots each time, are tried again every OUTAGE_PAUSE, not as fast as a refused connection comes back
    caplog.set_level(logging.WARNING, logger="worker_core")
    ids = [enqueue(conn, "t.ledger", {"item": f"o{i}"}, idempotency_key=f"o{i}").id for i in range(2)]
    conn.commit()
    connect, until = db.connect, time.monotonic() + 1.5

    def refused_for_a_while(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cls") is JobConnection and time.monotonic() < until:
            raise psycopg.OperationalError("connection refused")
        return connect(*args, **kwargs)

    monkeypatch.setattr(db, "connect", refused_for_a_while)
    run_grouped(dsn, concurrency=1)
    assert [state(dsn, j) for j in ids] == ["succeeded", "succeeded"]
    errors = [r for r in caplog.records if "database error around a group" in r.getMessage()]
    assert 1 <= len(errors) <= 1.5 / OUTAGE_PAUSE + 2


def test_a_group_whose_connection_is_lost_midway_does_not_settle_its_earlier_jobs_elsewhere(
    dsn: str, conn: db.Conn
) -> None:
    # a group [A, B]: A writes its effect in the group's transaction; then that connection is lost (a
    # failover). A's effect and record are gone with it: A must run again, not be settled succeeded on a
    # new connection with nothing behind it. B, whose handler met the loss (FATAL 57P01), is given back
    # uncharged too: an outage is nobody's failure (a handler that ends its own session so is charged after
    # MAX_UNCHARGED_GIVE_BACKS: test_settlement_errors)
    a = enqueue(conn, "t.ledger", {"item": "A"}, idempotency_key="gA", priority=0).id
    b = enqueue(conn, "t.cut_group_conn", {"item": "B"}, idempotency_key="gB", priority=1).id
    conn.commit()
    w = _run_measured(dsn, ("t.ledger", "t.cut_group_conn"))
    assert not w._ungrouped  # a lost connection is an outage: the types stay grouped
    assert [state(dsn, j) for j in (a, b)] == ["succeeded", "succeeded"]
    assert sorted(r["item"] for r in ledger(dsn)) == ["A", "B"]  # each effect once, none lost
    assert job(dsn, a)["errors"] == [] and job(dsn, a)["attempts"] == 1
    assert job(dsn, b)["errors"] == [] and job(dsn, b)["attempts"] == 1
    assert w._given_back[b] == 1  # once, as an outage (bounded: MAX_UNCHARGED_GIVE_BACKS)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "alone"])
def test_failures_the_worker_must_settle_carefully_are_settled_and_leak_nothing(
    dsn: str, conn: db.Conn, grouped: bool
) -> None:
    # each fails once with an awkward error (see t.awkward_failure): each is settled retry_scheduled with
    # a readable error, runs again and succeeds; none is left in flight (the burst worker finishes)
    hows = ["retry_in", "nul", "unprintable"]
    ids = [enqueue(conn, "t.awkward_failure", {"how": h, "item": h}).id for h in hows]
    conn.commit()
    w = _run_measured(dsn, ("t.awkward_failure",)) if grouped else run_burst(dsn, group_max=1, timeout=30)
    assert not w._in_flight
    rows = [job(dsn, j) for j in ids]
    assert [(r["state"], r["attempts"]) for r in rows] == [("succeeded", 2)] * 3
    assert [r["errors"][0]["kind"] for r in rows] == ["transient", "unknown", "unknown"]
    assert "\x00" not in rows[1]["errors"][0]["message"] and "byte" in rows[1]["errors"][0]["message"]
    assert rows[2]["errors"][0]["class"] == "_Unprintable"
    assert sorted(r["item"] for r in ledger(dsn)) == sorted(hows)


def test_a_retry_in_is_taken_when_it_is_a_number_of_seconds_within_a_year() -> None:
    def retry_in(value: Any) -> float | None:
        return _retry_in(TransientError("x", retry_in=value))

    assert [retry_in(v) for v in (30, "30", " 2.5 ", -5, dt.timedelta(minutes=1))] == [30.0, 30.0, 2.5, 0.0, 60.0]
    assert retry_in(float("inf")) == MAX_RETRY_IN_SECONDS
    # 10**400 is too large for a float: it raised OverflowError, and the settlement with it
    assert [retry_in(v) for v in (None, "soon", float("nan"), True, [1], 10**400)] == [None] * 6


@pytest.mark.parametrize(
    "stored", ['{"base_seconds": "1"}', '{"backoff": "fixed", "base_seconds": 1e300, "max_delay_seconds": 1e300}']
)
def test_a_retry_policy_the_worker_cannot_read_retries_under_the_default_one(
    dsn: str, conn: db.Conn, stored: str
) -> None:
    # raising in the settlement left the job running for no one until its lease ran out: taken for a crash
    # (a lease expiration, then a poison pill), its real error never recorded
    j = enqueue(conn, "t.awkward_failure", {"how": "nul", "item": "x"}).id
    conn.execute("UPDATE job_queue SET retry_policy = %s::jsonb WHERE id = %s", (stored, j))
    conn.commit()
    started = dt.datetime.now(dt.timezone.utc)
    run_worker_until(dsn, lambda: state(dsn, j) == "retry_scheduled", timeout=10)
    row = job(dsn, j)
    assert [(e["kind"], e["class"]) for e in row["errors"]] == [("unknown", "ValueError")]
    assert started < row["scheduled_at"] < started + dt.timedelta(hours=1)  # the default policy's delay


def test_keys_that_look_like_placeholders_are_recorded_as_they_are(dsn: str, conn: db.Conn) -> None:
    # the group's statements are filled in one pass: a key is never substituted into again
    keys = ["%(now)s", "%(retention_seconds)s", "a%(rows)sb", "%(key)s", "%(job_id)s"]
    ids = [
        enqueue(conn, "t.ledger", {"item": k, "fail_after_write": 1 if k == "%(key)s" else 0}, idempotency_key=k,
                priority=i).id
        for i, k in enumerate(keys)
    ]  # fmt: skip
    run_grouped(dsn)
    assert [job(dsn, j)["attempts"] for j in ids] == [1, 1, 1, 2, 1]  # "%(key)s" failed once, then succeeded
    assert sorted(r["item"] for r in ledger(dsn)) == sorted(keys)
    owners = {r["idempotency_key"]: r["job_id"] for r in conn.execute("SELECT * FROM processed_keys")}
    assert owners == dict(zip(keys, ids, strict=True))


def test_a_claim_that_brings_slow_jobs_after_fast_ones_gives_back_what_the_slots_cannot_take(
    dsn: str, conn: db.Conn
) -> None:
    ids = [enqueue(conn, "t.slow", {"seconds": 0.1}, priority=i).id for i in range(30)]
    w = Worker(config(dsn, concurrency=2, prefetch=2))
    w._jobs_per_load = 10.0  # the last claim was of fast jobs: ten to a slot load
    limit = min(w._room(), w.batch_size)
    assert limit == 40
    rows = w.claim(limit)
    kept = w._keep_within(rows, w.capacity - w._load)
    assert [r["id"] for r in kept] == ids[:4]  # four slot loads: four slow jobs, the first ones
    states = {r["id"]: (r["state"], r["attempts"], r["locked_by"]) for r in conn.execute("SELECT * FROM job_queue")}
    assert [states[j] for j in ids[:4]] == [("running", 1, w.id)] * 4
    assert [states[j] for j in ids[4:]] == [("queued", 0, None)] * 26  # as they were


def test_a_surplus_job_killed_since_the_claim_is_kept_and_never_runs(dsn: str, conn: db.Conn) -> None:
    ids = [enqueue(conn, "t.slow", {"seconds": 0.1}, priority=i).id for i in range(6)]
    w = Worker(config(dsn, concurrency=2, prefetch=2))
    w._jobs_per_load = 10.0
    rows = w.claim(min(w._room(), w.batch_size))
    ops.kill(conn, [ids[5]])  # between the claim and the give-back: flagged, since it is running
    kept = w._keep_within(rows, w.capacity - w._load)
    assert [r["id"] for r in kept] == [*ids[:4], ids[5]]  # kept: the heartbeat sees the kill
    assert [state(dsn, j) for j in ids] == ["running"] * 4 + ["queued", "running"]
    assert job(dsn, ids[5])["cancel_requested"]


def test_a_group_whose_settlement_meets_a_held_row_waits_a_bounded_time(
    dsn: str, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an operator's open transaction holds the row of one job of a group: the group's settlement waited for it
    # as long as it stayed open, and with it the slot, the group's idempotency records (every job with one of
    # those keys waited on it in turn) and the rows its handlers wrote. Now it waits a few seconds, rolls the
    # group back (nothing of it committed: its jobs run again and their effects happen once) and gives its
    # jobs back; the held one is left to its lease, and runs once the operator lets go
    from worker_core import execution

    monkeypatch.setattr(execution, "SETTLE_LOCK_WAIT_SECONDS", 1.0)
    lease = {"timeout_seconds": 1, "visibility_timeout_seconds": 7}
    ids = [
        enqueue(conn, "t.ledger", {"item": f"i{i}", "sleep": 0.8 if i == 0 else 0}, idempotency_key=f"held{i}",
                **lease).id
        for i in range(4)
    ]  # fmt: skip
    held = ids[3]
    operator = db.connect(dsn)
    # two slots: one gives the held job back, as soon as its row is free, the other runs the rest again
    wt = WorkerThread(dsn, **{**ONE_GROUP, "concurrency": 2, "burst": False, "heartbeat_interval": 0.2})
    wt.worker.observe_handler("t.ledger", 0.01)
    wt.start()
    try:
        wait_for(lambda: all(state(dsn, j) == "running" for j in ids), 10, what="the group to be claimed")
        operator.execute("SELECT 1 FROM job_queue WHERE id = %s FOR UPDATE", (held,))
        wait_for(lambda: all(state(dsn, j) == "succeeded" for j in ids[:3]), 10,
                 what="the others to be settled while the row is held")  # fmt: skip
        # the held job's effect and record went with the group's rollback; its lease is left to run out
        assert state(dsn, held) == "running"
        assert conn.execute("SELECT count(*) AS n FROM processed_keys WHERE idempotency_key = 'held3'").fetchone() == {
            "n": 0
        }
        operator.rollback()
        wait_for(lambda: state(dsn, held) == "succeeded", 20, what="the held job to run once the lock goes")
    finally:
        operator.close()
        wt.stop()
    assert sorted(r["item"] for r in ledger(dsn)) == ["i0", "i1", "i2", "i3"]  # each effect once
    assert [job(dsn, j)["errors"] for j in ids] == [[]] * 4  # given back, never charged
