"""Worker processes started from the console: ``python -m qconsole worker --tasks ... --queue ...``.

Each one is a child process whose output (stdout and stderr) goes to a ring buffer the console shows
and to a log file. Nothing here blocks the UI: starting is a ``Popen``, stopping sends STOP_SIGNAL and
returns, and a reader thread per process notices when it ended. A crash (a non-zero exit the console did
not ask for) is reported through ``on_exit`` and, with ``restart``, the worker is started again with
backoff. :meth:`EmbeddedWorkers.stop_all` ends them all when the console quits (and at interpreter
exit, as a last resort).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime as dt
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

import platformdirs
import psycopg

from qconsole.widgets.fmt import printable
from worker_core import db
from worker_core.signals import SUPERVISOR_STOP
from worker_core.supervisor import end_dead_worker
from worker_core.worker import WorkerConfig

OUTPUT_LINES = 2000
#: what a worker's stop may take beyond its shutdown grace and cancel grace: the worker waits cancel_grace
#: + 3 s for a handler that does not stop, then joins its threads and writes its final beat
STOP_MARGIN = 8.0
#: what the console stops its workers with: a graceful stop that never counts as a second signal (as a
#: supervisor's, see worker_core.signals); a SIGTERM after a first one released the running jobs at once
STOP_SIGNAL = SUPERVISOR_STOP
#: what ``qconsole worker`` exits with when it refuses its arguments (a task module it cannot import)
USAGE_ERROR = 2
#: and when it refuses to run on its database before it starts (a read-only server, a replica; a role that
#: may not write the queue's tables): started again, it refused again, every 30 s for ever
REFUSED = 1
#: workers that ended for good (stopped, or crashed and not restarted) whose records (status, the last
#: lines of their output) the console keeps; older ones are forgotten as new workers start
KEEP_ENDED = 20


@dataclass
class EmbeddedWorker:
    """One embedded worker (across its restarts)."""

    number: int
    tasks: tuple[str, ...]
    queues: tuple[str, ...]
    concurrency: int
    restart: bool = True
    host: str = field(default_factory=socket.gethostname)
    log_path: Path | None = None
    pid: int | None = None
    started_at: dt.datetime | None = None
    exit_code: int | None = None
    restarts: int = 0
    crashes: int = 0
    stopping: bool = False
    #: crashes in a row, each within 30 s of its start (drives the restart backoff)
    streak: int = 0
    spawned_at: float = 0.0
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES))
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.exit_code is None

    @property
    def restart_pending(self) -> bool:
        """Crashed, and to be started again after its backoff (unless stopped meanwhile)."""
        return not self.running and self.exit_code not in (None, 0) and self.restart and not self.stopping

    @property
    def status(self) -> str:
        if self.running:
            return "stopping" if self.stopping else "running"
        if self.exit_code is None:
            return "starting"
        if self.stopping or self.exit_code == 0:
            return f"stopped (exit {self.exit_code})"
        if self.restart:
            return f"crashed (exit {self.exit_code}), restarting"
        return f"crashed (exit {self.exit_code})"

    def tail(self, n: int = 200) -> list[str]:
        return list(self.output)[-n:]


def default_log_dir() -> Path | None:
    """The user's own log directory, or None where there is none (no HOME, and a uid without a passwd
    entry, as in a container): the workers' output is then shown only, never written."""
    try:
        return platformdirs.user_log_path("qconsole") / "workers"
    except RuntimeError:
        return None


def open_private_log(path: Path) -> IO[str]:
    """``path`` opened to append, readable by this user only, in a directory of this user's that no one
    else can write to; never through a symbolic link. Raises OSError (with why) otherwise."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{folder} is not a directory of this user's")
    if st.st_mode & 0o077:
        os.chmod(folder, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "a", encoding="utf-8")


def _read_status(fd: int) -> list[str]:
    """What a worker that exited wrote to its status pipe (see `qconsole worker --status-fd`), line by line;
    the pipe is closed. Never blocks: a process it started may hold the pipe still."""
    data = b""
    try:
        with contextlib.suppress(OSError):  # BlockingIOError: nothing (more) in it
            while chunk := os.read(fd, 4096):
                data += chunk
    finally:
        os.close(fd)
    return data.decode("ascii", "replace").split()


class WorkerLauncher(Protocol):
    """What the console needs to start, stop and watch embedded workers (tests pass a fake)."""

    def start(
        self, tasks: Sequence[str], queues: Sequence[str] = (), concurrency: int = 4, restart: bool = True
    ) -> EmbeddedWorker: ...

    def stop(self, number: int) -> None: ...

    def stop_all(self, timeout: float | None = None) -> None: ...

    def workers(self) -> list[EmbeddedWorker]: ...

    def set_on_exit(self, callback: Callable[[EmbeddedWorker, bool], None] | None) -> None: ...


class EmbeddedWorkers:
    """Starts, restarts and stops worker subprocesses against one database."""

    def __init__(
        self,
        dsn: str,
        *,
        command: Sequence[str] | None = None,
        log_dir: Path | None = None,
        shutdown_grace: float = 5.0,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.dsn = dsn
        self.command = list(command or [sys.executable, "-m", "qconsole", "worker"])
        # the user's own state directory, never a name in /tmp another local user could make first (and
        # point its files elsewhere) or read: the workers' output holds job data (errors, keys, tenants)
        self.log_dir = log_dir if log_dir is not None else default_log_dir()
        self.shutdown_grace = shutdown_grace
        #: the workers' cancel grace (WorkerConfig's: `qconsole worker` has no flag for it)
        self.cancel_grace = WorkerConfig.cancel_grace
        self.extra_args = list(extra_args)
        self.env = env
        self._workers: dict[int, EmbeddedWorker] = {}
        self._lock = threading.Lock()
        self._next = 1
        self._closed = False
        self._on_exit: Callable[[EmbeddedWorker, bool], None] | None = None
        atexit.register(self.stop_all)

    @property
    def stop_timeout(self) -> float:
        """How long a worker may take to stop when asked, its running jobs finished or released: its
        shutdown grace, then its cancel grace for a handler that does not stop, and a margin. Killed sooner,
        its jobs' leases are left to run out and the jobs become suspects."""
        return self.shutdown_grace + self.cancel_grace + STOP_MARGIN

    def set_on_exit(self, callback: Callable[[EmbeddedWorker, bool], None] | None) -> None:
        """``callback(worker, restarting)`` runs on a reader thread when a process ends."""
        self._on_exit = callback

    def workers(self) -> list[EmbeddedWorker]:
        with self._lock:
            return list(self._workers.values())

    def get(self, number: int) -> EmbeddedWorker | None:
        with self._lock:
            return self._workers.get(number)

    # ---------------------------------------------------------------- starting

    def start(
        self, tasks: Sequence[str], queues: Sequence[str] = (), concurrency: int = 4, restart: bool = True
    ) -> EmbeddedWorker:
        tasks = tuple(t.strip() for t in tasks if t.strip())
        if not tasks:
            raise ValueError("give at least one task module")
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        with self._lock:
            if self._closed:
                raise RuntimeError("the console is shutting down")
            number = self._next
            self._next += 1
            w = EmbeddedWorker(
                number=number,
                tasks=tasks,
                queues=tuple(q.strip() for q in queues if q.strip()),
                concurrency=concurrency,
                restart=restart,
                log_path=self.log_dir / f"worker-{os.getpid()}-{number}.log" if self.log_dir else None,
            )
            self._workers[number] = w
            self._forget_ended()
        self._spawn(w)
        return w

    def _forget_ended(self) -> None:
        """All but the newest KEEP_ENDED workers that ended for good: a console that started and stopped
        workers all night kept every record, with up to OUTPUT_LINES lines of output each."""
        ended = [n for n, w in self._workers.items() if w.exit_code is not None and not w.running
                 and not w.restart_pending]  # fmt: skip
        for number in ended[: max(0, len(ended) - KEEP_ENDED)]:
            del self._workers[number]

    def argv(self, w: EmbeddedWorker) -> list[str]:
        args = [*self.command, "--tasks", ",".join(w.tasks), "--concurrency", str(w.concurrency)]
        for q in w.queues:
            args += ["--queue", q]
        # stdin is a pipe this console holds: closed however the console ends, it stops the worker
        args += ["--shutdown-grace", f"{self.shutdown_grace:g}", "--stop-on-stdin-eof", *self.extra_args]
        return args

    def _spawn(self, w: EmbeddedWorker) -> None:
        env = dict(self.env if self.env is not None else os.environ)
        # the DSN goes through the environment, never the command line (``ps`` shows that to everyone)
        env["QCONSOLE_DSN"] = self.dsn
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("NO_COLOR", None)
        # what the worker says of itself (see `qconsole worker --status-fd`): whether an exit code 2 is a
        # refused configuration, or a crash (a job's exit(2)) to restart from
        status_r, status_w = os.pipe()
        os.set_blocking(status_r, False)
        argv = [*self.argv(w), "--status-fd", str(status_w)]
        w.output.append(f"$ {' '.join(argv)}")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,  # never written to: see argv
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                close_fds=True,
                pass_fds=(status_w,),
                # a session of its own: a terminal's signals (SIGHUP when an SSH connection drops, a Ctrl-C)
                # are not its own, or the console's stop on top of one was its second signal (release now).
                # The console stops it itself on every way out, and its stdin pipe when the console dies
                start_new_session=True,
            )
        except OSError as e:
            os.close(status_r)
            w.output.append(f"could not start: {e}")
            w.exit_code = 127
            w.restart = False
            self._notify(w, False)
            return
        finally:
            os.close(status_w)
        with self._lock:
            w.proc, w.pid, w.exit_code = proc, proc.pid, None
            w.started_at = dt.datetime.now(dt.timezone.utc)
            w.spawned_at = time.monotonic()
            # a stop (x, or the console quitting) that came while it was being started, on a restart: the
            # new process is stopped at once, never left running with its stop forgotten
            unwanted = w.stopping or self._closed
        threading.Thread(
            target=self._read, args=(w, proc, status_r), name=f"embedded-worker-{w.number}", daemon=True
        ).start()
        if unwanted:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(STOP_SIGNAL)

    # ---------------------------------------------------------------- watching

    def _read(self, w: EmbeddedWorker, proc: subprocess.Popen[bytes], status_fd: int) -> None:
        log: IO[str] | None = None
        try:
            log = open_private_log(w.log_path) if w.log_path is not None else None
        except OSError as e:
            w.output.append(f"[its output is not written to {w.log_path}: {e}]")
            log = None
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                w.output.append(printable(line))  # what a handler prints never drives the terminal
                if log is not None:
                    try:
                        log.write(line + "\n")
                        log.flush()
                    except OSError as e:
                        # a full disk, a quota, a file size limit: said once, and the pipe is drained on, or
                        # the worker would block on its next line once it is full (holding its jobs)
                        w.output.append(f"[its output is no longer written to {w.log_path}: {e}]")
                        with contextlib.suppress(OSError):
                            log.close()
                        log = None
        finally:
            code = proc.wait()
            # its pipes: the console kept two descriptors of every worker it ever started (about 500 starts
            # reached the usual limit of 1,024, and then its own connections to the database failed)
            for pipe in (proc.stdout, proc.stdin):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            if log is not None:
                with contextlib.suppress(OSError):
                    log.close()
            status = _read_status(status_fd)
        # refused: before it ran (its arguments: a task module it cannot import; its database: read-only, a
        # role that may not write), or said so after. Not any exit 2 or 1: a job's exit(2) (or a C library's)
        # once it started is a crash, restarted as any other
        refused = code in (USAGE_ERROR, REFUSED) and (status[-1:] != ["started"])
        with self._lock:
            if w.proc is not proc:
                return
            w.exit_code = code
            crashed = code != 0 and not w.stopping
            if crashed:
                w.crashes += 1
                w.streak = w.streak + 1 if time.monotonic() - w.spawned_at < 30 else 1
            if crashed and refused:
                w.restart = False  # a task module that cannot be imported, say: starting again changes nothing
            restarting = crashed and w.restart and not self._closed
        w.output.append(f"[exited with code {code}{'' if not crashed else ': crashed'}]")
        if code != 0:
            self._end_leases(w, proc.pid)
        if crashed and refused:
            w.output.append("[not restarted: the worker refused its configuration (see above)]")
        self._notify(w, restarting)
        if restarting:
            # back off when it keeps dying right after starting: 1s, 2s, 4s... up to 30s
            time.sleep(min(30.0, 2.0 ** min(w.streak - 1, 5)))
            with self._lock:
                go = not self._closed and not w.stopping and w.proc is proc
            if go:
                w.restarts += 1
                w.output.append(f"[restart {w.restarts}]")
                self._spawn(w)

    def _end_leases(self, w: EmbeddedWorker, pid: int) -> None:
        """A process that died (or was killed) without stopping: the jobs it held are reclaimed now, not when
        their leases run out, and its row in the workers screen says stopped instead of lost, as
        ``qconsole worker --processes`` does for its children. A clean exit released its jobs itself."""
        try:
            ended = end_dead_worker(self.dsn, process=(w.host, pid))
        except psycopg.Error as e:
            w.output.append(f"[could not end its leases: {printable(db.redact(str(e), self.dsn))}]")
            return
        if ended:
            w.output.append(f"[ended the leases of {len(ended)} jobs it held: any worker takes them now]")

    def _notify(self, w: EmbeddedWorker, restarting: bool) -> None:
        cb = self._on_exit
        if cb is not None:
            # the UI may be gone or going: then there is nobody to tell
            with contextlib.suppress(Exception):
                cb(w, restarting)

    # ---------------------------------------------------------------- stopping

    def stop(self, number: int) -> None:
        """Ask one worker to stop (it finishes or releases its jobs within its grace). Returns at once."""
        w = self.get(number)
        if w is None:
            raise KeyError(f"no embedded worker #{number}")
        self._ask_to_stop(w)

    def _ask_to_stop(self, w: EmbeddedWorker) -> None:
        """STOP_SIGNAL, once: a worker asked already (``x``, then ``q``) is stopping within its grace."""
        with self._lock:
            asked, w.stopping = w.stopping, True
        if not asked and w.running and w.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(STOP_SIGNAL)

    def stop_all(self, timeout: float | None = None) -> None:
        """Stop every worker (STOP_SIGNAL, unless asked already), wait up to ``timeout`` seconds (their
        :attr:`stop_timeout` unless told), then SIGKILL what is left. The leases of a worker killed or dead
        are ended before it returns: its reader thread, a daemon, may die with the interpreter first."""
        if timeout is None:
            timeout = self.stop_timeout
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
        live = {w.number for w in workers if w.running}
        for w in workers:
            self._ask_to_stop(w)
        deadline = time.monotonic() + timeout
        for w in workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.output.append(f"[did not stop within {timeout:g}s: killed]")
                w.proc.kill()
                w.proc.wait(5)
            with self._lock:
                # gone: say so now, not when its reader thread gets to the end of its output
                if w.exit_code is None and w.proc is not None and w.proc.returncode is not None:
                    w.exit_code = w.proc.returncode
            if w.number in live and w.proc.returncode not in (None, 0):
                # killed, or died during its stop: what it held is released now (its reader thread does it
                # too, and finds nothing left), not when its leases run out
                self._end_leases(w, w.proc.pid)
