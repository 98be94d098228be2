"""Helpers for worker tests: bounded polling and real Workers run in threads (never fixed sleeps)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from psycopg.conninfo import conninfo_to_dict, make_conninfo

import tests.worker_core.tasks  # noqa: F401 - producers get the t.* types' defaults (max_attempts, retry policy)
from worker_core import db
from worker_core.clock import SYSTEM_CLOCK, Clock
from worker_core.worker import Worker, WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("tests.worker_core.tasks",)
T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 15.0, interval: float = 0.02, what: str = "condition") -> T:
    """Poll ``cond`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def config(dsn: str, **overrides: Any) -> WorkerConfig:
    """A fast burst worker over the test handlers; any WorkerConfig field may be overridden."""
    base: dict[str, Any] = {
        "dsn": dsn,
        "task_modules": TASKS,
        "burst": True,
        "poll_interval": 0.1,
        "concurrency": 4,
        "heartbeat_interval": 0.5,
        "lock_contention_delay": 0.05,
    }
    base.update(overrides)
    return WorkerConfig(**base)


class WorkerThread:
    """A real Worker whose ``run()`` happens in a thread of the test process."""

    def __init__(self, dsn: str, clock: Clock = SYSTEM_CLOCK, **overrides: Any) -> None:
        self.worker = Worker(config(dsn, **overrides), clock=clock)
        self.result: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"test-worker-{self.worker.id}", daemon=True)

    def _main(self) -> None:
        try:
            self.result = self.worker.run()
        except BaseException as e:  # surfaced by join()
            self.error = e

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def join(self, timeout: float) -> int:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.worker.stop()
            self.thread.join(30)
            raise AssertionError(f"worker did not finish within {timeout}s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def stop(self, timeout: float = 30.0) -> int:
        self.worker.stop()
        return self.join(timeout)


def run_burst(dsn: str, timeout: float = 60.0, clock: Clock = SYSTEM_CLOCK, **overrides: Any) -> Worker:
    """Run a burst worker until nothing is ready or running (bounded); return it for its counters."""
    wt = WorkerThread(dsn, clock=clock, **overrides).start()
    assert wt.join(timeout) == 0
    return wt.worker


@contextmanager
def running_worker(dsn: str, clock: Clock = SYSTEM_CLOCK, **overrides: Any) -> Iterator[Worker]:
    """A non-burst worker running for the duration of the block, then stopped gracefully."""
    overrides.setdefault("burst", False)
    wt = WorkerThread(dsn, clock=clock, **overrides).start()
    try:
        yield wt.worker
    finally:
        wt.stop()


def run_worker_until(dsn: str, predicate: Callable[[], Any], timeout: float = 30.0, **overrides: Any) -> Worker:
    """Run a (non-burst) worker until ``predicate()`` is true, then stop it."""
    with running_worker(dsn, **overrides) as w:
        wait_for(predicate, timeout, what=getattr(predicate, "__name__", "predicate"))
    return w


class Held:
    """What this process holds, taken before an error path and compared after it: its open file descriptors
    (``/proc/self/fd``, where there is one), its sessions on ``dsn``'s database (``pg_stat_activity``, client
    backends only) and its threads. ``assert_released`` waits until none of them is above what it was."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.threads = set(threading.enumerate())
        self.before = self._now()

    @staticmethod
    def fds() -> list[str]:
        """This process's open file descriptors, each with what it is (empty where /proc cannot tell)."""
        folder = Path("/proc/self/fd")
        if not folder.is_dir():
            return []
        out = []
        for fd in os.listdir(folder):
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                out.append(f"{fd} -> {os.readlink(folder / fd)}")
        return out

    def sessions(self) -> list[str]:
        with db.connect(self.dsn, autocommit=True, application_name="tests-held") as c:
            rows = c.execute(
                "SELECT pid, application_name, state FROM pg_stat_activity WHERE datname = current_database()"
                " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            ).fetchall()
        return [f"{r['pid']} {r['application_name']} ({r['state']})" for r in rows]

    def _now(self) -> tuple[list[str], list[str]]:
        sessions = self.sessions()  # first: its connection is closed when the descriptors are listed
        return self.fds(), sessions

    def left(self) -> dict[str, Any]:
        """What is held beyond what was before, if anything."""
        fds, sessions = self._now()
        threads = [t.name for t in threading.enumerate() if t not in self.threads and t.is_alive()]
        left: dict[str, Any] = {}
        if len(fds) > len(self.before[0]):
            left["fds"] = sorted(set(fds) - set(self.before[0]))
        if len(sessions) > len(self.before[1]):
            left["sessions"] = sorted(set(sessions) - set(self.before[1]))
        if threads:
            left["threads"] = threads
        return left

    def assert_released(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while left := self.left():
            if time.monotonic() > deadline:
                raise AssertionError(f"still held {timeout:g} s after: {left}")
            time.sleep(0.1)


def job(dsn: str, job_id: uuid.UUID) -> dict[str, Any]:
    """The job's row, read on a fresh connection."""
    with db.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT * FROM job_queue WHERE id = %s", (job_id,)).fetchone()
    assert row is not None, f"no job {job_id}"
    return row


def state(dsn: str, job_id: uuid.UUID) -> str:
    return str(job(dsn, job_id)["state"])


def scalar(dsn: str, query: str, params: Any = None) -> Any:
    with db.connect(dsn, autocommit=True) as c:
        row = c.execute(query, params).fetchone()
    assert row is not None
    return next(iter(row.values()))


def ledger(dsn: str) -> list[dict[str, Any]]:
    with db.connect(dsn, autocommit=True) as c:
        return c.execute("SELECT job_id, item, attempt FROM ledger ORDER BY id").fetchall()


def metric(dsn: str, name: str, job_type: str | None = None) -> int:
    """The sum of one per-minute counter (what workers flushed), optionally for one job type."""
    with db.connect(dsn, autocommit=True) as c:
        row = c.execute(
            f"SELECT coalesce(sum({name}), 0) AS n FROM job_metrics_minute"  # noqa: S608 - a counter column
            " WHERE %(jt)s::text IS NULL OR job_type = %(jt)s",
            {"jt": job_type},
        ).fetchone()
    assert row is not None
    return int(row["n"])


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for var in ("QCONSOLE_DSN", "DATABASE_URL"):
        env.pop(var, None)
    return env


def spawn_python(code: str, *args: str, log: Path, new_session: bool = False) -> subprocess.Popen[bytes]:
    """``python -c code args...`` from the checkout; its output goes to ``log`` (a pipe could fill and block).
    ``new_session``: in a process group of its own, which a test may signal as a terminal's Ctrl-C does."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=str(ROOT),
            env=subprocess_env(),
            stdout=out,
            stderr=out,
            start_new_session=new_session,
        )


class FreezingProxy:
    """A TCP proxy in front of the server that can stop passing bytes while keeping both connections open:
    a server that stopped answering (hung, or behind a proxy in front of a dead one), which TCP keepalives
    never notice."""

    def __init__(self, host: str, port: int, hang_ups: bool = False) -> None:
        import socket

        self.target = (host, port)
        self.dsn = ""
        self.frozen = threading.Event()
        #: cut: every connection through it is closed, and new ones are refused, until restore()
        self.down = threading.Event()
        #: once: the connection that sends a statement with these bytes is closed when the server answers
        #: its transaction's COMMIT, before the answer reaches the client (committed, and not known to be)
        self.lose_commit_after: bytes | None = None
        self.commits_lost = 0
        #: seconds each chunk waits in each direction: a server that far away (2 x delay of round trip)
        self.delay = 0.0
        #: a connection's end is passed on, and its sockets closed then (see _pipe); off, as a hung host's
        self.hang_ups = hang_ups
        self._sockets: list[Any] = []
        self._sockets_lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down.is_set():
                client.close()
                continue
            host, port = self.target
            try:
                if host.startswith("/"):  # a socket directory (the embedded server)
                    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        server.connect(f"{host}/.s.PGSQL.{port}")
                    except OSError:
                        server.close()
                        raise
                else:
                    server = socket.create_connection(self.target)
            except OSError:
                # the server itself is down: this client is refused as it would be, and the proxy goes on
                # (this thread ended here, and every later client hung, unanswered, for ever)
                client.close()
                continue
            with self._sockets_lock:
                self._sockets += [client, server]
            pair: dict[str, Any] = {"marked": False, "ended": 0}
            for a, b, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, pair, up), daemon=True).start()

    def _pipe(self, src: Any, dst: Any, pair: dict[str, Any], up: bool) -> None:
        """One direction of a connection. With ``hang_ups``, its end (the sender closed) is passed on as a
        network would, and once both directions ended the proxy's two sockets are closed; without (as a hung
        host's network), the other side never hears of it, and the proxy keeps its two descriptors (and the
        server its session) until cut(): a test counting what an error path leaves open counted those."""
        try:
            while data := src.recv(65536):
                while self.frozen.is_set():
                    time.sleep(0.05)
                if self.delay:
                    time.sleep(self.delay)
                marker = self.lose_commit_after
                if marker is not None and up and marker in data:
                    pair["marked"] = True
                if pair["marked"] and not up and b"COMMIT\x00" in data:
                    # the server committed; its answer is lost with the connection
                    self.lose_commit_after, pair["marked"] = None, False
                    self.commits_lost += 1
                    for sock in (src, dst):
                        with contextlib.suppress(OSError):
                            sock.shutdown(2)  # SHUT_RDWR: close() alone, with a recv() blocked on it, sends nothing
                        sock.close()
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if self.hang_ups:
                self._ended(src, dst, pair)

    def _ended(self, src: Any, dst: Any, pair: dict[str, Any]) -> None:
        import socket

        while self.frozen.is_set() and not self.down.is_set():
            time.sleep(0.05)  # nothing passes a frozen network, its end neither
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._sockets_lock:
            pair["ended"] += 1
            both = pair["ended"] == 2
            if both:
                self._sockets = [x for x in self._sockets if x is not src and x is not dst]
        if both:
            src.close()
            dst.close()

    def cut(self) -> None:
        """The database goes away: the connections through the proxy break, new ones are refused."""
        import socket

        self.down.set()
        with self._sockets_lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        self.down.clear()

    def close(self) -> None:
        self.listener.close()

    @classmethod
    def before(cls, dsn: str, hang_ups: bool = False) -> FreezingProxy:
        """A proxy in front of ``dsn``'s server; its own DSN in ``dsn``."""
        params = conninfo_to_dict(dsn)
        proxy = cls(str(params.get("host") or "127.0.0.1"), int(str(params.get("port") or 5432)), hang_ups)
        proxy.dsn = make_conninfo(dsn, host="127.0.0.1", port=proxy.port)
        return proxy


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``fn()`` in a daemon thread: its result, or the exception it raised, lands in the list."""
    out: list[Any] = []

    def main() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=main, daemon=True)
    t.start()
    return t, out


def running_as(dsn: str, job_id: uuid.UUID, worker: str) -> None:
    with db.connect(dsn, autocommit=True) as c:
        c.execute(
            "UPDATE job_queue SET state = 'running', attempts = 1, locked_by = %s,"
            " locked_until = now() + interval '1 hour' WHERE id = %s",
            (worker, job_id),
        )
        c.execute(
            "INSERT INTO workers (id, host, pid, concurrency, in_flight, started_at, last_heartbeat_at)"
            " VALUES (%s, 'h', 1, 1, 1, now(), now())",
            (worker,),
        )
