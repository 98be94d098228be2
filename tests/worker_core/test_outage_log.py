"""What a worker's log says through an outage (review drill 1): the first failure once, a reminder at most once a
minute while it lasts, an error of another kind at once, and when the database answers again. Before, the heartbeat
logged every failure in full at every beat (30 multi-line warnings a minute per worker at the default interval) and
nothing said when the database was back."""

from __future__ import annotations

import logging
import time

import psycopg
import pytest

from tests.worker_core.helpers import FreezingProxy, running_worker
from worker_core import execution
from worker_core.execution import RecurringFailure


def test_an_outage_is_not_logged_at_every_heartbeat_and_its_end_is_said(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="worker_core")
    proxy = FreezingProxy.before(dsn, hang_ups=True)
    try:
        with running_worker(proxy.dsn, heartbeat_interval=0.25):
            time.sleep(1.5)  # a few beats went through
            proxy.cut()
            outage_began = len(caplog.records)
            time.sleep(8.0)  # 32 beats' worth of outage
            during = caplog.records[outage_began:]
            proxy.restore()
            time.sleep(3.0)
            after = caplog.records[outage_began + len(during) :]
    finally:
        proxy.cut()
        proxy.close()
    beats = [r for r in during if r.levelno >= logging.WARNING and "heartbeat failed" in r.getMessage()]
    claims = [r for r in during if r.levelno >= logging.WARNING and "claim failed" in r.getMessage()]
    warnings = [r for r in during if r.levelno >= logging.WARNING]
    # one outage of 8 s: the first failure (and one of another kind, as the connection's loss turns into a refusal),
    # not one per beat nor one per claim's backoff
    assert 1 <= len(beats) <= 3, [r.getMessage() for r in beats]
    assert len(claims) <= 3, [r.getMessage() for r in claims]
    assert len(warnings) <= 12, [r.getMessage() for r in warnings]
    # and once it is back, the log says so, with how long it was away
    back = [r.getMessage() for r in after if r.levelno >= logging.INFO]
    assert any(m.startswith("heartbeat: database reachable again after ") for m in back), back


def test_a_recurring_failure_is_said_once_then_reminded_and_another_kind_is_never_hidden(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = logging.getLogger("worker_core.test_outage")
    caplog.set_level("INFO", logger="worker_core.test_outage")
    failures = RecurringFailure(log, "heartbeat")
    lost = psycopg.OperationalError("connection refused")
    for _ in range(20):
        failures.failed(lost, "connection refused\n\tIs the server running?")
    assert [r.getMessage() for r in caplog.records] == [
        "heartbeat failed: connection refused\n\tIs the server running? (said again once a minute while it fails)"
    ]
    # an error of another kind meanwhile (a statement timeout) is said at once, in full
    failures.failed(psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), "timeout")
    assert caplog.records[-1].getMessage().startswith("heartbeat failed: timeout")
    # the first kind again is not said again (already said), until the reminder is due
    failures.failed(lost, "connection refused\n\tIs the server running?")
    assert len(caplog.records) == 2
    # past the reminder's interval, a reminder: how long, how many tries
    monkeypatch.setattr(execution, "FAILURE_REMINDER_SECONDS", 0.0)
    failures.failed(lost, "connection refused\n\tIs the server running?")
    failures.failed(lost, "connection refused\n\tIs the server running?")
    reminder = caplog.records[-1].getMessage()
    assert reminder.startswith("heartbeat still failing after ") and "(24 tries failed): connection refused" in reminder
    assert "\n" not in reminder
    failures.succeeded()
    failures.succeeded()  # said once
    ends = [r.getMessage() for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(ends) == 1 and ends[0].startswith("heartbeat: database reachable again after "), ends
    assert ends[0].endswith("(24 tries failed)")
