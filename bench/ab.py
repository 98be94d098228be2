"""A/B drains for development: the same drain, interleaved between code roots, with each side's CPU.

    bench/.venv/bin/python bench/ab.py --root /tmp/base --root . --workload write --processes 1 --jobs 40000

Make the old side with ``git worktree add /tmp/base <commit>``. Each round runs every root once, in turn,
so a noisy minute on the machine hits both. Per drain it prints jobs/s, commits per job, the worker
processes' CPU per job (interpreter start-up included) and the CPU of every PostgreSQL process of this
machine per job, from after the enqueue to the end of the drain. Single drains vary by about 20% on a
2-core VM: compare rounds, not runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def postgres_cpu_seconds() -> float:
    """user + sys (and waited-for children's) of every process named postgres on this machine."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.index("(") + 1 : stat.rindex(")")].startswith("postgres"):
            fields = stat[stat.rindex(")") + 2 :].split()
            total += sum(int(f) for f in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def one(args: argparse.Namespace) -> None:
    """One drain with the code of ``--one`` (a root), in this process: that root's bench and worker_core."""
    sys.path.insert(0, args.one)
    # from the root under test, not this one
    from bench import throughput
    from bench.harness import Server
    from bench.systems import SYSTEMS, Config

    system = SYSTEMS[args.system]
    enqueue = system.enqueue
    marks: dict[str, float] = {}

    def enqueue_then_mark(*a: object, **k: object) -> None:
        enqueue(*a, **k)  # type: ignore[arg-type]
        marks["after_enqueue"] = postgres_cpu_seconds()

    system.enqueue = enqueue_then_mark  # type: ignore[method-assign]
    server = Server.connect(os.environ.get("QCONSOLE_BENCH_DSN"))
    cfg = Config(args.system, args.processes, args.width, f"{args.processes}x{args.width}")
    logdir = Path("/tmp/qcbench-ab")
    logdir.mkdir(exist_ok=True)
    r = throughput.measure(server, cfg, args.workload, args.jobs, logdir, f"ab{os.getpid()}")
    server_ms = (postgres_cpu_seconds() - marks["after_enqueue"]) * 1000 / args.jobs
    print(
        f"{args.one}: {r.jobs_per_s:,.0f} jobs/s, {r.commits_per_job or 0:.3f} commits/job, worker CPU"
        f" {r.worker_cpu_ms_per_job or 0:.3f} ms/job, server CPU {server_ms:.3f} ms/job"
        + (f" PROBLEMS {r.problems}" if r.problems else ""),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", action="append", help="a code root (repeat; default: this checkout)")
    p.add_argument("--workload", choices=("noop", "write"), default="noop")
    p.add_argument("--system", default="qconsole", help="qconsole, pgqueuer or procrastinate")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--width", type=int, default=4, help="qconsole: concurrency; pgqueuer: batch size")
    p.add_argument("--jobs", type=int, default=40_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args)
        return
    roots = [str(Path(r).resolve()) for r in (args.root or [HERE.parent])]
    passed = [f"--workload={args.workload}", f"--system={args.system}", f"--processes={args.processes}",
              f"--width={args.width}", f"--jobs={args.jobs}"]  # fmt: skip
    for _ in range(args.rounds):
        for root in roots:
            # a fresh interpreter per side: each imports its own worker_core
            subprocess.run([sys.executable, str(HERE / "ab.py"), *passed, "--one", root], check=False)


if __name__ == "__main__":
    main()
