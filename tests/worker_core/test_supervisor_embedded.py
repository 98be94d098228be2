"""`qconsole worker --processes N` over the embedded PostgreSQL whose postmaster is killed (kill -9, the OOM
killer): the server is started again, as under a single `qconsole worker`.

Under --processes the supervisor is the only process attached to the server (start_embedded): its worker
processes get its URI as their DSN, and revive_if_down leaves a URI it was only given alone. The supervisor
opened no connection while its children lived, so nothing started the server again: both workers logged
`heartbeat failed: ... Connection refused` every beat, for ever (until the supervisor's own stop connected).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from tests.worker_core.test_embedded import (  # noqa: F401 - fixtures
    ROOT,
    _env,
    kill_postmaster,
    pgdata,
    postmaster,
    procs,
)

#: the CLI in this process after making it a child subreaper, as a container's PID 1 is: the killed postmaster
#: (pg_ctl's daemon, reparented to it) is a zombie until it reaps it, and postgres will not start beside it
AS_SUBREAPER = (
    "import ctypes, runpy, sys\n"
    "assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0\n"  # PR_SET_CHILD_SUBREAPER
    "sys.argv[0] = 'qconsole'\n"
    "runpy.run_module('qconsole', run_name='__main__')\n"
)


def _uri(data: Path) -> str:
    return f"postgresql://postgres:@/postgres?host={data}"


def _live_beats(data: Path) -> int:
    """Workers whose row was beaten in the last 2 s (0 when the server is not there)."""
    try:
        with psycopg.connect(_uri(data), connect_timeout=2) as c:
            row = c.execute(
                "SELECT count(*) FROM workers WHERE stopped_at IS NULL"
                " AND last_heartbeat_at > now() - interval '2 seconds'"
            ).fetchone()
            return int(row[0]) if row else 0
    except psycopg.Error:
        return 0


@pytest.mark.parametrize("parent", ["init", "subreaper"])
def test_a_killed_embedded_server_is_started_again_under_worker_processes(
    pgdata: Path,  # noqa: F811
    procs: list[subprocess.Popen[str]],  # noqa: F811
    tmp_path: Path,
    parent: str,
) -> None:
    env = dict(_env(), QCONSOLE_PGDATA=str(pgdata), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "qconsole"] if parent == "init" else [sys.executable, "-c", AS_SUBREAPER]
    subprocess.run([*cmd, "migrate"], env=env, cwd=ROOT, check=True, capture_output=True, timeout=120)
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        supervisor = subprocess.Popen(
            [*cmd, "worker", "--tasks", "tests.worker_core.tasks", "--processes", "2", "--heartbeat", "0.5"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    procs.append(supervisor)
    try:
        deadline = time.monotonic() + 60
        while _live_beats(pgdata) < 2:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        if parent == "subreaper":
            crashed = postmaster(pgdata)
            assert crashed is not None and crashed.ppid() == supervisor.pid  # pg_ctl's daemon, reparented
            crashed.kill()  # a zombie until the supervisor reaps it: kill_postmaster would reap it for it
        else:
            kill_postmaster(pgdata)
        # the first process attached whose connection fails starts it again, at most every 5 s: 30 s is generous
        deadline = time.monotonic() + 30
        while not (postmaster(pgdata) is not None and _live_beats(pgdata) >= 2):
            if time.monotonic() > deadline:
                tail = "\n".join(log.read_text().splitlines()[-8:])
                raise AssertionError(
                    "30 s after its postmaster was killed the embedded server is still down under"
                    f" `qconsole worker --processes 2` (postmaster: {postmaster(pgdata)}); the log ends:\n{tail}"
                )
            time.sleep(0.5)
        os.kill(supervisor.pid, signal.SIGTERM)
        assert supervisor.wait(60) == 0, log.read_text()[-3000:]
        assert postmaster(pgdata) is None  # the last process attached stopped the server it started again
    finally:
        if supervisor.poll() is None:
            os.kill(supervisor.pid, signal.SIGTERM)
            try:
                supervisor.wait(60)
            except subprocess.TimeoutExpired:
                supervisor.kill()
