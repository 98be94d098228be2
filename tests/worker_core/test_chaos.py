"""Chaos: thousands of jobs with idempotent ledger writes, 3 worker processes, a random worker SIGKILLed
about every second, and one PostgreSQL restart in the middle. At the end every job is terminal, every
effect happened exactly once and nothing was lost.

The jobs arrive in waves, one a second, and each kill lands while a wave is being worked: the workers
drain thousands of these jobs in a few seconds, so a single backlog would be gone before the chaos began.

It runs on an embedded server of its own, so restarting it disturbs no other test.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from worker_core import db
from worker_core.embedded import restart_embedded, start_embedded
from worker_core.migrate import migrate
from worker_core.producer import enqueue_many

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("chaos"), pytest.mark.timeout(240)]

JOBS = int(os.environ.get("QCONSOLE_CHAOS_JOBS", "5000"))
WAVES = 10
DEADLINE_SECONDS = 170
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chaos_dsn() -> str:
    base = Path(tempfile.mkdtemp(prefix="qcc", dir="/tmp"))  # a short path: the server's socket is in it
    pgdata = base / "pg"
    # the server stops as this process exits (start_embedded's exit hook, stop_embedded); an exit hook
    # registered before start_embedded runs after that one, and removes the directory
    atexit.register(_remove_stopped_server, base, pgdata)
    uri = start_embedded(pgdata)
    with db.connect(uri) as conn:
        migrate(conn)
        conn.execute("CREATE TABLE ledger (id bigserial, job_id uuid, item text, attempt int)")
        conn.commit()
    return uri


def _remove_stopped_server(base: Path, pgdata: Path) -> None:
    if not (pgdata / "postmaster.pid").exists():  # never the data of a server still running
        shutil.rmtree(base, ignore_errors=True)


def _counts(dsn: str) -> dict[str, int]:
    with db.connect(dsn, autocommit=True) as conn:
        return {r["state"]: r["n"] for r in conn.execute("SELECT state, count(*) AS n FROM job_queue GROUP BY state")}


def _kill_random_child(supervisor: subprocess.Popen[bytes], rng: random.Random, dsn: str) -> int | None:
    """SIGKILL one of the worker processes that has registered (beaten once): GIVE_UP_AFTER kills in a row of
    processes still starting are, by design, a crash loop the supervisor gives up on. On a busy machine (a
    start-up of seconds) the random kills once hit five starting processes in a row, and the run ended early."""
    try:
        with db.connect(dsn, autocommit=True) as conn:
            registered = {r["pid"] for r in conn.execute("SELECT pid FROM workers WHERE stopped_at IS NULL")}
    except Exception:
        return None  # the server is coming back
    workers = []
    try:
        for child in psutil.Process(supervisor.pid).children():
            try:
                if (
                    child.pid in registered
                    and child.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" not in " ".join(child.cmdline())
                ):
                    workers.append(child)
            except psutil.Error:
                continue
    except psutil.Error:
        return None
    if not workers:
        return None
    victim = rng.choice(workers)
    try:
        victim.send_signal(signal.SIGKILL)
    except psutil.Error:
        return None
    return victim.pid


def test_chaos_exactly_once(chaos_dsn: str) -> None:
    rng = random.Random(1234)
    size = -(-JOBS // WAVES)
    waves = [range(start, min(JOBS, start + size)) for start in range(0, JOBS, size)]
    ids: set[object] = set()

    def enqueue_wave(items: range) -> None:
        # a connection per wave: the server restart (done by this thread, never during an enqueue) breaks
        # the previous one
        with db.connect(chaos_dsn) as conn:
            results = enqueue_many(
                conn, [("t.ledger", {"item": f"i{i}"}, {"idempotency_key": f"ledger:{i}"}) for i in items]
            )
            conn.commit()
        ids.update(r.id for r in results)

    env = {**os.environ, "QCONSOLE_DSN": chaos_dsn, "PYTHONPATH": str(ROOT)}
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "qconsole", "worker", "--tasks", "tests.worker_core.tasks", "--processes", "3",
         "--concurrency", "8", "--heartbeat", "0.5", "--poll-interval", "0.2", "--shutdown-grace", "2",
         "--log-level", "ERROR"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    kills, restarted = 0, False
    started = time.monotonic()
    try:
        while time.monotonic() - started < DEADLINE_SECONDS:
            if waves:
                enqueue_wave(waves.pop(0))
            time.sleep(rng.uniform(0.05, 0.3))  # the wave is being worked
            if _kill_random_child(supervisor, rng, chaos_dsn):
                kills += 1
            time.sleep(rng.uniform(0.5, 1.0))
            try:
                counts = _counts(chaos_dsn)
            except Exception:
                continue  # the server is coming back
            done = counts.get("succeeded", 0)
            if not restarted and done >= JOBS // 3:
                restart_embedded(chaos_dsn)
                restarted = True
            if restarted and not waves and done == JOBS:
                break
    finally:
        supervisor.send_signal(signal.SIGTERM)
        try:
            _, err = supervisor.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            supervisor.kill()
            _, err = supervisor.communicate()

    elapsed = time.monotonic() - started
    with db.connect(chaos_dsn, autocommit=True) as conn:
        states = {r["state"]: r["n"] for r in conn.execute("SELECT state, count(*) AS n FROM job_queue GROUP BY 1")}
        effects = conn.execute(
            "SELECT count(*) AS rows, count(DISTINCT job_id) AS jobs, count(DISTINCT item) AS items FROM ledger"
        ).fetchone()
        duplicated = conn.execute(
            "SELECT count(*) AS n FROM (SELECT item FROM ledger GROUP BY item HAVING count(*) > 1) d"
        ).fetchone()
        expirations = conn.execute("SELECT coalesce(sum(lease_expirations), 0) AS n FROM job_queue").fetchone()
    assert effects is not None and duplicated is not None and expirations is not None
    lost = JOBS - effects["items"]
    stuck = sum(n for s, n in states.items() if s in ("queued", "running", "retry_scheduled"))
    print(
        f"\nchaos: {JOBS} jobs in {elapsed:.0f}s, {kills} workers SIGKILLed, PostgreSQL restarted={restarted}, "
        f"{expirations['n']} lease expirations; states={states}; "
        f"lost={lost} duplicated_effects={duplicated['n']} stuck={stuck}"
    )
    assert len(ids) == JOBS
    assert restarted, "the run ended before the PostgreSQL restart"
    assert kills >= 5, "too few kills to call this chaos"
    assert stuck == 0, f"jobs left unfinished: {states}\n{err.decode()[-3000:]}"
    assert duplicated["n"] == 0
    assert lost == 0
    assert states == {"succeeded": JOBS}
