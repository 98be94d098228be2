"""What a Worker, or the fleet's metrics endpoint, leaves open when things go wrong: file descriptors, sessions
on the server and threads, counted before and after (helpers.Held), never a mock."""

from __future__ import annotations

from pathlib import Path

import pytest

import tests.worker_core.tasks  # noqa: F401
from tests.worker_core.helpers import Held, WorkerThread
from worker_core import policy


def test_a_worker_refused_at_its_start_leaves_no_thread_behind(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a policy file that does not load refuses the worker (qconsole worker: exit 2) as it publishes its types'
    # contracts; its slot threads had been started before, and stayed, each waiting for a job, the Worker
    # with them: an application that tried again kept four more threads each time
    bad = tmp_path / "qconsole.toml"
    bad.write_text("[defaults]\nmax_attempts = 'many'\n")
    monkeypatch.setenv("QCONSOLE_POLICY_FILE", str(bad))
    policy.set_current(None)
    held = Held(dsn)
    for _ in range(2):
        with pytest.raises(policy.PolicyError, match="max_attempts"):
            WorkerThread(dsn).start().join(30)
    held.assert_released()
