"""The three queues the bench drives, behind one shape: install, enqueue, count what is left, start workers.

Each system is driven the way its documentation says: qconsole through ``python -m qconsole worker``,
pgqueuer through ``pgqueuer.run`` as ``pgq run`` calls it (asyncpg driver), procrastinate through
``procrastinate worker``; producers use each library's batch enqueue. Handlers live in ``bench/peers/``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from bench.peers.common import EFFECTS_DDL

WORKLOADS = ("noop", "write")
ENQUEUE_BATCH = 1000


@dataclass(frozen=True)
class Config:
    """One way of running one system's workers."""

    system: str
    processes: int
    #: qconsole: slots per process; procrastinate: concurrency per process; pgqueuer: batch size
    width: int
    label: str

    @property
    def key(self) -> str:
        return f"{self.system}:{self.label}"


class System:
    name = ""
    #: the tables whose statistics ANALYZE refreshes after the enqueue
    tables: tuple[str, ...] = ()

    def setup(self, dsn: str) -> None:
        raise NotImplementedError

    def enqueue(self, dsn: str, workload: str, n: int) -> None:
        raise NotImplementedError

    def remaining_sql(self) -> str:
        raise NotImplementedError

    def any_left_sql(self) -> str:
        raise NotImplementedError

    def succeeded(self, conn: psycopg.Connection) -> int:
        raise NotImplementedError

    def window_sql(self) -> str:
        """(first job started, last job settled) as the database recorded them, in seconds since the epoch."""
        raise NotImplementedError

    def worker_commands(self, cfg: Config, workload: str) -> list[list[str]]:
        raise NotImplementedError

    def env(self, dsn: str) -> dict[str, str]:
        return {"QCBENCH_DSN": dsn}

    def analyze(self, conn: psycopg.Connection) -> None:
        for t in self.tables:
            conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(t)))


def _effects(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECTS_DDL)


# ---------------------------------------------------------------------------------------------- qconsole


class QConsole(System):
    name = "qconsole"
    tables = ("job_queue",)
    TASKS = "bench.peers.qconsole_tasks"

    def setup(self, dsn: str) -> None:
        from worker_core import db
        from worker_core.migrate import migrate

        with db.connect(dsn, application_name="qcbench") as conn:
            migrate(conn)
            conn.commit()
        _effects(dsn)

    def enqueue(self, dsn: str, workload: str, n: int) -> None:
        import bench.peers.qconsole_tasks  # noqa: F401 - registers the types and their defaults
        from worker_core import db, enqueue_many

        with db.connect(dsn, application_name="qcbench-producer") as conn:
            for start in range(0, n, ENQUEUE_BATCH):
                ids = range(start, min(n, start + ENQUEUE_BATCH))
                if workload == "write":
                    enqueue_many(conn, [("bench.write", {"i": i}, {"idempotency_key": f"k{i}"}) for i in ids])
                else:
                    enqueue_many(conn, [("bench.noop", {"i": i}) for i in ids])
                conn.commit()

    def remaining_sql(self) -> str:
        return "SELECT count(*) FROM job_queue WHERE state IN ('queued', 'running', 'retry_scheduled')"

    def any_left_sql(self) -> str:
        return "SELECT EXISTS (SELECT 1 FROM job_queue WHERE state IN ('queued', 'running', 'retry_scheduled'))"

    def succeeded(self, conn: psycopg.Connection) -> int:
        return conn.execute("SELECT count(*) FROM job_queue WHERE state = 'succeeded'").fetchone()[0]  # type: ignore[index]

    def window_sql(self) -> str:
        return "SELECT extract(epoch FROM min(started_at)), extract(epoch FROM max(finished_at)) FROM job_queue"

    def worker_commands(self, cfg: Config, workload: str) -> list[list[str]]:
        # one supervisor for --processes N, as an operator would run it
        return [
            [
                sys.executable,
                "-m",
                "qconsole",
                "worker",
                "--tasks",
                self.TASKS,
                "--processes",
                str(cfg.processes),
                "--concurrency",
                str(cfg.width),
                "--burst",
                "--log-level",
                "WARNING",
            ]
        ]

    def env(self, dsn: str) -> dict[str, str]:
        return {"QCONSOLE_DSN": dsn, "QCBENCH_DSN": dsn}


# ---------------------------------------------------------------------------------------------- pgqueuer


class PgQueuerSystem(System):
    name = "pgqueuer"
    tables = ("pgqueuer", "pgqueuer_log")

    async def _queries(self, dsn: str):  # type: ignore[no-untyped-def]
        import asyncpg
        from pgqueuer import Queries

        conn = await asyncpg.connect(dsn)
        return conn, Queries.from_asyncpg_connection(conn)

    def setup(self, dsn: str) -> None:
        async def go() -> None:
            conn, q = await self._queries(dsn)
            try:
                await q.install()
            finally:
                await conn.close()

        asyncio.run(go())
        _effects(dsn)

    def enqueue(self, dsn: str, workload: str, n: int) -> None:
        entrypoint = "write" if workload == "write" else "noop"

        async def go() -> None:
            conn, q = await self._queries(dsn)
            try:
                for start in range(0, n, ENQUEUE_BATCH):
                    ids = range(start, min(n, start + ENQUEUE_BATCH))
                    await q.enqueue([entrypoint] * len(ids), [str(i).encode() for i in ids], [0] * len(ids))
            finally:
                await conn.close()

        asyncio.run(go())

    def remaining_sql(self) -> str:
        return "SELECT count(*) FROM pgqueuer"

    def any_left_sql(self) -> str:
        return "SELECT EXISTS (SELECT 1 FROM pgqueuer)"

    def succeeded(self, conn: psycopg.Connection) -> int:
        return conn.execute("SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'").fetchone()[0]  # type: ignore[index]

    def window_sql(self) -> str:
        # completions are logged in batches: the last one's time is when the last job was settled
        return (
            "SELECT extract(epoch FROM min(created) FILTER (WHERE status = 'picked')),"
            " extract(epoch FROM max(created) FILTER (WHERE status = 'successful')) FROM pgqueuer_log"
        )

    def worker_commands(self, cfg: Config, workload: str) -> list[list[str]]:
        cmd = [
            sys.executable,
            "-m",
            "bench.peers.pgqueuer_worker",
            "--batch-size",
            str(cfg.width),
            "--mode",
            "drain",
        ]
        return [cmd for _ in range(cfg.processes)]


# ---------------------------------------------------------------------------------------------- procrastinate


class ProcrastinateSystem(System):
    name = "procrastinate"
    tables = ("procrastinate_jobs", "procrastinate_events")

    def _app(self, dsn: str):  # type: ignore[no-untyped-def]
        import procrastinate

        return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    def setup(self, dsn: str) -> None:
        app = self._app(dsn)

        async def go() -> None:
            async with app.open_async():
                await app.schema_manager.apply_schema_async()

        asyncio.run(go())
        _effects(dsn)

    def enqueue(self, dsn: str, workload: str, n: int) -> None:
        app = self._app(dsn)
        task = "write" if workload == "write" else "noop"

        async def go() -> None:
            async with app.open_async():
                deferrer = app.configure_task(task, allow_unknown=True)
                for start in range(0, n, ENQUEUE_BATCH):
                    await deferrer.batch_defer_async(*({"i": i} for i in range(start, min(n, start + ENQUEUE_BATCH))))

        asyncio.run(go())

    def remaining_sql(self) -> str:
        return "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"

    def any_left_sql(self) -> str:
        return "SELECT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status IN ('todo', 'doing'))"

    def succeeded(self, conn: psycopg.Connection) -> int:
        return conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'").fetchone()[0]  # type: ignore[index]

    def window_sql(self) -> str:
        return (
            "SELECT extract(epoch FROM min(at) FILTER (WHERE type = 'started')),"
            " extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')) FROM procrastinate_events"
        )

    def worker_commands(self, cfg: Config, workload: str) -> list[list[str]]:
        cmd = [
            sys.executable,
            "-m",
            "procrastinate",
            "--app",
            "bench.peers.procrastinate_app.app",
            "--log-level",
            "warning",
            "worker",
            "--concurrency",
            str(cfg.width),
            "--one-shot",
        ]
        return [cmd for _ in range(cfg.processes)]


SYSTEMS: dict[str, System] = {s.name: s for s in (QConsole(), PgQueuerSystem(), ProcrastinateSystem())}


def configs(qc_concurrency: int) -> Sequence[Config]:
    """What each round runs (the no-op workload runs every config; the write workload a subset)."""
    c = qc_concurrency
    return (
        Config("qconsole", 1, c, f"1 process x concurrency {c}"),
        Config("qconsole", 2, c, f"2 processes x concurrency {c}"),
        Config("pgqueuer", 1, 10, "default (batch 10)"),
        Config("pgqueuer", 1, 100, "tuned (batch 100)"),
        Config("pgqueuer", 2, 100, "2 processes x batch 100"),
        Config("procrastinate", 2, 8, "2 processes x concurrency 8"),
    )
