"""Scenario 5: pickup latency of an idle worker: enqueue commit -> handler start.

One idle worker process per system (qconsole: ``--concurrency C``; pgqueuer: default batch 10;
procrastinate: concurrency 8), woken by each system's LISTEN/NOTIFY. The producer enqueues one job per
transaction, ``count`` jobs 50 ms apart, and notes the time its commit returned; the handler's first
statement appends ``time.time()`` to a file. Same machine, same clock. A warm-up job first, so
connection set-up is not measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import Child, Server, child_env, log, percentile
from bench.peers.common import PICKUP_FILE_ENV
from bench.systems import SYSTEMS

SPACING = 0.05


def _worker_command(system: str, qc_concurrency: int) -> list[str]:
    if system == "qconsole":
        return [
            sys.executable,
            "-m",
            "qconsole",
            "worker",
            "--tasks",
            "bench.peers.qconsole_tasks",
            "--concurrency",
            str(qc_concurrency),
            "--log-level",
            "WARNING",
        ]
    if system == "pgqueuer":
        return [sys.executable, "-m", "bench.peers.pgqueuer_worker", "--batch-size", "10", "--mode", "continuous"]
    return [
        sys.executable,
        "-m",
        "procrastinate",
        "--app",
        "bench.peers.procrastinate_app.app",
        "--log-level",
        "warning",
        "worker",
        "--concurrency",
        "8",
    ]


class _Producer:
    """``send(i)`` enqueues one job in its own transaction and returns when the commit did."""

    def __init__(self, system: str, dsn: str) -> None:
        self.system = system
        self.loop = asyncio.new_event_loop()
        self._close: Callable[[], Any] = lambda: None
        if system == "qconsole":
            import bench.peers.qconsole_tasks  # noqa: F401
            from worker_core import db, enqueue

            conn = db.connect(dsn, application_name="qcbench-producer", autocommit=True)
            self._send: Callable[[int], Any] = lambda i: enqueue(conn, "bench.pickup", {"i": i})
            self._close = conn.close
        elif system == "pgqueuer":
            import asyncpg
            from pgqueuer import Queries

            conn = self.loop.run_until_complete(asyncpg.connect(dsn))
            q = Queries.from_asyncpg_connection(conn)
            self._send = lambda i: self.loop.run_until_complete(q.enqueue("pickup", str(i).encode()))
            self._close = lambda: self.loop.run_until_complete(conn.close())
        else:
            import procrastinate

            app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
            self.loop.run_until_complete(app.open_async())
            deferrer = app.configure_task("pickup", allow_unknown=True)
            self._send = lambda i: self.loop.run_until_complete(deferrer.defer_async(i=i))
            self._close = lambda: self.loop.run_until_complete(app.close_async())

    def send(self, i: int) -> float:
        self._send(i)
        return time.time()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._close()
        self.loop.close()


def _read(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[int(parts[0])] = float(parts[1])
    return out


def _wait_for(path: Path, keys: set[int], timeout: float) -> dict[int, float]:
    deadline = time.monotonic() + timeout
    seen = _read(path)
    while not keys <= seen.keys() and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = _read(path)
    return seen


def measure(server: Server, system: str, count: int, qc_concurrency: int, logdir: Path) -> dict[str, Any]:
    impl = SYSTEMS[system]
    dbname = f"qcbench_pickup_{system}"
    fd, name = tempfile.mkstemp(prefix=f"qcbench-pickup-{system}-", suffix=".txt")
    os.close(fd)
    probe = Path(name)
    result: dict[str, Any] = {"system": system, "jobs": count}
    with server.fresh_db(dbname) as dsn:
        impl.setup(dsn)
        env = child_env({**impl.env(dsn), PICKUP_FILE_ENV: str(probe)})
        worker = Child.start(
            _worker_command(system, qc_concurrency), f"{system}-pickup", env, logdir / f"pickup-{system}.log"
        )
        producer = _Producer(system, dsn)
        try:
            producer.send(-1)
            if -1 not in _wait_for(probe, {-1}, 60):
                raise RuntimeError(f"{system}: the idle worker never ran the warm-up job (see {logdir})")
            time.sleep(0.5)
            committed: dict[int, float] = {}
            start = time.monotonic()
            for i in range(count):
                delay = start + i * SPACING - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                committed[i] = producer.send(i)
            started = _wait_for(probe, set(range(count)), 10)
        finally:
            producer.close()
            worker.stop(grace=10)
            probe.unlink(missing_ok=True)
    lat = [(started[i] - committed[i]) * 1000 for i in range(count) if i in started]
    result.update(
        {
            "received": len(lat),
            "p50_ms": percentile(lat, 50) if lat else None,
            "p99_ms": percentile(lat, 99) if lat else None,
            "max_ms": max(lat) if lat else None,
            "ok": len(lat) == count,
        }
    )
    log(f"  pickup {system}: p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms ({len(lat)}/{count})")
    return result
