"""What every scenario shares: the server, fresh databases, child processes, percentiles, the machine."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import psutil
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DSN_ENV = "QCBENCH_DSN"
#: every database the bench makes starts with this; nothing else is ever dropped
DB_PREFIX = "qcbench_"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- numbers


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty sample."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, round(p / 100.0 * len(s) + 0.5) - 1))
    return s[k]


def median(values: Sequence[float]) -> float:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else float("nan")


# ---------------------------------------------------------------------------------------------- the server


@dataclass
class Server:
    """The PostgreSQL server every scenario of one run uses."""

    admin_dsn: str
    kind: str  # "external" or "embedded"
    version: str = ""
    settings: dict[str, str] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)

    @classmethod
    def connect(cls, dsn: str | None, allow_embedded: bool = True) -> Server:
        dsn = dsn or os.environ.get("QCONSOLE_BENCH_DSN") or DEFAULT_DSN
        try:
            with psycopg.connect(dsn, connect_timeout=3, autocommit=True):
                pass
            server = cls(dsn, "external")
        except psycopg.OperationalError as e:
            if not allow_embedded:
                raise
            log(f"no server at {redact(dsn)} ({str(e).strip().splitlines()[0]}): starting the embedded one")
            from worker_core.embedded import start_embedded

            pgdata = BENCH / ".pgdata"
            server = cls(start_embedded(pgdata), "embedded")
        server._describe()
        return server

    def _describe(self) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            self.version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            for name in (
                "synchronous_commit",
                "fsync",
                "shared_buffers",
                "max_connections",
                "wal_level",
                "autovacuum",
                "jit",
            ):
                self.settings[name] = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()[0]  # type: ignore[index]

    def dsn_for(self, dbname: str) -> str:
        """A postgresql:// URL (asyncpg takes nothing else) for ``dbname`` on this server."""
        params = {k: str(v) for k, v in conninfo_to_dict(self.admin_dsn).items() if v is not None}
        params.pop("dbname", None)
        user = quote(params.pop("user", ""), safe="")
        password = params.pop("password", None)
        host = params.pop("host", "")
        port = params.pop("port", "")
        auth = (f"{user}:{quote(password, safe='')}@" if password is not None else f"{user}@") if user else ""
        query = {}
        if host.startswith("/"):
            query["host"] = host
            host = ""
            if port:
                query["port"], port = port, ""
        query.update(params)
        netloc = f"{auth}{host}" + (f":{port}" if port else "")
        url = f"postgresql://{netloc}/{quote(dbname, safe='')}"
        return url + ("?" + urlencode(query) if query else "")

    def libpq_env(self, dbname: str) -> dict[str, str]:
        """PG* variables for pgbench and psql."""
        params = conninfo_to_dict(self.dsn_for(dbname))
        env = {}
        for key, var in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"), ("password", "PGPASSWORD")):
            if params.get(key):
                env[var] = str(params[key])
        env["PGDATABASE"] = dbname
        return env

    def create_db(self, name: str) -> str:
        assert name.startswith(DB_PREFIX), name
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            self._drop(conn, name)
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        if name not in self.created:
            self.created.append(name)
        return self.dsn_for(name)

    def drop_db(self, name: str) -> None:
        assert name.startswith(DB_PREFIX), name
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            self._drop(conn, name)
        if name in self.created:
            self.created.remove(name)

    @staticmethod
    def _drop(conn: psycopg.Connection[Any], name: str) -> None:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))

    def cleanup(self) -> None:
        for name in list(self.created):
            with contextlib.suppress(psycopg.Error):
                self.drop_db(name)

    @contextlib.contextmanager
    def fresh_db(self, name: str, keep: bool = False) -> Iterator[str]:
        dsn = self.create_db(name)
        try:
            yield dsn
        finally:
            if not keep:
                self.drop_db(name)


def redact(dsn: str) -> str:
    return re.sub(r"(://[^:/@]*:)[^@]*(@)", r"\1***\2", dsn)


def db_counters(dsn: str, dbname: str) -> dict[str, int]:
    """The database's cumulative transaction and row counters (pg_stat_database)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, tup_fetched "
            "FROM pg_stat_database WHERE datname = %s",
            (dbname,),
        ).fetchone()
    keys = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_deleted", "tup_fetched")
    return dict(zip(keys, (int(v) for v in row), strict=True)) if row else {}


# ---------------------------------------------------------------------------------------------- processes


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


@dataclass
class Child:
    """A child process whose CPU time (its own and its waited-for descendants') is read when it exits."""

    proc: subprocess.Popen[bytes]
    name: str
    cpu_seconds: float | None = None
    returncode: int | None = None

    @classmethod
    def start(cls, args: Sequence[str], name: str, env: dict[str, str], logfile: Path) -> Child:
        out = open(logfile, "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(list(args), env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        out.close()
        return cls(proc, name)

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        pid, status, ru = os.wait4(self.proc.pid, os.WNOHANG)
        if pid == 0:
            return None
        self.cpu_seconds = ru.ru_utime + ru.ru_stime
        self.returncode = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.returncode
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll() is not None:
                return self.returncode
            time.sleep(0.02)
        return None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (the process tree's leader), then SIGKILL the whole tree after ``grace``."""
        if self.poll() is not None:
            return
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        if self.wait(grace) is None:
            for p in [psutil.Process(self.proc.pid), *tree]:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            self.wait(5)
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()


# ---------------------------------------------------------------------------------------------- the machine


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "pgbench": shutil.which("pgbench") or "",
        "git": code_version(),
    }


def code_version() -> str:
    """HEAD plus a digest of the uncommitted changes to the code under test: the code can change under a
    long run when others commit to this checkout, and the report says so."""
    import hashlib

    if os.environ.get("QCBENCH_CODE_VERSION"):
        return os.environ["QCBENCH_CODE_VERSION"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "diff", "HEAD", "--", "worker_core", "qconsole", "migrations"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (f"+{hashlib.sha1(diff).hexdigest()[:7]}" if diff else "")


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def wait_for_quiet(max_wait: float, threshold: float = 30.0) -> float:
    """Between measurements the bench itself is idle: wait (up to ``max_wait`` s) until the machine's CPU
    use, which is then other people's, drops under ``threshold`` percent. Returns the last reading."""
    deadline = time.monotonic() + max_wait
    busy = psutil.cpu_percent(interval=0.5)
    while busy >= threshold and time.monotonic() < deadline:
        busy = psutil.cpu_percent(interval=1.0)
    return busy


def busy_other_processes(own: set[int]) -> list[str]:
    """Other processes using the CPU right now: the figures are only as quiet as the machine."""
    procs = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            p.cpu_percent(None)
            procs.append(p)
    time.sleep(0.5)
    busy = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.pid in own:
                continue
            pct = p.cpu_percent(None)
            if pct >= 10:
                cmd = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])[:80]
                busy.append(f"{pct:.0f}% {cmd}")
    return busy
