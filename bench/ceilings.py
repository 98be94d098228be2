"""What the remaining targets of issue 6 would take: ceilings measured with no worker at all.

    bench/.venv/bin/python bench/ceilings.py [--jobs 20000] [--rounds 3]

Two client processes of bare psycopg (no worker_core in the loop), on the server of ``make bench``
($QCONSOLE_BENCH_DSN, else the embedded one), each scenario in a fresh database, interleaved over rounds.
Per scenario: jobs/s, the clients' CPU and the server's CPU per job (every ``postgres`` process of this
machine: a remote server reads as 0), and the ratio to pgbench's single-row UPDATE at 8 clients, measured
in the same run. The table is also written to bench/results/ceilings.txt.

- ``effects, savepoint per job``: what an idempotent-write job needs besides its claim and settlement,
  nothing more: per group of 32, one transaction with the group's idempotency records in one INSERT,
  then per job a SAVEPOINT and the handler's INSERT, then COMMIT. The write target (1.0x pgbench) asks
  the whole job, claim and settlement included, to fit in this.
- ``effects, no savepoint``: the same without the savepoints, which isolate a failing job from its group.
- ``claim + settle, job_queue``: the worker's own claim and ``settle_succeeded_many`` statements
  (queries.sql), 100 jobs at a time, on the table as migrated: the server's side of a no-op job.
- ``claim + settle, live + history``: the same on a narrow table of live jobs whose settlement deletes
  the row into a history table (pgqueuer's shape): what that structural change would save the server.
- ``claim + settle, job_queue split``: the same split on job_queue as migrated (uuid ids, every column,
  its live indexes), the finished-only indexes moved to a history table of the same shape: what the
  change would save this project's own schema.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from bench.ab import postgres_cpu_seconds
from bench.harness import RESULTS, Server, log, machine, median
from bench.pgbench import PgBench, available

PROCESSES = 2
GROUP = 32
BATCH = 100

EFFECTS_DDL = """
CREATE TABLE ceiling_keys (key text PRIMARY KEY, job_id bigint NOT NULL);
CREATE TABLE ceiling_effects (key text PRIMARY KEY, item integer NOT NULL)
"""

SPLIT_DDL = """
CREATE TABLE live (
    id bigserial PRIMARY KEY, job_type text NOT NULL, queue text NOT NULL DEFAULT 'default',
    payload jsonb NOT NULL, state text NOT NULL DEFAULT 'queued', priority integer NOT NULL DEFAULT 0,
    attempts integer NOT NULL DEFAULT 0, scheduled_at timestamptz NOT NULL DEFAULT now(), locked_by text,
    locked_until timestamptz, started_at timestamptz, created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(), idempotency_key text,
    retry_policy jsonb NOT NULL DEFAULT '{}', errors jsonb NOT NULL DEFAULT '[]');
CREATE INDEX live_ready ON live (priority, scheduled_at, id) WHERE state = 'queued';
CREATE INDEX live_running ON live (locked_until) WHERE state = 'running';
CREATE TABLE history (
    id bigint NOT NULL, job_type text NOT NULL, queue text NOT NULL, payload jsonb NOT NULL,
    state text NOT NULL, attempts integer NOT NULL, scheduled_at timestamptz, started_at timestamptz,
    finished_at timestamptz NOT NULL, created_at timestamptz NOT NULL, idempotency_key text, errors jsonb);
CREATE INDEX history_finished ON history (finished_at);
CREATE INDEX history_id ON history (id)
"""
SPLIT_CLAIM = """
WITH ready AS MATERIALIZED (
    SELECT id FROM live WHERE state = 'queued' AND scheduled_at <= now()
    ORDER BY priority, scheduled_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
UPDATE live j SET state = 'running', attempts = j.attempts + 1, locked_by = %(worker)s,
    locked_until = now() + interval '90 seconds', started_at = now(), updated_at = now()
WHERE j.id = ANY(ARRAY(SELECT id FROM ready))
RETURNING j.id, j.job_type, j.queue, j.payload, j.attempts
"""
SPLIT_SETTLE = """
WITH done AS (
    DELETE FROM live WHERE id = ANY(%(ids)s::bigint[]) AND state = 'running' AND locked_by = %(worker)s
    RETURNING *)
INSERT INTO history
SELECT id, job_type, queue, payload, 'succeeded', attempts, scheduled_at, started_at, now(), created_at,
       idempotency_key, errors
FROM done
"""


def _effects_setup(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for stmt in EFFECTS_DDL.split(";"):
            conn.execute(stmt)  # type: ignore[call-overload]


def _effects_client(dsn: str, start: int, count: int, savepoints: bool) -> None:
    conn = psycopg.connect(dsn)
    cur = conn.cursor()
    pg = conn.pgconn
    insert = "INSERT INTO ceiling_effects (key, item) VALUES (%s, %s)"
    for first in range(start, start + count, GROUP):
        last = min(first + GROUP, start + count)
        rows = ", ".join(f"('k{i}', {i})" for i in range(first, last))
        # the records as literals in one simple-protocol round trip, as the worker writes a group's (numbers only)
        pg.exec_(f"BEGIN; INSERT INTO ceiling_keys VALUES {rows} ON CONFLICT DO NOTHING".encode())  # noqa: S608
        for i in range(first, last):
            if savepoints:
                pg.exec_(b"SAVEPOINT job")
            cur.execute(insert, (f"k{i}", i))
        conn.commit()
    conn.close()


def _job_queue_setup(dsn: str, n: int) -> None:
    from worker_core import db, enqueue_many
    from worker_core.migrate import migrate

    with db.connect(dsn) as conn:
        migrate(conn)
        conn.commit()
        for first in range(0, n, 1000):
            enqueue_many(conn, [("bench.noop", {"i": i}) for i in range(first, min(n, first + 1000))])
            conn.commit()
        conn.execute("ANALYZE job_queue")
        conn.commit()


def _job_queue_client(dsn: str, start: int, count: int, worker: str) -> None:
    from worker_core.sql import queries

    def settle(conn: Any, rows: list[dict[str, Any]], ids: str, now: dt.datetime) -> None:
        fences = "{" + ",".join(f"{r['id']}/{r['attempts']}" for r in rows) + "}"
        params = {"ids": ids, "fences": fences, "worker": worker, "now": now}
        conn.execute(queries["settle_succeeded_many"], params).fetchall()

    _drain_job_queue(dsn, worker, settle)


Settle = Callable[[Any, list[dict[str, Any]], str, dt.datetime], Any]


def _drain_job_queue(dsn: str, worker: str, settle: Settle) -> None:
    """The worker's own claim of 100 at a time, each batch settled by ``settle`` in a transaction of its own."""
    from worker_core import db
    from worker_core.sql import queries

    conn = db.connect(dsn)
    claim = {
        "worker": worker, "all_queues": True, "queues": [], "job_types": ["bench.noop"], "paused": [],
        "limited_types": [], "limited_pairs": [], "limit": BATCH,
    }  # fmt: skip
    while True:
        claim["now"] = now = dt.datetime.now(dt.timezone.utc)
        rows = conn.execute(queries["claim"], claim).fetchall()
        conn.commit()
        if not rows:
            break
        settle(conn, rows, "{" + ",".join(str(r["id"]) for r in rows) + "}", now)
        conn.commit()
    conn.close()


def _split_setup(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for stmt in SPLIT_DDL.split(";"):
            conn.execute(stmt)  # type: ignore[call-overload]
        conn.execute(
            "INSERT INTO live (job_type, payload) SELECT 'bench.noop', jsonb_build_object('i', g)"
            " FROM generate_series(1, %s::integer) g",
            (n,),
        )
        conn.execute("ANALYZE live")


def _split_client(dsn: str, start: int, count: int, worker: str) -> None:
    conn = psycopg.connect(dsn)
    while True:
        rows = conn.execute(SPLIT_CLAIM, {"limit": BATCH, "worker": worker}).fetchall()
        conn.commit()
        if not rows:
            break
        conn.execute(SPLIT_SETTLE, {"ids": [r[0] for r in rows], "worker": worker})
        conn.commit()
    conn.close()


#: job_queue's indexes that only finished rows enter: a split moves them to the history table
FINISHED_ONLY = (
    "job_queue_dead_idx", "job_queue_finished_idx", "job_queue_unsuccessful_counts_idx",
    "job_queue_unsuccessful_idx",
)  # fmt: skip


def _job_queue_split_setup(dsn: str, n: int) -> None:
    """job_queue as migrated (its uuid ids, its columns, its live indexes), with a history table of the same
    shape that takes the finished rows and their indexes: the split on the real schema, not a narrow one."""
    _job_queue_setup(dsn, n)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE job_history (LIKE job_queue INCLUDING DEFAULTS)")
        conn.execute("ALTER TABLE job_history ADD PRIMARY KEY (id)")
        for name in FINISHED_ONLY:
            definition = conn.execute("SELECT pg_get_indexdef(%s::regclass)", (name,)).fetchone()
            assert definition is not None
            conn.execute(f"DROP INDEX {name}")
            conn.execute(definition[0].replace(" ON public.job_queue ", " ON public.job_history "))


def _job_queue_split_client(dsn: str, start: int, count: int, worker: str) -> None:
    from worker_core import db

    conn = db.connect(dsn)
    columns = [r["attname"] for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'job_queue'::regclass AND attnum > 0"
        " AND NOT attisdropped ORDER BY attnum"
    )]  # fmt: skip
    moved = ", ".join(
        {"state": "'succeeded'", "finished_at": "now()", "locked_until": "NULL", "updated_at": "now()"}.get(c, c)
        for c in columns
    )
    settle = (
        "WITH done AS (DELETE FROM job_queue WHERE id = ANY(%(ids)s::uuid[]) AND (state = 'running') IS TRUE"  # noqa: S608
        f" AND locked_by = %(worker)s RETURNING *) INSERT INTO job_history SELECT {moved} FROM done"
    )
    conn.close()
    _drain_job_queue(dsn, worker, lambda c, rows, ids, now: c.execute(settle, {"ids": ids, "worker": worker}))


def _child(target: Callable[..., None], args: tuple[Any, ...], out: Any) -> None:
    t0 = time.process_time()
    target(*args)
    out.put(time.process_time() - t0)


Setup = Callable[[str, int], None]
ClientArgs = Callable[[str, int, int], tuple[Any, ...]]
SCENARIOS: dict[str, tuple[Setup, ClientArgs, Callable[..., None]]] = {
    "effects, savepoint per job": (_effects_setup, lambda d, s, c: (d, s, c, True), _effects_client),
    "effects, no savepoint": (_effects_setup, lambda d, s, c: (d, s, c, False), _effects_client),
    "claim + settle, job_queue": (_job_queue_setup, lambda d, s, c: (d, s, c, f"ceiling-{s}"), _job_queue_client),
    "claim + settle, live + history": (_split_setup, lambda d, s, c: (d, s, c, f"ceiling-{s}"), _split_client),
    "claim + settle, job_queue split": (
        _job_queue_split_setup, lambda d, s, c: (d, s, c, f"ceiling-{s}"), _job_queue_split_client
    ),
}


def measure(server: Server, name: str, n: int) -> dict[str, float]:
    setup, make_args, client = SCENARIOS[name]
    with server.fresh_db("qcbench_ceiling") as dsn:
        setup(dsn, n)
        per = n // PROCESSES
        out: Any = mp.get_context("fork").Queue()
        procs = [
            mp.get_context("fork").Process(target=_child, args=(client, make_args(dsn, i * per, per), out))
            for i in range(PROCESSES)
        ]
        server_before = postgres_cpu_seconds()
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        client_cpu = sum(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        seconds = time.perf_counter() - t0
        server_cpu = postgres_cpu_seconds() - server_before
    jobs = per * PROCESSES
    return {
        "jobs_per_s": jobs / seconds,
        "client_ms": client_cpu * 1000 / jobs,
        "server_ms": server_cpu * 1000 / jobs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dsn", help="the server (default: $QCONSOLE_BENCH_DSN, else the embedded one)")
    p.add_argument("--only", action="append", help="run only this scenario (repeat); default: all")
    args = p.parse_args()
    server = Server.connect(args.dsn)
    pgbench = PgBench(server, 5) if available() else None
    names = [n for n in SCENARIOS if not args.only or n in args.only]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    ceiling: list[float] = []
    try:
        for r in range(args.rounds):
            log(f"round {r + 1}/{args.rounds}")
            for name in names:
                runs[name].append(measure(server, name, args.jobs))
                log(f"  {name}: {runs[name][-1]['jobs_per_s']:,.0f} jobs/s")
            if pgbench is not None:
                ceiling.append(pgbench.measure("update", 8))
    finally:
        if pgbench is not None:
            pgbench.close()
        server.cleanup()
    update8 = median(ceiling) if ceiling else None
    info = machine()
    lines = [
        f"ceilings — {info['date']} — {info['cpu']}, {info['cores']} cores; git {info['git']}; server {server.version}",
        f"{PROCESSES} client processes of bare psycopg, {args.jobs:,} jobs, median of {args.rounds}",
        "",
        f"{'scenario':34} {'jobs/s':>9} {'client CPU':>12} {'server CPU':>12} {'x pgbench UPDATE@8':>20}",
    ]
    for name, rs in runs.items():
        rate = median([x["jobs_per_s"] for x in rs])
        ratio = f"{rate / update8:.2f}x" if update8 else "n/a"
        lines.append(
            f"{name:34} {rate:>9,.0f} {median([x['client_ms'] for x in rs]):>9.3f} ms"
            f" {median([x['server_ms'] for x in rs]):>9.3f} ms {ratio:>20}"
        )
    if update8:
        lines.append(f"{'pgbench UPDATE, 8 clients':34} {update8:>9,.0f} tx/s")
    print("\n" + "\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ceilings.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
