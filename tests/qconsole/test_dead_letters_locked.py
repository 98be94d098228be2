"""A dead-letter group's action pressed while the jobs table is locked (a migration, VACUUM FULL, LOCK TABLE):
said at once, and given up in seconds with what held it up, not asked ten minutes later unannounced."""

from __future__ import annotations

import time

from qconsole.screens.confirm import ConfirmScreen
from qconsole.screens.dead_letters import DeadLettersScreen
from tests.qconsole.pilot import opened, run_async, settle, until
from tests.qconsole.test_pilot import console, notes
from worker_core import db, stats
from worker_core.models import JobState


def test_a_group_action_behind_a_table_lock_is_said_at_once_and_given_up_in_seconds(dsn: str, conn: db.Conn) -> None:
    # found in review: the first r said nothing at all (no notice, nothing in the title bar) while the read
    # waited on the lock under the 10-minute action bound; when the lock went, the question popped up
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, finished_at, last_error, error_fingerprint)"
        " SELECT 't.ok', 'default', '{}', 'dead_lettered', now(), 'boom', 'boom' FROM generate_series(1, 3)"
    )
    app = console(dsn)
    locker = db.connect(dsn)

    async def scenario() -> None:
        async with app.run_test(size=(120, 30)) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "d", DeadLettersScreen)
            locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            await pilot.press("r")
            await pilot.pause(0.2)
            assert "Reading the jobs of 1 group(s), to ask…" in notes(app)
            await until(pilot, lambda: "could not be read: a lock" in notes(app), timeout=20, what="the give-up")
            assert time.monotonic() - started < 15  # the 5 s lock wait, not the 10-minute action bound
            assert "Nothing changed; r asks again." in notes(app)
            assert app.screen is screen and not screen.fetching
            locker.rollback()
            await pilot.press("r")  # and once the lock is gone, it asks
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the question")
            await pilot.press("n")
            await settle(pilot)

    try:
        run_async(scenario())
    finally:
        locker.close()
    assert [j.state for j in stats.list_jobs(conn, limit=10)] == [JobState.DEAD_LETTERED] * 3
    assert stats.audit_log(conn) == []
