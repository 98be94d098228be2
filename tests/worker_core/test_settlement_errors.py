"""Errors of a job's own making that surface only at its settlement or its COMMIT, and handlers that leave
work behind them: each is that job's failure, charged an attempt, and never leaks into another job.

Before, a deferred constraint violated at COMMIT (or a search_path the handler changed) was taken for a
database outage: the job was given back uncharged and ran again for ever, never dead-lettered, and the
innocent jobs grouped with it with it.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest

from tests.worker_core.helpers import WorkerThread, job, ledger, metric, run_burst, running_worker, state, wait_for
from worker_core import db
from worker_core.execution import MAX_UNCHARGED_GIVE_BACKS
from worker_core.producer import enqueue
from worker_core.worker import Worker

GROUPED: dict[str, Any] = {"concurrency": 1, "prefetch": 20, "group_seconds": 10.0, "cancel_grace": 0.2}


def run_grouped(dsn: str, job_types: tuple[str, ...]) -> Worker:
    """A burst worker that has measured these types already: their jobs go out in groups."""
    wt = WorkerThread(dsn, **GROUPED)
    for job_type in job_types:
        wt.worker.observe_handler(job_type, 0.01)
    assert wt.start().join(60) == 0
    return wt.worker


@pytest.fixture
def deferred_fk(conn: db.Conn) -> None:
    conn.execute("CREATE TABLE parent (id int PRIMARY KEY)")
    conn.execute(
        "CREATE TABLE child (id serial PRIMARY KEY,"
        " parent_id int REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)"
    )
    conn.commit()


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "grouped"])
def test_a_deferred_constraint_violated_at_commit_fails_the_job_that_broke_it(
    dsn: str, conn: db.Conn, deferred_fk: None, grouped: bool
) -> None:
    bad = enqueue(conn, "t.deferred_fk", {"item": "bad"}, priority=0).id
    good = [enqueue(conn, "t.ledger", {"item": f"ok{i}"}, idempotency_key=f"k{i}", priority=1).id for i in range(3)]
    conn.commit()
    w = run_grouped(dsn, ("t.deferred_fk", "t.ledger")) if grouped else run_burst(dsn, group_max=1)
    row = job(dsn, bad)
    assert (row["state"], row["attempts"]) == ("dead_lettered", 3)
    assert [e["class"] for e in row["errors"]] == ["ForeignKeyViolation"] * 3
    assert [state(dsn, j) for j in good] == ["succeeded"] * 3  # the jobs grouped with it ran
    assert sorted(r["item"] for r in ledger(dsn)) == ["ok0", "ok1", "ok2"]  # nothing of the bad one
    if grouped:
        assert "t.deferred_fk" in w._ungrouped  # found alone, where it failed by itself


def test_an_async_jobs_deferred_violation_fails_it_too(dsn: str, conn: db.Conn, deferred_fk: None) -> None:
    bad = enqueue(conn, "t.async_deferred_fk", {}, idempotency_key="a1").id
    conn.commit()
    run_burst(dsn)
    assert (job(dsn, bad)["state"], job(dsn, bad)["attempts"]) == ("dead_lettered", 3)
    assert conn.execute("SELECT count(*) AS n FROM processed_keys").fetchone() == {"n": 0}


def test_a_search_path_the_handler_changed_fails_its_settlement_and_the_job(dsn: str, conn: db.Conn) -> None:
    bad = enqueue(conn, "t.tenant_path", {}, idempotency_key="t1").id
    conn.commit()
    run_burst(dsn, group_max=1)
    row = job(dsn, bad)
    assert (row["state"], row["attempts"]) == ("dead_lettered", 3)
    assert row["errors"][0]["class"] == "UndefinedTable"


def test_with_ctx_tx_as_a_block_that_raises_fails_its_job_once_not_its_group_for_ever(
    dsn: str, conn: db.Conn
) -> None:
    # psycopg's own exit rolled back (refused), then closed the connection: the group, given back
    # uncharged, came back round and round
    j = enqueue(conn, "t.with_tx", {"fail_times": 1}).id
    others = [enqueue(conn, "t.ledger", {"item": f"o{i}"}, idempotency_key=f"o{i}").id for i in range(2)]
    conn.commit()
    run_grouped(dsn, ("t.with_tx", "t.ledger"))
    assert (state(dsn, j), job(dsn, j)["attempts"]) == ("succeeded", 2)
    assert [state(dsn, o) for o in others] == ["succeeded"] * 2
    assert sorted((r["item"], r["attempt"]) for r in ledger(dsn)) == [("o0", 1), ("o1", 1), ("w", 2)]


def test_a_connection_the_handler_lost_itself_charges_that_job_not_the_others(dsn: str, conn: db.Conn) -> None:
    # a slow call inside the transaction outlived idle_in_transaction_session_timeout: the server ended the
    # group's connection. Charged to nobody, the job ran again and again, never dead-lettered
    j = enqueue(conn, "t.idle_too_long", {"item": "slow"}, priority=1).id
    conn.commit()
    run_grouped(dsn, ("t.idle_too_long",))
    row = job(dsn, j)
    assert (row["state"], row["attempts"]) == ("succeeded", 2)
    assert [r["attempt"] for r in ledger(dsn)] == [2, 2]


def test_tasks_an_async_handler_left_running_never_write_into_the_next_jobs_transaction(
    dsn: str, conn: db.Conn
) -> None:
    # gather(write in 0.3 s, a call failing at once): the handler fails, its write is still pending in the
    # slot's loop, which runs the next async job: the write landed in that job's transaction and committed
    # with it, and the retry wrote again
    g = enqueue(conn, "t.async_gather", {}, priority=0).id
    nxt = enqueue(conn, "t.async_ok", {"item": "next", "sleep": 0.6}, priority=1).id
    conn.commit()
    run_burst(dsn, concurrency=1)
    assert [state(dsn, j) for j in (g, nxt)] == ["succeeded", "succeeded"]
    assert sorted((r["item"], r["attempt"]) for r in ledger(dsn)) == [("g", 2), ("next", 1)]


def test_an_async_handler_raising_system_exit_leaves_no_transaction_open(dsn: str, conn: db.Conn) -> None:
    # its connection, dropped, kept the job's transaction (its idempotency record) open until the garbage
    # collector closed it: the retry waited on its own key
    import gc

    j = enqueue(conn, "t.async_exit", {}, idempotency_key="exit-1").id
    conn.commit()
    gc.disable()
    try:
        run_burst(dsn, timeout=30)
    finally:
        gc.enable()
    assert (state(dsn, j), job(dsn, j)["attempts"]) == ("succeeded", 2)
    assert [(r["item"], r["attempt"]) for r in ledger(dsn)] == [("e", 2)]


def test_a_neighbours_commit_does_not_run_the_keyless_jobs_before_it_twice(dsn: str, conn: db.Conn) -> None:
    # the COMMIT committed what the jobs before it wrote: given back, those without an idempotency key
    # wrote again
    before = [enqueue(conn, "t.ok", {"ledger": True, "item": f"b{i}"}, priority=0).id for i in range(3)]
    committer = enqueue(conn, "t.raw_commit", {"item": "c"}, priority=1).id
    conn.commit()
    run_grouped(dsn, ("t.ok", "t.raw_commit"))
    assert [state(dsn, j) for j in before] == ["succeeded"] * 3
    assert state(dsn, committer) == "failed"
    assert sorted(r["item"] for r in ledger(dsn) if r["item"].startswith("b")) == ["b0", "b1", "b2"]


def test_a_connection_lost_during_a_quiet_handler_charges_it_not_the_next_job(dsn: str, conn: db.Conn) -> None:
    # its slow call outlived the session's idle timeout but it did not touch ctx.tx after it: the next job of
    # the group met the lost connection and was charged for it
    quiet = enqueue(conn, "t.idle_quiet", {"item": "q"}, priority=0).id
    nxt = enqueue(conn, "t.ledger", {"item": "n"}, idempotency_key="n1", priority=1).id
    conn.commit()
    w = run_grouped(dsn, ("t.idle_quiet", "t.ledger"))
    assert (state(dsn, quiet), job(dsn, quiet)["attempts"]) == ("succeeded", 2)
    assert quiet not in w._given_back  # its idle timeout (25P03) is its own doing, no outage: charged at once
    assert (state(dsn, nxt), job(dsn, nxt)["errors"]) == ("succeeded", [])


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "grouped"])
def test_a_handler_that_swallows_its_lost_connection_is_charged_not_looped(
    dsn: str, conn: db.Conn, grouped: bool
) -> None:
    j = enqueue(conn, "t.idle_quiet", {"item": "s", "swallow": True}).id
    conn.commit()
    w = run_grouped(dsn, ("t.idle_quiet",)) if grouped else run_burst(dsn, group_max=1)
    assert (state(dsn, j), job(dsn, j)["attempts"]) == ("succeeded", 2)
    assert w._ungrouped == set()  # a lost connection is not an error of a job's writes
    assert j not in w._given_back  # the error it swallowed said 25P03, its own doing: charged at once


def test_a_database_restart_is_an_outage_not_an_error_of_the_jobs(dsn: str, conn: db.Conn) -> None:
    # every connection of the worker ended (a restart, a failover): the next group's first statement met a
    # closed connection, whose error has no SQLSTATE, and that was taken for an error of the jobs' making:
    # their types went ungrouped, one transaction per job from then on
    from tests.worker_core.helpers import running_worker, wait_for

    def batch(tag: str) -> list[Any]:
        ids = [enqueue(conn, "t.ledger", {"item": f"{tag}{i}"}, idempotency_key=f"{tag}{i}").id for i in range(4)]
        conn.commit()
        return ids

    with running_worker(dsn, **GROUPED) as w:
        w.observe_handler("t.ledger", 0.01)
        first = batch("a")
        wait_for(lambda: all(state(dsn, j) == "succeeded" for j in first), 20)
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        conn.commit()
        second = batch("b")
        wait_for(lambda: all(state(dsn, j) == "succeeded" for j in second), 30)
        assert w._ungrouped == set()
    expected = sorted([*(f"a{i}" for i in range(4)), *(f"b{i}" for i in range(4))])
    assert sorted(r["item"] for r in ledger(dsn)) == expected


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "grouped"])
def test_a_handler_that_makes_its_settlement_fail_like_an_outage_is_charged_in_the_end(
    dsn: str, conn: db.Conn, grouped: bool
) -> None:
    # SET TRANSACTION READ ONLY: the settlement fails with 25006, what a read-only server answers too; given
    # back uncharged each time, the job ran for ever. It is charged after MAX_UNCHARGED_GIVE_BACKS
    j = enqueue(conn, "t.read_only_tx", {}, idempotency_key="ro1").id
    conn.commit()
    run_grouped(dsn, ("t.read_only_tx",)) if grouped else run_burst(dsn, group_max=1, timeout=60)
    assert (state(dsn, j), job(dsn, j)["attempts"]) == ("dead_lettered", 3)
    assert {e["class"] for e in job(dsn, j)["errors"]} == {"ReadOnlySqlTransaction"}


@pytest.mark.parametrize(
    "end",
    ["ROLLBACK; COMMIT", "SAVEPOINT s; ROLLBACK TO SAVEPOINT s; COMMIT", "COMMIT; COMMIT", "COMMIT; ROLLBACK"],
    ids=["rollback-then-commit", "savepoint-rollback-then-commit", "commit-then-commit", "commit-then-rollback"],
)
def test_whether_a_neighbours_commit_committed_the_group_before_it(dsn: str, conn: db.Conn, end: str) -> None:
    # the same command tags, opposite outcomes. ROLLBACK; COMMIT committed nothing of the jobs before it:
    # taken for committed, they were settled succeeded with their writes gone; they must run again.
    # ROLLBACK TO SAVEPOINT; COMMIT committed them: given back, the keyless ones wrote twice. The server's
    # warning that no transaction was in progress (25P01) tells the two apart
    before = [enqueue(conn, "t.ok", {"ledger": True, "item": f"b{i}"}, priority=0).id for i in range(3)]
    enqueue(conn, "t.raw_commit", {"item": "c", "end": end}, priority=1)
    conn.commit()
    run_grouped(dsn, ("t.ok", "t.raw_commit"))
    assert [state(dsn, j) for j in before] == ["succeeded"] * 3
    assert sorted(r["item"] for r in ledger(dsn) if r["item"].startswith("b")) == ["b0", "b1", "b2"]


def test_an_async_handler_returning_with_a_statement_in_flight_does_not_hang_its_slot(
    dsn: str, conn: db.Conn
) -> None:
    # the check for a lost connection read the socket under that statement, took its reply, and the
    # statement (and the settlement behind it) waited until the job's timeout
    ids = [enqueue(conn, "t.async_fire_and_forget", {}).id for _ in range(30)]
    conn.commit()
    w = run_burst(dsn, concurrency=2, timeout=60)
    assert [state(dsn, j) for j in ids] == ["succeeded"] * 30
    assert w.zombies == 0 and len(ledger(dsn)) == 30


def test_only_errors_the_server_answered_after_the_handler_ran_count_towards_charging_a_give_back() -> None:
    """A job given back for database errors is charged after MAX_UNCHARGED_GIVE_BACKS only where it may be
    the cause: not for a lost connection, too many clients or a shutdown (an innocent job with
    max_attempts=1 was dead-lettered, its handler never run, after four such give-backs)."""
    import psycopg

    from worker_core.execution import _answered

    assert _answered(psycopg.errors.ReadOnlySqlTransaction("read-only"))
    assert _answered(psycopg.errors.LockNotAvailable("lock_timeout"))
    for outage in (psycopg.OperationalError("server closed the connection unexpectedly"),
                   psycopg.errors.TooManyConnections("too many clients"),
                   psycopg.errors.AdminShutdown("terminating connection"),
                   psycopg.errors.ConnectionFailure("connection failure")):  # fmt: skip
        assert not _answered(outage), outage


VIAS = [("stream", False), ("stream", True), ("copy", False), ("copy", True)]
VIA_IDS = ["stream", "stream-swallowed", "copy", "copy-swallowed"]


@pytest.mark.parametrize(("via", "swallow"), VIAS, ids=VIA_IDS)
def test_a_commit_sent_through_stream_or_copy_is_seen_as_one_sent_through_execute(
    dsn: str, conn: db.Conn, via: str, swallow: bool
) -> None:
    # only execute() and executemany() were watched: a COMMIT through a cursor's stream() or copy() (psycopg
    # raises ProgrammingError after the server ran it) went unseen. The keyless jobs before it in the group
    # were given back and wrote again; the committer was retried and settled as a hit
    before = [enqueue(conn, "t.ok", {"ledger": True, "item": f"b{i}"}, priority=0).id for i in range(3)]
    committer = enqueue(
        conn, "t.raw_commit", {"item": "c", "via": via, "swallow": swallow}, idempotency_key="ck", priority=1
    ).id
    conn.commit()
    run_grouped(dsn, ("t.ok", "t.raw_commit"))
    assert [state(dsn, j) for j in before] == ["succeeded"] * 3
    row = job(dsn, committer)
    assert (row["state"], row["attempts"]) == ("failed", 1), row["last_error"]
    assert "ended ctx.tx's transaction itself" in row["last_error"]
    assert sorted(r["item"] for r in ledger(dsn)) == ["b0", "b1", "b2", "c"]


@pytest.mark.parametrize(("via", "swallow"), VIAS, ids=VIA_IDS)
@pytest.mark.parametrize("kind", ["alone", "async"])
def test_a_job_alone_that_commits_through_stream_or_copy_fails_for_good(
    dsn: str, conn: db.Conn, kind: str, via: str, swallow: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # what it wrote before its COMMIT stays, with its idempotency record: retried, it was settled as a hit,
    # succeeded, with the rest of its handler never run
    job_type = "t.async_self_end" if kind == "async" else "t.raw_commit"
    payload = {"item": "a", "how": "COMMIT", "via": via, "swallow": swallow}
    j = enqueue(conn, job_type, payload, idempotency_key="ak").id
    conn.commit()
    run_burst(dsn, group_max=1, timeout=30)
    row = job(dsn, j)
    assert (row["state"], row["attempts"]) == ("failed", 1), row["last_error"]
    assert "ended ctx.tx's transaction itself" in row["last_error"]
    assert [r["item"] for r in ledger(dsn)] == ["a"]
    # the async handler's exception was retrieved: collected, its task logged it from whatever thread the
    # collector ran on (under pytest, inside an import's compile, which Python 3.11 then failed)
    gc.collect()
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize("via", ["stream", "copy"])
def test_a_rollback_sent_through_stream_or_copy_leaves_the_jobs_before_it_to_run_again(
    dsn: str, conn: db.Conn, via: str
) -> None:
    # the other outcome: nothing of the group committed, so the jobs before it run again (and write once)
    before = [enqueue(conn, "t.ok", {"ledger": True, "item": f"b{i}"}, priority=0).id for i in range(3)]
    enqueue(conn, "t.raw_commit", {"item": "c", "via": via, "end": "ROLLBACK", "swallow": True}, priority=1)
    conn.commit()
    run_grouped(dsn, ("t.ok", "t.raw_commit"))
    assert [state(dsn, j) for j in before] == ["succeeded"] * 3
    assert sorted(r["item"] for r in ledger(dsn) if r["item"].startswith("b")) == ["b0", "b1", "b2"]


def test_a_group_idle_longer_than_a_lease_is_not_ended_under_its_jobs(dsn: str, conn: db.Conn) -> None:
    # the idle limit of a job's transaction was the longest lease of the group: a group stays idle across
    # several handlers (after the first job's write, the next ones used no ctx.tx), so the server ended a
    # transaction that was working normally, charging the job then running and running the others twice
    first = enqueue(conn, "t.ledger", {"item": "w", "sleep": 1.8}, idempotency_key="w", priority=0,
                    timeout_seconds=2, visibility_timeout_seconds=7.5).id  # fmt: skip
    quiet = [enqueue(conn, "t.slow", {"seconds": 1.8}, priority=1, timeout_seconds=2,
                     visibility_timeout_seconds=7.5).id for _ in range(4)]  # fmt: skip
    conn.commit()
    run_grouped(dsn, ("t.ledger", "t.slow"))
    assert [(state(dsn, j), job(dsn, j)["attempts"]) for j in [first, *quiet]] == [("succeeded", 1)] * 5
    assert [r["item"] for r in ledger(dsn)] == ["w"]


def test_a_lease_longer_than_the_servers_idle_limit_takes_runs(dsn: str, conn: db.Conn) -> None:
    # 25 days of timeout: the idle limit set from its lease was out of the server's range, and the job
    # stayed running, never run, for its whole lease
    j = enqueue(conn, "t.ledger", {"item": "long"}, idempotency_key="long", timeout_seconds=25 * 86400,
                visibility_timeout_seconds=25 * 86400 + 60).id  # fmt: skip
    conn.commit()
    run_burst(dsn, group_max=1, timeout=30)
    assert state(dsn, j) == "succeeded" and [r["item"] for r in ledger(dsn)] == ["long"]


def test_a_kill_reaches_a_group_waiting_for_one_of_its_keys(dsn: str, conn: db.Conn) -> None:
    # the group's first statement records every key of the group: waiting on one another transaction held,
    # a kill (or a shutdown) of its jobs never reached it
    from tests.worker_core.helpers import running_worker, wait_for
    from worker_core import ops

    with db.connect(dsn) as holder:
        holder.execute(
            "INSERT INTO processed_keys (idempotency_key, job_id, job_type, processed_at, expires_at)"
            " VALUES ('K1', gen_random_uuid(), 't.other', now(), now() + interval '1 day')"
        )  # not committed
        a = enqueue(conn, "t.ledger", {"item": "a"}, idempotency_key="K1", priority=0).id
        b = enqueue(conn, "t.ledger", {"item": "b"}, idempotency_key="K2", priority=0).id
        conn.commit()
        with running_worker(dsn, heartbeat_interval=0.2, **GROUPED) as w:
            w.observe_handler("t.ledger", 0.01)
            wait_for(lambda: state(dsn, a) == state(dsn, b) == "running", 10, what="the group to wait")
            ops.kill(conn, [a], actor=ops.Actor("oncall"))
            wait_for(lambda: state(dsn, a) == "cancelled", 10, what="the kill to end the waiting job")
            holder.rollback()
            wait_for(lambda: state(dsn, b) == "succeeded", 10, what="the other job to run")
    assert [r["item"] for r in ledger(dsn)] == ["b"]


def test_a_job_with_a_lock_key_that_breaks_its_own_transaction_is_charged_not_looped(
    dsn: str, conn: db.Conn
) -> None:
    # the lock's lease is extended in the job's transaction before its commit: the error there (the handler
    # made the transaction read-only) was taken for a lost lock, and the job given back uncharged, for ever
    j = enqueue(conn, "t.read_only_tx", {}, idempotency_key="ro-lock", lock_key="order:1").id
    conn.commit()
    run_burst(dsn, group_max=1, timeout=60)
    assert (state(dsn, j), job(dsn, j)["attempts"]) == ("dead_lettered", 3)
    assert {e["class"] for e in job(dsn, j)["errors"]} == {"ReadOnlySqlTransaction"}


@pytest.mark.parametrize(
    "dirty, probe, group_max",
    [
        ("t.dirty_session", "t.session_probe", 1),
        ("t.dirty_session", "t.session_probe", 32),
        ("t.async_dirty_session", "t.async_session_probe", 32),
    ],
    ids=["alone", "grouped", "async"],
)
def test_what_a_handler_leaves_in_its_session_is_gone_before_the_next_job(
    dsn: str, conn: db.Conn, dirty: str, probe: str, group_max: int
) -> None:
    # a slot keeps its connection from job to job: one tenant's search_path sent the next job's writes to that
    # tenant's schema, a statement_timeout failed another type's queries, a temp table the next run of its type
    conn.execute("CREATE SCHEMA dirty_tenant")
    first = enqueue(conn, dirty, {}, priority=0).id
    then = enqueue(conn, probe, {}, priority=5).id
    conn.commit()
    wt = WorkerThread(dsn, concurrency=1, group_max=group_max)
    for t in (dirty, probe):
        wt.worker.observe_handler(t, 0.001)  # measured fast: the two go in one group (one transaction)
    assert wt.start().join(60) == 0
    assert (state(dsn, first), state(dsn, then)) == ("succeeded", "succeeded")
    if group_max > 1 and "async" not in dirty:
        assert wt.worker.groups == 1
    [found] = [r["item"] for r in ledger(dsn)]
    search_path, timeout, no_temp_table, locks, tenant = found.split("|")
    assert (search_path, timeout, no_temp_table, tenant) == ('"$user", public', "0", "t", "")
    if group_max == 1 or "async" in dirty:  # in a group the advisory lock goes with the group's transaction
        assert locks == "0"


@pytest.mark.parametrize("group_max", [1, 32], ids=["alone", "grouped"])
def test_an_exception_that_cannot_be_read_still_fails_its_job(dsn: str, conn: db.Conn, group_max: int) -> None:
    # repr() of the exception raised: grouped, the job went round uncharged for ever; alone, it waited for its
    # lease to run out and was taken for a worker that died
    bad = enqueue(conn, "t.bad_repr", {}).id
    conn.commit()
    run_burst(dsn, group_max=group_max, timeout=30)
    row = job(dsn, bad)
    assert (row["state"], row["attempts"], row["lease_expirations"]) == ("dead_lettered", 2, 0)
    assert row["errors"][0]["class"] == "ValueError"


TENANT_CHECK = """
CREATE TABLE tenant_items (tenant text NOT NULL);
CREATE FUNCTION tenant_check() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('app.tenant', true) IS DISTINCT FROM NEW.tenant THEN
        RAISE EXCEPTION 'row of tenant % written under tenant %', NEW.tenant, current_setting('app.tenant', true);
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER tenant_check AFTER INSERT ON tenant_items DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION tenant_check();
"""


def test_a_jobs_set_local_holds_until_its_commit(dsn: str, conn: db.Conn) -> None:
    # the session's reset went before COMMIT: a tenant set for the transaction was gone when its deferred
    # triggers ran, and every such job failed and was dead-lettered
    conn.execute(TENANT_CHECK)
    ids = [enqueue(conn, "t.tenant_local", {"tenant": t}).id for t in ("t1", "t2")]
    conn.commit()
    run_burst(dsn, group_max=1)
    assert [state(dsn, j) for j in ids] == ["succeeded", "succeeded"]
    assert [job(dsn, j)["attempts"] for j in ids] == [1, 1]


def test_grouped_jobs_whose_deferred_triggers_read_their_set_local_end_up_alone_and_succeed(
    dsn: str, conn: db.Conn
) -> None:
    # in a group a job's SET LOCAL lasts until the next job begins: the group's commit fails once on the
    # first job's row, and the type runs one job per transaction from then on
    conn.execute(TENANT_CHECK)
    ids = [enqueue(conn, "t.tenant_local", {"tenant": t}).id for t in ("t1", "t2")]
    conn.commit()
    wt = WorkerThread(dsn, concurrency=1, group_max=32)
    wt.worker.observe_handler("t.tenant_local", 0.001)  # measured fast: the two go in one group
    assert wt.start().join(60) == 0
    assert [state(dsn, j) for j in ids] == ["succeeded", "succeeded"]
    assert "t.tenant_local" in wt.worker._ungrouped


def slow_commits(conn: db.Conn, seconds: float) -> None:
    """A table whose rows a deferred trigger checks for ``seconds`` at COMMIT (t.slow_commit writes one)."""
    conn.execute(f"""
        CREATE TABLE slow_commit (job_id uuid);
        CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_sleep({float(seconds)}); RETURN NULL; END $$;
        CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow_commit DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW EXECUTE FUNCTION slow_commit();
    """)


def test_a_slow_commit_holds_up_no_other_thread_of_the_worker(dsn: str, conn: db.Conn) -> None:
    # the commit that resets the session waited for its answer holding the GIL: every other thread of the
    # worker (its beats, the other slots, the watchdog) froze for as long as the COMMIT took
    import itertools
    import threading
    import time

    slow_commits(conn, 1.5)
    j = enqueue(conn, "t.slow_commit", {}).id
    conn.commit()
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    threading.Thread(target=ticker, daemon=True).start()
    try:
        run_burst(dsn, group_max=1)
    finally:
        stop.set()
    assert state(dsn, j) == "succeeded"
    longest = max(b - a for a, b in itertools.pairwise(ticks))
    assert longest < 1.0, f"the test's own thread stood still {longest:.2f}s"


def test_a_left_over_tasks_transaction_block_touches_nothing_of_the_next_job(dsn: str, conn: db.Conn) -> None:
    # ctx.tx.transaction() was not refused to a finished job's task: its SAVEPOINT went into the next job's
    # transaction, and its ROLLBACK TO took that job's later write with it; the job settled succeeded
    a = enqueue(conn, "t.async_leaves_a_block", {}, priority=0).id
    b = enqueue(conn, "t.async_steps", {}, priority=1, idempotency_key="kb").id
    conn.commit()
    run_burst(dsn, concurrency=1)
    assert (state(dsn, a), state(dsn, b)) == ("succeeded", "succeeded")
    assert sorted(r["item"] for r in ledger(dsn)) == ["A", "b1", "b2"]


def test_an_async_jobs_slow_commit_is_no_part_of_its_timeout(dsn: str, conn: db.Conn) -> None:
    # the watchdog kept its handler's deadline through the settlement: it abandoned the slot in the middle
    # of the COMMIT, and the job failed as a timeout, attempt after attempt
    slow_commits(conn, 2.5)
    j = enqueue(conn, "t.async_slow_commit", {}).id
    conn.commit()
    run_burst(dsn, cancel_grace=0.2)
    assert (state(dsn, j), job(dsn, j)["attempts"]) == ("succeeded", 1), job(dsn, j)["errors"]


def _fail_over(dsn: str) -> None:
    """What a restart or a failover does to every session of this test's database (never another's: other
    tests share the server): FATAL 57P01 (admin_shutdown), then the socket closed."""
    with db.connect(dsn, autocommit=True) as c:
        ended = c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchall()
    assert ended


def _uncharged_success(dsn: str, j: Any, *items: str) -> None:
    row = job(dsn, j)
    assert (row["state"], row["attempts"], row["errors"]) == ("succeeded", 1, []), row["last_error"]
    assert [r["item"] for r in ledger(dsn) if r["job_id"] == j] == list(items)  # the lost attempt's rolled back


@pytest.mark.parametrize("write_again", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("job_type", ["t.ledger", "t.async_ledger"], ids=["sync", "async"])
def test_a_failover_while_a_handler_runs_gives_its_job_back_uncharged(
    dsn: str, conn: db.Conn, job_type: str, write_again: bool
) -> None:
    # the server ended every session while the job's handler ran in its transaction (its idempotency
    # record and write in it): the job was charged an attempt, an anomaly ("the connection of the job's
    # transaction was lost while its handler ran"), and on its last one dead-lettered by the outage. Also
    # when the handler's next write raised what the lost connection gave it (AdminShutdown, 57P01)
    payload = {"item": "x", "sleep": 2.0, "write_again": write_again}
    j = enqueue(conn, job_type, payload, idempotency_key="fo-1", max_attempts=1).id
    with running_worker(dsn, group_max=1):
        wait_for(lambda: state(dsn, j) == "running", 10)
        time.sleep(0.7)  # the handler is in its sleep, its transaction open
        _fail_over(dsn)
        wait_for(lambda: state(dsn, j) not in ("running", "queued"), 30)
    _uncharged_success(dsn, j, *(["x", "x"] if write_again else ["x"]))
    assert metric(dsn, "anomalies") == 0


@pytest.mark.parametrize("write_again", [False, True], ids=["returns", "raises"])
def test_a_failover_while_a_grouped_handler_runs_gives_the_whole_group_back_uncharged(
    dsn: str, conn: db.Conn, write_again: bool
) -> None:
    # the same in a group: the job whose handler ran was charged (and dead-lettered on its last attempt),
    # the others given back
    with running_worker(dsn, **GROUPED) as w:
        w.observe_handler("t.ledger", 0.01)
        with conn.transaction():  # claimed together
            ids = [
                enqueue(conn, "t.ledger", {"item": item, "sleep": 2.0 * (item == "b"), "write_again": write_again},
                        idempotency_key=f"fo-{item}", max_attempts=1, priority=n).id
                for n, item in enumerate("abc")
            ]  # fmt: skip
        wait_for(lambda: state(dsn, ids[1]) == "running", 10)
        time.sleep(0.7)  # b is in its sleep, a done before it in the group's transaction, c waiting
        _fail_over(dsn)
        wait_for(lambda: all(state(dsn, j) not in ("running", "queued") for j in ids), 30)
        assert w.groups
    for j, item in zip(ids, "abc", strict=True):
        _uncharged_success(dsn, j, *([item, item] if write_again and item == "b" else [item]))
    assert metric(dsn, "anomalies") == 0


@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "grouped"])
@pytest.mark.parametrize("how", ["terminate", "finish"])
def test_a_handler_that_ends_its_session_as_an_outage_would_is_given_back_a_bounded_number_of_times(
    dsn: str, conn: db.Conn, how: str, grouped: bool
) -> None:
    # an outage, for all the worker can tell: given back uncharged, but not for ever (MAX_UNCHARGED_GIVE_BACKS
    # per job and worker), then charged each time, and dead-lettered in the end
    j = enqueue(conn, "t.own_end", {"item": "o", "how": how}).id
    w = run_grouped(dsn, ("t.own_end",)) if grouped else run_burst(dsn, group_max=1)
    row = job(dsn, j)
    assert (row["state"], row["attempts"]) == ("dead_lettered", 2)
    assert w._given_back[j] == MAX_UNCHARGED_GIVE_BACKS + 2  # 3 times uncharged, then charged both attempts
    assert all("lost while its handler ran" in e["message"] for e in row["errors"]), row["errors"]
