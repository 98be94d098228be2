"""Running a worker from Python: ``worker_core.Worker`` and ``WorkerConfig`` are public (found by an
integrator's review: tests/review_integrator, commit 4e59e1c), and the README's example runs as written.

The two README tests hold the README's snippet ("Running a worker from Python") line for line, with
``myapp.tasks`` as tests.worker_core.readme_worker_tasks and ``DSN`` as the test's database: keep them the
same."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid

import worker_core
from tests.worker_core.helpers import ROOT, scalar, state, wait_for
from worker_core import db

TASKS = "tests.worker_core.readme_worker_tasks"


def test_worker_is_part_of_the_public_api() -> None:
    """The review's finding: the README speaks of "a `Worker` run inside an application" and worker_core
    exported neither ``Worker`` nor ``WorkerConfig``."""
    from worker_core import Worker, WorkerConfig
    from worker_core.worker import Worker as Worker_
    from worker_core.worker import WorkerConfig as WorkerConfig_

    assert Worker is Worker_ and WorkerConfig is WorkerConfig_
    assert hasattr(worker_core, "Worker") and hasattr(worker_core, "WorkerConfig")
    assert {"Worker", "WorkerConfig"} <= set(worker_core.__all__) <= set(dir(worker_core))


def test_a_producer_importing_worker_core_does_not_load_the_worker() -> None:
    """They are imported on first use: ``import worker_core`` in a web process costs what it did."""
    probe = (
        "import sys, json, worker_core\n"
        "before = 'worker_core.worker' in sys.modules\n"
        "worker_core.Worker\n"
        "print(json.dumps([before, 'worker_core.worker' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True]


def enqueue(dsn: str, job_type: str, n: int) -> list[uuid.UUID]:
    with db.connect(dsn) as conn:
        ids = [worker_core.enqueue(conn, job_type, {"order_id": f"ord_{i}"}).id for i in range(n)]
        conn.commit()
    return ids


def test_the_readme_worker_in_a_thread_runs_jobs_until_stopped(dsn: str) -> None:
    DSN = dsn
    handlers_before = signal.getsignal(signal.SIGTERM)
    # --- README: "Running a worker from Python" (in a thread, until stop())
    import threading

    from worker_core import Worker, WorkerConfig

    config = WorkerConfig(dsn=DSN, task_modules=(TASKS,), queues=("billing",), concurrency=4)
    worker = Worker(config)  # imports the task modules; ValueError if no @task is registered
    thread = threading.Thread(target=worker.run, name="worker_core")
    thread.start()
    # --- (the application runs: its jobs are claimed and run meanwhile)
    ids = enqueue(dsn, "readme.invoice", 3)
    wait_for(lambda: all(state(dsn, i) == "succeeded" for i in ids), 30, what="the jobs to succeed")
    assert signal.getsignal(signal.SIGTERM) is handlers_before  # off the main thread it takes no signal
    # --- README
    worker.stop()  # graceful: claims nothing more, running jobs get shutdown_grace (10 s)
    thread.join()
    # ---
    assert scalar(dsn, "SELECT count(*) FROM ledger WHERE job_id = ANY(%s)", (ids,)) == 3
    assert scalar(dsn, "SELECT stopped_at IS NOT NULL FROM workers WHERE id = %s", (worker.id,)) is True


def test_the_readme_worker_in_burst_mode_runs_what_is_ready_and_returns(dsn: str) -> None:
    DSN = dsn
    ids = enqueue(dsn, "readme.invoice", 3) + enqueue(dsn, "readme.report", 2)
    handlers_before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    # --- README: burst
    from worker_core import Worker, WorkerConfig

    exit_code = Worker(WorkerConfig(dsn=DSN, task_modules=(TASKS,), burst=True)).run()
    # ---
    assert exit_code == 0
    assert [state(dsn, i) for i in ids] == ["succeeded"] * 5
    # run() on the main thread took SIGTERM, SIGINT and SIGHUP for a graceful stop, and put them back
    assert {s: signal.getsignal(s) for s in handlers_before} == handlers_before
