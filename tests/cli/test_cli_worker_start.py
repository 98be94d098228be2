"""``qconsole worker`` checks the database itself, with its own messages and exit codes, before any process
starts: worker_core does not check it again (Worker.run and the supervisor would, each, otherwise)."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from qconsole.cli import app

WORKER = ("worker", "--tasks", "tests.worker_core.tasks", "--burst", "--poll-interval", "0.1")


@pytest.mark.parametrize("processes", ["1", "2"])
def test_the_worker_command_checks_the_database_once(dsn: str, monkeypatch: pytest.MonkeyPatch, processes: str) -> None:
    import worker_core.supervisor
    import worker_core.worker

    calls: list[Any] = []
    monkeypatch.setattr(worker_core.worker, "check_worker_database", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(worker_core.supervisor, "check_worker_database", lambda *a, **k: calls.append(a))
    monkeypatch.setenv("QCONSOLE_DSN", dsn)
    result = CliRunner().invoke(app, [*WORKER, "--processes", processes])
    assert result.exit_code == 0, result.output
    assert calls == []


def test_the_worker_command_still_refuses_an_unmigrated_database(
    empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QCONSOLE_DSN", empty_dsn)
    result = CliRunner().invoke(app, list(WORKER))
    assert result.exit_code == 3, result.output
    assert "the database needs migrations" in result.output


def test_a_heartbeat_that_cannot_keep_a_worker_live_is_bad_input(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QCONSOLE_DSN", dsn)
    result = CliRunner().invoke(app, [*WORKER, "--heartbeat", "61"])
    assert result.exit_code == 2, result.output
    assert "--heartbeat 61: 60 s at most" in result.output
    assert CliRunner().invoke(app, [*WORKER, "--heartbeat", "60"]).exit_code == 0
