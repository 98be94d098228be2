"""Scenarios 1-3: enqueue N jobs, then drain them with a system's workers; jobs/s.

Per measurement: a fresh database, the system's schema, N jobs enqueued in batches of 1,000 (each batch
its own transaction; the enqueue rate is reported on its own), ANALYZE of the queue tables (what
autovacuum does within a minute on a fresh table; without it every system's planner works from an empty
table's statistics: see README), then the workers are started and the bench polls the database.

The drain rate is ``N / (last job settled - first job started)``, both times as each system records
them in the database (qconsole: started_at/finished_at; pgqueuer: pgqueuer_log; procrastinate:
procrastinate_events), so process start-up is not in it. The bench also polls the database every 50 ms
(is anything left?) and reports the rate from launch to drained, start-up included, as a cross-check.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench.harness import Child, Server, child_env, db_counters, log
from bench.systems import SYSTEMS, Config

POLL = 0.05
#: a drain in which no job finished this long after the workers were launched is abandoned
STALL = 60.0


@dataclass
class DrainResult:
    config: str
    system: str
    workload: str
    jobs: int
    enqueue_per_s: float
    jobs_per_s: float
    #: from polling: jobs left at the first sign of progress / time until none was left
    jobs_per_s_polled: float
    #: including process start-up: jobs / (launch -> all done)
    jobs_per_s_with_startup: float
    seconds: float
    #: transactions committed in the database per job while draining (pg_stat_database)
    commits_per_job: float | None
    rows_written_per_job: float | None
    #: CPU seconds of the worker processes per 1,000 jobs (user + sys, every process of the tree)
    worker_cpu_ms_per_job: float | None
    ok: bool
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(
    server: Server,
    cfg: Config,
    workload: str,
    n: int,
    logdir: Path,
    tag: str,
    timeout: float | None = None,
    analyze: bool = True,
) -> DrainResult:
    system = SYSTEMS[cfg.system]
    dbname = f"qcbench_tp_{tag}"
    problems: list[str] = []
    with server.fresh_db(dbname) as dsn:
        system.setup(dsn)
        t0 = time.perf_counter()
        system.enqueue(dsn, workload, n)
        enqueue_rate = n / (time.perf_counter() - t0)
        with psycopg.connect(dsn, autocommit=True) as conn:
            if analyze:
                system.analyze(conn)
            before = db_counters(server.admin_dsn, dbname)
            env = child_env(system.env(dsn))
            logfile = logdir / f"{cfg.system}-{workload}-{tag}.log"
            launched = time.perf_counter()
            children = [
                Child.start(cmd, f"{cfg.system}-{i}", env, logfile)
                for i, cmd in enumerate(system.worker_commands(cfg, workload))
            ]
            deadline = launched + (timeout or max(180.0, n / 40.0))
            t1 = r1 = t_end = None
            try:
                while time.perf_counter() < deadline:
                    if t1 is None:
                        left = conn.execute(system.remaining_sql()).fetchone()[0]  # type: ignore[index]
                        if left < n:
                            t1, r1 = time.perf_counter(), left
                            if left == 0:
                                t_end = t1
                                break
                    elif not conn.execute(system.any_left_sql()).fetchone()[0]:  # type: ignore[index]
                        t_end = time.perf_counter()
                        break
                    if t1 is None and time.perf_counter() - launched > STALL:
                        problems.append(f"no job finished within {STALL:.0f}s of the launch: see {logfile}")
                        break
                    if any(c.poll() not in (None, 0) for c in children):
                        problems.append("a worker process exited with an error: see " + str(logfile))
                        break
                    time.sleep(POLL)
                else:
                    problems.append(f"not drained within {deadline - launched:.0f}s")
                for c in children:
                    if c.wait(0 if problems else 30) is None and not problems:
                        problems.append(f"{c.name} did not exit by itself after the drain")
                        c.stop()
            finally:
                for c in children:
                    c.stop(grace=5)
            time.sleep(0.3)  # exited backends flush their statistics
            after = db_counters(server.admin_dsn, dbname)
            first, last = conn.execute(system.window_sql()).fetchone()  # type: ignore[misc]
            done = system.succeeded(conn)
            if done != n:
                problems.append(f"{done} of {n} jobs succeeded")
            if workload == "write":
                effects = conn.execute("SELECT count(*) FROM bench_effects").fetchone()[0]  # type: ignore[index]
                if effects != n:
                    problems.append(f"{effects} effects written for {n} jobs")
    polled = 0.0
    if t1 is not None and t_end is not None and r1 is not None and t_end > t1:
        # the first poll that saw progress already missed the jobs finished before it: count from there
        polled = r1 / (t_end - t1)
    seconds = float(last - first) if first is not None and last is not None else float("nan")
    rate = n / seconds if seconds > 0 and not problems else 0.0
    cpu = [c.cpu_seconds for c in children]
    commits = (after.get("xact_commit", 0) - before.get("xact_commit", 0)) if before and after else None
    rows = (
        sum(after.get(k, 0) - before.get(k, 0) for k in ("tup_inserted", "tup_updated", "tup_deleted"))
        if before and after
        else None
    )
    result = DrainResult(
        config=cfg.key,
        system=cfg.system,
        workload=workload,
        jobs=n,
        enqueue_per_s=enqueue_rate,
        jobs_per_s=rate,
        jobs_per_s_polled=polled,
        jobs_per_s_with_startup=(n / (t_end - launched)) if t_end else 0.0,
        seconds=seconds,
        commits_per_job=(commits / n) if commits is not None else None,
        rows_written_per_job=(rows / n) if rows is not None else None,
        worker_cpu_ms_per_job=(sum(cpu) * 1000 / n) if all(x is not None for x in cpu) else None,  # type: ignore[misc]
        ok=not problems,
        problems=problems,
    )
    log(
        f"  {cfg.key} {workload} n={n}: {rate:,.0f} jobs/s (polled {polled:,.0f}; enqueue {enqueue_rate:,.0f}/s, "
        f"{result.commits_per_job or 0:.2f} commits/job, worker CPU {result.worker_cpu_ms_per_job or 0:.2f} ms/job)"
        + (f" PROBLEMS: {problems}" if problems else "")
    )
    return result
