"""Scenarios 6 and 7 on one big table: 1,000,000 finished jobs, 10,000 dead-lettered, 10,000 waiting.

Built the way production gets there: the finished history first (then VACUUM ANALYZE, as autovacuum
leaves a quiet table), then a backlog of 10,000 jobs arrives through ``enqueue_many``. 10,000 changed
rows are far under autovacuum's analyze threshold on a 1M-row table (50 + 10% of the rows), so the
planner still believes there is nothing waiting: that is the "stale statistics" phase, what a real
server sees while a backlog builds. Then ANALYZE, and the same measurements with fresh statistics.

Claim latency (6): ``p50/p99`` of the claim statement (queries.sql "claim" as ``Worker._claim_ready`` runs
it: prepared, generic plan, limit 1, client round trip, each claim committed), of ``Worker.claim(1)``
(what the worker pays: the claims of every lane), and of
the claim statement with the batch a worker really asks for at the bench's ``--concurrency``.

Console cost (7): the functions the console calls on a refresh (``stats.overview`` + ``stats.latency_series``
for the overview screen, ``stats.list_jobs(limit=200)`` for the jobs screen, ``stats.dead_letter_groups``
for the dead-letters screen). Every statement they run is captured and re-run under EXPLAIN ANALYZE: the
database time is the sum of planning + execution times (per-node timing off, whose overhead is not the
query's; median of 3); the full plans, ``EXPLAIN (ANALYZE, BUFFERS)``, are saved to bench/results/explain/.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench.harness import Server, log, median, percentile

FINISHED_SQL = """
INSERT INTO job_queue (job_type, queue, payload, state, priority, attempts, max_attempts, scheduled_at,
                       idempotency_key, created_at, started_at, finished_at, updated_at)
SELECT (ARRAY['invoice.generate', 'email.send', 'report.build', 'webhook.deliver', 'image.resize',
              'search.index'])[1 + g %% 6],
       (ARRAY['billing', 'default', 'email', 'default', 'media', 'default'])[1 + g %% 6],
       jsonb_build_object('order_id', 'ord_' || g, 'amount', g %% 1000),
       'succeeded', 0, 1, 5, t, CASE WHEN g %% 6 = 0 THEN 'invoice:ord_' || g END,
       t, t + interval '40 ms', t + interval '60 ms', t + interval '60 ms'
FROM (SELECT g, now() - interval '24 hours' + g * (interval '24 hours' / %(n)s) AS t
      FROM generate_series(%(start)s, %(stop)s) AS g) s
"""

DEAD_SQL = """
INSERT INTO job_queue (job_type, queue, payload, state, priority, attempts, max_attempts, scheduled_at,
                       created_at, started_at, finished_at, updated_at, last_error, error_fingerprint, errors)
SELECT (ARRAY['invoice.generate', 'email.send', 'webhook.deliver', 'report.build'])[1 + g %% 4],
       (ARRAY['billing', 'email', 'default', 'default'])[1 + g %% 4],
       jsonb_build_object('order_id', 'ord_x' || g),
       'dead_lettered', 0, 5, 5, t, t, t + interval '1 s', t + interval '2 s', t + interval '2 s',
       'TimeoutError: upstream ' || (g %% 20) || ' timed out after 30s on ord_x' || g,
       'TimeoutError: upstream <*> timed out after <*>s on <*> #' || (g %% 20),
       jsonb_build_array(jsonb_build_object('attempt', 5, 'kind', 'transient', 'class', 'TimeoutError',
                                            'message', 'upstream timed out', 'worker', 'w1', 'at', t))
FROM (SELECT g, now() - interval '24 hours' + g * (interval '24 hours' / %(n)s) AS t
      FROM generate_series(1, %(n)s) AS g) s
"""

ROLLUPS_SQL = """
INSERT INTO job_metrics_minute (minute, queue, job_type, started, succeeded, failed, dead_lettered, retried,
                                latency_ms_sum, duration_ms_sum)
SELECT m, q.queue, q.job_type, 100, 98, 0, 1, 3, 1500, 2400
FROM generate_series(date_trunc('minute', now()) - interval '7 days', date_trunc('minute', now()),
                     interval '1 minute') AS m,
     (VALUES ('billing', 'invoice.generate'), ('email', 'email.send'), ('default', 'report.build'),
             ('default', 'webhook.deliver'), ('media', 'image.resize'), ('default', 'search.index'))
         AS q(queue, job_type)
"""

WORKERS_SQL = """
INSERT INTO workers (id, host, pid, queues, tasks, concurrency, in_flight, started_at, last_heartbeat_at)
SELECT 'bench-host:' || g, 'bench-host', 1000 + g, NULL, ARRAY['bench.noop'], 8, 0, now() - interval '1 hour', now()
FROM generate_series(1, 4) AS g
"""

RESTORE_SQL = """
UPDATE job_queue SET state = 'queued', attempts = 0, locked_by = NULL, locked_until = NULL, started_at = NULL
WHERE state = 'running'
"""


def build(dsn: str, finished: int, dead: int, waiting: int) -> dict[str, float]:
    """The table, in phases; returns how long each took."""
    import bench.peers.qconsole_tasks  # noqa: F401
    from worker_core import db, enqueue_many
    from worker_core.migrate import migrate

    timings: dict[str, float] = {}
    with db.connect(dsn, application_name="qcbench-build") as conn:
        migrate(conn)
        conn.commit()
        t = time.perf_counter()
        step = 250_000
        for start in range(1, finished + 1, step):
            conn.execute(FINISHED_SQL, {"n": finished, "start": start, "stop": min(finished, start + step - 1)})  # type: ignore[arg-type]
            conn.commit()
        conn.execute(DEAD_SQL, {"n": dead})  # type: ignore[arg-type]
        conn.execute(ROLLUPS_SQL)
        conn.execute(WORKERS_SQL)
        conn.commit()
        timings["insert_s"] = time.perf_counter() - t
        t = time.perf_counter()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE")
        conn.autocommit = False
        timings["vacuum_analyze_s"] = time.perf_counter() - t
        # the backlog arrives: statistics still say nothing is waiting
        for start in range(0, waiting, 1000):
            enqueue_many(conn, [("bench.noop", {"i": i}) for i in range(start, min(waiting, start + 1000))])
            conn.commit()
        counts = dict(conn.execute("SELECT state, count(*) FROM job_queue GROUP BY state").fetchall())  # type: ignore[arg-type]
    timings["counts"] = counts  # type: ignore[assignment]
    return timings


# ---------------------------------------------------------------------------------------------- claim latency


def _claim_statements(worker: Any, limit: int, count: int) -> tuple[list[float], str]:
    """``count`` claims of ``limit`` jobs by the claim statement alone (``Worker._claim_ready``: the prepared
    claim, one round trip), on the connection the worker claims with; and its plan, the generic one the
    worker runs."""
    conn = worker._conn_for_claims()
    worker._refresh_claim_filters(conn)
    times: list[float] = []
    for _ in range(count):
        t0 = time.perf_counter()
        rows = worker._claim_ready(conn, limit)
        times.append((time.perf_counter() - t0) * 1000)
        if not rows:
            raise RuntimeError("the claim found nothing ready")
    plan = ""
    with contextlib.suppress(psycopg.Rollback), conn.transaction():
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan", prepare=False)
        explain = sql.SQL("EXPLAIN (ANALYZE, BUFFERS) EXECUTE worker_core_claim({}, {})").format(
            worker.clock.now(), limit
        )
        rows = conn.execute(explain, prepare=False).fetchall()
        plan = "\n".join(r["QUERY PLAN"] for r in rows)
        raise psycopg.Rollback()  # the explained claim claims nothing
    return times, plan


def _sorts_backlog(plan: str) -> bool:
    """The plan reads every ready job and sorts them, instead of walking the ready index in order."""
    return "Sort Key: job_queue.priority" in plan


def claim_latency(dsn: str, count: int, concurrency: int) -> dict[str, Any]:
    """One job per claim (the target figure), ``Worker.claim(1)``, and claims of the batch the worker really
    asks for at ``--concurrency`` (its ``batch_size``: slots plus prefetch)."""
    import bench.peers.qconsole_tasks  # noqa: F401
    from worker_core import db
    from worker_core.worker import Worker, WorkerConfig

    worker = Worker(WorkerConfig(dsn=dsn, concurrency=1))
    batch = Worker(WorkerConfig(dsn=dsn, concurrency=concurrency)).batch_size
    stmt, plan = _claim_statements(worker, 1, count)
    # the batch claims take 10,000 / batch / 2 rounds at most, leaving half the backlog
    with db.connect(dsn, application_name="qcbench-claim") as conn, conn.transaction():
        ready = conn.execute("SELECT count(*) AS n FROM job_queue WHERE state = 'queued'").fetchone()["n"]  # type: ignore[index]
    batch_count = max(5, min(count, ready // batch // 2))
    batch_times, batch_plan = _claim_statements(worker, batch, batch_count)
    full: list[float] = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            got = worker.claim(1)
            full.append((time.perf_counter() - t0) * 1000)
            if not got:
                raise RuntimeError("Worker.claim found nothing ready")
    finally:
        if worker._claim_conn is not None:
            worker._claim_conn.close()
    return {
        "claims": count,
        "statement_p50_ms": percentile(stmt, 50),
        "statement_p99_ms": percentile(stmt, 99),
        "worker_claim_p50_ms": percentile(full, 50),
        "worker_claim_p99_ms": percentile(full, 99),
        "batch": batch,
        "batch_claims": batch_count,
        "batch_p50_ms": percentile(batch_times, 50),
        "batch_p99_ms": percentile(batch_times, 99),
        "plan": plan,
        "batch_plan": batch_plan,
        "plan_sorts_backlog": _sorts_backlog(plan),
        "batch_plan_sorts_backlog": _sorts_backlog(batch_plan),
    }


def restore(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RESTORE_SQL)


def analyze(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE job_queue")


# ---------------------------------------------------------------------------------------------- console cost


class Recorder:
    """A connection stand-in that records every statement it runs (and how long the round trip took)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.statements: list[tuple[Any, Any, float]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        cur = self._conn.execute(query, params, **kwargs)
        self.statements.append((query, params, (time.perf_counter() - t0) * 1000))
        return cur

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


PLAN_TIME = re.compile(r"(Planning|Execution) Time: ([0-9.]+) ms")
SCAN_ON_JOBS = re.compile(r"(Seq Scan|Parallel Seq Scan) on job_queue")
ACTUAL_ROWS = re.compile(r"on job_queue\b.*?\(actual time=[0-9.]+\.\.[0-9.]+ rows=(\d+) loops=(\d+)\)")


def console_calls() -> dict[str, Callable[[Any], Any]]:
    """What each console screen calls on a refresh (qconsole/backend.py's DatabaseBackend)."""
    from worker_core import stats

    dead_states = ("dead_lettered", "failed", "retry_scheduled")
    try:
        from qconsole.backend import DEAD_LETTER_STATES

        dead_states = tuple(DEAD_LETTER_STATES)
    except ImportError:
        pass

    # the console's clock: aligned to the server's once, then read locally (a system clock would read the
    # server's time on every call, as a one-shot CLI command does)
    try:
        from worker_core.clock import ServerAlignedClock

        clock: Any = ServerAlignedClock()
    except ImportError:  # a root from before it
        from worker_core.clock import SYSTEM_CLOCK as clock

    def overview_refresh(conn: Any) -> Any:
        if getattr(clock, "measured", True) is False:  # the console measures once, on its first read
            clock.align_on(conn)
        out = stats.overview(conn, clock)
        if hasattr(stats, "latency_series"):
            stats.latency_series(conn, clock)
        return out

    return {
        "overview": overview_refresh,
        "list_jobs": lambda conn: stats.list_jobs(conn, limit=200),
        "dead_letter_groups": lambda conn: stats.dead_letter_groups(conn, states=dead_states),
    }


def _timing_off(query: Any) -> Any:
    prefix = "EXPLAIN (ANALYZE, TIMING OFF, SUMMARY ON) "
    return prefix + query if isinstance(query, str) else sql.SQL(prefix) + query


def _query_name(query: Any) -> str:
    from worker_core.sql import queries

    for name, text in queries.items():
        if text is query or text == query:
            return name
    return "composed"


def console_cost(dsn: str, explain_dir: Path | None, label: str, reps: int = 5) -> dict[str, Any]:
    from worker_core import db

    calls = console_calls()
    out: dict[str, Any] = {"functions": {}}
    with db.connect(dsn, application_name="qcbench-console", autocommit=True) as conn:
        for fn in calls.values():  # warm: the console refreshes every 2 s, so its pages are cached
            fn(conn)
            fn(conn)
        for fname, fn in calls.items():
            walls = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(conn)
                walls.append((time.perf_counter() - t0) * 1000)
            rec = Recorder(conn)
            fn(rec)
            statements = []
            for idx, (query, params, wall) in enumerate(rec.statements):
                name = _query_name(query) if isinstance(query, str) else fname
                if isinstance(query, str):
                    explain: Any = "EXPLAIN (ANALYZE, BUFFERS) " + query
                else:
                    explain = sql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + query
                plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(explain, params).fetchall())
                # the time: per-node timing off (its overhead is not the query's), median of 3
                samples = []
                for _ in range(3):
                    timed = "\n".join(r["QUERY PLAN"] for r in conn.execute(_timing_off(query), params).fetchall())
                    samples.append(dict((k, float(v)) for k, v in PLAN_TIME.findall(timed)))
                times = {k: median([t.get(k, 0.0) for t in samples]) for k in ("Planning", "Execution")}
                rows_read = [int(r) * int(lp) for r, lp in ACTUAL_ROWS.findall(plan)]
                st = {
                    "name": name,
                    "planning_ms": times.get("Planning", 0.0),
                    "execution_ms": times.get("Execution", 0.0),
                    "round_trip_ms": wall,
                    "seq_scan_on_job_queue": bool(SCAN_ON_JOBS.search(plan)),
                    "max_job_queue_rows_read": max(rows_read, default=0),
                }
                st["db_ms"] = st["planning_ms"] + st["execution_ms"]
                statements.append(st)
                if explain_dir is not None:
                    explain_dir.mkdir(parents=True, exist_ok=True)
                    text = query if isinstance(query, str) else query.as_string(conn)
                    (explain_dir / f"{label}-{fname}-{idx:02d}-{name}.txt").write_text(
                        f"-- {fname} statement {idx} ({name}), statistics {label}\n-- params: {params!r}\n"
                        f"{text.strip()}\n\n{plan}\n"
                    )
            out["functions"][fname] = {
                "wall_ms_median": median(walls),
                "db_ms": sum(s["db_ms"] for s in statements),
                "statements": statements,
                "reads_finished_rows": any(
                    s["seq_scan_on_job_queue"] or s["max_job_queue_rows_read"] > 100_000 for s in statements
                ),
            }
    f = out["functions"]
    out["overview_db_ms"] = f["overview"]["db_ms"]
    out["total_db_ms"] = sum(v["db_ms"] for v in f.values())
    out["total_wall_ms"] = sum(v["wall_ms_median"] for v in f.values())
    log(
        f"  console ({label} statistics): overview {f['overview']['db_ms']:.1f} ms DB, "
        f"list_jobs {f['list_jobs']['db_ms']:.1f} ms, dead_letter_groups {f['dead_letter_groups']['db_ms']:.1f} ms; "
        f"total {out['total_db_ms']:.1f} ms DB ({out['total_wall_ms']:.1f} ms wall)"
    )
    return out


def run(
    server: Server,
    finished: int,
    dead: int,
    waiting: int,
    claims: tuple[int, int],
    explain_dir: Path,
    concurrency: int = 32,
) -> dict[str, Any]:
    """Build, then: console and claims on stale statistics, ANALYZE, console and claims again.

    Returns the results and leaves the database for the console's memory/first-frame measurement; the
    caller drops it (``server.drop_db``)."""
    dbname = "qcbench_bigtable"
    dsn = server.create_db(dbname)
    log(f"building {finished:,} finished + {dead:,} dead-lettered + {waiting:,} waiting jobs")
    res: dict[str, Any] = {"finished": finished, "dead_lettered": dead, "waiting": waiting, "dsn_db": dbname}
    res["build"] = build(dsn, finished, dead, waiting)
    log(f"  built in {res['build']['insert_s']:.0f}s + VACUUM ANALYZE {res['build']['vacuum_analyze_s']:.0f}s")
    res["console_stale"] = console_cost(dsn, explain_dir, "stale")
    res["claim_stale"] = claim_latency(dsn, claims[0], concurrency)
    log(
        f"  claim (stale statistics): statement p50 {res['claim_stale']['statement_p50_ms']:.2f} ms "
        f"p99 {res['claim_stale']['statement_p99_ms']:.2f} ms; Worker.claim p50 "
        f"{res['claim_stale']['worker_claim_p50_ms']:.2f} ms; batch of {res['claim_stale']['batch']} p50 "
        f"{res['claim_stale']['batch_p50_ms']:.2f} ms"
    )
    restore(dsn)
    analyze(dsn)
    res["console_fresh"] = console_cost(dsn, explain_dir, "fresh")
    res["claim_fresh"] = claim_latency(dsn, claims[1], concurrency)
    log(
        f"  claim (fresh statistics): statement p50 {res['claim_fresh']['statement_p50_ms']:.2f} ms "
        f"p99 {res['claim_fresh']['statement_p99_ms']:.2f} ms; Worker.claim p50 "
        f"{res['claim_fresh']['worker_claim_p50_ms']:.2f} ms; batch of {res['claim_fresh']['batch']} p50 "
        f"{res['claim_fresh']['batch_p50_ms']:.2f} ms"
    )
    restore(dsn)
    for phase in ("claim_stale", "claim_fresh"):
        state = phase.split("_")[1]
        (explain_dir / f"claim-{state}-limit1.txt").write_text(res[phase].pop("plan") + "\n")
        batch = res[phase]["batch"]
        (explain_dir / f"claim-{state}-limit{batch}.txt").write_text(res[phase].pop("batch_plan") + "\n")
    res["dsn"] = dsn
    return res
