"""Scenario 4: the server's commit-rate ceiling, measured with pgbench in the same run.

- ``update``: one single-row UPDATE per transaction (pgbench_accounts, scale 1, random row);
- ``claim``: one job per transaction: a ``FOR UPDATE SKIP LOCKED`` claim of the oldest queued row and
  its completion, two statements in one transaction (what a queue that commits once per job does).

Both at 2 and 8 clients (``-j 2`` threads), simple protocol, ``-T`` seconds each.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg

from bench.harness import Server, log

UPDATE_SCRIPT = """\\set aid random(1, 100000)
UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;
"""

CLAIM_SCRIPT = """BEGIN;
WITH next AS (
    SELECT id FROM bench_jobs WHERE state = 'queued' ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED
)
UPDATE bench_jobs j SET state = 'running', started_at = now() FROM next WHERE j.id = next.id
RETURNING j.id AS job_id \\gset
UPDATE bench_jobs SET state = 'done', finished_at = now() WHERE id = :job_id;
END;
"""

CLAIM_SETUP = """
DROP TABLE IF EXISTS bench_jobs;
CREATE TABLE bench_jobs (
    id bigserial PRIMARY KEY,
    state text NOT NULL DEFAULT 'queued',
    payload jsonb NOT NULL DEFAULT '{}',
    started_at timestamptz,
    finished_at timestamptz
);
INSERT INTO bench_jobs (payload) SELECT '{}' FROM generate_series(1, %(rows)s);
CREATE INDEX bench_jobs_queued ON bench_jobs (id) WHERE state = 'queued';
VACUUM ANALYZE bench_jobs;
"""

TPS_RE = re.compile(r"tps = ([0-9.]+) \(without initial connection time\)")
SCENARIOS = ("update", "claim")
CLIENTS = (2, 8)


def available() -> str | None:
    return shutil.which("pgbench")


class PgBench:
    """One database for every pgbench figure of the run; ``measure`` is called once per round."""

    DB = "qcbench_pgbench"

    def __init__(self, server: Server, seconds: int) -> None:
        self.server = server
        self.seconds = seconds
        self.exe = available()
        self.dsn = server.create_db(self.DB)
        self.env = {**_base_env(), **server.libpq_env(self.DB)}
        self._run([self.exe or "pgbench", "-i", "-s", "1", "-q", "--no-vacuum"], check=True)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE pgbench_accounts")
        self.tmp = Path(tempfile.mkdtemp(prefix="qcbench-pgbench-"))
        (self.tmp / "update.sql").write_text(UPDATE_SCRIPT)
        (self.tmp / "claim.sql").write_text(CLAIM_SCRIPT)

    def _run(self, args: list[str], check: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, check=check, timeout=300)

    def measure(self, scenario: str, clients: int) -> float:
        if scenario == "claim":
            # enough queued rows that no client runs dry: the best rate seen so far, with a wide margin
            rows = max(50_000, 6_000 * self.seconds)
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                for stmt in CLAIM_SETUP.replace("%(rows)s", str(rows)).split(";"):
                    if stmt.strip():
                        conn.execute(stmt)  # type: ignore[call-overload]
        proc = self._run(
            [
                self.exe or "pgbench",
                "-n",
                "-c",
                str(clients),
                "-j",
                str(min(clients, 2)),
                "-T",
                str(self.seconds),
                "-f",
                str(self.tmp / f"{scenario}.sql"),
            ]
        )
        m = TPS_RE.search(proc.stdout)
        if proc.returncode != 0 or not m:
            raise RuntimeError(f"pgbench {scenario} -c {clients} failed: {proc.stdout[-500:]} {proc.stderr[-500:]}")
        tps = float(m.group(1))
        log(f"  pgbench {scenario} -c {clients}: {tps:,.0f} tx/s")
        return tps

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.server.drop_db(self.DB)


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}
