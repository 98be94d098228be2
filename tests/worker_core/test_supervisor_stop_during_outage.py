"""`qconsole worker --processes N` stopped (SIGTERM) while the database is away: the supervisor keeps trying to
end its dead workers' leases and record their stops a while, and says what it could not do, in a bounded time.

Observed (drill, `--processes 2`, the server stopped, then SIGTERM): the supervisor killed its children after
22 s ("did not stop in time"), logged "could not end the leases ... (tried again in 4 s)" and exited 0 at once,
without trying again: the workers read as lost and their jobs sat `running` until their leases ran out.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.worker_core.helpers import TASKS, FreezingProxy, config, in_thread, scalar, wait_for
from worker_core import db, enqueue
from worker_core.supervisor import END_AT_EXIT_EXTRA_SECONDS, Supervisor

GRACE = 1.0
#: the supervisor, its thread, what run() returned, its worker processes' ids
Supervised = tuple[Supervisor, threading.Thread, list[Any], list[str]]


@pytest.fixture
def held(conn: db.Conn) -> list[uuid.UUID]:
    """Long jobs with long leases: held by the workers until their stop (and 10 minutes more if not released)."""
    ids = [enqueue(conn, "t.slow", {"seconds": 120}, visibility_timeout_seconds=600).id for _ in range(4)]
    conn.commit()
    return ids


@pytest.fixture
def proxy(dsn: str) -> Iterator[FreezingProxy]:
    p = FreezingProxy.before(dsn, hang_ups=True)
    yield p
    p.cut()
    p.close()


@pytest.fixture
def supervised(
    dsn: str, held: list[uuid.UUID], proxy: FreezingProxy, caplog: pytest.LogCaptureFixture
) -> Iterator[Supervised]:
    """Two worker processes (2 slots each, nothing claimed ahead) through the proxy, both running jobs; stopped
    at the end whatever happens, with the database back (else they stop in an outage: slowly)."""
    sup = Supervisor(
        config(
            proxy.dsn, burst=False, task_modules=TASKS, concurrency=2, prefetch=0, shutdown_grace=GRACE,
            cancel_grace=1.0,
        ),
        processes=2,
    )  # fmt: skip
    caplog.set_level(logging.WARNING, logger="worker_core.supervisor")
    t, out = in_thread(sup.run)
    try:
        wait_for(lambda: len(sup.children) == 2, 30, what="the worker processes to start")
        ids = [worker_id for _, worker_id in sup.children.values()]
        # both hold jobs, their leases 10 minutes long
        wait_for(
            lambda: scalar(
                dsn,
                "SELECT count(DISTINCT locked_by) FROM job_queue WHERE state = 'running' AND locked_by = ANY(%s)",
                (ids,),
            ) == 2,
            60,
            what="both workers to run jobs",
        )  # fmt: skip
        yield sup, t, out, ids
    finally:
        proxy.restore()
        sup.stop()
        t.join(90)


def _leased(dsn: str, ids: list[str]) -> int:
    return int(
        scalar(
            dsn,
            "SELECT count(*) FROM job_queue WHERE state = 'running' AND locked_by = ANY(%s) AND locked_until > now()",
            (ids,),
        )
    )


def _not_stopped(dsn: str, ids: list[str]) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM workers WHERE id = ANY(%s) AND stopped_at IS NULL", (ids,)))


def test_a_supervisor_stopped_during_an_outage_ends_its_workers_leases_once_the_database_is_back(
    dsn: str, proxy: FreezingProxy, supervised: Supervised, caplog: pytest.LogCaptureFixture
) -> None:
    sup, t, out, ids = supervised
    try:
        proxy.cut()  # the database goes away
        sup.stop()  # SIGTERM
        # its workers are gone (stopped, or killed after the grace) and their leases could not be ended
        wait_for(
            lambda: (
                all(not p.is_alive() for p, _ in sup.children.values())
                and any("could not end the leases" in r.getMessage() for r in caplog.records)
            ),
            90,
            what="the workers to be gone and their leases not ended",
        )
        proxy.restore()  # the database is back, a moment later
        t.join(60)
        assert not t.is_alive(), "the supervisor did not exit"
    finally:
        proxy.restore()
    assert out == [0]
    # tried again, it ended them: their jobs are taken again at once, their workers read as stopped
    assert _leased(dsn, ids) == 0, "the dead workers' jobs are still leased to them"
    assert _not_stopped(dsn, ids) == 0, "the dead workers' stops were not recorded"
    assert not any(r.levelno >= logging.ERROR and "gave up" in r.getMessage() for r in caplog.records)


def test_a_supervisor_stopped_during_an_outage_that_lasts_exits_and_says_what_it_could_not_do(
    dsn: str, proxy: FreezingProxy, supervised: Supervised, caplog: pytest.LogCaptureFixture
) -> None:
    sup, t, out, ids = supervised
    try:
        proxy.cut()  # the database goes away, for good
        sup.stop()
        # bounded: the workers' grace, cancel grace and 10 s, then its own grace and a few seconds of tries
        bound = GRACE + 1.0 + 10 + 5 + GRACE + END_AT_EXIT_EXTRA_SECONDS
        t.join(bound + 60)
        assert not t.is_alive(), "the supervisor did not exit"
    finally:
        proxy.restore()
    assert out == [0]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "gave up" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert all(i in said[0] for i in ids), said  # which workers
    assert "until their leases run out" in said[0], said  # and what becomes of their jobs
    # as it said: nothing was ended (the database was away), their leases run out by themselves
    assert _leased(dsn, ids) > 0
