"""An operator's reason is stored as one line of text: a pasted newline, a tab or an escape sequence typed
into the console's question or a CLI's --reason reached audit_log, concurrency_limits and a killed job's
error as typed (every display stripped them; --json, psql and log lines did not)."""

from __future__ import annotations

from worker_core import db, enqueue, ops

ME = ops.Actor("alice")
TYPED = "INC-7\n\x1b[31mdouble\x1b[0m\tcharges \x00"


def test_a_reason_is_stored_as_one_line_without_control_characters(conn: db.Conn) -> None:
    ops.pause(conn, "billing", actor=ME, reason=TYPED, allow_unknown=True)
    ops.set_limit(conn, "t.ok", 0, actor=ME, reason=TYPED, allow_unknown=True)
    job = enqueue(conn, "t.ok", {}).id
    ops.kill(conn, [job], actor=ME, reason=TYPED)
    reasons = [r["reason"] for r in conn.execute("SELECT reason FROM audit_log ORDER BY id").fetchall()]
    assert reasons == ["INC-7 double charges"] * 3
    assert conn.execute("SELECT reason FROM concurrency_limits").fetchone() == {"reason": "INC-7 double charges"}
    error = conn.execute("SELECT errors->-1->>'message' AS m FROM job_queue WHERE id = %s", (job,)).fetchone()
    assert error == {"m": "killed by alice: INC-7 double charges"}


def test_a_reason_of_control_characters_only_is_no_reason() -> None:
    assert ops.reason_text("\n\t \x1b[0m") is None
    assert ops.reason_text(None) is None
    assert ops.reason_text("  INC-8  ") == "INC-8"
