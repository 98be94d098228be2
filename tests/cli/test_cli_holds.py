"""`qconsole stats` says who paused a queue or held a type (limit 0), since when and why: what an engineer asks
before letting it go."""

from __future__ import annotations

import json
from typing import Any

from tests.cli.test_cli import cli  # noqa: F401  (the fixture)
from worker_core import db


def test_stats_says_who_paused_a_queue_and_held_a_type_and_why(cli: Any, conn: db.Conn) -> None:  # noqa: F811
    # it said "paused: billing" and nothing of a held type: both wait, and nobody knew whose call it was
    cli("enqueue", "t.ok", "--queue", "billing")
    cli("enqueue", "report.build", "--queue", "reports")
    cli("pause", "billing", "--reason", "INC-9 double charges")
    cli("limit", "report.build", "0", "--reason", "the warehouse is down")
    out = cli("stats").stdout
    [paused] = [line for line in out.splitlines() if line.startswith("paused:")]
    assert paused.startswith("paused: billing ") and " ago by " in paused, paused
    assert paused.endswith(": INC-9 double charges"), paused
    [held] = [line for line in out.splitlines() if line.startswith("held")]
    assert held.startswith("held (limit 0): report.build in every queue, by "), held
    assert held.endswith(": the warehouse is down"), held
    data = json.loads(cli("stats", "--json").stdout)
    [billing] = [q for q in data["queues"] if q["name"] == "billing"]
    assert (billing["paused"], billing["reason"]) == (True, "INC-9 double charges") and billing["changed_by"]
    [limit] = data["limits"]
    assert (limit["job_type"], limit["max_running"], limit["source"]) == ("report.build", 0, "operator")
    assert limit["reason"] == "the warehouse is down" and limit["set_by"]
