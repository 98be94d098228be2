"""`qconsole job ID` says why a waiting job has not started (and `--json` its reasons), and what holds a running
job's expired lease back: a paused queue, a limit with no room."""

from __future__ import annotations

import json
from typing import Any

from tests.cli.test_cli import cli  # noqa: F401  (the fixture)
from worker_core import db, ops


def flat(text: str) -> str:
    return " ".join(text.split())


def test_job_says_why_it_waits_the_most_pressing_reason_first(cli: Any, conn: db.Conn) -> None:  # noqa: F811
    # `qconsole job` of a job queued for 25 minutes said its state, nothing of the pause, the limit of 0 and the dead
    # worker behind it
    held = cli("enqueue", "invoice.generate", "--queue", "billing", "--idempotency-key", "inv:1").stdout.strip()
    conn.execute(
        "INSERT INTO workers (id, host, pid, queues, tasks, concurrency, last_heartbeat_at) VALUES ('web-2:77',"
        " 'web-2', 77, '{billing}', '{invoice.generate}', 4, now() - interval '95 seconds')"
    )
    ops.pause(conn, "billing", actor=ops.Actor("alice", "10.0.0.5"), reason="INC-7 double charges")
    ops.set_limit(conn, "invoice.generate", 0, actor=ops.Actor("bob"), reason="until the PDF fix ships")
    out = cli("job", held).stdout
    lines = [flat(line) for line in out.splitlines()]
    state = next(i for i, line in enumerate(lines) if line.startswith("state "))
    assert lines[state + 1].startswith("paused ⏸ its queue billing is paused (by alice@10.0.0.5 "), out
    assert lines[state + 1].endswith(
        "ago: INC-7 double charges): no worker claims from it until it is resumed (qconsole resume billing)"
    ), out
    assert lines[state + 2].startswith("limit ⏸ its type is held by a limit of 0 in every queue (set by bob "), out
    assert lines[state + 3].startswith(
        "workers ∅ no live worker takes invoice.generate in billing; lost: web-2:77 (last heartbeat 1m3"
    ), out
    said = json.loads(cli("job", held, "--json").stdout)["waiting"]
    assert said["reasons"] == ["queue_paused", "type_limit", "no_live_worker"]
    assert (said["paused"]["changed_by"], said["paused"]["reason"]) == ("alice@10.0.0.5", "INC-7 double charges")
    [limit] = said["limits"]
    assert (limit["queue"], limit["max_running"], limit["running"], limit["set_by"]) == ("*", 0, 0, "bob")
    assert [w["id"] for w in said["lost_workers"]] == ["web-2:77"] and said["live_workers"] == []
    # resumed, the limit lifted, a live worker of every queue: it is in line, behind the jobs due before it
    ops.resume(conn, "billing", actor=ops.Actor("alice"))
    ops.clear_limit(conn, "invoice.generate", actor=ops.Actor("bob"))
    conn.execute(
        "INSERT INTO workers (id, host, pid, tasks, concurrency) VALUES ('web-1:41', 'web-1', 41,"
        " '{invoice.generate}', 4)"
    )
    behind = cli("enqueue", "invoice.generate", "--queue", "billing", "--idempotency-key", "inv:2").stdout.strip()
    cli("enqueue", "t.ok", "--queue", "billing", "--priority", "-1")
    assert "in line 2 job(s) ahead of it in billing, 1 of them invoice.generate; the claim order" in flat(
        cli("job", behind).stdout
    )
    said = json.loads(cli("job", behind, "--json").stdout)["waiting"]
    assert (said["reasons"], said["ahead"], said["ahead_of_type"], said["ahead_more"]) == (["in_line"], 2, 1, False)
    assert json.loads(cli("job", held, "--json").stdout)["waiting"]["ahead"] == 1  # the t.ok of priority -1


def test_job_says_when_a_retry_is_due(cli: Any, conn: db.Conn) -> None:  # noqa: F811
    retry = cli("enqueue", "t.ok").stdout.strip()
    conn.execute(
        "UPDATE job_queue SET state = 'retry_scheduled', attempts = 2, scheduled_at = now() + interval '42 seconds'"
        " WHERE id = %s",
        (retry,),
    )
    text = flat(cli("job", retry).stdout)
    assert "due in 4" in text and "UTC): a retry, in its backoff after attempt 2 of 5 failed" in text, text
    assert json.loads(cli("job", retry, "--json").stdout)["waiting"]["reasons"][0] == "due_later"
    finished = cli("enqueue", "t.ok").stdout.strip()
    conn.execute("UPDATE job_queue SET state = 'succeeded', finished_at = now() WHERE id = %s", (finished,))
    assert json.loads(cli("job", finished, "--json").stdout)["waiting"] is None


def test_an_expired_lease_in_a_paused_queue_is_said_to_be_held_back(cli: Any, conn: db.Conn) -> None:  # noqa: F811
    # "expired 14s ago: only an idle worker reclaims it" of a job whose queue was paused: claim_solo skips it there
    job = cli("enqueue", "t.ok", "--queue", "billing").stdout.strip()
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'vm:1:a',"
        " locked_until = now() - interval '14 seconds' WHERE id = %s",
        (job,),
    )
    ops.pause(conn, "billing", actor=ops.Actor("alice"), reason="INC-7")
    text = flat(cli("job", job).stdout)
    assert ("ago: ⏸ its queue billing is paused: no worker reclaims it until it is resumed (qconsole resume billing); a"
            " kill still ends it") in text, text  # fmt: skip
    assert "only an idle worker reclaims it" not in text
    holder = json.loads(cli("job", job, "--json").stdout)["lease_holder"]
    assert (holder["expired_lease_next"], holder["expired_lease_held_by"]) == ("run_alone", ["queue_paused"])
    ops.resume(conn, "billing", actor=ops.Actor("alice"))
    assert "only an idle worker reclaims it, and runs it alone as a suspect (claim_solo" in flat(cli("job", job).stdout)
