"""The jobs list says when a job waiting for a time to come is due: enqueued for later, or a retry's backoff."""

from __future__ import annotations

from qconsole.screens.jobs import JobsScreen
from qconsole.widgets.table import LiveTable
from tests.qconsole.pilot import opened, run_async, settle
from tests.qconsole.test_pilot import SIZE, console
from worker_core import db
from worker_core.producer import enqueue


def test_the_jobs_list_says_when_a_delayed_job_and_a_retry_are_due(dsn: str, conn: db.Conn) -> None:
    # a job enqueued for in an hour read "· queued" as any other: the engineer looked for a lag that was not one
    later = enqueue(conn, "t.ok", {}, delay_seconds=3600).id
    now = enqueue(conn, "t.ok", {}).id
    retry = enqueue(conn, "t.ok", {}).id
    conn.execute(
        "UPDATE job_queue SET state = 'retry_scheduled', attempts = 1, scheduled_at = now() + interval '90 seconds'"
        " WHERE id = %s",
        (retry,),
    )
    conn.commit()
    app = console(dsn)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            screen = await opened(pilot, "j", JobsScreen)
            table = screen.query_one(LiveTable)
            state = {key: str(table.get_row(str(key))[1]).strip() for key in (later, now, retry)}
            assert state[now] == "· queued"
            assert state[later].startswith("· queued in 59m") or state[later] == "· queued in 1h00m", state
            assert state[retry].startswith("↻ retry in 1m2") or state[retry].startswith("↻ retry in 1m3"), state

    run_async(scenario())
