"""The job detail says why a waiting job has not started, the most pressing reason first, and what holds a running
job's expired lease back: against a real PostgreSQL whose rows (ids, times) are fixed, read at a frozen clock."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from textual.pilot import Pilot

from qconsole.app import QConsoleApp
from qconsole.backend import DatabaseBackend
from qconsole.screens.job_detail import JobDetailScreen
from tests.qconsole.conftest import T0, jid
from tests.qconsole.pilot import run_async, settle
from tests.qconsole.test_pilot import SIZE, console, screen_text
from worker_core import FixedClock, db, ops

CLOCK = FixedClock(T0)


class PinnedBackend(DatabaseBackend):
    """A real backend at the frozen clock, named as the pictures name it (each test's database has its own name)."""

    @property
    def description(self) -> str:
        return "postgresql://ops@db.internal:5432/jobs"


def app_on(dsn: str) -> QConsoleApp:
    return console(dsn, backend=PinnedBackend(dsn, clock=CLOCK), clock=CLOCK, theme="textual-dark")


def job(
    conn: db.Conn, n: int, job_type: str, queue: str = "default", *, due: float = -600, **columns: Any
) -> uuid.UUID:
    """Job ``jid(n)``, enqueued 15 minutes before T0, due ``due`` seconds from T0; other columns as given."""
    values = {"id": jid(n), "job_type": job_type, "queue": queue, "payload": f'{{"order_id": "ord_{n}"}}',
              "scheduled_at": T0 + dt.timedelta(seconds=due), "created_at": T0 - dt.timedelta(minutes=15),
              "updated_at": T0 - dt.timedelta(minutes=15), **columns}  # fmt: skip
    names = ", ".join(values)
    marks = ", ".join(f"%({k})s" for k in values)
    conn.execute(f"INSERT INTO job_queue ({names}) VALUES ({marks})", values)  # noqa: S608 (the test's own names)
    return jid(n)


def worker(conn: db.Conn, wid: str, tasks: list[str], queues: list[str] | None, beat: float) -> None:
    conn.execute(
        "INSERT INTO workers (id, host, pid, queues, tasks, concurrency, started_at, last_heartbeat_at)"
        " VALUES (%s, %s, %s, %s, %s, 4, %s, %s)",
        (wid, wid.split(":")[0], int(wid.split(":")[1]), queues, tasks, T0 - dt.timedelta(hours=2),
         T0 - dt.timedelta(seconds=beat)),
    )  # fmt: skip


@pytest.fixture
def scene(conn: db.Conn) -> dict[str, uuid.UUID]:
    """billing paused by alice (INC-7) and invoice.generate held everywhere by bob; its only worker lost 95 s ago. In
    default: report.build at its limit of 1 (one running), a report due in an hour and a retry in its backoff;
    email.send in line behind two, and one waiting on a lock key another job holds."""
    at = FixedClock(T0 - dt.timedelta(minutes=20))
    worker(conn, "web-1:4121", ["email.send", "report.build"], None, beat=1)
    worker(conn, "web-2:77", ["invoice.generate"], ["billing"], beat=95)
    ids = {
        "held": job(conn, 1, "invoice.generate", "billing"),
        "expired": job(conn, 2, "invoice.generate", "billing", state="running", attempts=1, locked_by="web-2:77",
                       locked_until=T0 - dt.timedelta(seconds=68), started_at=T0 - dt.timedelta(minutes=3)),
        "report_running": job(conn, 3, "report.build", state="running", attempts=1, locked_by="web-1:4121",
                              locked_until=T0 + dt.timedelta(seconds=50), started_at=T0 - dt.timedelta(seconds=40)),
        "limited": job(conn, 4, "report.build"),
        "later": job(conn, 5, "report.build", due=3540),
        "retry": job(conn, 6, "email.send", state="retry_scheduled", attempts=2, due=42),
        "ahead_1": job(conn, 7, "email.send", due=-900),
        "ahead_2": job(conn, 8, "email.send", priority=-1),
        "in_line": job(conn, 9, "email.send", due=-300),
        "lock_holder": job(conn, 10, "email.send", state="running", attempts=1, locked_by="web-1:4121",
                           lock_key="order:9", locked_until=T0 + dt.timedelta(seconds=80),
                           started_at=T0 - dt.timedelta(seconds=10)),
        "locked": job(conn, 11, "email.send", lock_key="order:9", due=-100),
    }  # fmt: skip
    ops.pause(conn, "billing", actor=ops.Actor("alice", "10.0.0.5"), reason="INC-7 double charges", clock=at)
    ops.set_limit(conn, "invoice.generate", 0, actor=ops.Actor("bob"), reason="until the PDF fix ships", clock=at)
    ops.set_limit(conn, "report.build", 1, queue="default", actor=ops.Actor("bob"), reason="db load", clock=at)
    conn.execute(
        "INSERT INTO resource_locks (lock_key, token, job_id, expires_at) VALUES ('order:9', 'tok', %s, %s)",
        (ids["lock_holder"], T0 + dt.timedelta(seconds=80)),
    )
    return ids


def detail_of(dsn: str, job_id: uuid.UUID, size: tuple[int, int] = SIZE) -> str:
    """The job's detail as the screen shows it (plain text, its lines joined)."""
    app = app_on(dsn)
    seen: dict[str, str] = {}

    async def scenario() -> None:
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            app.push_screen(JobDetailScreen(job_id))
            await settle(pilot)
            seen["text"] = screen_text(app)

    run_async(scenario())
    return seen["text"]


def flat(text: str) -> str:
    return " ".join(text.split())


def test_a_held_jobs_detail_says_first_its_paused_queue_then_its_limit_then_its_lost_worker(
    dsn: str, scene: dict[str, uuid.UUID]
) -> None:
    # 3 a.m.: a job "queued" for 25 minutes, and its detail said nothing of why (a pause, a limit of 0 and a dead
    # worker, each on another screen)
    text = detail_of(dsn, scene["held"])
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if "── why it waits" in line)
    assert flat(lines[first + 1]) == "paused ⏸ its queue billing is paused (by alice@10.0.0.5 20m00s ago: INC-7", text
    said = flat(text)
    assert said.index("paused ⏸") < said.index("limit ⏸") < said.index("workers ∅"), said
    assert "⏸ its type is held by a limit of 0 in every queue (set by bob 20m00s ago: until the PDF fix ships)" in said
    assert "∅ no live worker takes invoice.generate in billing; lost: web-2:77 (last heartbeat 1m35s ago)" in said
    assert "in line" not in said and "lease and lock" not in said


def test_each_reason_a_job_waits_is_said(dsn: str, scene: dict[str, uuid.UUID]) -> None:
    said = {name: flat(detail_of(dsn, scene[name], (120, 36))) for name in ("later", "retry", "limited", "in_line",
                                                                           "locked")}  # fmt: skip
    assert "due in 59m00s (10:25:53 UTC): enqueued for later" in said["later"], said["later"]
    assert "due in 42s (09:27:35 UTC): a retry, in its backoff after attempt 2 of 5 failed" in said["retry"]
    assert ("limit its type is at its limit, ≤1 in queue default, 1 running now (set by bob 20m00s ago: db load): it"
            " starts when one of them ends") in said["limited"]  # fmt: skip
    # one of the three ahead of it is a report.build (a worker that takes email.send only has two ahead of it)
    assert ("in line 3 job(s) ahead of it in default, 2 of them email.send; the claim order: priority, lowest first,"
            " then due time") in said["in_line"], said["in_line"]  # fmt: skip
    assert (f"lock order:9 held by job {str(jid(10))[:8]} (email.send, running) until 09:28:13 UTC (expires in 1m20s):"
            " this job waits for it; a worker that claims it gives it back (lock contention)") in said["locked"]
    for name in ("later", "retry", "limited", "locked"):
        assert "in line" not in said[name], said[name]  # said only when nothing else holds it


def test_an_expired_lease_in_a_paused_queue_is_said_to_be_held_until_the_queue_is_resumed(
    dsn: str, scene: dict[str, uuid.UUID]
) -> None:
    # "EXPIRED … only an idle worker reclaims it": no worker does in a paused queue (claim_solo skips it there)
    said = flat(detail_of(dsn, scene["expired"], (120, 36)))
    assert "lease EXPIRED 1m08s ago (held by web-2:77, ✗ LOST since" in said, said
    assert ("⏸ its queue billing is paused: no worker reclaims it until it is resumed (qconsole resume billing); a kill"
            " still ends it; ⏸ its type is held by a limit of 0") in said, said
    assert "only an idle worker reclaims it" not in said and "why it waits" not in said


def test_a_held_jobs_detail_at_80x24(snap_compare: Any, dsn: str, scene: dict[str, uuid.UUID]) -> None:
    async def open_it(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        pilot.app.push_screen(JobDetailScreen(scene["held"]))
        await settle(pilot)

    assert snap_compare(app_on(dsn), terminal_size=SIZE, run_before=open_it)
