"""Replay from dead letters: requeue keeps the history, gives a fresh budget, changes nothing the operator
did not change, and a payload fix is recorded as a diff in the audit entry."""

from __future__ import annotations

from tests.worker_core.helpers import run_burst
from worker_core import db, ops, stats
from worker_core.ops import Actor, payload_diff
from worker_core.producer import enqueue


def test_payload_diff_by_path() -> None:
    old = {"customer": {"email": "a@x", "name": "A"}, "amount": 5, "gone": 1}
    new = {"customer": {"email": "a@example.com", "name": "A"}, "amount": 5, "added": True}
    assert payload_diff(old, new) == {
        "added": {"new": True},
        "customer.email": {"old": "a@x", "new": "a@example.com"},
        "gone": {"old": 1},
    }


def test_replay_after_a_fix_runs_once_with_history_and_a_fresh_budget(dsn: str, conn: db.Conn) -> None:
    jid = enqueue(
        conn, "t.ledger", {"item": "inv-9", "fail_after_write": 99}, idempotency_key="inv-9", max_attempts=2,
        trace_id="tr-9", priority=3,
    ).id  # fmt: skip
    run_burst(dsn)
    dead = stats.get_job(conn, jid)
    assert dead.state.value == "dead_lettered" and dead.attempts == 2 and len(dead.errors) == 2

    fixed = {"item": "inv-9"}
    result = ops.requeue(conn, [jid], actor=Actor("alice", "198.51.100.4"), reason="bad flag", budget=3, payload=fixed)
    assert result.changed == [jid]
    requeued = stats.get_job(conn, jid)
    assert (requeued.state.value, requeued.attempts, requeued.max_attempts) == ("queued", 2, 5)
    assert requeued.errors == dead.errors  # history kept
    # nothing else changed
    for field in ("job_type", "queue", "idempotency_key", "trace_id", "priority", "timeout_seconds", "retry_policy"):
        assert getattr(requeued, field) == getattr(dead, field)
    entry = stats.audit_log(conn, 1)[0]
    assert (entry.action, entry.os_user, entry.ssh_client, entry.reason) == (
        "requeue",
        "alice",
        "198.51.100.4",
        "bad flag",
    )
    assert entry.detail["payload_diff"] == {str(jid): {"fail_after_write": {"old": 99}}}

    run_burst(dsn)
    done = stats.get_job(conn, jid)
    assert done.state.value == "succeeded" and done.attempts == 3
    effects = conn.execute("SELECT count(*) AS n FROM ledger WHERE item = 'inv-9'").fetchone()
    assert effects == {"n": 1}  # the failed attempts rolled back; the fixed one ran once
