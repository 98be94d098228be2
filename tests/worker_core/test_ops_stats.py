"""The read side (stats) on a known workload, and operator actions (ops): audited, refused read-only."""

from __future__ import annotations

import datetime as dt
import getpass
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.conftest import dsn_for
from tests.worker_core.conftest import EFFECT_TABLES
from tests.worker_core.helpers import run_burst, wait_for
from worker_core import FixedClock, ReadOnlyError, db, enqueue, ops, stats
from worker_core.models import JobState
from worker_core.sql import queries

NOW = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


@pytest.fixture(scope="module")
def workload(admin_dsn: str, template_db: str) -> Iterator[dict[str, Any]]:
    """One database with a known history, shared by the tests that only read it:
    3 t.ok succeeded; 2 t.permanent failed (one with SQL metacharacters in its error); 3 t.unknown and
    3 t.base_exc dead-lettered; then, not run: 2 waiting in queue 'lagging' (one 120 s late, one due
    in an hour) and 1 in the paused queue 'held'."""
    name = f"qc_w_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    dsn = dsn_for(admin_dsn, name)
    ids: dict[str, Any] = {}
    with db.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECT_TABLES)
        ids["ok"] = [enqueue(conn, "t.ok", {"n": i}, idempotency_key=f"ok-{i}").id for i in range(3)]
        ids["permanent"] = [
            enqueue(conn, "t.permanent", {"invoice": "inv_9"}, dedup_key="perm-1", lock_key="order:ord_1").id,
            enqueue(conn, "t.permanent", {"invoice": "50%_off"}).id,
        ]
        ids["unknown"] = [enqueue(conn, "t.unknown", {"key": k}).id for k in ("a", "b", "c")]
        ids["memory"] = [enqueue(conn, "t.base_exc", {"kind": "memory"}).id for _ in range(2)]
        ids["exit"] = [enqueue(conn, "t.base_exc", {"kind": "exit"}).id]
        run_burst(dsn)
        ids["late"] = enqueue(conn, "t.ok", {}, queue="lagging", clock=FixedClock(NOW - dt.timedelta(seconds=120))).id
        ids["future"] = enqueue(conn, "t.ok", {}, queue="lagging", delay_seconds=3600, clock=FixedClock(NOW)).id
        ops.pause(conn, "held", actor=ops.Actor("setup"), allow_unknown=True)  # before its job
        ids["held"] = enqueue(conn, "t.ok", {}, queue="held", clock=FixedClock(NOW)).id
    yield {"dsn": dsn, **ids}
    with psycopg.connect(admin_dsn, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def wconn(workload: dict[str, Any]) -> Iterator[db.Conn]:
    with db.connect(workload["dsn"], autocommit=True) as c:
        yield c


def snapshot(conn: db.Conn) -> dict[str, Any]:
    return {
        "jobs": conn.execute("SELECT * FROM job_queue ORDER BY id").fetchall(),
        "queues": conn.execute("SELECT * FROM queues ORDER BY name").fetchall(),
        "audit": conn.execute("SELECT count(*) AS n FROM audit_log").fetchone(),
    }


# --------------------------------------------------------------------------- stats.overview


def test_rates_divide_by_the_time_the_window_covers(conn: db.Conn) -> None:
    """A steady 60 a minute read at 12:00:30: 14 full minutes and half of this one hold 870, which is 60 a
    minute; divided by 15 minutes it read 58 (and near a threshold, a DLQ rate read low hides its warning)."""
    now = dt.datetime(2030, 1, 1, 12, 0, 30, tzinfo=dt.timezone.utc)
    rows = [(now.replace(second=0) - dt.timedelta(minutes=m), 60, 6) for m in range(1, 15)]
    rows.append((now.replace(second=0), 30, 3))
    for minute, ok, dead in rows:
        conn.execute(
            "INSERT INTO job_metrics_minute (minute, queue, job_type, succeeded, dead_lettered)"
            " VALUES (%s, 'default', 't.ok', %s, %s)",
            (minute, ok, dead),
        )
    t = {x.job_type: x for x in stats.overview(conn, clock=FixedClock(now)).types}["t.ok"]
    assert t.throughput_per_min == pytest.approx(60.0) and t.dlq_per_min == pytest.approx(6.0)


def test_overview_counts_lag_and_rates_on_a_known_workload(wconn: db.Conn) -> None:
    ov = stats.overview(wconn, clock=FixedClock(NOW))
    by = {(t.queue, t.job_type): t for t in ov.types}
    ok, perm, unk, exc = by[("default", "t.ok")], by[("default", "t.permanent")], by[("default", "t.unknown")], by[
        ("default", "t.base_exc")]  # fmt: skip
    assert (ok.succeeded, ok.waiting, ok.running, ok.failed, ok.dead_lettered) == (3, 0, 0, 0, 0)
    covered = ov.window_minutes - 1 + NOW.second / 60  # its full minutes, and the current one so far
    assert ok.throughput_per_min == pytest.approx(3 / covered)
    assert (perm.failed, perm.succeeded, perm.retries) == (2, 0, 0)
    assert (unk.dead_lettered, unk.retries, unk.anomalies) == (3, 3, 6)  # 2 attempts each
    assert unk.dlq_per_min == pytest.approx(3 / covered)
    assert exc.dead_lettered == 3
    lag = by[("lagging", "t.ok")]
    assert (lag.queued, lag.oldest_waiting_seconds) == (2, 120.0)  # the job due in an hour is not lag
    held = by[("held", "t.ok")]
    assert held.paused and held.queued == 1
    queues = {q.name: q for q in ov.queues}
    assert queues["held"].paused and queues["held"].changed_by == "setup"
    assert (queues["lagging"].waiting, queues["lagging"].paused) == (2, False)
    assert ov.workers_alive == 0  # the burst worker said goodbye


def test_overview_lag_follows_the_clock(wconn: db.Conn) -> None:
    later = stats.overview(wconn, clock=FixedClock(NOW + dt.timedelta(seconds=30)))
    (lag,) = [t for t in later.types if t.queue == "lagging"]
    assert lag.oldest_waiting_seconds == 150.0


# --------------------------------------------------------------------------- stats.list_jobs


def test_list_jobs_filters(wconn: db.Conn, workload: dict[str, Any]) -> None:
    failed = stats.list_jobs(wconn, state="failed")
    assert {j.id for j in failed} == set(workload["permanent"])
    assert all(j.state is JobState.FAILED for j in failed)
    assert {j.id for j in stats.list_jobs(wconn, job_type="t.unknown")} == set(workload["unknown"])
    assert {j.id for j in stats.list_jobs(wconn, queue="lagging")} == {workload["late"], workload["future"]}
    assert {j.id for j in stats.list_jobs(wconn, state=JobState.DEAD_LETTERED, job_type="t.base_exc")} == set(
        workload["memory"] + workload["exit"]
    )
    assert len(stats.list_jobs(wconn, limit=4)) == 4
    assert stats.list_jobs(wconn, state="queued", job_type="t.permanent") == []
    with pytest.raises(ValueError):
        stats.list_jobs(wconn, state="paused")


def test_list_jobs_is_newest_activity_first_across_waiting_running_and_finished_jobs(conn: db.Conn) -> None:
    at = [NOW + dt.timedelta(seconds=s) for s in range(6)]
    ids = [enqueue(conn, "t.ok", {"n": i}, clock=FixedClock(at[0])).id for i in range(6)]
    # what each job's last transition left: (state, updated_at, finished_at)
    rows = [
        ("succeeded", at[1], at[1]),
        ("running", at[2], None),
        ("queued", at[3], None),
        ("dead_lettered", at[4], at[4]),
        ("retry_scheduled", at[5], None),
        ("cancelled", at[0], at[0]),
    ]
    for j, (state, updated, finished) in zip(ids, rows, strict=True):
        conn.execute(
            "UPDATE job_queue SET state = %s, updated_at = %s, finished_at = %s WHERE id = %s",
            (state, updated, finished, j),
        )
    newest_first = [ids[4], ids[3], ids[2], ids[1], ids[0], ids[5]]
    assert [j.id for j in stats.list_jobs(conn)] == newest_first
    assert [j.id for j in stats.list_jobs(conn, limit=3)] == newest_first[:3]
    assert [j.id for j in stats.list_jobs(conn, state="running")] == [ids[1]]
    assert [j.id for j in stats.list_jobs(conn, state="cancelled")] == [ids[5]]


def test_list_jobs_breaks_ties_by_id_in_every_source(conn: db.Conn) -> None:
    # a batch settles hundreds of jobs at one timestamp: the first N are the N smallest ids, not any N
    ids = [enqueue(conn, "t.ok", {"n": i}, clock=FixedClock(NOW)).id for i in range(30)]
    conn.execute(
        "UPDATE job_queue SET state = 'succeeded', finished_at = %s, updated_at = %s WHERE id = ANY(%s)",
        (NOW, NOW, ids[:20]),
    )
    assert [j.id for j in stats.list_jobs(conn, limit=5)] == sorted(ids)[:5]
    assert [j.id for j in stats.list_jobs(conn, state="succeeded", limit=5)] == sorted(ids[:20])[:5]
    assert [j.id for j in stats.list_jobs(conn, state="queued", limit=5)] == sorted(ids[20:])[:5]


def test_list_jobs_reads_each_source_through_its_index(conn: db.Conn) -> None:
    # no index over every row version by updated_at (each claim and settlement would write to it): the
    # waiting and finished jobs are read newest first through partial indexes, never by sorting the table
    assert conn.execute("SELECT to_regclass('job_queue_updated_idx') AS i").fetchone() == {"i": None}
    query, params = stats.list_jobs_query(limit=200)
    conn.execute("SET enable_seqscan = off")  # a table this small would be read whole
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(sql.SQL("EXPLAIN ") + query, params))
    assert "job_queue_waiting_updated_idx" in plan and "job_queue_finished_idx" in plan, plan
    query, params = stats.list_jobs_query(state="succeeded")  # one source only
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(sql.SQL("EXPLAIN ") + query, params))
    assert plan.count("Index Scan") == 1 and "job_queue_finished_idx" in plan, plan
    # the waiting jobs' index holds the list's order, ties included: nothing to sort, whatever the estimates
    query, params = stats.list_jobs_query(state="queued")
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(sql.SQL("EXPLAIN ") + query, params))
    inner = plan.split("->  Limit")[-1]
    assert "job_queue_waiting_updated_idx" in inner and "Sort" not in inner, plan
    # and no other index can stand in for it: the ready index (by priority), say, would have the planner
    # sort every waiting job whenever its statistics expect none
    with conn.transaction():
        conn.execute("DROP INDEX job_queue_waiting_updated_idx")
        for state in ("queued", None):
            query, params = stats.list_jobs_query(state=state)
            plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(sql.SQL("EXPLAIN ") + query, params))
            waiting = plan.split("->  Limit")[1]  # the first source's
            assert "job_queue_ready_idx" not in waiting and "job_queue_waiting_idx" not in waiting, plan
        raise psycopg.Rollback()


def test_list_jobs_next_first_is_the_claim_order_through_the_ready_index(conn: db.Conn) -> None:
    # newest activity first only: in a backlog the head of the queue (the oldest waiting job, the one behind
    # a lag) was past the newest 10,000, out of every list's reach
    now = dt.datetime.now(dt.timezone.utc)
    late = enqueue(conn, "t.ok", {}, priority=5).id
    urgent = enqueue(conn, "t.ok", {}, priority=-1).id
    old = enqueue(conn, "t.ok", {}, priority=5, scheduled_at=now + dt.timedelta(seconds=1)).id
    retrying = enqueue(conn, "t.ok", {}, queue="mail").id
    running = enqueue(conn, "t.ok", {}).id
    conn.execute("UPDATE job_queue SET scheduled_at = now() - interval '1 hour' WHERE id = %s", (old,))
    conn.execute("UPDATE job_queue SET state = 'retry_scheduled' WHERE id = %s", (retrying,))
    conn.execute("UPDATE job_queue SET state = 'running', attempts = 1 WHERE id = %s", (running,))
    ids = [j.id for j in stats.list_jobs(conn, next_first=True)]
    assert ids[0] == urgent and ids.index(old) < ids.index(late) and running not in ids and retrying in ids
    assert [j.id for j in stats.list_jobs(conn, next_first=True, queue="mail")] == [retrying]
    assert stats.list_jobs(conn, next_first=True, state="running") == []  # no longer in line
    conn.execute(  # a backlog of 20,000 beside 20,000 finished jobs, its statistics fresh
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at) SELECT 't.ok', 'default', '{}',"
        " CASE WHEN i % 2 = 0 THEN 'queued' ELSE 'succeeded' END, now() FROM generate_series(1, 40000) AS i"
    )
    conn.execute("ANALYZE job_queue")
    query, params = stats.list_jobs_query(next_first=True, limit=200)
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(sql.SQL("EXPLAIN ") + query, params))
    assert "Index Scan using job_queue_ready_idx" in plan and "Sort" not in plan, plan  # the claim's walk


def test_live_counts_read_the_waiting_and_running_indexes(conn: db.Conn) -> None:
    # no index holds every live state (migration 0011: a claim makes one index entry fewer); the counts
    # of the overview and of a --burst worker read the waiting jobs' and the running jobs' partial indexes,
    # never the finished rows
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at) "
        "SELECT 't.ok', 'default', '{}', 'succeeded', now() FROM generate_series(1, 20000)"
    )
    ids = [enqueue(conn, "t.ok", {"n": i}, queue=("a", "b")[i % 2]).id for i in range(6)]
    conn.execute(
        "UPDATE job_queue SET state = 'running', locked_until = now() + interval '1 minute' WHERE id = ANY(%s)",
        (ids[:2],),
    )
    conn.execute("UPDATE job_queue SET state = 'retry_scheduled' WHERE id = %s", (ids[2],))
    conn.execute("ANALYZE job_queue")
    burst = {
        "now": dt.datetime.now(dt.timezone.utc), "all_queues": True, "queues": [], "job_types": ["t.ok"],
    }  # fmt: skip
    for name, params in (("stats_live", {"now": burst["now"]}), ("burst_remaining", burst)):
        plan = "\n".join(r["QUERY PLAN"] for r in conn.execute("EXPLAIN " + queries[name], params))
        assert "Seq Scan on job_queue" not in plan, plan
        assert "job_queue_waiting_idx" in plan and "job_queue_running_idx" in plan, plan
    assert conn.execute(queries["burst_remaining"], burst).fetchone() == {"n": 6}
    counts = {t.queue: (t.queued, t.running, t.retry_scheduled) for t in stats.overview(conn).types}
    assert counts == {"a": (1, 1, 1), "b": (2, 1, 0)}


def test_list_jobs_search(wconn: db.Conn, workload: dict[str, Any]) -> None:
    def found(text: str) -> set[uuid.UUID]:
        return {j.id for j in stats.list_jobs(wconn, search=text)}

    target = workload["unknown"][1]
    assert found(str(target)[:13]) == {target}  # an id prefix
    assert found(str(target)) == {target}
    assert found("ok-2") == {workload["ok"][2]}  # idempotency key
    assert found("perm-1") == {workload["permanent"][0]}  # dedup key
    assert found("order:ord_1") == {workload["permanent"][0]}  # lock key
    assert found("DOES NOT EXIST") == set(workload["permanent"])  # error text, any case
    assert found("out of memory") == set(workload["memory"])
    assert found("no such thing anywhere") == set()


def rows_read(conn: db.Conn, query: sql.Composable, params: dict[str, Any]) -> int:
    """The job_queue rows a statement read (returned or filtered out), from EXPLAIN ANALYZE."""
    plan = conn.execute(sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + query, params).fetchone()
    assert plan is not None
    total, stack = 0, [plan["QUERY PLAN"][0]["Plan"]]
    while stack:
        node = stack.pop()
        if node.get("Relation Name") == "job_queue":
            loops = node.get("Actual Loops", 1)
            total += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * loops
        stack.extend(node.get("Plans", []))
    return int(total)


def test_a_search_reads_indexes_never_every_finished_row(conn: db.Conn, monkeypatch: pytest.MonkeyPatch) -> None:
    """With millions of finished jobs, `id::text LIKE` and an error-text ILIKE over all of them timed out
    (3 s at 6M rows), and the jobs screen went on showing unfiltered rows. An id (or a prefix of one) is a
    range of the primary key, an idempotency key its index, and the other keys and the error text are
    looked for among the newest jobs of each kind only."""
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error) "
        "SELECT 't.ok', 'default', '{}', 'succeeded', now() - g * interval '1 second', 'boom ' || g"
        " FROM generate_series(1, 60000) AS g"
    )
    conn.execute("ANALYZE job_queue")
    oldest = conn.execute("SELECT id FROM job_queue ORDER BY finished_at LIMIT 1").fetchone()
    assert oldest is not None
    monkeypatch.setattr(stats, "SEARCH_SCAN_ROWS", 1000)
    for text in (str(oldest["id"]), str(oldest["id"])[:8], "boom 17", "some-key"):
        query, params = stats.list_jobs_query(search=text)
        assert rows_read(conn, query, params) < 5000, text  # not the 60,000
    # the oldest of 60,000 finished jobs: beyond the newest 1,000 of them, its id still finds it
    assert [j.id for j in stats.list_jobs(conn, search=str(oldest["id"]))] == [oldest["id"]]
    assert oldest["id"] in {j.id for j in stats.list_jobs(conn, search=str(oldest["id"])[:8])}
    errors = [j.last_error or "" for j in stats.list_jobs(conn, search="boom 17", limit=3)]
    assert len(errors) == 3 and all(e.startswith("boom 17") for e in errors)


def test_a_filtered_search_finds_older_matches_beyond_the_newest_jobs(
    conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stats, "SEARCH_SCAN_ROWS", 1000)
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error)"
        " SELECT 't.ok', 'default', '{}', 'failed', now() - interval '1 day' - g * interval '1 s', 'boom'"
        " FROM generate_series(1, 5) AS g"
    )
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at)"
        " SELECT 't.ok', 'default', '{}', 'succeeded', now() - g * interval '1 ms' FROM generate_series(1, 5000) g"
    )
    assert len(stats.list_jobs(conn, search="boom", state="failed")) == 5  # the filter picks the kind's newest
    assert len(stats.list_jobs(conn, search="boom")) == 0  # unfiltered, the newest 1,000 finished hold none


def test_the_consoles_reads_of_unsuccessful_jobs_do_not_grow_with_the_finished_table(
    conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured at 1M-6M finished rows: the overview's dead counts, the jobs list on a failed state and the
    attempts chart each read (nearly) the whole table: 0.4-2 s a refresh."""
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at)"
        " SELECT 't.ok', 'default', '{}', 'succeeded', 1, now() - g * interval '10 ms'"
        " FROM generate_series(1, 60000) AS g"
    )
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at, last_error)"
        " SELECT 't.ok', 'default', '{}', (ARRAY['failed', 'dead_lettered'])[1 + g % 2], 3,"
        "        now() - interval '2 hours' - g * interval '1 second', 'boom'"
        " FROM generate_series(1, 200) AS g"
    )
    conn.execute("ANALYZE job_queue")
    assert rows_read(conn, sql.SQL(queries["stats_dead"]), {}) <= 200
    for state in ("failed", "dead_lettered", "cancelled"):
        query, params = stats.list_jobs_query(state=state, limit=50)
        assert rows_read(conn, query, params) <= 100, state
    monkeypatch.setattr(stats, "ATTEMPTS_SAMPLE", 1000)
    since = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    assert rows_read(conn, sql.SQL(queries["stats_attempts_distribution"]), {"since": since, "sample": 1000}) <= 1000
    assert stats.attempts_distribution(conn) == {"t.ok": {1: 1000}}
    assert {(j.state.value) for j in stats.list_jobs(conn, state="failed")} == {"failed"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("'; drop table job_queue; --", set()),
        ("%", "pct"),  # only the job whose error literally contains "%"
        ("_", "unders"),  # only jobs with a literal underscore somewhere searched
        ("%_", "pct"),  # only the job whose error literally contains "%_"
        ("\\", set()),
        ("50%_off", "pct"),
    ],
    ids=["sql-injection", "percent", "underscore", "percent-underscore", "backslash", "literal"],
)
def test_list_jobs_search_with_metacharacters_is_harmless(
    wconn: db.Conn, workload: dict[str, Any], text: str, expected: Any
) -> None:
    before = snapshot(wconn)
    got = {j.id for j in stats.list_jobs(wconn, search=text)}
    if expected == "pct":
        expected = {workload["permanent"][1]}
    elif expected == "unders":
        expected = set(workload["permanent"])  # "inv_9", "50%_off" in their errors ("order:ord_1" is exact-only)
    assert got == expected
    assert snapshot(wconn) == before


# --------------------------------------------------------------------------- dead letters


def test_dead_letter_groups_group_by_fingerprint(wconn: db.Conn, workload: dict[str, Any]) -> None:
    groups = stats.dead_letter_groups(wconn)
    summary = [(g.job_type, g.fingerprint, g.count, set(g.job_ids)) for g in groups]
    assert summary == [
        ("t.unknown", "KeyError: '<*>'", 3, set(workload["unknown"])),
        ("t.base_exc", "MemoryError: out of memory", 2, set(workload["memory"])),
        ("t.base_exc", "SystemExit: <n>", 1, set(workload["exit"])),
    ]
    assert groups[0].sample_error.startswith("KeyError: ")
    assert groups[0].first_seen <= groups[0].last_seen
    failed = stats.dead_letter_groups(wconn, states=("failed",))
    assert [(g.fingerprint, g.count) for g in failed] == [
        ("PermanentError: invoice <id> does not exist", 1),
        ("PermanentError: invoice <n>%_off does not exist", 1),
    ]
    assert [g.job_type for g in stats.dead_letter_groups(wconn, job_type="t.base_exc")] == ["t.base_exc"] * 2
    assert set(ops.group_job_ids(wconn, "t.unknown", "KeyError: '<*>'")) == set(workload["unknown"])


def test_a_dead_letter_group_without_a_fingerprint_and_the_newest_ids_first(conn: db.Conn) -> None:
    """Jobs with no error recorded (a lease lost before any error) form a group of their own, named
    "(no error recorded)"; a group lists its newest jobs first, at most max_ids of them."""
    ids = []
    for i in range(5):
        ids.append(enqueue(conn, "t.ok", {}).id)
        conn.execute(
            "UPDATE job_queue SET state = 'dead_lettered', finished_at = now() + %s * interval '1 second'"
            " WHERE id = %s",
            (i, ids[-1]),
        )
    [group] = stats.dead_letter_groups(conn, max_ids=3)
    assert (group.job_type, group.fingerprint, group.count) == ("t.ok", "(no error recorded)", 5)
    assert group.job_ids == ids[::-1][:3]
    assert sorted(ops.group_job_ids(conn, "t.ok", "(no error recorded)")) == sorted(ids)
    assert ops.group_job_ids(conn, "t.ok", "KeyError: '<*>'") == []


def test_read_only_connection_reads_but_refuses_every_operator_action(workload: dict[str, Any]) -> None:
    with db.connect(workload["dsn"], read_only=True) as ro:
        before = snapshot(ro)
        ro.rollback()
        assert stats.overview(ro).types and stats.list_jobs(ro, limit=3)
        ro.rollback()
        actions = [
            lambda: ops.requeue(ro, workload["unknown"], actor=ops.Actor("intruder")),
            lambda: ops.kill(ro, [workload["late"]], actor=ops.Actor("intruder")),
            lambda: ops.pause(ro, "lagging", actor=ops.Actor("intruder")),
            lambda: ops.resume(ro, "held", actor=ops.Actor("intruder")),
            lambda: ops.audit_worker(
                ro, "worker_start", number=1, pid=1, queues=[], concurrency=1, tasks=["t"], actor=ops.Actor("intruder")
            ),
        ]
        for action in actions:
            with pytest.raises(ReadOnlyError, match="read-only"):
                action()
            ro.rollback()
    with db.connect(workload["dsn"], autocommit=True) as rw:
        assert snapshot(rw) == before


# --------------------------------------------------------------------------- audit


def test_every_operator_action_is_audited_with_who_and_from_where(
    conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSH_CLIENT", "10.20.30.40 51234 22")
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    waiting = enqueue(conn, "t.ok", {}).id
    dead = enqueue(conn, "t.unknown", {}).id
    run_burst(dsn)
    waiting2 = enqueue(conn, "t.ok", {}).id

    results = [
        ops.kill(conn, [waiting2], reason="duplicate order"),
        ops.requeue(conn, [dead, waiting], reason="fixed upstream", budget=2),
        ops.pause(conn, "default", reason="incident 42"),
        ops.resume(conn, "default"),
    ]
    entries = {e.id: e for e in stats.audit_log(conn)}
    assert len(entries) == 4
    for r in results:
        e = entries[r.audit_id]
        assert e.os_user == getpass.getuser() and e.ssh_client == "10.20.30.40"
        assert e.at is not None
    kill, requeue, pause, resume = (entries[r.audit_id] for r in results)
    assert (kill.action, kill.job_ids, kill.reason) == ("kill", [waiting2], "duplicate order")
    assert kill.detail["cancelled"] == 1
    # only the dead letter changed (the succeeded job is not requeueable): the audit says so
    assert (requeue.action, requeue.job_ids, requeue.detail["requested"]) == ("requeue", [dead], 2)
    assert requeue.detail["budget"] == 2 and results[1].skipped == [waiting]
    assert (pause.action, pause.queue, pause.reason) == ("pause", "default", "incident 42")
    assert (resume.action, resume.queue) == ("resume", "default")
    # newest first
    assert [e.action for e in stats.audit_log(conn)] == ["resume", "pause", "requeue", "kill"]


def test_an_embedded_worker_started_or_stopped_from_the_console_is_audited(
    conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the console's s and x left no trace: who started the worker that ran the night's jobs, who stopped it
    monkeypatch.setenv("SSH_CLIENT", "10.20.30.40 51234 22")
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    start = ops.audit_worker(conn, "worker_start", number=3, pid=4121, host="web-1", queues=["billing"],
                             concurrency=4, tasks=["myapp.tasks"])  # fmt: skip
    stop = ops.audit_worker(conn, "worker_stop", number=3, pid=4121, host="web-1", queues=["billing", "mail"],
                            concurrency=4, tasks=["myapp.tasks", "myapp.more"], token="abc")  # fmt: skip
    every = ops.audit_worker(conn, "worker_stop", number=4, pid=None, queues=[], concurrency=2, tasks=["t"],
                             restart_cancelled=True)  # fmt: skip
    assert (start.action, stop.action, start.requested, start.changed) == ("worker_start", "worker_stop", 1, [])
    entries = {e.id: e for e in stats.audit_log(conn)}
    first, second, third = (entries[r.audit_id] for r in (start, stop, every))
    assert (first.os_user, first.ssh_client) == (getpass.getuser(), "10.20.30.40")
    assert (first.action, first.job_ids, first.reason) == ("worker_start", [], None)
    assert first.detail == {"number": 3, "pid": 4121, "host": "web-1", "queues": ["billing"], "concurrency": 4,
                            "tasks": ["myapp.tasks"]}  # fmt: skip
    # the queue column names a worker's only queue; a worker on several, or every, queue has them in its detail
    assert (first.queue, second.queue, third.queue) == ("billing", None, None)
    assert second.detail["queues"] == ["billing", "mail"] and second.detail[ops.TOKEN_KEY] == "abc"
    assert ops.audit_entry_of_token(conn, "abc") == (stop.audit_id, 0)
    assert third.detail["queues"] == [] and third.detail["restart_cancelled"] is True and third.detail["pid"] is None
    with pytest.raises(ValueError, match="worker_start or worker_stop"):
        ops.audit_worker(conn, "worker_restart", number=1, pid=1, queues=[], concurrency=1, tasks=["t"])
    assert len(stats.audit_log(conn)) == 3


def test_an_action_and_its_audit_row_commit_together(dsn: str) -> None:
    with db.connect(dsn, autocommit=True) as c:
        j = enqueue(c, "t.ok", {}).id
    with db.connect(dsn) as c:  # the caller's transaction: rolled back, neither the kill nor its audit stays
        c.execute("SELECT 1")
        ops.kill(c, [j], actor=ops.Actor("tester"))
        c.rollback()
    with db.connect(dsn, autocommit=True) as c:
        assert stats.get_job(c, j).state is JobState.QUEUED
        assert stats.audit_log(c) == []


def test_a_kill_racing_a_worker_that_gives_the_job_back_still_kills_it(dsn: str, conn: db.Conn) -> None:
    # the worker's release (running -> queued, at shutdown) commits while the kill is in flight: the kill
    # must cancel the job in whichever state it finds it, not miss it between "waiting" and "running"
    j = enqueue(conn, "t.ok", {}).id
    conn.execute("UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'w', locked_until = now() "
                 "+ interval '1 minute', started_at = now() WHERE id = %s", (j,))  # fmt: skip
    with db.connect(dsn) as releaser:
        releaser.execute(
            "UPDATE job_queue SET state = 'queued', attempts = 0, locked_by = NULL, locked_until = NULL "
            "WHERE id = %s",
            (j,),
        )
        results: list[ops.ActionResult] = []
        with db.connect(dsn, autocommit=True) as operator:
            pid = operator.info.backend_pid
            killer = threading.Thread(target=lambda: results.append(ops.kill(operator, [j], actor=ops.Actor("oncall"))))
            killer.start()
            wait_for(
                lambda: conn.execute(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone() == {"wait_event_type": "Lock"},
                10,
                what="the kill to wait for the releasing transaction",
            )
            releaser.commit()
            killer.join(10)
    assert results and results[0].changed == [j]
    assert conn.execute("SELECT state FROM job_queue WHERE id = %s", (j,)).fetchone() == {"state": "cancelled"}


def test_requeue_of_dead_jobs_sharing_a_dedup_key_requeues_one_and_skips_the_others(conn: db.Conn) -> None:
    # an hourly sync's key: dedup collapses live jobs only, so dead ones pile up under one key. Requeued
    # together, at most one may be live again (the partial unique index); before, none was and it raised
    ids = []
    for _ in range(3):
        ids.append(enqueue(conn, "t.ok", {}, dedup_key="sync:cust-42").id)
        conn.execute("UPDATE job_queue SET state = 'dead_lettered', finished_at = now() WHERE id = %s", (ids[-1],))
    other = enqueue(conn, "t.ok", {}).id
    conn.execute("UPDATE job_queue SET state = 'dead_lettered', finished_at = now() WHERE id = %s", (other,))
    result = ops.requeue(conn, [*ids, other], actor=ops.Actor("test"))
    assert len(result.changed) == 2 and other in result.changed
    assert sorted(result.skipped) == sorted(i for i in ids if i not in result.changed)
    assert [stats.get_job(conn, i).state for i in ids].count(JobState.QUEUED) == 1
    # said as it is, not as "changed state meanwhile" (the operator would think someone else acted)
    assert set(result.why_skipped.values()) == {"a live job (or a newer requeued one) holds its dedup key"}
    assert result.skipped_summary() == "2 skipped: a live job (or a newer requeued one) holds its dedup key (2)"
    again = ops.requeue(conn, [other], actor=ops.Actor("test"))
    assert again.why_skipped == {other: "it is queued"} and again.skipped_summary() == "1 skipped: it is queued"


def test_a_requeue_racing_a_producer_that_takes_the_dedup_key_skips_the_job(dsn: str, conn: db.Conn) -> None:
    # the producer's job holding the key was not committed when the requeue looked for one: the requeue
    # waited on the unique index, then failed with UniqueViolation (a traceback, and the whole batch lost)
    dead = enqueue(conn, "t.ok", {}, dedup_key="sync:7").id
    conn.execute("UPDATE job_queue SET state = 'dead_lettered', finished_at = now() WHERE id = %s", (dead,))
    conn.commit()
    with db.connect(dsn) as producer:
        live = enqueue(producer, "t.ok", {}, dedup_key="sync:7").id  # not committed yet
        results: list[Any] = []
        with db.connect(dsn, autocommit=True) as operator:
            pid = operator.info.backend_pid

            def requeue() -> None:
                try:
                    results.append(ops.requeue(operator, [dead], actor=ops.Actor("oncall")))
                except Exception as e:
                    results.append(e)

            t = threading.Thread(target=requeue)
            t.start()
            wait_for(
                lambda: conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
                == {"wait_event_type": "Lock"},
                10,
                what="the requeue to wait for the producer's transaction",
            )
            producer.commit()
            t.join(10)
    result = results[0]
    assert isinstance(result, ops.ActionResult), result
    held = "a live job (or a newer requeued one) holds its dedup key"
    assert (result.changed, result.why_skipped) == ([], {dead: held})
    assert stats.get_job(conn, live).state is JobState.QUEUED
    assert stats.get_job(conn, dead).state is JobState.DEAD_LETTERED


def test_error_times_as_postgresql_writes_them_into_json_are_read_back(conn: db.Conn) -> None:
    """kill_jobs and the lease-expiry claim write an error's time with jsonb_build_object: PostgreSQL trims
    the fraction's trailing zeros (25.1+00:00), which Python 3.10's fromisoformat refused, and one such
    error made every read of its job fail (the jobs list, `qconsole job`)."""
    from worker_core.models import AttemptError, parse_timestamp

    times = [dt.datetime(2030, 1, 1, 12, 0, 25, us, tzinfo=dt.timezone.utc) for us in (0, 100000, 120000, 123456)]
    for t in times:
        text = conn.execute("SELECT jsonb_build_object('at', %s::timestamptz)->>'at' AS at", (t,)).fetchone()
        assert text is not None
        assert parse_timestamp(text["at"]) == t, text["at"]
        assert AttemptError.from_json({"attempt": 1, "at": text["at"]}).at == t
    assert parse_timestamp("2030-01-01T12:00:25.1+00") == times[1]
    assert parse_timestamp("not a time") is None


def test_a_skipped_kill_says_why(conn: db.Conn) -> None:
    # it said "not in a state that allows kill" for a job that does not exist, where requeue said "no such
    # job", and the same for a job already being killed
    done = enqueue(conn, "t.ok", {}).id
    conn.execute("UPDATE job_queue SET state = 'succeeded', finished_at = now() WHERE id = %s", (done,))
    running = enqueue(conn, "t.ok", {}).id
    conn.execute("UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'w' WHERE id = %s", (running,))
    ghost = uuid.uuid4()
    assert ops.kill(conn, [running], actor=ops.Actor("oncall")).changed == [running]
    result = ops.kill(conn, [done, running, ghost], actor=ops.Actor("oncall"))
    assert result.why_skipped == {done: "it is succeeded", running: "it is being killed already", ghost: "no such job"}


def test_dead_letters_can_be_discarded_and_a_requeue_undoes_it(conn: db.Conn) -> None:
    # dead letters that could never succeed could not be cleared: kill refused them ("it is dead_lettered"),
    # and they stayed on the dead-letter screen and in its counts until retention pruned them
    dead, failed, live = (enqueue(conn, "t.ok", {}).id for _ in range(3))
    conn.execute(
        "UPDATE job_queue SET state = CASE WHEN id = %s THEN 'dead_lettered' ELSE 'failed' END, attempts = 1,"
        " finished_at = now() - interval '1 hour', last_error = 'ValueError: bad VAT id',"
        " error_fingerprint = 'ValueError: bad VAT id' WHERE id IN (%s, %s)",
        (dead, dead, failed),
    )
    assert "discard it" in ops.kill(conn, [dead], actor=ops.Actor("oncall")).why_skipped[dead]
    assert stats.dead_letter_groups(conn, states=("dead_lettered", "failed")).dead == 2
    result = ops.discard(conn, [dead, failed, live], actor=ops.Actor("oncall"), reason="INC-9: bad data")
    assert (sorted(result.changed), result.why_skipped) == (sorted([dead, failed]), {live: "it is queued"})
    groups = stats.dead_letter_groups(conn, states=("dead_lettered", "failed"))
    assert (groups.dead, list(groups)) == (0, [])
    job = stats.get_job(conn, dead)
    assert job.state is JobState.CANCELLED and job.last_error == "ValueError: bad VAT id"  # what it died of
    assert (job.errors[-1].error_class, job.errors[-1].message) == ("Discarded", "discarded by oncall: INC-9: bad data")
    entry = stats.audit_log(conn)[0]
    assert (entry.action, entry.reason, sorted(entry.job_ids)) == ("discard", "INC-9: bad data", sorted([dead, failed]))
    assert ops.requeue(conn, [dead], actor=ops.Actor("oncall")).changed == [dead]  # undone


def test_a_kill_of_waiting_jobs_is_counted_as_cancelled(conn: db.Conn) -> None:
    # only workers counted cancelled jobs: the ones an operator killed while they waited were never counted
    ids = [enqueue(conn, "t.ok", {}).id for _ in range(4)]
    conn.commit()
    assert len(ops.kill(conn, ids, actor=ops.Actor("oncall")).changed) == 4
    assert {t.job_type: t.cancelled for t in stats.overview(conn).types}["t.ok"] == 4


def test_a_killed_running_job_gives_up_its_dedup_key_and_a_requeue_gives_it_back(conn: db.Conn) -> None:
    # until its worker saw the kill, an equivalent message collapsed into the doomed job and was lost
    doomed = enqueue(conn, "t.ok", {}, dedup_key="nightly:2026-11-30").id
    conn.execute("UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'w' WHERE id = %s", (doomed,))
    assert ops.kill(conn, [doomed], actor=ops.Actor("oncall")).changed == [doomed]
    again = enqueue(conn, "t.ok", {}, dedup_key="nightly:2026-11-30")
    assert again.created and again.id != doomed
    job = stats.get_job(conn, doomed)
    assert (job.dedup_key, job.released_dedup_key) == (None, "nightly:2026-11-30")
    # its worker ends it: cancelled. A requeue while the new one lives is refused, and says why
    conn.execute("UPDATE job_queue SET state = 'cancelled', finished_at = now() WHERE id = %s", (doomed,))
    refused = ops.requeue(conn, [doomed], actor=ops.Actor("oncall"))
    assert refused.why_skipped == {doomed: "a live job (or a newer requeued one) holds its dedup key"}
    conn.execute("UPDATE job_queue SET state = 'succeeded', finished_at = now() WHERE id = %s", (again.id,))
    assert ops.requeue(conn, [doomed], actor=ops.Actor("oncall")).changed == [doomed]
    job = stats.get_job(conn, doomed)
    assert (job.state, job.dedup_key, job.released_dedup_key) == (JobState.QUEUED, "nightly:2026-11-30", None)
    assert not enqueue(conn, "t.ok", {}, dedup_key="nightly:2026-11-30").created  # it holds the key again


# --------------------------------------------------------------------------- stats.workers


def test_workers_list_the_running_ones_first_then_the_stopped_ones_newest_stop_first(conn: db.Conn) -> None:
    # sorted by host and pid, a live worker on host "z" sat below ten stopped ones on host "a": at 80x24
    # the header said "1 live" while every row in sight was "■ stopped"
    now = dt.datetime.now(dt.timezone.utc)
    for i in range(10):
        conn.execute(
            "INSERT INTO workers (id, host, pid, concurrency, last_heartbeat_at, stopped_at)"
            " VALUES (%s, 'a', %s, 4, %s, %s)",
            (f"a:{i}", i, now - dt.timedelta(seconds=60 - i), now - dt.timedelta(seconds=60 - i)),
        )
    conn.execute("INSERT INTO workers (id, host, pid, concurrency) VALUES ('z:1', 'z', 1, 4), ('y:2', 'y', 2, 4)")
    rows = stats.workers(conn)
    assert [w.id for w in rows] == ["y:2", "z:1", *(f"a:{i}" for i in reversed(range(10)))]


def test_the_overview_tells_queued_jobs_due_now_from_those_scheduled_later(wconn: db.Conn) -> None:
    # "wait 2" on queue lagging counted the job due in an hour with the one waiting since 120 s ago
    by = {(t.queue, t.job_type): t for t in stats.overview(wconn, clock=FixedClock(NOW)).types}
    lagging = by[("lagging", "t.ok")]
    assert (lagging.queued, lagging.queued_later, lagging.queued_due) == (2, 1, 1)
    assert (by[("held", "t.ok")].queued_later, by[("default", "t.ok")].queued_later) == (0, 0)
    later = stats.overview(wconn, clock=FixedClock(NOW + dt.timedelta(hours=2))).types
    assert [(t.queued_due, t.queued_later) for t in later if t.queue == "lagging"] == [(2, 0)]


def test_the_live_counts_read_no_finished_row_on_a_table_of_200k(conn: db.Conn) -> None:
    # the overview's counts of jobs scheduled later are read where its counts are, through the partial
    # indexes: not a sequential scan of the finished rows
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at) "
        "SELECT 't.ok', 'default', '{}', 'succeeded', now() FROM generate_series(1, 200000)"
    )
    enqueue(conn, "t.ok", {}, delay_seconds=30 * 86400)
    enqueue(conn, "t.ok", {})
    conn.execute("ANALYZE job_queue")
    now = dt.datetime.now(dt.timezone.utc)
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute("EXPLAIN " + queries["stats_live"], {"now": now}))
    assert "Seq Scan on job_queue" not in plan, plan
    [t] = stats.overview(conn).types
    assert (t.queued, t.queued_later, t.succeeded) == (2, 1, 0)


def test_lock_key_holder_names_whichever_job_holds_the_key(conn: db.Conn) -> None:
    # the job detail looked the lock up by the job's own id (job_lock): a job waiting on a key another job
    # held was told "rep:1 (not held now)"
    holder = enqueue(conn, "t.ok", {}, lock_key="rep:1").id
    waiter = enqueue(conn, "t.ok", {}, lock_key="rep:1").id
    free = enqueue(conn, "t.ok", {}, lock_key="rep:2").id
    conn.execute("UPDATE job_queue SET state = 'running', locked_by = 'w1', locked_until = now() WHERE id = %s",
                 (holder,))  # fmt: skip
    conn.execute(
        "INSERT INTO resource_locks (lock_key, token, job_id, expires_at) VALUES ('rep:1', 't', %s, %s)",
        (holder, NOW + dt.timedelta(seconds=40)),
    )

    def held(job: uuid.UUID, now: dt.datetime = NOW) -> dict[str, Any] | None:
        return stats.lock_key_holder(conn, stats.get_job(conn, job), now)

    said = held(waiter)
    assert said is not None and said["held_by"] == "another_job" and said["job_id"] == holder
    assert (said["job_type"], said["job_state"], said["expires_in_seconds"]) == ("t.ok", "running", 40.0)
    assert stats.job_lock(conn, waiter) is None  # what the detail read before: nothing of its own
    assert held(holder)["held_by"] == "this_job"  # type: ignore[index]
    assert held(waiter, NOW + dt.timedelta(seconds=41))["held_by"] == "expired"  # type: ignore[index]
    assert held(free) == {"lock_key": "rep:2", "held_by": "nobody", "job_id": None, "job_type": None,
                          "job_state": None, "expires_at": None, "expires_in_seconds": None}  # fmt: skip
    conn.execute("UPDATE resource_locks SET job_id = NULL")  # a single_flight refill's lease, another program's
    assert held(waiter)["held_by"] == "no_job"  # type: ignore[index]
    assert stats.lock_key_holder(conn, stats.get_job(conn, enqueue(conn, "t.ok", {}).id), NOW) is None


def test_a_jobs_lease_holder_is_judged_lost_by_the_workers_lists_own_rule(conn: db.Conn) -> None:
    # the job detail said "held by vm:29289:30c326" of a worker the workers screen showed LOST
    clock = FixedClock(NOW)
    beats = {"live": 1, "edge": stats.LOST_AFTER_SECONDS, "lost": stats.LOST_AFTER_SECONDS + 1, "stopped": 300}
    jobs = {}
    for name, age in beats.items():
        conn.execute(
            "INSERT INTO workers (id, host, pid, concurrency, last_heartbeat_at, stopped_at) VALUES (%s, 'h', 1, 4, %s,"
            " %s)",
            (name, NOW - dt.timedelta(seconds=age), NOW - dt.timedelta(seconds=age) if name == "stopped" else None),
        )
        jobs[name] = enqueue(conn, "t.ok", {}).id
        conn.execute(
            "UPDATE job_queue SET state = 'running', locked_by = %s, locked_until = %s WHERE id = %s",
            (name, NOW - dt.timedelta(seconds=5), jobs[name]),
        )
    listed = {w.id: w.lost for w in stats.workers(conn, clock)}
    for name, job in jobs.items():
        holders = stats.job_holders(conn, stats.get_job(conn, job), clock)
        assert holders.worker is not None and holders.worker.lost == listed[name], name
        assert holders.worker_state == {"edge": "live"}.get(name, name)
        assert stats.expired_lease_fate(stats.get_job(conn, job), holders) == "run_alone"
    # what the next claim (claim_solo) does with an expired lease: a poison pill, a kill requested
    lost = jobs["lost"]

    def fate() -> str | None:
        job = stats.get_job(conn, lost)
        return stats.expired_lease_fate(job, stats.job_holders(conn, job, clock))

    conn.execute("UPDATE job_queue SET ran_solo = true, attempts = max_attempts WHERE id = %s", (lost,))
    assert fate() == "dead_lettered"
    conn.execute("UPDATE job_queue SET cancel_requested = true WHERE id = %s", (lost,))
    assert fate() == "cancelled"
    gone = enqueue(conn, "t.ok", {}).id  # its worker's row pruned
    conn.execute("UPDATE job_queue SET state = 'running', locked_by = 'gone', locked_until = %s WHERE id = %s",
                 (NOW + dt.timedelta(seconds=60), gone))  # fmt: skip
    holders = stats.job_holders(conn, stats.get_job(conn, gone), clock)
    assert holders.worker is None and holders.worker_state is None
    assert stats.expired_lease_fate(stats.get_job(conn, gone), holders) is None  # its lease is live


# --------------------------------------------------------------------------- who runs what


# --------------------------------------------------------------------------- who runs what, and dead workers' jobs


def test_the_overview_counts_the_live_workers_that_claim_each_type_in_its_queue(conn: db.Conn) -> None:
    # drill: sms.send jobs waited in mail, where live workers ran other types; the overview showed the lag
    # climbing and nothing else. A worker claims a type in a queue when the type is among its tasks and the queue
    # among its queues (none: every queue); one whose heartbeat is older than the lost threshold is lost
    now = dt.datetime.now(dt.timezone.utc)
    conn.execute(
        "INSERT INTO workers (id, host, pid, queues, tasks, concurrency, last_heartbeat_at, stopped_at) VALUES"
        " ('a:1', 'a', 1, '{mail}', '{mail.digest}', 4, %(now)s, NULL),"
        " ('b:2', 'b', 2, NULL, '{t.ok}', 4, %(now)s, NULL),"
        " ('c:3', 'c', 3, '{mail}', '{report.build}', 4, %(lost)s, NULL),"
        " ('d:4', 'd', 4, '{mail}', '{sms.send}', 4, %(stopped)s, %(stopped)s)",
        {"now": now, "lost": now - dt.timedelta(seconds=stats.LOST_AFTER_SECONDS + 5),
         "stopped": now - dt.timedelta(seconds=20)},
    )  # fmt: skip
    for job_type, queue in (("sms.send", "mail"), ("mail.digest", "mail"), ("mail.digest", "default"),
                            ("t.ok", "mail"), ("report.build", "mail")):  # fmt: skip
        enqueue(conn, job_type, {}, queue=queue)
    ops.pause(conn, "held", actor=ops.Actor("test"), allow_unknown=True)
    enqueue(conn, "sms.send", {}, queue="held")
    by = {(t.queue, t.job_type): t for t in stats.overview(conn).types}
    assert {k: (t.live_workers, t.lost_workers) for k, t in by.items()} == {
        ("mail", "sms.send"): (0, 0),  # its only worker stopped
        ("mail", "mail.digest"): (1, 0),
        ("default", "mail.digest"): (0, 0),  # its worker takes mail only
        ("mail", "t.ok"): (1, 0),  # a worker of every queue
        ("mail", "report.build"): (0, 1),
        ("held", "sms.send"): (0, 0),
    }
    # a paused queue says why its jobs wait already
    unserved = sorted(k for k, t in by.items() if stats.unserved(t))
    assert unserved == [("default", "mail.digest"), ("mail", "report.build"), ("mail", "sms.send")]
    assert stats.overview(conn).workers_alive == 2


def test_the_overview_says_how_many_running_jobs_hold_an_expired_lease(conn: db.Conn) -> None:
    # drill: a worker kill -9'd, its 8 jobs of report.build still "run 8" long after their leases expired
    ids = [enqueue(conn, "report.build", {"n": i}, queue="reports").id for i in range(10)]
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'dead:1',"
        " locked_until = now() - interval '5 minutes' WHERE id = ANY(%s)",
        (ids[:8],),
    )
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'live:1',"
        " locked_until = now() + interval '5 minutes' WHERE id = ANY(%s)",
        (ids[8:],),
    )
    [t] = stats.overview(conn).types
    assert (t.running, t.running_expired, t.queued) == (10, 8, 0)
    # nothing waits, but the expired leases are claimable again, and no live worker would take them over
    assert stats.unserved(t)
    conn.execute(
        "INSERT INTO workers (id, host, pid, queues, tasks, concurrency) VALUES ('live:1', 'h', 1, NULL,"
        " '{report.build}', 4)"
    )
    [t] = stats.overview(conn).types
    assert t.running_expired == 8 and not stats.unserved(t)
    # by the overview's clock: ten minutes on, every lease has run out
    [later] = stats.overview(conn, clock=FixedClock(dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=10))).types
    assert later.running_expired == 10


def test_the_audit_of_an_action_on_dead_letter_groups_says_which_groups(conn: db.Conn) -> None:
    # "requeue 43 job(s) budget=1 requested=43": no job type, no fingerprint; the handover could not tell which
    # group was replayed without looking up every id
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at, last_error, error_fingerprint)"
        " SELECT 'email.send', 'mail', '{}', 'dead_lettered', 4, now(), 'upstream 503', 'TransientError: upstream <n>'"
        " FROM generate_series(1, 3)"
    )
    ids = ops.group_job_ids(conn, "email.send", "TransientError: upstream <n>")
    group = {"job_type": "email.send", "fingerprint": "TransientError: upstream <n>", "state": "dead_lettered",
             "jobs": 3, "sample_error": "not kept"}  # fmt: skip
    kept = {k: v for k, v in group.items() if k != "sample_error"}
    requeued = ops.requeue(conn, ids, actor=ops.Actor("alice"), groups=[group], token="t1")
    killed = ops.kill(conn, ids[:1], actor=ops.Actor("alice"), groups=[group, {**group, "state": "retry_scheduled"}])
    discarded = ops.discard(conn, ids[1:], actor=ops.Actor("alice"), groups=[group])
    plain = ops.requeue(conn, ids[:1], actor=ops.Actor("alice"))
    entries = {e.id: e for e in stats.audit_log(conn)}
    first = entries[requeued.audit_id]
    # the keys it had are kept; the groups are added
    assert first.detail == {"budget": 1, "requested": 3, ops.TOKEN_KEY: "t1", ops.GROUPS_KEY: [kept]}
    assert entries[killed.audit_id].detail[ops.GROUPS_KEY] == [kept, {**kept, "state": "retry_scheduled"}]
    assert entries[killed.audit_id].detail["requested"] == 1
    assert entries[discarded.audit_id].detail[ops.GROUPS_KEY] == [kept]
    assert ops.GROUPS_KEY not in entries[plain.audit_id].detail
