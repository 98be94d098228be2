"""The ``qconsole`` CLI against a real database: every envelope flag, exit codes, reading and operating."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from typer.testing import CliRunner

from qconsole.cli import app
from worker_core import db, ops, stats

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("QCONSOLE_DSN", dsn)
    monkeypatch.delenv("SSH_CLIENT", raising=False)
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> Any:
        result = runner.invoke(app, list(args))
        assert result.exit_code == code, f"exit {result.exit_code}: {result.output}"
        return result

    return run


def count_jobs(conn: db.Conn) -> int:
    row = conn.execute("SELECT count(*) AS n FROM job_queue").fetchone()
    assert row is not None
    return int(row["n"])


def test_enqueue_takes_every_envelope_field(cli: Any, conn: db.Conn) -> None:
    out = cli(
        "enqueue", "invoice.generate", "--payload", '{"order_id": "ord_987"}', "--queue", "billing",
        "--idempotency-key", "invoice:ord_987", "--dedup-key", "dd:ord_987", "--lock-key", "order:ord_987",
        "--priority", "3", "--delay", "60", "--max-attempts", "7", "--timeout", "20", "--visibility-timeout", "40",
        "--retry-policy", '{"backoff": "linear", "base_seconds": 4}', "--tenant", "acme", "--trace-id", "tr-1",
    ).stdout.strip()  # fmt: skip
    job = stats.get_job(conn, out)
    assert (job.job_type, job.queue, job.payload) == ("invoice.generate", "billing", {"order_id": "ord_987"})
    assert (job.idempotency_key, job.dedup_key, job.lock_key) == ("invoice:ord_987", "dd:ord_987", "order:ord_987")
    assert (job.priority, job.max_attempts, job.timeout_seconds, job.visibility_timeout_seconds) == (3, 7, 20, 40)
    assert job.retry_policy["backoff"] == "linear" and job.retry_policy["base_seconds"] == 4
    assert (job.tenant_id, job.trace_id, job.state.value, job.attempts) == ("acme", "tr-1", "queued", 0)
    assert 59 <= (job.scheduled_at - job.created_at).total_seconds() <= 61


def test_enqueue_takes_an_absolute_time_with_its_zone_and_refuses_one_without(cli: Any, conn: db.Conn) -> None:
    # the envelope's scheduled_at had no flag: a runbook could only say "in N seconds"
    out = cli("enqueue", "t.ok", "--scheduled-at", "2031-05-06T02:00:00Z").stdout.strip()
    assert stats.get_job(conn, out).scheduled_at == dt.datetime(2031, 5, 6, 2, tzinfo=dt.timezone.utc)
    out = cli("enqueue", "t.ok", "--scheduled-at", "2031-05-06 04:00:00+02:00").stdout.strip()
    assert stats.get_job(conn, out).scheduled_at == dt.datetime(2031, 5, 6, 2, tzinfo=dt.timezone.utc)
    before = count_jobs(conn)
    assert "no time zone" in cli("enqueue", "t.ok", "--scheduled-at", "2031-05-06T02:00", code=2).output
    assert "not an ISO 8601 time" in cli("enqueue", "t.ok", "--scheduled-at", "tomorrow", code=2).output
    assert "not both" in cli("enqueue", "t.ok", "--scheduled-at", "2031-05-06T02:00Z", "--delay", "5", code=2).output
    assert count_jobs(conn) == before


def test_enqueue_reports_a_duplicate_of_a_live_job(cli: Any) -> None:
    first = cli("enqueue", "t.ok", "--dedup-key", "k").stdout.strip()
    second = cli("enqueue", "t.ok", "--dedup-key", "k").stdout.strip()
    assert uuid.UUID(first)
    assert second == f"duplicate of {first}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["Bad Type"], "job_type"),
        ([""], "job_type is required"),
        (["t.ok", "--payload", "[1, 2]"], "JSON object"),
        (["t.ok", "--payload", "{oops"], "not valid JSON"),
        (["t.ok", "--payload", json.dumps({"x": "a" * 300_000})], "over the limit"),
        (["t.ok", "--max-attempts", "0"], "max_attempts"),
        (["t.ok", "--timeout", "30", "--visibility-timeout", "32"], "visibility_timeout_seconds"),
        (["t.ok", "--timeout", "0"], "timeout_seconds must be > 0"),
        (["t.ok", "--delay", "-1"], "delay_seconds must not be negative"),
        (["t.ok", "--idempotency-key", "run-2026-11-29T03:00"], "timestamp"),
        (["t.ok", "--retry-policy", '{"backoff": "sometimes"}'], "backoff"),
    ],
)
def test_bad_envelopes_exit_2_and_write_nothing(cli: Any, conn: db.Conn, args: list[str], message: str) -> None:
    result = cli("enqueue", *args, code=2)
    assert message in result.output
    assert count_jobs(conn) == 0


@pytest.mark.parametrize(
    ("args", "problems"),
    [
        (["--payload", "[1]", "--max-attempts", "0"], ["--payload must be a JSON object", "max_attempts"]),
        (["--payload", "{oops", "--timeout", "0"], ["--payload is not valid JSON", "timeout_seconds must be > 0"]),
        (["--scheduled-at", "2026-12-01T02:00:00", "--max-attempts", "0"], ["has no time zone", "max_attempts"]),
        (["--scheduled-at", "tomorrow", "--delay", "5"], ["not an ISO 8601 time", "not both"]),
        (["--retry-policy", "[]", "--priority", "5000"], ["--retry-policy must be a JSON object", "priority"]),
        (["--visibility-timeout=-5", "--timeout=0"], ["timeout_seconds must be > 0", "visibility_timeout_seconds"]),
    ],
    ids=["payload-not-object", "payload-not-json", "time-without-zone", "bad-time-and-delay", "retry-policy", "lease"],
)  # fmt: skip
def test_a_bad_envelope_lists_every_problem_at_once(
    cli: Any, conn: db.Conn, args: list[str], problems: list[str]
) -> None:
    # a bad --payload or --scheduled-at exited at once and hid a --max-attempts 0 beside it; a refused timeout hid
    # a negative lease
    out = cli("enqueue", "t.ok", *args, code=2).output
    listed = [line[4:] for line in out.splitlines() if line.startswith("  - ")]
    assert len(listed) == len(problems), out
    for problem, line in zip(problems, listed, strict=True):
        assert problem in line, out
    assert count_jobs(conn) == 0


def test_a_bad_envelope_is_bad_input_with_the_database_out_of_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    # the rest of the envelope is judged under the type's registered contract, in the database: unreachable,
    # the problems the flags show are still said, exit 2 (a script does not retry bad input as an outage)
    monkeypatch.setenv("QCONSOLE_DSN", "postgresql://nobody@127.0.0.1:1/nowhere?connect_timeout=2")
    result = CliRunner().invoke(app, ["enqueue", "t.ok", "--payload", "[1]", "--max-attempts", "0"])
    assert result.exit_code == 2, result.output
    assert "cannot connect" in result.output and "--payload must be a JSON object" in result.output
    assert "the other fields were not checked" in result.output
    plain = CliRunner().invoke(app, ["enqueue", "t.ok", "--max-attempts", "0"])
    assert plain.exit_code == 3 and "cannot connect" in plain.output, plain.output  # judged in the database alone


def test_reading_commands(cli: Any, conn: db.Conn) -> None:
    jid = cli("enqueue", "t.ok", "--payload", '{"n": 1}', "--queue", "q1").stdout.strip()
    cli("enqueue", "t.other", "--queue", "q2")
    listed = json.loads(cli("jobs", "--queue", "q1", "--json").stdout)
    assert [j["id"] for j in listed] == [jid]
    assert json.loads(cli("jobs", "--state", "queued", "--json").stdout).__len__() == 2
    assert json.loads(cli("jobs", "--search", jid[:8], "--json").stdout)[0]["id"] == jid
    detail = json.loads(cli("job", jid, "--json").stdout)
    assert detail["payload"] == {"n": 1} and detail["state"] == "queued" and detail["errors"] == []
    ov = json.loads(cli("stats", "--json").stdout)
    by_type = {t["job_type"]: t for t in ov["types"]}
    assert by_type["t.ok"]["queued"] == 1 and by_type["t.ok"]["queue"] == "q1"
    assert "t.ok" in cli("stats").stdout
    cli("job", str(uuid.uuid4()), code=1)
    cli("job", "not-a-uuid", code=2)  # bad input, as kill and requeue say it
    cli("jobs", "--state", "sleeping", code=2)


def test_jobs_next_lists_the_head_of_the_queue_first(cli: Any) -> None:
    # newest activity first only: the job behind a lag was past any --limit in a backlog
    urgent = cli("enqueue", "t.ok", "--priority", "-5").stdout.strip()
    later = cli("enqueue", "t.ok").stdout.strip()
    assert [j["id"] for j in json.loads(cli("jobs", "--json").stdout)] == [later, urgent]
    assert [j["id"] for j in json.loads(cli("jobs", "--next", "--json").stdout)] == [urgent, later]
    assert "not with --search" in cli("jobs", "--next", "--search", "x", code=2).output


def test_jobs_after_reads_the_next_page(cli: Any, conn: db.Conn) -> None:
    # --limit alone reached the first page only: the middle of a backlog was out of the CLI's reach
    ids = [cli("enqueue", "t.ok", "--priority", str(i % 2)).stdout.strip() for i in range(5)]
    for order in ([], ["--next"]):
        whole = [j["id"] for j in json.loads(cli("jobs", *order, "--json").stdout)]
        assert sorted(whole) == sorted(ids)
        first = cli("jobs", *order, "--limit", "2", "--json")
        page = [j["id"] for j in json.loads(first.stdout)]  # stdout holds the rows alone
        assert page == whole[:2] and f"--after {page[-1]}" in first.stderr
        seen = list(page)
        while page:
            result = cli("jobs", *order, "--limit", "2", "--after", seen[-1], "--json")
            page = [j["id"] for j in json.loads(result.stdout)]
            seen += page
            assert ("--after" in result.stderr) == (len(page) == 2)
        assert seen == whole
    text = cli("jobs", "--limit", "2", "--after", ids[0]).stdout  # the table
    assert "job(s)" in text
    assert "not paged" in cli("jobs", "--search", "x", "--after", ids[0], code=2).output
    assert "not a job id" in cli("jobs", "--after", "nope", code=2).output
    assert "no job" in cli("jobs", "--after", str(uuid.uuid4()), code=1).output


def test_operator_actions_are_audited_with_user_and_ssh_client(
    cli: Any, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSH_CLIENT", "203.0.113.7 52100 22")
    jid = cli("enqueue", "t.ok").stdout.strip()
    assert "1 of 1" in cli("kill", jid, "--reason", "bad deploy").stdout
    assert stats.get_job(conn, jid).state.value == "cancelled"
    assert "1 of 1" in cli("requeue", jid, "--payload", '{"fixed": true}').stdout
    job = stats.get_job(conn, jid)
    assert job.state.value == "queued" and job.payload == {"fixed": True}
    assert "skipped" in cli("requeue", jid, code=1).stdout  # queued: nothing to requeue, refused
    cli("pause", "default", "--reason", "incident 42")
    assert [q.paused for q in stats.queues(conn) if q.name == "default"] == [True]
    cli("resume", "default")
    audit = json.loads(cli("audit", "--json").stdout)
    assert [a["action"] for a in audit] == ["resume", "pause", "requeue", "requeue", "kill"]
    assert {a["ssh_client"] for a in audit} == {"203.0.113.7"}
    assert all(a["os_user"] for a in audit)
    kill = audit[-1]
    assert kill["job_ids"] == [jid] and kill["reason"] == "bad deploy"
    assert audit[-2]["detail"]["payload"] == {"fixed": True}


def test_unreachable_database_exits_3_without_leaking_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cr3t-pa55"
    monkeypatch.setenv("QCONSOLE_DSN", f"postgresql://qc:{secret}@127.0.0.1:1/nowhere?connect_timeout=2")
    result = CliRunner().invoke(app, ["jobs"])
    assert result.exit_code == 3
    assert "cannot connect" in result.output
    assert secret not in result.output


def test_read_only_commands_cannot_write(cli: Any, conn: db.Conn, dsn: str) -> None:
    jid = cli("enqueue", "t.ok").stdout.strip()
    with db.connect(dsn, read_only=True, autocommit=True) as ro:
        from worker_core import ops
        from worker_core.errors import ReadOnlyError

        with pytest.raises(ReadOnlyError):
            ops.kill(ro, [jid])
        import psycopg

        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            ro.execute("UPDATE job_queue SET state = 'cancelled'")
    assert stats.get_job(conn, jid).state.value == "queued"


@pytest.mark.slow
def test_mixed_workload_through_the_cli_reaches_the_right_final_states(dsn: str, conn: db.Conn) -> None:
    """The issue's "done when": enqueue a mixed workload with the CLI, run `worker --processes 2 --burst`."""
    conn.execute("CREATE TABLE ledger (id serial, job_id uuid, item text, attempt int)")
    env = {**os.environ, "QCONSOLE_DSN": dsn, "PYTHONPATH": str(ROOT)}

    def q(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "qconsole", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    t = ("--tasks", "tests.worker_core.tasks")
    ok = [q("enqueue", "t.ok", "--payload", json.dumps({"ledger": True, "item": f"ok{i}"}), *t) for i in range(8)]
    flaky = [q("enqueue", "t.flaky", "--payload", json.dumps({"fail_times": 2, "ledger": True, "item": f"f{i}"}), *t)
             for i in range(3)]  # fmt: skip
    permanent = q("enqueue", "t.permanent", *t)
    unknown = q("enqueue", "t.unknown", *t)
    crash = q("enqueue", "t.crash", *t)
    idem = [q("enqueue", "t.ledger", "--payload", '{"item": "inv-1"}', "--idempotency-key", "inv-1", *t)
            for _ in range(3)]  # fmt: skip
    dedup_first = q("enqueue", "t.ok", "--dedup-key", "same", *t)
    assert q("enqueue", "t.ok", "--dedup-key", "same", *t) == f"duplicate of {dedup_first}"

    q("worker", *t, "--processes", "2", "--burst", "--poll-interval", "0.1", "--heartbeat", "0.3")

    def state(jid: str) -> str:
        return stats.get_job(conn, jid).state.value

    assert {state(j) for j in [*ok, *flaky, *idem, dedup_first]} == {"succeeded"}
    assert state(permanent) == "failed"
    assert state(unknown) == "dead_lettered"
    assert state(crash) == "dead_lettered"
    assert stats.get_job(conn, crash).attempts == 2  # max_attempts restarts, no more
    assert all(stats.get_job(conn, j).attempts == 3 for j in flaky)
    rows = conn.execute("SELECT item, count(*) AS n FROM ledger GROUP BY item").fetchall()
    assert {r["item"]: r["n"] for r in rows} == {**{f"ok{i}": 1 for i in range(8)}, **{f"f{i}": 1 for i in range(3)},
                                                 "inv-1": 1}  # fmt: skip
    live = conn.execute("SELECT count(*) AS n FROM job_queue WHERE state IN ('queued', 'running', 'retry_scheduled')")
    assert live.fetchone() == {"n": 0}


def test_worker_group_flag_sets_how_many_jobs_share_a_transaction(
    cli: Any, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker_core.worker as worker_module

    seen: list[Any] = []
    real = worker_module.run_worker

    def observed(config: Any, registry: Any = None) -> int:
        seen.append(config)
        return real(config, registry)  # the real worker, on the real database

    monkeypatch.setattr(worker_module, "run_worker", observed)
    cli("enqueue", "t.ok", "--tasks", "tests.worker_core.tasks")
    cli("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--poll-interval", "0.1", "--group", "1")
    cli("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--poll-interval", "0.1")
    assert [c.group_max for c in seen] == [1, 32]
    assert conn.execute("SELECT state FROM job_queue").fetchall() == [{"state": "succeeded"}]
    cli("worker", "--tasks", "tests.worker_core.tasks", "--group", "0", code=2)


def test_requeue_refuses_a_payload_or_budget_enqueue_would_refuse_and_changes_nothing(cli: Any, conn: db.Conn) -> None:
    jid = cli("enqueue", "t.ok").stdout.strip()
    cli("kill", jid)
    for bad in ('{"a": NaN}', '{"s": "\\u0000"}', '{"s": "\\ud800"}', '{"big": "' + "x" * 300_000 + '"}'):
        result = cli("requeue", jid, "--payload", bad, code=2)
        assert "payload" in result.output
    for budget in ("100000", "3000000000"):
        assert "budget" in cli("requeue", jid, "--budget", budget, code=2).output
    job = stats.get_job(conn, jid)
    assert job.state.value == "cancelled" and job.payload == {}
    assert [a.action for a in stats.audit_log(conn)] == ["kill"]


def test_requeue_writes_one_payload_into_many_jobs_only_when_told_to(cli: Any, conn: db.Conn) -> None:
    # `requeue ID1 ID2 --payload X` wrote X into both: their own payloads were gone (but for the audit's diff)
    from worker_core import ops

    ids = [cli("enqueue", "t.ok", "--payload", json.dumps({"order": n})).stdout.strip() for n in (1, 2)]
    cli("kill", *ids)
    out = cli("requeue", *ids, "--payload", '{"fixed": true}', code=2).output
    assert "each of the 2 jobs" in out and "--same-payload" in out
    with pytest.raises(ValueError, match="same_payload"):
        ops.requeue(conn, ids, payload={"fixed": True})
    assert [(stats.get_job(conn, j).state.value, stats.get_job(conn, j).payload) for j in ids] == [
        ("cancelled", {"order": 1}),
        ("cancelled", {"order": 2}),
    ]
    assert [a.action for a in stats.audit_log(conn)] == ["kill"]  # nothing audited for the refusal
    cli("requeue", ids[0], ids[0], "--payload", '{"order": 10}')  # one job, named twice
    assert "1 of 1" in cli("requeue", ids[1], "--payload", '{"order": 20}', "--same-payload").stdout
    cli("kill", *ids)
    assert "2 of 2" in cli("requeue", *ids, "--payload", '{"fixed": true}', "--same-payload").stdout
    assert [stats.get_job(conn, j).payload for j in ids] == [{"fixed": True}] * 2


def test_limit_and_migrate_errors_are_messages_and_exit_codes(cli: Any, conn: db.Conn) -> None:
    assert "check its spelling" in cli("limit", "t.nope", "0", code=2).output
    assert "between 0 and" in cli("limit", "t.ok", "3000000000", "--unknown-type", code=2).output
    assert "at most 0 running" in cli("limit", "t.new", "0", "--unknown-type").output
    conn.execute("UPDATE worker_core_migrations SET checksum = 'x' WHERE version = 1")
    conn.commit()
    assert "forward-only" in cli("migrate", code=3).output
    # other commands go on (an operator's command in an incident), but say it
    result = cli("jobs", "--json")
    assert "warning: migrations 0001_init differ" in result.stderr and json.loads(result.stdout) is not None
    # a worker does not start on it (it said so, and started)
    refused = cli("worker", "--tasks", "tests.worker_core.tasks", "--burst", code=3)
    assert "its workers refuse to start" in refused.output


def test_enqueue_with_a_task_module_that_does_not_import_is_bad_input(cli: Any) -> None:
    # a 44-line traceback and exit 1
    assert "cannot import task module" in cli("enqueue", "t.ok", "--tasks", "no_such_module_here", code=2).output


def test_data_is_printed_as_text_never_as_markup_or_escape_sequences(cli: Any, conn: db.Conn) -> None:
    """A reason like ``[/var full]`` is Rich markup syntax: printed as markup it raised MarkupError (the
    audit unreadable until the row was gone); a job's error reached the terminal with its escapes."""
    cli("pause", "default", "--reason", "INC-7 [/var full] [bold]x")
    out = cli("audit").stdout
    assert "INC-7 [/var full] [bold]x" in out
    jid = cli("enqueue", "t.ok").stdout.strip()
    conn.execute(
        "UPDATE job_queue SET last_error = %s, payload = %s WHERE id = %s",
        ("boom \x1b]0;pwned\x07\x1b[31m[red]red[/red]", '{"k": "\u009b2J"}', jid),
    )
    for args in (("jobs",), ("job", jid)):
        text = cli(*args).stdout
        assert "\x1b" not in text and "\u009b" not in text and "pwned" not in text
    assert "[red]red[/red]" in cli("jobs").stdout


def test_dsn_and_read_only_given_before_the_subcommand_hold_for_it(
    cli: Any, conn: db.Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qconsole --dsn X kill ...` acted on $QCONSOLE_DSN's database; `qconsole --read-only pause` paused."""
    jid = cli("enqueue", "t.ok").stdout.strip()
    monkeypatch.setenv("QCONSOLE_DSN", "postgresql://nobody@127.0.0.1:1/nowhere?connect_timeout=2")
    assert json.loads(cli("--dsn", dsn, "jobs", "--json").stdout)[0]["id"] == jid
    assert "read-only mode" in cli("--dsn", dsn, "--read-only", "pause", "default", code=1).output
    assert "read-only mode" in cli("--dsn", dsn, "--read-only", "kill", jid, code=1).output
    assert "read-only mode" in cli("--dsn", dsn, "--read-only", "migrate", code=1).output
    assert json.loads(cli("--dsn", dsn, "--read-only", "job", jid, "--json").stdout)["state"] == "queued"
    assert [q.paused for q in stats.queues(conn) if q.name == "default"] == [False]
    assert "1 of 1" in cli("--dsn", dsn, "kill", jid).stdout
    cli("jobs", code=3)  # the option held for that run only: here $QCONSOLE_DSN again


@pytest.mark.parametrize("args", [[], ["stats"]], ids=["console", "subcommand"])
def test_an_unknown_theme_is_bad_input_said_before_connecting(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    # `qconsole --theme no-such-theme` was ignored: the console opened (its notice said it only once open), and
    # a subcommand ran, exit 0. A database that cannot be reached: the theme is refused first
    monkeypatch.setenv("QCONSOLE_DSN", "postgresql://app:Secr3t%PW@127.0.0.1/db")
    result = CliRunner().invoke(app, ["--theme", "no-such-theme", *args])
    assert result.exit_code == 2, result.output
    assert "unknown theme 'no-such-theme'" in result.output and "textual-dark" in result.output, result.output
    assert "cannot connect" not in result.output


def test_clearing_a_limit_that_does_not_exist_is_an_error_not_a_silent_success(cli: Any, conn: db.Conn) -> None:
    cli("enqueue", "t.ok")
    cli("limit", "t.ok", "0", "--reason", "incident")
    out = cli("limit", "t.okk", "--clear", code=1).output
    assert "no limit on 't.okk'" in out
    out = cli("limit", "t.ok", "--clear", "--queue", "billing", code=1).output
    assert "its limits are t.ok in *" in out
    assert [a.action for a in stats.audit_log(conn)] == ["limit"]  # the refused clears wrote nothing
    cli("limit", "t.ok", "--clear")
    assert stats.limits(conn) == []


def test_the_audit_names_who_ran_sudo(cli: Any, conn: db.Conn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUDO_USER", "alice")
    cli("pause", "default")
    assert stats.audit_log(conn, 1)[0].os_user.startswith("alice (as ")


@pytest.mark.parametrize("value", ["inf", "nan", "1e8d", "-1h"])
def test_a_retention_that_would_break_every_housekeeping_round_is_refused_at_start(cli: Any, value: str) -> None:
    out = cli("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--retention-succeeded", value, code=2).output
    assert "between 0 and 100 years" in out


def test_retention_out_of_range_is_refused_by_the_library_too() -> None:
    from worker_core.maintenance import Retention

    for bad in (float("inf"), float("nan"), -1.0, 1e12):
        with pytest.raises(ValueError, match="retention failed_seconds must be between"):
            Retention(failed_seconds=bad)


def test_pause_and_resume_refuse_a_misspelt_queue(cli: Any, conn: db.Conn) -> None:
    # "resume biling" reported "resumed queue biling", exit 0, while billing stayed paused
    cli("enqueue", "t.ok", "--queue", "billing")
    cli("pause", "billing", "--reason", "INC-9")
    out = cli("resume", "biling", code=2).output
    assert "no job, worker or earlier pause names queue 'biling'" in out and "paused now: billing" in out
    assert cli("pause", "reports", code=2).output.count("check its spelling") == 1
    assert [q.name for q in stats.queues(conn) if q.paused] == ["billing"]
    assert [a.action for a in stats.audit_log(conn)] == ["pause"]  # nothing audited for the refusals
    cli("pause", "reports", "--unknown-queue")  # a queue still to come, on purpose
    cli("resume", "billing")
    assert [q.name for q in stats.queues(conn) if q.paused] == ["reports"]


def test_a_limit_refuses_a_misspelt_queue(cli: Any, conn: db.Conn) -> None:
    # "limit t.ok 0 --queue biling" said "at most 0 running", exit 0, and held nothing: billing ran on
    cli("enqueue", "t.ok", "--queue", "billing")
    out = cli("limit", "t.ok", "0", "--queue", "biling", "--reason", "INC-9", code=2).output
    assert "no job, worker or earlier pause names queue 'biling'" in out and "--unknown-queue" in out
    assert cli("limit", "t.ok", "0", "--queue", "biling", "--unknown-type", code=2).output.count("spelling") == 1
    assert stats.limits(conn) == [] and stats.audit_log(conn) == []  # nothing set, nothing audited
    cli("limit", "t.ok", "0", "--queue", "billing", "--reason", "INC-9")
    cli("limit", "t.ok", "2", "--queue", "default")  # the default queue is never a misspelling, as for pause
    cli("limit", "t.ok", "1", "--queue", "reports", "--unknown-queue")  # a queue still to come, on purpose
    held = [(r["queue"], r["max_running"]) for r in stats.limits(conn)]
    assert held == [("billing", 0), ("default", 2), ("reports", 1)]


def test_requeue_and_kill_of_a_job_that_does_not_exist_exit_1(cli: Any, conn: db.Conn) -> None:
    # they printed "skipped ...: no such job" and exited 0: a script read success
    ghost = str(uuid.uuid4())
    assert "no such job" in cli("requeue", ghost, code=1).output
    assert "no such job" in cli("kill", ghost, code=1).output
    jid = cli("enqueue", "t.ok").stdout.strip()
    assert "1 of 2" in cli("kill", jid, ghost, code=1).output  # the real one is killed all the same


def test_dead_letters_lists_the_failed_jobs_too(cli: Any, conn: db.Conn) -> None:
    # the console's d screen shows failed jobs (a permanent error) with the dead letters; the CLI showed only
    # dead letters, and told an operator there was nothing to requeue
    for state, n in (("failed", 3), ("dead_lettered", 2), ("retry_scheduled", 1)):
        for _ in range(n):
            jid = cli("enqueue", "t.ok").stdout.strip()
            conn.execute(
                "UPDATE job_queue SET state = %s, finished_at = now(), error_fingerprint = 'Boom' WHERE id = %s",
                (state, jid),
            )
    conn.commit()
    groups = json.loads(cli("dead-letters", "--json").stdout)
    assert sorted((g["state"], g["count"]) for g in groups) == [("dead_lettered", 2), ("failed", 3)]
    groups = json.loads(cli("dead-letters", "--state", "retry_scheduled", "--json").stdout)
    assert [(g["state"], g["count"]) for g in groups] == [("retry_scheduled", 1)]
    assert "unknown state" in cli("dead-letters", "--state", "dead", code=2).output


def test_the_audit_table_says_what_a_limit_was_on(cli: Any) -> None:
    # it printed "limit - INC-42": the type, the scope and the number were in --json only
    cli("enqueue", "t.ok")
    cli("limit", "t.ok", "0", "--reason", "INC-42")
    cli("limit", "t.ok", "--clear", "--reason", "INC-42 over")
    out = cli("audit").stdout
    assert "t.ok@*=0" in out and "t.ok@*" in out.replace("t.ok@*=0", "")


def test_the_audit_table_says_which_embedded_worker_was_started_or_stopped(cli: Any, conn: db.Conn) -> None:
    # the console's worker_start and worker_stop printed "-": the worker, its queues and task modules were in
    # --json only
    alice = ops.Actor("alice")
    ops.audit_worker(conn, "worker_start", number=3, pid=4121, host="web-1", queues=["billing", "mail"],
                     concurrency=4, tasks=["myapp.tasks"], actor=alice)  # fmt: skip
    ops.audit_worker(conn, "worker_stop", number=2, pid=4188, host="web-1", queues=[], concurrency=2,
                     tasks=["myapp.tasks", "myapp.more"], restart_cancelled=True, actor=alice)  # fmt: skip
    stop, start = cli("audit").stdout.splitlines()[1:]
    assert "worker_start" in start and "emb#3 pid 4121: queues=billing,mail concurrency=4 tasks=myapp.tasks" in start
    assert "worker_stop" in stop and "emb#2 pid 4188: restart cancelled queues=* concurrency=2" in stop
    assert "tasks=myapp.tasks,myapp.more host=web-1" in stop
    entries = json.loads(cli("audit", "--json").stdout)
    assert [(e["action"], e["detail"]["number"]) for e in entries] == [("worker_stop", 2), ("worker_start", 3)]


def test_the_audit_table_says_which_dead_letter_groups_a_console_action_was_on(cli: Any, conn: db.Conn) -> None:
    # a console requeue of a group printed "requeue 3 job(s)": which group (type, error) was in no column
    conn.execute(
        "INSERT INTO job_queue (job_type, queue, payload, state, attempts, finished_at, last_error,"
        " error_fingerprint) SELECT 'email.send', 'mail', '{}', 'dead_lettered', 4, now(), 'upstream 503',"
        " 'TransientError: upstream <n>' FROM generate_series(1, 3)"
    )
    ids = ops.group_job_ids(conn, "email.send", "TransientError: upstream <n>")
    group = {"job_type": "email.send", "fingerprint": "TransientError: upstream <n>", "state": "dead_lettered",
             "jobs": 3}  # fmt: skip
    ops.requeue(conn, ids, actor=ops.Actor("alice"), groups=[group])
    ops.kill(conn, ids[:2], actor=ops.Actor("alice"), groups=[group, {**group, "job_type": "sms.send"}])
    ops.kill(conn, ids[2:], actor=ops.Actor("alice"))
    plain, two, one = cli("audit").stdout.splitlines()[1:]
    assert "3 job(s) of email.send (dead_lettered, 3): TransientError: upstream <n>" in one
    assert "2 job(s) of 2 groups: email.send (dead_lettered, 3): TransientError: upstream <n>; sms.send" in two
    assert " 1 job(s) " in plain and " of " not in plain
    [entry] = [e for e in json.loads(cli("audit", "--json").stdout) if e["action"] == "requeue"]
    assert entry["detail"]["groups"] == [group]


def test_stats_says_which_waiting_types_no_live_worker_runs_and_the_expired_leases(cli: Any, conn: db.Conn) -> None:
    # a type no live worker runs only showed its lag; a dead worker's jobs read "running 8"
    conn.execute(
        "INSERT INTO workers (id, host, pid, queues, tasks, concurrency) VALUES ('h:1:a', 'h', 1, NULL, '{t.ok}', 4)"
    )
    cli("enqueue", "sms.send", "--queue", "mail")
    cli("enqueue", "t.ok", "--queue", "mail")
    for _ in range(2):
        cli("enqueue", "report.build", "--queue", "reports")
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_until = now() - interval '1 minute'"
        " WHERE job_type = 'report.build'"
    )
    out = cli("stats").stdout
    # report.build waits for nothing, but its expired leases are claimable again, by no live worker
    assert "no live worker runs: sms.send in mail, report.build in reports" in out, out
    [reports] = [line for line in out.splitlines() if line.startswith("reports")]
    assert "2 (2 expired)" in reports, reports
    types = {(t["queue"], t["job_type"]): t for t in json.loads(cli("stats", "--json").stdout)["types"]}
    assert (types[("mail", "sms.send")]["live_workers"], types[("mail", "t.ok")]["live_workers"]) == (0, 1)
    assert types[("reports", "report.build")]["running_expired"] == 2
    [worker] = [line for line in cli("workers").stdout.splitlines() if "h:1:a" in line]
    assert worker.split()[-1] == "t.ok", worker  # its job types


def test_enqueue_of_a_type_no_worker_registered_says_whose_defaults_apply(cli: Any) -> None:
    # the README's own sequence (migrate, enqueue, then start the worker) put the job in queue default under
    # the deployment's defaults, without a word, while the type's @task says billing
    out = cli("enqueue", "billing.unknown-yet")
    assert "no worker has registered job type 'billing.unknown-yet'" in out.stderr
    assert "has no @task in this process" not in out.stderr  # the library's own warning: said once, not twice
    import tests.worker_core.tasks  # noqa: F401  # its @task here (alone, this test relied on another's import)

    assert "no worker has registered" not in cli("enqueue", "t.ok").stderr  # this process imported its @task


def test_enqueue_says_an_unregistered_type_once_in_its_own_words(dsn: str) -> None:
    # the library's warning (for producers that call enqueue) came on top of the CLI's, in a real process
    from tests.worker_core.helpers import subprocess_env

    env = {**subprocess_env(), "QCONSOLE_DSN": dsn}
    argv = [sys.executable, "-m", "qconsole", "enqueue", "billing.unknown-yet"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("billing.unknown-yet") == 1 and "--tasks was not given" in done.stderr


def test_an_argument_that_is_not_utf8_is_refused_by_name(dsn: str, conn: db.Conn, make_job: Callable[..., Any]) -> None:
    # a --reason with a Latin-1 byte failed at the audit's write: "error: 'utf-8' codec can't encode
    # character '\\udcff' in position 19: surrogates not allowed", which said nothing of which argument
    from tests.worker_core.helpers import subprocess_env

    jid = str(make_job("t.ok"))
    argv = [sys.executable, "-m", "qconsole", "kill", jid, "--reason", "caf\udce9 down"]
    env = {**subprocess_env(), "QCONSOLE_DSN": dsn}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT, errors="replace")
    assert done.returncode == 2 and "not UTF-8 text, nothing was done: caf\\xe9 down" in done.stderr
    assert stats.get_job(conn, jid).state.value == "queued"


def test_the_console_on_a_database_not_migrated_says_so_before_it_opens(
    cli: Any, admin_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # it opened, and showed UndefinedTable as a read failure, refresh after refresh
    import psycopg

    from tests.conftest import dsn_for

    name = f"qc_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        monkeypatch.setenv("QCONSOLE_DSN", dsn_for(admin_dsn, name))
        assert "needs migrations (0001_init" in cli(code=3).output
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ------------------------------------------------------------------------------------------------ bad input


def test_enqueue_judges_the_envelope_under_the_contract_the_types_workers_registered(cli: Any, dsn: str) -> None:
    # checked before connecting, under the deployment's defaults (timeout 60): a lease of 20 s was refused
    from worker_core.registry import Registry, Task
    from worker_core.worker import Worker, WorkerConfig

    reg = Registry()
    reg.register(Task("r.fast", lambda ctx, payload: None, timeout=10, reason="a quick one"))
    Worker(WorkerConfig(dsn=dsn, burst=True, poll_interval=0.05), registry=reg).run()  # publishes its contract
    jid = cli("enqueue", "r.fast", "--visibility-timeout", "20").stdout.strip()
    with db.connect(dsn) as c:
        row = c.execute("SELECT timeout_seconds, visibility_timeout_seconds FROM job_queue WHERE id = %s", (jid,))
        assert row.fetchone() == {"timeout_seconds": 10.0, "visibility_timeout_seconds": 20.0}
    out = cli("enqueue", "r.fast", "--visibility-timeout", "12", code=2).output  # still judged: 10 + 5 > 12
    assert "nothing was written" in out and "timeout_seconds (10" in out


@pytest.mark.parametrize(
    "payload", ['{"a": 1' + "9" * 5000 + "}", "[" * 30000 + "]" * 30000], ids=["huge-integer", "deep-nesting"]
)
def test_a_json_option_python_cannot_decode_is_bad_input(cli: Any, payload: str) -> None:
    assert "--payload is not valid JSON" in cli("enqueue", "t.ok", "--payload", payload, code=2).output


def test_a_task_module_whose_task_the_policy_refuses_is_bad_input(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "unreasoned_tasks.py").write_text(
        "import worker_core\n\n"
        "@worker_core.task('x.unreasoned', max_attempts=8)\n"
        "def handler(ctx, payload):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for args in (("worker", "--tasks", "unreasoned_tasks", "--burst"), ("enqueue", "x.unreasoned", "--tasks",
                                                                          "unreasoned_tasks")):  # fmt: skip
        out = cli(*args, code=2).output  # a traceback, exit 1
        assert "@task is refused" in out and "without a reason" in out


def test_a_bad_policy_file_is_named_with_its_table_not_blamed_on_an_at_task(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # worker and enqueue --tasks said "a task module's @task is refused: .../pyproject.toml [defaults]: ...":
    # no @task was wrong, and pyproject.toml has no table [defaults]
    (tmp_path / "pyproject.toml").write_text("[tool.qconsole.defaults]\nmax_attempts = 2.9\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QCONSOLE_POLICY_FILE")
    said = f"{tmp_path / 'pyproject.toml'} [tool.qconsole.defaults]: max_attempts must be an integer, not 2.9"
    for args in (
        ("worker", "--tasks", "tests.worker_core.tasks", "--burst"),
        ("enqueue", "t.ok", "--tasks", "tests.worker_core.tasks"),
        ("policies", "--tasks", "tests.worker_core.tasks"),
        ("policies",),
    ):
        out = cli(*args, code=2).output
        assert f"the deployment's policy is refused: {said}" in out and "@task" not in out, out


REFUSED_TASKS = {
    "bad_type_tasks": ('@worker_core.task("Invoice.Generate")\ndef f(ctx, p): pass\n', "must match"),
    "zero_concurrency_tasks": ('@worker_core.task("x.conc", concurrency=0)\ndef f(ctx, p): pass\n', "concurrency"),
    "timeout_past_lease_tasks": (
        '@worker_core.task("x.vis", timeout=100, visibility_timeout=50, reason="x")\ndef f(ctx, p): pass\n',
        "visibility_timeout",
    ),
}


@pytest.fixture
def refused_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Task modules whose @task the registry refuses, importable by name (the modules are forgotten after)."""
    for name, (source, _) in REFUSED_TASKS.items():
        (tmp_path / f"{name}.py").write_text("import worker_core\n\n" + source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in REFUSED_TASKS:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("module", sorted(REFUSED_TASKS))
@pytest.mark.parametrize("command", ["enqueue", "worker"])
def test_a_task_module_whose_task_the_registry_refuses_is_bad_input(
    cli: Any, refused_tasks: Path, module: str, command: str
) -> None:
    # a bad type name, concurrency=0, a timeout past its lease: a traceback (ValueError, EnvelopeError) and exit 1
    args = ("enqueue", "x.any", "--tasks", module) if command == "enqueue" else ("worker", "--tasks", module, "--burst")
    result = cli(*args, code=2)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "@task is refused" in result.output and REFUSED_TASKS[module][1] in result.output


def test_a_refused_task_module_stops_a_worker_of_several_processes_before_any_starts(
    dsn: str, refused_tasks: Path
) -> None:
    # --processes N and the console's embedded workers run `qconsole worker`: exit 2 before it says "started"
    # is what they take for a configuration refusal (not restarted); a traceback's exit 1 was a crash, and the
    # console restarted it for ever
    env = {**os.environ, "QCONSOLE_DSN": dsn, "PYTHONPATH": f"{refused_tasks}{os.pathsep}{ROOT}"}
    read, write = os.pipe()
    try:
        argv = [sys.executable, "-m", "qconsole", "worker", "--tasks", "zero_concurrency_tasks", "--processes", "2",
                "--status-fd", str(write)]  # fmt: skip
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, pass_fds=(write,))
    finally:
        os.close(write)
    with os.fdopen(read) as status:
        said = status.read()
    assert (proc.returncode, said) == (2, ""), proc.stderr
    assert "@task is refused" in proc.stderr and "Traceback" not in proc.stderr


def test_a_log_level_that_does_not_exist_is_bad_input(cli: Any) -> None:
    assert "--log-level must be" in cli("worker", "--tasks", "tests.worker_core.tasks", "--log-level", "LOUD",
                                        code=2).output  # fmt: skip


def test_fleet_metrics_on_a_port_taken_is_bad_input(cli: Any) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert "cannot serve metrics" in cli("metrics", "--port", port, "--addr", "127.0.0.1", code=2).output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("metrics", "--port", "70000", "--addr", "127.0.0.1"), "--port"),
        (("metrics", "--port", "0", "--addr", "127.0.0.1"), "--port"),
        (("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--metrics-port", "70000"), "--metrics-port"),
        (("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--metrics-port", "-1"), "--metrics-port"),
        (
            ("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--processes", "3", "--metrics-port", "65534"),
            "process 2 would serve port 65536",
        ),
    ],
    ids=["fleet-past-65535", "fleet-0", "worker-past-65535", "worker-negative", "last-process-past-65535"],
)
def test_a_metrics_port_out_of_range_is_bad_input(cli: Any, args: tuple[str, ...], message: str) -> None:
    # an OverflowError from bind(): a traceback and exit 1 (the last of --processes N only, after the others
    # had started)
    result = cli(*args, code=2)
    assert isinstance(result.exception, SystemExit) and message in result.output


def test_migrate_says_so_when_the_embedded_server_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("QCONSOLE_DSN", "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("QCONSOLE_PGDATA", "/tmp/" + "x" * 120)  # too long for its socket
    result = CliRunner().invoke(app, ["migrate"])
    assert result.exit_code == 3 and "QCONSOLE_PGDATA" in result.output, result.output


def test_with_no_home_directory_the_embedded_server_says_what_else_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # no HOME and a uid without a passwd entry (a container): it said only "set an absolute HOME or XDG variable"
    import pwd

    def no_entry(uid: int) -> Any:
        raise KeyError(uid)

    for name in ("QCONSOLE_DSN", "DATABASE_URL", "QCONSOLE_PGDATA", "HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.setattr(os, "geteuid", lambda: 12345)  # not root, whose data directory is under /var/lib
    result = CliRunner().invoke(app, ["stats"])
    assert result.exit_code == 3, result.output
    assert "home directory" in result.output, result.output
    assert "QCONSOLE_PGDATA" in result.output and "QCONSOLE_DSN" in result.output, result.output


def test_a_worker_on_the_embedded_server_starts_it_again_when_it_was_killed() -> None:
    # the worker logged `heartbeat failed: ... Connection refused` for ever, until some other qconsole command
    # started the server again
    import shutil
    import signal
    import tempfile
    import time

    from tests.worker_core.test_embedded import kill_postmaster, postmaster

    base = Path(tempfile.mkdtemp(prefix="qc", dir="/tmp"))
    pgdata = base / "pg"
    env = {k: v for k, v in os.environ.items() if k not in ("QCONSOLE_DSN", "DATABASE_URL")}
    env.update(QCONSOLE_PGDATA=str(pgdata), PYTHONPATH=str(ROOT))
    log = base / "worker.log"
    worker = None
    try:
        argv = [sys.executable, "-m", "qconsole", "worker", "--tasks", "tests.worker_core.tasks", "--heartbeat", "0.5"]
        with log.open("w") as out:
            worker = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while "worker starting" not in log.read_text() and time.monotonic() < deadline:
            assert worker.poll() is None, log.read_text()
            time.sleep(0.2)
        kill_postmaster(pgdata)
        deadline = time.monotonic() + 30
        while postmaster(pgdata) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert postmaster(pgdata) is not None, log.read_text()  # the worker alone started it again
        assert "starting it again" in log.read_text()
        time.sleep(2)  # its beats go through again: no failure logged once it is up
        failures = log.read_text().count("heartbeat failed")
        time.sleep(2)
        assert log.read_text().count("heartbeat failed") == failures
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, log.read_text()
        assert postmaster(pgdata) is None  # and stopped what it started, the last one attached
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(60)
        if (server := postmaster(pgdata)) is not None:
            server.kill()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_worker_whose_handler_left_a_thread_blocking_exits_once_stopped(
    dsn: str, conn: db.Conn, tmp_path: Path, processes: int
) -> None:
    # an async handler's asyncio.to_thread (run_in_executor) call went on in its thread after the job was
    # released, and the interpreter joins such threads at exit, unbounded: the process stayed until it
    # ended (under --processes, the supervisor killed it after its grace)
    import signal

    from tests.worker_core.helpers import state, wait_for
    from worker_core.producer import enqueue

    job = enqueue(conn, "t.async_to_thread", {"seconds": 600}).id
    env = {k: v for k, v in os.environ.items() if k not in ("QCONSOLE_DSN", "DATABASE_URL")}
    env.update(QCONSOLE_DSN=dsn, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "qconsole", "worker", "--tasks", "tests.worker_core.tasks", "--shutdown-grace", "1",
            "--processes", str(processes)]  # fmt: skip
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: state(dsn, job) == "running", 60, what="the job to start")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
    assert "did not stop in time" not in log.read_text(), log.read_text()
    assert state(dsn, job) == "queued"  # released, its attempt given back


def test_the_log_level_holds_for_the_worker_processes_too(dsn: str, tmp_path: Path) -> None:
    # --log-level was set in the supervisor only: its children logged at INFO whatever it said
    env = {k: v for k, v in os.environ.items() if k not in ("QCONSOLE_DSN", "DATABASE_URL")}
    env.update(QCONSOLE_DSN=dsn, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "qconsole", "worker", "--tasks", "tests.worker_core.tasks", "--burst",
            "--processes", "2", "--poll-interval", "0.1", "--log-level", "WARNING"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "worker starting" not in done.stderr and "INFO" not in done.stderr, done.stderr


@pytest.fixture
def migrations_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The shipped migrations in a folder of the test's own, which ``qconsole migrate`` applies."""
    import shutil

    import worker_core.migrate

    folder = tmp_path / "migrations"
    shutil.copytree(ROOT / "migrations", folder)
    monkeypatch.setattr(worker_core.migrate, "migrations_dir", lambda: folder)
    return folder


def test_migrate_names_the_migration_that_failed_and_those_applied_before_it(cli: Any, migrations_folder: Path) -> None:
    (migrations_folder / "9001_extra.sql").write_text("CREATE TABLE extra_thing (id int);\n")
    (migrations_folder / "9002_also.sql").write_text("CREATE TABLE also_thing (id int);\n")
    (migrations_folder / "9003_broken.sql").write_text("SELECT 1/0;\n")
    out = cli("migrate", code=3).output
    assert "migration 9003_broken failed, nothing of it was applied: division by zero" in out
    assert "applied before it: 9001_extra, 9002_also" in out


def test_migrate_is_not_cancelled_by_the_roles_statement_timeout(cli: Any, dsn: str, migrations_folder: Path) -> None:
    # "lost the database while migrating", naming neither the migration nor those applied before it
    from psycopg.conninfo import make_conninfo

    (migrations_folder / "9001_slow.sql").write_text("SELECT pg_sleep(0.5);\n")
    out = cli("migrate", "--dsn", make_conninfo(dsn, options="-c statement_timeout=100")).output
    assert "applied 9001_slow" in out


@pytest.fixture
def dml_role(dsn: str, conn: db.Conn) -> Iterator[str]:
    """A DSN for an application's role: it reads and writes the tables, and creates nothing."""
    from psycopg.conninfo import make_conninfo

    role = f"qc_dml_{uuid.uuid4().hex[:8]}"
    conn.execute(f"CREATE ROLE {role} LOGIN")
    conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")  # the default since PostgreSQL 15
    conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
    try:
        yield make_conninfo(dsn, user=role)
    finally:
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


def test_migrate_on_an_up_to_date_database_writes_nothing(cli: Any, dsn: str, dml_role: str) -> None:
    # it created worker_core_migrations "if not exists" first: PostgreSQL checks the privilege before the
    # table, and an application's role or a replica failed (exit 3, "permission denied for schema public")
    from psycopg.conninfo import make_conninfo

    assert "up to date" in cli("migrate", "--dsn", dml_role).output
    read_only = make_conninfo(dsn, options="-c default_transaction_read_only=on")
    assert "up to date" in cli("migrate", "--dsn", read_only).output


def test_migrate_by_a_role_that_cannot_is_refused_with_what_to_do(
    cli: Any, dsn: str, dml_role: str, migrations_folder: Path
) -> None:
    from psycopg.conninfo import make_conninfo

    (migrations_folder / "9001_extra.sql").write_text("CREATE TABLE extra_thing (id int);\n")
    out = cli("migrate", "--dsn", dml_role, code=1).output
    assert "this role cannot migrate 9001_extra: run it as the schema's owner" in out, out
    # a read-only server (a replica; here a read-only session) was told to run it as the schema's owner
    read_only = make_conninfo(dsn, options="-c default_transaction_read_only=on")
    out = cli("migrate", "--dsn", read_only, code=1).output
    assert "cannot migrate 9001_extra here: the server (or this session) is read-only, a replica perhaps" in out, out
    assert "on the primary" in out and "schema's owner" not in out, out
    assert "applied 9001_extra" in cli("migrate").output


def test_migrate_on_a_read_only_server_never_migrated_says_so(cli: Any, admin_dsn: str) -> None:
    # creating worker_core_migrations, before the first migration: "this role cannot migrate: run it as the
    # schema's owner", on a replica
    from psycopg.conninfo import make_conninfo

    name = f"qc_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        read_only = make_conninfo(admin_dsn, dbname=name, options="-c default_transaction_read_only=on")
        out = cli("migrate", "--dsn", read_only, code=1).output
        assert "cannot migrate here: the server (or this session) is read-only, a replica perhaps" in out, out
        assert "on the primary" in out and "schema's owner" not in out, out
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_migrate_gives_up_after_lock_wait_and_says_who_holds_the_locks(
    cli: Any, dsn: str, migrations_folder: Path
) -> None:
    (migrations_folder / "9001_column.sql").write_text("ALTER TABLE job_queue ADD COLUMN extra int;\n")
    with db.connect(dsn) as reader:
        reader.execute("SELECT count(*) FROM job_queue")  # a pg_dump, a producer's long transaction
        out = cli("migrate", "--lock-wait", "1s", code=3).output
        assert f"pid {reader.info.backend_pid} (idle in transaction" in out, out
        assert "9001_column did not get its locks within --lock-wait 1s, nothing of it was applied" in out
    assert "applied 9001_column" in cli("migrate").output
    assert "--lock-wait" in cli("migrate", "--lock-wait", "soon", code=2).output


def test_a_database_a_newer_version_migrated_is_said(cli: Any, conn: db.Conn) -> None:
    conn.execute("INSERT INTO worker_core_migrations (version, name, checksum) VALUES (9999, 'future', 'x')")
    conn.commit()
    migrated = cli("migrate").output
    assert "up to date" in migrated and "does not know (9999)" in migrated
    assert "does not know (9999)" in cli("jobs").output


def test_a_read_only_command_brings_the_embedded_servers_schema_up_to_date() -> None:
    # `qconsole stats` on an embedded server with migrations pending said "run qconsole migrate" (exit 3). (On a
    # machine with no embedded server yet, a command that reads makes none: see the test above)
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="qc", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("QCONSOLE_DSN", "DATABASE_URL")}
    env.update(QCONSOLE_PGDATA=str(base / "pg"), PYTHONPATH=str(ROOT))
    try:
        # a server made, never migrated (by an older version, or a program of the user's own)
        make = "from worker_core.embedded import start_embedded; start_embedded()"
        made = subprocess.run([sys.executable, "-c", make], env=env, capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        done = subprocess.run([sys.executable, "-m", "qconsole", "stats"], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        refused = subprocess.run([sys.executable, "-m", "qconsole", "--read-only", "stats"], env=env,
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
        assert refused.returncode == 0, refused.stderr  # migrated already
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_with_no_dsn_every_command_says_it_uses_the_embedded_server_and_one_that_reads_makes_none(
    cli: Any,
) -> None:
    # `sudo qconsole stats` (sudo drops QCONSOLE_DSN) started a brand-new, empty embedded server and said "nothing
    # queued, no dead letters", exit 0, of the wrong database; nothing said which database it read
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="qc", dir="/tmp"))
    pgdata = base / "pg"
    env = {k: v for k, v in os.environ.items() if k not in ("QCONSOLE_DSN", "DATABASE_URL")}
    env.update(QCONSOLE_PGDATA=str(pgdata), PYTHONPATH=str(ROOT))

    def qconsole(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "qconsole", *args], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    try:
        for args in (["stats", "--json"], ["dead-letters", "--json"], ["jobs"], ["--read-only"]):
            refused = qconsole(*args)
            assert refused.returncode == 3 and refused.stdout == "", (args, refused.stdout, refused.stderr)
            assert f"no embedded server in {pgdata}" in refused.stderr and "--dsn" in refused.stderr, refused.stderr
        assert sorted(p.name for p in base.iterdir()) == []  # nothing made
        made = qconsole("migrate")
        assert made.returncode == 0 and "applied 0001" in made.stdout, made.stderr
        assert made.stderr.count("note: ") == 1, made.stderr
        assert f"a new, empty embedded PostgreSQL server was created in {pgdata}" in made.stderr
        read = qconsole("stats", "--json")
        assert read.returncode == 0, read.stderr
        assert json.loads(read.stdout)["types"] == []  # stdout holds the JSON alone
        assert read.stderr.count("note: ") == 1, read.stderr
        assert f"using the embedded PostgreSQL server in {pgdata}" in read.stderr and "QCONSOLE_DSN" in read.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert "embedded" not in cli("stats").output  # a DSN given: nothing said


# ------------------------------------------------------------------------------------------------ safety


@pytest.mark.parametrize(
    "bad_dsn",
    ["postgresql://app:Secr3t%PW@127.0.0.1/db", "postgres://app:Secr3tPW@[::1/db", "postgresql://app:Secr3t@PW@127.0.0.1:1/db"],
    ids=["percent", "bracket", "at-sign"],
)
@pytest.mark.parametrize("args", [["stats"], ["migrate"], ["kill", "00000000-0000-4000-8000-000000000000"]])
def test_a_dsn_libpq_cannot_parse_is_said_without_its_password(
    monkeypatch: pytest.MonkeyPatch, bad_dsn: str, args: list[str]
) -> None:
    # a traceback that quoted the password (CI logs, pastes), exit 1; an @ in it showed the tail
    monkeypatch.setenv("QCONSOLE_DSN", bad_dsn)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 3, result.output
    assert "cannot connect" in result.output
    for secret in ("Secr3t", "PW@", "%PW"):
        assert secret not in result.output


@pytest.mark.parametrize("bad_dsn", ["postgresql://app:Secr3t%PW@127.0.0.1/db", "postgres://app:Secr3tPW@[::1/db"])
def test_the_console_on_a_dsn_libpq_cannot_parse_says_so_without_its_password(
    monkeypatch: pytest.MonkeyPatch, bad_dsn: str
) -> None:
    monkeypatch.setenv("QCONSOLE_DSN", bad_dsn)
    result = CliRunner().invoke(app, [])
    assert result.exit_code == 3 and "cannot connect" in result.output, result.output
    assert "Secr3t" not in result.output and "%PW" not in result.output


def test_the_consoles_banner_never_shows_a_piece_of_the_password() -> None:
    # an unencoded @ in the password: libpq takes its tail for the host, and its error names that host
    import psycopg

    from qconsole.backend import describe_error

    dsn = "postgresql://app:Secr3t@PW@127.0.0.1:1/db"
    with pytest.raises(psycopg.OperationalError) as caught:
        psycopg.connect(dsn, connect_timeout=2)
    text = describe_error(caught.value, dsn)
    assert "Secr3t" not in text and "PW@" not in text and "failed to resolve host" in text


def test_an_action_a_read_only_role_may_not_do_is_refused_cleanly(dsn: str, conn: db.Conn) -> None:
    role = f"qc_ro_{uuid.uuid4().hex[:8]}"
    conn.execute(f"CREATE ROLE {role} LOGIN")
    conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    conn.commit()
    try:
        from psycopg.conninfo import make_conninfo

        ro = make_conninfo(dsn, user=role)
        jid = CliRunner().invoke(app, ["enqueue", "t.ok", "--dsn", dsn]).stdout.strip()
        for args in (["kill", jid], ["pause", "default"], ["enqueue", "t.ok"]):
            result = CliRunner().invoke(app, [*args, "--dsn", ro])
            assert result.exit_code == 1, result.output  # a traceback, exit 1
            assert "refused by the database, nothing changed" in result.output
        shown = CliRunner().invoke(app, ["job", jid, "--dsn", ro]).stdout  # it reads: the kill changed nothing
        assert re.search(r"^state\s+queued\s*$", shown, re.M), shown
    finally:
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")
        conn.commit()


def test_the_demo_never_runs_on_a_database_the_environment_names(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # DATABASE_URL exported for an application: the demo wrote its jobs there and its workers ran the
    # application's jobs of the same types
    import shutil
    import tempfile

    result = CliRunner().invoke(app, ["--read-only", "demo"])
    assert result.exit_code == 1 and "read-only" in result.output
    base = Path(tempfile.mkdtemp(prefix="qd", dir="/tmp"))
    env = {**os.environ, "DATABASE_URL": dsn, "QCONSOLE_PGDATA": str(base / "pg"), "PYTHONPATH": str(ROOT)}
    env.pop("QCONSOLE_DSN", None)
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from qconsole.demo import demo_dsn; print(demo_dsn(None))"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "DATABASE_URL ignored" in done.stdout
        assert done.stdout.strip().splitlines()[-1].endswith(f"host={base / 'pg'}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_worker_without_housekeeping_prunes_nothing_and_the_console_starts_such_workers(
    cli: Any, conn: db.Conn
) -> None:
    # the winner of a round prunes the fleet's finished jobs with its own retention: a worker started from
    # the console, with the defaults, deleted the dead letters the fleet kept 90 days after 14
    old = cli("enqueue", "t.ok").stdout.strip()
    conn.execute(
        "UPDATE job_queue SET state = 'dead_lettered', finished_at = now() - interval '20 days' WHERE id = %s", (old,)
    )
    conn.commit()
    cli("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--no-housekeeping")
    assert stats.get_job(conn, old).state == "dead_lettered"  # still there to read and requeue
    out = cli("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--retention-metrics", "30m", code=2).output
    assert "at least an hour" in out
    from qconsole.app import console_launcher
    from qconsole.embedded_workers import EmbeddedWorker

    assert "--no-housekeeping" in console_launcher("postgresql://unused").argv(EmbeddedWorker(1, ("m",), (), 1))


def test_the_demo_says_why_it_cannot_start_as_other_commands_do(
    cli: Any, dsn: str, dml_role: str, migrations_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `qconsole demo` (and `make demo`) printed a traceback, exit 1, where every other command says what to do
    import pwd

    def no_entry(uid: int) -> Any:
        raise KeyError(uid)

    runner = CliRunner()
    # a role that cannot apply a migration pending: what `qconsole migrate` says, and its exit code
    (migrations_folder / "9001_extra.sql").write_text("CREATE TABLE extra_thing (id int);\n")
    result = runner.invoke(app, ["demo", "--dsn", dml_role])
    assert result.exit_code == 1, result.output
    assert "this role cannot migrate 9001_extra: run it as the schema's owner" in result.output, result.output
    # the embedded server of another user's data directory
    theirs = tmp_path / "pg"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    for name in ("QCONSOLE_DSN", "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("QCONSOLE_PGDATA", str(theirs))
    monkeypatch.setattr(os, "geteuid", lambda: 12345)  # not root (who is never told) nor the owner
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 3, result.output
    assert f"{theirs} belongs to " in result.output and "QCONSOLE_PGDATA" in result.output, result.output
    # no home directory to put it in (no HOME, a uid without a passwd entry: a container)
    for name in ("QCONSOLE_PGDATA", "HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 3, result.output
    assert "home directory" in result.output and "QCONSOLE_DSN" in result.output, result.output


def test_migrate_gives_up_after_lock_wait_when_another_session_holds_the_migration_lock(
    cli: Any, dsn: str, migrations_folder: Path
) -> None:
    # a session holding the advisory lock (a migrate suspended with Ctrl-Z) made migrate hang for ever, silently
    import threading

    from worker_core.migrate import LOCK_KEY

    (migrations_folder / "9001_extra.sql").write_text("CREATE TABLE extra_thing (id int);\n")
    with db.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))
        guard = threading.Timer(60, holder.close)  # before: it waited for ever; then it would have applied 9001
        guard.start()
        try:
            out = cli("migrate", "--lock-wait", "1s", code=3).output
        finally:
            guard.cancel()
        pid = holder.info.backend_pid
    assert "9001_extra waits for the migration lock, held by another session" in out, out
    assert f"\n  pid {pid} (idle" in out, out
    assert "did not get the migration lock within --lock-wait 1s, nothing of it was applied" in out, out
    assert "applied 9001_extra" in cli("migrate").output


# ------------------------------------------------------------------ errors an operator met as tracebacks


@pytest.fixture
def role_dsn(dsn: str, conn: db.Conn) -> Iterator[Callable[[str], str]]:
    """``role_dsn("SELECT")``: a DSN for a new role granted that on every table (``""``: nothing)."""
    from psycopg.conninfo import make_conninfo

    roles: list[str] = []

    def make(grant: str) -> str:
        role = f"qc_role_{uuid.uuid4().hex[:8]}"
        conn.execute(f"CREATE ROLE {role} LOGIN")
        if grant:
            conn.execute(f"GRANT {grant} ON ALL TABLES IN SCHEMA public TO {role}")
        roles.append(role)
        return make_conninfo(dsn, user=role)

    yield make
    for role in roles:
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


def dead_letter(conn: db.Conn, payload_sql: str = "'{}'") -> str:
    """A dead-lettered job of type t.ok, its payload written in SQL (what another producer may write)."""
    row = conn.execute(
        "INSERT INTO job_queue (id, job_type, queue, payload, state, attempts, max_attempts, finished_at)"  # noqa: S608
        f" VALUES (gen_random_uuid(), 't.ok', 'default', {payload_sql}::jsonb, 'dead_lettered', 1, 1, now())"
        " RETURNING id"
    ).fetchone()
    assert row is not None
    return str(row["id"])


def test_a_role_granted_nothing_on_the_tables_is_told_so_not_shown_a_traceback(cli: Any, role_dsn: Any) -> None:
    # reading worker_core_migrations (before any command ran) raised InsufficientPrivilege: a traceback, exit 1
    nothing = role_dsn("")
    for args in (["stats"], ["jobs", "--json"], ["kill", str(uuid.uuid4())], ["worker", "--tasks",
                 "tests.worker_core.tasks", "--burst"]):  # fmt: skip
        result = cli(*args, "--dsn", nothing, code=1)
        assert isinstance(result.exception, SystemExit), result.exception
        assert "this role cannot read the queue's tables: permission denied" in result.output
        assert "grant it SELECT" in result.output and "schema owner's role" in result.output


def test_enqueue_by_a_role_that_may_not_read_the_registered_contracts_is_refused_not_a_traceback(
    cli: Any, conn: db.Conn, role_dsn: Any
) -> None:
    # its warning about an unregistered type read job_type_contracts outside the CLI's error handling
    writer = role_dsn("SELECT, INSERT")
    role = sql.Identifier(conninfo_to_dict(writer)["user"])
    conn.execute(sql.SQL("REVOKE SELECT ON job_type_contracts FROM {}").format(role))
    conn.commit()
    result = cli("enqueue", "no.such.type", "--dsn", writer, code=1)
    assert isinstance(result.exception, SystemExit), result.exception
    assert "refused by the database, nothing changed" in result.output


@pytest.fixture
def broken_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``syntax_error_tasks``, importable by name; and tests.cli.tasks_need_config without its setting."""
    (tmp_path / "syntax_error_tasks.py").write_text("import worker_core\n\ndef broken(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TASKS_NEED_CONFIG_SETTINGS_URL", raising=False)
    yield
    for name in ("syntax_error_tasks", "tests.cli.tasks_need_config"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("module", "error"),
    [("syntax_error_tasks", "SyntaxError"), ("tests.cli.tasks_need_config", "KeyError: 'TASKS_NEED_CONFIG")],
)
@pytest.mark.parametrize("command", [["worker", "--burst"], ["enqueue", "t.ok"], ["policies"]])
def test_a_task_module_that_raises_at_import_is_bad_input_naming_it(
    cli: Any, broken_tasks: None, module: str, error: str, command: list[str]
) -> None:
    # only ImportError was caught: a SyntaxError or a KeyError of a setting read at import was a traceback,
    # exit 1 (which --processes and the console's embedded workers take for a crash, and restart)
    result = cli(*command, "--tasks", module, code=2)
    assert isinstance(result.exception, SystemExit), result.exception
    assert f"cannot import task module '{module}': {error}" in result.output, result.output


def test_policies_with_a_task_the_registry_refuses_is_bad_input(cli: Any, refused_tasks: Path) -> None:
    # policies --tasks imported the modules itself: a refused @task was a traceback (EnvelopeError), exit 1
    result = cli("policies", "--tasks", "zero_concurrency_tasks", code=2)
    assert isinstance(result.exception, SystemExit), result.exception
    assert "@task is refused" in result.output


def test_requeue_with_an_empty_payload_is_refused_not_ignored(cli: Any, conn: db.Conn) -> None:
    # a runbook's --payload "$FIXED" with FIXED never set: requeued with the old payload, exit 0
    jid = dead_letter(conn, """'{"bad": true}'""")
    assert "--payload is empty" in cli("requeue", jid, "--payload", "", "--reason", "fix", code=2).output
    assert "give --payload too" in cli("requeue", jid, "--same-payload", code=2).output
    assert stats.get_job(conn, jid).state.value == "dead_lettered"
    assert stats.get_job(conn, jid).payload == {"bad": True}


@pytest.mark.parametrize("command", ["job", "jobs"])
def test_json_output_stays_json_with_a_number_a_float_cannot_hold(cli: Any, conn: db.Conn, command: str) -> None:
    # jsonb holds 1 followed by 400 zeros, and .5, exactly; Python reads it as inf, and --json printed Infinity
    jid = dead_letter(conn, """('{"amount": 1' || repeat('0', 400) || '.5, "n": 2}')""")

    def strict(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    out = json.loads(cli(command, *([jid] if command == "job" else []), "--json").stdout, parse_constant=strict)
    found = out if command == "job" else out[0]
    assert found["payload"] == {"amount": "(a number out of float range: inf)", "n": 2}


def test_a_worker_that_could_not_write_ends_at_once_with_why(cli: Any, dsn: str, role_dsn: Any) -> None:
    # it checked reachability and migrations only, then claimed nothing, once a second, for ever (--burst too)
    from psycopg.conninfo import make_conninfo

    worker = ("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--poll-interval", "0.1")
    read_only = make_conninfo(dsn, options="-c default_transaction_read_only=on")
    out = cli(*worker, "--dsn", read_only, code=1).output
    assert "the worker cannot run here: this session is read-only" in out and "against the primary" in out
    out = cli(*worker, "--dsn", role_dsn("SELECT"), code=1).output
    assert "this role may not write the queue's tables (it lacks INSERT on job_queue, UPDATE on job_queue" in out
    assert "exited" not in cli(*worker, "--dsn", role_dsn("SELECT, INSERT, UPDATE, DELETE")).output


def test_dead_letters_json_says_on_stderr_when_it_is_a_subset_and_all_lists_every_one(
    cli: Any, conn: db.Conn
) -> None:
    conn.execute(
        "INSERT INTO job_queue (id, job_type, queue, payload, state, attempts, max_attempts, finished_at,"
        " last_error, error_fingerprint)"
        " SELECT gen_random_uuid(), 't.ok', 'default', '{}', 'dead_lettered', 1, 1, now(), 'E' || g,"
        "  CASE WHEN g <= 1200 THEN 'big' ELSE 'fp' || g END FROM generate_series(1, 1450) g"
    )  # one group of 1,200 jobs and 250 groups of one
    result = cli("dead-letters", "--json")
    data = json.loads(result.stdout)
    assert len(data) == 200 and len(next(g for g in data if g["fingerprint"] == "big")["job_ids"]) == 1000
    assert "left out: 51 group(s) and 200 job id(s) of the groups listed; --all lists every one" in result.stderr
    result = cli("dead-letters", "--json", "--all")
    data = json.loads(result.stdout)
    assert len(data) == 251 and sum(len(g["job_ids"]) for g in data) == 1450
    assert "subset" not in result.stderr


def test_a_read_only_server_is_not_blamed_on_the_read_only_flag(cli: Any, conn: db.Conn, dsn: str) -> None:
    from psycopg.conninfo import make_conninfo

    jid = dead_letter(conn)
    read_only = make_conninfo(dsn, options="-c default_transaction_read_only=on")
    out = cli("requeue", jid, "--dsn", read_only, code=1).output
    assert "--read-only" not in out and "this session is read-only" in out and "against the primary" in out
    assert "drop --read-only" in cli("--read-only", "requeue", jid, code=1).output  # the flag given: said so


def test_limit_refuses_a_number_with_clear_and_says_when_a_type_has_no_limit(cli: Any, conn: db.Conn) -> None:
    dead_letter(conn)
    assert "no limit on t.ok" in cli("limit", "t.ok").output  # it printed nothing
    cli("limit", "t.ok", "0", "--reason", "INC-1")
    assert "not both" in cli("limit", "t.ok", "5", "--clear", code=2).output  # it cleared the limit, exit 0
    assert "t.ok * 0" in cli("limit", "t.ok").output
    assert "check its spelling" in cli("limit", "t.nope", code=1).output


def test_discard_ends_dead_letters_and_kill_points_to_it(cli: Any, conn: db.Conn) -> None:
    # the runbook's "jobs that can never succeed: qconsole kill ID" was refused for dead letters, exit 1
    jid = dead_letter(conn)
    assert "discard it (it ends cancelled) or requeue it" in cli("kill", jid, code=1).output
    assert "discard: 1 of 1 job(s) changed" in cli("discard", jid, "--reason", "INC-9").output
    assert stats.get_job(conn, jid).state.value == "cancelled"
    assert "it is cancelled" in cli("discard", jid, code=1).output  # nothing changed: exit 1
    assert "'x' is not a job id" in cli("discard", "x", code=2).output


@pytest.mark.parametrize("command", ["job", "kill", "requeue", "discard"])
def test_a_malformed_job_id_is_bad_input_for_every_command(cli: Any, command: str) -> None:
    assert "'not-a-uuid' is not a job id" in cli(command, "not-a-uuid", code=2).output  # job: exit 1


def test_a_worker_refuses_a_queue_name_pause_would_refuse_and_warns_of_a_new_one(cli: Any) -> None:
    worker = ("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--poll-interval", "0.1")
    assert "'Billing!' is not a queue name" in cli(*worker, "--queue", "Billing!", code=2).output
    result = cli(*worker, "--queue", "default", "--queue", "biling")
    assert "no job, worker, pause or task names queue 'biling' yet" in result.stderr
    assert "'default'" not in result.stderr


def test_a_command_behind_a_lock_gives_up_at_its_statement_timeout_and_writes_nothing(
    cli: Any, conn: db.Conn, dsn: str, make_job: Callable[..., Any]
) -> None:
    # behind a session holding a lock (another tool's migration, a VACUUM FULL, an operator's open
    # transaction), `qconsole stats` and `qconsole kill` waited for ever: a cron job's runs piled up
    jid = str(make_job("t.ok"))
    with db.connect(dsn) as locker:
        locker.execute("SELECT 1 FROM job_queue WHERE id = %s FOR UPDATE", (jid,))
        out = cli("--statement-timeout", "300ms", "kill", jid, "--reason", "INC-7", code=3).output
        assert "ran past the statement timeout" in out and "nothing of it was written" in out
        locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
        assert "ran past the statement timeout" in cli("--statement-timeout", "300ms", "stats", code=3).output
        locker.rollback()
    assert stats.get_job(conn, jid).state.value == "queued"
    assert "at least" not in cli("--statement-timeout", "0", "stats").output  # 0: no limit
    assert "between 1 ms and 24 days" in cli("--statement-timeout", "30d", "stats", code=2).output
    assert "not a duration" in cli("--statement-timeout", "soon", "stats", code=2).output


def test_commands_read_under_a_minute_and_write_under_ten_by_default(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from qconsole import cli as cli_module

    monkeypatch.setitem(cli_module._ROOT, "statement_timeout_s", None)
    with cli_module.connect(dsn, read_only=True) as conn:
        assert conn.execute("SHOW statement_timeout").fetchone() == {"statement_timeout": "1min"}
    with cli_module.connect(dsn) as conn:
        assert conn.execute("SHOW statement_timeout").fetchone() == {"statement_timeout": "10min"}


def test_a_command_gives_up_on_a_server_that_stopped_answering(
    cli: Any, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # TCP still acknowledged (a hung server, a proxy in front of a dead one): `qconsole stats` waited for ever
    from qconsole import cli as cli_module
    from tests.worker_core.helpers import FreezingProxy, Held

    proxy = FreezingProxy.before(dsn, hang_ups=True)
    held = Held(dsn)
    check = cli_module._check_schema

    def then_freeze(*args: Any) -> None:
        check(*args)
        proxy.frozen.set()

    monkeypatch.setattr(cli_module, "_check_schema", then_freeze)
    try:
        out = cli("--statement-timeout", "200ms", "stats", "--dsn", proxy.dsn, code=3).output
        assert "ran past 10.4 s in all" in out and "check before running it again" in out
        proxy.frozen.clear()  # the server hears of the connection's end once the network passes it again
        held.assert_released()
    finally:
        proxy.frozen.clear()
        proxy.close()


def test_job_says_who_holds_its_lock_key_and_the_state_of_its_worker(cli: Any, conn: db.Conn) -> None:
    # `qconsole job ID` of a job waiting on its lock_key said nothing of who held it (its "lock" key is the
    # lease the job holds itself: null), nor that the worker holding a running job's lease was lost
    holder = cli("enqueue", "t.ok", "--lock-key", "rep:1").stdout.strip()
    waiter = cli("enqueue", "t.ok", "--lock-key", "rep:1").stdout.strip()
    conn.execute(
        "INSERT INTO workers (id, host, pid, concurrency, last_heartbeat_at) VALUES ('vm:1:a', 'vm', 1, 4,"
        " now() - interval '2 minutes')"
    )
    conn.execute(
        "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = 'vm:1:a',"
        " locked_until = now() - interval '14 seconds' WHERE id = %s",
        (holder,),
    )
    conn.execute(
        "INSERT INTO resource_locks (lock_key, token, job_id, expires_at)"
        " VALUES ('rep:1', 'tok', %s, now() + interval '5 minutes')",
        (holder,),
    )
    out = json.loads(cli("job", waiter, "--json").stdout)
    assert out["lock"] is None and out["lease_holder"] is None and out["suspect"] is False
    assert {k: out["lock_holder"][k] for k in ("lock_key", "held_by", "job_id", "job_type", "job_state")} == {
        "lock_key": "rep:1", "held_by": "another_job", "job_id": holder, "job_type": "t.ok", "job_state": "running",
    }  # fmt: skip
    assert 290 < out["lock_holder"]["expires_in_seconds"] <= 300
    text = " ".join(cli("job", waiter).stdout.split())
    assert f"lock rep:1 held by job {holder} (t.ok, running) until" in text, text
    mine = json.loads(cli("job", holder, "--json").stdout)
    assert mine["lock"]["job_id"] == holder and mine["lock_holder"]["held_by"] == "this_job"
    assert mine["lease_holder"]["worker_id"] == "vm:1:a" and mine["lease_holder"]["state"] == "lost"
    assert mine["lease_holder"]["expired_lease_next"] == "run_alone"
    text = " ".join(cli("job", holder).stdout.split())
    assert "lease holder vm:1:a: LOST since " in text and "(last heartbeat 2m0" in text, text
    assert "only an idle worker reclaims it, and runs it alone as a suspect (claim_solo: it may be" in text, text


def test_stats_shows_the_jobs_queued_for_later(cli: Any) -> None:
    # the console's overview splits the queued jobs due now from those scheduled later; `qconsole stats` showed
    # only their sum: a job due in 30 days read as one waiting now
    cli("enqueue", "t.ok")
    for _ in range(2):
        cli("enqueue", "t.ok", "--delay", "3600")
    (row,) = [t for t in json.loads(cli("stats", "--json").stdout)["types"] if t["job_type"] == "t.ok"]
    assert (row["queued"], row["queued_later"], row["queued_due"], row["waiting"]) == (3, 2, 1, 3)
    lines = cli("stats").stdout.splitlines()
    header = next(line.split() for line in lines if line.split()[:2] == ["queue", "type"])
    cells = next(line.split() for line in lines if "t.ok" in line.split())
    assert header[2:4] == ["queued", "later"]
    assert cells[2:4] == ["3", "2"]


@pytest.mark.parametrize("how", ["behind-a-lock", "not-migrated", "unreachable", "port-taken"])
def test_a_command_that_fails_leaves_no_connection_or_file_open(
    cli: Any, dsn: str, empty_dsn: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each command's error path (its statement timeout, a schema missing, no server, a port it cannot serve on),
    # run in this process: no descriptor, session or thread of it is left once it exited
    from tests.worker_core.helpers import Held

    worker = ("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--poll-interval", "0.1")
    locker = db.connect(dsn)
    taken = socket.create_server(("127.0.0.1", 0))
    port = str(taken.getsockname()[1])
    try:
        if how == "behind-a-lock":
            locker.execute("LOCK TABLE job_queue IN ACCESS EXCLUSIVE MODE")
        target = {"not-migrated": empty_dsn, "unreachable": f"postgresql://postgres@127.0.0.1:{_closed_port()}/x"}
        monkeypatch.setenv("QCONSOLE_DSN", target.get(how, dsn))
        held = Held(empty_dsn if how == "not-migrated" else dsn)
        if how == "port-taken":
            cli(*worker, "--metrics-port", port, code=2)
            assert "Address already in use" in cli("metrics", "--port", port, code=2).output
        else:
            commands = [("stats",), ("jobs", "--json"), ("kill", str(uuid.uuid4())), ("enqueue", "t.ok")]
            # (a worker behind the lock runs, and waits: its claims and beats are tried again until it goes)
            for args in [*commands, *([worker] if how != "behind-a-lock" else [])]:
                cli("--statement-timeout", "300ms", *args, code=3)
        held.assert_released()
    finally:
        taken.close()
        locker.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
