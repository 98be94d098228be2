"""``make bench``: qconsole side by side with procrastinate and pgqueuer on one PostgreSQL server.

    python bench/run.py              full run (~8 min on 2 cores), median of 3 runs
    python bench/run.py --quick      development run (~3 min): 1 run, fewer jobs, a 200k-row table

Prints the table (figures, references measured in the same run, target ratios, PASS/MISS) and writes
bench/results/latest.json, bench/results/latest.md and the console queries' plans in
bench/results/explain/. See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import bigtable, console, pickup, report, throughput
from bench.harness import (
    RESULTS,
    Server,
    busy_other_processes,
    code_version,
    load_average,
    log,
    machine,
    median,
    wait_for_quiet,
)
from bench.pgbench import CLIENTS, SCENARIOS, PgBench, available
from bench.systems import configs


def _preload() -> None:
    """Import every library before the first measurement, so no import is timed (e.g. in an enqueue)."""
    import asyncpg  # noqa: F401
    import pgqueuer  # noqa: F401
    import procrastinate  # noqa: F401

    import bench.peers.qconsole_tasks  # noqa: F401
    import worker_core.migrate
    import worker_core.worker  # noqa: F401


WRITE_CONFIGS = {"qconsole", "pgqueuer:tuned (batch 100)", "pgqueuer:2 processes x batch 100", "procrastinate"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~3 min: 1 run, 5,000 jobs, a 200,000-row table")
    p.add_argument("--runs", type=int, help="rounds of every throughput/pgbench/pickup figure (median); default 3")
    p.add_argument("--jobs", type=int, help="jobs per drain, qconsole and pgqueuer (default 20,000)")
    p.add_argument("--peer-jobs", type=int, help="jobs per procrastinate drain (default 5,000: it runs ~500/s)")
    p.add_argument(
        "--qc-concurrency", type=int, default=4, help="qconsole slots per worker process (default 4, the CLI's)"
    )
    p.add_argument("--pgbench-seconds", type=int, help="-T of each pgbench figure (default 5)")
    p.add_argument("--pickup-jobs", type=int, help="jobs 50 ms apart per pickup measurement (default 200)")
    p.add_argument("--rows", type=int, help="finished rows of the claim/console table (default 1,000,000)")
    p.add_argument(
        "--only",
        default="throughput,pgbench,pickup,bigtable,console",
        help="comma-separated subset of: throughput,pgbench,pickup,bigtable,console",
    )
    p.add_argument(
        "--dsn", help="server to use (default $QCONSOLE_BENCH_DSN, else postgresql://postgres@127.0.0.1:5432/postgres)"
    )
    p.add_argument("--no-embedded", action="store_true", help="fail instead of starting the embedded server")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="before each measurement, wait up to this many seconds for other work on the machine to calm down "
        "(default 10; quick 3)",
    )
    p.add_argument(
        "--no-analyze",
        action="store_true",
        help="do not ANALYZE the queue tables after the enqueue (shows how each claim copes with a table whose "
        "statistics predate the backlog)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    a = p.parse_args(argv)
    quick = a.quick
    a.runs = a.runs or (1 if quick else 3)
    a.jobs = a.jobs or (5_000 if quick else 20_000)
    a.peer_jobs = a.peer_jobs or (2_000 if quick else 5_000)
    a.pgbench_seconds = a.pgbench_seconds or (3 if quick else 5)
    a.pickup_jobs = a.pickup_jobs or (60 if quick else 200)
    a.rows = a.rows or (200_000 if quick else 1_000_000)
    a.quiet_wait = a.quiet_wait if a.quiet_wait is not None else (3.0 if quick else 10.0)
    a.only = {s.strip() for s in a.only.split(",") if s.strip()}
    return a


def _rotate(items: list[Any], k: int) -> list[Any]:
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


def _interleave(groups: list[list[Any]]) -> list[Any]:
    """Round-robin over the groups, so no system runs all its measurements back to back."""
    out: list[Any] = []
    i = 0
    while any(i < len(g) for g in groups):
        out.extend(g[i] for g in groups if i < len(g))
        i += 1
    return out


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    logdir = out / "logs"
    shutil.rmtree(logdir, ignore_errors=True)
    logdir.mkdir(parents=True)
    explain_dir = out / "explain"
    shutil.rmtree(explain_dir, ignore_errors=True)

    signal.signal(signal.SIGTERM, _interrupt)

    _preload()
    server = Server.connect(args.dsn, allow_embedded=not args.no_embedded)
    res: dict[str, Any] = {
        "machine": machine(),
        "server": {"kind": server.kind, "version": server.version, "settings": server.settings},
        "args": {
            k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
        },
        "load_start": load_average(),
        "busy_start": busy_other_processes({os.getpid()}),
        "notes": [],
        "errors": [],
        "drains": [],
        "pgbench_runs": [],
        "pickup_runs": [],
    }
    if server.kind == "embedded":
        res["notes"].append("no server was reachable: these figures come from the embedded PostgreSQL server")
    if args.no_analyze:
        res["notes"].append("--no-analyze: queue tables were drained with the statistics of an empty table")
    elif server.settings.get("autovacuum") == "off":
        res["notes"].append(
            "autovacuum is off on this server: the bench ANALYZEs the queue tables itself after each enqueue"
        )
    if res["busy_start"]:
        log("other processes are busy on this machine; figures will be noisier: " + "; ".join(res["busy_start"][:3]))
    log(
        f"server: PostgreSQL {server.version} ({server.kind}); mode {'quick' if args.quick else 'full'}, "
        f"{args.runs} run(s)"
    )

    pgb: PgBench | None = None
    try:
        if "pgbench" in args.only:
            if available():
                pgb = PgBench(server, args.pgbench_seconds)
            else:
                res["notes"].append("pgbench is not installed: no ceiling figures")

        # ------------------------------------------------------------ rounds: drains, pgbench, pickup, interleaved
        cfgs = configs(args.qc_concurrency)
        by_system: dict[str, list[Any]] = {}
        if "throughput" in args.only:
            for cfg in cfgs:
                by_system.setdefault(cfg.system, []).append(("drain", cfg, "noop"))
            for cfg in cfgs:
                if cfg.system in WRITE_CONFIGS or cfg.key in WRITE_CONFIGS:
                    by_system.setdefault(cfg.system, []).append(("drain", cfg, "write"))
        if pgb is not None:
            by_system["pgbench"] = [("pgbench", sc, c) for sc in SCENARIOS for c in CLIENTS]
        if "pickup" in args.only:
            for system in ("qconsole", "pgqueuer", "procrastinate"):
                by_system.setdefault(system, []).append(("pickup", system, None))
        items = _interleave(list(by_system.values()))
        for rnd in range(args.runs):
            log(f"round {rnd + 1}/{args.runs}: {len(items)} measurements")
            for kind, a, b in _rotate(items, rnd * max(1, len(items) // args.runs)):
                tag = f"r{rnd}"
                busy = wait_for_quiet(args.quiet_wait)
                code = code_version()
                if busy >= 30:
                    log(f"  the machine is {busy:.0f}% busy with other work; measuring anyway")
                try:
                    if kind == "drain":
                        n = args.peer_jobs if a.system == "procrastinate" else args.jobs
                        r = throughput.measure(server, a, b, n, logdir, tag, analyze=not args.no_analyze).as_dict()
                        r.update({"round": rnd, "load": load_average(), "cpu_busy_before": busy, "code": code})
                        res["drains"].append(r)
                    elif kind == "pgbench":
                        assert pgb is not None
                        tps = pgb.measure(a, b)
                        res["pgbench_runs"].append(
                            {
                                "round": rnd,
                                "scenario": a,
                                "clients": b,
                                "tps": tps,
                                "cpu_busy_before": busy,
                                "code": code,
                            }
                        )
                    else:
                        r = pickup.measure(server, a, args.pickup_jobs, args.qc_concurrency, logdir)
                        r.update({"round": rnd, "cpu_busy_before": busy, "code": code})
                        res["pickup_runs"].append(r)
                except KeyboardInterrupt:
                    raise
                except Exception as e:
                    log(f"  FAILED {kind} {a} {b}: {e}")
                    res["errors"].append({"what": f"{kind} {a} {b}", "error": repr(e), "trace": traceback.format_exc()})
        if pgb is not None:
            pgb.close()
            pgb = None

        # ------------------------------------------------------------ the big table: claims and console
        if "bigtable" in args.only or "console" in args.only:
            try:
                res["bigtable_code"] = code_version()
                big = bigtable.run(
                    server,
                    finished=args.rows,
                    dead=10_000,
                    waiting=10_000,
                    claims=(300, 1000) if not args.quick else (100, 300),
                    explain_dir=explain_dir,
                    concurrency=args.qc_concurrency,
                )
                dsn = big.pop("dsn")
                if "console" in args.only:
                    big["console"] = console.measure(dsn, logdir)
                res["bigtable"] = big
            except KeyboardInterrupt:
                raise
            except Exception as e:
                log(f"  FAILED big table: {e}")
                res["errors"].append({"what": "bigtable", "error": repr(e), "trace": traceback.format_exc()})
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
        res["notes"].append("interrupted before the end")
    finally:
        if pgb is not None:
            pgb.close()
        server.cleanup()

    res["load_end"] = load_average()
    versions = sorted(
        {d.get("code") for d in res["drains"] + res["pickup_runs"] if d.get("code")}
        | ({res["bigtable_code"]} if res.get("bigtable_code") else set())
    )
    res["code_versions"] = versions
    if len(versions) > 1:
        res["notes"].append(
            "THE CODE UNDER TEST CHANGED DURING THIS RUN (" + ", ".join(versions) + "): medians mix versions; "
            "see each measurement's 'code' in latest.json, and run again on a quiet checkout"
        )
    res["duration_s"] = round(time.perf_counter() - started, 1)
    res["medians"] = _medians(res)
    text = report.render(res)
    res["table"] = text
    (out / "latest.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    (out / "latest.md").write_text(text)
    print(text)
    log(f"done in {res['duration_s']:.0f}s: {out / 'latest.json'}")
    return 1 if res["errors"] else 0


def _medians(res: dict[str, Any]) -> dict[str, Any]:
    drains: dict[str, dict[str, Any]] = {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for d in res["drains"]:
        groups.setdefault((d["config"], d["workload"]), []).append(d)
    for (key, workload), ds in groups.items():
        ok = [d for d in ds if d["ok"]]
        use = ok or ds
        drains[f"{key} [{workload}]"] = {
            "system": ds[0]["system"],
            "workload": workload,
            "jobs": ds[0]["jobs"],
            "runs": len(ds),
            "ok_runs": len(ok),
            "jobs_per_s": median([d["jobs_per_s"] for d in ok]) if ok else None,
            "jobs_per_s_runs": [round(d["jobs_per_s"]) for d in ds],
            "enqueue_per_s": median([d["enqueue_per_s"] for d in use]),
            "commits_per_job": median([d["commits_per_job"] for d in use if d["commits_per_job"] is not None]),
            "worker_cpu_ms_per_job": median(
                [d["worker_cpu_ms_per_job"] for d in use if d["worker_cpu_ms_per_job"] is not None]
            ),
            "problems": sorted({p for d in ds for p in d["problems"]}),
        }
    pgbench: dict[str, float] = {}
    for sc in SCENARIOS:
        for c in CLIENTS:
            vals = [r["tps"] for r in res["pgbench_runs"] if r["scenario"] == sc and r["clients"] == c]
            if vals:
                pgbench[f"{sc}:{c}"] = median(vals)
    pick: dict[str, dict[str, Any]] = {}
    for system in ("qconsole", "pgqueuer", "procrastinate"):
        rs = [r for r in res["pickup_runs"] if r["system"] == system and r.get("p50_ms") is not None]
        if rs:
            pick[system] = {
                "jobs": rs[0]["jobs"],
                "runs": len(rs),
                "p50_ms": median([r["p50_ms"] for r in rs]),
                "p99_ms": median([r["p99_ms"] for r in rs]),
                "p50_runs": [round(r["p50_ms"], 2) for r in rs],
            }
    return {"drain": drains, "pgbench": pgbench, "pickup": pick}


if __name__ == "__main__":
    sys.exit(main())
