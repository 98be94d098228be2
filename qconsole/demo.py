"""``qconsole demo``: the console over the embedded PostgreSQL, two embedded workers and a live workload.

This module is also the demo's task module (``--tasks qconsole.demo``), with four job types that show
what goes wrong in a real queue within a minute:

- ``invoice.generate``: idempotent writes. Its effect (the invoice mail) is enqueued through the job's own
  transaction, so it happens once even when the job is retried or delivered twice.
- ``email.send``: calls a flaky fake upstream that has an outage 20 seconds out of every minute:
  retries with backoff, then dead letters; mail to a bounce address fails permanently.
- ``report.build``: slow (15-45 s), so its lease lives on heartbeats; it stops early when killed.
- ``image.resize``: a "poison" payload crashes the worker process itself (``os._exit``). The embedded
  worker restarts, the job's lease expires and, out of attempts, the claim dead-letters it unrun.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from typing import Any

import psycopg

import worker_core
from worker_core import JobContext, PermanentError, RetryPolicy, TransientError, db

DEMO_TASKS = "qconsole.demo"
QUICK = RetryPolicy(backoff="exponential", base_seconds=1.0, max_delay_seconds=8.0, jitter=0.2)
#: seconds of every minute during which the fake mail upstream is down
OUTAGE_SECONDS = 20


def upstream_down(now: float | None = None) -> bool:
    return int(now if now is not None else time.time()) % 60 < OUTAGE_SECONDS


@worker_core.task(
    "invoice.generate",
    queue="billing",
    requires_idempotency_key=True,
    max_attempts=4,
    timeout=10,
    retry=QUICK,
    reason="demo: fail fast so dead letters show within a minute",
)
def generate_invoice(ctx: JobContext, payload: dict[str, Any]) -> None:
    time.sleep(random.uniform(0.05, 0.3))
    if random.random() < 0.1:
        raise TransientError("pdf renderer busy, try again")
    invoice = payload["invoice"]
    # the effect goes through ctx.tx: it commits with this job's success and idempotency record, or not at all
    worker_core.enqueue(
        ctx.tx,
        "email.send",
        {"to": payload.get("email", "billing@example.com"), "template": "invoice", "invoice": invoice},
        queue="mail",
        idempotency_key=f"invoice-mail:{invoice}",
        trace_id=ctx.trace_id,
    )


@worker_core.task(
    "email.send",
    queue="mail",
    requires_idempotency_key=True,
    max_attempts=4,
    timeout=5,
    retry=QUICK,
    reason="demo: the fake upstream is flaky by design; short retries keep the charts moving",
)
def send_email(ctx: JobContext, payload: dict[str, Any]) -> None:
    to = str(payload.get("to", ""))
    time.sleep(random.uniform(0.05, 0.4))
    if to.endswith("@bounce.example"):
        raise PermanentError(f"mailbox '{to}' does not exist")
    failure = 0.85 if upstream_down() else 0.1
    if random.random() < failure:
        relay = random.randint(1, 4)
        raise TransientError(f"upstream 503 from smtp relay 'mx{relay}' after {random.randint(5, 30)}s")
    if random.random() < 0.02:
        raise ConnectionResetError(f"connection reset by peer 10.0.0.{random.randint(2, 250)}")


@worker_core.task(
    "report.build",
    queue="reports",
    max_attempts=3,
    timeout=60,
    visibility_timeout=75,
    retry=QUICK,
    reason="demo: slow reports need a long timeout and heartbeats",
)
def build_report(ctx: JobContext, payload: dict[str, Any]) -> None:
    deadline = time.monotonic() + float(payload.get("seconds", 20))
    while time.monotonic() < deadline:
        if ctx.wait_cancelled(0.2):  # killed, timed out or shutting down: stop now
            return


@worker_core.task(
    "image.resize",
    queue="media",
    max_attempts=2,
    timeout=4,
    visibility_timeout=10,
    retry=QUICK,
    reason="demo: a poison payload should reach dead letters after two crashes",
)
def resize_image(ctx: JobContext, payload: dict[str, Any]) -> None:
    if payload.get("poison"):
        os._exit(13)  # a decoder bug that takes the whole process down
    time.sleep(random.uniform(0.05, 0.3))


# ------------------------------------------------------------------------------------------------ workload


class Feeder(threading.Thread):
    """A steady workload with bursts: a few jobs a second, a burst of mail every 30 seconds, a report
    every 15 seconds and a poison image every 45 seconds."""

    def __init__(self, dsn: str, *, seed: int | None = None) -> None:
        super().__init__(name="qconsole-demo-feeder", daemon=True)
        self.dsn = dsn
        self.stopped = threading.Event()
        self.rng = random.Random(seed)
        self.enqueued = 0
        self.last_error: str | None = None

    def stop(self) -> None:
        self.stopped.set()

    def batch(self, tick: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        rng = self.rng
        jobs: list[tuple[str, dict[str, Any], dict[str, Any]]] = []

        def invoice() -> None:
            n = rng.randint(10_000, 99_999_999)
            email = f"c{n}@bounce.example" if rng.random() < 0.03 else f"c{n}@example.com"
            payload = {"invoice": f"inv_{n}", "email": email, "amount_cents": rng.randint(500, 90_000)}
            tenant = rng.choice(["acme", "globex", "initech"])
            jobs.append(("invoice.generate", payload, {"idempotency_key": f"invoice:inv_{n}", "tenant_id": tenant}))

        def email() -> None:
            n = rng.randint(10_000, 99_999_999)
            to = f"u{n}@bounce.example" if rng.random() < 0.03 else f"u{n}@example.com"
            jobs.append(("email.send", {"to": to, "template": "welcome"}, {"idempotency_key": f"welcome:{n}"}))

        for _ in range(rng.randint(1, 3)):
            invoice()
        for _ in range(rng.randint(1, 4)):
            email()
        if tick % 30 == 0:
            for _ in range(60):
                email()
            for _ in range(20):
                invoice()
        if tick % 15 == 0:
            jobs.append(("report.build", {"report": "daily-sales", "seconds": rng.randint(15, 45)}, {}))
        if tick % 3 == 0:
            jobs.append(("image.resize", {"image": f"img_{rng.randint(1, 10**6)}.png", "width": 640}, {}))
        if tick % 45 == 20:
            jobs.append(("image.resize", {"image": "cursed.png", "poison": True}, {}))
        return jobs

    def run(self) -> None:
        tick = 0
        conn: db.Conn | None = None
        while not self.stopped.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = db.connect(self.dsn, application_name="qconsole-demo-feeder", autocommit=True)
                self.enqueued += len(worker_core.enqueue_many(conn, self.batch(tick)))
                self.last_error = None
            except psycopg.Error as e:
                self.last_error = str(e)
                conn = None
            tick += 1
            self.stopped.wait(1.0)
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()


def demo_dsn(explicit: str | None) -> str:
    """The demo's database: the embedded server's, unless ``--dsn`` names one. Never QCONSOLE_DSN or
    DATABASE_URL: the demo writes jobs of its own and runs workers that take any job of its types
    (invoice.generate, email.send...): on an application's database, exported for it, it ran that
    application's jobs with the demo's handlers (a real password-reset mail settled, never sent)."""
    if explicit:
        return explicit
    ignored = [var for var in db.DSN_ENV_VARS if os.environ.get(var)]
    if ignored:
        print(
            f"qconsole demo: {' and '.join(ignored)} ignored: the demo writes jobs and runs workers of its own, on"
            " the embedded PostgreSQL (`qconsole demo --dsn` puts them in a database of yours)",
            flush=True,
        )
    from worker_core.embedded import start_embedded

    return start_embedded()


def run_demo(dsn: str, refresh: float = 1.0, workers: int = 2) -> int:
    """On ``dsn``, the demo's database (:func:`demo_dsn`) migrated (the CLI's demo command migrates it, and says
    what went wrong as `qconsole migrate` does): ``workers`` embedded workers on the demo tasks, a workload, and
    the console. Quitting stops everything it started."""
    from qconsole.app import run_console
    from qconsole.embedded_workers import EmbeddedWorkers

    launcher = EmbeddedWorkers(dsn)
    feeder = Feeder(dsn)
    try:
        for _ in range(workers):
            launcher.start([DEMO_TASKS], (), concurrency=4)
        feeder.start()
        return run_console(dsn, False, refresh, None, launcher=launcher, default_tasks=(DEMO_TASKS,))
    finally:
        feeder.stop()
        print("qconsole demo: stopping workers…", flush=True)
        launcher.stop_all()  # their whole stop: grace, cancel grace, settlement
        feeder.join(5)
