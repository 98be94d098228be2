"""A settlement whose COMMIT went through and whose answer was lost with the connection (the server restarted, or
the network cut, between the commit and its answer), review drill 1.

The batch completer tried its batch again on a new connection, found its rows no longer running (settled, by that
very commit) and took them for jobs killed or taken over by another worker: `lease lost to another worker` was said
of jobs this worker settled, and their success was never counted (job_metrics_minute.succeeded: what `qconsole
stats`, the console and the Prometheus exporter show). A group's commit had the same: its jobs were "given back",
their release refused by the fence, "no longer held by this worker". What the row says decides now: succeeded, by
this worker, at this attempt (queries.sql settled_here) is our own lost answer, counted once."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

import tests.worker_core.tasks  # noqa: F401
from tests.worker_core.helpers import FreezingProxy, metric, running_worker, scalar, wait_for


@pytest.mark.parametrize("path", ["completer", "group", "alone"])
def test_jobs_settled_by_a_commit_whose_answer_was_lost_are_counted_once_and_not_said_lost(
    dsn: str, make_job: Callable[..., uuid.UUID], caplog: pytest.LogCaptureFixture, path: str
) -> None:
    caplog.set_level("INFO", logger="worker_core")
    if path == "completer":  # no ctx.tx, no idempotency key: the batch completer settles them
        jobs = [make_job("t.ok", {"n": i}) for i in range(20)]
        marker = b"settle_succeeded_many for the completer"
    else:  # writes through ctx.tx with an idempotency key: the slot's group commit settles them, or its own
        jobs = [make_job("t.ledger", {"item": str(i)}, idempotency_key=f"t.ledger:{i}") for i in range(20)]
        marker = b"settle_succeeded_many for a group's commit"
    if path == "alone":  # each job in a transaction of its own (group_max=1): settle_succeeded, then COMMIT
        marker = b"A job an operator killed is refused its success"
    proxy = FreezingProxy.before(dsn, hang_ups=True)
    # the settling statement (its text is sent while it is not yet prepared: the first batches)
    proxy.lose_commit_after = marker
    try:
        group_max = 1 if path == "alone" else 10
        with running_worker(proxy.dsn, concurrency=4, heartbeat_interval=0.5, group_max=group_max):
            wait_for(lambda: scalar(dsn, "SELECT count(*) FROM job_queue WHERE state = 'succeeded'") == len(jobs),
                     timeout=60, what="every job settled")  # fmt: skip
        assert proxy.commits_lost >= 1
    finally:
        proxy.cut()
        proxy.close()
    messages = [r.getMessage() for r in caplog.records]
    lost = [m for m in messages if "lease lost" in m or "no longer held" in m]
    counted = metric(dsn, "succeeded")
    assert (counted, lost) == (len(jobs), []), f"{len(jobs)} jobs succeeded, {counted} counted"
    if path != "completer":
        assert scalar(dsn, "SELECT count(*) FROM ledger") == len(jobs), "an effect twice, or lost"
        assert any(m.startswith("its settlement had committed") for m in messages), messages
    else:
        assert any(m.startswith("completer: ") and "answer was lost" in m for m in messages), messages
    # every job ran once, at its first attempt (none was run again as if given back)
    assert scalar(dsn, "SELECT count(*) FROM job_queue WHERE attempts = 1") == len(jobs)
