"""Found by a first-time integrator: `enqueue --delay 90s` refused while the other flags take durations, and a
task module whose dependency is missing not named."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_cli import cli  # noqa: F401  (the fixture)
from worker_core import db


def test_enqueue_takes_durations_for_its_times(cli: Any, conn: db.Conn) -> None:  # noqa: F811
    # --retention-succeeded 24h, --statement-timeout 5s, --lock-wait 10m took durations; --delay 90s was
    # "Input should be a valid number"
    jid = cli("enqueue", "t.ok", "--delay", "90s", "--timeout", "2m", "--visibility-timeout", "5m").stdout.strip()
    [job] = json.loads(cli("jobs", "--json").stdout)
    assert job["id"] == jid and (job["timeout_seconds"], job["visibility_timeout_seconds"]) == (120, 300)
    row = conn.execute("SELECT scheduled_at - created_at AS d FROM job_queue WHERE id = %s", (jid,)).fetchone()
    assert 89 <= row["d"].total_seconds() <= 91
    out = cli("enqueue", "t.ok", "--delay", "soon", "--timeout", "0", code=2).output
    assert "--delay: 'soon' is not a duration like 90s" in out and "timeout_seconds must be > 0" in out, out
    assert "delay_seconds must not be negative" in cli("enqueue", "t.ok", "--delay", "-1", code=2).output


def test_a_task_module_whose_dependency_is_missing_is_named(
    cli: Any,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "cannot import task module: No module named 'stripe_sdk_missing'": which of the --tasks modules, unsaid
    (tmp_path / "qc_billing_tasks.py").write_text("import stripe_sdk_missing  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        out = cli("worker", "--tasks", "tests.worker_core.tasks,qc_billing_tasks", "--burst", code=2).output
    finally:
        sys.modules.pop("qc_billing_tasks", None)
    assert "cannot import task module 'qc_billing_tasks': No module named 'stripe_sdk_missing'" in out, out
